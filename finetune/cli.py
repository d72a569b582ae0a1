"""The `finetune` command. Flags become a Config; the backend is chosen; run.

No keras import at module level: the backend is fixed at keras' first import,
and it is chosen here, from the flags, before anything imports keras.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Optional

import typer

from finetune import config as config_module
from finetune import vertex as vertex_module
from finetune.backend import DEFAULT_BATCH_SIZE
from finetune.errors import RunStopped, UserError
from finetune.plan import DEVICES as PLAN_DEVICES
from finetune.presets import LEARNING_RATE

try:  # recent typer (0.29 here) vendors click: it raises its own copy's exceptions, not the `click` package's
    from typer._click import exceptions as click_exceptions
except ImportError:
    from click import exceptions as click_exceptions

D = config_module.Config()  # the built-in defaults, shown in --help
PRECISION_CHOICES = "|".join(config_module.PRECISIONS)

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
        from finetune import __version__

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


def _default(value) -> str:
    return f"(default: {value})"


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
    if isinstance(error, UserError):
        print(f"error: {error}", file=sys.stderr)
        raise typer.Exit(2)
    from finetune import backend

    if backend.is_out_of_memory(error):
        print(f"error: {out_of_memory}", file=sys.stderr)
        raise typer.Exit(2)
    if not debug:
        print(f"error: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}", file=sys.stderr)
        print("rerun with --debug for the traceback", file=sys.stderr)
    raise typer.Exit(1)


@app.command()
def gemma(
    backend: Optional[str] = _flag(
        "Keras backend: jax, torch or tensorflow. (default: $KERAS_BACKEND if set, else jax)",
        rich_help_panel="Model",
        metavar="jax|torch|tensorflow",
    ),
    preset: Optional[str] = _flag(
        f"keras-hub preset name (gemma_2b_en, gemma2_2b_en, gemma3_1b), kaggle:// handle, local preset directory, or `tiny` (offline). {_default(D.model.preset)}",
        rich_help_panel="Model",
        metavar="NAME|DIR",
    ),
    rank: Optional[int] = _flag(f"LoRA rank. {_default(D.lora.rank)}", rich_help_panel="LoRA"),
    alpha: Optional[float] = _flag(
        "LoRA alpha; the update is scaled by alpha/rank. (default: rank)", rich_help_panel="LoRA"
    ),
    target: Optional[list[str]] = _flag(
        f"Layer name to adapt; repeat or comma-separate. {_default(','.join(D.lora.targets))}",
        rich_help_panel="LoRA",
        metavar="LAYER",
    ),
    data: Optional[str] = _flag(
        "Records: JSONL, a JSON array, CSV or Parquet (a path or gs://), hf:NAME, or `sample` (the shipped "
        "finetune/assets/dolly-sample.jsonl); Dolly, Alpaca, chat, ShareGPT, prompt/completion or text records, "
        f"detected. Check a file with `finetune data FILE`. {_default(D.data.path)}",
        rich_help_panel="Data",
        metavar="FILE|sample|hf:NAME",
    ),
    template: Optional[str] = _flag(
        "Prompt template: auto follows the data (Dolly, Alpaca, the family's chat turns for chat and ShareGPT "
        f"records, none for prompt/completion and text); or dolly, alpaca, gemma-chat, gemma4-chat, none. "
        f"{_default(D.data.template)}",
        rich_help_panel="Data",
        metavar="auto|dolly|alpaca|gemma-chat|gemma4-chat|none",
    ),
    seq_len: Optional[int] = _flag(
        f"Tokens per training sequence. {_default(D.model.seq_len)}", rich_help_panel="Model"
    ),
    batch_size: Optional[str] = _flag(
        "Sequences per step, or `auto` to probe the largest that fits. "
        + _default(", ".join(f"{b} {n}" for b, n in DEFAULT_BATCH_SIZE.items())),
        rich_help_panel="Training",
        metavar="N|auto",
    ),
    epochs: Optional[int] = _flag(
        f"Passes over the training split. {_default(D.train.epochs)}", rich_help_panel="Training"
    ),
    max_steps: Optional[int] = _flag("Stop after this many steps. (default: no limit)", rich_help_panel="Training"),
    lr: Optional[float] = _flag(
        "AdamW learning rate. " + _default(f"{LEARNING_RATE['pretrained']:g}; {LEARNING_RATE['tiny']:g} for tiny"),
        rich_help_panel="Training",
    ),
    eval_fraction: Optional[float] = _flag(
        f"Share of records held out for evaluation. {_default(D.data.eval_fraction)}", rich_help_panel="Data"
    ),
    seed: Optional[int] = _flag(
        f"Seed for the split, shuffling and LoRA init. {_default(D.train.seed)}", rich_help_panel="Training"
    ),
    output: Optional[str] = _flag(
        "Run directory. (default: runs/<timestamp>; /kaggle/working/runs/<timestamp> in a Kaggle notebook)",
        rich_help_panel="Output and checkpoints",
        metavar="DIR",
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Replace a run already in --output (the old one stays until the new one finishes).",
        rich_help_panel="Output and checkpoints",
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue the run in --output from its newest checkpoint, with its settings; "
        "start it there if it has none. --epochs and --max-steps may grow.",
        rich_help_panel="Output and checkpoints",
    ),
    checkpoint_every: Optional[int] = _flag(
        f"Save a checkpoint every N steps, and at each epoch's end. {_default(D.train.checkpoint_every)}",
        rich_help_panel="Output and checkpoints",
    ),
    keep_checkpoints: Optional[int] = _flag(
        f"Keep the newest N checkpoints. {_default(D.train.keep_checkpoints)}", rich_help_panel="Output and checkpoints"
    ),
    time_limit: Optional[str] = _flag(
        "Stop with a checkpoint before this much time, e.g. 11h30m, 90m, or `off`. "
        "(default: 11h30m in a Kaggle notebook, else off)",
        rich_help_panel="Output and checkpoints",
        metavar="DURATION",
    ),
    train_on_prompt: bool = typer.Option(
        False,
        "--train-on-prompt",
        help="Also train on prompt tokens (default: response tokens only).",
        rich_help_panel="Data",
    ),
    drop_context: bool = typer.Option(
        False,
        "--drop-context",
        help="Drop records that have a context, as the Keras tutorial does.",
        rich_help_panel="Data",
    ),
    packing: Optional[str] = _flag(
        "auto, on or off: several examples per row, each attending only to itself (exact); off pads one "
        f"example per row, as the Keras tutorial does. {_default(D.data.packing)}",
        rich_help_panel="Data",
        metavar="auto|on|off",
    ),
    category: Optional[list[str]] = _flag(
        "Keep only this Dolly category; repeatable. (default: all)", rich_help_panel="Data", metavar="NAME"
    ),
    max_records: Optional[int] = _flag("Use at most this many records. (default: all)", rich_help_panel="Data"),
    precision: Optional[str] = _flag(
        "The frozen base's dtype (LoRA is float32): auto is bfloat16 on a TPU, a bf16 GPU or a CPU with bf16 "
        f"units, float16 on a T4 or V100, else float32. {_default(D.model.precision)}",
        rich_help_panel="Model",
        metavar=PRECISION_CHOICES,
    ),
    quantize: Optional[str] = _flag(
        "int4 or int8: load the frozen base quantized, layer by layer (QLoRA-like), to save memory. (default: none)",
        rich_help_panel="Model",
        metavar="int4|int8",
    ),
    remat: Optional[str] = _flag(
        "Recompute each block's activations in the backward pass: on, off, or auto (on when the plan says the "
        f"run would not fit without it). {_default(D.model.remat)}",
        rich_help_panel="Model",
        metavar="auto|on|off",
    ),
    threads: Optional[int] = _flag(
        "PyTorch on CPU: intra-op threads. (default: the physical cores idle at start)", rich_help_panel="Training"
    ),
    xla_mem_fraction: Optional[float] = _flag(
        f"JAX: share of GPU memory XLA may take. {_default(D.train.xla_mem_fraction)}", rich_help_panel="Training"
    ),
    parallel: Optional[str] = _flag(
        "none; data: the model replicated, each batch split over the devices; model: the kernels sharded over "
        f"the mesh's model axis. JAX only. {_default(D.distribution.parallel)}",
        rich_help_panel="Scale out",
        metavar="none|data|model",
    ),
    mesh: Optional[str] = _flag(
        "DATAxMODEL device mesh, e.g. 2x4. (default: all devices on the data axis for data, the model axis for model)",
        rich_help_panel="Scale out",
        metavar="DxM",
    ),
    coordinator: Optional[str] = _flag(
        "Multi-host: host:port of process 0. (default: from CLUSTER_SPEC on Vertex AI, or KERAS_DISTRIBUTION_*)",
        rich_help_panel="Scale out",
        metavar="HOST:PORT",
    ),
    num_processes: Optional[int] = _flag("Multi-host: processes in the job.", rich_help_panel="Scale out"),
    process_id: Optional[int] = _flag(
        "Multi-host: this process's index (0 writes the outputs).", rich_help_panel="Scale out"
    ),
    recipe: Optional[str] = _flag(
        "YAML recipe file, or a shipped recipe by name (`finetune recipes` lists them); flags and --set override it.",
        rich_help_panel="Recipe and diagnostics",
        metavar="FILE|NAME",
    ),
    set_: Optional[list[str]] = typer.Option(
        None,
        "--set",
        help="Any config key, e.g. --set train.epochs=2; repeatable.",
        show_default=False,
        rich_help_panel="Recipe and diagnostics",
        metavar="KEY=VALUE",
    ),
    plan_only: bool = typer.Option(
        False,
        "--plan-only",
        help="Print the run's per-device memory plan (as `finetune plan`) and exit; loads and writes nothing.",
        rich_help_panel="Recipe and diagnostics",
    ),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks.", rich_help_panel="Recipe and diagnostics"),
    verbose: bool = typer.Option(
        False,
        "--verbose",
        help="Also show the frameworks' own log lines (TensorFlow, XLA, SentencePiece).",
        rich_help_panel="Recipe and diagnostics",
    ),
):
    """Fine-tune a Gemma preset with LoRA on instruction, chat or text data, evaluate it and save the adapter.

    Precedence: built-in defaults < --recipe < --set < named flags.
    """
    try:
        # --output, --data and --preset are checked with the rest of the config (config.validate).
        _refuse_empty({"--recipe": recipe, "--mesh": mesh, "--coordinator": coordinator})
        _note_keras_backend(backend)
        overrides = dict(config_module.parse_set(pair) for pair in set_ or [])
        flags = {
            "backend": backend,
            "model.preset": preset,
            "model.seq_len": seq_len,
            "model.precision": precision,
            "lora.rank": rank,
            "lora.alpha": alpha,
            "lora.targets": _split_list(target),
            "data.path": data,
            "data.template": template,
            "data.eval_fraction": eval_fraction,
            "data.max_records": max_records,
            "data.categories": _split_list(category),
            "data.drop_context": drop_context or None,
            "data.train_on_prompt": train_on_prompt or None,
            "data.packing": packing,
            "train.batch_size": _batch_size(batch_size),
            "train.epochs": epochs,
            "train.max_steps": max_steps,
            "train.learning_rate": lr,
            "train.seed": seed,
            "train.xla_mem_fraction": xla_mem_fraction,
            "train.threads": threads,
            "model.quantize": quantize,
            "model.remat": remat,
            "output.dir": output,
            "output.overwrite": overwrite or None,
            "train.checkpoint_every": checkpoint_every,
            "train.keep_checkpoints": keep_checkpoints,
            "train.time_limit": time_limit,
            "distribution.parallel": parallel,
            "distribution.mesh": mesh,
            "distribution.coordinator": coordinator,
            "distribution.num_processes": num_processes,
            "distribution.process_id": process_id,
        }
        overrides.update({k: v for k, v in flags.items() if v is not None})
        base = None
        if resume and plan_only:  # a resume reads (for gs://, downloads) its checkpoints: not a plan's business
            raise UserError("--plan-only plans a new run and reads no checkpoint; drop --resume")
        if resume:
            from finetune import outputs

            base = outputs.settings_to_resume(output)
        cfg = config_module.load(recipe, overrides, base=base)
        if plan_only:  # before finetune.run: no keras, no download, nothing written
            _print_plan(cfg, None, None)
            return
        import finetune

        finetune.run(cfg, resume=resume)
    except typer.Exit:
        raise
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - the one place errors become exit codes
        _fail(error, debug)


@app.command()
def plan(
    preset: Optional[str] = _flag(
        f"gemma_2b_en, gemma_7b_en, gemma2_*, gemma3_* (offline: a table of their shapes), a local preset "
        f"directory, or `tiny`. {_default(D.model.preset)}",
        rich_help_panel="Model",
        metavar="NAME|DIR",
    ),
    seq_len: Optional[int] = _flag(
        f"Tokens per training sequence. {_default(D.model.seq_len)}", rich_help_panel="Model"
    ),
    batch_size: Optional[str] = _flag(
        "Sequences per step, or `auto` for the largest that fits --device-memory. "
        + _default(", ".join(f"{b} {n}" for b, n in DEFAULT_BATCH_SIZE.items())),
        rich_help_panel="Model",
        metavar="N|auto",
    ),
    precision: Optional[str] = _flag(
        f"The frozen base's dtype; auto follows the device. {_default(D.model.precision)}",
        rich_help_panel="Model",
        metavar=PRECISION_CHOICES,
    ),
    quantize: Optional[str] = _flag(
        "int4 or int8: plan a quantized frozen base. (default: none)", rich_help_panel="Model", metavar="int4|int8"
    ),
    remat: Optional[str] = _flag(
        f"Plan blocks recomputed in the backward: on, off, or auto (on when it would not fit without). "
        f"{_default(D.model.remat)}",
        rich_help_panel="Model",
        metavar="auto|on|off",
    ),
    backend: Optional[str] = _flag(
        "Keras backend the run would use. (default: $KERAS_BACKEND if set, else jax)",
        rich_help_panel="Model",
        metavar="jax|torch|tensorflow",
    ),
    rank: Optional[int] = _flag(f"LoRA rank. {_default(D.lora.rank)}", rich_help_panel="LoRA"),
    target: Optional[list[str]] = _flag(
        f"Layer name to adapt; repeat or comma-separate. {_default(','.join(D.lora.targets))}",
        rich_help_panel="LoRA",
        metavar="LAYER",
    ),
    parallel: Optional[str] = _flag(
        f"none (one device), data or model. {_default(D.distribution.parallel)}",
        rich_help_panel="Devices",
        metavar="none|data|model",
    ),
    mesh: Optional[str] = _flag(
        "DATAxMODEL device mesh, e.g. 1x8; its sizes multiply to the device count.",
        rich_help_panel="Devices",
        metavar="DxM",
    ),
    devices: Optional[int] = _flag(
        "Devices to plan for, without --mesh: all on the data axis (data) or the model axis (model). "
        "(default: the mesh's, or 1)",
        rich_help_panel="Devices",
    ),
    device_memory: Optional[str] = _flag(
        "Memory of one device, to say whether the plan fits: a size (16GB, 16GiB) or a kind: "
        f"{', '.join(PLAN_DEVICES)}, cpu. (default: no verdict)",
        rich_help_panel="Devices",
        metavar="SIZE|KIND",
    ),
    json_out: bool = typer.Option(
        False,
        "--json",
        help="Print the plan as JSON (bytes per device) instead of the table.",
        rich_help_panel="Output",
    ),
    recipe: Optional[str] = _flag(
        "YAML recipe file, or a shipped recipe by name; flags and --set override it.",
        rich_help_panel="Recipe and diagnostics",
        metavar="FILE|NAME",
    ),
    set_: Optional[list[str]] = typer.Option(
        None,
        "--set",
        help="Any config key, e.g. --set lora.rank=8; repeatable.",
        show_default=False,
        rich_help_panel="Recipe and diagnostics",
        metavar="KEY=VALUE",
    ),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks.", rich_help_panel="Recipe and diagnostics"),
    verbose: bool = typer.Option(
        False,
        "--verbose",
        help="Accepted for symmetry with the other commands; plan loads no framework.",
        rich_help_panel="Recipe and diagnostics",
    ),
):
    """Print each device's memory for a run, layout by layout, without loading weights (offline, no keras)."""
    try:
        _refuse_empty({"--recipe": recipe, "--mesh": mesh, "--device-memory": device_memory})
        overrides = dict(config_module.parse_set(pair) for pair in set_ or [])
        flags = {
            "backend": backend,
            "model.preset": preset,
            "model.seq_len": seq_len,
            "model.precision": precision,
            "model.quantize": quantize,
            "model.remat": remat,
            "lora.rank": rank,
            "lora.targets": _split_list(target),
            "train.batch_size": _batch_size(batch_size),
            "distribution.parallel": parallel,
            "distribution.mesh": mesh,
        }
        overrides.update({k: v for k, v in flags.items() if v is not None})
        # A run refuses --batch-size auto with --parallel (its probe has no mesh); a plan finds that size.
        auto = overrides.get("train.batch_size") == "auto"
        if auto:
            del overrides["train.batch_size"]
        cfg = config_module.load(recipe, overrides)
        if auto:
            cfg.train.batch_size = "auto"
        _print_plan(cfg, devices, device_memory, json_out)
    except typer.Exit:
        raise
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001
        _fail(error, debug)


