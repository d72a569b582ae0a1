"""finetune: LoRA fine-tuning of Gemma with Keras 3 and keras-hub, on JAX, PyTorch or TensorFlow.

Notebook use:

    import finetune
    cfg = finetune.load_config("tiny", {"train.epochs": 2, "output.dir": "runs/first"})  # or a YAML path
    metrics = finetune.run(cfg)
    finetune.evaluate("runs/first")                     # held-out metrics of the finished run
    finetune.generate("runs/first", ["What is LoRA?"])  # completions with its adapter
    lm = finetune.load("runs/first")                    # the keras-hub model, adapter loaded
    finetune.export("runs/first", "merged", "exported/first")  # also lora, hf, peft, gguf
    finetune.publish("runs/first", "hf://you/first", dry_run=True)  # the files and the model card

Nothing here imports keras, so the backend named in the config can still be
chosen; import keras yourself only after `run`, or with the same backend.
"""

import contextlib

from finetune import config as _config
from finetune.config import Config
from finetune.config import load as load_config
from finetune.platform.errors import RunStopped, UserError
from finetune.platform.version import __version__ as __version__

__all__ = [
    "Config",
    "RunStopped",
    "UserError",
    "evaluate",
    "export",
    "generate",
    "load",
    "load_config",
    "publish",
    "run",
]


def _argument(name: str, flag: str, kind=str, **declared) -> _config.Setting:
    """An argument of these functions, where the command line has the flag `flag`."""
    return _config.Setting(key=name, type=kind, default=None, help="", flag=flag, **declared)


_RUN_DIR = _argument("run_dir", "--run", metavar="DIR")
_BACKEND = _argument("backend", "--backend", choices=_config.BACKENDS)


def _keeps_the_caller_s_state(function):
    """`function` leaves keras' global dtype policy, and Python's and NumPy's global random generators, as the
    caller had them: a run sets its precision's policy (backend.select) and seeds every generator with its seed
    (keras.utils.set_random_seed), and a notebook's next model was built in that policy (a bf16 run left
    mixed_bfloat16 behind) and its next draws were the run's."""
    import functools
    import random
    import sys

    import numpy as np

    @functools.wraps(function)
    def kept(*args, **kwargs):
        keras = sys.modules.get("keras")  # not imported here: the call chooses the backend
        before = keras.config.dtype_policy() if keras is not None else None
        drawn = random.getstate(), np.random.get_state()
        try:
            return function(*args, **kwargs)
        finally:
            random.setstate(drawn[0])
            np.random.set_state(drawn[1])
            keras = sys.modules.get("keras")
            if keras is not None:
                keras.config.set_dtype_policy(before if before is not None else "float32")  # keras' own default

    return kept


@contextlib.contextmanager
def _in_python_words(*arguments: _config.Setting, with_settings: bool = False):
    """A refusal raised to a Python caller names the argument or config key to change where the command line's
    names a flag: `pass output.overwrite=True`, not `pass --overwrite`."""
    try:
        yield
    except UserError as error:
        error.args = (_config.in_python_words(str(error), arguments, with_settings),)
        raise


def run(cfg: Config | dict | None = None, resume: bool = False) -> dict:
    """Train, evaluate and save a LoRA adapter as `cfg` says; returns the run's metrics.

    cfg: Config, or a dict of settings as in a recipe: nested, or with dotted keys ({"lora.rank": 8}).
    resume: bool. Continue the run in cfg.output.dir from its newest checkpoint
        (see README: Resume). Raises RunStopped when SIGTERM, Ctrl-C or the time
        limit stops training early, after saving a checkpoint; SIGTERM or Ctrl-C
        before training stops the run with nothing written.
    """
    with _in_python_words(_argument("resume", "--resume", bool), with_settings=True):
        return run_as_command(cfg, resume)


