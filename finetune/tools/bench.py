"""`finetune bench`: one LoRA workload trained on each backend, side by side, with numbers that compare.

Each (backend, recipe) row runs in its own Python process, since Keras fixes
its backend at first import. The model is a Gemma architecture with random
weights (throughput does not depend on their values); the data is real.

- Recipe `finetune` is what `finetune gemma` trains with: packed rows, the
  backend's tweaks (precision `auto`, PyTorch threads), response-only loss, one
  `train_on_batch` per step, exactly as loop.py drives it.
- Recipe `tutorial` is the Keras Gemma LoRA tutorial's: every example padded
  to seq-len, float32, no tweaks, `fit()` on the preprocessed batches.
- Recipe `hf` is the peer: Hugging Face transformers + PEFT, packed, its base
  built in the dtype --precision auto picks on the device (peer.py), in the
  torch process: one row for the strongest attention and loss installed there
  (padding-free on FlashAttention-2 or flex attention, Liger's fused loss), and
  one for the sdpa floor (a block-diagonal mask) where that differs.
- A lever row is the `finetune` recipe with one setting changed (packing off,
  float32, an int4 or int8 base, remat on), so what each buys is measured in
  the same run.

tokens/s counts the non-padding tokens of the timed steps only: the first
`warmup` steps, and the first step of each batch shape (it compiles), are left
out, and nothing else is timed. MFU is those tokens/s times the training FLOPs
per token of the full model (its whole vocabulary projection included), over
the device's matmul peak in the row's compute dtype: a large square matmul,
warmed up, the best of several runs on each backend, measured once before the
rows and printed with the table.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from finetune.config import LoraConfig, TrainConfig, setting
from finetune.methods import registry
from finetune.model import archs, presets
from finetune.platform.errors import UserError

# Gemma architectures as keras-hub backbone configs, random weights. cpu-small is the shared benchmark workload's;
# the others are released models' (archs.py), with the settings that pick their kernels and not their shapes
# (soft caps, sliding windows) as their presets have them. gemma3-4b is the text tower of Gemma 3 4B.
PRESETS = {
    "gemma-2b": "gemma_2b_en",
    "gemma-7b": "gemma_7b_en",
    "gemma2-2b": "gemma2_2b_en",
    "gemma3-1b": "gemma3_1b",
    "gemma3-4b": "gemma3_4b_text",
    "gemma4-e4b": "gemma4_4b",
    "gemma4-26b-a4b": "gemma4_26b_a4b",
}
_KERNEL_SETTINGS = {
    "gemma2-2b": dict(attention_logit_soft_cap=50.0, final_logit_soft_cap=30.0, use_sliding_window_attention=True,
                      sliding_window_size=4096),
    "gemma3-1b": dict(use_sliding_window_attention=True, sliding_window_size=512, global_rope_scaling_factor=1.0),
    "gemma3-4b": dict(use_sliding_window_attention=True, sliding_window_size=1024, global_rope_scaling_factor=8.0),
}  # fmt: skip
# tiny-gemma3 and tiny-gemma4 (the MoE's), the tiny presets' decoders: the families' paths, in seconds.
_TINY = ("tiny-gemma3", "tiny-gemma4-moe")
FAMILY = {"tiny": "gemma", "cpu-small": "gemma", "host-2b": "gemma", "host-e4b": "gemma4",
          **{name: presets.TINY[name].family for name in _TINY},
          **{name: archs.ARCHS[p].family for name, p in PRESETS.items()}}  # fmt: skip
ARCHS = {
    "tiny": presets.TINY_CONFIG,
    **{name: {k: v for k, v in presets.TINY[name].config.items() if k not in ("vocabulary_size", "image_size")}
       for name in _TINY},
    "cpu-small": dict(
        num_layers=6, num_query_heads=4, num_key_value_heads=1, hidden_dim=512, intermediate_dim=2048, head_dim=128
    ),
    # gemma-2b's structure (18 blocks, 8 query heads on one key head) at widths where the arithmetic costs next to
    # nothing: its step is the host's work per step, what a GPU step waits on where the host is the bottleneck
    # (PyTorch's, BENCHMARKS.md). Measurable on any CPU, --seq-len 32 --batch-size 1.
    "host-2b": dict(
        num_layers=18, num_query_heads=8, num_key_value_heads=1, hidden_dim=64, intermediate_dim=128, head_dim=16
    ),
    # Gemma 4 e4b's the same way: its 42 blocks, 8 query heads on 2 key heads, the sliding and global layers, the 18
    # that borrow keys and values, per-layer inputs (of the tokenizer's vocabulary), at width 64.
    "host-e4b": {
        **{k: v for k, v in archs.ARCHS["gemma4_4b"].config.items()
           if k not in ("vocabulary_size", "vocab_size_per_layer_input")},
        **dict(hidden_dim=64, intermediate_dim=128, head_dim=16, global_head_dim=32, hidden_size_per_layer_input=16),
    },
    **{
        name: {**{k: v for k, v in archs.ARCHS[p].config.items() if k != "vocabulary_size"},
               **_KERNEL_SETTINGS.get(name, {})}
        for name, p in PRESETS.items()
    },
}  # fmt: skip
# The released models' vocabulary; the small archs take the tokenizer's. Ids of
# a small tokenizer are valid ids of a larger vocabulary, and the logits cost is the real one.
VOCAB = {name: archs.ARCHS[p].config["vocabulary_size"] for name, p in PRESETS.items()}
BACKENDS = ("jax", "torch", "tensorflow")
RECIPES = ("finetune", "tutorial", "hf")
LEVERS = {
    "packing": "packing off",
    "grouped": "packing off, batches of like length",  # --group-by-length: the padding packing off leaves, less
    "precision": "float32",
    "int8": "int8 base",
    "int4": "int4 base",
    "remat": "remat on",
    "compile": "compiled step",  # PyTorch: each decoder block torch.compile'd; TensorFlow: XLA; JAX always compiles
    "stock": "keras' own ops",  # PyTorch: keras' per-op host work as it comes, without keras_compat.lean_torch_ops
}
UNPACKED = ("packing", "grouped")  # the levers whose rows hold one example each
ROW = "BENCH-ROW "  # a worker's last stdout line: this, then the row as JSON


@dataclass
class Workload:
    """What every row trains: `finetune bench` takes a flag for each field (cli.with_settings)."""

    arch: str = setting("cpu-small", "Gemma architecture, random weights: tiny, tiny-gemma3, tiny-gemma4-moe, "
                        "cpu-small, host-2b and host-e4b (gemma-2b's 18 blocks and Gemma 4 e4b's 42 at width 64: "
                        "the host's work), gemma-2b, gemma-7b, "
                        "gemma2-2b, gemma3-1b, gemma3-4b (text), gemma4-e4b, gemma4-26b-a4b.", flag="--arch",
                        metavar="NAME")  # fmt: skip
    tokenizer: str = setting("", "A SentencePiece .spm tokenizer file.", flag="--tokenizer", metavar="FILE",
                             default_text="the tiny model's")  # fmt: skip
    data: str = setting("sample", "Dolly-style JSONL to train on, or `sample`.", flag="--data", metavar="FILE")
    seq_len: int = setting(512, "Tokens per row.", flag="--seq-len")
    batch_size: int = setting(8, "Rows per step.", flag="--batch-size")
    steps: int = setting(10, "Timed steps per row of the table, after the warm-up ones.", flag="--steps")
    warmup: int = setting(2, "Steps run before timing (the first compiles).", flag="--warmup")
    rank: int = setting(4, "LoRA rank, on query and value.", flag="--rank")
    quantize: str = setting("", "int4 or int8: the finetune rows' base built quantized (gemma-7b fits a 24 GB host "
                            "so).", flag="--quantize", metavar="int4|int8", default_text="none")  # fmt: skip
    method: str = setting("sft", "sft, or dpo, orpo, simpo: the finetune rows train that loss on pairs made from the "
                          "records as the TRL DPO peer (peer_trl_dpo.py) makes them (the chosen answer the response, "
                          "the rejected its words shuffled); --batch-size counts pairs. grpo: rollouts of the records' "
                          "prompts, rewarded by the share of --max-completion-length used; --batch-size counts "
                          "prompts, and recipe hf is TRL's GRPOTrainer on the same.", flag="--method",
                          metavar="NAME")  # fmt: skip
    num_generations: int = setting(4, "--method grpo: completions sampled per prompt.", flag="--num-generations")
    max_completion_length: int = setting(64, "--method grpo: the most tokens a completion samples; --seq-len is the "
                                         "prompt and the completion.", flag="--max-completion-length")  # fmt: skip
    peer: str = setting("auto", "Recipe hf's attention: auto (the strongest installed, then the sdpa floor), flash, "
                        "flex or sdpa (peer.py).", flag="--peer", metavar="NAME")  # fmt: skip


@dataclass
class Spec:
    backend: str
    recipe: str
    lever: str | None = None
    workload: Workload = field(default_factory=Workload)
    setup: str | None = None  # recipe hf: peer.Setup's name


def default_recipes(workload: Workload) -> str:
    """The recipes benched when none are named: finetune's and the Keras tutorial's, or finetune's alone for a
    preference method (the tutorial trains SFT)."""
    method = registry.get(workload.method)
    return "finetune" if method.paired or method.prompted else "finetune,tutorial"


def _check_tokenizer(path: str) -> None:
    """--tokenizer: a SentencePiece model file that loads, before any row spends its time."""
    import sentencepiece

    if not Path(path).is_file():
        raise UserError(f"tokenizer {path} does not exist; pass a SentencePiece .spm file")
    try:
        sentencepiece.SentencePieceProcessor(model_file=path)
    except (RuntimeError, OSError):
        raise UserError(f"tokenizer {path} is not a SentencePiece model; pass an .spm file, such as a Gemma "
                        "preset's tokenizer.model") from None  # fmt: skip


def check(workload: Workload, backends: list[str], recipes: list[str], levers: list[str]) -> None:
    """Everything a user can get wrong, before any process starts."""
    if workload.arch not in ARCHS:
        raise UserError(f"unknown arch {workload.arch!r}; choose one of {', '.join(ARCHS)}")
    if workload.tokenizer:
        _check_tokenizer(workload.tokenizer)
    for name, value, least in (
        ("seq-len", workload.seq_len, 16),
        ("batch-size", workload.batch_size, 1),
        ("steps", workload.steps, 1),
        ("warmup", workload.warmup, 1),
        ("rank", workload.rank, 1),
    ):
        if value < least:
            raise UserError(f"--{name} must be at least {least}, got {value}")
    for kind, given, allowed in (
        ("backend", backends, BACKENDS),
        ("recipe", recipes, RECIPES),
        ("lever", levers, LEVERS),
    ):
        unknown = [g for g in given if g not in allowed]
        if unknown:
            raise UserError(f"unknown {kind} {unknown[0]!r}; choose from {', '.join(allowed)}")
    if workload.quantize not in ("", "int4", "int8"):
        raise UserError(f"unknown quantize mode {workload.quantize!r}; choose int4 or int8, or leave it out")
    method = registry.get(workload.method)
    if method.paired and [r for r in recipes if r != "finetune"]:
        raise UserError(f"--method {workload.method} benches the finetune recipe alone (the tutorial and hf recipes "
                        "train SFT): pass --recipes finetune")  # fmt: skip
    if method.prompted and "tutorial" in recipes:
        raise UserError(f"--method {workload.method} benches recipes finetune and hf (TRL's GRPOTrainer); the "
                        "tutorial trains SFT: leave it out of --recipes")  # fmt: skip
    unpacked = [lever for lever in levers if lever in UNPACKED]
    if unpacked and method.unpacked_why():  # GRPO: each rollout is a row of its own already
        raise UserError(f"--levers {unpacked[0]}: {method.unpacked_why()}; leave it out")
    if method.prompted and workload.num_generations < 2:
        raise UserError(f"--num-generations must be at least 2 (a group's advantages need two), got "
                        f"{workload.num_generations}")  # fmt: skip
    if method.prompted and not 1 <= workload.max_completion_length <= workload.seq_len - 8:
        raise UserError(f"--max-completion-length must be from 1 to --seq-len less 8 ({workload.seq_len - 8}), got "
                        f"{workload.max_completion_length}")  # fmt: skip
    if not backends or not (recipes or levers):
        raise UserError("nothing to run: give at least one backend and one recipe")
    from finetune.tools import peer

    if "hf" in recipes and (FAMILY[workload.arch] != "gemma" or "attention_logit_soft_cap" in ARCHS[workload.arch]):
        raise UserError(f"recipe hf builds Gemma 1's architecture (GemmaForCausalLM); --arch {workload.arch} is "
                        "another: bench it with --recipes finetune")  # fmt: skip
    if "hf" in recipes and not peer.available():
        raise UserError("recipe hf needs torch, transformers and peft: pip install 'finetune[torch,hf]'")
    if "hf" in recipes and method.prompted and not method.bench_peer:
        raise UserError(f"recipe hf has no {method.title} peer yet (its peer is TRL's GRPOTrainer, for --method "
                        "grpo): pass --recipes finetune")  # fmt: skip
    if "hf" in recipes and method.prompted:
        from finetune.tools import peer_grpo

        if not peer_grpo.available():
            raise UserError("recipe hf under --method grpo is TRL's GRPOTrainer: pip install 'finetune[torch,hf,dev]'")
    if workload.peer != "auto" and method.prompted:
        raise UserError(f"--peer picks the SFT peer's attention; --method {workload.method}'s peer is TRL's trainer")
    if "hf" in recipes and not method.prompted:
        hf_specs(workload, levers)  # a --peer not installed here is refused now
    import importlib.util

    missing = [b for b in backends if importlib.util.find_spec(b) is None]
    if missing:
        raise UserError(
            f"{missing[0]} is not installed; pip install 'finetune[{missing[0]}]', or leave it out of --backends"
        )
    from finetune.data import formats

    formats.load_records(workload.data)  # a missing or malformed file fails here, not in every worker


def hf_specs(workload: Workload, levers: list[str]) -> list[Spec]:
    """Recipe hf's rows: one per peer setup (peer.setups: the strongest installed, then the sdpa floor), and with
    the precision lever the strongest in float32 too, to compare in the same dtype. TRL's GRPOTrainer is one row."""
    if registry.get(workload.method).prompted:
        names, float32 = [None], None
    else:
        from finetune.tools import peer

        device = peer.device()
        names = [setup.name for setup in peer.setups(device, True, workload.peer)]
        float32 = peer.setups(device, False, workload.peer)[0].name if "precision" in levers else None
    specs = [Spec("torch", "hf", None, workload, name) for name in names]
    if "precision" in levers:
        specs.append(Spec("torch", "hf", "precision", workload, float32))
    return specs


