"""Shared fixtures, and the helpers that two or more test files use, each section naming its files.

The Keras backend comes from KERAS_BACKEND (one pytest process per backend).
"""

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# JAX compiles each new model's step with XLA, and the suite builds the same tiny models over and over, in its
# workers and in the `finetune` processes it starts: one persistent compilation cache for the session (inherited
# by the workers and the subprocesses) compiles each graph once. It only caches; a hit gives the same program.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="finetune-tests-jax-cache-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

BACKEND = os.environ["KERAS_BACKEND"]
REPO = Path(__file__).resolve().parent.parent
SHARED_DOLLY = REPO.parent / "shared" / "data" / "dolly-real-151.jsonl"


@contextlib.contextmanager
def float32_policy():
    """Build models in float32 whatever an earlier in-process run left as keras' global dtype policy.

    A run applies its precision globally, as the Keras tutorial does, and `auto`
    is mixed_bfloat16 on a CPU with bf16 units; exactness tests need float32.
    """
    import keras

    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy("float32")
    try:
        yield
    finally:
        keras.config.set_dtype_policy(before)


# A run in a test's process applies its precision globally (`auto` is mixed_float16 or mixed_bfloat16 on some
# CPUs), and a test that builds a layer read what an earlier test, an earlier file's fixture or a session fixture
# had left: it passed or failed by the order xdist chose, and by the machine. Each file starts from keras'
# default policy, and each test from the policy found before it (a file's own fixtures may set one).
@pytest.fixture(scope="module", autouse=True, name="_keras_default_dtype_policy_per_file")
def _keras_default_dtype_policy_per_file():
    keras = sys.modules.get("keras")
    if keras is not None:  # a session fixture set up for this file's first test may have set one: not ours
        keras.config.set_dtype_policy("float32")
    yield
    keras = sys.modules.get("keras")
    if keras is not None:
        keras.config.set_dtype_policy("float32")


@pytest.fixture(autouse=True, name="_keras_dtype_policy_kept_per_test")
def _keras_dtype_policy_kept_per_test():
    keras = sys.modules.get("keras")
    before = keras.config.dtype_policy() if keras is not None else None
    yield
    keras = sys.modules.get("keras")
    if keras is not None:
        keras.config.set_dtype_policy(before if before is not None else "float32")  # keras' own default


def tensorboard_scalars(log_dir) -> dict:
    """tag -> {step: value} of the TensorBoard event files in `log_dir`, read by TensorBoard's own loader (the
    tensorboard package, which reads them without TensorFlow); each must be a chart TensorBoard draws."""
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    found = {}
    for path in Path(log_dir).glob("events.out.tfevents.*"):
        events = event_accumulator.EventAccumulator(str(path), size_guidance={event_accumulator.TENSORS: 0})
        events.Reload()
        for tag in events.Tags()["tensors"]:
            assert events.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"  # what TensorBoard charts
            for event in events.Tensors(tag):
                found.setdefault(tag, {})[event.step] = float(tensor_util.make_ndarray(event.tensor_proto))
    return found


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def make_records(n: int, with_context_every: int = 3):
    out = []
    for i in range(n):
        out.append(
            {
                "instruction": f"What is {i} plus {i + 1}?",
                "context": f"Numbers {i} and {i + 1}." if i % with_context_every == 0 else "",
                "response": f"{i} plus {i + 1} is {2 * i + 1}.",
                "category": "general_qa" if i % 2 else "open_qa",
            }
        )
    return out


# === Records in every format finetune reads: one builder per format (test_data, test_templates, test_datacheck,
# test_train), and a writer for every container that can hold them ===

CHAT = {
    "messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2 plus 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3 plus 3?"},
        {"role": "assistant", "content": "6."},
    ]
}


def alpaca(i):
    return {"instruction": f"Add {i} and 1.", "input": "" if i % 2 else f"{i} + 1", "output": f"{i + 1}."}


def chat(i):
    return {"messages": [{"role": "user", "content": f"Add {i} and 1."}, {"role": "assistant", "content": f"{i + 1}."}]}


def sharegpt(i):
    turns = [{"from": "human", "value": f"Add {i} and 1."}, {"from": "gpt", "value": f"{i + 1}."}]
    return {"conversations": turns} if i % 2 else {"system": "Be brief.", "conversations": turns}


def completion(i):
    return {"prompt": f"{i} plus 1 is", "completion": f" {i + 1}."}


def completion_chat(i):
    """TRL's conversational prompt-completion, with an earlier answer in the prompt (not trained)."""
    prompt = [{"role": "user", "content": f"Add {i} and 1."}, {"role": "assistant", "content": f"{i + 1}."},
              {"role": "user", "content": "And 2?"}]  # fmt: skip
    return {"prompt": prompt, "completion": [{"role": "assistant", "content": f"{i + 2}."}]}


