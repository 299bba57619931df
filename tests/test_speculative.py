"""Tests for llmserve/speculative/: greedy equivalence, losslessness, proposers, no recompiles."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from llmserve import sampling, speculative
from llmserve.config import preset
from llmserve.kv_cache import DenseKVCache, PagedKVCache
from llmserve.model import init_params
from llmserve.reference import decode_dense, generate_reference, prefill_dense
from llmserve.sampling import SamplingArrays
from llmserve.speculative import NgramProposer, verify
from llmserve.speculative import draft as spec_draft

_verify = jax.jit(verify)


def _np(out):
    return jax.tree.map(np.asarray, out)


# ---------------------------------------------------------------------------------- greedy
_sample = jax.jit(sampling.sample)
# Greedy tests share one shape (one compile of verify and of sample): [_GB, _GK + 1, _GV].
_GB, _GK, _GV = 6, 4, 256


def _small_verify(drafts, logits, arrays, positions, q=None, counts=None, pmask=None,
                  num_draft=None):
    """verify at the one small signature every small test shares (q, counts, num_draft given).

    q defaults to a point mass on the drafts (greedy rows ignore q anyway).
    """
    b, k = np.shape(drafts)
    v = np.shape(logits)[-1]
    drafts = jnp.asarray(drafts, jnp.int32)
    q = jax.nn.one_hot(drafts, v) if q is None else jnp.asarray(q, jnp.float32)
    counts = jnp.zeros((b, v), jnp.int32) if counts is None else jnp.asarray(counts, jnp.int32)
    pmask = jnp.zeros((b, v), bool) if pmask is None else jnp.asarray(pmask, bool)
    num_draft = jnp.full((b,), k, jnp.int32) if num_draft is None else jnp.asarray(num_draft,
                                                                                  jnp.int32)
    return _np(_verify(drafts, q, jnp.asarray(logits, jnp.float32), arrays,
                       jnp.asarray(positions, jnp.int32), counts, pmask, num_draft=num_draft))


def _greedy_oracle(drafts, logits, arrays, positions, counts, pmask):
    """Token-by-token decoding with sampling.sample: row i keeps going while draft == token."""
    b, k = drafts.shape
    counts = counts.copy()
    outs = [[] for _ in range(b)]
    live = np.ones(b, bool)
    for j in range(k + 1):
        toks = np.asarray(_sample(jnp.asarray(logits[:, j]), arrays,
                                  jnp.asarray(positions + j), jnp.asarray(counts),
                                  jnp.asarray(pmask)).tokens)
        for i in np.flatnonzero(live):
            outs[i].append(int(toks[i]))
            if j == k or toks[i] != drafts[i, j]:
                live[i] = False
            else:
                counts[i, toks[i]] += 1
    return outs


def _check_greedy(drafts, logits, rows, counts=None, pmask=None):
    """verify == _greedy_oracle on [b <= _GB, _GK] drafts (padded with neutral rows)."""
    b = drafts.shape[0]
    d = np.zeros((_GB, _GK), np.int32)
    d[:b] = drafts
    lg = np.zeros((_GB, _GK + 1, _GV), np.float32)
    lg[:b] = logits
    c = np.zeros((_GB, _GV), np.int32) if counts is None else counts
    m = np.zeros((_GB, _GV), bool) if pmask is None else pmask
    arrays = SamplingArrays.from_lists(list(rows) + [{}] * (_GB - b))
    positions = np.arange(_GB, dtype=np.int32) + 5
    res = _small_verify(d, lg, arrays, positions, counts=c, pmask=m)
    expect = _greedy_oracle(d, lg, arrays, positions, c, m)
    for i, toks in enumerate(expect):
        assert res.num_accepted[i] == len(toks) - 1, (i, res.num_accepted[i], toks)
        np.testing.assert_array_equal(res.out_tokens[i, : len(toks)], toks)
        assert np.all(res.out_tokens[i, len(toks):] == speculative.PAD_TOKEN)
    return jax.tree.map(lambda x: x[:b], res)


def test_greedy_all_accepted_mismatch_and_first_mismatch():
    k, v = _GK, _GV
    # argmax at each of the K+1 positions: 2, 5, 1, 7, 3
    logits = np.full((3, k + 1, v), -1.0, np.float32)
    for j, t in enumerate([2, 5, 1, 7, 3]):
        logits[:, j, t] = 3.0
    drafts = np.array([[2, 5, 1, 7],  # all accepted -> bonus 3
                       [2, 4, 1, 7],  # mismatch at 1 -> correction 5
                       [0, 5, 1, 7]], np.int32)  # mismatch at 0 -> correction 2
    res = _check_greedy(drafts, logits, [{}] * 3)
    np.testing.assert_array_equal(res.num_accepted, [4, 1, 0])
    np.testing.assert_array_equal(res.out_tokens, [[2, 5, 1, 7, 3], [2, 5, -1, -1, -1],
                                                   [2, -1, -1, -1, -1]])
    # Raw logprobs of the emitted tokens, 0 past them.
    lse = np.log(np.exp(logits[0, 0]).sum())
    np.testing.assert_allclose(res.logprobs[0], 3.0 - lse, rtol=1e-5)
    np.testing.assert_array_equal(res.logprobs[2, 1:], 0.0)


def test_greedy_random_logits_with_penalties_and_num_draft():
    rng = np.random.default_rng(1)
    b, k, v = _GB, _GK, _GV
    logits = rng.normal(size=(b, k + 1, v)).astype(np.float32)
    top = logits.argmax(-1)
    drafts = top[:, :k].copy()
    drafts[1, 2] = (drafts[1, 2] + 1) % v
    drafts[2, 0] = (drafts[2, 0] + 3) % v
    _check_greedy(drafts, logits, [{}] * b)
    # Presence/repetition penalties: position j sees drafts 0..j-1 as generated tokens.
    counts = rng.integers(0, 2, (b, v)).astype(np.int32)
    pmask = rng.random((b, v)) < 0.3
    rows = [dict(presence_penalty=2.0), dict(repetition_penalty=1.5), {},
            dict(frequency_penalty=1.0), dict(presence_penalty=0.5), {}]
    # Drafts made to repeat the previous argmax, so the penalty decides acceptance.
    logits[:, 1, :] = logits[:, 0, :] + 0.01 * rng.normal(size=(b, v)).astype(np.float32)
    drafts = np.concatenate([logits[:, 0].argmax(-1)[:, None]] * k, axis=1).astype(np.int32)
    _check_greedy(drafts, logits, rows, counts, pmask)
    # Padding drafts (num_draft) are never accepted; the token there comes from the target.
    res = _small_verify(top[:, :k], logits, SamplingArrays.neutral(b), np.zeros(b),
                        num_draft=[0, 1, 2, 3, 3, 3])
    np.testing.assert_array_equal(res.num_accepted[:2], [0, 1])


# ---------------------------------------------------------------------------------- lossless
# N rows of one verify call: each row is an independent trial (its own seed), so the histogram
# of out_tokens[:, 0] must follow p. The run is deterministic (fixed seeds).
_N = 200_000
_V = 8
_K = 2


def _run_batch(p_logits, q, rows, num_draft=None, draft_tokens=None, seed0=0):
    """verify over _N identical rows with seeds seed0..; drafts drawn from q (numpy)."""
    rng = np.random.default_rng(seed0)
    if draft_tokens is None:
        cum = np.cumsum(q, axis=-1)  # [K, V]
        u = rng.random((_N, _K))
        draft_tokens = np.stack([np.minimum(np.searchsorted(cum[j], u[:, j], side="right"),
                                            _V - 1) for j in range(_K)], axis=1)
    arrays = SamplingArrays.from_lists([rows])
    arrays = jax.tree.map(lambda x: jnp.broadcast_to(x, (_N,)), arrays)
    arrays = arrays.replace(seed=jnp.arange(_N, dtype=jnp.uint32) + seed0)
    logits = jnp.broadcast_to(jnp.asarray(p_logits, jnp.float32), (_N, _K + 1, _V))
    probs = None if q is None else jnp.broadcast_to(jnp.asarray(q, jnp.float32), (_N, _K, _V))
    if num_draft is None:
        num_draft = jnp.full((_N,), _K, jnp.int32)
    res = _verify(jnp.asarray(draft_tokens, jnp.int32), probs, logits, arrays,
                  jnp.full((_N,), 7, jnp.int32), num_draft=num_draft)
    return _np(res)


def _target_p(p_logits, rows):
    """The plain sampler's distribution at each position: [K+1, V] float64."""
    arrays = SamplingArrays.from_lists([rows] * (_K + 1))
    return np.asarray(sampling.probs_from_logits(jnp.asarray(p_logits, jnp.float32), arrays),
                      np.float64)