def installed_backends() -> list[str]:
    import importlib.util

    return [b for b in BACKENDS if importlib.util.find_spec(b) is not None]


def run(
    workload: Workload,
    backends: list[str],
    recipes: list[str],
    levers: list[str],
    json_path: str | None = None,
    plot_path: str | None = None,
) -> list[dict]:
    """Run every row, one process each, one after another; print the table and the verdict."""
    check(workload, backends, recipes, levers)
    from finetune.platform import storage

    for path, flag in ((json_path, "--json"), (plot_path, "--plot")):
        if path is not None:  # written beside under a temporary name, then renamed (outputs.write_atomic)
            storage.check_output(path, flag, beside=len(".partial."))
    specs = hf_specs(workload, levers) if "hf" in recipes else []
    specs += [Spec(b, r, None, workload) for b in backends for r in recipes if r != "hf"]
    specs += [Spec(b, "finetune", lever, workload) for b in backends for lever in levers
              if not (lever == "compile" and b == "jax") and not (lever == "stock" and b != "torch")]  # fmt: skip
    order = ["torch", *backends] if "hf" in recipes else backends
    specs.sort(key=lambda spec: order.index(spec.backend) if spec.recipe != "hf" else -1)  # the peer first
    peaks = measure_peaks(sorted({spec.backend for spec in specs}))
    print(peak_line(peaks), flush=True)
    rows = []
    for index, spec in enumerate(specs, 1):
        label = f"{spec.backend} {_label(asdict(spec))}"
        print(f"bench {index}/{len(specs)}: {label} ...", flush=True)
        row = run_worker(spec)
        rows.append(row)
        if "error" in row:
            print(f"  failed: {row['error']}", flush=True)
        else:
            pairs = f", {row['pairs_per_s']:.2f} pairs/s" if "pairs_per_s" in row else ""
            if "step_s" in row:
                pairs = (f" trained, {row['generation_tokens_per_s']:.0f} generated, {row['step_s']:.2f} s a step "
                         f"({row['generate_s']:.2f} s sampling)")  # fmt: skip
            print(f"  {row['tokens_per_s']:.0f} tokens/s{pairs}, loss {_loss(row)}", flush=True)
        if json_path is not None and index < len(specs) and any("error" not in r for r in rows):
            # the rows so far, so a bench stopped later (a device's time limit) keeps them
            so_far = [dict(r) for r in rows]
            add_mfu(so_far, workload, peaks)
            try:
                _write_json(so_far, json_path)
            except UserError:  # the disk: said at the end, with every row printed
                pass
    add_mfu(rows, workload, peaks)
    print()
    print(table(rows))
    print(peak_line(peaks))
    print(verdict(rows))
    if all("error" in row for row in rows):  # nothing to write
        raise UserError(f"every bench row failed; the first: {rows[0]['error']}")
    if json_path is not None:
        _write_json(rows, json_path)
    if plot_path is not None:
        _write(plot_path, lambda p: plot(rows, p, workload), rows)
    return rows


