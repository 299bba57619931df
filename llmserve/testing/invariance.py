"""Bitwise batch invariance: a request's tokens and logprobs under every serving condition.

``invariance_matrix`` runs a set of target requests alone (the oracle) and again under each
condition the engine must not let leak into a request's numbers: co-tenants (7, 31 or 63
random requests, random arrival order), a prefix-cache hit, another prefill chunk split, a
preemption and recompute, and speculative decoding (greedy targets). It counts differing token
ids and differing bits of the sampled tokens' logprobs (float32 XOR popcount). Pass = all zero.

Used by ``tests/test_batch_invariance.py`` (tiny preset) and ``experiments/invariance.py``
(SmolLM2). Imports no jax itself; it drives ``Engine`` like any user.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import numpy as np

from llmserve.engine import Engine, EngineConfig
from llmserve.sampling_params import SamplingParams


@dataclasses.dataclass
class Target:
    """A request whose numbers are compared: prompt ids and how it samples."""

    prompt: list[int]
    params: SamplingParams


def run(engine: Engine, requests: Sequence[tuple[str, list[int], SamplingParams]],
        arrivals: Optional[Sequence[int]] = None) -> dict:
    """Serves ``requests`` (id, prompt, params); ``arrivals[i]`` is the step request i joins
    at (default: all at once). Returns {id: (token ids, float32 logprobs of the tokens)}."""
    arrivals = list(arrivals) if arrivals is not None else [0] * len(requests)
    pending = sorted(range(len(requests)), key=lambda i: arrivals[i])
    done, step = {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            rid, prompt, params = requests[pending.pop(0)]
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                lps = [lp[t] for lp, t in zip(c.logprobs or [], c.token_ids)]
                done[out.request_id] = (list(c.token_ids), np.asarray(lps, np.float32))
        step += 1
    return done


def differing(a: tuple, b: tuple) -> tuple[int, int]:
    """(differing token ids, differing logprob bits) between two (ids, logprobs) results."""
    ids_a, lp_a = a
    ids_b, lp_b = b
    n = min(len(ids_a), len(ids_b))
    tokens = sum(x != y for x, y in zip(ids_a, ids_b)) + abs(len(ids_a) - len(ids_b))
    xor = lp_a[:n].view(np.uint32) ^ lp_b[:n].view(np.uint32)
    bits = int(np.unpackbits(xor.view(np.uint8)).sum()) + 32 * abs(len(lp_a) - len(lp_b))
    return int(tokens), bits


def random_cotenants(rng, vocab: int, count: int, max_prompt: int, max_new: int,
                     prefix: str) -> list[tuple[str, list[int], SamplingParams]]:
    """Random requests: greedy or sampled, with or without penalties."""
    out = []
    for i in range(count):
        prompt = rng.integers(1, vocab, int(rng.integers(1, max_prompt))).tolist()
        sampled = bool(rng.random() < 0.5)
        params = SamplingParams(
            temperature=float(rng.uniform(0.5, 1.2)) if sampled else 0.0,
            top_k=int(rng.integers(5, 50)) if sampled else -1, seed=int(rng.integers(1 << 30)),
            presence_penalty=float(rng.choice([0.0, 0.5])), logprobs=1,
            max_tokens=int(rng.integers(1, max_new)), ignore_eos=True)
        out.append((f"{prefix}{i}", prompt, params))
    return out


def invariance_matrix(make_engine: Callable[..., Engine], targets: Sequence[Target], *,
                      vocab: int, cotenants: Sequence[int] = (7, 31, 63), max_prompt: int = 64,
                      max_new: int = 16, seed: int = 0,
                      speculative: bool = True) -> dict[str, tuple[int, int]]:
    """{condition: (differing token ids, differing logprob bits)} summed over ``targets``.

    ``make_engine(**overrides)`` builds a warmed-up batch-invariant engine; overrides change
    EngineConfig fields (max_num_batched_tokens, prefill_buckets, num_pages,
    speculative_config, enable_prefix_caching) for the conditions.
    """
    rng = np.random.default_rng(seed)
    ids = [(f"t{i}", t.prompt, t.params) for i, t in enumerate(targets)]
    alone = {}
    eng = make_engine(enable_prefix_caching=False)
    for rid, prompt, params in ids:
        alone.update(run(eng, [(rid, prompt, params)]))

    def compare(name: str, got: dict, which=None) -> None:
        total = [0, 0]
        for rid, *_ in ids:
            if which is None or rid in which:
                d = differing(alone[rid], got[rid])
                total[0] += d[0]
                total[1] += d[1]
        matrix[name] = tuple(total)

    matrix: dict[str, tuple[int, int]] = {}
    for count in cotenants:
        others = random_cotenants(rng, vocab, count, max_prompt, max_new, "c")
        reqs = ids + others
        order = rng.permutation(len(reqs))
        arrivals = rng.integers(0, 6, len(reqs))
        compare(f"{count} co-tenants", run(make_engine(enable_prefix_caching=False),
                                           [reqs[i] for i in order], arrivals[order]))
    # Prefix-cache hit: a request sharing each target's prompt ran first, on the same engine.
    eng = make_engine(enable_prefix_caching=True)
    run(eng, [(f"w{i}", prompt + [1], SamplingParams(max_tokens=1, temperature=0))
              for i, (_, prompt, _) in enumerate(ids)])
    hits = eng.blocks.stats.prefix_hits
    compare("prefix-cache hit", run(eng, ids))
    assert eng.blocks.stats.prefix_hits > hits, "the prefix-cache condition hit nothing"
    # Another prefill chunk split: small chunks under a small token budget.
    compare("other chunk split", run(make_engine(enable_prefix_caching=False,
                                                 max_num_batched_tokens=12,
                                                 prefill_buckets=((1, 4), (2, 8))), ids))
    # Preemption and recompute: a page pool far too small for everyone at once.
    eng = make_engine(enable_prefix_caching=False, num_pages=None, small_pool=True)
    # (co-tenants that generate 3x longer: decode growth, not admission, is what preempts)
    others = random_cotenants(rng, vocab, 16, max_prompt, 3 * max_new, "p")
    compare("preemption + recompute", run(eng, ids + others))
    matrix["preemptions"] = (eng.stats["preemptions"], 0)
    if speculative:
        greedy = {rid for rid, _, p in ids if p.temperature == 0}
        spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
        compare("speculation (greedy)", run(make_engine(enable_prefix_caching=False,
                                                        speculative_config=spec),
                                            [r for r in ids if r[0] in greedy]), greedy)
    return matrix


def engine_factory(cfg, params, tokenizer=None, **base) -> Callable[..., Engine]:
    """``make_engine(**overrides)`` for ``invariance_matrix``: batch-invariant engines over
    one model; ``small_pool=True`` sizes the pool at 2.5 sequences of max_model_len."""
    def make(small_pool: bool = False, **overrides) -> Engine:
        kw = dict(base, batch_invariant=True, **overrides)
        if small_pool:
            per_seq = -(-kw["max_model_len"] // kw["page_size"])
            kw["num_pages"] = int(2.5 * per_seq) + 1
        eng = Engine(cfg, params, tokenizer, EngineConfig(**kw))
        eng.warmup()
        return eng
    return make
