"""The README and the guides in docs/: every shell command in them runs, and the README stays a front door.

What runs. Each ```sh block of README.md and docs/*.md is read as shell commands, one a line (a trailing `\\`
continues a line; blank and comment-only lines are skipped). The README's commands run first, once, in the
JAX suite, in a fresh directory: its quickstart leaves `runs/first`, a finished tiny run. Then each guide's commands
run in order in a directory of their own that starts with a copy of `runs/first`, so a guide can evaluate,
generate, export and resume without training again, and a copy of the repository's `examples/` (docs/rl.md's
prompts and reward functions), as a reader in the repository root has them. A `finetune` command runs in this process through Typer's
CliRunner, so keras is imported once; anything else, or a command with shell syntax (`>`, `|`, `$`, an
environment assignment), runs in bash with this environment's `finetune` on PATH. A command that names a
backend (`--backend X`, `KERAS_BACKEND=X`, or a recipe's `backend: X`) runs in X's suite only; one that names
none runs as a reader types it, on the default backend (jax), in the JAX suite. Every command must exit 0.

A `pip install` line runs as a dry run, offline, against this environment (`--dry-run --no-index
--no-build-isolation`), in a copy of the repository's package files: it checks that everything the line asks
for, the extras included, is installed here, and changes nothing.

The markers. A command that must not run here says why in its trailing comment, as `# MARKER: VALUE`, with
markers separated by `;` from each other and from any note. An HTML comment on the line before a block,
`<!-- MARKER: VALUE -->`, marks every command of the block and stays out of a reader's sight:
- `needs: network`: a download (Kaggle, Hugging Face, pip), a cloud service or other hosts.
- `needs: gpu`, `needs: tpu`: an accelerator (several GPUs for `--parallel`).
- `needs: llama.cpp`, `needs: ollama`: a program finetune does not install.
- `slow: REASON`: offline, but too slow for this test; REASON names the test under tests/ that covers the path.
  These are the whole suite (README, docs/development.md), this test itself, `finetune bench` (a benchmark
  wants the machine to itself; tests/test_bench.py), the 8 simulated devices of docs/scale-out.md (about 30 s;
  tests/test_distribution.py) and a Gemma 4 run in docs/families.md (tests/test_families.py).
- `exits: N`: the command runs and must exit with code N: a refusal the guide shows.
Unknown `needs:` values fail the test, and so does a fence in another shell language (bash, console, ...), so
no command escapes it.

The first ```python example of docs/python-api.md runs too, in a copy of what the README's commands left, in the
suite of its recipe's backend.

Runtime: the quickstart (one epoch of the tiny model) and one more epoch in docs/resume.md are the bulk; every
other training command is `--max-steps 2` or none at all.

End to end: the guides' commands, as a reader runs them; it mirrors no one module.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import BACKEND, REPO

from finetune.platform.errors import UserError

README = REPO / "README.md"
GUIDES = sorted((REPO / "docs").glob("*.md"))
README_LIMIT = 12 * 1024
NEEDS = {"network", "gpu", "tpu", "llama.cpp", "ollama"}
OTHER_SHELLS = {"bash", "shell", "console", "zsh", "shell-session", "sh-session"}
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
BLOCK_MARKERS = re.compile(r"^\s*<!--(.*)-->\s*$")
# Characters that make a command bash's business: redirections, pipes, lists, expansions and globs.
SHELL_SYNTAX = set("|&;<>$`*?[(){}")


@dataclasses.dataclass
class Command:
    source: str  # file:line, for messages
    text: str  # the command without its comment
    needs: set
    slow: str | None
    exits: int

    @property
    def runs_here(self) -> bool:
        return not self.needs and self.slow is None

    def backend(self, workdir: Path) -> str | None:
        """The backend the command names: by flag, by variable, or through its recipe's `backend:` key."""
        found = re.search(r"(?:--backend[ =]|KERAS_BACKEND=)(\w+)", self.text)
        if found:
            return found.group(1)
        recipe = re.search(r"--recipe[ =](\S+)", self.text)
        if recipe is None:
            return None
        from finetune import config

        before = os.getcwd()
        os.chdir(workdir)  # a recipe file the guide made is relative to its directory
        try:
            return config.read_recipe(recipe.group(1)).get("backend")
        except UserError:  # no such recipe: the command runs, and says so
            return None
        finally:
            os.chdir(before)


