"""The layers point down only (tools -> runtime -> offload), and no module imports itself back
through others, counting imports made only for type checking."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAYERS = {"offload": 0, "runtime": 1, "tools": 2}


def imports() -> dict[str, set[str]]:
    """Each package module's imports of other package modules, by dotted name under outcore."""
    graph: dict[str, set[str]] = {}
    for package in LAYERS:
        for path in sorted((ROOT / package).glob("*.py")):
            name = f"outcore.{package}.{path.stem}"
            found = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("outcore."):
                    found.add(node.module)
                elif isinstance(node, ast.Import):
                    found |= {a.name for a in node.names if a.name.startswith("outcore.")}
            graph[name] = {m for m in found if m.count(".") == 2}  # module-level names, not packages
    return graph


def test_no_package_imports_a_higher_layer():
    wrong = [(m, dep) for m, deps in imports().items() for dep in deps
             if LAYERS[dep.split(".")[1]] > LAYERS[m.split(".")[1]]]
    assert not wrong, wrong


def test_there_is_no_import_circle():
    graph = imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for dep in sorted(graph.get(m, ())):
            assert state.get(dep) != 1, " -> ".join([*path[path.index(dep):], dep]) if dep in path else dep
            if dep not in state:
                visit(dep, [*path, dep])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
