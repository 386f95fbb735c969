"""The layers point down only (tools -> hf -> runtime -> offload), no module imports itself back
through others, and the engine (runtime/, offload/) imports no Hugging Face library, counting
imports made only for type checking or inside a function."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAYERS = {"offload": 0, "runtime": 1, "hf": 2, "tools": 3}
HUGGING_FACE = ("transformers", "peft", "tokenizers", "trl", "datasets", "accelerate")


def imports() -> dict[str, set[str]]:
    """Each package module's imports of other package modules, by dotted name under outcore."""
    found_by: dict[str, set[str]] = {}
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(("outcore", *(parts[:-1] if parts[-1] == "__init__" else parts)))
            found = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("outcore."):
                    found.add(node.module)
                elif isinstance(node, ast.Import):
                    found |= {a.name for a in node.names if a.name.startswith("outcore.")}
            found_by[name] = found
    modules = {name for name in found_by if name.count(".") >= 2}  # a layer's package itself is the public API
    return {name: {m for m in found if m in modules and m != name} for name, found in found_by.items()}


def test_no_package_imports_a_higher_layer():
    wrong = [(m, dep) for m, deps in imports().items() for dep in deps
             if LAYERS[dep.split(".")[1]] > LAYERS[m.split(".")[1]]]
    assert not wrong, wrong


def test_there_is_no_import_circle():
    graph = imports()
    # the graph is the package's real one (an empty one would pass)
    assert len(graph) > 80 and "outcore.offload.mover" in graph.get("outcore.offload.store", ())
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


def _all_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """Every module `path` imports, wherever the statement stands (TYPE_CHECKING, a function body)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, node.module)]
    return out


@pytest.mark.parametrize("package", ["runtime", "offload"])
def test_the_engine_imports_no_hugging_face_library(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    wrong = [f"{p.name}:{line} imports {name}" for p in files for line, name in _all_imports(p)
             if name.split(".")[0] in HUGGING_FACE]
    assert wrong == []


def test_the_import_check_sees_imports_inside_functions_and_under_type_checking(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from peft import LoraConfig\n"
                      "def f():\n    import transformers.models\n")
    assert [name for _, name in _all_imports(module)] == ["typing", "peft", "transformers.models"]
