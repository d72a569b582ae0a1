"""`finetune bench`: its rows, its FLOP count, its verdict, and one real run on this suite's backend.

No speed is asserted: the numbers belong in BENCHMARKS.md. The run is the
smallest that goes through every path: the tiny arch, one warm-up and one
timed step per row, in the worker processes `finetune bench` starts.
"""

import json
import os
import subprocess
import sys

import keras_hub
import pytest
from conftest import BACKEND

from finetune.tools import bench


def test_the_bench_runs_both_recipes_and_a_lever_on_this_backend(tmp_path):
    out, picture = tmp_path / "rows.json", tmp_path / "bench.png"
    args = [
        *("--arch tiny --seq-len 64 --batch-size 2 --steps 1 --warmup 1".split()),
        *("--backends", BACKEND, "--json", str(out), "--plot", str(picture)),
        # CI time: the packing lever's row is backend-independent code; the PyTorch suite runs it, and the stock
        # lever, PyTorch's alone (keras' own host work: the same losses as the row without it).
        *(["--levers", "packing,grouped,stock"] if BACKEND == "torch" else []),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "finetune", "bench", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "KERAS_BACKEND": BACKEND, "FINETUNE_BENCH_PEAK_SIZE": "1024"},
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = json.loads(out.read_text())
    levered = [(BACKEND, "finetune", lever) for lever in ("packing", "grouped", "stock")] if BACKEND == "torch" else []
    assert [(r["backend"], r["recipe"], r["lever"]) for r in rows] == [
        (BACKEND, "finetune", None),
        (BACKEND, "tutorial", None),
        *levered,
    ]
    for row in rows:
        assert {"backend", "recipe", "tokens_per_s", "padding_fraction", "mfu", "peak_memory_mb", "loss"} <= set(row)
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1 and row["peak_memory_mb"] > 0
        assert len(row["losses"]) == 2 and row["loss"] > 0
    packed, tutorial = rows[:2]
    unpacked = [row for row in rows if row["lever"] == "packing"]
    stock = [row for row in rows if row["lever"] == "stock"]
    assert all("keras' own ops" in row["settings"] for row in stock)
    assert all(row["losses"] == packed["losses"] for row in stock)  # lean ops are exact: the same tensors
    # Packing is what removes the padding; the tutorial pads every example to seq-len.
    assert all(packed["padding_fraction"] < row["padding_fraction"] / 2 for row in unpacked)
    # Batches of like length (--group-by-length) carry less of the padding packing off leaves.
    for grouped in (row for row in rows if row["lever"] == "grouped"):
        assert "batches of like length" in grouped["settings"] and grouped["padding_fraction"] < min(
            row["padding_fraction"] for row in unpacked
        )
    assert tutorial["padding_fraction"] > packed["padding_fraction"] and tutorial["precision"] == "float32"
    assert picture.read_bytes()[:4] == b"\x89PNG"
    lines = done.stdout.strip().splitlines()
    assert lines[-1].startswith(f"verdict: {BACKEND} is fastest here") and "the tutorial recipe" in lines[-1]
    assert any(line.startswith("backend") and "tokens/s" in line and "MFU" in line for line in lines)


def test_the_flop_count_covers_every_weight_of_the_architecture():
    """4 FLOPs per frozen weight per token: checked against the parameters keras-hub builds for the arch."""
    backbone = keras_hub.models.GemmaBackbone(vocabulary_size=300, **bench.ARCHS["tiny"])
    dims = bench.ARCHS["tiny"]
    norms = (2 * dims["num_layers"] + 1) * dims["hidden_dim"]
    attention = 3 * 2 * 2 * dims["num_layers"] * 64 * dims["num_query_heads"] * dims["head_dim"]
    flops = bench.train_flops_per_token("tiny", 300, 64)
    assert (flops - attention) / 4 == backbone.count_params() - norms


def test_gemma_2b_has_the_released_model_s_parameter_count():
    # gemma_2b_en: 2,506,172,416 parameters, of which 37 RMS norm scales of 2048.
    weights = (bench.train_flops_per_token("gemma-2b", 256000, 1) - 3 * 2 * 2 * 18 * 8 * 256) / 4
    assert weights + 37 * 2048 == 2_506_172_416


