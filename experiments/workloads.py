"""The throughput benchmark's requests: prompts cut from the corpus, uniform or heavy-tailed
max_tokens, a summary with a hash (to match runs up), and the JSON that vLLM's driver reads."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Optional

try:
    from experiments import common
except ImportError:  # run as a script: python experiments/workloads.py
    import common


@dataclasses.dataclass(frozen=True)
class Request:
    """One benchmark request: prompt token ids and how many tokens to generate."""

    prompt_ids: tuple[int, ...]
    max_tokens: int


def new_token_counts(wcfg, rng, n: int):
    """Per-request max_tokens: uniform in ``new_tokens``, or log-normal for "heavy"."""
    import numpy as np

    if wcfg.kind == "uniform":
        return rng.integers(*wcfg.new_tokens, size=n, endpoint=True)
    if wcfg.kind != "heavy":
        raise ValueError(f"workload.kind {wcfg.kind!r}: use uniform or heavy")
    draws = rng.lognormal(np.log(wcfg.median_new_tokens), wcfg.sigma, size=n)
    return np.clip(np.rint(draws), wcfg.min_new_tokens, wcfg.max_new_tokens).astype(int)


def build_workload(wcfg, tokenizer, seed: int, vocab_size: Optional[int] = None) -> list[Request]:
    """Cuts ``num_prompts`` prompts from the tokenized corpus at distinct random offsets.

    Distinct offsets keep prefix caching from sharing pages between prompts. Token ids are
    taken modulo ``vocab_size`` for a small random-weight model.
    """
    import numpy as np

    lo, hi = wcfg.prompt_len
    if tokenizer is None:  # random ids (a random-weight model does not care what they say)
        ids = np.random.default_rng(10_000 + seed).integers(
            3, vocab_size or 32_000, size=hi * (wcfg.num_prompts + 8)).tolist()
    else:
        ids = tokenizer.encode(common.corpus_text())
    n = wcfg.num_prompts
    if len(ids) - hi < n:
        raise ValueError(f"corpus of {len(ids)} tokens is too small for {n} prompts")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi, size=n, endpoint=True)
    new_tokens = new_token_counts(wcfg, rng, n)
    offsets = rng.choice(len(ids) - hi, size=n, replace=False)
    vocab = vocab_size or (1 << 62)
    return [Request(tuple(int(t) % vocab for t in ids[o: o + length]), int(m))
            for o, length, m in zip(offsets, lengths, new_tokens)]


def workload_summary(workload: list[Request]) -> dict:
    """Sizes and a hash of the request list, so runs (and vLLM's) can be matched up."""
    import numpy as np

    digest = hashlib.sha256(repr([(r.prompt_ids, r.max_tokens) for r in workload]).encode())
    plen = [len(r.prompt_ids) for r in workload]
    new = [r.max_tokens for r in workload]
    return {"num_prompts": len(workload), "prompt_tokens": sum(plen), "new_tokens": sum(new),
            "prompt_len_min_max": [min(plen), max(plen)],
            "new_tokens_min_max": [min(new), max(new)],
            "new_tokens_median_p99": [float(np.median(new)), float(np.percentile(new, 99))],
            "sha256": digest.hexdigest()[:16]}


def warmup_prompts(cfg) -> list[list[int]]:
    """Short prompts that share no page with the workload (so no prefix-cache hits)."""
    return [[100 + 7 * i + j for j in range(8)] for i in range(cfg.warmup_prompts)]


def sampling_kwargs(spec: str, key: str = "workload.sampling") -> dict:
    """A workload's sampling parameters from "name=value,..." (e.g. "temperature=0.7,top_p=0.9");
    "" is greedy. Values are vLLM SamplingParams fields (temperature, top_p, top_k, min_p,
    presence/frequency/repetition_penalty); every request also gets seed = its index."""
    allowed = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
               "presence_penalty": float, "frequency_penalty": float,
               "repetition_penalty": float}
    out = {}
    for part in filter(None, (p.strip() for p in str(spec or "").split(","))):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or name not in allowed:
            raise ValueError(f"{key}: {part!r} is not name=value with name one of "
                             f"{sorted(allowed)} (e.g. temperature=0.7,top_p=0.9)")
        try:
            out[name] = allowed[name](value)
        except ValueError:
            raise ValueError(f"{key}: {name}={value!r} is not a number") from None
    return out


def write_workload(path: str, workload: list[Request], sampling: dict | None = None) -> str:
    """The request list as JSON, for scripts/vllm_driver.py (``sampling``: every request's
    sampling parameters; absent: greedy)."""
    with open(path, "w") as fh:
        json.dump({"workload": workload_summary(workload), "sampling": sampling or {},
                   "requests": [{"prompt_token_ids": list(r.prompt_ids),
                                 "max_tokens": r.max_tokens} for r in workload]}, fh)
    return path