def blocks(path: Path):
    """(line number, language, body lines, markers) of each fenced block, indentation removed; markers: the text
    of an HTML comment on the line before the fence, else ""."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        before = BLOCK_MARKERS.match(lines[i - 1]) if i else None
        indent, language, start = len(opening.group(1)), opening.group(2), i + 1
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        yield start, language, [line[indent:] for line in lines[start:i]], before.group(1).strip() if before else ""
        i += 1


def split_comment(line: str) -> tuple[str, str]:
    """(command, comment): the comment starts at the first `#` outside quotes that follows a space."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1 :].strip()
    return line.rstrip(), ""


def unquoted(text: str) -> str:
    """`text` with its quoted parts removed (double quotes keep `$` and backticks: bash expands them)."""
    out, quote = [], None
    for char in text:
        if quote:
            if char == quote:
                quote = None
            elif quote == '"' and char in "$`":
                out.append(char)
        elif char in "'\"":
            quote = char
        else:
            out.append(char)
    return "".join(out)


def parse(source: str, line: str, block_markers: str = "") -> Command:
    """The command on `line`, with the markers of its trailing comment and of its block's HTML comment."""
    text, comment = split_comment(line)
    needs, slow, exits = set(), None, 0
    for part in (p.strip() for p in f"{block_markers};{comment}".split(";")):
        key, _, value = part.partition(":")
        if key == "needs":
            needs |= {v.strip() for v in value.split(",")}
        elif key == "slow":
            slow = value.strip()
        elif key == "exits":
            exits = int(re.match(r"\s*(\d+)", value).group(1))
    return Command(source, text, needs, slow, exits)


def commands(path: Path) -> list[Command]:
    found = []
    for start, language, body, block_markers in blocks(path):
        assert language not in OTHER_SHELLS, f"{path.name}:{start}: write shell commands in ```sh blocks"
        if language != "sh":
            continue
        pending, first = "", start
        for offset, line in enumerate(body):
            if not pending:
                first = start + offset + 1
            if line.rstrip().endswith("\\") and not split_comment(line)[1]:
                pending += line.rstrip()[:-1] + " "
                continue
            logical, pending = pending + line, ""
            if logical.strip() and not logical.strip().startswith("#"):
                found.append(parse(f"{path.relative_to(REPO)}:{first}", logical.strip(), block_markers))
    return found


def in_process(command: Command) -> bool:
    words = command.text.split()
    return words[0] == "finetune" and "=" not in words[0] and not SHELL_SYNTAX & set(unquoted(command.text))


def is_pip_install(command: Command) -> bool:
    return command.text.startswith("pip install ")


def run(command: Command, workdir: Path) -> str | None:
    """None when `command` exits as its marker says, else a message with its output."""
    if is_pip_install(command):
        code, output = _run_pip_dry(command.text)
    elif in_process(command):
        code, output = _run_in_process(shlex.split(command.text)[1:], workdir)
    else:
        code, output = _run_in_bash(command.text, workdir)
    if code == command.exits:
        return None
    return f"{command.source}: `{command.text}` exited {code}, not {command.exits}:\n{output[-3000:]}"


def _run_in_process(args: list[str], workdir: Path) -> tuple[int, str]:
    from typer.testing import CliRunner

    from finetune.cli import app

    before = os.getcwd()
    policy = _dtype_policy()
    os.chdir(workdir)
    try:
        result = CliRunner().invoke(app, args)
    finally:
        os.chdir(before)
        if policy is not None:  # a run applies its precision globally; later tests in this process build float32
            import keras

            keras.config.set_dtype_policy(policy)
    output = result.output + (f"\n{result.exception!r}" if result.exception and result.exit_code != 2 else "")
    return result.exit_code, output


def _dtype_policy():
    if "keras" not in sys.modules:
        return None
    import keras

    return keras.config.dtype_policy()


