"""The `finetune` command. Flags become a Config; the backend is chosen; run.

The flags of the run's settings are not declared here: `with_settings` derives
them from the config's fields (and `bench`'s from bench.Workload's), so a flag,
its recipe key, its --help entry and its check come from one declaration.

No keras import at module level: the backend is fixed at keras' first import,
and it is chosen here, from the flags, before anything imports keras.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import signal
import sys
import traceback
import typing
from pathlib import Path
from typing import Annotated, Optional

import typer

from finetune import config as config_module
from finetune.model import archs
from finetune.platform import storage
from finetune.platform.errors import RunStopped, UserError
from finetune.tools import bench as bench_module
from finetune.tools import vertex as vertex_module
from finetune.training.plan import DEVICES as PLAN_DEVICES

try:  # recent typer (0.29 here) vendors click: it raises its own copy's exceptions, not the `click` package's
    from typer._click import exceptions as click_exceptions
    from typer._click.globals import get_current_context
except ImportError:
    from click import exceptions as click_exceptions
    from click.globals import get_current_context

D = config_module.Config()  # the built-in defaults

# Pydantic's error types behind typer's "Input should be a valid integer, unable to parse ...".
_PARSED_AS = {
    "int_parsing": "integer",
    "int_from_float": "integer",
    "float_parsing": "number",
    "bool_parsing": "boolean",
}


class _Commands(typer.core.TyperGroup):
    """The top-level group, so that click's own usage errors follow the project's rule too.

    Click answers `--rank nan` or `--epoch 2` with a usage block and `Error: ...`
    over four lines; we print one `error:` line and where to find help, exit 2.
    """

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            # Not standalone, click raises its errors to us and returns exit codes instead of exiting.
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click_exceptions.NoArgsIsHelpError as error:  # bare `finetune`: the help, as click shows it
            error.show()
            sys.exit(error.exit_code)
        except click_exceptions.UsageError as error:
            print(f"error: {_usage_message(error)}", file=sys.stderr)
            command = error.ctx.command_path if error.ctx is not None else "finetune"
            print(f"see {command} --help", file=sys.stderr)
            sys.exit(2)
        except click_exceptions.ClickException as error:
            print(f"error: {error.format_message()}", file=sys.stderr)
            sys.exit(error.exit_code)
        except typer.Abort:  # end of input at a prompt
            print("interrupted", file=sys.stderr)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


def _usage_message(error) -> str:
    """Click's message on one line, in our words: invalid value for '--rank': 'nan' is not a valid integer."""
    cause = error.__cause__
    if isinstance(error, click_exceptions.BadParameter) and hasattr(cause, "errors") and cause.errors():
        first = cause.errors()[0]
        if first.get("type") in _PARSED_AS and "input" in first:
            error.message = f"{first['input']!r} is not a valid {_PARSED_AS[first['type']]}"
    message = (error.format_message().strip().splitlines() or ["bad usage"])[0]
    return message[0].lower() + message[1:]


app = typer.Typer(
    cls=_Commands,
    help="Fine-tune Gemma with LoRA on Keras 3 (JAX, PyTorch or TensorFlow).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _print_version(value: bool):
    if value:
        from finetune.platform.version import __version__

        print(f"finetune {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print finetune's version and exit."
    ),
):
    """Fine-tune Gemma with LoRA on Keras 3 (JAX, PyTorch or TensorFlow)."""


def _what_to_type(option, ctx) -> str:
    """The help's word for what an option takes, where its declaration names none: N, NUMBER or TEXT, and nothing
    for a switch. typer 0.2x would print the Python type (<int>, <str>, <bool>), which tells a user nothing."""
    del ctx
    if getattr(option, "is_flag", False) or getattr(option, "count", False):
        return ""
    word = {"int": "N", "float": "NUMBER"}.get(option.bare_type(), "TEXT")
    return word + ("..." if option.type_descriptor.is_list else "")


# Every subcommand's options and arguments, declared here or in any later one, show a word, not a type: one
# rule for all.
typer.core.TyperOption.display_type = _what_to_type
typer.core.TyperArgument.display_type = _what_to_type


# === Flags derived from the config ===
#
# A setting's field in config.py (or bench.Workload) declares its option once; `with_settings` turns each into
# a Typer option, as HfArgumentParser turns dataclass fields into argparse arguments for `trl sft`.


def with_settings(schema, *under: str):
    """Give a command one flag for each setting of dataclass `schema` that declares a flag, built from its field.

    under: dotted prefixes (`model`, `lora.rank`) that pick the settings; none picks them all.
    The command takes the flags as `settings`: dotted key to what the user typed, None where a flag was left out
    (`_typed` reads them). They come first in --help, in the order of the fields and their panels.
    """
    chosen = [s for s in config_module.settings(schema) if s.flag and _is_under(s.key, under)]

    def decorate(command):
        by_name = {item.key.replace(".", "__"): item for item in chosen}
        own = inspect.signature(command, eval_str=True)

        @functools.wraps(command)
        def with_flags(**kwargs):
            return command(settings={item.key: kwargs.pop(name) for name, item in by_name.items()}, **kwargs)

        flags = [_parameter(name, item) for name, item in by_name.items()]
        rest = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own.parameters.values() if p.name != "settings"]
        with_flags.__signature__ = own.replace(parameters=flags + rest)
        return with_flags

    return decorate


