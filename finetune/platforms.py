"""Where a run happens: credentials, reachability of the hubs we download from, and Vertex AI's contract.

Checked up front so that an offline machine gets a clear message in seconds
instead of a download library's retries.

Vertex AI custom training tells a job where to write through the environment:
AIP_MODEL_DIR (the model artifacts), AIP_CHECKPOINT_DIR and
AIP_TENSORBOARD_LOG_DIR, each a gs:// URL. A hyperparameter tuning trial also
gets CLOUD_ML_TRIAL_ID and CLOUD_ML_HP_METRIC_TAG, and reports its metric
through the cloudml-hypertune package.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path


def reachable(host: str, port: int = 443, timeout: float = 3.0) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def kaggle_credentials_present() -> bool:
    """KAGGLE_USERNAME + KAGGLE_KEY, a token variable, or ~/.kaggle/kaggle.json (values never read here)."""
    if os.environ.get("KAGGLE_USERNAME") and os.environ.get("KAGGLE_KEY"):
        return True
    if os.environ.get("KAGGLE_API_TOKEN"):
        return True
    config_dir = Path(os.environ.get("KAGGLE_CONFIG_DIR", Path.home() / ".kaggle"))
    return (config_dir / "kaggle.json").is_file() or (config_dir / "access_token").is_file()


def in_kagglehub_cache(handle: str) -> bool:
    """kagglehub keeps models under <cache>/models/<owner>/<model>/<framework>/<variation>."""
    cache = Path(os.environ.get("KAGGLEHUB_CACHE", Path.home() / ".cache" / "kagglehub"))
    parts = handle.removeprefix("kaggle://").split("/")
    variation = parts[3] if len(parts) >= 4 else parts[-1]
    return any(cache.glob(f"models/*/*/*/{variation}"))


def use_hugging_face_cache_only_when_offline() -> None:
    """Without a route to the Hub, make `datasets` read its cache instead of retrying for half a minute."""
    if not os.environ.get("HF_HUB_OFFLINE") and not reachable("huggingface.co"):
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["HF_DATASETS_OFFLINE"] = "1"


def vertex_model_dir() -> str | None:
    """AIP_MODEL_DIR: where a Vertex AI job's run goes when --output is not given."""
    return os.environ.get("AIP_MODEL_DIR") or None


def vertex_checkpoint_dir() -> str | None:
    """AIP_CHECKPOINT_DIR: where Vertex AI wants checkpoints; the run's are copied there too."""
    return os.environ.get("AIP_CHECKPOINT_DIR") or None


def vertex_tensorboard_dir() -> str | None:
    """AIP_TENSORBOARD_LOG_DIR: where Vertex AI's TensorBoard reads; the run's logs are copied there."""
    return os.environ.get("AIP_TENSORBOARD_LOG_DIR") or None


def vertex_mirror_dirs() -> list[str]:
    """The Vertex AI directories a run copies parts of itself to."""
    return [d for d in (vertex_checkpoint_dir(), vertex_tensorboard_dir()) if d]


def in_vertex_tuning() -> bool:
    """Whether this process is a trial of a Vertex AI hyperparameter tuning job."""
    return bool(os.environ.get("CLOUD_ML_HP_METRIC_TAG") or os.environ.get("CLOUD_ML_TRIAL_ID"))


def report_tuning_metric(eval_loss: float, step: int) -> None:
    """Tell a Vertex AI tuning job this trial's final eval loss; a note, not a crash, without cloudml-hypertune."""
    if not in_vertex_tuning():
        return
    try:
        import hypertune
    except ImportError:
        print('note: not reporting eval_loss to the tuning job: pip install "finetune[vertex]" (cloudml-hypertune)')
        return
    tag = os.environ.get("CLOUD_ML_HP_METRIC_TAG") or "eval_loss"
    hypertune.HyperTune().report_hyperparameter_tuning_metric(
        hyperparameter_metric_tag=tag, metric_value=eval_loss, global_step=step
    )
    print(f"reported {tag}={eval_loss:.4f} to the Vertex AI tuning job")
