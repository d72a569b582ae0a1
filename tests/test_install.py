"""A non-editable install runs the quickstart from any directory; the install lines in the guides ask for extras
that exist.

The sample and the recipes once lived at the repository's top level, so a
wheel installed into site-packages looked for them in site-packages/data/ and
failed. This builds the wheel, installs it into a fresh virtual environment,
and runs its `finetune` command and docs/python-api.md's example from an
unrelated directory. The environment's dependencies (4 GB) are this one's,
seen through a .pth line: only finetune itself comes from the wheel.

End to end, from the built wheel: it mirrors no one module.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from conftest import BACKEND, REPO

from finetune import config

# What is checked is the packaging, which no backend changes: the module runs once, in the PyTorch suite
# (conftest's one_backend), where the quickstart trains on torch and the API example on its recipe's jax.
pytestmark = pytest.mark.one_backend

# --no-build-isolation builds with the venv's own setuptools, so the test needs no network;
# Python 3.12+ venvs no longer come with setuptools preinstalled.
pytest.importorskip("setuptools", reason="building the wheel offline needs setuptools in this environment")

PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
SHIPPED = [
    "finetune/assets/dolly-sample.jsonl",
    "finetune/assets/tiny/tokenizer.spm",
    "finetune/assets/tiny/weights.npz",
    "finetune/assets/tiny-gemma4/tokenizer.spm",
    "finetune/assets/tiny-gemma3n/tokenizer.spm",
    *(f"finetune/recipes/{path.name}" for path in sorted(config.RECIPES_DIR.glob("*.yaml"))),
]

# Checks the installed copy is the one imported (the editable install's finder
# comes after PYTHONPATH on sys.path) and that `tiny` and `sample` resolve in it.
LOAD_TINY = """
import sys
from pathlib import Path

import finetune
from finetune.data import formats as data

site = Path(sys.argv[1]).resolve()
assert Path(finetune.__file__).resolve().is_relative_to(site), finetune.__file__
cfg = finetune.load_config("tiny")
assert cfg.model.preset == "tiny" and cfg.data.path == data.SAMPLE, cfg
assert data.SAMPLE_PATH.resolve().is_relative_to(site) and data.SAMPLE_PATH.is_file(), data.SAMPLE_PATH
assert len(data.load_records(cfg.data.path)) == 400
"""


def _source_copy(dest: Path) -> Path:
    """What the wheel is built from, copied: an in-tree build would write build/ and
    finetune.egg-info/ (the editable install's metadata) into the shared checkout,
    and a stale build/lib/ could slip files into the wheel."""
    dest.mkdir()
    shutil.copy2(REPO / "pyproject.toml", dest / "pyproject.toml")
    shutil.copy2(REPO / "README.md", dest / "README.md")
    shutil.copytree(REPO / "finetune", dest / "finetune", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def _run(args, timeout, **kwargs):
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert result.returncode == 0, (
        f"{args[:4]} exited {result.returncode}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    )
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv, elsewhere): the wheel installed into a fresh venv, and an empty working directory."""
    root = tmp_path_factory.mktemp("install")
    source = _source_copy(root / "src")
    wheels = root / "wheels"
    _run([*PIP, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", wheels, source], timeout=300)
    (wheel,) = wheels.glob("finetune-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [name for name in SHIPPED if name not in names]
    assert not missing, f"the wheel lacks {missing}"
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], timeout=120)
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], 60).stdout.strip())
    # This environment's packages, after the venv's own: its editable finetune is not seen, since a .pth
    # line adds a folder to sys.path without running the .pth files (the editable finder) inside it.
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([*PIP, "--python", python, "install", "--no-deps", "--no-index", wheel], timeout=300)
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    return venv, elsewhere


def _env() -> dict:
    return {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}, "KERAS_BACKEND": BACKEND}


def test_installed_package_finds_its_recipes_and_sample(installed):
    venv, elsewhere = installed
    _run([venv / "bin" / "python", "-c", LOAD_TINY, venv], timeout=120, cwd=elsewhere, env=_env())


