r"""Online serving benchmark: Poisson arrivals against the OpenAI-compatible server.

Commands (from the repository root):

  python -m experiments.serving --config=configs/serving.py:smoke   # tiny random model, <1 min
  python -m experiments.serving --config=configs/serving.py         # SmolLM2-135M, 3 rates
  llmserve bench serving --config=configs/serving.py                # the same

Overrides, e.g.:
  --config.request_rates=0.5,1,2,inf   requests/s per run; inf sends everything at once
  --config.num_prompts=64              requests per rate
  --config.url=http://127.0.0.1:8000   benchmark a running server instead of starting one

Workload: half the requests are chat questions (the built-in ones of ``llmserve generate``,
/v1/chat/completions), half are completions of text cut from Python standard-library
docstrings (/v1/completions), ``prompt_len`` tokens; each asks for ``new_tokens`` tokens
(uniform, EOS ignored), greedy, streamed. Numpy seed ``seed``. Reports TTFT, TPOT (time per
output token after the first), ITL (gaps between streamed chunks) and end-to-end latency
(p50/p90/p99), and request / output-token throughput, like vLLM's ``bench serve``. Writes
results/serving/<time>/results.json and latency.png; prints a markdown table.

Measured (default config, SmolLM2-135M fp32, 2 CPU cores shared with other jobs: load average
~6, 2026-11-30; whole run ~4 min): at 0.5 / 1 / 2 req/s offered, 0.41 / 0.70 / 0.94 req/s and
31 / 54 / 72 output tok/s served; TTFT p50 224 / 351 / 1108 ms, TPOT p50 66 / 86 / 178 ms,
ITL p50 56 / 76 / 96 ms (p99 225 / 318 / 1395 ms); no failures.
"""

import ml_collections


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    """Returns the benchmark config; ``arg`` is ``default`` or ``smoke`` (alias ``runlocal``)."""
    arg = {"runlocal": "smoke"}.get(arg, arg)
    if arg not in ("default", "smoke"):
        raise ValueError(f"serving config arg {arg!r}: use default or smoke")
    smoke = arg == "smoke"
    c = ml_collections.ConfigDict()
    c.name = arg
    c.url = ""  # "" = start the server in this process
    # "" = SmolLM2-135M-Instruct; "tiny-random" = a random 2-layer model with SmolLM2's tokenizer
    c.model = "tiny-random" if smoke else ""
    c.request_rates = "8,inf" if smoke else "0.5,1,2"
    c.num_prompts = 12 if smoke else 32
    c.prompt_len = (16, 64) if smoke else (16, 128)  # inclusive range (completions prompts)
    c.new_tokens = (4, 16) if smoke else (16, 128)  # inclusive range
    c.chat_fraction = 0.5
    c.seed = 0

    c.server = ml_collections.ConfigDict()
    c.server.max_num_seqs = 8 if smoke else 32
    c.server.max_model_len = 256 if smoke else 512
    c.server.max_num_batched_tokens = 256 if smoke else 512
    c.server.page_size = 16
    c.server.backend = ""  # "" = the default for the platform
    # "" = the engine's default prefill buckets; smoke: two ("rows x tokens"), so warm-up compiles
    # 6 step shapes instead of 18 (CI time).
    c.server.prefill_buckets = "4x8,32x8" if smoke else ""
    c.warmup_requests = 2  # untimed, after compilation
    return c