def _print_plan(cfg, devices: int | None, device_memory: str | None, json_out: bool = False) -> None:
    from finetune import plan as plan_module

    target = plan_module.device(device_memory) if device_memory is not None else None
    planned = plan_module.make(cfg, devices, target)
    if json_out:
        print(json.dumps(plan_module.as_dict(planned), indent=2))
    else:
        print(plan_module.table(planned))


@app.command()
def bench(
    arch: str = typer.Option(
        "cpu-small", help="Gemma architecture, random weights: tiny, cpu-small, gemma-2b, gemma-7b."
    ),
    tokenizer: Optional[str] = _flag("SentencePiece .spm tokenizer file. (default: the tiny model's)"),
    data: str = typer.Option("sample", help="Dolly-style JSONL to train on, or `sample`."),
    seq_len: int = typer.Option(512, help="Tokens per row."),
    batch_size: int = typer.Option(8, help="Rows per step."),
    steps: int = typer.Option(10, help="Timed steps per row of the table."),
    warmup: int = typer.Option(2, help="Steps run before timing (the first compiles)."),
    rank: int = typer.Option(4, help="LoRA rank, on query and value."),
    backends: Optional[str] = _flag("Comma-separated backends. (default: every installed one)"),
    recipes: str = typer.Option(
        "finetune,tutorial",
        help="finetune (this tool's settings), tutorial (the Keras tutorial's), hf (the peer: transformers + PEFT, "
        "packed, bf16 base; needs the hf extra).",
    ),
    levers: str = typer.Option(
        "", help="Comma-separated levers, each one more finetune row: packing, precision, int4, int8, remat."
    ),
    quantize: str = typer.Option("", help="int4 or int8: the finetune rows' base loaded quantized. (default: none)"),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write the rows as a JSON list to this file."),
    plot_path: Optional[str] = typer.Option(None, "--plot", help="Draw tokens/s and loss per step to this PNG."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
    verbose: bool = typer.Option(
        False, "--verbose", help="Also show the frameworks' own log lines (TensorFlow, XLA, SentencePiece)."
    ),
):
    """Train the same LoRA workload on each backend, one process each, and compare tokens/s, MFU and memory."""
    try:
        from finetune import bench as bench_module

        workload = bench_module.Workload(
            arch=arch, tokenizer=tokenizer or "", data=data, seq_len=seq_len, batch_size=batch_size,
            steps=steps, warmup=warmup, rank=rank, quantize=quantize,
        )  # fmt: skip
        chosen = _split_list([backends]) if backends else bench_module.installed_backends()
        bench_module.run(
            workload, chosen, _split_list([recipes]) or [], _split_list([levers]) or [], json_path, plot_path
        )
    except typer.Exit:
        raise
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001
        _fail(error, debug)


@app.command("eval")
def eval_(
    run: str = typer.Option(..., "--run", help="A finished run directory."),
    data: Optional[str] = _flag("Evaluate on all of this JSONL instead of the run's held-out split."),
    backend: Optional[str] = _flag(
        "jax, torch or tensorflow: an adapter trained on one loads on the others. (default: the run's backend)",
        metavar="jax|torch|tensorflow",
    ),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
    verbose: bool = typer.Option(
        False, "--verbose", help="Also show the frameworks' own log lines (TensorFlow, XLA, SentencePiece)."
    ),
):
    """Evaluate a saved adapter: per-token loss, perplexity and accuracy over response tokens."""
    try:
        from finetune import runs

        _refuse_empty({"--run": run}, fix="pass --run DIR of a finished run")
        _refuse_empty({"--data": data})
        saved = runs.open_on(run, backend)
        result = runs.evaluate_run(saved, data)
        print(
            f"eval_loss {result['loss']:.4f}  eval_perplexity {result['perplexity']:.2f}  "
            f"eval_accuracy {result['accuracy']:.4f}  examples {result['examples']}"
        )
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001
        _fail(error, debug)


@app.command("data")
def data_(
    file: str = typer.Argument(..., help="A data file (JSONL, JSON array, CSV, Parquet; a path or gs://), or hf:NAME."),
    preset: Optional[str] = _flag(
        f"The preset whose tokenizer counts the tokens and whose chat turns chat records take. "
        f"{_default(D.model.preset)}",
        metavar="NAME|DIR",
    ),
    template: Optional[str] = _flag(
        f"Prompt template, as for `finetune gemma`. {_default(D.data.template)}",
        metavar="auto|dolly|alpaca|gemma-chat|gemma4-chat|none",
    ),
    seq_len: Optional[int] = _flag(f"Tokens per training sequence. {_default(D.model.seq_len)}"),
    example: int = typer.Option(1, "--example", help="Which record to render, from 1.", metavar="N"),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
    verbose: bool = typer.Option(
        False, "--verbose", help="Also show the frameworks' own log lines (TensorFlow, XLA, SentencePiece)."
    ),
):
    """Check a data file before training: its format, records, token lengths, what packing saves, and one
    example with the text the loss is taken on marked."""
    try:
        from finetune import datacheck
        from finetune.templates import TEMPLATES

        _refuse_empty({"FILE": file, "--preset": preset, "--template": template})
        template = template or D.data.template
        if template != "auto" and template not in TEMPLATES:
            raise UserError(f"unknown template {template!r}; choose auto or one of {', '.join(TEMPLATES)}")
        seq_len = D.model.seq_len if seq_len is None else seq_len
        if seq_len < 8:
            raise UserError(f"--seq-len must be at least 8, got {seq_len}")
        for line in datacheck.report(file, preset or D.model.preset, template, seq_len, example=example):
            print(line)
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001
        _fail(error, debug)


@app.command()
def generate(
    run: str = typer.Option(..., "--run", help="A finished run directory."),
    prompt: list[str] = typer.Option(..., help="An instruction; it is put in the run's template. Repeatable."),
    max_new_tokens: Optional[int] = typer.Option(None, help="Tokens to generate. (default: the run's)"),
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as is, without the template."),
    backend: Optional[str] = _flag(
        "jax, torch or tensorflow: an adapter trained on one loads on the others. (default: the run's backend)",
        metavar="jax|torch|tensorflow",
    ),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
    verbose: bool = typer.Option(
        False, "--verbose", help="Also show the frameworks' own log lines (TensorFlow, XLA, SentencePiece)."
    ),
):
    """Generate from the base model with a saved adapter (greedy)."""
    try:
        from finetune import runs

        _refuse_empty({"--run": run}, fix="pass --run DIR of a finished run")
        if any(not p.strip() for p in prompt):
            raise UserError('--prompt is empty; give an instruction, e.g. --prompt "What is the capital of Vietnam?"')
        if max_new_tokens is not None and max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be at least 1, got {max_new_tokens}; try --max-new-tokens 48")
        saved = runs.open_on(run, backend)
        for text in runs.generate(saved, list(prompt), max_new_tokens, raw):
            print(text)
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001
        _fail(error, debug, "out of memory while generating; lower --max-new-tokens, or shorten the prompt")


@app.command("export")
def export_(
    run: str = typer.Option(..., "--run", help="A finished run directory."),
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
        "With --format gguf: the weights' type, f16, bf16 or f32 (norms stay f32). (default: f16)",
        metavar="f16|bf16|f32",
    ),
    backend: Optional[str] = _flag(
        "jax, torch or tensorflow: an adapter trained on one loads on the others. (default: the run's backend)",
        metavar="jax|torch|tensorflow",
    ),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
    verbose: bool = typer.Option(
        False, "--verbose", help="Also show the frameworks' own log lines (TensorFlow, XLA, SentencePiece)."
    ),
):
    """Export a run's adapter for keras-hub, transformers, PEFT or llama.cpp; nothing is written if a check fails."""
    try:
        from finetune import export

        _refuse_empty({"--run": run}, fix="pass --run DIR of a finished run")
        target = export(run, format, output, overwrite, base, backend, dtype)
        print(f"exported {run} as {format}{' (base model)' if base else ''} to {target}")
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001
        _fail(error, debug)


