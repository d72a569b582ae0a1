"""How the package is laid out, checked: layer folders that import down, no import cycle, a test file for each module.

The package's folders are its layers (docs/architecture.md draws them). Imports are counted as `imports_of`
reads them, those made inside functions included. A module may import from its own layer or from one below it.
The layers, top to bottom:

- front doors (finetune/cli.py, finetune/__init__.py, __main__.py): the command line and the Python API.
- tools/: the commands that inspect or launch without training: bench and its peer, `finetune data`
  (datacheck) and `finetune vertex-spec` (vertex).
- exports/: the formats a finished run's adapter is written in (export, llamacpp, transformers_gguf, mmproj), and its upload with a model card
  (publish, card); they read a run through training/runs.
- training/: a run, from its resolved settings to its run directory: resolve, plan (the memory model that
  resolve and `finetune plan` share), train, loop, callbacks, events, checkpoint, outputs, prepare, scoring,
  runs, adapter.
- config (finetune/config.py): the typed settings. It checks names against presets and templates and takes
  backend's default batch sizes, so it sits above model and data, and below everything that reads a Config.
- model/: presets, archs and families, the builder (builder, quantized, remat, attention, experts), the objective, and
  the layouts of weights over devices (layouts, distribution).
- data/: records (formats), templates, token ids (batching), packing. model and data import nothing of each
  other; data is lower because a run reads it first.
- platform/: backend, storage, platforms, quiet, errors, version, documents and keras_compat: the framework,
  the files, the machine, the documents read from outside and every keras internal we touch, used by all.

Tests mirror the package: finetune/<layer>/X.py has tests/test_X.py, so a change finds its tests by name. A
module without one is in NO_TEST_FILE with the reason; a test file that is no module's checks the package as
a whole (most run the CLI or API end to end) and is in END_TO_END.
"""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "finetune"
TESTS = Path(__file__).resolve().parent
FRONT = {"cli", "__init__", "__main__"}
LAYERS = [
    "front doors",
    "tools",
    "exports",
    "training",
    "methods",
    "config",
    "model",
    "data",
    "platform",
]  # top to bottom


def layer_of(path: Path) -> str:
    """The layer of a module file: its folder, or for a file at the top, front doors or config."""
    relative = path.relative_to(PACKAGE)
    if len(relative.parts) == 1:
        return "config" if relative.stem == "config" else "front doors"
    return relative.parts[0]


# Every module, by name: the file's stem, unique across the folders (each has its own test file).
FILES = {p.stem: p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent == PACKAGE}
MODULES = set(FILES)

# Modules without a tests/test_<module>.py, each with the reason.
NO_TEST_FILE = {
    "__init__": "the Python API: test_api.py runs it as a notebook does",
    "__main__": "one line, `python -m finetune`, that runs cli.main",
    "errors": "the exception classes, with no logic: every refusal in the suite raises one",
    "version": "one constant: test_cli.py checks `finetune --version` prints it, and the install test installs it",
    "adapter": "adapter.json's checks refuse edited runs end to end: test_bad_inputs.py and test_export.py",
    "peer_grpo": "the bench's `hf` row under --method grpo (TRL's GRPOTrainer): test_bench.py runs it",
    "pair_batches": "the pairs' rows: test_preference.py checks them with the losses they feed",
    "method": "the base of every method: test_registry.py checks each method overrides what it leaves to them",
    "pair_view": "the view the preference losses train through: test_preference.py checks each loss by it",
    "reward": "the reward model and its GRPO reward: test_reward_model.py runs both end to end",
    "reward_view": "the view the reward model trains through: test_reward_model.py checks its loss against TRL's",
    "classify_view": "the view a classifier trains through: test_classify.py trains it on every backend",
    "rloo_view": "the view RLOO trains through: test_rloo_trl.py checks its loss against TRL's, test_rloo.py trains "
    "it on every backend",
    "chat": "the chat templates' renderer: test_chat_templates.py checks it against transformers' and trains on it",
}
END_TO_END = {  # test files of the whole package (or of the suite: test_suite) rather than one module; most run the
    # CLI or API end to end
    "test_api", "test_image_tokens", "test_as_typed", "test_bad_inputs", "test_backends_agree", "test_docs", "test_imports", "test_install",
    "test_notebook", "test_properties", "test_recipes", "test_evaluation", "test_preference_runs",
    "test_preference_trl", "test_method_matrix", "test_reward_model", "test_grpo_trl", "test_rloo_trl", "test_chat_templates",
    "test_compiled_step", "test_gpu_check", "test_suite", "test_device_reads", "test_pictured_pairs",
}  # fmt: skip


