#!/usr/bin/env bash
# The GPU device check: `finetune bench` rows on one GPU for JAX and PyTorch, beside the strongest Hugging Face
# peer installed, at gemma-2b dims first and then the families users pick, written as one JSON table.
#
#   tools/gpu_check.sh [--dry-run] [--out DIR] [--budget SECONDS]
#
# For a bare machine with PyTorch and JAX and no network: where keras-hub is missing, wheels in .whl/ (keras, keras-hub and what they need
# that the machine lacks; liger-kernel for the peer's fused cross-entropy) are installed into /tmp/site first.
# No TensorFlow: keras-hub tokenizes with sentencepiece alone, and the bench's random models need no more.
# DATA and TOKENIZER name the bench's records and .spm (default: the package's sample and the tiny tokenizer;
# the logits are the released vocabulary's either way).
#
# On a device lent by the minute: in .whl/, keras==3.15.1 keras-hub==0.32.0 namex optree kagglehub kagglesdk and
# liger-kernel for its Python (pip download --no-deps --only-binary=:all: --python-version 3.12 ...); in .gpu/,
# the bench's data and tokenizer; carry both, and run
#   DATA=.gpu/dolly-real-151.jsonl TOKENIZER=.gpu/bench.spm bash tools/gpu_check.sh --budget 470
# with a time limit of about 590 s. Checked without TensorFlow on a CPU (a virtual environment without it).
# The first run (an H200, 2026-11-27) finished in 503 s and held the device 537 s of its 900. A lent machine goes
# back 30 s after a call: a second call for the benches not reached must be written before the first returns
# and sent at once, or it starts a bare machine (the wheels installed again, a minute of start).
#
# Benches run in priority order and none starts after --budget seconds (default 450), so a device lent by the
# minute returns what finished; each row also stops at FINETUNE_BENCH_ROW_SECONDS (default 150). The rows of
# every bench are merged into DIR/gpu_check.json (default $OUT, else ./gpu-check) after each one, beside
# DIR/gpu_check.log; the bench running keeps its finished rows in DIR/gpu_check.current.json. --dry-run runs the
# first bench on this machine at the tiny arch, one step each, to check the script end to end without a GPU,
# and the long-context plan.
set -uo pipefail
cd "$(dirname "$0")/.."

dry=0
out="${OUT:-gpu-check}"
budget=450
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --out) out="$2"; shift ;;
    --budget) budget="$2"; shift ;;
    *) echo "usage: tools/gpu_check.sh [--dry-run] [--out DIR] [--budget SECONDS]" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out"
log="$out/gpu_check.log"
: >"$log"
started=$(date +%s)

if ! KERAS_BACKEND=jax python3 -c "import keras_hub" >/dev/null 2>&1 && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_check: the wheels in .whl/ did not install" | tee -a "$log"; exit 1; }
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
export FINETUNE_BENCH_ROW_SECONDS="${FINETUNE_BENCH_ROW_SECONDS:-150}"
rows_dir=$(mktemp -d)
export FINETUNE_BENCH_PEAKS="$rows_dir/peaks.json"  # the matmul peaks, measured once for every bench

{
  echo "gpu_check: $(date -u +%FT%TZ), budget ${budget} s, dry run ${dry}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  python3 -c "import torch, jax; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), '| jax',
jax.__version__, jax.devices()[0].device_kind)" 2>&1 | tail -1
} | tee -a "$log"

data="${DATA:-sample}"
tokenizer=()
[ -n "${TOKENIZER:-}" ] && tokenizer=(--tokenizer "$TOKENIZER")

# name | arguments (after the common ones) | the row time limit, where not the default. Priority order, from the
# first run on an H200 (2026-11-27, BENCHMARKS.md): gemma-2b's finetune rows have two rounds there, and gemma3-1b's
# and gemma2-2b's one; the peer's rows and the rest are still to measure. The compile lever on PyTorch compiles
# each decoder block (lean_torch.compile_blocks): the one lever measured on a CPU to take the host's work per op
# away (keras' whole-step compile ran past 150 s there), so it comes second, with a longer limit for its
# compilation. host-2b and host-e4b are gemma-2b's and Gemma 4 e4b's blocks at width 64: the host's work per step
# on this machine, PyTorch's lean path beside keras' own (the stock lever) and compiled blocks, in seconds.
benches=(
  "gemma-2b|--arch gemma-2b --backends jax,torch --recipes finetune,hf --levers stock"
  "gemma-2b-compile|--arch gemma-2b --backends torch --recipes finetune --levers compile|300"
  "host-2b|--arch host-2b --backends jax,torch --recipes finetune --levers stock,compile --seq-len 32 --batch-size 1 --steps 20|300"
  "host-e4b|--arch host-e4b --backends torch --recipes finetune --levers stock --seq-len 32 --batch-size 1 --steps 20"
  "gemma4-e4b|--arch gemma4-e4b --backends jax,torch --recipes finetune"
  "gemma-2b-8k|--arch gemma-2b --backends jax,torch --recipes finetune --seq-len 8192 --batch-size 1"
  "gemma-2b-hf-round2|--arch gemma-2b --backends torch --recipes hf"
  "gemma3-4b|--arch gemma3-4b --backends jax,torch --recipes finetune"
  "gemma4-26b-a4b|--arch gemma4-26b-a4b --backends jax --recipes finetune --batch-size 2"
)

