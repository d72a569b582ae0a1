"""finetune: LoRA fine-tuning of Gemma with Keras 3 and keras-hub, on JAX, PyTorch or TensorFlow.

Notebook use:

    import finetune
    cfg = finetune.load_config("tiny", {"train.epochs": 2})  # a shipped recipe, or a YAML path
    metrics = finetune.run(cfg)

Nothing here imports keras, so the backend named in the config can still be
chosen; import keras yourself only after `run`, or with the same backend.
"""

from finetune.config import Config
from finetune.config import load as load_config
from finetune.errors import RunStopped, UserError

__all__ = ["Config", "RunStopped", "UserError", "load_config", "run"]
__version__ = "0.1.0"


def run(cfg: Config | None = None, resume: bool = False) -> dict:
    """Train, evaluate and save a LoRA adapter as `cfg` says; returns the run's metrics.

    resume: bool. Continue the run in cfg.output.dir from its newest checkpoint
        (see README: Resume). Raises RunStopped when SIGTERM, Ctrl-C or the time
        limit stops training early, after saving a checkpoint.
    """
    from finetune import backend, config

    cfg = cfg or Config()
    config.validate(cfg)  # a Config built by hand in a notebook gets the same checks as a recipe
    backend.select(cfg.backend, cfg.train.xla_mem_fraction)
    from finetune import train

    return train.run(cfg, resume=resume)