def _is_under(key: str, prefixes: tuple[str, ...]) -> bool:
    return not prefixes or any(key == p or key.startswith(p + ".") for p in prefixes)


def _parameter(name: str, item: config_module.Setting) -> inspect.Parameter:
    """The Typer option for a setting: defaulting to None (or off), so only flags the user typed override a recipe."""
    kind = _flag_type(item.type)
    repeat = " Repeat it." if item.whole or kind == list[float] else " Repeat it or comma-separate."
    help_text = item.help + (repeat if typing.get_origin(kind) is list else "")
    if item.default_words():
        help_text += f" (default: {item.default_words()})"
    option = typer.Option(
        item.flag,
        help=help_text,
        rich_help_panel=item.panel,
        metavar=item.metavar or ("|".join(item.choices) if item.choices else None),
        show_default=False,
    )
    annotation = Annotated[bool, option] if kind is bool else Annotated[Optional[kind], option]
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=False if kind is bool else None, annotation=annotation
    )


def _flag_type(hint):
    """What a setting's flag parses: its type without None, and text where it takes a number or a word."""
    if typing.get_origin(hint) is list:
        return hint
    kinds = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return kinds[0] if len(kinds) == 1 else str


def _typed(schema, settings: dict) -> dict:
    """The flags the user typed, by dotted key, as their settings take them: lists split at commas, and an integer
    where a setting takes a number or a word (`--batch-size 8`, `--batch-size auto`). A flag left out, or a switch
    left off, is not there, so it does not override a recipe."""
    typed = {}
    for item in config_module.settings(schema):
        value = settings.get(item.key)
        if isinstance(value, list):
            value = value if item.whole or item.type != list[str] else _split_list(value)
        elif value is not None and {int, str} <= set(typing.get_args(item.type)):
            value = _number_or_word(item, value)
        if value is not None and value is not False:
            typed[item.key] = value
    return typed


def _number_or_word(item: config_module.Setting, text: str):
    try:
        return int(text)
    except ValueError:
        message = item.problem(text, name=item.flag)  # named by the flag: it is the text typed that is wrong
        if message:
            raise UserError(message) from None
        return text


def _overrides(pairs: list[str] | None, settings: dict) -> dict:
    """--set pairs, then the named flags typed: dotted keys for config.load, where later keys win."""
    overrides = dict(config_module.parse_set(pair) for pair in pairs or [])
    overrides.update(_typed(config_module.Config, settings))
    return overrides


# === Options that are not settings, declared once for every command that takes them ===

RECIPE_PANEL = "Recipe and diagnostics"
Recipe = Annotated[
    Optional[list[str]],  # one, refused where repeated (the_recipe): the last would win silently
    typer.Option(
        "--recipe",
        help="YAML recipe file, or a shipped recipe by name (`finetune recipes` lists them); flags and --set "
        "override it.",
        rich_help_panel=RECIPE_PANEL,
        metavar="FILE|NAME",
        show_default=False,
    ),
]
SetPairs = Annotated[
    Optional[list[str]],
    typer.Option(
        "--set",
        help="Any config key, e.g. --set train.epochs=2; repeatable.",
        rich_help_panel=RECIPE_PANEL,
        metavar="KEY=VALUE",
        show_default=False,
    ),
]
Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks.")]
Verbose = Annotated[
    bool, typer.Option("--verbose", help="Also show the frameworks' own log lines (TensorFlow, XLA, SentencePiece).")
]
RunDir = Annotated[str, typer.Option("--run", help="A finished run directory: a path or gs://BUCKET/PATH.")]
RunBackend = Annotated[
    Optional[str],
    typer.Option(
        "--backend",
        help="jax, torch or tensorflow: an adapter trained on one loads on the others. (default: the run's backend)",
        metavar="|".join(config_module.BACKENDS),
        show_default=False,
    ),
]


def _flag(help_text: str, rich_help_panel: str | None = None, metavar: str | None = None):
    """An option that defaults to None, so that only flags the user typed override the recipe."""
    return typer.Option(None, help=help_text, show_default=False, rich_help_panel=rich_help_panel, metavar=metavar)


TRAINING_OOM = "out of memory; lower --batch-size (or use --batch-size auto) or --seq-len"


