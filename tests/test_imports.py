"""How the package is laid out, checked: no import cycle, and a test file for each module.

Imports are counted as `imports_of` reads them, those made inside functions included.

Tests mirror the package: finetune/X.py has tests/test_X.py, so a change finds its tests by name. A module
without one is in NO_TEST_FILE with the reason; a test file that is no module's checks the package as a whole
(most run the CLI or API end to end) and is in END_TO_END.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "finetune"
TESTS = Path(__file__).resolve().parent
MODULES = {p.stem for p in PACKAGE.glob("*.py")}

# Modules without a tests/test_<module>.py, each with the reason.
NO_TEST_FILE = {
    "__init__": "the Python API: test_api.py runs it as a notebook does",
    "__main__": "one line, `python -m finetune`, that runs cli.main",
    "errors": "the exception classes, with no logic: every refusal in the suite raises one",
    "adapter": "adapter.json's checks refuse edited runs end to end: test_bad_inputs.py and test_export.py",
    "peer": "the bench's `hf` row (transformers + PEFT): no test runs it yet",
}
END_TO_END = {  # test files of the whole package rather than one module; most run the CLI or API end to end
    "test_api", "test_bad_inputs", "test_backends_agree", "test_docs", "test_imports", "test_install",
    "test_notebook", "test_recipes",
}  # fmt: skip


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


def test_every_module_has_its_test_file():
    missing = sorted(name for name in MODULES - set(NO_TEST_FILE) if not (TESTS / f"test_{name}.py").exists())
    assert not missing, f"add tests/test_<module>.py, or say in NO_TEST_FILE why not: {missing}"
    stale = sorted(name for name in NO_TEST_FILE if name not in MODULES or (TESTS / f"test_{name}.py").exists())
    assert not stale, f"take these out of NO_TEST_FILE: {stale}"


def test_every_test_file_is_a_module_s_or_end_to_end():
    files = {p.stem for p in TESTS.glob("test_*.py")}
    strays = sorted(name for name in files - END_TO_END if name.removeprefix("test_") not in MODULES)
    assert not strays, f"name each after the module it tests, or add it to END_TO_END: {strays}"
    assert END_TO_END <= files, sorted(END_TO_END - files)