@pytest.mark.backend_neutral  # each family trains on every backend in test_as_typed; here, the bench's build of it
def test_the_new_families_train_in_the_bench(tmp_path):
    """tiny-gemma3 and tiny-gemma4-moe: the Gemma 3 and 4 backbones (sliding windows, Gemma 4's position ids and
    experts) built at random and trained by the bench's worker, as gemma3-1b, gemma3-4b and the gemma4 dims are."""
    out = tmp_path / "rows.json"
    args = [*"--seq-len 64 --batch-size 2 --steps 1 --warmup 1 --recipes finetune".split(), "--backends", BACKEND]
    for arch in ["tiny-gemma3", "tiny-gemma4-moe"]:
        done = subprocess.run([sys.executable, "-m", "finetune", "bench", "--arch", arch, *args, "--json", str(out)],
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, "KERAS_BACKEND": BACKEND, "FINETUNE_BENCH_PEAK_SIZE": "512"})  # fmt: skip
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        (trained,) = json.loads(out.read_text())
        assert trained["arch"] == arch and trained["tokens_per_s"] > 0 and 0 < trained["mfu"] < 1


@pytest.mark.one_backend
def test_the_flops_count_windows_wide_heads_and_the_experts_a_token_takes():
    # Gemma 3's sliding layers (5 of 6) attend over their window: past it, a longer row costs only the global ones.
    gemma3 = bench.ARCHS["gemma3-1b"]
    per_position = 3 * 2 * 2 * gemma3["num_query_heads"] * gemma3["head_dim"]
    globals_ = sum(1 for index in range(gemma3["num_layers"]) if index % 6 == 5)
    grown = bench.train_flops_per_token("gemma3-1b", 262144, 4096) - bench.train_flops_per_token("gemma3-1b", 262144,
                                                                                                  2048)  # fmt: skip
    assert grown == per_position * globals_ * 2048
    # The MoE: its experts at 8 of 128, so far under its 26B weights; its dense blocks whole.
    moe = bench.train_flops_per_token("gemma4-26b-a4b", 262144, 1)
    assert 4 * 3e9 < moe < 4 * 5e9
    # The released gemma-2b: the closed form the bench had before it read the layouts.
    a = bench.ARCHS["gemma-2b"]
    d, f = a["hidden_dim"], a["intermediate_dim"] // 2
    weights = 18 * (2 * d * 8 * 256 + 2 * d * 256 + 3 * d * f) + d * 256000
    assert bench.train_flops_per_token("gemma-2b", 256000, 1024) == 4 * weights + 3 * 2 * 2 * 18 * 1024 * 8 * 256


@pytest.mark.one_backend
def test_the_mfu_gives_the_datasheet_s_denominator_on_a_known_gpu():
    assert bench.datasheet_gflops("gpu (NVIDIA H100 80GB HBM3)", "bfloat16") == 989_000
    assert bench.datasheet_gflops("gpu (NVIDIA H100 PCIe)", "bfloat16") == 756_000
    assert bench.datasheet_gflops("gpu (Tesla T4)", "bfloat16") is None  # no bf16 units
    assert bench.datasheet_gflops("gpu (NVIDIA L40S)", "bfloat16") is None  # not an L4
    assert bench.datasheet_gflops("cpu (Intel Xeon, 2 cores)", "float32") is None
    # float32 matmuls run in TF32 on a GPU (backend.apply_tweaks): an H200 measured 335 TFLOP/s in float32, so
    # plain float32's 67 would put a float32 row's MFU* over 100%. The T4 has no TF32.
    measured_h200_float32 = 335_679
    assert bench.datasheet_gflops("gpu (NVIDIA H200)", "float32") > measured_h200_float32
    assert bench.datasheet_gflops("gpu (Tesla T4)", "float32") == 8_100
    peaks = {"bfloat16": {"gflops": 600_000.0, "backend": "jax", "by_backend": {"jax": 600_000.0},
                          "device": "gpu (NVIDIA H200)"}}  # fmt: skip
    rows = [dict(row("jax", 40_000), vocab=256000)]
    bench.add_mfu(rows, bench.Workload(arch="gemma-2b", seq_len=1024), peaks)
    assert rows[0]["mfu_datasheet"] == pytest.approx(rows[0]["mfu"] * 600 / 989, abs=1e-4)
    assert bench._mfu(rows[0]).endswith("*)") and "8192² matmul" in bench.peak_line(peaks)
    assert "on gpu (NVIDIA H200)" in bench.peak_line(peaks) and "on a CPU" not in bench.peak_line(peaks)