@_keeps_the_caller_s_state
def run_as_command(cfg: Config | dict | None = None, resume: bool = False) -> dict:
    """`run` as `finetune gemma` calls it: its refusals name the command line's flags."""
    from finetune import config
    from finetune.model import presets
    from finetune.platform import backend

    if cfg is not None and not isinstance(cfg, (Config, dict)):
        raise UserError(f"cfg must be a Config (finetune.load_config(...)) or a dict of settings, got "
                        f"{type(cfg).__name__} {cfg!r:.60}; for a recipe, pass finetune.load_config({cfg!r:.40})")  # fmt: skip
    # A Config edited by hand in a notebook gets the recipe's checks: types, then ranges, naming the key.
    cfg = config.from_dict(cfg if isinstance(cfg, dict) else (cfg or Config()).to_dict())
    cfg = config.absolute_paths(cfg)  # config.yaml then names the same files from any directory
    from finetune.training import loop  # numpy's alone: its handlers are in before the frameworks' imports

    try:
        with loop.StopSignals() as signals:
            # A Ctrl-C raised inside an import leaves its module half made, and the notebook's next call fails
            # on it: a stop while the frameworks load is recorded, and taken once they have.
            with loop.StopSignals.deferred():
                backend.select(cfg.backend, cfg.train.xla_mem_fraction, presets.frameworks_needed(cfg.model.preset))
                from finetune.training import train
            signals.check()
            return train.run(cfg, resume=resume)
    finally:
        if cfg.distribution.parallel != "none":  # a notebook's next run starts on one device again
            import keras

            keras.distribution.set_distribution(None)


def _open(run_dir, backend: str | None = None):
    """Read a run and choose the backend to use it on: `backend`, keras' if already loaded, else the run's."""
    from finetune.training import runs

    return runs.open_on(run_dir, backend)


@_keeps_the_caller_s_state
def evaluate(run_dir, data: str | None = None, backend: str | None = None, generate: int = 0) -> dict:
    """Per-token loss, perplexity and accuracy over response tokens of a finished run's adapter.

    data: str. Evaluate on all records of this file instead of the run's held-out records.
    backend: str. jax, torch or tensorflow; by default the one keras is loaded with, else the run's.
    generate: int. Also answer the first this many held-out prompts (greedy) and score the answers against the
        references with ROUGE-L: `rougeL` in the result.
    """
    from finetune.training import runs

    if isinstance(generate, bool) or not isinstance(generate, int) or generate < 0:
        raise UserError(f"generate must be a number of prompts, 0 or more, got {generate!r}")
    arguments = (_RUN_DIR, _BACKEND, _argument("data", "--data", metavar="FILE"), _argument("generate", "--generate"))
    with _in_python_words(*arguments):
        return runs.evaluate_run(_open(run_dir, backend), data, generate)


@_keeps_the_caller_s_state
def generate(
    run_dir, prompts: str | list[str], max_new_tokens: int | None = None, raw: bool = False, backend: str | None = None,
    images: list | None = None, audio: str | None = None, system: str | None = None, tools=None, think: bool = False,
    **sampling,
) -> list[str]:  # fmt: skip
    """Completions from a finished run's model; each prompt goes in the run's template unless `raw`.

    system: a system prompt before every prompt, as `finetune generate --system`: a chat template's runs only.
    tools: tool schemas the model may call (a list of them, or a JSON file's path), as `finetune generate
        --tools`: declared as gemma4-chat declares a tool-chat record's.
    think: the template's thinking switch on (gemma4-chat's <|think|>), as `finetune generate --think`: how a run
        trained on records with thinking (`reasoning_content`) is asked.

    images: paths of pictures that go with every prompt, where its `<image>` is (else before it), as
        `finetune generate --image`; the run's preset must see images (tiny-gemma3-vision, tiny-gemma4-vision,
        tiny-gemma3n-vision, gemma3_4b and up).
    audio: the path of an audio file that goes with every prompt, where its `<audio>` is (else before it), as
        `finetune generate --audio`; the run's preset must hear (tiny-gemma4-audio, tiny-gemma3n-audio).

    sampling: greedy by default; temperature (float), top_p (float), top_k (int) sample with keras-hub's
        samplers, and seed (int) makes the sampling repeatable, as `finetune generate`'s flags of the same names.
    """
    from finetune.training import runs

    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompts or any(not isinstance(p, str) or not p.strip() for p in prompts):
        raise UserError("prompts must be non-empty strings, e.g. finetune.generate(run_dir, ['What is LoRA?'])")
    tokens = _argument("max_new_tokens", "--max-new-tokens", int)
    names = [_argument(item.key, item.flag) for item in _config.settings(_config.Sampling)]
    pictures, clip = _argument("images", "--image"), _argument("audio", "--audio")
    framing = _argument("system", "--system"), _argument("tools", "--tools"), _argument("think", "--think", bool)
    with _in_python_words(_RUN_DIR, _BACKEND, tokens, _argument("raw", "--raw", bool), pictures, clip, *framing,
                          *names):  # fmt: skip
        given = runs.Given(tuple(images or ()), audio, system, tools, bool(think))
        sampled = _config.Sampling.checked(sampling)
        return runs.generate(_open(run_dir, backend), prompts, max_new_tokens, raw, sampled, given)


