"""Every method against each feature written below the methods: a finite run equal to the plain one, or a clean
refusal (exit 2, nothing written) that names the combination.

A feature written once below the methods holds for every method; this matrix is where that is checked, so a
new method is a new row here. Each cell trains the tiny preset for a few steps in float32, from the command line
as typed. The backend-dependent parts of each feature have their own tests on every backend (remat and dropout:
test_remat.py; accumulation: test_optimizer.py, test_preference.py; resume: test_checkpoint.py), so most cells
run in one suite (backend_neutral). --parallel data runs in the JAX suite, on 2 simulated devices (the distribution
API is JAX-only). The split across processes is checked for every method on what each process is fed, and in real
jobs of two processes for DPO (below: the pairs' scoring) and SFT (test_distribution.py). GRPO's rows are its
own rollouts, a prompt and one completion each, sampled in one process: `--batch-size auto`, `--packing on`, a
job of several processes are refused there (docs/not-yet.md); its sampled rollouts' resume on
every backend: test_grpo.py.
"""

import csv
import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import (
    BACKEND,
    REPO,
    adapter_arrays,
    invoke,
    killed_after,
    make_records,
    tensorboard_scalars,
    write_jsonl,
)
from test_grpo import story_prompts
from test_preference_runs import learnable_pairs

from finetune.methods import registry

neutral = pytest.mark.backend_neutral  # the features' backend parts: the tests named above

METHODS = list(registry.METHODS)
# Each method's own flags: GRPO's rollouts, 4 completions of 4 tokens a prompt, scored by a built-in reward.
OWN_FLAGS = {name: ["--reward", "format:The", "--num-generations", "4", "--max-completion-length", "4"]
             if registry.get(name).prompted else [] for name in METHODS}  # fmt: skip
# The same, as the Python API's settings (the --parallel runs below), with a KL term: its base's pass (LoRA off)
# scores the rollouts' slots as they are laid out per data shard (GRPO's scored them as one shard: KL 3.3 at step 1).
OWN_SETTINGS = {name: {"train.reward": ["format:The"], "train.num_generations": 4, "train.max_completion_length": 4,
                       "train.beta": 0.1} for name in METHODS if registry.get(name).prompted}  # fmt: skip
ROWS_OF_THEIR_OWN = [m for m in METHODS if registry.get(m).prompted]  # GRPO: each rollout is a row (not-yet.md)
PACKED = [m for m in METHODS if m not in ROWS_OF_THEIR_OWN]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Each method's records: 21 of them, so that no batch of 4 divides the training share (filler rows)."""
    root = tmp_path_factory.mktemp("matrix")
    sft = write_jsonl(root / "sft.jsonl", make_records(21))
    paired = write_jsonl(root / "pairs.jsonl", learnable_pairs(21))
    prompts = write_jsonl(root / "prompts.jsonl", story_prompts()[:21])
    labelled = write_jsonl(root / "labelled.jsonl", [{"text": f"record {i}", "label": i % 2} for i in range(21)])
    return {name: paired if registry.get(name).paired else prompts if registry.get(name).prompted
            else labelled if registry.get(name).labelled else sft for name in METHODS}  # fmt: skip


def run(method, data, out, *flags):
    """`finetune gemma` as typed: the tiny preset, float32, 3 steps of 4 (pairs), the method's records."""
    return invoke("gemma", "--preset", "tiny", "--backend", BACKEND, "--precision", "float32", "--seq-len", "48",
                  "--method", method, "--data", data[method], "--max-steps", "3", "--set", "train.samples=0",
                  "--lr", "1e-2", "--output", out, *OWN_FLAGS[method], *flags)  # fmt: skip


