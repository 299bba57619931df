r"""Speculative decoding benchmark on SmolLM2-135M-Instruct fp32 (issue 5).

  python -m experiments.speculative --config=configs/speculative.py:smoke      # ~40 s, tiny model
  python -m experiments.speculative --config=configs/speculative.py:small      # ~2.5 min, SmolLM2
  python -m experiments.speculative --config=configs/speculative.py            # full, ~25 min
("runlocal" is an alias of "smoke"; "smoke" runs a random-weight tiny target, checking the
pipeline only: its acceptance numbers mean nothing.)
Overrides: --config.max_tokens=32 --config.batches=1,4 --config.methods=ngram
           --config.draft_model=checkpoints/distill_draft/smoke/draft_hf

Workload: half chat prompts (held-out questions of llmserve.training.prompts, rendered with the
model's chat template), half code-completion prompts (signature + docstring + the first body
lines of held-out Python stdlib functions), at most ``max_prompt_tokens`` each; greedy, EOS
ignored, ``max_tokens`` new tokens per request. A "batch" is that many concurrent requests
(max_num_seqs = decode bucket = batch); batches smaller than ``min_requests`` run again with the
next prompts (batch 1 runs one chat and one code request, one after the other).

Each row serves its rounds ``repeats`` times on the same engine (3; the smoke run once) and
reports the median decode tokens/s with its [min-max].
Rows: the no-speculation baseline per batch, then the n-gram and the draft-model proposers with
adaptive=True (the engine's never-slower policy, which may stop speculating) and adaptive=False
(always verify K drafts). The sweep is trimmed to fit 15 minutes of 2 shared CPU cores: every K
of ``ks`` at the batches of ``all_k_batches``, only ``main_k`` at the others.

Decode tokens/s counts only the steps after the last prefill of a round (prefill and
compilation are outside the timed window). Writes results/speculative/<timestamp>/results.json and
a plot (speedup vs batch; acceptance per draft position), and prints a markdown table.
Measured (full, 2 shared CPU cores, load 2.6-5.5, 2026-11-30, 832 s): acceptance is low on
this workload (n-gram 6-15%, the CPU-distilled 2-layer draft 3-8%; draft 1 accepted in ~25% /
~13% of verify rows, later positions less), so always speculating is slower everywhere
(0.54-0.80x at batch 1, 0.31-0.45x at batch 16-32); the adaptive policy mostly decodes plainly
(0-18% verify steps at batch 1, 2-6% at 16-32) and lands within the no-speculation rows' noise
(0.70-1.23x vs before/after baselines 17.7/18.9, 32.4/38.8, 101.8/143.3, 99.8/169.7 tok/s at
batch 1/4/16/32). Greedy output equals the no-speculation output in every row.
"""

import ml_collections


def get_config(arg: str = "full") -> ml_collections.ConfigDict:
    """``arg``: "full" (default), "small" (SmolLM2, batch 1 and 4, K=2, 8 tokens) or "smoke"
    (alias "runlocal": the same sweep on a random-weight tiny target)."""
    arg = {"runlocal": "smoke"}.get(arg, arg)
    if arg not in ("full", "small", "smoke"):
        raise ValueError(f"speculative config arg {arg!r}: use full, small or smoke")
    runlocal = arg != "full"
    c = ml_collections.ConfigDict()
    c.name = arg
    c.target_model = "tiny-9-3" if arg == "smoke" else ""  # "" = SmolLM2-135M-Instruct
    c.out_root = ""  # "" = results/ (or $LLMSERVE_RESULTS)
    c.batches = "1,4" if runlocal else "1,4,16,32"
    if arg == "smoke":
        c.batches = "2"
    c.methods = "ngram,draft"
    c.ks = "2" if runlocal else "2,4,6"
    c.main_k = 2 if runlocal else 4  # the K run at every batch
    c.all_k_batches = "1"  # batches that run every K of ks
    # Both: the raw speculative speed, then the never-slower policy's effect.
    c.adaptive = "false,true"
    c.max_tokens = 8 if runlocal else 64
    c.repeat_baseline = not runlocal  # no-speculation row again after each batch's sweep
    c.min_requests = 2  # per row: small batches run again until this many requests ran
    c.repeats = 1 if arg == "smoke" else 3  # each row's rounds, again on the same engine

    c.max_prompt_tokens = 64
    c.max_model_len = 160  # >= max_prompt_tokens + max_tokens + the largest K
    c.prefill_buckets = ((1, 64), (8, 64))  # (rows, chunk): chunk >= max_prompt_tokens
    c.max_num_batched_tokens = 512
    c.page_size = 16
    c.backend = ""  # "" = the platform's default

    # The distilled draft (scripts/distill_draft.py --config=configs/distill_draft.py:cpu);
    # if the directory is missing, an untrained 2-layer draft sharing the target's embedding.
    c.draft_model = "checkpoints/distill_draft/cpu/draft_hf"
    c.untrained_draft_layers = 2
    c.ngram_max = 3
    c.ngram_min = 1
    return c
