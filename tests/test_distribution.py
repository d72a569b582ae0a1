"""Sharding and multi-host: cluster settings, and real runs on simulated CPU devices.

The layout rules themselves are pure Python, checked on every backend in test_layouts.py.

The runs need JAX (the installed Keras's distribution API is JAX-only) and a
device count fixed before JAX starts, so they run in subprocesses of the JAX
suite with XLA_FLAGS=--xla_force_host_platform_device_count=N.
"""

import csv
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BACKEND, REPO

from finetune.config import DistributionConfig
from finetune.model import distribution
from finetune.platform.errors import UserError

jax_only = pytest.mark.skipif(BACKEND != "jax", reason="the distribution API is JAX-only; runs once, in the JAX suite")
TIMEOUT = 300  # every wait is bounded: a broken collective fails the test instead of hanging it


def spec(task_type: str, index: int, port: int = 2222, workers: int = 1) -> str:
    """CLUSTER_SPEC as Vertex AI writes it on each worker of a custom job."""
    return json.dumps(
        {
            "cluster": {
                "workerpool0": [f"127.0.0.1:{port}"],
                "workerpool1": [f"10.0.0.{i + 2}:2222" for i in range(workers)],
            },
            "environment": "cloud",
            "task": {"type": task_type, "index": index},
            "job": '{"worker_pool_specs": []}',
        }
    )


# --- cluster settings (every backend: pure Python) ---


DATA = DistributionConfig(parallel="data")


def test_cluster_spec_maps_chief_and_workers_to_processes():
    chief = distribution.cluster(DATA, {"CLUSTER_SPEC": spec("workerpool0", 0, workers=2)})
    assert (chief.coordinator, chief.num_processes, chief.process_id) == ("127.0.0.1:2222", 3, 0)
    second = distribution.cluster(DATA, {"CLUSTER_SPEC": spec("workerpool1", 1, workers=2)})
    assert (second.num_processes, second.process_id, second.source) == (3, 2, "CLUSTER_SPEC")


def test_tf_config_maps_chief_and_workers_to_processes():
    cluster = {"chief": ["10.0.0.1:2222"], "worker": ["10.0.0.2:2222", "10.0.0.3:2222"], "ps": ["10.0.0.9:1"]}
    found = distribution.cluster(
        DATA, {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 1}})}
    )
    assert (found.coordinator, found.num_processes, found.process_id, found.source) == (
        "10.0.0.1:2222",
        3,
        2,
        "TF_CONFIG",
    )
    workers = {"cluster": {"worker": ["10.0.0.2:2222", "10.0.0.3:2222"]}, "task": {"type": "worker", "index": "0"}}
    found = distribution.cluster(DATA, {"TF_CONFIG": json.dumps(workers)})  # no chief: worker 0 leads
    assert (found.coordinator, found.num_processes, found.process_id) == ("10.0.0.2:2222", 2, 0)
    both = {"TF_CONFIG": json.dumps(workers), "CLUSTER_SPEC": spec("workerpool1", 0, workers=2)}
    assert distribution.cluster(DATA, both).source == "CLUSTER_SPEC"  # Vertex AI writes both: its own wins


def test_single_worker_cluster_spec_is_no_job():
    solo = json.dumps({"cluster": {"workerpool0": ["host:2222"]}, "task": {"type": "workerpool0", "index": 0}})
    assert distribution.cluster(DistributionConfig(), {"CLUSTER_SPEC": solo}) is None
    assert distribution.cluster(DistributionConfig(), {}) is None


def test_flags_win_over_the_environment_and_need_all_three():
    flags = DistributionConfig(parallel="model", coordinator="h:1234", num_processes=4, process_id=3)
    found = distribution.cluster(flags, {"CLUSTER_SPEC": spec("workerpool0", 0)})
    assert (found.coordinator, found.num_processes, found.process_id, found.source) == ("h:1234", 4, 3, "flags")
    with pytest.raises(UserError, match="all three"):
        distribution.cluster(DistributionConfig(parallel="data", coordinator="h:1234"), {})