def losses(out) -> list[float]:
    """Each step's loss, then its gradient's norm: GRPO's loss is about 0 at every step (its ratio is 1 where each
    batch of rollouts trains one step), so its gradient is what a feature would change."""
    with (out / "history.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r["train_loss"]]
    return [float(r["train_loss"]) for r in rows] + [float(r["grad_norm"]) for r in rows]


@pytest.fixture(scope="module")
def plain_runs(data, tmp_path_factory):
    """Each method's run with no feature: batch 4, no accumulation, remat off, no dropout or noise; a checkpoint
    every 2 steps (what resume takes up)."""
    out = {}
    for method in METHODS:
        path = tmp_path_factory.mktemp(f"plain-{method}") / "run"
        result = run(method, data, path, "--batch-size", "4", "--remat", "off", "--packing", "off",
                     "--checkpoint-every", "2")  # fmt: skip
        assert result.exit_code == 0, result.output
        trained = losses(path)
        assert len(trained) == 6 and all(math.isfinite(v) for v in trained)
        out[method] = path
    return out


@pytest.fixture(scope="module")
def plain(plain_runs):
    """Each method's plain run's training losses."""
    return {method: losses(path) for method, path in plain_runs.items()}


@neutral
@neutral  # the trackers' writers are Python; each method's metrics: its own tests on every backend
@pytest.mark.parametrize("method", METHODS)
def test_the_trackers_log_every_metric_history_csv_has(method, plain_runs):
    """A tracker is written once for every method: each step's and each evaluation's numbers in history.csv (a
    preference step's rewards, GRPO's rollouts', a classifier's macro F1) are in the TensorBoard log too, as MLflow
    and W&B are given them (callbacks.step_scalars, held_out_scalars)."""
    out = plain_runs[method]
    with (out / "history.csv").open() as f:
        rows = list(csv.DictReader(f))
    train = {name for r in rows if r["train_loss"] for name, value in r.items() if value} - {"step", "epoch"}
    held_out = {name for r in rows if r["eval_loss"] for name, value in r.items() if value} - {"step", "epoch"}
    board = tensorboard_scalars(out / "tensorboard" / "train")
    assert {"loss" if name == "train_loss" else name for name in train} <= set(board), (train, set(board))
    board = tensorboard_scalars(out / "tensorboard" / "eval")
    assert {name.removeprefix("eval_") for name in held_out} <= set(board), (held_out, set(board))
    assert len(held_out) >= 2 and len(train) >= 3


@pytest.mark.parametrize("method", METHODS)
def test_grad_accum_equals_the_whole_batch(method, data, plain, tmp_path):
    result = run(method, data, tmp_path / "run", "--batch-size", "2", "--grad-accum", "2", "--remat", "off",
                 "--packing", "off")  # fmt: skip
    assert result.exit_code == 0, result.output
    # Within 1e-5, or float32's rounding of IPO's squared losses (about 25 at the start).
    assert losses(tmp_path / "run") == pytest.approx(plain[method], rel=1e-6, abs=1e-5)


@neutral
@pytest.mark.parametrize("method", METHODS)
def test_remat_equals_no_remat(method, data, plain, tmp_path):
    result = run(method, data, tmp_path / "run", "--batch-size", "4", "--remat", "on", "--packing", "off")
    assert result.exit_code == 0, result.output
    assert losses(tmp_path / "run") == pytest.approx(plain[method], rel=1e-6, abs=1e-5)


@neutral
@pytest.mark.parametrize("method", METHODS)
def test_dropout_and_neftune_train_finite_to_the_end_with_filler_rows(method, data, tmp_path):
    """Three epochs of 4 on a training share no batch divides: each epoch ends on a step with filler rows."""
    result = run(method, data, tmp_path / "run", "--batch-size", "4", "--lora-dropout", "0.1", "--neftune-alpha",
                 "5", "--max-steps", "15", "--packing", "off")  # fmt: skip
    assert result.exit_code == 0, result.output
    trained = losses(tmp_path / "run")
    assert len(trained) == 30 and all(math.isfinite(v) for v in trained)


@pytest.mark.skipif(BACKEND != "jax", reason="XLA's cond took the loss's chunks' branches in the run's dtype on "
                    "JAX only; --full in mixed_bfloat16 trains on every backend (test_full_model.py)")  # fmt: skip
@pytest.mark.parametrize("method", METHODS)
def test_mixed_bfloat16_trains_with_every_method(method, data, tmp_path):
    """--precision mixed_bfloat16: bfloat16 hidden states beside float32 weights. On JAX the loss's chunk branch
    gave float32 gradients of the hidden states where its empty branch gave bfloat16, and XLA's cond refused them:
    exit 1 on the first step, with every method but the classifier."""
    result = run(method, data, tmp_path / "run", "--batch-size", "4", "--precision", "mixed_bfloat16", "--max-steps",
                 "1", "--eval-fraction", "0")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert all(math.isfinite(v) for v in losses(tmp_path / "run"))


@neutral
@pytest.mark.parametrize("method", METHODS)
def test_added_tokens_train_with_every_method(method, data, tmp_path):
    """--add-tokens (appended to tiny's vocabulary): a finite run whose new rows are saved beside the adapter; that
    only they train beside LoRA, and everywhere they go: test_tokens.py."""
    result = run(method, data, tmp_path / "run", "--batch-size", "4", "--add-tokens", "<tool>,<sym>")
    assert result.exit_code == 0, result.output
    assert all(math.isfinite(v) for v in losses(tmp_path / "run"))
    rows = np.load(tmp_path / "run" / "adapter.tokens.npy")
    assert rows.shape[0] == 2 and np.isfinite(rows).all()
    described = json.loads((tmp_path / "run" / "adapter.json").read_text())
    assert described["added_tokens"]["tokens"] == ["<tool>", "<sym>"]


@neutral
@pytest.mark.parametrize("method", PACKED)
def test_auto_batch_size_probes_the_method_s_own_batches(method, data, tmp_path):
    result = run(method, data, tmp_path / "run", "--batch-size", "auto")
    assert result.exit_code == 0, result.output
    assert "batch size auto: " in result.output and math.isfinite(losses(tmp_path / "run")[-1])


@neutral
@pytest.mark.parametrize("method", PACKED)
def test_packing_trains(method, data, tmp_path):
    """--packing on: SFT's examples several to a row, pairs whole in micro-batches of 4 rows (issue 34)."""
    result = run(method, data, tmp_path / "run", "--batch-size", "4", "--packing", "on")
    assert result.exit_code == 0, result.output
    assert "packing: " in result.output and "padding " in result.output, result.output
    held = json.loads((tmp_path / "run" / "metrics.json").read_text())["eval_examples"]  # records, not rows' arrays
    assert f"evaluating before training ({held} held-out records)" in result.output, result.output
    trained = losses(tmp_path / "run")
    assert len(trained) == 6 and all(math.isfinite(v) for v in trained)


@neutral
@pytest.mark.parametrize("method", PACKED)
def test_group_by_length_trains_and_resumes_exactly(method, data, tmp_path):
    """--group-by-length (the order below the methods, batching.EpochRows): a finite run over two epochs' ends,
    and a stop after step 2's checkpoint resumed to the same losses: the grouped order is a function of (seed,
    step) too. With packed rows it says it leaves them be."""
    whole = tmp_path / "whole"
    result = run(method, data, whole, "--batch-size", "4", "--packing", "off", "--group-by-length", "--max-steps",
                 "6", "--checkpoint-every", "2", "--keep-checkpoints", "9")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "--group-by-length leaves packed rows" not in result.output
    trained = losses(whole)
    assert len(trained) == 12 and all(math.isfinite(v) for v in trained)
    out = killed_after(whole, tmp_path / "stopped", 2)
    (out / "history.csv").unlink()
    result = invoke("gemma", "--resume", "--output", out)
    assert result.exit_code == 0 and "resuming" in result.output, result.output
    assert losses(out) == pytest.approx(trained, rel=1e-6, abs=1e-5)
    if method == "sft":
        result = run(method, data, tmp_path / "packed", "--batch-size", "4", "--packing", "on", "--group-by-length")
        assert result.exit_code == 0 and "--group-by-length leaves packed rows" in result.output, result.output


@pytest.mark.one_backend  # numpy: the order each method's rows train in
@pytest.mark.parametrize("method", PACKED)
def test_each_method_s_grouped_order_trains_every_row_once_in_no_more_positions(method, data):
    from finetune import config
    from finetune.data import batching
    from finetune.methods import prepare
    from finetune.model import presets

    chosen = registry.get(method)
    cfg = config.from_dict({"model": {"preset": "tiny", "seq_len": 48},
                            "data": {"path": str(data[method]), "template": "none" if chosen.paired else "dolly"},
                            "train": {"method": method, "batch_size": 2, "group_by_length": True}})  # fmt: skip
    records, _ = prepare.read(cfg, cfg.data.path)
    prepared = chosen.prepare(records, presets.tiny_tokenizer(), cfg, packed=False)
    plain, grouped = (chosen.order(prepared, cfg, batching.Feed(length_step=4, grouped=g)) for g in (False, True))
    steps = range(grouped.steps_per_epoch)
    assert grouped.steps_per_epoch == plain.steps_per_epoch
    count = len(prepared.rows["token_ids"]) if isinstance(prepared.rows, dict) else len(prepared.rows)
    assert sorted(np.concatenate([grouped.rows(s) for s in steps]).tolist()) == list(range(count))

    def positions(order) -> int:
        return sum(x["token_ids"].size for s in steps for x, _, _ in order.micro_batches(s))

    assert positions(grouped) <= positions(plain)


@neutral
@pytest.mark.parametrize("method", ROWS_OF_THEIR_OWN)
@pytest.mark.parametrize("flags, said", [(["--batch-size", "auto"], "--batch-size counts prompts"),
                                         (["--packing", "on"], "is a row of its own"),
                                         (["--group-by-length"], "pads every prompt to the widest")])  # fmt: skip
def test_rollouts_refuse_what_they_do_not_do_yet_before_anything_is_written(method, data, tmp_path, flags, said):
    result = run(method, data, tmp_path / "run", *flags)
    assert result.exit_code == 2 and said in result.output, result.output
    assert not (tmp_path / "run").exists()


@neutral
@pytest.mark.parametrize("method", METHODS)
def test_held_out_records_of_another_kind_are_refused(method, data, tmp_path):
    """--eval-data of another kind than --data (pairs beside SFT records, SFT records beside pairs or prompts) was
    scored as if it were the run's; it is refused as --data of that kind is, exit 2, nothing written."""
    other = data["sft"] if registry.get(method).paired else data["dpo"]
    result = run(method, data, tmp_path / "run", "--eval-data", other, "--eval-fraction", "0")
    assert result.exit_code == 2 and "hold out records of the kind the run trains on" in result.output, result.output
    assert not (tmp_path / "run").exists()


@neutral
@pytest.mark.parametrize("method", METHODS)
def test_train_on_prompt_trains_where_the_loss_takes_prompts_and_is_refused_elsewhere(method, data, tmp_path):
    """--train-on-prompt was read by SFT alone, and recorded as set by every method: a run that did not do what its
    config.yaml said. A method whose loss has no place for prompt tokens refuses it, exit 2, nothing written."""
    result = run(method, data, tmp_path / "run", "--batch-size", "4", "--train-on-prompt")
    if not registry.get(method).prompt_loss:
        assert result.exit_code == 2 and "--train-on-prompt puts the prompt's tokens" in result.output, result.output
        assert not (tmp_path / "run").exists()
        return
    assert result.exit_code == 0, result.output
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["response_tokens"] == metrics["trained_tokens"]  # every token carries the loss


@neutral
@pytest.mark.parametrize("method", [m for m in METHODS if registry.get(m).paired])
def test_pairs_with_pictures_train_on_them_with_every_paired_method(method, tmp_path):
    """They trained on the literal text `<image>`, then were refused; now each side reads the picture
    (test_pictured_pairs.py: as SFT's rows do). A step's gradient follows the picture: red and blue squares under
    the same texts train apart."""
    from PIL import Image

    runs = []
    for colour in ("red", "blue"):
        Image.new("RGB", (8, 8), colour).save(tmp_path / f"{colour}.png")
        rows = [{"prompt": "<image>What colour is it?", "chosen": "Red.", "rejected": "Blue.",
                 "images": [f"{colour}.png"]}] * 8  # fmt: skip
        paired = write_jsonl(tmp_path / f"{colour}.jsonl", rows)
        out = tmp_path / colour
        result = invoke("gemma", "--preset", "tiny-gemma3-vision", "--backend", BACKEND, "--method", method,
                        "--data", paired, "--batch-size", "2", "--max-steps", "2", "--set", "train.samples=0",
                        "--precision", "float32", "--output", out)  # fmt: skip
        assert result.exit_code == 0, result.output
        assert "packing off: the data has images" in result.output
        runs.append(losses(out))
    assert all(math.isfinite(v) for v in runs[0] + runs[1])
    assert runs[0] != runs[1]


# === Resume ===


@neutral
@pytest.mark.parametrize("method", METHODS)
def test_a_run_stopped_after_a_checkpoint_resumes_to_the_plain_run(method, plain_runs, tmp_path):
    """The plain run as a stop right after step 2's checkpoint leaves it (its results, history, adapter and the
    method's own files gone: a reward model's head), resumed: step 3, the adapter and those files are the
    uninterrupted run's."""
    whole = plain_runs[method]
    out = killed_after(whole, tmp_path / "stopped", 2)
    own = registry.get(method).files
    for name in ("history.csv", "adapter.lora.h5", *own):
        (out / name).unlink()
    result = invoke("gemma", "--resume", "--output", out)  # every other setting comes from the checkpoint
    assert result.exit_code == 0, result.output
    assert "resuming" in result.output
    assert losses(out) == pytest.approx(losses(whole), rel=1e-6, abs=1e-5) and len(losses(out)) == 6
    expected, resumed = adapter_arrays(whole / "adapter.lora.h5"), adapter_arrays(out / "adapter.lora.h5")
    assert expected.keys() == resumed.keys() and len(expected) > 1
    for name in expected:
        np.testing.assert_allclose(resumed[name], expected[name], rtol=1e-5, atol=1e-5, err_msg=name)
    for name in own:  # .npz files of arrays (a reward model's head)
        with np.load(whole / name) as expected, np.load(out / name) as resumed:
            assert expected.files == resumed.files
            for key in expected.files:
                np.testing.assert_allclose(resumed[key], expected[key], rtol=1e-5, atol=1e-5, err_msg=key)
    assert json.loads((out / "metrics.json").read_text())["resumed_from_step"] == 2


# === The split across processes ===


@pytest.mark.one_backend  # numpy: what each process is fed; the view on a split batch: the --parallel cell below
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("method", PACKED)
def test_each_process_is_fed_its_part_and_the_parts_are_the_whole_batch(method, packed, data):
    """Two processes of a data-parallel job, each holding one of 2 data shards (Feed.part): every micro-batch of
    every step, an epoch's end with filler rows included, is the two processes' parts put together, and each part
    is half of it."""
    from finetune import config
    from finetune.data import batching
    from finetune.methods import prepare
    from finetune.model import presets

    chosen = registry.get(method)
    cfg = config.from_dict({"model": {"preset": "tiny", "seq_len": 48},
                            "data": {"path": str(data[method]), "template": "none" if chosen.paired else "dolly"},
                            "train": {"method": method, "batch_size": 4, "grad_accum": 2}})  # fmt: skip
    records, _ = prepare.read(cfg, cfg.data.path)
    prepared = chosen.prepare(records, presets.tiny_tokenizer(), cfg, packed=packed)
    whole = chosen.order(prepared, cfg, batching.Feed((0, 2, 2), 16))
    parts = [chosen.order(prepared, cfg, batching.Feed((i, i + 1, 2), 16)) for i in range(2)]
    assert whole.steps_per_epoch >= 2
    for step in range(whole.steps_per_epoch + 1):  # an epoch, its last step filled, and the next epoch's first
        split = [part.micro_batches(step) for part in parts]
        for micro, (x, labels, weights) in enumerate(whole.micro_batches(step)):
            first, second = split[0][micro], split[1][micro]
            assert first[0]["token_ids"].shape[0] == second[0]["token_ids"].shape[0] == len(x["token_ids"]) // 2
            assert len(first[2]) == len(weights) // 2
            for name in x:
                np.testing.assert_array_equal(np.concatenate([first[0][name], second[0][name]]), x[name], name)
            np.testing.assert_array_equal(np.concatenate([first[1], second[1]]), labels)
            np.testing.assert_array_equal(np.concatenate([first[2], second[2]]), weights)
        assert whole.metric_weights(step) == parts[0].metric_weights(step)


@pytest.mark.one_backend  # the order's own check, before anything is sampled
@pytest.mark.parametrize("method", ROWS_OF_THEIR_OWN)
def test_rollouts_refuse_a_split_across_processes(method, data):
    from finetune import config
    from finetune.data import batching
    from finetune.platform.errors import UserError

    cfg = config.from_dict({"model": {"preset": "tiny", "seq_len": 48}, "data": {"path": str(data[method])},
                            "train": {"method": method, "batch_size": 4, "reward": ["format:The"]}})  # fmt: skip
    with pytest.raises(UserError, match="samples its rollouts in one process"):
        registry.get(method).order(None, cfg, batching.Feed((0, 1, 2), 16))


# === --parallel data on 2 simulated devices (JAX) ===

PARALLEL_RUNS = """
import csv, json, os, sys
import finetune
from finetune.methods import registry

data, root, flags, own = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[5])
for method in json.loads(sys.argv[4]) or registry.METHODS:
    out = f"{root}/{method}"
    settings = {"model.preset": "tiny", "backend": "jax", "model.precision": "float32", "model.seq_len": 32,
                "train.method": method, "data.path": data[method], "train.max_steps": 2, "train.samples": 0,
                "train.learning_rate": 1e-2, "train.batch_size": 4, "output.dir": out, **flags, **own.get(method, {})}
    metrics = finetune.run(finetune.load_config(None, settings))
    if not os.path.exists(f"{out}/history.csv"):  # a job's process 1: process 0 writes the run
        continue
    with open(f"{out}/history.csv") as f:
        trained = [float(r["train_loss"]) for r in csv.DictReader(f) if r["train_loss"]]
    found = {k: metrics[k] for k in ("eval_loss_before", "eval_loss", "packing")}
    print("RESULT", json.dumps({"method": method, "losses": trained, **found}), flush=True)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def parallel_runs(data, tmp_path_factory):
    """Every method on one device and with --parallel data on 2, packing on (pairs and SFT's rows alike), each
    process training the methods in turn through the Python API; beside them, DPO in a job of two processes of one
    device each (its reference pass and held-out scores gather every process's part). All side by side."""
    if BACKEND != "jax":
        pytest.skip("the distribution API is JAX-only; runs once, in the JAX suite")
    root = tmp_path_factory.mktemp("parallel")
    paths = json.dumps({method: str(path) for method, path in data.items()})
    port = _free_port()
    job = {"distribution.parallel": "data", "distribution.coordinator": f"127.0.0.1:{port}",
           "distribution.num_processes": 2}  # fmt: skip
    procs = {}
    for name, devices, flags, methods in (
        ("one", 1, {}, []),
        ("data", 2, {"distribution.parallel": "data"}, []),
        ("job", 1, {**job, "distribution.process_id": 0}, ["dpo"]),
        ("job 1", 1, {**job, "distribution.process_id": 1}, ["dpo"]),
    ):
        env = dict(os.environ, KERAS_BACKEND="jax", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        (root / f"tmp-{name}").mkdir()
        env["TMPDIR"] = str(root / f"tmp-{name}")  # process 1's scratch run directory
        args = [sys.executable, "-c", PARALLEL_RUNS, paths, str(root / name), json.dumps(flags), json.dumps(methods),
                json.dumps(OWN_SETTINGS)]  # fmt: skip
        procs[name] = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                       cwd=root)  # fmt: skip
    found = {}
    for name, proc in procs.items():
        try:
            output, _ = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        assert proc.returncode == 0, output[-3000:]
        results = [json.loads(line[7:]) for line in output.splitlines() if line.startswith("RESULT ")]
        found[name] = {r["method"]: r for r in results}
        found[name + " output"] = output
    shutil.rmtree(root)
    return found


def same_steps(one: dict, other: dict) -> None:
    """`other`'s training losses and held-out scores before and after are `one`'s within 1e-5 (relative, or absolute
    near 0), and finite. float32 sums taken in another order (a shard's, then both) differ in their last bits, and two
    steps later a loss of 25 (IPO's) differed by 1.4e-6 of itself on one machine: a wrong gather differs by far more."""
    assert len(other["losses"]) == 2 and all(math.isfinite(v) for v in other["losses"])
    assert other["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=1e-5)
    for name in ("eval_loss_before", "eval_loss"):
        assert math.isfinite(other[name]) and other[name] == pytest.approx(one[name], rel=1e-5, abs=1e-5), name


@pytest.mark.parametrize("method", METHODS)
def test_parallel_data_on_two_devices_trains_as_one_device(method, parallel_runs):
    """Each method's steps (packed where it packs) and held-out scores before and after, on 2 data shards, are one
    device's."""
    one, two = parallel_runs["one"][method], parallel_runs["data"][method]
    assert "mesh 2 batch" in parallel_runs["data output"]
    packs = method in PACKED  # pairs pack under --parallel too; GRPO's rollouts are rows of their own
    assert two["packing"] is packs and one["packing"] is packs
    same_steps(one, two)


def test_a_pair_job_of_two_processes_trains_and_scores_as_one_device(parallel_runs):
    """Each process fed its part of every pair batch, and keras' predict_on_batch took that part for the whole
    batch: the reference and the held-out scores were each process's own (6.58 and ln 2 before training, then
    NaN). Now the whole batch is scored and every process gathers it (distribution.predicted)."""
    assert "2 processes" in parallel_runs["job output"] and "as process 1" in parallel_runs["job 1 output"]
    job = parallel_runs["job"]["dpo"]
    assert job["eval_loss_before"] == pytest.approx(math.log(2), abs=1e-5)
    same_steps(parallel_runs["one"]["dpo"], job)


@neutral
@pytest.mark.parametrize("method", METHODS)
def test_full_trains_every_weight_under_every_method(method, data, tmp_path):
    """--full below the methods: every weight of the language model trains, finite, and the run publishes the
    whole model (model.weights.h5) that `finetune eval` reopens; DPO and IPO score their reference, and GRPO its KL
    term (--beta), on the base's weights kept beside the trained ones (builder.lora_off)."""
    import h5py

    beta = ["--beta", "0.1"] if registry.get(method).prompted else []
    out = tmp_path / "run"
    result = run(method, data, out, "--full", "--batch-size", "4", "--lr", "1e-3", *beta)
    assert result.exit_code == 0, result.output
    trained = losses(out)
    assert len(trained) == 6 and all(math.isfinite(v) for v in trained)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["full"] and metrics["trainable_parameters"] > 300_000  # the tiny model's every weight
    assert not (out / "adapter.lora.h5").exists()
    with h5py.File(out / "model.weights.h5") as f:
        assert len(f["weights"]) > 0
    evaluated = invoke("eval", "--run", out)
    assert evaluated.exit_code == 0, evaluated.output
    # The reopened model scores as the run's last evaluation did (DPO's reference: the base, swapped back in).
    loss = re.search(r"eval_loss (\S+)", evaluated.output)
    if metrics.get("eval_loss") is not None and loss:
        assert float(loss.group(1)) == pytest.approx(metrics["eval_loss"], rel=1e-4, abs=1e-4), method
    else:
        assert "reward" in evaluated.output, evaluated.output


# The LoRA variants and a quantized base, each below the methods: (flags, what metrics.json or config.yaml records).
VARIANTS = {
    "int8-rslora-plus": ["--quantize", "int8", "--rslora", "--lora-plus-ratio", "4"],
    "dora-cosine-best": ["--dora", "--lr-schedule", "cosine", "--warmup-steps", "1", "--keep-best", "--eval-every",
                         "1"],
}  # fmt: skip


@neutral
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("method", METHODS)
def test_lora_variants_and_a_quantized_base_train_under_every_method(method, variant, data, plain, tmp_path):
    """A quantized base, rsLoRA, LoRA+, DoRA, a schedule and --keep-best under every method: finite steps that
    differ from the plain run's (the variant took effect), and a finished run `finetune eval` scores as the run's
    own last (or kept best) evaluation."""
    out = tmp_path / "run"
    result = run(method, data, out, "--batch-size", "4", "--remat", "off", "--packing", "off", *VARIANTS[variant])
    assert result.exit_code == 0, result.output
    trained = losses(out)
    assert len(trained) == 6 and all(math.isfinite(v) for v in trained)
    # Steps 2 and 3 (step 1's loss is the base's where B starts at 0) and every gradient norm (GRPO's losses are 0).
    assert not np.allclose(trained[1:], plain[method][1:], rtol=1e-6, atol=0), "the variant changed nothing"
    metrics = json.loads((out / "metrics.json").read_text())
    evaluated = invoke("eval", "--run", out)
    assert evaluated.exit_code == 0, evaluated.output
    loss = re.search(r"eval_loss (\S+)", evaluated.output)
    if metrics.get("eval_loss") is not None and loss:
        assert float(loss.group(1)) == pytest.approx(metrics["eval_loss"], rel=1e-4, abs=1e-4), (method, variant)
    else:
        assert "reward" in evaluated.output, evaluated.output
