"""Where a run happens: credentials, reachability of the hubs we download from, Kaggle notebooks and Vertex AI.

Checked up front so that an offline machine gets a clear message in seconds
instead of a download library's retries. In a Kaggle notebook a run reads a
model attached under /kaggle/input instead of downloading it, writes under
/kaggle/working (the part of the disk a notebook keeps), and takes Kaggle
credentials from the notebook's secrets.

Vertex AI custom training tells a job where to write through the environment:
AIP_MODEL_DIR (the model artifacts), AIP_CHECKPOINT_DIR and
AIP_TENSORBOARD_LOG_DIR, each a gs:// URL. A hyperparameter tuning trial also
gets CLOUD_ML_TRIAL_ID and CLOUD_ML_HP_METRIC_TAG, and reports its metric
through the cloudml-hypertune package.
"""

from __future__ import annotations

import glob
import json
import os
import socket
from pathlib import Path

# Kaggle mounts attached models read-only at <input>/<model>/<framework>/<variation>/<version>,
# and keeps what a notebook writes under <working>. The variables move them for tests.
KAGGLE_INPUT = "/kaggle/input"
KAGGLE_WORKING = "/kaggle/working"
# The notebook secrets kagglehub reads, when the notebook's owner has added them (Add-ons > Secrets).
KAGGLE_SECRETS = ("KAGGLE_USERNAME", "KAGGLE_KEY")


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


def in_kaggle_notebook() -> bool:
    """Kaggle sets KAGGLE_KERNEL_RUN_TYPE (Interactive or Batch) in every notebook session."""
    return bool(os.environ.get("KAGGLE_KERNEL_RUN_TYPE"))


def kaggle_input() -> Path:
    return Path(os.environ.get("FINETUNE_KAGGLE_INPUT") or KAGGLE_INPUT)


def kaggle_working() -> Path:
    return Path(os.environ.get("FINETUNE_KAGGLE_WORKING") or KAGGLE_WORKING)


def runs_root() -> Path:
    """Where a run without --output goes: /kaggle/working/runs in a Kaggle notebook, else ./runs.

    A notebook's current directory is /kaggle/working already, but a notebook
    that changed it would otherwise lose its runs when the session ends.
    """
    return kaggle_working() / "runs" if in_kaggle_notebook() else Path("runs")


def attached_preset(handle: str) -> Path | None:
    """The keras-hub preset directory attached under /kaggle/input for a preset name or kaggle:// handle.

    A name (gemma_2b_en) is the variation, in any model and framework; a
    handle (kaggle://keras/gemma/keras/gemma_2b_en/2) also fixes the model and,
    when it names one, the version. Of several versions the newest wins.
    """
    parts = handle.removeprefix("kaggle://").split("/") if handle.startswith("kaggle://") else []
    if parts and len(parts) < 4:
        return None  # not owner/model/framework/variation[/version]: nothing to match
    model, framework, variation = (glob.escape(p) for p in parts[1:4]) if parts else ("*", "*", glob.escape(handle))
    version = glob.escape(parts[4]) if len(parts) > 4 else "*"
    found = [c.parent for c in kaggle_input().glob(f"{model}/{framework}/{variation}/{version}/config.json")]
    found = [path for path in found if _is_keras_hub_preset(path)]
    return max(found, key=_version_order, default=None)


def _version_order(path: Path) -> tuple[int, int | str]:
    return (1, int(path.name)) if path.name.isdigit() else (0, path.name)


def _is_keras_hub_preset(path: Path) -> bool:
    """keras-hub's config.json names a class; a Transformers or JAX checkpoint's does not."""
    try:
        described = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(described, dict) and "class_name" in described


def use_kaggle_secrets() -> bool:
    """In a Kaggle notebook, put the KAGGLE_USERNAME and KAGGLE_KEY secrets into the environment for kagglehub.

    Only when no credentials are set already. The values go to os.environ and
    nowhere else: never printed, never written. Returns whether credentials
    came from the secrets.
    """
    if not in_kaggle_notebook() or kaggle_credentials_present():
        return False
    try:
        from kaggle_secrets import UserSecretsClient  # only importable inside a Kaggle notebook

        client = UserSecretsClient()
    except Exception:  # noqa: BLE001 - no secrets service: the credential check that follows explains
        return False
    found = {}
    for name in KAGGLE_SECRETS:
        if os.environ.get(name):
            continue
        try:
            value = client.get_secret(name)
        except Exception:  # noqa: BLE001 - a secret not added to this notebook raises; its message is not ours
            continue
        if isinstance(value, str) and value.strip():
            found[name] = value.strip()
    os.environ.update(found)
    return bool(found) and kaggle_credentials_present()


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