def _tv_bound(n: int, v: int, delta: float = 1e-6) -> float:
    """A bound that the empirical TV of n draws exceeds with probability < delta.

    TV = 1/2 sum_i |p^_i - p_i|. E|p^_i - p_i| <= sd = sqrt(p_i (1 - p_i) / n), so by
    Cauchy-Schwarz E[TV] <= 1/2 sum_i sqrt(p_i / n) <= 1/2 sqrt(v / n). Changing one draw moves
    TV by at most 1/n, so McDiarmid gives P(TV >= E[TV] + t) <= exp(-2 n t^2), i.e.
    t = sqrt(ln(1/delta) / (2 n)). For n = 200000, v = 8: 0.0032 + 0.0059 = 0.0091.
    """
    return 0.5 * math.sqrt(v / n) + math.sqrt(math.log(1 / delta) / (2 * n))


_REPORT: dict = {}


def _check_law(tokens, p, name):
    """Chi-square (p-value > 0.001) and TV (below _tv_bound) of tokens against p [V]."""
    n = len(tokens)
    counts = np.bincount(tokens, minlength=_V)
    assert counts.shape == (_V,) and np.all(tokens >= 0)
    support = p > 0
    assert counts[~support].sum() == 0, (name, counts, p)  # never a token p excludes
    expected = p[support] * n
    pval = stats.chisquare(counts[support], expected * counts[support].sum() / expected.sum()
                           ).pvalue if support.sum() > 1 else 1.0
    tv = 0.5 * np.abs(counts / n - p).sum()
    _REPORT[name] = (float(pval), float(tv), _tv_bound(n, _V))
    print(f"{name}: n={n} chi2 p={pval:.3g} TV={tv:.5f} bound={_tv_bound(n, _V):.5f}")
    assert pval > 1e-3, (name, pval, counts, p * n)
    assert tv < _tv_bound(n, _V), (name, tv)