def _write_json(rows: list[dict], path: str) -> None:
    text = json.dumps(rows, indent=1, allow_nan=False) + "\n"
    _write(path, lambda p: p.write_text(text, encoding="utf-8"), rows)


def _write(path: str, write, rows: list[dict]) -> None:
    """`write` to `path` atomically; where the disk fails, the rows are printed as JSON and the error said."""
    from finetune.training import outputs

    try:
        outputs.write_atomic(Path(path), write)
    except OSError as e:  # the disk filled or changed during the bench: the rows are not lost
        print(json.dumps(rows, indent=1, allow_nan=False))
        raise UserError(f"could not write {path} ({e.strerror or e}); the rows are printed above as JSON") from e


def run_worker(spec: Spec) -> dict:
    """One row, in a fresh process on its backend; a failed process gives a row with `error` saying why."""
    payload = json.dumps({**asdict(spec), "workload": asdict(spec.workload)})
    process, peak = _watched([sys.executable, "-m", "finetune.tools.bench", payload], spec.backend)
    for line in reversed(process.stdout.splitlines()):
        if line.startswith(ROW):
            return json.loads(line[len(ROW) :])
    return {"backend": spec.backend, "recipe": spec.recipe, "lever": spec.lever, "setup": spec.setup,
            "error": failure(process, peak)}  # fmt: skip


TIME_LIMIT = "FINETUNE_BENCH_ROW_SECONDS"  # a row's wall-clock limit, for a device lent by the minute (gpu_check.sh)
_STOPPED = "bench: the row ran past its time limit"


def _watched(command: list[str], backend: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run a worker to its end, sampling its resident memory: (the process, its highest resident bytes seen).
    A worker still running after FINETUNE_BENCH_ROW_SECONDS is stopped, and its row says so."""
    env = dict(os.environ, KERAS_BACKEND=backend)
    limit = float(os.environ.get(TIME_LIMIT) or 0)
    started, stopped = time.monotonic(), False
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
        peak, streams = 0.0, {}

        def drain(name, stream):
            streams[name] = stream.read()

        import threading

        readers = [
            threading.Thread(target=drain, args=(n, s)) for n, s in (("out", child.stdout), ("err", child.stderr))
        ]
        for reader in readers:
            reader.start()
        while child.poll() is None:
            peak = max(peak, _resident(child.pid))
            if limit and time.monotonic() - started > limit and not stopped:
                child.kill()
                stopped = True
            time.sleep(0.5)
        for reader in readers:
            reader.join()
    err = streams.get("err", "") + (f"\n{_STOPPED} ({limit:.0f} s, {TIME_LIMIT})\n" if stopped else "")
    done = subprocess.CompletedProcess(command, child.returncode, streams.get("out", ""), err)
    return done, peak


def _resident(pid: int) -> float:
    """Bytes of the process's peak resident memory so far (Linux), 0 where unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def failure(process: subprocess.CompletedProcess, peak: float) -> str:
    """Why a worker gave no row: the signal that ended it, or the last line of its error, never a log line."""
    import signal

    from finetune.platform.quiet import NOISE

    resident = f" at {peak / 1e9:.1f} GB resident" if peak else ""
    lines = [line.strip() for line in (process.stderr or "").splitlines() if line.strip()]
    fatal = [line for line in lines if re.match(r"F\d{4} ", line)]  # XLA's and TensorFlow's fatal check
    lines = [line for line in lines if not NOISE.match(line.encode())]
    if lines and lines[-1].startswith(_STOPPED):
        return lines[-1].removeprefix("bench: ")
    if process.returncode < 0:
        try:
            name = signal.Signals(-process.returncode).name
        except ValueError:
            name = f"signal {-process.returncode}"
        if name == "SIGKILL":
            return f"killed by SIGKILL{resident}: the system's out-of-memory killer, most likely"
        why = fatal[-1].split("] ", 1)[-1] if fatal else (lines[-1] if lines else "")
        return f"ended by {name}{resident}" + (f": {why}" if why else "")
    if lines:
        return f"{lines[-1]} (exit {process.returncode})"
    return f"exit {process.returncode} with no message{resident}"


def measure_peaks(backends: list[str]) -> dict[str, dict]:
    """dtype -> {"gflops", "backend", "by_backend", "device"}: the best square-matmul rate any of `backends`
    reaches on this device, and the device's name. FINETUNE_BENCH_PEAKS names a JSON file that keeps them: read
    when it holds every backend asked for, else measured and written there (tools/gpu_check.sh runs several
    benches on one device and measures once)."""
    cache = os.environ.get("FINETUNE_BENCH_PEAKS")
    if cache and Path(cache).is_file():
        kept = json.loads(Path(cache).read_text(encoding="utf-8"))
        if kept and all(set(backends) <= set(p["by_backend"]) for p in kept.values()):
            return kept
    peaks: dict[str, dict] = {}
    for backend in backends:
        process, _ = _watched([sys.executable, "-m", "finetune.tools.bench", "--peak"], backend)
        found = [line for line in process.stdout.splitlines() if line.startswith(ROW)]
        if not found:
            continue
        measured = json.loads(found[-1][len(ROW) :])
        name = measured.pop("device", "")
        for dtype, gflops in measured.items():
            peak = peaks.setdefault(dtype, {"gflops": 0.0, "backend": None, "by_backend": {}, "device": name})
            peak["by_backend"][backend] = gflops
            if gflops > peak["gflops"]:
                peak.update(gflops=gflops, backend=backend)
    if cache and peaks:
        Path(cache).write_text(json.dumps(peaks), encoding="utf-8")
    return peaks


# Dense (no sparsity) tensor-core peaks from NVIDIA's datasheets, TFLOP/s, by a part of the name the device
# reports. float32 is TF32's rate where the part has TF32 (Ampere on): backend.apply_tweaks lets float32
# matmuls run in TF32 on every backend, and the measured float32 peak shows it (335 TFLOP/s on an H200,
# against 67 for plain float32). The T4 (Turing) has no TF32: plain float32. The SXM parts; a PCIe H100
# and an H100 NVL have their own rows.
DATASHEET_TFLOPS = {
    "H100 PCIe": {"bfloat16": 756.0, "float16": 756.0, "float32": 378.0},
    "H100 NVL": {"bfloat16": 835.0, "float16": 835.0, "float32": 418.0},
    "H100": {"bfloat16": 989.0, "float16": 989.0, "float32": 495.0},
    "H200": {"bfloat16": 989.0, "float16": 989.0, "float32": 495.0},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "float32": 156.0},
    "L4": {"bfloat16": 121.0, "float16": 121.0, "float32": 60.0},
    "T4": {"float16": 65.0, "float32": 8.1},
}


def datasheet_gflops(device: str, dtype: str) -> float | None:
    """The datasheet's dense peak of the GPU named `device` in `dtype`, GFLOP/s; None for another device."""
    for part, peaks in DATASHEET_TFLOPS.items():  # the longer names first: "H100 PCIe" before "H100"
        if re.search(rf"\b{re.escape(part)}\b", device) and dtype in peaks:
            return peaks[dtype] * 1000
    return None


