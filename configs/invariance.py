r"""Bitwise batch invariance (``batch_invariant=True``): the invariance matrix and its cost.

  python -m experiments.invariance --config=configs/invariance.py          # SmolLM2, ~15 min
  python -m experiments.invariance --config=configs/invariance.py:smoke    # tiny preset, ~1 min
  python -m experiments.invariance --config=configs/invariance.py --config.dtype=bfloat16

Targets (greedy and seeded-sampled, with logprobs) run alone, then beside 7 / 31 / 63 random
co-tenants in random arrival order, after a prefix-cache hit, under another chunk split, after
preemption and recompute, and (greedy) with n-gram speculation; each cell counts differing
token ids and differing logprob bits (llmserve.testing.invariance). Pass = all zero.
Cost: the same greedy workload served with and without the mode, interleaved, median of
``repeats`` (tok/s ratio).
"""

import ml_collections


def get_config(arg: str = "full") -> ml_collections.ConfigDict:
    """``arg``: "full" (default, SmolLM2) or "smoke" (alias "runlocal": the tiny preset)."""
    arg = {"runlocal": "smoke"}.get(arg, arg)
    if arg not in ("full", "smoke"):
        raise ValueError(f"invariance config arg {arg!r}: use full or smoke")
    smoke = arg == "smoke"
    c = ml_collections.ConfigDict()
    c.name = arg
    c.out_root = ""  # "" = results/ (or $LLMSERVE_RESULTS)
    c.model = "tiny-9-3" if smoke else ""  # "" = SmolLM2-135M-Instruct (random ids as prompts)
    c.dtype = "float32"
    c.num_targets = 2 if smoke else 16
    c.max_prompt = 48 if smoke else 256
    c.max_new = 10 if smoke else 24
    c.cotenants = "7" if smoke else "7,31,63"
    c.max_num_seqs = 8 if smoke else 32
    c.max_model_len = 96 if smoke else 320
    c.page_size = 4 if smoke else 16
    c.cost_requests = 4 if smoke else 32
    c.repeats = 1 if smoke else 3
    c.seed = 0
    return c
