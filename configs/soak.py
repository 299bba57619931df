r"""Soak with faults (issue 10): random requests, aborts and bad requests through the engine.

  python -m experiments.soak --config=configs/soak.py:smoke     # ~20 s: 12 requests, 2 runs
  python -m experiments.soak --config=configs/soak.py           # full: 1,000 requests
("runlocal" is an alias of "smoke".) Overrides: --config.requests=300 --config.runs=plain,ngram
--config.seed=1 --config.num_pages=25

A tiny random model (tiny-9-3 over a 98-id character tokenizer, weights spread so its next-token
distribution is peaked) serves ``requests`` random requests split evenly over ``runs``: "plain",
"ngram" and "draft" (draft == target) speculation with ``num_speculative_tokens`` drafts, always
verified. Requests arrive ~Poisson(``arrivals_per_step``) per engine step with random prompts
(text or ids, shared prefixes, repeated motifs, a few of max_model_len - 1 tokens) and random
sampling parameters (greedy/sampled, n 1-3, seeds, top-k/p, min-p, penalties, min/max tokens,
stop strings and ids, logprobs, ...). Faults: ``num_pages`` far too small for all at once
(preemption), ``abort_fraction`` aborted at a random later step (some twice, some after they
finished), and bad requests at ``bad_request_rate`` per step that must be rejected with no
state change. Every check of llmserve/testing/soak.py runs afterwards; the program exits
non-zero if any fails. Writes results/soak/<timestamp>/results.json (figures per run, every
failure) and a plot of running / waiting requests and free pages per step.
Measured (full, seed 0, 2 shared CPU cores at load 5-7, 2026-11-30, 248 s with warm-up and
lone runs): PASS, 0 failed checks. 1,000 requests (1,288 completions; 334/334/332 plain/ngram/
draft), 103 aborted (131 completions report abort), 49 bad requests rejected, 348 preemptions,
12,685 tokens, 205 stopped (184 by a stop string), 952 by length; 784 completions equal their
lone runs (every plain one, the greedy ones under speculation); acceptance 0.54 (n-gram) and
0.82 (draft == target: the draft ignores penalties and min_tokens bans, so q != p there).
"""

import ml_collections


def get_config(arg: str = "full") -> ml_collections.ConfigDict:
    """``arg``: "full" (default: 1,000 requests) or "smoke" (alias "runlocal": 12 requests,
    plain and n-gram only; tests/test_soak.py runs the draft model too)."""
    arg = {"runlocal": "smoke"}.get(arg, arg)
    if arg not in ("full", "smoke"):
        raise ValueError(f"soak config arg {arg!r}: use full or smoke")
    c = ml_collections.ConfigDict()
    c.name = arg
    c.out_root = ""  # "" = results/ (or $LLMSERVE_RESULTS)
    c.requests = 12 if arg == "smoke" else 1000
    c.runs = "plain,ngram" if arg == "smoke" else "plain,ngram,draft"
    c.seed = 0
    # The engine: 32 usable pages of 4 tokens hold two max-length sequences of the 8 slots.
    c.max_model_len = 64
    c.max_num_seqs = 8
    c.page_size = 4
    c.num_pages = 33
    c.max_num_batched_tokens = 32
    c.prefill_buckets = ((4, 16),)
    c.decode_buckets = (8,)
    c.max_logprobs = 3
    c.num_speculative_tokens = 3
    # The workload.
    c.max_prompt = 40
    c.max_new = 24
    c.arrivals_per_step = 1.5
    c.abort_fraction = 0.1
    c.bad_request_rate = 0.02
    return c