@pytest.mark.one_backend
def test_the_hf_peer_is_refused_for_an_architecture_it_cannot_build(tmp_path):
    done = subprocess.run([sys.executable, "-m", "finetune", "bench", "--arch", "gemma3-1b", "--recipes", "hf",
                           "--json", str(tmp_path / "rows.json")], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2 and "recipe hf builds Gemma 1's architecture" in done.stderr
    assert list(tmp_path.iterdir()) == []


def row(backend, tokens, recipe="finetune", peak=100.0, mfu=0.1):
    return {"backend": backend, "recipe": recipe, "lever": None, "tokens_per_s": tokens,
            "matmul_peak_gflops": peak, "compute_dtype": "bfloat16", "mfu": mfu}  # fmt: skip


def test_the_verdict_names_the_fastest_and_its_lead():
    line = bench.verdict(
        [row("jax", 900), row("tensorflow", 1800), row("torch", 1200), row("tensorflow", 600, "tutorial")]
    )
    assert line.startswith("verdict: tensorflow is fastest here (1800 tokens/s, 1.50x torch, 2.00x jax)")
    assert "3.00x the tutorial recipe on it" in line
    assert "behind" not in line  # nobody is more than 2x behind


@pytest.mark.one_backend
def test_a_grpo_verdict_ranks_the_whole_step_sampling_included():
    """Rollout rows: the step a run waits on decides, not the tokens trained after sampling (a backend that trains
    fast and samples slowly is not the fastest)."""

    def step(backend, step_s, generate_s, tokens, recipe="finetune"):
        return {**row(backend, tokens, recipe), "step_s": step_s, "generate_s": generate_s, "peak_memory_mb": 1000}

    line = bench.verdict(
        [step("torch", 2.0, 1.9, 900, "hf"), step("jax", 2.2, 1.0, 500), step("torch", 5.0, 4.7, 2000)]
    )
    assert line.startswith("verdict: jax is fastest here (2.20 s a step, 2.27x that on torch)")
    assert "jax's step takes 1.10x TRL's time (2.20 s against 2.00 s)" in line
    assert "torch is 2.3x behind: 4.70 s of its 5.00 s step is sampling" in line


def test_the_verdict_says_why_a_backend_is_more_than_2x_behind():
    slow_matmuls = bench.verdict([row("torch", 1000, peak=400), row("jax", 300, peak=150)])
    assert "jax is 3.3x behind: its bfloat16 matmuls peak at 150 GFLOP/s on this device against 400" in slow_matmuls
    elsewhere = bench.verdict([row("torch", 1000, mfu=0.3), row("jax", 300, mfu=0.09)])
    assert "jax is 3.3x behind: not its matmuls (100 GFLOP/s peak here, against 100 on torch)" in elsewhere
    assert "9% MFU against 30%" in elsewhere


def test_a_failed_row_is_shown_and_the_others_still_count():
    rows = [row("jax", 900), {"backend": "torch", "recipe": "finetune", "lever": None, "error": "MemoryError: x"}]
    assert bench.verdict(rows).startswith("verdict: jax is fastest here (900 tokens/s)")
    rows[0].update(settings="packed", padding_fraction=0.01, peak_memory_mb=2048, loss=1.5)
    assert "failed: MemoryError: x" in bench.table(rows)


def test_when_every_row_fails_nothing_is_written(tmp_path, monkeypatch):
    failed = {"backend": BACKEND, "recipe": "finetune", "lever": None, "error": "MemoryError: x"}
    monkeypatch.setattr(bench, "measure_peaks", lambda backends: {})  # measured in the test above
    monkeypatch.setattr(bench, "run_worker", lambda spec: dict(failed, recipe=spec.recipe))
    out = tmp_path / "rows.json"
    with pytest.raises(bench.UserError, match="every bench row failed; the first: MemoryError: x"):
        bench.run(bench.Workload(arch="tiny"), [BACKEND], ["finetune"], [], json_path=str(out))
    assert not out.exists()


def _no_work(monkeypatch):
    """Fail the test if the bench measures or trains anything."""

    def work(*args):
        raise AssertionError("the bench started work before refusing its output")

    monkeypatch.setattr(bench, "measure_peaks", work)
    monkeypatch.setattr(bench, "run_worker", work)


@pytest.mark.parametrize("flag", ["--json", "--plot"])
@pytest.mark.parametrize("where", ["folder", "read-only", "long name"])
def test_an_output_that_cannot_be_written_is_refused_before_any_work(flag, where, tmp_path, read_only_dir, monkeypatch):
    from conftest import invoke

    _no_work(monkeypatch)
    path = {"folder": tmp_path, "read-only": read_only_dir / "rows", "long name": tmp_path / ("r" * 250)}[where]
    result = invoke("bench", "--arch", "tiny", "--backends", BACKEND, flag, path)
    assert result.exit_code == 2, result.output
    expected = {"folder": "is a folder", "read-only": "not a writable directory", "long name": "too long"}[where]
    assert result.stderr.startswith("error: ") and expected in result.stderr and flag in result.stderr
    assert list(tmp_path.iterdir()) == [read_only_dir] and not list(read_only_dir.iterdir())


def test_rows_that_cannot_be_written_at_the_end_are_printed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "measure_peaks", lambda backends: {})
    done = dict(row(BACKEND, 900), settings="packed", padding_fraction=0.01, peak_memory_mb=2048, loss=1.5)
    monkeypatch.setattr(bench, "run_worker", lambda spec: done)
    out = tmp_path / "rows.json"

    def full_disk(path, write):
        raise OSError(28, "No space left on device")

    from finetune.training import outputs

    monkeypatch.setattr(outputs, "write_atomic", full_disk)
    with pytest.raises(bench.UserError, match="could not write .*rows.json \\(No space left on device\\); the rows"):
        bench.run(bench.Workload(arch="tiny"), [BACKEND], ["finetune"], [], json_path=str(out))
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.index("[\n") :])[0]["tokens_per_s"] == 900
    assert not out.exists()