@functools.cache
def _package_copy() -> Path:
    """The files pip installs the project from, copied: `pip install .` reads the repository root, and a build
    in the checkout itself could leave build/ or finetune.egg-info/ behind."""
    root = Path(tempfile.mkdtemp(prefix="finetune-pip-"))
    atexit.register(shutil.rmtree, root, True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, root / name)
    shutil.copytree(REPO / "finetune", root / "finetune", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return root


def _run_pip_dry(text: str) -> tuple[int, str]:
    """A `pip install` line as a dry run from the repository root, offline: it resolves against what this
    environment holds (an `--index-url` the line names is not asked), and installs nothing."""
    offline = ["--dry-run", "--no-index", "--no-build-isolation", "--disable-pip-version-check"]
    args = [sys.executable, "-m", "pip", "install", *offline, *shlex.split(text)[2:]]
    proc = subprocess.run(args, cwd=_package_copy(), capture_output=True, text=True, timeout=600, check=False)
    return proc.returncode, proc.stdout + proc.stderr


def _run_in_bash(text: str, workdir: Path) -> tuple[int, str]:
    env = {**os.environ, "KERAS_BACKEND": BACKEND}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(
        ["bash", "-c", text], cwd=workdir, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    return proc.returncode, proc.stdout + proc.stderr


# A command that names no backend runs as a reader types it: on the default backend (config's: jax when
# KERAS_BACKEND is unset), so in that suite only. The others run the commands that name them.
DOCS_SUITE = "jax"


def runs_in_this_suite(command: Command, workdir: Path) -> bool:
    named = command.backend(workdir)
    return command.runs_here and (named == BACKEND or (named is None and BACKEND == DOCS_SUITE))


def run_all(path: Path, workdir: Path) -> list[str]:
    problems = []
    for command in commands(path):
        if runs_in_this_suite(command, workdir):
            problems += [problem] if (problem := run(command, workdir)) else []
    return problems


@pytest.fixture(scope="session")
def readme_dir(tmp_path_factory) -> Path:
    """The directory the README's commands ran in, once, in the default backend's suite: with xdist, the workers
    share it."""
    from filelock import FileLock

    if BACKEND != DOCS_SUITE:
        pytest.skip(f"the README names no backend: its commands run in the {DOCS_SUITE} suite")

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    workdir, record = shared / f"docs-readme-{BACKEND}", shared / f"docs-readme-{BACKEND}.json"
    with FileLock(str(record) + ".lock"):
        if not record.exists():
            workdir.mkdir()
            record.write_text(json.dumps(run_all(README, workdir)))
    problems = json.loads(record.read_text())
    assert not problems, "\n\n".join(problems)
    assert (workdir / "runs" / "first" / "metrics.json").is_file(), "the README's quickstart leaves runs/first"
    return workdir


def test_the_readme_commands_run(readme_dir):
    metrics = json.loads((readme_dir / "runs" / "first" / "metrics.json").read_text())
    assert metrics["eval_loss"] < metrics["eval_loss_before"]  # what the quickstart promises


@pytest.mark.parametrize("guide", GUIDES, ids=[g.stem for g in GUIDES])
def test_the_guide_commands_run(guide, request, tmp_path):
    if BACKEND != DOCS_SUITE and not any(runs_in_this_suite(c, tmp_path) for c in commands(guide)):
        pytest.skip(f"no command of {guide.name} names {BACKEND}; the others run in the {DOCS_SUITE} suite")
    if BACKEND == DOCS_SUITE:  # the guides go on from the README's quickstart run
        shutil.copytree(request.getfixturevalue("readme_dir") / "runs" / "first", tmp_path / "runs" / "first")
    shutil.copytree(REPO / "examples", tmp_path / "examples")  # a guide's commands run from the repository root
    problems = run_all(guide, tmp_path)
    assert not problems, "\n\n".join(problems)


def python_examples(path: Path) -> list[str]:
    return ["\n".join(body) + "\n" for _, language, body, _ in blocks(path) if language == "python"]


def test_the_python_api_example_runs_where_the_readme_ran(readme_dir, tmp_path):
    """docs/python-api.md's first example, in a directory that holds what the README's commands left (runs/first,
    exported/first): a reader who tries the quickstart, then the API, meets no refusal."""
    example = python_examples(REPO / "docs" / "python-api.md")[0]
    recipe = re.search(r"load_config\(\"([\w-]+)\"", example).group(1)
    backend = config_backend(recipe)
    if backend != BACKEND:
        pytest.skip(f"the example's recipe {recipe} trains on {backend}: that suite runs it")
    for name in ("runs", "exported"):
        shutil.copytree(readme_dir / name, tmp_path / name)
    checks = "\nassert metrics['eval_loss'] < metrics['eval_loss_before'] and lm.preprocessor is not None\n"
    env = {**os.environ, "KERAS_BACKEND": BACKEND}
    proc = subprocess.run(
        [sys.executable, "-c", example + checks], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (tmp_path / "runs" / "api-first" / "adapter.lora.h5").is_file()
    assert (tmp_path / "exported" / "first").is_dir()  # the README's export, untouched


def config_backend(recipe: str) -> str | None:
    from finetune import config

    return config.read_recipe(recipe).get("backend")


def test_the_readme_is_a_front_door():
    text = README.read_text(encoding="utf-8")
    assert len(text.encode("utf-8")) <= README_LIMIT, f"README.md is {len(text.encode())} bytes; move some to docs/"
    unlinked = [g.name for g in GUIDES if f"](docs/{g.name})" not in text]
    assert not unlinked, f"README.md links no {unlinked}"
    assert "](BENCHMARKS.md)" in text
    # .ci/run and users copy these exactly.
    for line in (
        "pip install torch==2.13.0",
        'pip install -e ".[all,dev,hf]"',
        "KERAS_BACKEND=jax python -m pytest -q -n 2",
    ):
        assert line in text


GEMMA_TERMS = "https://ai.google.dev/gemma/terms"
KAGGLE_GEMMA = "https://www.kaggle.com/models/google/gemma"


def test_the_gemma_license_is_linked_where_it_is_named():
    """A reader told to accept the license is given the terms and the page to accept them on."""
    naming = []
    for path in [README, *GUIDES]:
        for paragraph in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")):
            if re.search(r"Gemma licen[cs]e", paragraph):
                naming.append(path.name)
                assert f"]({GEMMA_TERMS})" in paragraph and f"]({KAGGLE_GEMMA})" in paragraph, (path.name, paragraph)
    assert {"README.md", "kaggle.md", "troubleshooting.md"} <= set(naming)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set:
    text = path.read_text(encoding="utf-8")
    in_code, found = False, set()
    for line in text.splitlines():
        if FENCE.match(line) or line.strip() == "```":
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            found.add(_slug(line.lstrip("#")))
    return found


def test_every_link_between_the_guides_resolves():
    broken = []
    for path in [README, *GUIDES]:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            if not resolved.is_file():
                broken.append(f"{path.name}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{path.name}: {target} (no such heading)")
    assert not broken


def test_every_command_is_run_or_marked_with_a_known_reason():
    every = [c for path in [README, *GUIDES] for c in commands(path)]
    assert len(every) > 50
    for command in every:
        assert command.needs <= NEEDS, f"{command.source}: unknown needs {command.needs - NEEDS}; known: {NEEDS}"
        if command.slow is not None:
            named = re.findall(r"tests/[\w/.]*", command.slow)
            assert named and all((REPO / n).exists() for n in named), f"{command.source}: name the test in tests/"


def test_the_recipe_guide_lists_every_config_key_and_real_flags():
    import typer

    from finetune import Config
    from finetune.cli import app

    rows = re.findall(r"^\| `([\w.]+)` \| (`--[\w-]+`)? ?\|", (REPO / "docs" / "recipes.md").read_text(), re.M)
    listed = {key: flag.strip("`") for key, flag in rows}

    def keys(tree, prefix=""):
        for name, value in tree.items():
            yield from keys(value, f"{prefix}{name}.") if isinstance(value, dict) else [prefix + name]

    assert set(listed) == set(keys(Config().to_dict()))
    gemma = typer.main.get_command(app).commands["gemma"]
    options = {opt for param in gemma.params for opt in param.opts}
    assert {flag for flag in listed.values() if flag} <= options
