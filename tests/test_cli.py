"""The CLI: help, flag precedence, refusals and exit codes; the bad-input corpus is test_bad_inputs.py.

End to end: the `finetune` command runs in-process, as a user types it, down through every module it calls.
"""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import BACKEND, REPO
from typer.testing import CliRunner

import finetune
from finetune.cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def help_text(*args) -> str:
    """Help as one line of words: wide, without the panels' box characters."""
    result = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "250", "TERMINAL_WIDTH": "250"})
    assert result.exit_code == 0, result.output
    return " ".join(result.output.translate(str.maketrans("│╭╮╰╯─", "      ")).split())


def test_help_lists_every_option_with_its_default():
    top = help_text()
    for command in ("gemma", "plan", "bench", "eval", "generate", "runs", "recipes", "vertex-spec"):
        assert command in top
    # Whole command descriptions and shell completion.
    assert "compare tokens/s, MFU and memory." in top and "--install-completion" in top
    text = help_text("gemma")
    for flag, default in [
        ("--backend", "$KERAS_BACKEND if set, else jax"),
        ("--preset", "gemma_2b_en"),
        ("--rank", "4"),
        ("--template", "auto"),
        ("--seq-len", "256"),
        ("--eval-fraction", "0.05"),
        ("--epochs", "1"),
        ("--seed", "0"),
    ]:
        assert flag in text and f"(default: {default})" in text, flag
    for flag in (
        "--alpha",
        "--target",
        "--data",
        "--batch-size",
        "--max-steps",
        "--lr",
        "--output",
        "--recipe",
        "--set",
        "--overwrite",
        "--train-on-prompt",
        "--debug",
        "--verbose",
        "--threads",
        "--quantize",
    ):
        assert flag in text, flag


def test_help_groups_the_options_and_lists_the_allowed_values():
    text = help_text("gemma")
    panels = ["Model", "LoRA", "Data", "Training", "Output and checkpoints", "Recipe and diagnostics"]
    assert all(f" {panel} " in text for panel in panels)
    assert " Model --backend" in text and " LoRA --rank" in text and " Data --data" in text  # heading, first option
    for values in (
        "jax|torch|tensorflow",
        "dolly|alpaca|gemma-chat",
        "auto|bfloat16|float16|float32|mixed_bfloat16",
        "auto|on|off",
    ):
        assert values in text, values


