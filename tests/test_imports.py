"""How the package is laid out, checked: no import cycle, a test file for each module, and layers that import down.

The package is one flat folder; its layers are the map below instead of folders. Imports are counted as
`imports_of` reads them, those made inside functions included. A module may import from its own layer or from
one below it. The layers, top to bottom:

- front doors: cli, the Python API (__init__) and __main__.
- tools: the commands that inspect or launch without training: plan, bench and its peer, `finetune data`
  (datacheck, which builds a tokenizer through model) and `finetune vertex-spec` (vertex, which loads the
  recipe through config to check it).
- run: what a run does and leaves behind: train, loop, callbacks, events, checkpoint, outputs, prepare,
  scoring, runs, and the adapter and exports written from it.
- config: the typed settings. It checks names against presets and templates and takes backend's default batch
  sizes, so it sits above model and data, and below everything that reads a Config.
- model: presets, archs and families, building (model, quantized, remat, attention), the objective, and the
  layouts of weights over devices. distribution is here, not in platform: it lays the model's variables over
  the mesh with layouts' rules, and only run modules call it.
- data: records, templates, token ids, packing. model and data import nothing of each other; data is lower
  because a run reads it first.
- platform: backend, storage, platforms, quiet, errors, documents: the framework, the files, the machine and the
  documents read from outside, used by all.

An import that goes up is named in UPWARD with its reason, so that it is seen rather than folded into the map.

Tests mirror the package: finetune/X.py has tests/test_X.py, so a change finds its tests by name. A module
without one is in NO_TEST_FILE with the reason; a test file that is no module's checks the package as a whole
(most run the CLI or API end to end) and is in END_TO_END.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "finetune"
TESTS = Path(__file__).resolve().parent
MODULES = {p.stem for p in PACKAGE.glob("*.py")}

LAYERS = {  # top to bottom
    "front doors": {"cli", "__init__", "__main__"},
    "tools": {"plan", "bench", "peer", "datacheck", "vertex"},
    "run": {"train", "loop", "callbacks", "events", "checkpoint", "outputs", "prepare", "scoring", "runs", "export",
            "llamacpp", "adapter"},
    "config": {"config"},
    "model": {"model", "presets", "archs", "families", "quantized", "remat", "attention", "objective", "layouts",
              "distribution"},
    "data": {"data", "templates", "batching", "packing"},
    "platform": {"backend", "documents", "keras_compat", "storage", "platforms", "quiet", "errors", "version"},
}  # fmt: skip
UPWARD = {
    # --remat auto asks the plan whether the run fits the device without it (plan.remat_for): the plan's memory
    # model is a tool's, and the run borrows it. Moving that model below both would remove this.
    ("train", "plan"),
}

# Modules without a tests/test_<module>.py, each with the reason.
NO_TEST_FILE = {
    "__init__": "the Python API: test_api.py runs it as a notebook does",
    "__main__": "one line, `python -m finetune`, that runs cli.main",
    "errors": "the exception classes, with no logic: every refusal in the suite raises one",
    "version": "one constant: test_cli.py checks `finetune --version` prints it, and the install test installs it",
    "adapter": "adapter.json's checks refuse edited runs end to end: test_bad_inputs.py and test_export.py",
    "peer": "the bench's `hf` row (transformers + PEFT): no test runs it yet",
}
END_TO_END = {  # test files of the whole package rather than one module; most run the CLI or API end to end
    "test_api", "test_as_typed", "test_bad_inputs", "test_backends_agree", "test_docs", "test_imports", "test_install",
    "test_notebook", "test_properties", "test_recipes",
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


def upward_imports(graph: dict, level: dict) -> set[tuple[str, str]]:
    """(importer, imported) for each import of a module from a layer above the importer's (0 is the top)."""
    return {(name, imported) for name, found in graph.items() for imported in found if level[imported] < level[name]}


def test_every_module_is_in_one_layer():
    placed = [name for members in LAYERS.values() for name in members]
    assert len(placed) == len(set(placed)), sorted(name for name in placed if placed.count(name) > 1)
    assert set(placed) == MODULES, (
        f"not in LAYERS: {sorted(MODULES - set(placed))}; gone: {sorted(set(placed) - MODULES)}"
    )


def test_no_module_imports_from_a_layer_above_its_own():
    level = {name: rank for rank, members in enumerate(LAYERS.values()) for name in members}
    layer = {name: title for title, members in LAYERS.items() for name in members}
    graph = {name: imports_of(PACKAGE / f"{name}.py", MODULES) & MODULES for name in MODULES}
    found = upward_imports(graph, level)
    new = [f"{a} ({layer[a]}) imports {b} ({layer[b]})" for a, b in sorted(found - UPWARD)]
    assert not new, "; ".join(new)
    assert not UPWARD - found, f"no longer imported upward, so take them out of UPWARD: {sorted(UPWARD - found)}"


def test_the_check_finds_an_upward_import():
    level = {"run": 0, "loop": 0, "model": 1}
    assert upward_imports({"run": {"loop", "model"}, "loop": set(), "model": {"run"}}, level) == {("model", "run")}


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