def test_the_json_holds_each_finished_row_before_the_next_starts(tmp_path, monkeypatch):
    """A bench stopped mid-way (a lent device's time limit) keeps the rows that finished."""
    monkeypatch.setattr(bench, "measure_peaks", lambda backends: {})
    done = dict(row(BACKEND, 900), settings="packed", padding_fraction=0.01, peak_memory_mb=2048, loss=1.5)
    out = tmp_path / "rows.json"
    seen = []

    def worker(spec):
        seen.append([r["recipe"] for r in json.loads(out.read_text())] if out.exists() else None)
        return dict(done, recipe=spec.recipe)

    monkeypatch.setattr(bench, "run_worker", worker)
    bench.run(bench.Workload(arch="tiny"), [BACKEND], ["finetune", "tutorial"], [], json_path=str(out))
    assert seen == [None, ["finetune"]]
    assert [r["recipe"] for r in json.loads(out.read_text())] == ["finetune", "tutorial"]
    assert [p.name for p in tmp_path.iterdir()] == ["rows.json"]  # no partial file left beside it


@pytest.mark.skipif(BACKEND != "torch", reason="the lean path is PyTorch's")
@pytest.mark.parametrize("arch", ["host-2b", "host-e4b"])
def test_the_host_archs_train_lean_and_stock_to_the_same_losses(tmp_path, arch):
    """`--arch host-2b` and `host-e4b` (gemma-2b's 18 blocks, Gemma 4 e4b's 42, at width 64), through the command
    in fresh processes: PyTorch's lean path and keras' own (the stock lever) train the same losses, digit for
    digit."""
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, "-m", "finetune", "bench", "--arch", arch, *"--seq-len 32 --batch-size 1 --steps 2".split(),
         *"--warmup 1 --backends torch --recipes finetune --levers stock --json".split(), str(out)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "KERAS_BACKEND": BACKEND, "FINETUNE_BENCH_PEAK_SIZE": "512"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lean, stock = json.loads(out.read_text())
    assert (lean["arch"], lean["lever"], stock["lever"]) == (arch, None, "stock")
    assert "keras' own ops" in stock["settings"] and "keras' own ops" not in lean["settings"]
    assert len(lean["losses"]) == 3 and lean["losses"] == stock["losses"]


