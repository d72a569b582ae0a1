"""Where a run's metrics go as it trains (--report-to): TensorBoard, MLflow, Weights & Biases.

Each tracker is a keras Callback told what TensorBoardLog (callbacks.py) is told: each step's loss, each
evaluation, with the run's step. MLflow and W&B also get the run's settings as params when it starts, and, once
it is published, its final metrics and the adapter as an artifact. Both are optional extras; a missing one is
refused before anything is written (check).

MLflow writes to `mlruns/` in the run directory unless MLFLOW_TRACKING_URI names a store (a sqlite:/// file, a
tracking server, Databricks); a store MLflow refuses is refused before anything is written (check). W&B runs offline,
into `wandb/` in the run directory, unless the user is logged in (WANDB_API_KEY, or `wandb login`'s ~/.netrc entry) or
sets WANDB_MODE. No key is ever read out, printed or written by finetune.
"""

from __future__ import annotations

import contextlib
import importlib.util
import netrc
import os
import urllib.parse
from pathlib import Path

import keras

from finetune.platform.errors import RunStopped, UserError
from finetune.training import callbacks, outputs

# tracker: the module it needs, and the extra that installs it.
EXTRAS = {"mlflow": "mlflow", "wandb": "wandb"}
EXPERIMENT = "finetune"


def check(report_to: list[str]) -> None:
    """Refuse a tracker that cannot run, before the run writes anything: its package is not installed, or MLflow
    refuses the store MLFLOW_TRACKING_URI names."""
    for name in report_to:
        if name in EXTRAS and importlib.util.find_spec(EXTRAS[name]) is None:
            raise UserError(
                f"--report-to {name} needs the {name} package, which is not installed: pip install 'finetune[{name}]'"
                f", or leave {name} out of --report-to"
            )
    if "mlflow" in report_to and os.environ.get("MLFLOW_TRACKING_URI"):
        check_mlflow_store(os.environ["MLFLOW_TRACKING_URI"])


# Asked once, without MLflow's retries (7, backing off for minutes): a server that does not answer is refused now.
QUICK_REQUESTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}


def check_mlflow_store(uri: str) -> None:
    """Refuse the MLflow store at `uri` where MLflow refuses it (a file store without MLflow 3's opt-in, a database
    whose packages are missing, a server that does not answer, a scheme MLflow does not know), naming the fix.

    It asks the store for finetune's experiment, as the run will: a sqlite store is created here, a server is asked.
    """
    from mlflow import MlflowClient

    saved = {name: os.environ.get(name) for name in QUICK_REQUESTS}
    os.environ.update(QUICK_REQUESTS)
    try:
        MlflowClient(tracking_uri=uri).get_experiment_by_name(EXPERIMENT)
    except Exception as e:  # noqa: BLE001 - each store raises its own (MlflowException, ImportError, requests')
        raise UserError(
            f"--report-to mlflow cannot use MLFLOW_TRACKING_URI={_shown(uri)}: {_shown(_store_fix(uri, e), uri)}, "
            "or unset MLFLOW_TRACKING_URI to log into the run directory's mlruns/"
        ) from None
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# The schemes MLFLOW_TRACKING_URI takes (a database's past its driver: postgresql+psycopg2): MLflow's stores.
DATABASES = ("sqlite", "postgresql", "mysql", "mssql")
STORE_SCHEMES = ("", "file", "http", "https", "databricks", "databricks-uc", "uc", *DATABASES)