def test_installed_quickstart_runs_outside_the_checkout(installed):
    venv, elsewhere = installed
    out = elsewhere / "run"
    command = [
        *(venv / "bin" / "finetune", "gemma", "--preset", "tiny", "--backend", BACKEND),
        *("--max-steps", "2", "--seq-len", "64", "--batch-size", "2"),
        *("--set", "train.samples=1", "--set", "train.max_new_tokens=4", "--output", out),
    ]
    _run(command, timeout=300, cwd=elsewhere, env=_env())
    assert json.loads((out / "metrics.json").read_text())


def test_the_python_api_guide_example_runs_from_the_installed_package(installed):
    venv, elsewhere = installed
    guide = (REPO / "docs" / "python-api.md").read_text(encoding="utf-8")
    example = guide[guide.index("```python\n") + len("```python\n") :]
    example = example[: example.index("```\n")]
    assert "finetune.run(" in example and "finetune.load(" in example
    workdir = elsewhere / "api-example"
    workdir.mkdir()
    checks = "\nassert metrics['eval_loss'] < metrics['eval_loss_before'] and lm.preprocessor is not None\n"
    _run([venv / "bin" / "python", "-c", example + checks], timeout=600, cwd=workdir, env=_env())
    assert (workdir / "runs" / "api-first" / "adapter.lora.h5").is_file()


# `.[all,hf]`, `finetune[torch]`: the extras an install line or a sentence of the guides names.
EXTRAS_NAMED = re.compile(r"(?:\.|finetune)\[([\w,-]+)\]")


def _extras() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml takes Python 3.11's tomllib")
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]


def test_every_extra_the_guides_name_is_declared():
    declared = set(_extras())
    named = {}
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "Dockerfile"]:
        for group in EXTRAS_NAMED.findall(path.read_text(encoding="utf-8")):
            for extra in group.split(","):
                named.setdefault(extra, path.name)
    assert {"jax-cuda", "tensorflow-cuda", "tpu", "all", "dev", "hf"} <= set(named)  # the lines the guides give
    unknown = {extra: where for extra, where in named.items() if extra not in declared}
    assert not unknown, f"extras named but not in pyproject.toml: {unknown}"


def test_the_accelerator_extras_name_extras_their_packages_have():
    """jax[cuda12], jax[tpu], tensorflow[and-cuda]: a misspelt extra of another package is only a warning to pip,
    which then installs the CPU build without a word. Checked against the installed packages' metadata."""
    checked = []
    for requirements in _extras().values():
        for requirement in requirements:
            found = re.match(r"([\w.-]+)\[([\w,-]+)\]", requirement)
            if not found or found.group(1) == "finetune":
                continue
            package, wanted = found.group(1), set(found.group(2).split(","))
            try:
                provided = set(metadata.metadata(package).get_all("Provides-Extra") or [])
            except metadata.PackageNotFoundError:
                continue
            assert wanted <= provided, f"{requirement}: {package} {metadata.version(package)} has {sorted(provided)}"
            checked.append(requirement)
    assert any(r.startswith("jax[cuda12]") for r in checked) and any(r.startswith("jax[tpu]") for r in checked)


def test_the_readme_install_lines_are_the_ci_lines_and_the_docs_test_runs_them():
    """.ci/run installs as the README says; tests/test_docs.py dry-runs each README pip line offline, so none may
    be marked out of its reach."""
    from test_docs import commands, is_pip_install

    readme = [c for c in commands(REPO / "README.md") if is_pip_install(c)]
    assert len(readme) == 2 and all(c.runs_here for c in readme), readme
    ci = [line.split("||")[0].strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    ci = [line.replace(" -q ", " ") for line in ci if line.startswith("pip install ")]
    assert ci == ["pip install torch==2.13.0", 'pip install -e ".[all,dev,hf]"']
    assert all(c.text.startswith(line) for c, line in zip(readme, ci)), (readme, ci)