def test_flag_precedence(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(finetune, "run_as_command", lambda cfg, **kwargs: seen.setdefault("cfg", cfg))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("lora:\n  rank: 8\n  alpha: 16\ntrain:\n  epochs: 3\n  seed: 5\n")
    result = invoke(
        "gemma",
        "--recipe",
        recipe,
        "--set",
        "train.epochs=4",
        "--set",
        "lora.rank=6",
        "--rank",
        "2",
        "--target",
        "query,key",
        "--batch-size",
        "auto",
    )
    assert result.exit_code == 0, result.output
    cfg = seen["cfg"]
    assert cfg.lora.rank == 2  # flag beats --set beats recipe
    assert cfg.train.epochs == 4  # --set beats recipe
    assert cfg.train.seed == 5 and cfg.lora.alpha == 16.0  # recipe beats defaults
    assert cfg.lora.targets == ["query", "key"]
    assert cfg.train.batch_size == "auto"
    assert cfg.backend == BACKEND  # the default: KERAS_BACKEND, which each suite sets


def test_output_holding_a_run_is_refused_unless_overwrite(tmp_path, tiny_args, small_data):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.json").write_text("{}")
    (out / "finetune-run.json").write_text("{}")  # a run's directory carries finetune's marker
    result = invoke("gemma", *tiny_args, "--data", small_data, "--output", out)
    assert result.exit_code == 2 and "already holds a run; pass --overwrite to replace it" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["finetune-run.json", "metrics.json"]


def test_kaggle_preset_without_credentials_fails_fast_and_hides_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KAGGLEHUB_CACHE", str(tmp_path / "cache"))
    for name in ("KAGGLE_USERNAME", "KAGGLE_KEY", "KAGGLE_API_TOKEN", "KAGGLE_CONFIG_DIR"):
        monkeypatch.delenv(name, raising=False)
    for preset in ("gemma_2b_en", "gemma4_2b"):
        result = invoke("gemma", "--backend", BACKEND, "--preset", preset, "--output", tmp_path / "run")
        assert result.exit_code == 2, (preset, result.output)
        assert f"preset {preset} is downloaded from Kaggle" in result.stderr and "KAGGLE_USERNAME" in result.stderr
        assert "/kaggle/input" in result.stderr and "--preset tiny" in result.stderr
        assert not (tmp_path / "run").exists()

    monkeypatch.setenv("KAGGLE_USERNAME", "someone")
    monkeypatch.setenv("KAGGLE_KEY", "s3cr3t-key-value")
    result = invoke("gemma", "--backend", BACKEND, "--preset", "gemma_2b_en", "--output", tmp_path / "run")
    # With credentials but no network here, the download cannot work: still exit 2, never the key.
    assert result.exit_code == 2
    assert "s3cr3t-key-value" not in result.output


def test_debug_shows_the_traceback(tmp_path):
    result = invoke("gemma", "--backend", BACKEND, "--preset", "tiny", "--data", tmp_path / "missing.jsonl", "--debug")
    assert result.exit_code == 2
    assert "Traceback" in result.output and "UserError" in result.output


def test_python_dash_m_runs_the_cli_in_a_fresh_process(tmp_path):
    env = {**os.environ, "KERAS_BACKEND": BACKEND}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"instruction": "a"}) + "\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "finetune",
            "gemma",
            "--preset",
            "tiny",
            "--backend",
            BACKEND,
            "--data",
            str(bad),
            "--output",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "record has no 'response' field" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_ctrl_c_exits_130_without_a_traceback(monkeypatch):
    def interrupted(cfg, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(finetune, "run_as_command", interrupted)
    result = invoke("gemma", "--preset", "tiny", "--backend", BACKEND)
    assert result.exit_code == 130 and "interrupted" in result.stderr and "Traceback" not in result.output


def test_importing_the_cli_and_api_loads_no_framework():
    """The backend is chosen from flags, so nothing may import keras before the CLI has parsed them."""
    code = (
        "import sys, finetune, finetune.cli; "
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('keras', 'keras_hub', 'jax', 'torch', 'tensorflow')]; "
        "print(loaded); sys.exit(1 if loaded else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and result.output.strip() == f"finetune {finetune.__version__}"


def _command_paths(command, path=()):
    yield path
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from _command_paths(sub, (*path, name))


def test_no_help_shows_a_type_placeholder():
    """Every subcommand's --help names what an option takes (N, TEXT, a metavar) or nothing for a switch."""
    import re

    import typer

    paths = list(_command_paths(typer.main.get_command(app)))
    assert ("bench",) in paths and ("recipes", "copy") in paths
    for path in paths:
        result = runner.invoke(app, [*path, "--help"], terminal_width=200)
        assert result.exit_code == 0, (path, result.output)
        found = re.findall(r"<(?:int|str|bool|float|path|Path|datetime|list\[[^\]]*\]|\w+ range)>", result.output)
        assert not found, (path, found)


def test_generate_out_of_memory_advises_generates_own_remedies(monkeypatch):
    from finetune.training import runs

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 107374182400 bytes")

    monkeypatch.setattr(runs, "open_on", lambda run, backend: object())
    monkeypatch.setattr(runs, "generate", out_of_memory)
    result = runner.invoke(app, ["generate", "--run", "somewhere", "--prompt", "x" * 100_000])
    assert result.exit_code == 2, result.output
    assert "--max-new-tokens" in result.stderr and "shorten the prompt" in result.stderr
    assert "--batch-size" not in result.stderr and "--seq-len" not in result.stderr


def _panels(*args) -> dict[str, str]:
    """--help's panels by title, each as one line of words."""
    result = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "250", "TERMINAL_WIDTH": "250"})
    assert result.exit_code == 0, result.output
    panels, title = {}, None
    for line in result.output.splitlines():
        if line.startswith("╭─"):
            title = line.strip("╭─╮ ")
        elif title and line.startswith("│"):
            panels[title] = panels.get(title, "") + " " + " ".join(line.strip("│ ").split())
    return panels


def test_every_setting_with_a_flag_is_listed_under_its_panel():
    from finetune import config

    gemma = _panels("gemma")
    for item in config.settings(config.Config):
        if item.flag:
            assert f" {item.flag} " in gemma[item.panel], (item.key, item.panel)
            assert item.help.split(".")[0] in gemma[item.panel], item.key
    plan = _panels("plan")
    assert {"--backend", "--preset", "--precision", "--rank", "--batch-size", "--mesh"} <= set(
        " ".join(plan.values()).split()
    )