@pytest.mark.one_backend
def test_the_stock_lever_is_a_row_of_pytorch_alone(monkeypatch):
    """`stock` (keras' own per-op host work, against finetune's lean ops) is a PyTorch matter;
    `compile` is not JAX's, which always compiles."""
    monkeypatch.setattr(bench, "measure_peaks", lambda backends: {})
    specs = []

    def worker(spec):
        specs.append((spec.backend, spec.lever))
        return dict(row(spec.backend, 900), settings="packed", padding_fraction=0.01, peak_memory_mb=2048, loss=1.5)

    monkeypatch.setattr(bench, "run_worker", worker)
    bench.run(bench.Workload(arch="tiny"), ["jax", "torch"], ["finetune"], ["stock", "compile"])
    assert specs == [("jax", None), ("torch", None), ("torch", "stock"), ("torch", "compile")]
    assert bench._label({"recipe": "finetune", "lever": "stock"}) == "finetune, keras' own ops"


def test_the_plot_goes_to_the_path_given_whatever_its_suffix(tmp_path):
    bench.plot([dict(row(BACKEND, 900), losses=[2.0, 1.5])], tmp_path / "speed", bench.Workload(arch="tiny"))
    assert (tmp_path / "speed").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "speed.png").exists()


@pytest.mark.backend_neutral  # GRPO trains on every backend in test_grpo; the timing split is the bench's own
def test_the_grpo_bench_times_sampling_apart_from_training(tmp_path):
    """--method grpo: each row samples, scores and trains; the step's time splits into sampling and the rest.
    Under PyTorch the TRL GRPOTrainer peer runs beside it on the same prompts."""
    out = tmp_path / "rows.json"
    recipes = "finetune,hf" if BACKEND == "torch" else "finetune"
    args = [
        *(
            "--method grpo --arch tiny --seq-len 96 --max-completion-length 8 --num-generations 2 --batch-size 2".split()
        ),
        *"--steps 1 --warmup 1 --recipes".split(),
        recipes,
        "--backends",
        BACKEND,
        "--json",
        str(out),
    ]
    done = subprocess.run([sys.executable, "-m", "finetune", "bench", *args], capture_output=True, text=True,
                          env={**os.environ, "KERAS_BACKEND": BACKEND, "FINETUNE_BENCH_PEAK_SIZE": "1024"},
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["recipe"] for r in rows] == (["hf", "finetune"] if BACKEND == "torch" else ["finetune"])
    for row in rows:
        assert 0 < row["generate_s"] < row["step_s"], row
        assert row["generation_tokens_per_s"] > 0 and row["tokens_per_s"] > 0 and row["peak_memory_mb"] > 0
        assert 0 <= row["padding_fraction"] < 1 and "mfu" not in row  # a rollout step is not one FLOP count
    assert "s a step" in done.stdout
    if BACKEND == "torch":
        assert "x TRL's time" in done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "flags, says",
    [
        ("--recipes tutorial", "the tutorial trains SFT"),
        ("--num-generations 1", "--num-generations must be at least 2"),
        ("--seq-len 64 --max-completion-length 60", "--max-completion-length must be from 1"),
        ("--levers grouped", "--levers grouped: --method grpo: each rollout"),
    ],
)
@pytest.mark.backend_neutral
def test_a_grpo_bench_that_cannot_run_is_refused_before_any_work(flags, says):
    done = subprocess.run([sys.executable, "-m", "finetune", "bench", "--method", "grpo", "--arch", "tiny",
                           *flags.split()], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and says in done.stderr, done.stderr[-1500:]