def text(i):
    return {"text": f"The number after {i} is {i + 1}, and the one after that is {i + 2}."}


def dolly(i):
    return make_records(i + 1)[i]


BUILDERS = {
    "dolly": dolly,
    "alpaca": alpaca,
    "chat": chat,
    "sharegpt": sharegpt,
    "completion": completion,
    "completion-chat": completion_chat,
    "text": text,
}
FLAT = ("dolly", "alpaca", "completion", "text")
CONTAINERS = ("jsonl", "json", "csv", "parquet")


def write(path, rows):
    """rows as the file its suffix names."""
    if path.suffix == ".jsonl":
        write_jsonl(path, rows)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=1))
    elif path.suffix == ".csv":
        import csv

        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# === Output paths nobody may write to (test_storage, test_bench, test_export) ===


@pytest.fixture
def read_only_dir(tmp_path, monkeypatch):
    """A folder that may not be written in: mode 555, and for root, whom modes do not stop, os.access says so as
    it does for a read-only file system (EROFS)."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    if os.geteuid() == 0:
        access = os.access

        def refusing(path, mode, *args, **kwargs):
            if mode & os.W_OK and Path(path).resolve() == folder.resolve():
                return False
            return access(path, mode, *args, **kwargs)

        monkeypatch.setattr(os, "access", refusing)
    yield folder
    folder.chmod(0o755)


# === Tokenized examples, for packing rows (test_attention, test_packing) ===


def examples_of(lengths, seed=0, vocabulary=200):
    """Tokenized examples of these lengths: random ids between BOS and EOS, the loss on the last two thirds."""
    import numpy as np

    from finetune.data import batching
    from finetune.data.batching import Example

    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = [batching.BOS, *(int(t) for t in rng.integers(10, vocabulary, size=n - 2)), batching.EOS]
        prompt = n // 3
        out.append(Example(ids, [0.0] * (prompt + 1) + [1.0] * (n - prompt - 1)))
    return out


# === Parameter counts, for test_archs and test_plan ===

# keras-hub's published `params` for each preset (keras_hub/src/models/gemma*/gemma*_presets.py).
PUBLISHED = {
    "gemma_2b_en": 2_506_172_416,
    "gemma_7b_en": 8_537_680_896,
    "gemma2_2b_en": 2_614_341_888,
    "gemma2_9b_en": 9_241_705_984,
    "gemma2_27b_en": 27_227_128_320,
    "gemma3_270m": 268_098_176,
    "gemma3_1b": 999_885_952,
    "gemma3_4b_text": 3_880_099_328,
    "gemma3_12b_text": 11_765_788_416,
    "gemma3_27b_text": 27_009_002_240,
    "gemma3_4b": 4_299_915_632,
    "gemma3_12b": 12_187_079_280,
    "gemma3_27b": 27_432_062_576,
    "gemma3n_e2b": 5_439_595_456,
    "gemma3n_e4b": 7_850_135_376,
}


# keras-hub publishes Gemma 4's counts rounded: (params, to the nearest).
ROUNDED = {
    "gemma4_2b": (5_100_000_000, 10**8),
    "gemma4_4b": (7_900_000_000, 10**8),
    "gemma4_26b_a4b": (26_000_000_000, 10**9),
    "gemma4_31b": (31_000_000_000, 10**9),
}


@pytest.fixture
def backend_name():
    return BACKEND


@pytest.fixture
def small_data(tmp_path):
    return write_jsonl(tmp_path / "small.jsonl", make_records(24))


@pytest.fixture
def tiny_args():
    """CLI flags for a fast tiny run on this process' backend."""
    return [
        "--preset",
        "tiny",
        "--backend",
        BACKEND,
        "--seq-len",
        "64",
        "--batch-size",
        "2",
        "--set",
        "train.samples=1",
        "--set",
        "train.max_new_tokens=4",
    ]


# === Runs trained, killed and resumed through the CLI (test_checkpoint, test_loop, test_outputs, test_remat,
# test_runs) ===

runner = CliRunner()
TESTS = Path(__file__).resolve().parent
# 8 steps of batch 2 on 40 records (38 to train: 19 steps an epoch); a checkpoint every 2 steps. No samples: these
# runs are stopped, resumed and compared, and generating a sample before and after training took 6 s a run on
# TensorFlow (tracing its generate function) for nothing they check. The samples have tests of their own, on every
# backend: tiny_args' runs (samples.md beside the user's files), test_train's, test_storage's, and test_loop's Ctrl-C
# while generating them. One PyTorch thread: these runs are compared bit for bit, and the default thread count is
# the cores idle when a run starts, which the other test worker's load changes between two runs (on a 2-core
# Xeon, 1 and 2 threads trained new token rows 1.2e-7 apart in float32; a killed run then resumed "differently").
SHORT = [
    "--preset", "tiny", "--backend", BACKEND, "--seq-len", "64", "--batch-size", "2", "--max-records", "40",
    "--max-steps", "8", "--checkpoint-every", "2", "--set", "train.samples=0", "--threads", "1",
]  # fmt: skip