def test_an_option_declared_once_is_a_flag_a_recipe_key_a_help_entry_and_documented(tmp_path, monkeypatch):
    """Adding an option is one field: here a throwaway one, added the way every real option is."""
    import dataclasses

    import typer

    from finetune import cli, config

    @config.documented
    @dataclasses.dataclass
    class Extra:
        """Settings this test adds."""

        warmup_steps: int = config.setting(
            0, "Steps of learning-rate warm-up.", flag="--warmup-steps", panel=config.TRAINING, range=config.Range(0)
        )

    @dataclasses.dataclass
    class Extended(config.Config):
        extra: Extra = dataclasses.field(default_factory=Extra)

    monkeypatch.setattr(config, "Config", Extended)  # the schema load() builds and the CLI reads flags against
    seen = []
    extended = typer.Typer()

    @extended.command()
    @cli.with_settings(Extended)
    def train(settings: dict, recipe: cli.Recipe = None, set_: cli.SetPairs = None):
        seen.append(config.load(cli.the_recipe(recipe), cli._overrides(set_, settings)).extra.warmup_steps)

    # The flag, under its panel, with its default.
    result = runner.invoke(extended, ["--help"], env={"COLUMNS": "250", "TERMINAL_WIDTH": "250"})
    training = result.output[result.output.index("╭─ Training") :].split("╰")[0]
    assert "--warmup-steps" in training and "Steps of learning-rate warm-up. (default: 0)" in training
    # The recipe key and --set, with the precedence of every other setting.
    recipe = tmp_path / "r.yaml"
    recipe.write_text("extra:\n  warmup_steps: 5\n")
    for args, steps in [([], 0), (["--recipe", recipe], 5), (["--set", "extra.warmup_steps=6"], 6)]:
        assert runner.invoke(extended, [str(a) for a in args]).exit_code == 0
        assert seen.pop() == steps
    assert runner.invoke(extended, ["--recipe", str(recipe), "--warmup-steps", "7"]).exit_code == 0
    assert seen.pop() == 7
    # Its check, its place among the keys, and its section's docstring.
    with pytest.raises(finetune.UserError, match="warmup steps must not be negative, got -1"):
        config.load(None, {"extra.warmup_steps": -1})
    with pytest.raises(finetune.UserError, match="did you mean 'extra.warmup_steps'"):
        config.load(None, {"extra.warmup_step": 1})
    assert "warmup_steps: int. Steps of learning-rate warm-up. Default: 0. Flag: --warmup-steps." in Extra.__doc__


def test_no_function_in_the_cli_or_the_config_is_over_100_lines():
    import ast
    from pathlib import Path

    from finetune import cli, config

    for module in (cli, config):
        tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        long = {f.name: f.end_lineno - f.lineno + 1 for f in functions if f.end_lineno - f.lineno >= 100}
        assert not long, (module.__name__, long)


def _every_help(width: int, monkeypatch) -> dict:
    """Each command's --help as rendered at `width` columns, by command path."""
    import typer
    import typer.rich_utils

    # typer reads TERMINAL_WIDTH once, at its first help: an earlier test's width would stay.
    monkeypatch.setattr(typer.rich_utils, "MAX_WIDTH", width)
    rendered = {}
    for path in _command_paths(typer.main.get_command(app)):
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": str(width), "TERMINAL_WIDTH": str(width)})
        assert result.exit_code == 0, (path, result.output)
        assert max(map(len, result.output.splitlines())) == width, (path, "rendered at another width")
        rendered[" ".join(path) or "finetune"] = result.output
    return rendered


def test_help_text_breaks_lines_only_where_the_terminal_ends(monkeypatch):
    """Wide enough, each paragraph of a description, and each command's row in a list, is one line: `data`'s ran
    over two, broken mid-sentence, and so did a paragraph of `plan`'s."""
    for path, text in _every_help(400, monkeypatch).items():
        lines = text.splitlines()
        start = next(i for i, line in enumerate(lines) if "Usage:" in line) + 1
        description = lines[start : next(i for i, line in enumerate(lines) if line.startswith("╭"))]
        assert not [a for a, b in zip(description, description[1:]) if a.strip() and b.strip()], (path, description)
        if "╭─ Commands" in text:
            rows = lines[next(i for i, line in enumerate(lines) if line.startswith("╭─ Commands")) + 1 :]
            rows = rows[: next(i for i, line in enumerate(rows) if line.startswith("╰"))]
            assert not [row for row in rows if row.startswith("│  ")], (path, rows)  # a row's second line