def imports_of(path: Path) -> set[str]:
    """The finetune modules `path` imports, by name."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "finetune":
            parts = node.module.split(".")
            if parts[-1] in MODULES:  # from finetune.training.train import run
                found.add(parts[-1])
            else:  # from finetune import config; from finetune.training import train, loop
                found |= {alias.name for alias in node.names if alias.name in MODULES}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[-1] for a in node.names if a.name.startswith("finetune.")}
    return (found & MODULES) - {path.stem}


def test_modules_are_named_once_across_the_folders():
    stems = [p.stem for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]
    assert len(stems) == len(set(stems)), sorted(s for s in stems if stems.count(s) > 1)


def test_every_folder_is_a_layer():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(LAYERS) - {"front doors", "config"}, folders


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
    """__init__ is left out: it gathers the public API, and no module imports it."""
    modules = MODULES - {"__init__"}
    graph = {name: imports_of(FILES[name]) & modules for name in modules}
    cycles = [c for c in (cycle_from(name, graph) for name in sorted(modules)) if c]
    assert not cycles, " ; ".join(" -> ".join(c) for c in cycles)


def test_the_check_finds_a_cycle():
    assert cycle_from("a", {"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle_from("a", {"a": {"b"}, "b": set()}) is None


def upward_imports(graph: dict, level: dict) -> set[tuple[str, str]]:
    """(importer, imported) for each import of a module from a layer above the importer's (0 is the top)."""
    return {(name, imported) for name, found in graph.items() for imported in found if level[imported] < level[name]}


def test_no_module_imports_from_a_layer_above_its_own():
    level = {name: LAYERS.index(layer_of(path)) for name, path in FILES.items()}
    graph = {name: imports_of(path) for name, path in FILES.items()}
    found = upward_imports(graph, level)
    upward = [f"{a} ({layer_of(FILES[a])}) imports {b} ({layer_of(FILES[b])})" for a, b in sorted(found)]
    assert not upward, "; ".join(upward)


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


def test_keras_internals_are_imported_in_keras_compat_only():
    """keras.src and keras_hub.src move between releases: one module touches them, each use with its guard test
    (tests/test_keras_compat.py)."""
    found = sorted(
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in FILES.values()
        if path.stem != "keras_compat"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and any(
            name.startswith(("keras.src", "keras_hub.src"))
            for name in ([node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names])
        )
    )
    assert not found, found


# The front doors' functions take what a user passes: each CLI command its flags, and each function of the
# Python API the same settings by the command's names (finetune.export: format, output, overwrite, base, backend,
# dtype, as `finetune export` has them). Everything under them takes narrower things: a resolved run, a model.
FRONT_DOOR_FUNCTIONS = {"cli", "__init__"}
MOST_PARAMETERS = 6


def test_no_function_under_the_front_doors_takes_more_than_six_parameters():
    wide = []
    for name, path in FILES.items():
        if name in FRONT_DOOR_FUNCTIONS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                count = len([a for a in arguments if a.arg not in ("self", "cls")])
                if count > MOST_PARAMETERS:
                    wide.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({count})")
    assert not wide, wide


# What a command reads before it chooses the backend: keras fixes its backend at its first import, so none of
# these may import it (a run once chose torch, and keras was already loaded with TensorFlow's default).
BEFORE_THE_BACKEND = [
    "finetune.cli", "finetune.config", "finetune.training.runs", "finetune.training.outputs",
    "finetune.training.checkpoint", "finetune.training.loop", "finetune.training.adapter", "finetune.training.plan",
    "finetune.exports.export", "finetune.tools.vertex", "finetune.tools.bench",
]  # fmt: skip


def test_what_runs_before_the_backend_is_chosen_imports_no_framework():
    import subprocess
    import sys

    code = (
        "import sys\n"
        + "".join(f"import {name}\n" for name in BEFORE_THE_BACKEND)
        + "print(sorted(m for m in ('keras', 'tensorflow', 'torch', 'jax') if m in sys.modules))"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "KERAS_BACKEND"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_docs_architecture_names_every_module():
    """docs/architecture.md is a newcomer's map: each module of the package is named in it (as `stem`), and each
    name in its layer table is a module."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`([a-z_]+)`", text))
    missing = sorted(stem for stem in MODULES - FRONT - {"config"} if stem not in named)
    assert missing == [], f"docs/architecture.md does not name {missing}"