def invoke(*args):
    from finetune.cli import app  # imported once KERAS_BACKEND is set, above

    return runner.invoke(app, [str(a) for a in args])


def train(out, *flags):
    result = invoke("gemma", *SHORT, *flags, "--output", out)
    assert result.exit_code == 0, result.output + (result.stderr or "")
    return result


def run_with_fault(out, fault: str, step: int, *flags, mark=None):
    env = {**os.environ, "KERAS_BACKEND": BACKEND, "FAULT": fault, "FAULT_STEP": str(step)}
    if mark:
        env["FAULT_MARK"] = str(mark)
    args = [sys.executable, str(TESTS / "fault_run.py"), "gemma", *SHORT, *flags, "--output", str(out)]
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)


def train_losses(out):
    return [r["train_loss"] for r in _history(out) if r["train_loss"]]


def adapter_arrays(path) -> dict:
    """Every array of an adapter file (adapter.lora.h5), by its path in the file."""
    import h5py

    arrays = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, item: arrays.__setitem__(name, item[()]) if isinstance(item, h5py.Dataset) else None)
    return arrays


def _history(out):
    import csv

    return list(csv.DictReader((out / "history.csv").open()))


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """An 8-step run, never stopped, that killed and resumed runs are compared against; they only read it, so one
    per worker serves every file."""
    out = tmp_path_factory.mktemp("whole") / "run"
    train(out)
    return out


# === The tiny Gemma with LoRA, trained on packed rows (test_objective, test_quantized, test_remat) ===


def packed_rows(tokenizer, seq_len=48, n=12):
    from finetune.data import batching, packing

    pairs = [(f"Instruction:\nName {i} things.\n\nResponse:\n", "thing " * (i % 5 + 1)) for i in range(n)]
    examples, _ = batching.tokenize(pairs, tokenizer, seq_len)
    return packing.pack(examples, seq_len)


def lora_model(precision="float32", quantize=None, remat=False, dropout=0.0):
    """The tiny Gemma built in `precision` (quantized, with remat, if asked), LoRA of rank 2 on query and value
    (with `dropout` on their input while training)."""
    import keras

    from finetune.config import LoraConfig
    from finetune.model import builder, presets
    from finetune.platform import backend

    backend.set_seed(0)
    keras.config.set_dtype_policy(backend.POLICIES[precision][1])
    lm, preprocessor = builder.build(presets.Source("tiny", "tiny", "gemma"), 48, precision, quantize, remat)
    builder.enable_lora(lm, LoraConfig(rank=2, targets=["query", "value"], dropout=dropout), seed=0)
    return lm, preprocessor


def forward(model, x):
    """model(x) as numpy, inference mode. On JAX through keras' jit-compiled predict (one program a shape): an eager
    call there compiles each op of each shape on its own, which made an eager check of a few batches take a minute."""
    import keras

    if keras.config.backend() == "jax":
        return model.predict_on_batch(x)
    return keras.ops.convert_to_numpy(model(x))


def lora_train_losses(lm, steps=6, learning_rate=1e-2):
    """The loss of each of `steps` steps of `lm` on packed_rows, 4 rows a batch. The files import it as
    `train_losses`, the name it had before these files shared it; a run's train_losses above reads history.csv."""
    from finetune.data import batching
    from finetune.model import builder, presets

    trainer = builder.compile(lm, learning_rate, 0.0)
    rows = packed_rows(presets.tiny_tokenizer())
    order = batching.TrainOrder(rows, 4, seed=0)
    return [float(trainer.train_on_batch(*order.batch(s)[:2], sample_weight=order.batch(s)[2])) for s in range(steps)]


# --- one_backend and backend_neutral: tests that run once, in the PyTorch suite (the fastest) ---------------
# CI runs the suite once per backend; a test that would check the same thing in each runs in one, and the JAX and
# TensorFlow suites leave it out (deselected, not skipped). Mark a module with `pytestmark = pytest.mark.X`, or
# one test with the decorator.
# - one_backend: the test touches no Keras backend (formats, templates, config, packing, the CLI's parsing).
# - backend_neutral: the test trains or loads a model on a backend, but the behaviour it checks is decided by code
#   that does not branch on the backend (a run folder's lifecycle, a refusal before or after training, tracking
#   writers, reports, labels), and another test checks on every backend the backend-dependent part it relies on
#   (exact resume: test_checkpoint's kill-and-resume tests; numerics: test_backends_agree, test_objective...).
#   Say which in a comment beside the mark when it is not obvious.
ONE_BACKEND_SUITE = "torch"
ONCE = ("one_backend", "backend_neutral")