@_keeps_the_caller_s_state
def load(run_dir, backend: str | None = None):
    """The keras-hub causal LM of a finished run, with its adapter loaded and its preprocessor attached.

    backend: str. jax, torch or tensorflow; by default the one keras is loaded with, else the run's. An
        adapter trained on one backend loads on the others.
    """
    from finetune.training import runs

    with _in_python_words(_RUN_DIR, _BACKEND):
        lm, preprocessor = runs.load_model(_open(run_dir, backend))
    lm.preprocessor = preprocessor
    return lm


@_keeps_the_caller_s_state
def export(run_dir, format: str, output, overwrite: bool = False, base: bool = False, backend=None, dtype=None):
    """Write a finished run's adapter as `format` into the directory `output`; returns its path.

    format: str. lora (adapter.lora.h5 and adapter.json, checked), merged (a keras-hub preset with the update
        merged in), hf (transformers' format, merged), peft (a PEFT adapter for the transformers model) or gguf
        (the merged model as model.gguf for llama.cpp and Ollama).
    overwrite: bool. Replace what `output` holds; without it a non-empty `output` is refused.
    base: bool. With format hf: the run's base model alone, for the peft adapter.
    backend: str. The Keras backend to build the model on; by default the one keras is loaded with, else the
        run's.
    dtype: str. With format gguf: f16 (the default), bf16, q8_0 or f32 for the matrices.
    Every check runs first: a refused export raises UserError and writes nothing.
    """
    from finetune.exports.export import FORMATS, Request, export

    arguments = (
        _RUN_DIR, _BACKEND, _argument("format", "--format", choices=FORMATS), _argument("output", "--output",
        metavar="DIR"), _argument("overwrite", "--overwrite", bool), _argument("base", "--base", bool),
        _argument("dtype", "--dtype"),
    )  # fmt: skip
    with _in_python_words(*arguments):
        return export(run_dir, Request(format, output, overwrite, base, dtype), backend)


@_keeps_the_caller_s_state
def publish(run_dir, to: str, format: str = "keras", dry_run: bool = False, private: bool = False, backend=None):
    """Upload a finished run to the Hugging Face Hub or Kaggle Models with a model card written from its record;
    returns what went up (`files`: (name, bytes) pairs, `card`: the README.md, `url`).

    to: str. hf://USER/NAME or kaggle://OWNER/MODEL/keras/VARIATION.
    format: str. keras (a keras-hub preset with the adapter merged in; merged is the same), lora, hf, peft or
        gguf, as `export` writes them; Kaggle takes keras.
    dry_run: bool. Make the files and the card, upload nothing; no credentials needed.
    private: bool. Make a new Hugging Face repository private.
    backend: str. The Keras backend to export on; by default the one keras is loaded with, else the run's.
    Every check runs first: a refusal raises UserError with nothing uploaded.
    """
    from finetune.exports.publish import FORMS, Request, publish

    arguments = (
        _RUN_DIR, _BACKEND, _argument("to", "--to", metavar="HANDLE"), _argument("format", "--format",
        choices=tuple(FORMS)), _argument("dry_run", "--dry-run", bool), _argument("private", "--private", bool),
    )  # fmt: skip
    with _in_python_words(*arguments):
        return publish(run_dir, Request(to, format, dry_run, private), backend)