def peak_line(peaks: dict[str, dict]) -> str:
    if not peaks:
        return "matmul peak: not measured"
    device = next(iter(peaks.values())).get("device") or "this device"
    size = PEAK_SIZE["accelerator" if device.startswith(("gpu", "tpu")) else "cpu"]
    parts = []
    for dtype, p in sorted(peaks.items()):
        sheet = datasheet_gflops(device, dtype)
        parts.append(f"{dtype} {p['gflops']:.0f} GFLOP/s ({p['backend']})"
                     + (f", datasheet {sheet:.0f}" if sheet else ""))  # fmt: skip
    return (f"matmul peak on {device}, the MFU denominator (a warmed {size}² matmul, best of 5; MFU* against the "
            f"datasheet's dense peak where the device is known): " + ", ".join(parts))  # fmt: skip


# --- the worker: everything below runs in the row's own process -------------------------------


def _work(spec: Spec) -> dict:
    from finetune.model import builder
    from finetune.platform import backend

    backend.select(spec.backend)  # the tutorial too sets XLA's memory fraction to 1.00
    if spec.recipe == "hf":
        return _work_hf(spec)
    import keras

    if spec.recipe == "tutorial":  # no other tweak: float32, each framework's own thread count
        keras.config.set_dtype_policy("float32")
        tweaks = {"device": backend.accelerator(), "dtype_policy": "float32"}
    else:
        tweaks = backend.apply_runtime_tweaks("float32" if spec.lever == "precision" else "auto",
                                              lean_ops=spec.lever != "stock")  # fmt: skip
    backend.set_seed(0)
    quantize = _quantize(spec)
    source = _random_source(spec.workload)
    if spec.recipe == "tutorial":  # keras-hub's model as it comes: no hook of ours
        lm, preprocessor = builder.load_base(source, spec.workload.seq_len, "float32")
        result = _train_tutorial(spec, lm, preprocessor.tokenizer)
    else:
        remat = spec.lever == "remat" or _auto_remat(spec, tweaks, quantize)
        tweaks["remat"] = remat
        lora = LoraConfig(rank=spec.workload.rank, targets=["query", "value"])
        method = registry.get(spec.workload.method)
        objective = method.objective(TrainConfig())  # the method's default constants
        recipe = builder.Recipe(spec.workload.seq_len, tweaks["dtype_policy"], quantize, remat, lora, seed=0,
                                optimizer=builder.Optimizer(1e-4, 0.01, objective=objective))  # fmt: skip
        model = builder.build_model(source, recipe)  # as `finetune gemma` builds its model
        if spec.lever == "compile":  # as --compile does: PyTorch each decoder block, TensorFlow XLA
            tweaks["compiled"] = builder.compile_step(model)[1]
        lm = model.lm
        if method.paired:
            result = _train_pairs(spec, model, method, objective)
        elif method.prompted:
            result = _train_rollouts(spec, model, method)
        else:
            result = _train_finetune(spec, model)
    policy = keras.config.dtype_policy()
    result.update(
        backend=spec.backend,
        recipe=spec.recipe,
        lever=spec.lever,
        arch=spec.workload.arch,
        device=tweaks["device"],
        precision=tweaks["dtype_policy"],
        settings=_settings(spec, tweaks),
        peak_memory_mb=round(backend.peak_memory_mb(), 1),
        compute_dtype=policy.compute_dtype,
        vocab=lm.backbone.vocabulary_size,
    )
    return result


def _work_hf(spec: Spec) -> dict:
    """The peer's row (peer.py): the same examples, trained with transformers + PEFT, packed, base in the
    dtype --precision auto picks here."""
    import keras_hub

    from finetune.platform import backend
    from finetune.tools import peer

    w = spec.workload
    tokenizer = keras_hub.models.GemmaTokenizer(proto=w.tokenizer or str(presets.TINY_TOKENIZER))
    vocabulary = VOCAB.get(w.arch) or tokenizer.vocabulary_size()
    # The dtype finetune's --precision auto picks on this device: the peer's best here too (bf16 where it is fast,
    # float16 on a T4, float32 on a CPU without bf16 units, where torch's bf16 matmul is a slow reference loop);
    # float32 with the precision lever, as the finetune rows take it.
    dtype = (
        "float32" if spec.lever == "precision" else backend.auto_precision("gpu" if peer.device() == "cuda" else "cpu")
    )
    if registry.get(w.method).prompted:
        return _work_trl_grpo(spec, vocabulary, dtype)
    _, _, examples = _examples(w, tokenizer)
    setup = peer.Setup.named(spec.setup)
    model = peer.build(ARCHS[w.arch], vocabulary, w.rank, dtype, setup)
    steps = peer.batches(examples, w.seq_len, w.batch_size)
    if not steps:
        raise UserError(f"the data fills fewer rows than one batch of {w.batch_size}")
    done = peer.train(model, steps, w.warmup, w.steps, dtype)
    positions = sum(int(inputs["input_ids"].numel()) for inputs, _ in steps[w.warmup : w.warmup + w.steps])
    result = _measured(done["losses"], done["seconds"], done["tokens"], max(positions, done["tokens"]))
    result.update(
        step_seconds=[round(s, 4) for s in done["step_seconds"]],
        backend="torch",
        recipe="hf",
        lever=spec.lever,
        arch=w.arch,
        device="gpu" if peer.device() == "cuda" else "cpu",
        precision=dtype,
        setup=setup.name,
        settings=setup.settings(dtype),
        peak_memory_mb=round(backend.peak_memory_mb(), 1),
        compute_dtype=dtype,
        vocab=vocabulary,
    )
    return result


def _work_trl_grpo(spec: Spec, vocabulary: int, dtype: str) -> dict:
    """The GRPO peer's row (peer_grpo.py): TRL's GRPOTrainer + PEFT on the same architecture and prompts."""
    from finetune.platform import backend
    from finetune.tools import peer, peer_grpo

    w = spec.workload
    import keras_hub

    spm = w.tokenizer or str(presets.TINY_TOKENIZER)
    tokenizer = peer_grpo.hf_tokenizer(spm)
    prompts = [text for text, _ in bench_prompts(w, keras_hub.models.GemmaTokenizer(proto=spm))]
    steps = peer_grpo.Steps(w.rank, w.batch_size, w.num_generations, w.max_completion_length, w.warmup, w.steps)
    timed = peer_grpo.train(peer.base(ARCHS[w.arch], vocabulary, dtype), tokenizer, prompts, steps, dtype)
    training = timed["step"] - timed["generate"]
    result = _measured(timed["losses"], training, timed["trained"], max(timed["positions"], timed["trained"]))
    result.update(_rollout_rates(timed["sampled"], timed["generate"], timed["step"], w.steps))
    result.update(backend="torch", recipe="hf", lever=spec.lever, arch=w.arch, device=peer.device(), precision=dtype,
                  settings=f"TRL GRPOTrainer + PEFT, {dtype} base, transformers' generate",
                  peak_memory_mb=round(backend.peak_memory_mb(), 1), compute_dtype=dtype, vocab=vocabulary)  # fmt: skip
    return result


def bench_prompts(workload: Workload, tokenizer) -> list[tuple[str, object]]:
    """(prompt, record) of each record whose prompt leaves --max-completion-length in --seq-len, in file order:
    the Dolly template up to the response, as the DPO peer cuts it. Both sides get the same prompts whole (TRL's
    GRPOTrainer cuts none)."""
    from finetune.data import batching, formats, templates

    template = templates.get("dolly")
    records = formats.load_records(workload.data)
    texts = [template.apply(record)[0] for record in records]
    room = workload.seq_len - workload.max_completion_length
    fits = [1 + len(ids) <= room for ids in batching.leading_ids(tokenizer, texts, 10**9)]  # <bos> and the prompt
    return [(text, record) for text, record, fit in zip(texts, records, fits) if fit]


def _rollout_rates(sampled: int, generate_s: float, step_s: float, steps: int) -> dict:
    return {"generation_tokens_per_s": round(sampled / generate_s, 1) if generate_s else 0.0,
            "step_s": round(step_s / steps, 3), "generate_s": round(generate_s / steps, 3)}  # fmt: skip