def _fail(error: BaseException, debug: bool, out_of_memory: str = TRAINING_OOM):
    """One or two lines and exit 2 for what the user can fix; the traceback only with --debug.

    out_of_memory: what to say when `error` is the device or host running out of memory: the remedies of the
        subcommand that failed (generate has no --batch-size).
    """
    if debug:
        traceback.print_exception(error)
    if isinstance(error, KeyboardInterrupt):
        print("interrupted", file=sys.stderr)
        raise typer.Exit(130)
    if isinstance(error, RunStopped):
        print(str(error), file=sys.stderr)
        raise typer.Exit(error.exit_code)
    if isinstance(error, BrokenPipeError):  # the reader went away (`finetune data FILE | head`): nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush would fail again
        raise typer.Exit(0)
    if isinstance(error, UserError):
        print(f"error: {for_this_command(str(error))}", file=sys.stderr)
        raise typer.Exit(2)
    from finetune.platform import backend

    if backend.is_out_of_memory(error):
        print(f"error: {out_of_memory}", file=sys.stderr)
        raise typer.Exit(2)
    if not debug:
        print(f"error: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}", file=sys.stderr)
        print("rerun with --debug for the traceback", file=sys.stderr)
    raise typer.Exit(1)


# A setting's flag, and the key a recipe, --set and a run's config.yaml name it by.
SETTING_KEYS = {item.flag: item.key for item in config_module.settings(config_module.Config) if item.flag}


def funneled(out_of_memory: str = TRAINING_OOM):
    """Every command's errors become exit codes here, once (as TRL's commands share one TrainingCommand).

    out_of_memory: what to say when the device or host runs out of memory: the remedies of this command (generate
        has no --batch-size). The command's own `debug` flag decides whether the traceback is shown.
    """

    def decorate(command):
        @functools.wraps(command)
        def funneled_command(*args, **kwargs):
            try:
                return command(*args, **kwargs)
            except typer.Exit:
                raise
            except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - the one place errors become exit codes
                _fail(error, kwargs.get("debug", False), out_of_memory)

        funneled_command.funneled = True
        return funneled_command

    return decorate


def for_this_command(message: str) -> str:
    """`message` as the running command prints it: a setting's flag that this command does not take is named by
    its key instead (`--mesh` is `distribution.mesh`), as the recipe, --set or the run's config.yaml holds it.

    Shared code (the config's checks, the data's) names settings by their flags, as `finetune gemma` takes
    them; `finetune plan` or `vertex-spec` take most through --set, and `finetune eval` reads them from the run.
    """
    context = get_current_context(silent=True)
    if context is None:
        return message
    taken = {name for parameter in context.command.params for name in getattr(parameter, "opts", [])}
    arguments = {parameter.name for parameter in context.command.params if parameter.param_type_name == "argument"}

    def named(match):
        flag, space = match.group(1), match.group(2)
        if flag == "--data" and "file" in arguments and flag not in taken:  # `finetune data FILE`: the file itself
            return ""
        return (SETTING_KEYS[flag] if flag in SETTING_KEYS and flag not in taken else flag) + space

    # From a command the message spells out on (`retrain it with: finetune gemma --recipe R`), flags are its own.
    commands = getattr(context.find_root().command, "commands", {})
    spelled = re.search(rf"\bfinetune ({'|'.join(map(re.escape, commands))})\b", message) if commands else None
    cut = spelled.start() if spelled else len(message)
    return FLAG.sub(named, message[:cut]) + message[cut:]


FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)( ?)")


@app.command()
@with_settings(config_module.Config)
@funneled()
def gemma(
    settings: dict,
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue the run in --output from its newest checkpoint, with its settings; "
        "start it there if it has none. --epochs and --max-steps may grow.",
        rich_help_panel=config_module.OUTPUT,
    ),
    recipe: Recipe = None,
    set_: SetPairs = None,
    plan_only: bool = typer.Option(
        False,
        "--plan-only",
        help="Print the run's per-device memory plan (as `finetune plan`) and exit; loads and writes nothing.",
        rich_help_panel=RECIPE_PANEL,
    ),
    debug: Debug = False,
    verbose: Verbose = False,
):
    """Fine-tune a Gemma preset with LoRA on instruction, chat or text data, evaluate it and save the adapter.

    Precedence: built-in defaults < --recipe < --set < named flags.
    """
    # The settings' own flags (--output, --data, --mesh, ...) are checked with the rest of the config.
    recipe = the_recipe(recipe)
    _refuse_empty({"--recipe": recipe})
    _note_keras_backend(settings["backend"])
    overrides = _overrides(set_, settings)
    if resume and plan_only:  # a resume reads (for gs://, downloads) its checkpoints: not a plan's business
        raise UserError("--plan-only plans a new run and reads no checkpoint; drop --resume")
    base = None
    if resume:
        from finetune.training import outputs

        base = outputs.settings_to_resume(settings["output.dir"])
        _note_resumed_backend(settings["backend"], base)
    cfg = config_module.load(recipe, overrides, base=base)
    if plan_only:  # before finetune.run: no keras, no download, nothing written
        from finetune.methods import registry

        registry.check(cfg)  # what the run would refuse of these settings, the plan refuses too
        _check_local_reads(cfg)
        from finetune.platform import backend

        # the run trains here: on a machine without a GPU or TPU, its CPU and memory decide (precision included)
        _print_plan(cfg, None, "cpu" if backend.no_accelerator_here() else None)
        return
    import finetune

    finetune.run_as_command(cfg, resume=resume)