if [ "$dry" = 1 ]; then  # the first bench (every recipe) and the plan
  benches=("${benches[0]}")
fi

merge() {
  python3 - "$rows_dir" "$out/gpu_check.json" <<'EOF'
import json, sys
from pathlib import Path
rows = []
for path in sorted(Path(sys.argv[1]).glob("bench-*.json"), key=lambda p: p.stat().st_mtime):
    for row in json.loads(path.read_text()):
        rows.append({"bench": path.stem.removeprefix("bench-"), **row})
peaks = Path(sys.argv[1], "peaks.json")
table = {"peaks": json.loads(peaks.read_text()) if peaks.is_file() else {}, "rows": rows}
Path(sys.argv[2]).write_text(json.dumps(table, indent=1) + "\n")
EOF
}

for entry in "${benches[@]}"; do
  name="${entry%%|*}"
  rest="${entry#*|}"
  limit="${FINETUNE_BENCH_ROW_SECONDS}"
  [ "${rest}" != "${rest%|*}" ] && limit="${rest##*|}" && rest="${rest%|*}"
  read -r -a arguments <<<"${rest}"
  elapsed=$(( $(date +%s) - started ))
  if [ "$elapsed" -ge "$budget" ]; then
    echo "gpu_check: ${name} not started: ${elapsed} s of the ${budget} s budget spent" | tee -a "$log"
    continue
  fi
  common=(--data "$data" "${tokenizer[@]}" --seq-len 1024 --batch-size 4 --steps 6 --warmup 2)
  if [ "$dry" = 1 ]; then  # this machine, the tiny arch, one step: the commands and the merge, not the numbers
    arguments=("${arguments[@]/gemma*/tiny}")
    common=(--data "$data" "${tokenizer[@]}" --seq-len 64 --batch-size 4 --steps 1 --warmup 1)
    for i in "${!arguments[@]}"; do  # no long context here, and the hf peer only where it is installed
      case "${arguments[$i]}" in 8192) arguments[$i]=128 ;; esac
    done
  fi
  echo "gpu_check: ${name} at ${elapsed} s: finetune bench ${arguments[*]}" | tee -a "$log"
  # the bench writes its rows after each one: into $out while it runs, so a device's time limit keeps them
  FINETUNE_BENCH_ROW_SECONDS="$limit" python3 -m finetune bench "${common[@]}" "${arguments[@]}" \
    --json "$out/gpu_check.current.json" 2>&1 \
    | grep -v -E '^(W|I|V)[0-9]{4} |^WARNING: All log messages|absl::InitializeLog' | tee -a "$log"
  [ -f "$out/gpu_check.current.json" ] && mv "$out/gpu_check.current.json" "$rows_dir/bench-${name}.json"
  merge
done

# Gemma 4's expert bank both ways on this device (tools/experts_check.py): whether the routed dispatch beats
# keras-hub's dense one here, which backend.routed_experts_rule allows on a TPU only. Seconds, not minutes.
if [ $(( $(date +%s) - started )) -lt "$budget" ]; then
  small=(); [ "$dry" = 1 ] && small=(--small)
  KERAS_BACKEND=jax python3 tools/experts_check.py --tokens 1024 "${small[@]}" 2>&1 \
    | grep -v -E '^(W|I|V)[0-9]{4} |^WARNING: All log messages|absl::InitializeLog' | tee -a "$log"
fi

for backend in jax torch; do  # the plan beside the long-context rows' measured peaks
  python3 -m finetune plan --preset gemma_2b_en --backend "$backend" --seq-len 8192 --batch-size 1 --rank 4 \
    --device-memory 80GB 2>&1 | grep -v -E '^(W|I|V)[0-9]{4} ' | tail -n 25 | tee -a "$log"
done
merge
echo "gpu_check: done in $(( $(date +%s) - started )) s; rows in $out/gpu_check.json" | tee -a "$log"