def _store_fix(uri: str, error: Exception) -> str:
    """Why MLflow refused the store at `uri`, and what to do about it."""
    scheme, _, _ = uri.partition(":")
    scheme = scheme.lower().split("+")[0] if ":" in uri and len(scheme) > 1 else ""  # C:\ is a path
    if scheme in ("", "file") and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1"):
        return (
            "MLflow 3 keeps its file store only with MLFLOW_ALLOW_FILE_STORE=true: set it, or use sqlite:///mlflow.db"
        )
    said = str(error).strip().split(". ")[0].splitlines()[0][:200] if str(error).strip() else ""
    reason = f"{type(error).__name__}: {said}" if said else type(error).__name__
    if scheme in DATABASES and any(importlib.util.find_spec(name) is None for name in ("sqlalchemy", "alembic")):
        return "MLflow's database stores need sqlalchemy and alembic, which mlflow-skinny leaves out: pip install " \
               "'finetune[mlflow]'"  # fmt: skip
    if isinstance(error, ImportError):
        return f"{reason}; install the {scheme} driver it names"
    if scheme in ("http", "https"):
        return f"{reason}; start the tracking server, or fix the address"
    if scheme in STORE_SCHEMES:
        return f"{reason}; fix the store it names"
    return f"{reason}; MLFLOW_TRACKING_URI takes sqlite:///FILE, http(s)://SERVER, databricks or a database's URL"


def _shown(text: str, uri: str | None = None) -> str:
    """`text` with the password a URI may hold (https://user:password@host) left out."""
    try:
        password = urllib.parse.urlsplit(uri or text).password
    except ValueError:  # not a URI urllib can read: no password to find in it either
        return text
    return text.replace(password, "***") if password else text


def flat(settings: dict, prefix: str = "") -> dict:
    """A nested config as dotted keys (model.preset), the params trackers show."""
    out = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def open_trackers(report_to: list[str], stack: contextlib.ExitStack, run_dir: Path, optimizer, run: dict) -> list:
    """The trackers --report-to names, entered on `stack` so that each ends with the run, however it ends.

    run: dict. name (the run's id), params (its config, as config.yaml holds it) and resumed (the step of the
        checkpoint this session resumes from, None for a new run: MLflow and W&B then carry on the tracker's run
        it began, and TensorBoard hides what a killed session logged after that step).
    """
    found = []
    for name in report_to:
        if name == "tensorboard":
            found.append(callbacks.TensorBoardLog(run_dir / outputs.TENSORBOARD, optimizer, run.get("resumed")))
        elif name == "mlflow":
            found.append(MLflowLog(run_dir, run["name"], flat(run["params"]), run.get("resumed") is not None))
        elif name == "wandb":
            found.append(WandbLog(run_dir, run["name"], flat(run["params"])))
    return [stack.enter_context(tracker) for tracker in found]


def published(trackers: list, metrics: dict, adapter: Path) -> None:
    """Tell each tracker the run is published: its final metrics, and the adapter file.

    The run is finished by now: a tracker that fails here (a server gone) is a note, not a failed run.
    """
    for tracker in trackers:
        if hasattr(tracker, "published"):
            try:
                tracker.published(metrics, adapter)
            except Exception as e:  # noqa: BLE001 - each tracker's client raises its own errors
                print(f"note: {type(tracker).__name__} could not log the finished run ({type(e).__name__}: {e})")