def _check_local_reads(cfg) -> None:
    """What --plan-only can check on this machine of what the run would refuse, reading but writing nothing: a
    local --output that holds a run (without --overwrite) or cannot be written, and GRPO's --reward functions,
    which load (a FILE.py runs; run:DIR is read, not built). A gs:// output is left to the run."""
    from finetune.methods import registry, rewards
    from finetune.platform import storage
    from finetune.training import outputs

    if cfg.output.dir is not None and not storage.is_staged(cfg.output.dir):
        outputs.check_target(cfg.output.dir, cfg.output.overwrite, False)
    method = registry.get(cfg.train.method)
    if method.prompted:
        rewards.load(cfg.train.reward, cfg.train.reward_weights, method.constants(cfg.train)["max_completion_length"])


# The families `finetune plan` has shapes for, as preset name patterns: gemma_*, gemma2_*, ...
_PLANNED = list(dict.fromkeys(name.split("_")[0] + "_*" for name in archs.ARCHS))
PLAN_HELP = (
    "Print each device's memory for a run, layout by layout, without loading weights (offline, no keras).\n\n"
    f"The {', '.join(_PLANNED[:-1])} and {_PLANNED[-1]} presets, the tiny ones and preset directories are planned "
    "from their shapes, offline; --batch-size auto finds the largest batch that fits --device-memory."
)

# What `finetune plan` takes of a run's settings: those that change the memory a device needs.
PLANNED = ("backend", "model", "lora.rank", "lora.targets", "data.images", "data.image_tokens", "data.audio_seconds", "train.batch_size", "train.method",
           "train.num_generations", "train.max_completion_length", "distribution.parallel", "distribution.mesh")  # fmt: skip


@app.command(help=PLAN_HELP)
@with_settings(config_module.Config, *PLANNED)
@funneled()
def plan(
    settings: dict,
    devices: Optional[int] = _flag(
        "Devices to plan for, without --mesh: all on the data axis (data) or the model axis (model). "
        "(default: the mesh's, or 1)",
        config_module.SCALE_OUT,
    ),
    device_memory: Optional[str] = _flag(
        "Memory of one device, to say whether the plan fits: a size (16GB, 16GiB) or a kind: "
        f"{', '.join(PLAN_DEVICES)}, cpu. (default: no verdict)",
        config_module.SCALE_OUT,
        metavar="SIZE|KIND",
    ),
    json_out: bool = typer.Option(
        False,
        "--json",
        help="Print the plan as JSON (bytes per device) instead of the table.",
        rich_help_panel="Output",
    ),
    recipe: Recipe = None,
    set_: SetPairs = None,
    debug: Debug = False,
    verbose: Verbose = False,
):
    """`finetune plan` (its help is PLAN_HELP, which names the families archs.py has shapes for)."""
    recipe = the_recipe(recipe)
    _refuse_empty({"--recipe": recipe, "--device-memory": device_memory})
    overrides = _overrides(set_, settings)
    # A run refuses --batch-size auto with --parallel (its probe has no mesh); a plan finds that size.
    auto = overrides.get("train.batch_size") == "auto"
    if auto:
        del overrides["train.batch_size"]
    cfg = config_module.load(recipe, overrides)
    if auto:
        cfg.train.batch_size = "auto"
    _print_plan(cfg, devices, device_memory, json_out)


DOES_NOT_FIT = 3  # the exit code of a plan that does not fit its device, so that a job script can stop there


def _print_plan(cfg, devices: int | None, device_memory: str | None, json_out: bool = False) -> None:
    """Print the plan; exit DOES_NOT_FIT after it when it does not fit the device given (none given: no verdict)."""
    from finetune.training import plan as plan_module

    target = plan_module.device(device_memory) if device_memory is not None else None
    planned = plan_module.make(cfg, devices, target)
    if json_out:
        print(json.dumps(plan_module.as_dict(planned), indent=2))
    else:
        print(plan_module.table(planned))
    if planned.fits is False:
        raise typer.Exit(DOES_NOT_FIT)