def _train_rollouts(spec: Spec, model, method) -> dict:
    """The steps `finetune gemma --method grpo` takes (methods/grpo.py, rollouts.py): each samples
    --num-generations completions of --batch-size prompts in one call of keras-hub's generate (the sampler compiled
    in once), scores them with `length:L` at L = --max-completion-length (the share of the budget used, the TRL
    peer's reward), and trains one train_on_batch on the rows. The prompts are the records' in file order, as the
    peer takes them. Timed after the warm-up: the whole step (sampling, scoring, the rows' layout, the train step),
    and within it the sampler's calls; generation tokens/s is the completion tokens over the latter, training
    tokens/s the prompt and completion tokens over the rest."""
    import numpy as np

    from finetune.config import Config
    from finetune.data import batching, templates
    from finetune.methods import rollouts
    from finetune.model import builder
    from finetune.platform import backend

    w = spec.workload
    cfg = Config()
    cfg.model.seq_len, cfg.data.template, cfg.train.seed = w.seq_len, "dolly", 0
    cfg.train.method, cfg.train.batch_size = w.method, w.batch_size
    cfg.train.num_generations, cfg.train.max_completion_length = w.num_generations, w.max_completion_length
    cfg.train.reward = [f"length:{w.max_completion_length}"]
    template = templates.get("dolly")
    sampling = method.sampling(cfg, template, model.tokenizer)
    records = [(record, None) for _, record in bench_prompts(w, model.tokenizer)]
    prompts = rollouts.prompts_of(records, template, model.tokenizer, sampling, w.seq_len)
    if len(prompts) < w.batch_size:
        raise UserError(f"the data has {len(prompts)} prompts, fewer than one batch of {w.batch_size}")
    feed = batching.Feed(length_step=batching.length_step(spec.backend, w.seq_len, backend.accelerator()),
                         inputs=builder.input_names(model.lm))  # fmt: skip
    order = rollouts.RolloutOrder(prompts, w.batch_size, cfg, feed, model, method.constants(cfg.train))
    order._rows = lambda group: (group * w.batch_size + np.arange(w.batch_size)) % len(prompts)  # file order
    sampler, sampling_s, shapes = order.sampler, [0.0], set()
    call = sampler._call
    compiles = batching.compiles_per_length(spec.backend, backend.accelerator())
    new_shape = [False]

    def timed_call(ids, lengths, seed, media):
        shape = (len(ids), rollouts.prompt_width(lengths, ids.shape[1], spec.backend))
        new_shape[0] |= shape not in shapes
        shapes.add(shape)
        started = time.perf_counter()
        out = call(ids, lengths, seed, media)
        sampling_s[0] += time.perf_counter() - started
        return out

    sampler._call = timed_call
    losses, seconds, generate_s, sampled, tokens, positions, timed, step = [], 0.0, 0.0, 0, 0, 0, 0, 0
    # As a run: each prompt width (generate) and batch length (the train step) compiles once where the backend
    # compiles per shape; a step that compiled one is not timed, and the steps run until `steps` are.
    while timed < w.steps and step < w.warmup + w.steps + 16:
        before, new_shape[0] = sampling_s[0], False
        started = time.perf_counter()
        for x, y, sample_weight in order.micro_batches(step):
            new_shape[0] |= ("train", x["token_ids"].shape) not in shapes
            shapes.add(("train", x["token_ids"].shape))
            loss = model.trainer.train_on_batch(x, y, sample_weight=sample_weight, return_dict=True)["loss"]
        elapsed = time.perf_counter() - started
        losses.append(float(loss))
        if step >= w.warmup and not (compiles and new_shape[0]):
            seconds += elapsed
            generate_s += sampling_s[0] - before
            trained, completion = order.tokens(step)
            tokens, sampled = tokens + trained, sampled + completion
            positions += x["token_ids"].size
            timed += 1
        step += 1
    if not timed:
        raise UserError(f"no step was timed in {step} steps (each compiled a new shape); add --steps")
    result = _measured(losses, seconds - generate_s, tokens, positions)
    result.update(_rollout_rates(sampled, generate_s, seconds, timed))
    return result


def _settings(spec: Spec, tweaks: dict) -> str:
    if spec.recipe == "tutorial":
        return "one example per row, float32, fit()"
    parts = [LEVERS[spec.lever] if spec.lever in UNPACKED else "packed", f"{tweaks['dtype_policy']} base"]
    if registry.get(spec.workload.method).prompted:
        parts[0] = f"{spec.workload.method}, G {spec.workload.num_generations}, keras-hub generate"
    if registry.get(spec.workload.method).paired:  # pairs: packed whole, or a row per answer
        packed = "pairs packed" if spec.lever not in UNPACKED else "2 rows a pair"
        packed += ", batches of like length" if spec.lever == "grouped" else ""
        parts[0] = f"{spec.workload.method}, {packed}"
    quantize = _quantize(spec)
    if quantize:
        parts[-1] = f"{quantize} base ({tweaks['dtype_policy']} embedding)"
    if spec.lever == "compile":
        parts.append(tweaks.get("compiled", "compiled"))
    if spec.lever == "stock":
        parts.append("keras' own ops (no lean host work)")
    if spec.lever == "remat" or tweaks.get("remat"):
        parts.append("remat" if spec.lever == "remat" else "remat (auto)")
    threads = tweaks.get("torch.intra_op_threads")
    if threads:
        parts.append(f"{threads.split()[0]} threads")
    return ", ".join(parts)


def _auto_remat(spec: Spec, tweaks: dict, quantize: str | None) -> bool:
    """What `finetune gemma --remat auto` picks for the row's released architecture on this device (the plan
    says whether the step fits without it); off for the small archs, which have no preset to plan."""
    from finetune.config import Config
    from finetune.platform import backend
    from finetune.training import plan

    preset = PRESETS.get(spec.workload.arch)
    if preset is None:
        return False
    cfg = Config()
    cfg.backend = spec.backend
    cfg.model.preset, cfg.model.seq_len, cfg.model.quantize = preset, spec.workload.seq_len, quantize
    cfg.model.precision = tweaks["dtype_policy"]
    cfg.train.batch_size = spec.workload.batch_size
    memory = backend.device_memory(tweaks["device"])
    return plan.remat_for(cfg, tweaks["device"], memory)[0]


def _quantize(spec: Spec) -> str | None:
    """The row's quantized base: its lever's, or --quantize's for finetune rows (the tutorial's recipe has none)."""
    if spec.lever in ("int8", "int4"):
        return spec.lever
    return (spec.workload.quantize or None) if spec.recipe == "finetune" else None


def _random_source(workload: Workload):
    """The arch as a preset the builder makes with random weights (builder.load_base): the released models'
    vocabulary, or for the small archs the tokenizer's."""
    import keras_hub

    from finetune.model import presets

    tokenizer_file = workload.tokenizer or str(presets.TINY_TOKENIZER)
    vocab = VOCAB.get(workload.arch)
    if vocab is None:
        vocab = keras_hub.models.GemmaTokenizer(proto=tokenizer_file).vocabulary_size()
    config = dict(ARCHS[workload.arch], vocabulary_size=vocab, tokenizer=tokenizer_file)
    if FAMILY[workload.arch] != "gemma":
        config["image_size"] = None  # the text tower: Gemma 3's and 4's backbones take no vision encoder
    return presets.Source("random", workload.arch, FAMILY[workload.arch], random=config)


def _examples(workload: Workload, tokenizer):
    """(records, template, examples): the workload's data, tokenized as a run tokenizes it (methods/prepare.py)."""
    from finetune.data import formats, templates
    from finetune.methods import prepare

    template = templates.get("dolly")
    records = formats.load_records(workload.data)
    usable = prepare.examples(records, template, tokenizer, workload.seq_len, source=workload.data)
    return records, template, [e for _, e in usable]


def _compiles_per_length(spec: Spec) -> bool:
    """Whether each batch length of the row's train step compiles a program: XLA's (batching.compiles_per_length),
    or the compile lever's (jit_compile: torch.compile, XLA on TensorFlow), whose first step of a length is not
    timed."""
    from finetune.data import batching
    from finetune.platform import backend

    return spec.lever == "compile" or batching.compiles_per_length(spec.backend, backend.accelerator())