def test_plan_help_names_every_family_plan_has_shapes_for():
    from finetune.model import archs, presets

    text = help_text("plan")
    for name in archs.ARCHS:
        assert f"{name.split('_')[0]}_*" in text, name
    assert "the tiny ones" in text and all(f.startswith("tiny") for f in presets.TINY)


def test_no_help_is_cut_short_on_an_80_column_terminal(monkeypatch):
    cut = {
        path: line for path, text in _every_help(80, monkeypatch).items() for line in text.splitlines() if "…" in line
    }
    assert not cut


def test_help_writes_every_default_one_way(monkeypatch):
    rendered = {path: " ".join(text.translate(str.maketrans("│╭╮╰╯─", "      ")).split())
                for path, text in _every_help(250, monkeypatch).items()}  # fmt: skip
    assert not [path for path, text in rendered.items() if "[default:" in text]
    for path, default in [("vertex-spec", "(default: 1)"), ("vertex-spec", "(default: us-central1)"),
                          ("runs", "(default: runs)"), ("bench", "(default: finetune,tutorial)"),
                          ("data", "from 1. (default: 1)")]:  # fmt: skip
        assert default in rendered[path], (path, default)


def test_preset_help_and_refusals_name_the_tiny_presets_and_near_misses():
    from finetune.model import presets

    text = help_text("gemma")
    assert all(name in text for name in presets.TINY)
    for command in ("gemma", "plan"):
        result = invoke(command, "--preset", "gemma_2b")
        assert result.exit_code == 2 and "did you mean gemma_2b_en" in result.stderr, (command, result.stderr)
        result = invoke(command, "--preset", "tiny_gemma4")
        assert result.exit_code == 2 and "did you mean tiny-gemma4" in result.stderr, (command, result.stderr)
        result = invoke(command, "--preset", "qwerty")
        assert result.exit_code == 2 and all(name in result.stderr for name in presets.TINY), result.stderr


# === Advice that fits the command: a message names only options of the command that printed it ===

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _options(command) -> set[str]:
    """Every option a click command takes, as its --help lists them."""
    return {name for parameter in command.params for name in getattr(parameter, "opts", [])} | {"--help"}


def _commands() -> dict:
    """Each subcommand's path (`eval`, `recipes copy`) to its click command."""
    import typer

    group = typer.main.get_command(app)
    found = {}
    for name, command in group.commands.items():
        for sub, inner in getattr(command, "commands", {}).items():
            found[f"{name} {sub}"] = inner
        found[name] = command
    return found


def _message_flags() -> dict[str, set[str]]:
    """Each flag named in a string of the package (its messages, notes and help), with the modules that name it."""
    import ast

    named: dict[str, set[str]] = {}
    for path in sorted((REPO / "finetune").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node) is not None
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                for flag in FLAG.findall(node.value):
                    named.setdefault(flag, set()).add(path.stem)
    return named


# Flags that are not advice to a user of finetune: other tools' (gcloud's, gcsfuse's mount option) and the
# bench's own argument to its worker process.
OTHER_TOOLS = {"--rename-dir-limit", "--config", "--display-name", "--region", "--peak"}


def test_every_flag_a_message_advises_is_an_option_of_some_command():
    """A flag named anywhere in the package (grep '--something' in finetune/) is one a command takes: no advice
    points at an option that was renamed or never existed."""
    taken = set().union(*(_options(command) for command in _commands().values()), {"--version"})
    unknown = {flag: sorted(where) for flag, where in _message_flags().items() if flag not in taken | OTHER_TOOLS}
    assert not unknown, unknown