_P_LOGITS = np.array([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2],
                      [0.0, 0.3, 2.0, -1.0, 1.0, 0.1, -0.2, 0.7],
                      [1.0, -1.0, 0.0, 0.5, 2.5, -0.5, 0.3, 0.0]], np.float32)
_Q_SKEW = np.array([[0.02, 0.05, 0.3, 0.3, 0.1, 0.1, 0.03, 0.1],
                    [0.4, 0.1, 0.05, 0.05, 0.1, 0.1, 0.1, 0.1]])
_Q_UNIFORM = np.full((_K, _V), 1.0 / _V)


@pytest.mark.parametrize("name,rows,q", [
    ("temp0.7", dict(temperature=0.7), _Q_SKEW),
    ("topk3_temp1.3", dict(temperature=1.3, top_k=3), _Q_UNIFORM),
    ("topp0.6_minp", dict(temperature=1.0, top_p=0.6, min_p=0.05), _Q_SKEW),
])
def test_lossless_first_token(name, rows, q):
    """out_tokens[:, 0] ~ p, and out_tokens[:, 1] ~ p at position 1 given draft 0 accepted."""
    p = _target_p(_P_LOGITS, rows)
    res = _run_batch(_P_LOGITS, q, rows)
    _check_law(res.out_tokens[:, 0], p[0], name)
    second = res.out_tokens[res.num_accepted >= 1, 1]
    assert len(second) > 5000
    assert 0.5 * np.abs(np.bincount(second, minlength=_V) / len(second) - p[1]).sum() < \
        _tv_bound(len(second), _V), name