def _numbers(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class MLflowLog(keras.callbacks.Callback):
    """An MLflow run: params at the start, train/eval metrics per step, final metrics and the adapter at the end.

    Args:
        run_dir: Path. The run directory; its `mlruns/` is the store unless MLFLOW_TRACKING_URI is set.
        name: str. The MLflow run's name: finetune's run id.
        params: dict. Dotted setting keys to values.
        resumed: bool. The run resumes from a checkpoint: the MLflow run of that name carries on (its params as
            they were logged), or a new one starts where none is found (another store).
    """

    def __init__(self, run_dir: Path, name: str, params: dict, resumed: bool = False):
        super().__init__()
        from mlflow import MlflowClient
        from mlflow.entities import Param

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # MLflow 3 keeps the file store only on request; a local mlruns/ beside the run is what we want here.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (Path(run_dir) / outputs.MLRUNS).resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(EXPERIMENT)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(EXPERIMENT)
        earlier = self._earlier_run(experiment_id, name) if resumed else None
        if earlier is not None:
            self.run_id = earlier
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
            items = [Param(k, str(v)[:6000]) for k, v in params.items()]
            for start in range(0, len(items), 100):  # MLflow takes at most 100 params a batch
                self.client.log_batch(self.run_id, params=items[start : start + 100])
        self._step = 0
        self._ended = False

    def _earlier_run(self, experiment_id: str, name: str) -> str | None:
        """The id of the newest MLflow run named `name` (a run id is 8 hex digits: nothing to quote)."""
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.mlflow.runName = '{name}'", order_by=["attributes.start_time DESC"]
        )
        return found[0].info.run_id if found else None

    def on_train_batch_end(self, batch, logs=None):
        self._step = batch
        for name, value in callbacks.step_scalars(logs).items():
            self.client.log_metric(self.run_id, f"train_{name}", value, step=batch)

    def on_test_end(self, logs=None):
        step = logs.get("step", self._step)
        for name, value in callbacks.held_out_scalars(logs).items():
            self.client.log_metric(self.run_id, f"eval_{name}", value, step=step)

    def published(self, metrics: dict, adapter: Path) -> None:
        from mlflow.entities import Metric

        step = metrics.get("steps", self._step)
        final = [Metric(f"final.{k}", v, 0, step) for k, v in _numbers(metrics).items()]
        for start in range(0, len(final), 1000):
            self.client.log_batch(self.run_id, metrics=final[start : start + 1000])
        self.client.log_artifact(self.run_id, str(adapter))
        self._end("FINISHED")

    def _end(self, status: str) -> None:
        if not self._ended:
            self._ended = True
            self.client.set_terminated(self.run_id, status)

    def __enter__(self) -> MLflowLog:
        return self

    def __exit__(self, kind, error, trace) -> None:
        stopped = isinstance(error, (RunStopped, KeyboardInterrupt))  # a checkpoint to resume from is kept
        self._end("FINISHED" if kind is None else "KILLED" if stopped else "FAILED")


def _logged_in() -> bool:
    """Whether W&B has the user's key: WANDB_API_KEY, or the ~/.netrc entry `wandb login` writes (not read out)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbLog(keras.callbacks.Callback):
    """A Weights & Biases run, offline unless the user is logged in: the same as MLflowLog is told.

    Args:
        run_dir: Path. The run directory; W&B writes its `wandb/` there.
        name: str. The W&B run's name: finetune's run id.
        params: dict. Dotted setting keys to values: the run's config.
    """

    def __init__(self, run_dir: Path, name: str, params: dict):
        super().__init__()
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if _logged_in() else "offline")
        settings = wandb.Settings(silent=True, console="off")
        self.wandb = wandb
        # The run's id is finetune's: a resumed run carries on the W&B run it began (offline, a second run file
        # of the same id, which `wandb sync` adds to it).
        self.run = wandb.init(
            dir=str(run_dir), project=EXPERIMENT, name=name, id=name, resume="allow", config=params, mode=mode,
            settings=settings, reinit="create_new",
        )  # fmt: skip
        self._step = 0
        self._ended = False

    def on_train_batch_end(self, batch, logs=None):
        self._step = batch
        self.run.log({f"train/{name}": value for name, value in callbacks.step_scalars(logs).items()}, step=batch)

    def on_test_end(self, logs=None):
        scalars = callbacks.held_out_scalars(logs)
        self.run.log({f"eval/{name}": value for name, value in scalars.items()}, step=logs.get("step", self._step))

    def published(self, metrics: dict, adapter: Path) -> None:
        self.run.summary.update(_numbers(metrics))
        artifact = self.wandb.Artifact(f"adapter-{self.run.name}", type="model")
        artifact.add_file(str(adapter))
        self.run.log_artifact(artifact)
        self._end(0)

    def _end(self, exit_code: int) -> None:
        if not self._ended:
            self._ended = True
            self.run.finish(exit_code=exit_code)

    def __enter__(self) -> WandbLog:
        return self

    def __exit__(self, kind, error, trace) -> None:
        self._end(1 if kind is not None else 0)
