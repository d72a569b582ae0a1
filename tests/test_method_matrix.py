"""Every method against each feature written below the methods: a finite run equal to the plain one, or a clean
refusal (exit 2, nothing written) that names the combination.

A feature written once below the methods holds for every method; this matrix is where that is checked, so a
new method is a new row here. Each cell trains the tiny preset for a few steps in float32, from the command line
as typed. The backend-dependent parts of each feature have their own tests on every backend (remat and dropout:
test_remat.py; accumulation: test_optimizer.py, test_preference.py; resume: test_checkpoint.py), so the matrix
runs in one suite.

Not in the matrix yet: --parallel data (test_distribution.py for SFT; pairs: test_preference_runs.py) and the
split across processes (test_distribution.py, SFT only; docs/not-yet.md).
"""

import csv
import math

import pytest
from conftest import BACKEND, invoke, make_records, write_jsonl
from test_preference_runs import learnable_pairs

from finetune.methods import registry

pytestmark = pytest.mark.backend_neutral  # the features' backend parts: the tests named above

METHODS = list(registry.METHODS)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Each method's records: 21 of them, so that no batch of 4 divides the training share (filler rows)."""
    root = tmp_path_factory.mktemp("matrix")
    sft = write_jsonl(root / "sft.jsonl", make_records(21))
    paired = write_jsonl(root / "pairs.jsonl", learnable_pairs(21))
    return {name: sft if not registry.get(name).paired else paired for name in METHODS}


def run(method, data, out, *flags):
    """`finetune gemma` as typed: the tiny preset, float32, 3 steps of 4 (pairs), the method's records."""
    return invoke("gemma", "--preset", "tiny", "--backend", BACKEND, "--precision", "float32", "--seq-len", "48",
                  "--method", method, "--data", data[method], "--max-steps", "3", "--set", "train.samples=0",
                  "--lr", "1e-2", "--output", out, *flags)  # fmt: skip


def losses(out) -> list[float]:
    with (out / "history.csv").open() as f:
        return [float(r["train_loss"]) for r in csv.DictReader(f) if r["train_loss"]]


@pytest.fixture(scope="module")
def plain(data, tmp_path_factory):
    """Each method's run with no feature: batch 4, no accumulation, remat off, no dropout or noise."""
    out = {}
    for method in METHODS:
        path = tmp_path_factory.mktemp(f"plain-{method}") / "run"
        result = run(method, data, path, "--batch-size", "4", "--remat", "off", "--packing", "off")
        assert result.exit_code == 0, result.output
        out[method] = losses(path)
        assert len(out[method]) == 3 and all(math.isfinite(v) for v in out[method])
    return out


@pytest.mark.parametrize("method", METHODS)
def test_grad_accum_equals_the_whole_batch(method, data, plain, tmp_path):
    result = run(method, data, tmp_path / "run", "--batch-size", "2", "--grad-accum", "2", "--remat", "off",
                 "--packing", "off")  # fmt: skip
    assert result.exit_code == 0, result.output
    # Within 1e-5, or float32's rounding of IPO's squared losses (about 25 at the start).
    assert losses(tmp_path / "run") == pytest.approx(plain[method], rel=1e-6, abs=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_remat_equals_no_remat(method, data, plain, tmp_path):
    result = run(method, data, tmp_path / "run", "--batch-size", "4", "--remat", "on", "--packing", "off")
    assert result.exit_code == 0, result.output
    assert losses(tmp_path / "run") == pytest.approx(plain[method], rel=1e-6, abs=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_dropout_and_neftune_train_finite_to_the_end_with_filler_rows(method, data, tmp_path):
    """Three epochs of 4 on a training share no batch divides: each epoch ends on a step with filler rows."""
    result = run(method, data, tmp_path / "run", "--batch-size", "4", "--lora-dropout", "0.1", "--neftune-alpha",
                 "5", "--max-steps", "15", "--packing", "off")  # fmt: skip
    assert result.exit_code == 0, result.output
    trained = losses(tmp_path / "run")
    assert len(trained) == 15 and all(math.isfinite(v) for v in trained)


@pytest.mark.parametrize("method", METHODS)
def test_auto_batch_size_probes_the_method_s_own_batches(method, data, tmp_path):
    result = run(method, data, tmp_path / "run", "--batch-size", "auto")
    assert result.exit_code == 0, result.output
    assert "batch size auto: " in result.output and math.isfinite(losses(tmp_path / "run")[-1])


@pytest.mark.parametrize("method", METHODS)
def test_packing_trains(method, data, tmp_path):
    """--packing on: SFT's examples several to a row, pairs whole in micro-batches of 4 rows (issue 34)."""
    result = run(method, data, tmp_path / "run", "--batch-size", "4", "--packing", "on")
    assert result.exit_code == 0, result.output
    assert "packing: " in result.output and "padding " in result.output, result.output
    trained = losses(tmp_path / "run")
    assert len(trained) == 3 and all(math.isfinite(v) for v in trained)


@pytest.mark.parametrize("method", [m for m in METHODS if registry.get(m).paired])
def test_pairs_with_pictures_are_refused_before_anything_is_written(method, tmp_path):
    """They trained on the literal text `<image>`: the pairs path never read the pictures."""
    from PIL import Image

    Image.new("RGB", (8, 8), "red").save(tmp_path / "red.png")
    rows = [{"prompt": "<image>What colour is it?", "chosen": "Red.", "rejected": "Blue.", "images": ["red.png"]}] * 8
    paired = write_jsonl(tmp_path / "pictured.jsonl", rows)
    result = invoke("gemma", "--preset", "tiny-gemma3-vision", "--backend", BACKEND, "--method", method, "--data",
                    paired, "--batch-size", "2", "--output", tmp_path / "run")  # fmt: skip
    assert result.exit_code == 2, result.output
    assert f"--method {method} does not train on pictures" in result.output
    assert not (tmp_path / "run").exists()