@app.command()
@with_settings(bench_module.Workload)
@funneled()
def bench(
    settings: dict,
    backends: Optional[str] = _flag("Comma-separated backends. (default: every installed one)"),
    recipes: Optional[str] = typer.Option(
        None,
        help="finetune (this tool's settings), tutorial (the Keras tutorial's), hf (the peer: transformers + PEFT, "
        "packed, its strongest attention installed (--peer); needs the hf extra); a preference --method benches finetune alone. "
        "(default: finetune,tutorial)",
        show_default=False,
    ),
    levers: str = typer.Option(
        "",
        help="Comma-separated levers, each one more finetune row: packing (off), grouped (packing off, batches of "
        "like length: --group-by-length), precision, int4, int8, remat, compile, stock (PyTorch: keras' own "
        "per-op host work, without finetune's lean ops).",
    ),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write the rows as a JSON list to this file."),
    plot_path: Optional[str] = typer.Option(None, "--plot", help="Draw tokens/s and loss per step to this PNG."),
    debug: Debug = False,
    verbose: Verbose = False,
):
    """Train the same LoRA workload on each backend, one process each, and compare tokens/s, MFU and memory."""
    workload = bench_module.Workload(**_typed(bench_module.Workload, settings))
    chosen = (_split_list([backends]) or []) if backends is not None else bench_module.installed_backends()
    recipes = bench_module.default_recipes(workload) if recipes is None else recipes
    bench_module.run(workload, chosen, _split_list([recipes]) or [], _split_list([levers]) or [], json_path, plot_path)


@app.command("eval")
@funneled("out of memory while evaluating at the run's batch size; use a device with more memory")
def eval_(
    run: RunDir,
    data: Optional[str] = _flag(
        "Evaluate on all of this data file (any format --data takes) instead of the run's held-out records."
    ),
    generate: int = typer.Option(
        0,
        "--generate",
        help="Also answer the first N held-out prompts (greedy) and score the answers against the references with "
        "ROUGE-L (rougeL). (default: 0, none)",
        metavar="N",
        show_default=False,
    ),
    backend: RunBackend = None,
    debug: Debug = False,
    verbose: Verbose = False,
):
    """Evaluate a saved adapter: per-token loss, perplexity and accuracy over response tokens; with --generate,
    ROUGE-L of its answers."""
    from finetune.methods import registry
    from finetune.training import runs

    _refuse_empty({"--run": run}, fix="pass --run DIR of a finished run")
    _refuse_empty({"--data": data})
    if generate < 0:
        raise UserError(f"--generate must not be negative, got {generate}; pass a number of prompts, e.g. 8")
    saved = runs.open_on(run, backend)
    result = runs.evaluate_run(saved, data, generate)
    rouge = f"  rougeL {result['rougeL']:.4f} ({result['generated']} answers)" if "rougeL" in result else ""
    method = registry.get(saved.config.train.method)
    shown = "  ".join(f"eval_{name} {result[name]:.{2 if name == 'perplexity' else 4}f}" for name in method.held_out)
    print(f"eval_loss {result['loss']:.4f}  {shown}  {method.examples} {result['examples']}{rouge}")
    print(f"evaluated on {runs.where(saved)}", file=sys.stderr)


@app.command("data")
@with_settings(config_module.Config, "model.preset", "data.template", "model.seq_len", "data.split")
@funneled("out of memory while counting tokens; lower --seq-len, or check a part of the file")
def data_(
    settings: dict,
    file: str = typer.Argument(..., help="A data file (JSONL, JSON array, CSV, Parquet; a path or gs://), or hf:NAME."),
    example: int = typer.Option(
        1, "--example", help="Which record to render, from 1. (default: 1)", metavar="N", show_default=False
    ),
    debug: Debug = False,
    verbose: Verbose = False,
):
    """Check a data file before training: its format, records, token lengths, what packing saves, and one
    example with the text the loss is taken on marked.

    The preset's tokenizer counts the tokens, and chat records take its family's turns.
    """
    from finetune.tools import datacheck

    _refuse_empty({"FILE": file})
    typed = _typed(config_module.Config, settings)
    preset = typed.get("model.preset", D.model.preset)
    template = typed.get("data.template", D.data.template)
    seq_len = typed.get("model.seq_len", D.model.seq_len)
    split = typed.get("data.split", D.data.split)
    config_module.check("model.preset", preset)
    config_module.check("data.template", template)
    config_module.check("model.seq_len", seq_len, name="--seq-len")
    config_module.check("data.split", split, name="--data-split")
    if os.environ.get("KERAS_BACKEND"):  # keras loads the tokenizer on it
        config_module.check("backend", os.environ["KERAS_BACKEND"])
    for line in datacheck.report(file, preset, template, seq_len, example=example, split=split):
        print(line)