def test_lossless_bonus_when_q_equals_p():
    """q == p: every draft is accepted and the bonus token (position K) follows p there."""
    rows = dict(temperature=0.9, top_k=6)
    p = _target_p(_P_LOGITS, rows)
    res = _run_batch(_P_LOGITS, p[:_K], rows, seed0=1 << 20)
    assert np.mean(res.num_accepted == _K) > 0.999
    full = res.num_accepted == _K
    _check_law(res.out_tokens[full, _K], p[_K], "bonus_q_eq_p")
    _check_law(res.out_tokens[:, 0], p[0], "first_q_eq_p")


def test_lossless_ngram_point_mass_and_num_draft():
    """draft_probs None (deterministic drafts, even ones p excludes), some rows padded."""
    rows = dict(temperature=0.8, top_p=0.8)
    p = _target_p(_P_LOGITS, rows)
    idx = np.arange(_N)
    drafts = np.stack([idx % _V, (idx // _V) % _V], axis=1)
    num_draft = jnp.asarray(idx % (_K + 1), jnp.int32)  # 0, 1 or 2 real drafts
    res = _run_batch(_P_LOGITS, None, rows, num_draft=num_draft, draft_tokens=drafts,
                     seed0=2 << 20)
    _check_law(res.out_tokens[:, 0], p[0], "ngram")
    assert np.all(res.num_accepted <= np.asarray(num_draft))


def test_rows_independent_of_batch_composition():
    rng = np.random.default_rng(3)
    b, k, v = _GB, _GK, _GV
    logits = rng.normal(size=(b, k + 1, v)).astype(np.float32)
    q = np.asarray(jax.nn.softmax(jnp.asarray(rng.normal(size=(b, k, v)), jnp.float32), -1))
    drafts = rng.integers(0, v, (b, k)).astype(np.int32)
    arrays = SamplingArrays.from_lists([dict(temperature=1.0, seed=11 * i) for i in range(b)])
    pos = np.arange(b, dtype=np.int32) * 3
    perm = np.array([3, 0, 5, 1, 4, 2])
    a = _small_verify(drafts, logits, arrays, pos, q=q)
    c = _small_verify(drafts[perm], logits[perm], jax.tree.map(lambda x: x[perm], arrays),
                      pos[perm], q=q[perm])
    np.testing.assert_array_equal(a.out_tokens[perm], c.out_tokens)


def test_no_recompilation_when_values_change():
    rng = np.random.default_rng(4)
    b, k, v = _GB, _GK, _GV
    sizes = []  # every jit of verify shares one compile cache: count its growth
    for i, rows in enumerate([
            [{}] * b,
            [dict(temperature=0.5, seed=i) for i in range(b)],
            [dict(temperature=1.0, top_k=5, top_p=0.9), {}, dict(min_p=0.1, temperature=2.0),
             dict(presence_penalty=1.0), dict(repetition_penalty=1.2), {}]]):
        _small_verify(rng.integers(0, v, (b, k)), rng.normal(size=(b, k + 1, v)),
                      SamplingArrays.from_lists(rows), np.full(b, i),
                      q=jax.nn.softmax(jnp.asarray(rng.normal(size=(b, k, v))), -1),
                      counts=rng.integers(0, 2, (b, v)), num_draft=np.full(b, i))
        sizes.append(_verify._cache_size())
    assert sizes[1:] == sizes[:1] * 2, sizes


# ---------------------------------------------------------------------------------- n-gram
def test_ngram_match_found_and_continuation():
    prop = NgramProposer(n_max=3, n_min=1, k=3)
    toks, n = prop.lookup([5, 6, 7, 8, 9, 1, 5, 6, 7])
    assert n == 3 and list(toks) == [8, 9, 1]


def test_ngram_longest_n_preferred_over_recent_shorter():
    prop = NgramProposer(n_max=3, n_min=1, k=2)
    # The 3-gram [1, 2, 3] occurs early (-> 40, 41); only the 1-gram [3] occurs later (-> 50).
    toks, n = prop.lookup([1, 2, 3, 40, 41, 3, 50, 1, 2, 3])
    assert n == 2 and list(toks) == [40, 41]


def test_ngram_earliest_or_latest_match_and_short_continuation():
    prop = NgramProposer(n_max=2, n_min=1, k=4)  # the earliest match: vLLM's choice
    toks, n = prop.lookup([7, 8, 1, 7, 8, 2, 9, 7, 8])
    assert n == 4 and list(toks) == [1, 7, 8, 2]
    latest = NgramProposer(n_max=2, n_min=1, k=4, match="latest")
    toks, n = latest.lookup([7, 8, 1, 7, 8, 2, 9, 7, 8])
    assert n == 4 and list(toks) == [2, 9, 7, 8]
    toks, n = latest.lookup([3, 4, 9, 3, 4])  # continuation runs into the end of the sequence
    assert n == 3 and list(toks) == [9, 3, 4, 0]
    with pytest.raises(ValueError, match="match"):
        NgramProposer(match="first")


def test_ngram_no_match_and_batch():
    prop = NgramProposer(n_max=3, n_min=2, k=3)
    assert prop.lookup([1, 2, 3, 4])[1] == 0
    assert prop.lookup([1])[1] == 0
    assert prop.lookup([])[1] == 0
    tokens, lengths = prop.propose_batch([[1, 2, 3, 4], [1, 2, 9, 1, 2], [5, 5, 5]], 3)
    np.testing.assert_array_equal(lengths, [0, 3, 1])
    np.testing.assert_array_equal(tokens, [[0, 0, 0], [9, 1, 2], [5, 0, 0]])


def _lookup_by_definition(ids, n_max, n_min, k, match):
    """Prompt lookup as its docstring defines it, in plain Python: for n = n_max .. n_min, the
    earliest (or latest) earlier window equal to the last n tokens, and the (up to) k tokens
    after it."""
    for n in range(min(n_max, len(ids) - 1), n_min - 1, -1):
        starts = range(len(ids) - 1 - n, -1, -1)
        for i in (reversed(starts) if match == "earliest" else starts):
            if ids[i:i + n] == ids[len(ids) - n:]:
                follow = ids[i + n:i + n + k]
                return follow + [0] * (k - len(follow)), len(follow)
    return [0] * k, 0


@pytest.mark.parametrize("match", ["earliest", "latest"])
def test_ngram_lookup_equals_its_definition_on_random_sequences(match):
    """The one-pass lookup against the search by definition on 3000 random sequences over
    small alphabets (many repeated n-grams, ties between windows, matches at the start)."""
    rng = np.random.default_rng(0)
    for trial in range(3000):
        n_max = int(rng.integers(1, 5))
        n_min = int(rng.integers(1, n_max + 1))
        k = int(rng.integers(1, 6))
        ids = rng.integers(0, int(rng.integers(1, 6)), int(rng.integers(0, 40))).tolist()
        toks, n = NgramProposer(n_max=n_max, n_min=n_min, k=k, match=match).lookup(ids)
        want, want_n = _lookup_by_definition(ids, n_max, n_min, k, match)
        assert (list(toks), n) == (want, want_n), (trial, ids, n_max, n_min, k)


# ---------------------------------------------------------------------------------- draft model
def test_draft_model_equal_to_target_matches_greedy_and_is_accepted():
    cfg = preset("tiny-gqa")
    params = init_params(cfg, seed=0)
    k, page, pages_per_seq = 4, 4, 6
    prompts = [[3, 17, 99, 4, 250, 8, 61], [12, 5, 77, 140, 9]]
    b = len(prompts)
    tables = np.array([[1 + i * pages_per_seq + j for j in range(pages_per_seq)]
                       for i in range(b)], np.int32)
    cache = PagedKVCache.create(cfg, 1 + b * pages_per_seq, page)
    # Prefill all but the last two prompt tokens; those are the tail draft_propose catches up.
    chunk = np.zeros((b, 8), np.int32)
    for i, p in enumerate(prompts):
        chunk[i, : len(p) - 2] = p[:-2]
    lens = np.array([len(p) for p in prompts], np.int32)
    cache = spec_draft.draft_prefill(params, cache, jnp.asarray(chunk), jnp.zeros(b, jnp.int32),
                                      jnp.asarray(lens - 2), jnp.asarray(tables), cfg=cfg)
    tail = np.array([p[-2:] for p in prompts], np.int32)
    ref = generate_reference(params, cfg, prompts, k + 1)

    def propose(cache, rows):
        arrays = SamplingArrays.from_lists(rows)
        return spec_draft.draft_propose(params, cache, jnp.asarray(tail), jnp.asarray(lens - 2),
                                         jnp.full((b,), 2, jnp.int32), jnp.asarray(tables),
                                         arrays, cfg=cfg, k=k)

    out, cache = propose(cache, [{}] * b)
    np.testing.assert_array_equal(np.asarray(out.tokens), [r[:k] for r in ref])
    np.testing.assert_allclose(np.asarray(out.probs).sum(-1), 1.0, rtol=1e-5)

    def target_verify(out, rows):
        """The target (same model, dense cache: the steps generate_reference compiled) scores
        [prompt, drafts]; verify runs at the small shared signature (rows padded to _GB)."""
        drafts = np.asarray(out.tokens)
        t = int(lens.max())
        tokens = np.zeros((b, t), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        dense = DenseKVCache.create(cfg, b, t + k + 1)
        logits, dense = prefill_dense(params, jnp.asarray(tokens), jnp.asarray(lens), dense,
                                      cfg=cfg)
        rows_logits = [np.asarray(logits)]
        for j in range(k):
            logits, dense = decode_dense(params, jnp.asarray(drafts[:, j], jnp.int32),
                                         jnp.asarray(lens + j), dense, cfg=cfg)
            rows_logits.append(np.asarray(logits))
        pad = _GB - b
        lg = np.concatenate([np.stack(rows_logits, 1), np.zeros((pad, k + 1, cfg.vocab_size))])
        q = np.concatenate([np.asarray(out.probs), np.full((pad, k, cfg.vocab_size), 1 / 256)])
        res = _small_verify(np.concatenate([drafts, np.zeros((pad, k), np.int32)]), lg,
                            SamplingArrays.from_lists(list(rows) + [{}] * pad),
                            np.concatenate([lens, np.zeros(pad, np.int32)]), q=q)
        return jax.tree.map(lambda x: x[:b], res)

    # Verify against the target (same model): every greedy draft accepted, bonus = next token.
    res = target_verify(out, [{}] * b)
    np.testing.assert_array_equal(res.num_accepted, [k, k])
    np.testing.assert_array_equal(res.out_tokens, ref)

    # Sampled drafts: q is processed exactly as the verifier's p (q == p up to float rounding),
    # so every draft is accepted.
    rows = [dict(temperature=0.8, top_k=20, seed=5), dict(temperature=1.2, top_p=0.9, seed=6)]
    compiled = spec_draft.draft_propose._cache_size()
    out, cache = propose(cache, rows)
    res = target_verify(out, rows)
    np.testing.assert_array_equal(res.num_accepted, [k, k])
    assert spec_draft.draft_propose._cache_size() == compiled  # the second propose reused it
