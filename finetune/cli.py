"""The `finetune` command. Flags become a Config; the backend is chosen; run.

No keras import at module level: the backend is fixed at keras' first import,
and it is chosen here, from the flags, before anything imports keras.
"""

from __future__ import annotations

import sys
import traceback
from typing import Optional

import typer

from finetune import config as config_module
from finetune.backend import DEFAULT_BATCH_SIZE
from finetune.errors import UserError
from finetune.presets import LEARNING_RATE

D = config_module.Config()  # the built-in defaults, shown in --help

app = typer.Typer(
    help="Fine-tune Gemma with LoRA on Keras 3 (JAX, PyTorch or TensorFlow).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _default(value) -> str:
    return f"[default: {value}]"


def _flag(help_text: str):
    """An option that defaults to None, so that only flags the user typed override the recipe."""
    return typer.Option(None, help=help_text, show_default=False)


def _fail(error: BaseException, debug: bool):
    """One or two lines and exit 2 for what the user can fix; the traceback only with --debug."""
    if debug:
        traceback.print_exception(error)
    if isinstance(error, KeyboardInterrupt):
        print("interrupted; nothing was saved", file=sys.stderr)
        raise typer.Exit(130)
    if isinstance(error, UserError):
        print(f"error: {error}", file=sys.stderr)
        raise typer.Exit(2)
    from finetune import backend

    if backend.is_out_of_memory(error):
        print("error: out of memory; lower --batch-size (or use --batch-size auto) or --seq-len", file=sys.stderr)
        raise typer.Exit(2)
    if not debug:
        print(f"error: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}", file=sys.stderr)
        print("rerun with --debug for the traceback", file=sys.stderr)
    raise typer.Exit(1)


@app.command()
def gemma(
    backend: Optional[str] = _flag(f"Keras backend: jax, torch or tensorflow. {_default(D.backend)}"),
    preset: Optional[str] = _flag(
        f"keras-hub preset name (gemma_2b_en, gemma2_2b_en, gemma3_1b), kaggle:// handle, local preset directory, or `tiny` (offline). {_default(D.model.preset)}"
    ),
    rank: Optional[int] = _flag(f"LoRA rank. {_default(D.lora.rank)}"),
    alpha: Optional[float] = _flag("LoRA alpha; the update is scaled by alpha/rank. [default: rank]"),
    target: Optional[list[str]] = _flag(
        f"Layer name to adapt; repeat or comma-separate. {_default(','.join(D.lora.targets))}"
    ),
    data: Optional[str] = _flag(
        f"Dolly-style JSONL (path or gs://), hf:NAME, or `sample` (data/dolly-sample.jsonl). {_default(D.data.path)}"
    ),
    template: Optional[str] = _flag(f"Prompt template: dolly, alpaca or gemma-chat. {_default(D.data.template)}"),
    seq_len: Optional[int] = _flag(f"Tokens per training sequence. {_default(D.model.seq_len)}"),
    batch_size: Optional[str] = _flag(
        "Sequences per step, or `auto` to probe the largest that fits. "
        + _default(", ".join(f"{b} {n}" for b, n in DEFAULT_BATCH_SIZE.items()))
    ),
    epochs: Optional[int] = _flag(f"Passes over the training split. {_default(D.train.epochs)}"),
    max_steps: Optional[int] = _flag("Stop after this many steps. [default: no limit]"),
    lr: Optional[float] = _flag(
        "AdamW learning rate. " + _default(f"{LEARNING_RATE['pretrained']:g}; {LEARNING_RATE['tiny']:g} for tiny")
    ),
    eval_fraction: Optional[float] = _flag(
        f"Share of records held out for evaluation. {_default(D.data.eval_fraction)}"
    ),
    seed: Optional[int] = _flag(f"Seed for the split, shuffling and LoRA init. {_default(D.train.seed)}"),
    output: Optional[str] = _flag("Run directory. [default: runs/<timestamp>]"),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a run already in --output."),
    train_on_prompt: bool = typer.Option(
        False, "--train-on-prompt", help="Also train on prompt tokens (default: response tokens only)."
    ),
    drop_context: bool = typer.Option(
        False, "--drop-context", help="Drop records that have a context, as the Keras tutorial does."
    ),
    category: Optional[list[str]] = _flag("Keep only this Dolly category; repeatable. [default: all]"),
    max_records: Optional[int] = _flag("Use at most this many records. [default: all]"),
    precision: Optional[str] = _flag(
        f"auto, float32, mixed_bfloat16 or bfloat16; auto is bf16 on GPU/TPU, float32 on CPU. {_default(D.model.precision)}"
    ),
    xla_mem_fraction: Optional[float] = _flag(
        f"JAX: share of GPU memory XLA may take. {_default(D.train.xla_mem_fraction)}"
    ),
    recipe: Optional[str] = _flag("YAML recipe; flags and --set override it."),
    set_: Optional[list[str]] = typer.Option(
        None, "--set", help="Any config key, e.g. --set train.epochs=2; repeatable.", show_default=False
    ),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
):
    """Fine-tune a Gemma preset with LoRA on Dolly-style data, evaluate it and save the adapter.

    Precedence: built-in defaults < --recipe < --set < named flags.
    """
    try:
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
            "train.batch_size": _batch_size(batch_size),
            "train.epochs": epochs,
            "train.max_steps": max_steps,
            "train.learning_rate": lr,
            "train.seed": seed,
            "train.xla_mem_fraction": xla_mem_fraction,
            "output.dir": output,
            "output.overwrite": overwrite or None,
        }
        overrides.update({k: v for k, v in flags.items() if v is not None})
        cfg = config_module.load(recipe, overrides)
        import finetune

        finetune.run(cfg)
    except typer.Exit:
        raise
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - the one place errors become exit codes
        _fail(error, debug)


@app.command("eval")
def eval_(
    run: str = typer.Option(..., "--run", help="A finished run directory."),
    data: Optional[str] = _flag("Evaluate on all of this JSONL instead of the run's held-out split."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
):
    """Evaluate a saved adapter: per-token loss, perplexity and accuracy over response tokens."""
    try:
        from finetune import backend, runs

        saved = runs.open_run(run)
        backend.select(saved.config.backend, saved.config.train.xla_mem_fraction)
        result = runs.evaluate_run(saved, data)
        print(
            f"eval_loss {result['loss']:.4f}  eval_perplexity {result['perplexity']:.2f}  "
            f"eval_accuracy {result['accuracy']:.4f}  examples {result['examples']}"
        )
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001
        _fail(error, debug)


@app.command()
def generate(
    run: str = typer.Option(..., "--run", help="A finished run directory."),
    prompt: list[str] = typer.Option(..., help="An instruction; it is put in the run's template. Repeatable."),
    max_new_tokens: Optional[int] = typer.Option(None, help="Tokens to generate. [default: the run's]"),
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as is, without the template."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
):
    """Generate from the base model with a saved adapter (greedy)."""
    try:
        from finetune import backend, runs

        saved = runs.open_run(run)
        backend.select(saved.config.backend, saved.config.train.xla_mem_fraction)
        for text in runs.generate(saved, list(prompt), max_new_tokens, raw):
            print(text)
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001
        _fail(error, debug)


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
    app()


if __name__ == "__main__":
    main()