@app.command()
@with_settings(config_module.Sampling)
@funneled("out of memory while generating; lower --max-new-tokens, or shorten the prompt")
def generate(
    settings: dict,
    run: RunDir,
    prompt: list[str] = typer.Option(..., help="An instruction; it is put in the run's template. Repeatable."),
    max_new_tokens: Optional[int] = typer.Option(None, help="Tokens to generate. (default: the run's)"),
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as is, without the template."),
    image: list[str] = typer.Option(
        [], "--image", help="A picture that goes with every prompt, where its <image> is (else before it). Repeatable."
    ),
    audio: Optional[str] = typer.Option(
        None,
        "--audio",
        help="An audio file (WAV, FLAC...) that goes with every prompt, where its <audio> is (else before it).",
    ),
    system: Optional[str] = typer.Option(
        None,
        "--system",
        help="A system prompt before every prompt, as the run's chat template puts one.",
        metavar="TEXT",
    ),  # fmt: skip
    tools: Optional[str] = typer.Option(
        None,
        "--tools",
        help="A JSON file of tool schemas the model may call (a list, as a tool-chat record's `tools`), declared "
        "as the run's template declares them (gemma4-chat).",
        metavar="FILE",
    ),
    think: bool = typer.Option(
        False,
        "--think",
        help="Turn on the template's thinking switch (gemma4-chat's <|think|>), as a record with reasoning_content "
        "trained: how a run trained on thinking is asked.",
    ),
    backend: RunBackend = None,
    debug: Debug = False,
    verbose: Verbose = False,
):
    """Generate from the base model with a saved adapter: greedy, or sampled with --temperature, --top-p or --top-k.

    Several prompts print labelled: `[1] prompt`, then its answer.
    """
    from finetune.training import runs

    _refuse_empty({"--run": run}, fix="pass --run DIR of a finished run")
    if any(not p.strip() for p in prompt):
        raise UserError('--prompt is empty; give an instruction, e.g. --prompt "What is the capital of Vietnam?"')
    config_module.check("train.max_new_tokens", max_new_tokens, name="--max-new-tokens")
    sampling = config_module.Sampling.checked(settings)
    saved = runs.open_on(run, backend)
    given = runs.Given(tuple(image), audio, system, tools, think)
    answers = runs.generate(saved, list(prompt), max_new_tokens, raw, sampling, given)
    for number, (text, answer) in enumerate(zip(prompt, answers), start=1):
        if len(prompt) > 1:
            print(f"[{number}] {text}")
        print(answer)
    print(f"generated on {runs.where(saved)}", file=sys.stderr)
    if sampling.greedy and sampling.seed is not None:
        print("note: --seed seeds sampling, and these answers are greedy (the most likely token each step); "
              "sample with --temperature, --top-p or --top-k", file=sys.stderr)  # fmt: skip


@app.command("predict")
@funneled("out of memory while predicting at the run's batch size; use a device with more memory")
def predict_(
    run: RunDir,
    data: str = typer.Option(..., "--data", help="The records to label (any format --data takes).", metavar="FILE"),
    output: str = typer.Option(
        ..., "--output", help="The JSON Lines file to write, one line a record.", metavar="FILE"
    ),  # fmt: skip
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace --output if it exists."),
    backend: RunBackend = None,
    debug: Debug = False,
    verbose: Verbose = False,
):
    """Label records with a classifier run (--method classify): each one's predicted label and every class's
    probability, one JSON line a record, in order; the data file is only read."""
    from finetune.training import runs

    _refuse_empty({"--run": run}, fix="pass --run DIR of a finished run")
    _refuse_empty({"--data": data, "--output": output})
    saved = runs.open_on(run, backend)
    count = runs.predict_run(saved, data, output, overwrite)
    print(f"predicted {count} records to {output}")
    print(f"predicted on {runs.where(saved)}", file=sys.stderr)


@app.command("export")
@funneled("out of memory while exporting; export on a machine with more memory")
def export_(
    run: RunDir,
    format: str = typer.Option(
        ...,
        "--format",
        help="lora (the adapter, checked), merged (a keras-hub preset), hf (transformers), peft (a PEFT adapter), "
        "gguf (llama.cpp and Ollama).",
        metavar="lora|merged|hf|peft|gguf",
    ),
    output: str = typer.Option(..., "--output", help="The directory to write.", metavar="DIR"),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace what --output already holds."),
    base: bool = typer.Option(
        False, "--base", help="With --format hf: the run's base model alone, for the peft adapter to apply to."
    ),
    dtype: Optional[str] = _flag(
        "With --format gguf: the weights' type, f16, bf16, q8_0 or f32 (norms stay f32); q4_k_m and the other "
        "K-quants are made from the f16 file by llama.cpp's llama-quantize. (default: f16)",
        metavar="f16|bf16|q8_0|f32",
    ),
    backend: RunBackend = None,
    debug: Debug = False,
    verbose: Verbose = False,
):
    """Export a run's adapter for keras-hub, transformers, PEFT or llama.cpp; nothing is written if a check fails."""
    from finetune.exports.export import Request, export  # its refusals name the flags, the API's its arguments

    _refuse_empty({"--run": run}, fix="pass --run DIR of a finished run")
    target = export(run, Request(format, output, overwrite, base, dtype), backend)
    print(f"exported {run} as {format}{' (base model)' if base else ''} to {target}")