def _train_finetune(spec: Spec, model) -> dict:
    """The steps `finetune gemma` takes: segment-aware mask, numpy LoRA init, the response-token loss view,
    one train_on_batch per step."""
    from finetune.data import batching
    from finetune.methods import prepare
    from finetune.model import builder
    from finetune.platform import backend

    w = spec.workload
    trainer = model.trainer
    _, _, examples = _examples(w, model.tokenizer)
    rows = prepare.rows(examples, w.seq_len, packed=spec.lever not in UNPACKED)
    if len(rows["token_ids"]) < w.batch_size:
        raise UserError(f"the data fills {len(rows['token_ids'])} rows, fewer than one batch of {w.batch_size}")
    feed = batching.Feed(length_step=batching.length_step(spec.backend, w.seq_len, backend.accelerator(),
                                                          compiled=spec.lever == "compile"),
                         inputs=builder.input_names(model.lm), grouped=spec.lever == "grouped")  # fmt: skip
    order = batching.TrainOrder(rows, w.batch_size, seed=0, feed=feed)
    compiles = _compiles_per_length(spec)  # else every length is timed
    losses, seconds, tokens, positions, timed, shapes, step = [], 0.0, 0, 0, 0, set(), 0
    # Where each batch length compiles (JAX), a step of a new length is not timed (as loop.py): run until `steps`
    # are. Elsewhere every step after the warm-up is: a length left out would leave out the steps of its rows.
    while timed < w.steps and step < w.warmup + w.steps + 16:
        x, y, sample_weight = order.batch(step)
        started = time.perf_counter()
        loss = trainer.train_on_batch(x, y, sample_weight=sample_weight)  # returns numpy: the step has finished
        elapsed = time.perf_counter() - started
        losses.append(float(loss))
        shape = x["token_ids"].shape
        if step >= w.warmup and (shape in shapes or not compiles):
            seconds += elapsed
            tokens += order.tokens(step)[0]
            positions += x["token_ids"].size  # the positions computed: each batch is cut to its longest row
            timed += 1
        shapes.add(shape)
        step += 1
    return _measured(losses, seconds, tokens, positions)


def bench_pairs(workload: Workload, tokenizer, max_words: int = 64) -> list:
    """Pairs as peer_trl_dpo.py makes them from the records: the dolly prompt; chosen, the response's first
    `max_words` words; rejected, the same words shuffled (random.Random(0), in record order); responses of under
    3 words skipped."""
    import random

    from finetune.data import formats, pairs, templates

    rng = random.Random(0)
    made = []
    for record in formats.load_records(workload.data):
        words = record.response.split()[:max_words]
        if len(words) < 3:
            continue
        bad = words[:]
        while bad == words:
            rng.shuffle(bad)
        made.append(formats.Record(instruction=record.instruction, context=record.context,
                                   response=" ".join(words), rejected=" ".join(bad)))  # fmt: skip
    return pairs.pairs(made, templates.get("dolly"), tokenizer, workload.seq_len)[0]


def _train_pairs(spec: Spec, model, method, objective) -> dict:
    """The steps `finetune gemma --method M` takes: packed micro-batches of --batch-size rows, whole pairs each
    sequence a segment (data/pair_packing.py), or with the packing lever pairs as 2B rows; one train_on_batch a
    step. DPO's reference is scored before a step, untimed, for that step's pairs only, under the base: LoRA
    switched off, so that it is what a run scores once before training (a run scores every pair then; at gemma-2b
    dims on a CPU that pass alone takes many minutes). tokens: the non-padding
    tokens of both answers' sequences, as the peer counts them; the padding share is of the positions the timed
    steps computed. Where each batch length compiles a program (JAX), a step at a length not seen before is not
    timed; elsewhere every step after the warm-up is."""
    import numpy as np

    from finetune.data import batching, pair_batches, pair_packing
    from finetune.model import builder
    from finetune.platform import backend

    w = spec.workload
    arrays = pair_batches.pad(bench_pairs(w, model.tokenizer), w.seq_len)
    if len(arrays) < w.batch_size:
        raise UserError(f"the data makes {len(arrays)} pairs, fewer than one batch of {w.batch_size}")
    feed = batching.Feed(length_step=batching.length_step(spec.backend, w.seq_len, backend.accelerator(),
                                                          compiled=spec.lever == "compile"),
                         inputs=builder.input_names(model.lm), grouped=spec.lever == "grouped")  # fmt: skip
    if spec.lever in UNPACKED:
        order = pair_batches.PairOrder(arrays, w.batch_size, 0, feed)
    else:
        order = pair_packing.PackedPairOrder(pair_packing.pack(arrays, w.batch_size), 0, feed)
    compiles = _compiles_per_length(spec)  # else every length is timed
    scored = np.zeros(len(arrays), bool)
    if method.needs_reference:
        with builder.lora_off(model.lm):  # a view made inside, so a compiled call traces the base
            reference = builder.objective_view(model.lm, objective)
    losses, seconds, tokens, positions, timed, shapes, step, pairs_timed = [], 0.0, 0, 0, 0, set(), 0, 0
    while timed < w.steps and step < w.warmup + w.steps + 16:
        if method.needs_reference:  # untimed, and only for the pairs the bench trains: a run scores all, once
            pairs = order.rows(step)
            with builder.lora_off(model.lm):
                _score_reference(reference, arrays, pairs[~scored[pairs]], w.batch_size, feed)
            scored[pairs] = True
        ((x, y, sample_weight),) = order.micro_batches(step)
        started = time.perf_counter()
        loss = model.trainer.train_on_batch(x, y, sample_weight=sample_weight, return_dict=True)["loss"]
        elapsed = time.perf_counter() - started
        losses.append(float(loss))
        if step >= w.warmup and (x["token_ids"].shape in shapes or not compiles):
            seconds += elapsed
            tokens += order.tokens(step)[0]
            positions += x["token_ids"].size  # the positions computed: each batch is cut to its longest row
            pairs_timed += len(order.rows(step))
            timed += 1
        shapes.add(x["token_ids"].shape)
        step += 1
    result = _measured(losses, seconds, tokens, positions)
    result["pairs_per_s"] = round(pairs_timed / seconds, 2)
    return result


def _score_reference(view, arrays, pairs, batch_size: int, feed) -> None:
    """DPO's reference log-probabilities of `pairs` (indices into arrays), as the run's reference pass makes them."""
    from finetune.data import pair_batches
    from finetune.methods import preference

    if not len(pairs):
        return
    some = pair_batches.PairArrays({k: v[pairs] for k, v in arrays.chosen.items()},
                                   {k: v[pairs] for k, v in arrays.rejected.items()}, arrays.reference[pairs])  # fmt: skip
    preference.reference_logps(view, pair_batches.Batches(some, batch_size, feed))
    arrays.reference[pairs] = some.reference


def _train_tutorial(spec: Spec, lm, tokenizer) -> dict:
    """The Keras tutorial's recipe: keras-hub's preprocessor pads each example to seq-len; fit() trains."""
    import keras
    import keras_hub
    import numpy as np

    w = spec.workload
    lm.backbone.enable_lora(rank=w.rank)
    optimizer = keras.optimizers.AdamW(learning_rate=1e-4, weight_decay=0.01)
    optimizer.exclude_from_weight_decay(var_names=["bias", "scale"])
    lm.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=optimizer,
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    records, template, _ = _examples(w, tokenizer)
    texts = ["".join(template.apply(r)) for r in records]
    preprocessor = keras_hub.models.GemmaCausalLMPreprocessor(tokenizer=tokenizer, sequence_length=w.seq_len)
    x, y, sample_weight = preprocessor(texts)
    take = np.arange((w.warmup + w.steps) * w.batch_size) % len(texts)
    x = {k: np.asarray(v)[take] for k, v in x.items()}
    y, sample_weight = np.asarray(y)[take], np.asarray(sample_weight)[take]

    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.means, self.started, self.seconds = [], None, 0.0

        def on_train_batch_end(self, batch, logs=None):
            self.means.append(float(logs["loss"]))  # fit's running mean over the steps so far
            if batch == w.warmup - 1:
                self.started = time.perf_counter()

        def on_train_end(self, logs=None):
            self.seconds = time.perf_counter() - self.started

    timer = Timer()
    lm.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=w.batch_size,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[timer],
    )
    losses = [m * (i + 1) - (timer.means[i - 1] * i if i else 0.0) for i, m in enumerate(timer.means)]
    timed = sample_weight[w.warmup * w.batch_size :]
    return _measured(losses, timer.seconds, int(timed.sum()), timed.size)


