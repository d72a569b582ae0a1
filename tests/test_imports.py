"""The package's modules import one another without a cycle, counting the imports made inside functions."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "finetune"


def imports_of(path: Path, modules: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module == "finetune":
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("finetune."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("finetune.")}
    return found - {path.stem}


def cycle_from(start: str, graph: dict) -> list[str] | None:
    """A path start -> ... -> start through `graph`, or None."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in sorted(graph[node]):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def test_no_module_imports_itself_back():
    """__init__ is left out: it gathers the public API, and modules read its __version__."""
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    graph = {name: imports_of(PACKAGE / f"{name}.py", modules) & modules for name in modules}
    cycles = [c for c in (cycle_from(name, graph) for name in sorted(modules)) if c]
    assert not cycles, " ; ".join(" -> ".join(c) for c in cycles)


def test_the_check_finds_a_cycle():
    assert cycle_from("a", {"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle_from("a", {"a": {"b"}, "b": set()}) is None
