r"""Offline serving throughput on SmolLM2-135M (fp32, CPU): llmserve vs Hugging Face (issue 4).

Commands (from the repository root):

  python -m experiments.throughput --config=configs/throughput.py:runlocal   # smoke test, ~1 min
  python -m experiments.throughput --config=configs/throughput.py            # 32 prompts
  python -m experiments.throughput --config=configs/throughput.py:256        # 256 prompts

Overrides, e.g.:
  --config.systems=llmserve_continuous,hf_batch   skip the other systems
  --config.hf_single_subset=0                     HF one-by-one on every prompt (no extrapolation)
  --config.profile=True                           decode / prefill / host time breakdown
  --config.trace_dir=/tmp/trace                   also a jax.profiler trace of llmserve continuous
  --config.prepare_only=True                      only write the workload JSON and an fp32 HF
                                                  directory for scripts/bench_vllm_cpu.sh

Workload: N prompts cut from real English text (Python standard-library docstrings, tokenized
with the model's tokenizer) at distinct random offsets, 16-128 tokens each, and 16-256 new tokens
each (uniform; numpy seed ``seed``), greedy, EOS ignored. N = the argument (default 32).

Systems: llmserve continuous and static batching (max_num_seqs slots), HF transformers
``generate`` one request at a time (on the first ``hf_single_subset`` prompts, extrapolated) and
in left-padded batches of ``hf_batch_size``. Writes results/throughput/throughput_<arg>.json and
a bar chart; prints a markdown table.

llmserve's static policy admits a batch only when every slot is free, prefills all of it, then
decodes until the whole batch is done (with N <= max_num_seqs it admits everything at once).

Measured (32 prompts, 2 CPU cores, quiet machine, load average ~1, 2026-11-30, with
--config.hf_single_subset=4 --config.profile=True): llmserve continuous 89.7 tok/s (1.13x HF
batch-32), static 97.1, HF 1-by-1 19.1 (4 prompts, extrapolated), HF batch-32 79.4; KV waste
3.9% (llmserve) vs 66.5% (HF padded batch). Profile: decode 41.3 s over 260 steps (159 ms per
step), prefill 6.2 s, host 0.3 s.
256 prompts (--config.systems=llmserve_continuous,llmserve_static,hf_batch): continuous 83.9
tok/s (1.05x HF batch-32, slot util 95.7%), static 93.7 (1.18x), HF batch-32 79.7; greedy
outputs identical for all 256.
"""

import ml_collections

ALL_SYSTEMS = "llmserve_continuous,llmserve_static,hf_single,hf_batch"


def get_config(arg: str = "32") -> ml_collections.ConfigDict:
    """Returns the benchmark config; ``arg`` is a prompt count or ``runlocal``."""
    runlocal = arg == "runlocal"
    c = ml_collections.ConfigDict()
    c.name = arg
    c.systems = ALL_SYSTEMS
    c.out_dir = "results/throughput"
    c.prepare_only = False

    c.workload = ml_collections.ConfigDict()
    c.workload.num_prompts = 4 if runlocal else int(arg)
    c.workload.prompt_len = (16, 32) if runlocal else (16, 128)  # inclusive range
    c.workload.new_tokens = (4, 16) if runlocal else (16, 256)  # inclusive range
    c.workload.seed = 0

    c.llmserve = ml_collections.ConfigDict()
    c.llmserve.max_num_seqs = 4 if runlocal else 32
    c.llmserve.max_model_len = 64 if runlocal else 384  # >= longest prompt + new tokens
    c.llmserve.page_size = 16
    c.llmserve.max_num_batched_tokens = 512
    c.llmserve.enable_prefix_caching = True  # prompts start at distinct offsets: no sharing
    c.llmserve.backend = ""  # "" = the default for the platform

    c.hf_batch_size = 32
    c.hf_single_subset = 2 if runlocal else 8  # 0 = every prompt
    c.torch_threads = 2

    c.warmup_prompts = 2  # a short untimed generate per system, after compilation
    c.warmup_tokens = 4

    c.profile = False
    c.trace_dir = ""
    return c