def test_a_setting_s_flag_the_command_does_not_take_is_named_by_its_key(monkeypatch):
    """Shared code names settings by gemma's flags; eval, plan and vertex-spec print the key they take instead."""
    from finetune import config
    from finetune.training import runs

    def refused(*args, **kwargs):
        raise finetune.UserError(
            "mesh 3x3 needs 9 devices; pass --mesh 1x2 or lower --batch-size, see --help; "
            "or retrain with finetune gemma --mesh 1x1"  # a command spelled out keeps its own flags
        )

    monkeypatch.setattr(runs, "open_on", refused)
    monkeypatch.setattr(config, "load", refused)
    under_eval = runner.invoke(app, ["eval", "--run", "somewhere"])
    assert "pass distribution.mesh 1x2 or lower train.batch_size, see --help" in under_eval.stderr
    assert "retrain with finetune gemma --mesh 1x1" in under_eval.stderr
    under_gemma = runner.invoke(app, ["gemma", "--preset", "tiny"])
    assert "pass --mesh 1x2 or lower --batch-size, see --help" in under_gemma.stderr
    under_plan = runner.invoke(app, ["plan", "--preset", "tiny"])  # plan takes --mesh and --batch-size
    assert "pass --mesh 1x2 or lower --batch-size" in under_plan.stderr


@pytest.mark.parametrize("command", ["eval", "export", "data"])
def test_out_of_memory_advises_the_command_s_own_remedies(command, monkeypatch):
    from finetune.tools import datacheck
    from finetune.training import runs

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 107374182400 bytes")

    monkeypatch.setattr(runs, "open_on", out_of_memory)
    monkeypatch.setattr(datacheck, "report", out_of_memory)
    args = {"eval": ["--run", "r"], "export": ["--run", "r", "--format", "lora", "--output", "o"], "data": ["f"]}
    from finetune.exports import export as export_module

    monkeypatch.setattr(export_module, "check_request", lambda *args: None)
    result = runner.invoke(app, [command, *args[command]])
    assert result.exit_code == 2 and "out of memory" in result.stderr, result.output
    assert set(FLAG.findall(result.stderr)) <= _options(_commands()[command]), result.stderr


def test_every_command_s_errors_become_exit_codes_in_one_place(monkeypatch):
    """One funnel (cli.funneled) for every command: an unexpected error is one line and exit 1, and --debug
    shows its traceback; each command that takes --debug goes through it."""
    import inspect

    import typer

    from finetune import cli
    from finetune.training import runs

    assert inspect.getsource(cli).count("except (Exception, KeyboardInterrupt)") == 1
    for path in _command_paths(typer.main.get_command(app)):
        command = typer.main.get_command(app)
        for name in path:
            command = command.commands[name]
        if any("--debug" in getattr(p, "opts", []) for p in command.params):
            chain = [command.callback]
            while hasattr(chain[-1], "__wrapped__"):
                chain.append(chain[-1].__wrapped__)
            assert any(vars(f).get("funneled") for f in chain), path

    def broken(directory):
        raise RuntimeError("a bug")

    monkeypatch.setattr(runs, "list_runs", broken)
    result = invoke("runs")
    assert result.exit_code == 1 and result.stderr.splitlines() == [
        "error: RuntimeError: a bug",
        "rerun with --debug for the traceback",
    ]
    result = invoke("runs", "--debug")
    assert result.exit_code == 1 and "Traceback" in result.stderr


@pytest.mark.backend_neutral  # the wording is Python's
def test_a_message_names_each_setting_as_the_running_command_takes_it():
    """Shared messages name settings by `finetune gemma`'s flags: a command without the flag names the key instead,
    and `finetune data`, which takes the data as its FILE argument, the file alone (it said `pass data.path`)."""
    import typer.main

    from finetune.cli import for_this_command

    group = typer.main.get_command(app)
    advice = "export it to JSONL elsewhere and pass --data FILE.jsonl; or raise --seq-len"
    with group.make_context("finetune", ["data", "x.jsonl"], resilient_parsing=True) as root:
        with group.commands["data"].make_context("data", ["x.jsonl"], parent=root, resilient_parsing=True):
            assert for_this_command(advice) == "export it to JSONL elsewhere and pass FILE.jsonl; or raise --seq-len"
    with group.make_context("finetune", ["eval"], resilient_parsing=True) as root:
        with group.commands["eval"].make_context("eval", ["--run", "r"], parent=root, resilient_parsing=True):
            assert (
                for_this_command(advice)
                == "export it to JSONL elsewhere and pass --data FILE.jsonl; or raise model.seq_len"
            )
