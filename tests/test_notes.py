"""Every `[Note: X]` a comment or docstring points to has its block: a line that begins with
`[Note: X]` (after `#` or in a docstring) and goes on to say it, there or on the next lines."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTE = re.compile(r"\[Note: ([^\]]+)\]")


def _sources() -> list[pathlib.Path]:
    found = [ROOT / "README.md", ROOT / "__init__.py"]
    for folder in ("offload", "runtime", "hf", "tools", "docs"):
        found += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md")]
    return found


def _blocks_and_references() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    blocks: dict[str, list[str]] = {}
    references: dict[str, list[str]] = {}
    for path in _sources():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for m in NOTE.finditer(line):
                before, after = line[: m.start()].strip(), line[m.end():]
                opens = before in ("", "#", '"""') and not re.match(r"\s*(in\b|\)|,|\.|;|:)", after)
                where = f"{path.relative_to(ROOT)}:{number}"
                (blocks if opens else references).setdefault(m.group(1), []).append(where)
    return blocks, references


def test_every_note_referred_to_has_its_block_and_one_only():
    blocks, references = _blocks_and_references()
    assert blocks, "the scan finds the notes"
    missing = {name: where for name, where in references.items() if name not in blocks}
    assert not missing, f"references to a [Note: ...] with no block: {missing}"
    twice = {name: where for name, where in blocks.items() if len(where) > 1}
    assert not twice, f"a [Note: ...] block written twice: {twice}"