def _measured(losses: list[float], seconds: float, tokens: int, positions: int) -> dict:
    if not seconds or not positions:  # every step compiled a new shape: nothing was timed
        raise UserError(f"no step was timed in {len(losses)} steps (each compiled a new batch shape); add --steps")
    return {
        "tokens_per_s": round(tokens / seconds, 1),
        "padding_fraction": round(1 - tokens / positions, 4),
        "loss": _finite(sum(losses) / len(losses)),
        "losses": [_finite(v) for v in losses],
        "timed_seconds": round(seconds, 3),
        "timed_tokens": tokens,
    }


def _finite(value: float) -> float | None:
    """Rounded, or None for a NaN or infinite loss: JSON has no NaN."""
    return round(value, 5) if math.isfinite(value) else None


PEAK_SIZE = {"cpu": 4096, "accelerator": 8192}


def matmul_peak(dtype: str, device: str, seconds: float = 2.0) -> float:
    """FLOP/s of a large square matmul on this backend in `dtype`: warmed up for `seconds`, then the best of 5.

    Large and warm, so the figure is the device's, not a cold cache's or a small matmul's: a 2048² matmul
    timed once gave the same TensorFlow row an MFU of 54% one day and 16% another. FINETUNE_BENCH_PEAK_SIZE
    sets another size: the tests' tiny rows use 1024², which on a CPU without 16-bit units took the JAX suite's
    bench test from 290 s to a fraction of it (its 16-bit matmuls are emulated).
    """
    import keras
    import numpy as np
    from keras import ops

    n = int(os.environ.get("FINETUNE_BENCH_PEAK_SIZE") or PEAK_SIZE["cpu" if device == "cpu" else "accelerator"])
    a = ops.convert_to_tensor(np.random.default_rng(0).standard_normal((n, n), np.float32), dtype=dtype)
    multiply = ops.matmul
    if keras.config.backend() == "jax":
        import jax

        multiply = jax.jit(ops.matmul)

    def once() -> float:
        started = time.perf_counter()
        product = multiply(a, a)
        ops.convert_to_numpy(ops.cast(product[0, 0], "float32"))  # wait for the device
        return time.perf_counter() - started

    warm_until = time.perf_counter() + seconds
    while time.perf_counter() < warm_until:
        once()
    return 2 * n**3 / min(once() for _ in range(5))


def _peak_main() -> int:
    """`python -m finetune.tools.bench --peak`: this backend's matmul peak in float32 and each 16-bit dtype the device
    has units for, as a ROW line."""
    from finetune.platform import backend

    backend.select(os.environ.get("KERAS_BACKEND", "jax"))
    device = backend.accelerator()
    # The device's peak, so every physical core: PyTorch's idle-core count, sampled over a quarter second, once
    # gave this process one thread of two and a float16 peak of 193 GFLOP/s against 331 measured the hour before.
    backend.apply_runtime_tweaks("float32", threads=backend.physical_cores() if device == "cpu" else None)
    # On a CPU, a 16-bit dtype only where it has units: without them it is a slow emulation, whose peak no row
    # uses (--precision auto trains float32 there) and which takes minutes to time at this size. On a GPU, bf16
    # where it is supported and float16, where a T4's rows run.
    if device == "cpu":
        flags = backend.cpu_flags()
        dtypes = ["float32"] + ["bfloat16"] * bool(flags & {"avx512_bf16", "amx_bf16"})
        dtypes += ["float16"] * ("avx512_fp16" in flags)
    else:
        dtypes = ["float32"] + ["bfloat16"] * backend.supports_bfloat16(device) + ["float16"] * (device == "gpu")
    peaks = {dtype: round(matmul_peak(dtype, device) / 1e9, 1) for dtype in dtypes}
    print(ROW + json.dumps({**peaks, "device": backend.device_name(device)}), flush=True)
    return 0


# --- the parent again: counting, the table, the verdict, the plot -----------------------------


def train_flops_per_token(arch: str, vocab: int, seq_len: int) -> float:
    """FLOPs to train one token with LoRA on a frozen base.

    The frozen weights need no weight gradients, so a matmul of N weights costs
    2N forward and 2N backward per token (not the usual 6N). The weights are
    the decoder's kernels as layouts.py lays them out, with a MoE block's
    experts counted at the share a token takes (experts per token over
    experts: the useful work, which the routed dispatch computes, and
    keras-hub's dense one E / k times over, builder.routed_experts), and the
    logits' projection (tied to the embedding); the
    embeddings' lookups are not matmuls. Attention's score and value products
    are counted over the whole row, as the dense kernel computes them, or
    over the window on a sliding-window layer, forward once and backward
    twice, at each layer's own head width (Gemma 4's global layers: 512).
    LoRA's own products (rank 4) are left out: under 1% of the rest.
    """
    from finetune.model import layouts

    family = FAMILY[arch]
    config = dict(ARCHS[arch], vocabulary_size=vocab)
    dims = layouts.Dims.from_backbone_config(config, family)
    weights = dims.hidden_dim * vocab
    for rule in layouts.rules_for(dims):
        shape = dims.shape(rule)
        if not shape or "embedding" in rule.group:
            continue
        count = math.prod(shape) * dims.copies(rule)
        if rule.group.startswith("experts"):
            count = count * int(config["num_experts_per_token"]) / int(config["num_experts"])
        weights += count
    attention = 0
    for index in range(dims.num_layers):
        context, width = seq_len, dims.num_query_heads * dims.head_dim
        if family == "gemma4":
            block = layouts.gemma4_block(config, index)
            width = dims.num_query_heads * block["head_dim"]
            sliding = not block["global"]
        elif family == "gemma3":
            sliding = config.get("use_sliding_window_attention", True) and index % 6 < 5
        else:
            sliding = config.get("use_sliding_window_attention", False) and index % 2 == 0
        if sliding:
            context = min(seq_len, int(config.get("sliding_window_size") or seq_len))
        attention += 2 * 2 * context * width
    return 4 * weights + 3 * attention


def add_mfu(rows: list[dict], workload: Workload, peaks: dict[str, dict]) -> None:
    """MFU of each row against the device's measured matmul peak in the row's compute dtype.

    A row above 100% means the FLOP count or the peak is wrong: it is flagged, never printed as a figure.
    """
    for row in rows:
        if "error" in row or row.get("compute_dtype") not in peaks or "step_s" in row:  # rollouts: not one workload
            continue
        peak = peaks[row["compute_dtype"]]
        flops = train_flops_per_token(workload.arch, row["vocab"], workload.seq_len)
        row["mfu"] = round(row["tokens_per_s"] * flops / (peak["gflops"] * 1e9), 4)
        row["device_peak_gflops"] = peak["gflops"]
        row["matmul_peak_gflops"] = peak["by_backend"].get(row["backend"], peak["gflops"])
        sheet = datasheet_gflops(peak.get("device") or "", row["compute_dtype"])
        if sheet:
            row["datasheet_gflops"] = sheet
            row["mfu_datasheet"] = round(row["tokens_per_s"] * flops / (sheet * 1e9), 4)


def _mfu(row: dict) -> str:
    if "mfu" not in row:
        return "?"
    if row["mfu"] > 1:
        return "over 100%: a bug"
    sheet = row.get("mfu_datasheet")
    return f"{row['mfu']:.1%}" + (f" ({sheet:.1%}*)" if sheet is not None else "")


def _loss(row: dict) -> str:
    return "not finite" if row["loss"] is None else f"{row['loss']:.4f}"


def _label(row: dict) -> str:
    """recipe, the hf peer's setup, the lever: `hf flex+liger, float32`."""
    setup = f" {row['setup']}" if row.get("setup") else ""
    return row["recipe"] + setup + (f", {LEVERS[row['lever']]}" if row.get("lever") else "")