@app.command("publish")
@funneled("out of memory while exporting for the upload; publish on a machine with more memory")
def publish_(
    run: RunDir,
    to: str = typer.Option(
        ...,
        "--to",
        help="Where to: hf://USER/NAME on the Hugging Face Hub, or kaggle://OWNER/MODEL/keras/VARIANT for a "
        "variation of a model on Kaggle Models.",
        metavar="HANDLE",
    ),
    format: str = typer.Option(
        "keras",
        "--format",
        help="keras (a keras-hub preset with the adapter merged in; merged is the same), lora, hf, peft or gguf, as "
        "finetune export writes them; Kaggle takes keras. (default: keras)",
        metavar="FORMAT",
        show_default=False,
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="List the files and where they would go, and print the model card; upload nothing."
    ),
    private: bool = typer.Option(False, "--private", help="Make a new Hugging Face repository private."),
    backend: RunBackend = None,
    debug: Debug = False,
    verbose: Verbose = False,
):
    """Upload a finished run to the Hugging Face Hub or Kaggle Models, with a model card written from its record.

    The files are exported into a temporary directory; the credentials are HF_TOKEN (or `hf auth login`) and
    KAGGLE_USERNAME with KAGGLE_KEY (or ~/.kaggle/kaggle.json), never printed or written.
    """
    from finetune.exports import publish

    _refuse_empty({"--run": run}, fix="pass --run DIR of a finished run")
    _refuse_empty({"--to": to}, fix=f"pass {publish.HANDLES}")
    done = publish.publish(run, publish.Request(to, format, dry_run, private), backend)
    print(publish.listing(done))
    if dry_run:
        print(f"\n{publish.README}:\n")
        print(done.card, end="")
        print("dry run: nothing was uploaded", file=sys.stderr)
    else:
        print(f"published {run} to {done.destination}: {done.url}")


@app.command("vertex-spec")
@funneled()
def vertex_spec(
    recipe: str = typer.Option(..., help="A shipped recipe by name, or a YAML file the image holds at that path."),
    machine_type: str = typer.Option(..., help="Machine type, e.g. g2-standard-8 (one L4) or a2-highgpu-1g."),
    accelerator_type: Optional[str] = _flag(
        "Vertex AI accelerator name, e.g. NVIDIA_L4, NVIDIA_TESLA_T4, TPU_V5_LITEPOD. (default: none, a CPU)"
    ),
    accelerator_count: Optional[int] = _flag("Accelerators per machine. (default: 1 with --accelerator-type, else 0)"),
    replicas: int = typer.Option(
        1, help="Machines; more than 1 needs distribution.parallel data or model. (default: 1)", show_default=False
    ),
    image: Optional[str] = _flag(
        "Training container image URI: the repository's Dockerfile, built and pushed. (default: "
        "finetune/finetune:latest in project PROJECT's Artifact Registry in --region; replace PROJECT in the spec)"
    ),
    region: str = typer.Option(
        vertex_module.DEFAULT_REGION,
        help=f"Vertex AI region. (default: {vertex_module.DEFAULT_REGION})",
        show_default=False,
    ),
    output: Optional[str] = _flag(
        "Run directory, gs://BUCKET/PATH. (default: none; the run then writes to AIP_MODEL_DIR)", metavar="GS_PATH"
    ),
    set_: Optional[list[str]] = typer.Option(
        None,
        "--set",
        help="A config key for the job, e.g. --set train.epochs=2; repeatable.",
        show_default=False,
        metavar="KEY=VALUE",
    ),
    debug: Debug = False,
    verbose: Verbose = False,
):
    """Print a Vertex AI custom job spec (JSON) that trains a recipe, and the gcloud command that submits it."""
    _refuse_empty({"--recipe": recipe, "--image": image, "--region": region, "--output": output})
    settings = list(set_ or [])
    count = accelerator_count if accelerator_count is not None else (1 if accelerator_type else 0)
    machine = vertex_module.Machine(machine_type, accelerator_type, count)
    vertex_module.check(recipe, machine, replicas, output, settings)
    spec = vertex_module.job_spec(
        recipe, machine, replicas, image or vertex_module.DEFAULT_IMAGE.format(region=region), output, settings
    )
    print(json.dumps(spec, indent=2))
    if not vertex_module.shipped(recipe):
        print(
            f"note: recipe {recipe} is not a shipped one: the image must hold it at that path "
            "(COPY it in), or use a shipped recipe with --set",
            file=sys.stderr,
        )
    if image is None:
        print("note: no --image; replace PROJECT in imageUri with your project, or pass --image", file=sys.stderr)
    if output is None:
        print(
            "note: no --output; the run writes to AIP_MODEL_DIR, which Vertex AI sets only for a job with a "
            "base output directory: pass --output gs://BUCKET/PATH to choose",
            file=sys.stderr,
        )
    command = vertex_module.gcloud_command(region, vertex_module.display_name(recipe))
    print(f"submit it, saved as spec.json (> spec.json), with:\n  {command}", file=sys.stderr)


recipes_app = typer.Typer(
    help="The shipped recipes: list them, or copy one out to edit.", add_completion=False, rich_markup_mode=None
)
app.add_typer(recipes_app, name="recipes")