def test_keras_distribution_variables():
    env = {
        "KERAS_DISTRIBUTION_JOB_ADDRESSES": "10.0.0.1:1234,10.0.0.2:1234",
        "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
        "KERAS_DISTRIBUTION_PROCESS_ID": "1",
    }
    found = distribution.cluster(DATA, env)
    assert (found.coordinator, found.num_processes, found.process_id) == ("10.0.0.1:1234", 2, 1)


def test_a_job_of_several_processes_without_parallel_is_refused():
    """Each process would train the whole model alone, and all but one would be thrown away."""
    with pytest.raises(UserError, match="pass --parallel data or --parallel model"):
        distribution.cluster(DistributionConfig(), {"CLUSTER_SPEC": spec("workerpool0", 0)})
    from finetune import config

    with pytest.raises(UserError, match="needs --parallel data or --parallel model"):
        config.load(None, {"backend": "jax", "distribution.num_processes": 2, "distribution.process_id": 0})


@pytest.mark.parametrize(
    "env, message",
    [
        ({"CLUSTER_SPEC": "{not json"}, "CLUSTER_SPEC is not valid JSON"),
        ({"CLUSTER_SPEC": spec("workerpool3", 0)}, "not a training worker pool"),
        # The shapes a hand-written or damaged spec takes: each is named by its field.
        ({"CLUSTER_SPEC": '{"cluster": ["h:1"], "task": {}}'}, "CLUSTER_SPEC: cluster must be an object, got a list"),
        (
            {"CLUSTER_SPEC": '{"cluster": {"workerpool0": [2222]}, "task": {"type": "workerpool0", "index": 0}}'},
            r"CLUSTER_SPEC: cluster.workerpool0\[0\] must be text, got a number",
        ),
        (
            {"CLUSTER_SPEC": '{"cluster": {"workerpool0": ["h"]}, "task": {"type": "workerpool0", "index": 0}}'},
            r"cluster.workerpool0\[0\] must be HOST:PORT, got 'h'",
        ),
        ({"CLUSTER_SPEC": '{"cluster": {"workerpool0": ["h:1"]}}'}, "CLUSTER_SPEC has no task"),
        (
            {"CLUSTER_SPEC": '{"cluster": {"workerpool0": ["h:1"]}, "task": {"type": "workerpool0", "index": [0]}}'},
            "CLUSTER_SPEC: task.index must be an integer or text, got a list",
        ),
        ({"CLUSTER_SPEC": '{"cluster": {}, "task": {"type": "workerpool0", "index": 0}}'}, "lists no training worker"),
        ({"CLUSTER_SPEC": "[1, 2]"}, r"CLUSTER_SPEC is not an object \(it holds a list\)"),
        ({"CLUSTER_SPEC": "[" * 100_000}, "CLUSTER_SPEC is nested too deeply"),
        (
            {"TF_CONFIG": '{"cluster": {"chief": "h:1"}, "task": {}}'},
            "TF_CONFIG: cluster.chief must be a list, got text",
        ),
        ({"TF_CONFIG": '{"cluster": {"worker": ["h:1", "g:1"]}, "task": {"type": "ps", "index": 0}}'}, "ps #0"),
        ({"KERAS_DISTRIBUTION_NUM_PROCESSES": "two"}, "must be integers"),
        ({"KERAS_DISTRIBUTION_NUM_PROCESSES": "2", "KERAS_DISTRIBUTION_PROCESS_ID": "5"}, "out of range"),
    ],
)
def test_broken_cluster_settings_are_refused(env, message):
    with pytest.raises(UserError, match=message):
        distribution.cluster(DATA, env)


# --- refusals (every backend) ---


def test_parallel_needs_jax_and_an_explicit_batch(tiny_args, tmp_path):
    from typer.testing import CliRunner

    from finetune.cli import app

    runner = CliRunner()
    other = "torch" if BACKEND == "jax" else BACKEND
    args = ["gemma", *tiny_args, "--output", str(tmp_path / "r")]
    args[args.index("--backend") + 1] = other
    done = runner.invoke(app, [*args, "--parallel", "data"])
    assert done.exit_code == 2 and "needs the jax backend" in done.output
    args[args.index("--backend") + 1] = "jax"
    args[args.index("--batch-size") + 1] = "auto"
    done = runner.invoke(app, [*args, "--parallel", "model"])
    assert done.exit_code == 2 and "--batch-size auto does not combine" in done.output
    done = runner.invoke(app, ["gemma", *tiny_args, "--output", str(tmp_path / "r"), "--mesh", "2x4"])
    assert done.exit_code == 2 and "needs --parallel" in done.output
    assert not (tmp_path / "r").exists()