def table(rows: list[dict]) -> str:
    header = ("backend", "recipe", "settings", "tokens/s", "padding", "MFU", "peak mem", "loss")
    lines = []
    for row in rows:
        if "error" in row:
            lines.append((row["backend"], _label(row), "failed (below)", "", "", "", "", ""))
            continue
        lines.append(
            (
                row["backend"],
                _label(row),
                row["settings"],
                f"{row['tokens_per_s']:.0f}",
                f"{row['padding_fraction']:.0%}",
                _mfu(row),
                f"{row['peak_memory_mb'] / 1024:.1f} GB",
                _loss(row),
            )
        )
    widths = [max(len(str(c)) for c in column) for column in zip(header, *lines)]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip()]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    out.append(
        "tokens/s: non-padding tokens of the timed steps (warm-up excluded). padding: the share of the positions "
        "those steps computed. loss: mean training loss of all steps;"
        " finetune's is per response token, the tutorial's is Keras' default (every token's loss summed, divided"
        " by every position, padding included)."
    )
    for row in rows:
        if "step_s" in row and "error" not in row:
            out.append(f"{row['backend']} {_label(row)}: {row['step_s']:.2f} s a step, {row['generate_s']:.2f} s of it "
                       f"sampling at {row['generation_tokens_per_s']:.0f} completion tokens/s")  # fmt: skip
    if any("step_s" in row for row in rows):
        out.append("--method grpo: tokens/s is the prompt and completion tokens trained over the step's time less "
                   "the sampling's; padding is the share of the trained positions.")  # fmt: skip
    out += [f"{row['backend']} {_label(row)} failed: {row['error']}" for row in rows if "error" in row]
    return "\n".join(out)


def verdict(rows: list[dict]) -> str:
    """One line: the fastest backend here, by how much, against the fastest hf peer setup, and why a backend more
    than 2x behind is slow."""
    best = {r["backend"]: r for r in rows if r["recipe"] == "finetune" and not r.get("lever") and "error" not in r}
    if not best:
        return "verdict: no finetune row finished, so no backend can be named fastest"
    if all("step_s" in r for r in best.values()):  # rollouts: the whole step, sampling included, is what a run waits
        return _rollout_verdict(rows, sorted(best.values(), key=lambda r: r["step_s"]))
    ranked = sorted(best.values(), key=lambda r: -r["tokens_per_s"])
    top = ranked[0]
    parts = [f"verdict: {top['backend']} is fastest here ({top['tokens_per_s']:.0f} tokens/s"]
    if len(ranked) > 1:
        parts[0] += ", " + ", ".join(
            f"{top['tokens_per_s'] / r['tokens_per_s']:.2f}x {r['backend']}" for r in ranked[1:]
        )
    parts[0] += ")"
    peers = [r for r in rows if r["recipe"] == "hf" and not r.get("lever") and "error" not in r]
    peer = max(peers, key=lambda r: r["tokens_per_s"], default=None)  # the strongest peer setup that ran
    if peer is not None and "step_s" not in peer:
        parts.append(
            f"{top['tokens_per_s'] / peer['tokens_per_s']:.2f}x the hf peer's tokens/s"
            + (f" (its fastest setup, {peer['setup']})" if peer.get("setup") else "")
            + ", in "
            f"{top['peak_memory_mb'] / peer['peak_memory_mb']:.2f}x its peak memory"
        )
    tutorial = {r["backend"]: r for r in rows if r["recipe"] == "tutorial" and "error" not in r}
    if top["backend"] in tutorial:
        parts.append(f"{top['tokens_per_s'] / tutorial[top['backend']]['tokens_per_s']:.2f}x the tutorial recipe on it")
    for slow in ranked[1:]:
        behind = top["tokens_per_s"] / slow["tokens_per_s"]
        if behind > 2:
            parts.append(f"{slow['backend']} is {behind:.1f}x behind: {_why_slow(slow, top)}")
    return "; ".join(parts)


def _rollout_verdict(rows: list[dict], ranked: list[dict]) -> str:
    """--method grpo: the backends ranked by their whole step's time, sampling included, and TRL's beside them."""
    top = ranked[0]
    parts = [f"verdict: {top['backend']} is fastest here ({top['step_s']:.2f} s a step"
             + "".join(f", {r['step_s'] / top['step_s']:.2f}x that on {r['backend']}" for r in ranked[1:]) + ")"]  # fmt: skip
    peer = next((r for r in rows if r["recipe"] == "hf" and not r.get("lever") and "error" not in r), None)
    if peer is not None:
        parts.append(f"{top['backend']}'s step takes {top['step_s'] / peer['step_s']:.2f}x TRL's time "
                     f"({top['step_s']:.2f} s against {peer['step_s']:.2f} s), in "
                     f"{top['peak_memory_mb'] / peer['peak_memory_mb']:.2f}x its peak memory")  # fmt: skip
    for slow in ranked[1:]:
        if slow["step_s"] > 2 * top["step_s"]:
            parts.append(f"{slow['backend']} is {slow['step_s'] / top['step_s']:.1f}x behind: {slow['generate_s']:.2f} "
                         f"s of its {slow['step_s']:.2f} s step is sampling")  # fmt: skip
    return "; ".join(parts)


def _why_slow(slow: dict, top: dict) -> str:
    own, theirs = slow.get("matmul_peak_gflops"), top.get("matmul_peak_gflops")
    if own is None or theirs is None:
        return "its matmul peak was not measured"
    if own < 0.6 * theirs:
        return (
            f"its {slow['compute_dtype']} matmuls peak at {own:.0f} GFLOP/s on this device against "
            f"{theirs:.0f} on {top['backend']}"
        )
    return (
        f"not its matmuls ({own:.0f} GFLOP/s peak here, against {theirs:.0f} on {top['backend']}): it reaches "
        f"{slow['mfu']:.0%} MFU against {top['mfu']:.0%}, so its time goes to the work around them "
        "(op dispatch, masking, optimizer)"
    )


def plot(rows: list[dict], path: str, workload: Workload) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if "error" not in r]
    fig, (speed, curve) = plt.subplots(1, 2, figsize=(13, 0.4 * len(done) + 2.5), dpi=100)
    labels = [f"{r['backend']} {_label(r)}" for r in done]
    colours = ["tab:blue" if r["recipe"] == "finetune" and not r.get("lever") else "tab:gray" for r in done]
    speed.barh(range(len(done)), [r["tokens_per_s"] for r in done], color=colours)
    speed.set_yticks(range(len(done)), labels, fontsize=8)
    speed.invert_yaxis()
    speed.set_xlabel("trained tokens/s (non-padding)")
    speed.set_title(f"{workload.arch}, seq {workload.seq_len}, batch {workload.batch_size}")
    # The tutorial's loss is Keras' default (divided by every position, padding included): another scale.
    for r in (r for r in done if r["recipe"] == "finetune"):
        curve.plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"{r['backend']} {_label(r)}", linewidth=1)
    curve.set_xlabel("step")
    curve.set_ylabel("training loss per response token")
    curve.set_title("finetune rows: loss per step")
    curve.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png")  # at the path given: matplotlib would add .png to a name without a suffix
    plt.close(fig)


def _worker_main(payload: str) -> int:
    from finetune.platform import backend

    backend.LEAVE_OUT_OTHER_FRAMEWORKS = True  # as `finetune gemma` trains: only the backend's framework
    if payload == "--peak":
        return _peak_main()
    spec_dict = json.loads(payload)
    spec = Spec(**{**spec_dict, "workload": Workload(**spec_dict["workload"])})
    # The tutorial's recipe keeps it: keras-hub's preprocessor, fed whole batches of text there, needs TensorFlow.
    backend.LEAVE_OUT_OTHER_FRAMEWORKS = spec.recipe != "tutorial"
    try:
        row = _work(spec)
    except Exception as error:  # noqa: BLE001 - the parent shows it as the row's failure
        if not isinstance(error, UserError):
            import traceback

            traceback.print_exc()
        message = str(error).splitlines()[0] if str(error) else ""
        row = {
            "backend": spec.backend,
            "recipe": spec.recipe,
            "lever": spec.lever,
            "setup": spec.setup,
            "error": f"{type(error).__name__}: {message}",
        }
    print(ROW + json.dumps(row), flush=True)
    return 0 if "error" not in row else 1


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1]))