def pytest_configure(config):
    config.addinivalue_line("markers", "one_backend: touches no Keras backend; runs in the PyTorch suite only")
    config.addinivalue_line(
        "markers",
        "backend_neutral: trains on a backend, but what it checks is decided by code that does not branch on the "
        "backend, and another test checks the backend-dependent part on every backend; runs in the PyTorch suite only",
    )


def pytest_collection_finish(session):
    """Keep the garbage collections the tests cause off what collection imported: keras runs a full gc.collect()
    for each variable a layer deletes, and each walks every object of the process, millions once TensorFlow and
    the test modules are in (keras_compat.collections_of_new_objects_only). What exists now lives all session."""
    import gc

    from finetune.platform import keras_compat

    # Each model a test builds in a worker would start with a full collection of the worker's heap
    # (keras_compat.FULL_COLLECTION_FIRST, which frees a notebook's previous model first): on TensorFlow, 14 s a
    # build once a worker has built hundreds (test_train.py: 604 s with it, 254 s without). Python's own
    # collections free the workers' garbage; test_keras_compat checks the collection a user's process makes.
    keras_compat.FULL_COLLECTION_FIRST = False
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    if BACKEND == ONE_BACKEND_SUITE:
        return
    once = [any(item.get_closest_marker(name) for name in ONCE) for item in items]
    left = [item for item, marked in zip(items, once) if marked]
    kept = [item for item, marked in zip(items, once) if not marked]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept


# --- the workers' schedule: the longest files first ----------------------------------------------------------
# `--dist loadfile` (pyproject.toml) keeps a file's tests on one worker, so that its module fixtures are made once.
# xdist hands out the files with the most tests first, which left the PyTorch suite's two slowest files, one test
# each (a torch.compile of the tiny model, 118 s, and the GPU check's dry run, 62 s), for the end: one worker ran
# them for two minutes while the other sat idle. Each worker is given instead the file that took longest in the
# last measured run of this backend (tests/durations.json); a file not in it counts a second a test. The order
# changes no test's outcome. `--store-durations` rewrites this backend's entry from the run just made.
DURATIONS = TESTS / "durations.json"


def stored_durations() -> dict:
    """backend -> {test file: seconds} from DURATIONS; empty where it is missing or unreadable."""
    try:
        return json.loads(DURATIONS.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def pytest_addoption(parser):
    parser.addoption("--store-durations", action="store_true", help=f"write each file's seconds to {DURATIONS.name}")


@pytest.hookimpl(optionalhook=True)  # xdist's hook: a run without xdist (-p no:xdist) has no such hook
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    seconds = stored_durations().get(BACKEND, {})

    if not hasattr(LoadFileScheduling, "_assign_work_unit"):
        return None  # an xdist whose scheduler is built otherwise (pyproject asks >=3.5): its own order

    class LongestFileFirst(LoadFileScheduling):
        def _assign_work_unit(self, node):
            if hasattr(self.workqueue, "move_to_end"):
                longest_first(self.workqueue, seconds)
            super()._assign_work_unit(node)  # hands out the workqueue's first file

    return LongestFileFirst(config, log)


def longest_first(workqueue, seconds: dict) -> None:
    """Move the file expected to take longest to the front of xdist's workqueue (file -> {test id: done})."""
    longest = max(workqueue, key=lambda path: seconds.get(path, len(workqueue[path])))
    workqueue.move_to_end(longest, last=False)


_file_seconds: dict = {}


def pytest_runtest_logreport(report):
    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # the controller (or a run without workers) adds them up
        path = report.nodeid.split("::", 1)[0]
        _file_seconds[path] = _file_seconds.get(path, 0.0) + report.duration


def pytest_sessionfinish(session):
    if not session.config.getoption("store_durations", False) or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    stored = stored_durations()
    stored[BACKEND] = {path: round(s, 1) for path, s in _file_seconds.items()}
    DURATIONS.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n", encoding="utf-8")


# --- a killed run: tests/test_families.py, tests/test_images.py ---------------------------------------------


def killed_after(whole, out, step: int):
    """A copy of the finished run `whole` at `out`, as a kill right after step `step`'s checkpoint leaves it."""
    import shutil

    from finetune.training import checkpoint, outputs

    shutil.copytree(whole, out)
    for found in checkpoint.find(out):
        if found.step > step:
            shutil.rmtree(found.path)
    (out / outputs.METRICS).unlink()
    return out