# --- real runs on simulated devices (JAX suite) ---


def _env(devices: int, **extra) -> dict:
    env = dict(os.environ, KERAS_BACKEND="jax", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _train(tmp_path: Path, name: str, *flags: str, devices: int = 8, env_extra=None, cwd=None):
    out = tmp_path / name
    args = [sys.executable, "-m", "finetune", "gemma", "--preset", "tiny", "--backend", "jax", "--max-steps", "3",
            "--precision", "float32", "--batch-size", "8", "--seq-len", "64", "--set", "train.samples=0",
            "--output", str(out), *flags]  # fmt: skip
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(devices, **(env_extra or {})),
        cwd=cwd,
    )  # fmt: skip


def _finish(proc) -> str:
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"run did not finish in {TIMEOUT}s:\n{output[-3000:]}")
    assert proc.returncode == 0, output[-3000:]
    return output


def _losses(run: Path) -> list[float]:
    with open(run / "history.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return [float(r[k]) for r in rows for k in ("train_loss", "eval_loss") if r.get(k)]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The reference: the same run on one device."""
    if BACKEND != "jax":
        pytest.skip("the distribution API is JAX-only; runs once, in the JAX suite")
    root = tmp_path_factory.mktemp("one")
    output = _finish(_train(root, "one", devices=1))
    assert "distribution" not in output
    return root / "one"


@jax_only
def test_data_and_model_parallel_train_like_one_device(tmp_path, one_device):
    runs = {
        "data": _train(tmp_path, "data", "--parallel", "data"),
        "model": _train(tmp_path, "model", "--parallel", "model", "--mesh", "2x4"),
    }
    output = {name: _finish(proc) for name, proc in runs.items()}
    assert "mesh 8 batch" in output["data"] and "mesh 2 batch x 4 model" in output["model"]
    reference = _losses(one_device)
    assert len(reference) >= 4
    for name in runs:
        assert _losses(tmp_path / name) == pytest.approx(reference, rel=1e-4), name
    metrics = json.loads((tmp_path / "model" / "metrics.json").read_text())
    assert metrics["distribution"]["mesh_shape"] == [2, 4]
    assert metrics["distribution"]["axis_names"] == ["batch", "model"]
    assert (metrics["distribution"]["devices"], metrics["distribution"]["processes"]) == (8, 1)
    assert metrics["eval_loss"] == pytest.approx(
        json.loads((one_device / "metrics.json").read_text())["eval_loss"], rel=1e-4
    )


SHARDING_CHECK = """
import json, sys
import keras
from finetune.model import builder as model, distribution, layouts, presets
from finetune.platform import backend
from finetune.config import DistributionConfig, LoraConfig

keras.config.set_dtype_policy("float32")
out = {}
for mesh in ("1x8", "2x4"):
    source = presets.resolve("tiny")
    info = distribution.setup(DistributionConfig(parallel="model", mesh=mesh), presets.dims(source), 8)
    lm, _ = model.build(source, 64)
    model.enable_lora(lm, LoraConfig(rank=2, targets=["query", "value", "ffw_linear"]))
    out[mesh] = {v.path: [str(a) for a in v.value.sharding.spec] + [None] * (len(v.shape) - len(v.value.sharding.spec))
                 for v in lm.backbone.weights}
    out[mesh + " info"] = info
    keras.distribution.set_distribution(None)
for name in ("tiny-gemma4-moe",):  # the experts' rules, on a 2x4 mesh
    source = presets.resolve(name)
    distribution.setup(DistributionConfig(parallel="model", mesh="2x4"), presets.dims(source), 8)
    lm, _ = model.build(source, 64)
    model.enable_lora(lm, LoraConfig(rank=2, targets=["query", "value", "ffw_linear", "experts"]))
    out[name] = {v.path: [str(a) for a in v.value.sharding.spec] + [None] * (len(v.shape) - len(v.value.sharding.spec))
                 for v in lm.backbone.weights}
    keras.distribution.set_distribution(None)
print("RESULT " + json.dumps(out))
"""


@jax_only
def test_data_parallel_without_a_batch_size_picks_one_that_splits(tmp_path):
    """The default batch (4 on JAX) does not split over 8 devices: the run picks 8 and says so."""
    args = [sys.executable, "-m", "finetune", "gemma", "--preset", "tiny", "--parallel", "data", "--max-steps", "1",
            "--seq-len", "32", "--max-records", "60", "--set", "train.samples=0", "--output", str(tmp_path / "r")]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, env=_env(8), timeout=TIMEOUT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "batch size 8: the default 4 does not split over the data axis of 8 devices" in done.stdout
    assert json.loads((tmp_path / "r" / "metrics.json").read_text())["batch_size"] == 8


@jax_only
def test_weights_are_sharded_as_the_layout_says(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SHARDING_CHECK], capture_output=True, text=True, env=_env(8),
                          timeout=TIMEOUT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    for mesh in ("1x8", "2x4"):
        spec = result[mesh]
        # tiny: vocabulary 811 (prime to 8 and 4) falls back to the hidden axis; 4 heads split over 4, not 8.
        assert spec["token_embedding/embeddings"] == ["None", "model"]
        assert spec["decoder_block_0/attention/query/kernel"] == (
            ["model", "None", "None"] if mesh == "2x4" else ["None", "model", "None"]
        )
        assert spec["decoder_block_1/attention/key/kernel"] == ["None", "model", "None"]  # one KV head
        assert spec["decoder_block_0/ffw_gating/kernel"] == ["None", "model"]
        assert spec["decoder_block_0/ffw_linear/kernel"] == ["model", "None"]
        assert spec["decoder_block_0/attention/query/lora_kernel_a"] == ["None", "None", "None"]
        assert spec["decoder_block_0/ffw_linear/lora_kernel_b"] == ["None", "None"]
        assert spec["final_normalization/scale"] == ["None"]
    assert result["2x4 info"]["layouts"]["key"] == [None, "model", None]
    moe = result["tiny-gemma4-moe"]  # 4 experts over a model axis of 4: on the experts axis
    assert moe["decoder_block_0/moe_expert_bank/gate_proj"] == ["model", "None", "None"]
    assert moe["decoder_block_1/moe_expert_bank/down_proj"] == ["model", "None", "None"]
    assert moe["decoder_block_0/moe_router/proj/kernel"] == ["None", "None"]
    assert moe["decoder_block_0/moe_expert_bank/lora_gate_proj_a"] == ["None", "None", "None"]  # replicated
    assert moe["decoder_block_1/attention/query/kernel"] == ["model", "None", "None"]  # the global layer's


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@jax_only
def test_two_processes_from_a_vertex_cluster_spec_train_as_one(tmp_path, one_device):
    """Two workers on 127.0.0.1, two CPU devices each, joined through CLUSTER_SPEC: one data-parallel job."""
    port = _free_port()
    for i in range(2):
        (tmp_path / f"tmp{i}").mkdir()
    aip = tmp_path.parent / f"{tmp_path.name}-aip"  # Vertex AI gives every worker the same checkpoint directory
    procs = [
        _train(tmp_path, "job", "--parallel", "data", devices=2, cwd=tmp_path,
               env_extra={"CLUSTER_SPEC": spec(pool, 0, port=port), "TMPDIR": str(tmp_path / f"tmp{i}"),
                          "AIP_CHECKPOINT_DIR": str(aip)})
        for i, pool in enumerate(("workerpool0", "workerpool1"))
    ]  # fmt: skip
    # Beside it, a model-parallel job over both hosts (mesh 1x4: the batch axis is not split across them, so
    # each process feeds the whole batch), joined through the flags a hand-made cluster would use.
    other = tmp_path.parent / f"{tmp_path.name}-model"
    other.mkdir()
    model_port = _free_port()
    model_job = [
        _train(other, "job", "--parallel", "model", "--mesh", "1x4", "--coordinator", f"127.0.0.1:{model_port}",
               "--num-processes", "2", "--process-id", str(i), devices=2, cwd=other)
        for i in range(2)
    ]  # fmt: skip
    outputs = [_finish(p) for p in procs]
    model_outputs = [_finish(p) for p in model_job]
    assert "mesh 1 batch x 4 model, 2 processes" in model_outputs[0]
    assert _losses(other / "job") == pytest.approx(_losses(one_device), rel=1e-4)
    assert "as process 0" in outputs[0] and "as process 1" in outputs[1]
    assert "4 devices" in outputs[0] and "2 processes" in outputs[0]

    def step_losses(text):
        return [line.split("loss ")[1].split()[0] for line in text.splitlines() if line.startswith("step ")]

    assert step_losses(outputs[0]) == step_losses(outputs[1]) and len(step_losses(outputs[0])) == 3
    assert "eval loss" in outputs[0] and "| job" not in outputs[1]  # only process 0 prints the summary
    metrics = json.loads((tmp_path / "job" / "metrics.json").read_text())
    assert metrics["distribution"]["processes"] == 2
    # Only process 0 wrote: the run directory is its own, and process 1's scratch directory is gone.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job", "tmp0", "tmp1"]
    assert list((tmp_path / "tmp1").iterdir()) == []
    copied = {p.name.split("-")[2] for p in aip.iterdir()}
    assert copied == {metrics["run_id"]}, copied  # process 1's scratch checkpoints never reach it
    # The job trains what one process trains on the same global batches.
    assert _losses(tmp_path / "job") == pytest.approx(_losses(one_device), rel=1e-4)


API_RUN = """
import sys
import finetune
from finetune import config

cfg = config.load("kaggle-2xt4", {"model.preset": "tiny", "data.path": "sample", "model.seq_len": 64,
                                  "train.max_steps": 2, "train.samples": 0, "train.batch_size": 4,
                                  "output.dir": sys.argv[1]})
metrics = finetune.run(cfg)
print("DISTRIBUTION", metrics["distribution"]["parallel"], metrics["distribution"]["devices"])
"""


@jax_only
def test_kaggle_recipes_shard_from_the_cli_and_the_python_api(tmp_path):
    """kaggle-tpu (model parallel, 1x8) from the CLI on 8 devices; kaggle-2xt4 (data parallel) from Python on 2."""
    cli = subprocess.Popen(
        [sys.executable, "-m", "finetune", "gemma", "--recipe", "kaggle-tpu", "--preset", "tiny", "--data", "sample",
         "--seq-len", "64", "--max-steps", "2", "--set", "train.samples=0", "--set", "train.time_limit=off",
         "--output", str(tmp_path / "tpu")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(8),
    )  # fmt: skip
    api = subprocess.Popen(
        [sys.executable, "-c", API_RUN, str(tmp_path / "t4")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(2),
    )  # fmt: skip
    assert "mesh 1 batch x 8 model" in _finish(cli)
    assert "DISTRIBUTION data 2" in _finish(api)
    for run in ("tpu", "t4"):
        assert (tmp_path / run / "metrics.json").is_file()


@jax_only
def test_dpo_with_data_parallel_scores_and_trains_as_one_device(tmp_path):
    """The pairs' loss positions were laid out for one shard while the view gathered from two: the reference, the
    held-out loss and the training loss were NaN. A fresh DPO run scores ln 2 before training, and its first
    steps' losses are the one-device run's."""
    from test_preference_runs import learnable_pairs

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in learnable_pairs(40)), encoding="utf-8")
    runs = {}
    # --packing off on both: the unpacked pairs (the matrix, test_method_matrix.py, runs every method packed).
    for name, devices, flags in (("one", 1, []), ("data", 2, ["--parallel", "data"])):
        args = [sys.executable, "-m", "finetune", "gemma", "--preset", "tiny", "--backend", "jax", "--method", "dpo",
                "--data", str(data), "--max-steps", "3", "--precision", "float32", "--batch-size", "4",
                "--seq-len", "32", "--lr", "1e-2", "--set", "train.samples=0", "--output", str(tmp_path / name),
                "--packing", "off", *flags]  # fmt: skip
        runs[name] = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=_env(devices))  # fmt: skip
    output = {name: _finish(proc) for name, proc in runs.items()}
    assert "mesh 2 batch" in output["data"]
    metrics = json.loads((tmp_path / "data" / "metrics.json").read_text())
    assert abs(metrics["eval_loss_before"] - 0.6931471805599453) < 1e-3
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "data")
    assert len(one) >= 3 and two == pytest.approx(one, abs=1e-5)