@app.command("vertex-spec")
def vertex_spec(
    recipe: str = typer.Option(..., help="A shipped recipe by name, or a YAML file the image holds at that path."),
    machine_type: str = typer.Option(..., help="Machine type, e.g. g2-standard-8 (one L4) or a2-highgpu-1g."),
    accelerator_type: Optional[str] = _flag(
        "Vertex AI accelerator name, e.g. NVIDIA_L4, NVIDIA_TESLA_T4, TPU_V5_LITEPOD. (default: none, a CPU)"
    ),
    accelerator_count: Optional[int] = _flag("Accelerators per machine. (default: 1 with --accelerator-type, else 0)"),
    replicas: int = typer.Option(1, help="Machines; more than 1 needs distribution.parallel data or model."),
    image: Optional[str] = _flag(
        f"Training container image URI (the repository's Dockerfile). {_default(vertex_module.DEFAULT_IMAGE)}"
    ),
    region: str = typer.Option(vertex_module.DEFAULT_REGION, help="Vertex AI region."),
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
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
    verbose: bool = typer.Option(
        False, "--verbose", help="Also show the frameworks' own log lines (TensorFlow, XLA, SentencePiece)."
    ),
):
    """Print a Vertex AI custom job spec (JSON) that trains a recipe, and the gcloud command that submits it."""
    try:
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
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001
        _fail(error, debug)


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
def recipes_copy(
    name: str = typer.Argument(..., help="A shipped recipe, e.g. tiny."),
    dest: str = typer.Argument(..., help="The file to write, or a directory to put NAME.yaml in."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
    verbose: bool = typer.Option(
        False, "--verbose", help="Also show the frameworks' own log lines (TensorFlow, XLA, SentencePiece)."
    ),
):
    """Copy a shipped recipe out to edit, as torchtune's `tune cp` does; never overwrites DEST."""
    try:
        source = config_module.shipped_recipe(name)
        target = Path(dest) / source.name if Path(dest).is_dir() else Path(dest)
        if not target.parent.is_dir():
            raise UserError(f"directory {target.parent} does not exist; create it or pick another DEST")
        try:
            # "x" refuses an existing file at open time, so a file made meanwhile is not clobbered either.
            with open(target, "xb") as f:
                f.write(source.read_bytes())
        except FileExistsError:
            raise UserError(f"{target} already exists; remove it or pick another DEST") from None
        print(f"copied {source.stem} to {target}; run it with: finetune gemma --recipe {target}")
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001
        _fail(error, debug)


@app.command("runs")
def runs_(
    directory: str = typer.Argument("runs", help="A run directory, or a directory of runs."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
    verbose: bool = typer.Option(
        False, "--verbose", help="Also show the frameworks' own log lines (TensorFlow, XLA, SentencePiece)."
    ),
):
    """List runs and their state: finished, running, checkpointed at step N, stopped or failed."""
    try:
        from finetune import runs

        rows = runs.list_runs(directory)
        if not rows:
            print(f"no runs in {directory}")
            return
        print(runs.format_table(rows))
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001
        _fail(error, debug)


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


def _split_list(values):
    if not values:
        return None
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def _batch_size(value):
    if value is None or value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise UserError(f"--batch-size must be a positive integer or `auto`, got {value!r}") from None


def main():
    # Before any framework is imported; commands accept --verbose so that it passes the parser.
    from finetune import backend, quiet

    if "--verbose" in sys.argv[1:]:
        quiet.keep_verbose()  # the Python API's own install (backend.select) included
    quiet.install()
    backend.LEAVE_OUT_TENSORFLOW = True  # a process of our own: no TensorFlow beside JAX or PyTorch
    app()


if __name__ == "__main__":
    main()