@recipes_app.callback(invoke_without_command=True)
def recipes(ctx: typer.Context):
    """List the shipped recipes; `finetune recipes copy NAME DEST` copies one out to edit."""
    if ctx.invoked_subcommand is not None:
        return
    shipped = config_module.shipped_recipes()
    width = max(map(len, shipped))
    for name, path in shipped.items():
        print(f"{name:<{width}}  {config_module.recipe_summary(path)}")
    print("\nrun one: finetune gemma --recipe NAME; edit one: finetune recipes copy NAME DEST")


@recipes_app.command("copy")
@funneled()
def recipes_copy(
    name: str = typer.Argument(..., help="A shipped recipe, e.g. tiny."),
    dest: str = typer.Argument(..., help="The file to write, or a directory to put NAME.yaml in."),
    debug: Debug = False,
    verbose: Verbose = False,
):
    """Copy a shipped recipe out to edit, as torchtune's `tune cp` does; never overwrites DEST."""
    source = config_module.shipped_recipe(name)
    _refuse_empty({"DEST": dest}, fix="pass the file to write, or a directory to put it in")
    try:
        into = Path(dest).is_dir()
    except OSError:  # a name too long for the file system, which check_output names
        into = False
    target = Path(dest) / source.name if into else Path(dest)
    storage.check_output(str(target), "DEST")
    try:
        # "x" refuses an existing file at open time, so a file made meanwhile is not clobbered either.
        with open(target, "xb") as f:
            f.write(source.read_bytes())
    except FileExistsError:
        raise UserError(f"{target} already exists; remove it or pick another DEST") from None
    print(f"copied {source.stem} to {target}; run it with: finetune gemma --recipe {target}")


@app.command("runs")
@funneled()
def runs_(
    directory: str = typer.Argument(
        "runs",
        help="A run directory, or a directory of runs: a path or gs://BUCKET/PATH. (default: runs)",
        show_default=False,
    ),
    debug: Debug = False,
    verbose: Verbose = False,
):
    """List runs and their state: finished, running, checkpointed at step N, stopped or failed."""
    from finetune.training import runs

    rows = runs.list_runs(directory)
    if not rows:
        print(f"no runs in {directory}")
        return
    print(runs.format_table(rows))


def the_recipe(given: list[str] | None) -> str | None:
    """The one --recipe given, or None; two are refused: one would replace the other whole, not merge with it."""
    if given and len(given) > 1:
        raise UserError(f"--recipe is given {len(given)} times ({', '.join(given)}); give one recipe, and change "
                        "its settings with --set or flags")  # fmt: skip
    return given[0] if given else None


def _refuse_empty(flags: dict, fix: str = "give it a value or leave the flag out") -> None:
    """An unset shell variable gives `--output ""`, which would otherwise mean the current directory."""
    for flag, value in flags.items():
        if value is not None and not value.strip():
            raise UserError(f"{flag} is empty (an unset shell variable?); {fix}")


def _note_keras_backend(flag: str | None) -> None:
    """Keras users expect KERAS_BACKEND to choose; say so when --backend overrides it."""
    env = os.environ.get("KERAS_BACKEND")
    if flag in config_module.BACKENDS and env and env != flag:
        print(f"note: --backend {flag} overrides KERAS_BACKEND={env}", file=sys.stderr)


def _note_resumed_backend(flag: str | None, base: dict | None) -> None:
    """A resume trains on the checkpoint's backend unless --backend names another: say so where KERAS_BACKEND,
    which a Keras user expects to choose, names another."""
    env, then = os.environ.get("KERAS_BACKEND"), (base or {}).get("backend")
    if flag is None and then and env in config_module.BACKENDS and env != then:
        print(f"note: resuming on {then}, the backend the run trained on; KERAS_BACKEND={env} is not used "
              f"(--backend {env} would resume there)", file=sys.stderr)  # fmt: skip


def _split_list(values):
    if not values:
        return None
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def _one_line_paragraphs(typer_app: typer.Typer) -> None:
    """Each paragraph of every command's help on one line, for rich to wrap to the terminal: rich keeps a
    docstring's line breaks, so one wrapped at 120 columns in the source broke mid-sentence in --help."""
    for info in typer_app.registered_commands:
        text = info.help or inspect.getdoc(info.callback) or ""
        info.help = "\n\n".join(" ".join(paragraph.split()) for paragraph in text.split("\n\n"))
    for group in typer_app.registered_groups:
        _one_line_paragraphs(group.typer_instance)


_one_line_paragraphs(app)


def main():
    # Before any framework is imported; commands accept --verbose so that it passes the parser.
    from finetune.platform import backend, quiet

    if "--verbose" in sys.argv[1:]:
        quiet.keep_verbose()  # the Python API's own install (backend.select) included
    quiet.install()
    backend.LEAVE_OUT_OTHER_FRAMEWORKS = True  # a process of our own: only its backend's framework
    try:
        app()
    finally:
        # The exit code is decided: a Ctrl-C that arrives while the interpreter shuts down (a second one, close
        # behind the first) would raise in the frameworks' exit hooks and print their traceback.
        signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":
    main()
