"""Tests for llmserve/sampling.py: invariants, numpy references, and no recompilation."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from llmserve import sampling
from llmserve.sampling import SamplingArrays

# Every call runs at one padded shape, so the whole file compiles each function once (compiles
# dominate the runtime): rows are padded with neutral slots, the vocab with -inf logits.
_B, _V = 2048, 64
_sample_jit = jax.jit(sampling.sample, static_argnames=("num_logprobs",))
_process_jit = jax.jit(sampling.process_logits)
_probs_jit = jax.jit(sampling.probs_from_logits)


def _arrays(rows):
    return SamplingArrays.from_lists(rows)


def _pad(logits, rows, counts=None, prompt_mask=None):
    b, v = logits.shape
    assert b <= _B and v <= _V
    full = np.zeros((_B, _V), np.float32)
    full[:b] = -np.inf
    full[:b, :v] = logits
    c = np.zeros((_B, _V), np.int32)
    m = np.zeros((_B, _V), bool)
    if counts is not None:
        c[:b, :v] = counts
    if prompt_mask is not None:
        m[:b, :v] = prompt_mask
    arrays = _arrays(list(rows) + [{}] * (_B - b))
    return jnp.asarray(full), arrays, jnp.asarray(c), jnp.asarray(m)


def _sample(logits, rows, positions, counts=None, prompt_mask=None):
    """sample() on rows [b, v] padded to [_B, _V]; returns numpy (tokens, logprobs, ids, lps)."""
    b, v = np.shape(logits)
    full, arrays, c, m = _pad(np.asarray(logits), rows, counts, prompt_mask)
    pos = np.zeros(_B, np.int32)
    pos[:b] = positions
    out = _sample_jit(full, arrays, jnp.asarray(pos), c, m, num_logprobs=4)
    return jax.tree.map(lambda x: np.asarray(x)[:b], out)


def _process(logits, rows, counts=None, prompt_mask=None):
    b, v = np.shape(logits)
    return np.asarray(_process_jit(*_pad(np.asarray(logits), rows, counts, prompt_mask)))[:b, :v]


def _probs(logits, rows):
    b, v = np.shape(logits)
    return np.asarray(_probs_jit(*_pad(np.asarray(logits), rows)))[:b, :v]


def _tile(row, n):
    return np.tile(np.asarray(row, np.float32)[None], (n, 1))


# --- numpy references (vLLM semantics) ---------------------------------------------------------


def _np_penalties(logits, rp, fp, pp, counts, prompt_mask):
    out = logits.astype(np.float64).copy()
    seen = (counts > 0) | prompt_mask
    rp = rp[:, None]
    out = np.where(seen, np.where(out > 0, out / rp, out * rp), out)
    out -= fp[:, None] * counts
    out -= pp[:, None] * (counts > 0)
    return out


def _np_top_k_top_p(logits, k, p):
    """vLLM's _apply_top_k_top_p: ascending sort, mask, scatter back."""
    out = np.array(logits, np.float64)
    for b in range(out.shape[0]):
        order = np.argsort(out[b], kind="stable")
        srt = out[b][order]
        vocab = srt.size
        if 0 < k[b] < vocab:
            srt = np.where(srt < srt[vocab - k[b]], -np.inf, srt)
        if p[b] < 1.0:
            probs = np.exp(srt - srt.max())
            probs /= probs.sum()
            drop = np.cumsum(probs) <= 1 - p[b]
            drop[-1] = False
            srt = np.where(drop, -np.inf, srt)
        out[b][order] = srt
    return out


# --- SamplingArrays ----------------------------------------------------------------------------


def test_neutral_and_from_lists():
    a = SamplingArrays.neutral(3)
    assert a.temperature.shape == (3,) and a.temperature.dtype == jnp.float32
    assert a.top_k.dtype == jnp.int32 and a.seed.dtype == jnp.uint32
    np.testing.assert_array_equal(a.top_p, 1.0)
    np.testing.assert_array_equal(a.repetition_penalty, 1.0)
    b = _arrays([{"temperature": 0.5, "top_k": 7, "seed": 2**32 + 5}, {"top_p": None}])
    np.testing.assert_allclose(b.temperature, [0.5, 0.0])
    np.testing.assert_array_equal(b.top_k, [7, 0])
    np.testing.assert_array_equal(b.top_p, [1.0, 1.0])
    np.testing.assert_array_equal(b.seed, [5, 0])
    with pytest.raises(ValueError, match="unknown"):
        _arrays([{"temprature": 1.0}])


# --- greedy and temperature --------------------------------------------------------------------


def test_top1_sampling_equals_greedy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(16, 50)).astype(np.float32) * 3
    top1 = [{"temperature": 1.5, "top_k": 1, "seed": i} for i in range(16)]
    for step in range(3):
        pos = np.full(16, step)
        want = _sample(logits, [{}] * 16, pos).tokens
        np.testing.assert_array_equal(want, logits.argmax(-1))
        np.testing.assert_array_equal(_sample(logits, top1, pos).tokens, want)
    # Greedy rows stay greedy beside sampled ones.
    mixed = [{} if i % 2 else {"temperature": 5.0, "seed": i} for i in range(16)]
    got = _sample(logits, mixed, np.zeros(16)).tokens
    np.testing.assert_array_equal(got[1::2], want[1::2])
    assert not np.array_equal(got[::2], want[::2])


def test_temperature_to_zero_limit():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(64, 40)).astype(np.float32) * 3
    cold = [{"temperature": 2e-5, "seed": i} for i in range(64)]
    np.testing.assert_array_equal(_sample(logits, cold, np.arange(64)).tokens, logits.argmax(-1))
    np.testing.assert_allclose(_probs(logits, cold).max(-1), 1.0, atol=1e-6)
    # Greedy rows: probs_from_logits is a one-hot on the argmax.
    one_hot = _probs(logits, [{}] * 64)
    np.testing.assert_array_equal(one_hot.argmax(-1), logits.argmax(-1))
    np.testing.assert_array_equal(one_hot.sum(-1), 1.0)


# --- randomness --------------------------------------------------------------------------------


def test_seeded_reproducible_and_batch_independent():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(6, _V)).astype(np.float32) * 2
    rows = [
        {"temperature": 1.0, "seed": 11},
        {"temperature": 0.8, "top_k": 10, "seed": 12},
        {"temperature": 1.2, "top_p": 0.9, "seed": 13},
        {"seed": 14},  # greedy
        {"temperature": 1.0, "min_p": 0.1, "seed": 15},
        {"temperature": 1.0, "seed": 16},
    ]
    pos = np.array([3, 9, 4, 7, 1, 5])
    full = _sample(logits, rows, pos).tokens
    np.testing.assert_array_equal(_sample(logits, rows, pos).tokens, full)

    # Same requests at other row indices, beside other requests (with and without filters and
    # penalties of their own): the same tokens for the same (seed, position).
    sel = [4, 0, 2]
    others = rng.normal(size=(3, _V)).astype(np.float32)
    other_rows = [{"temperature": 0.5, "top_k": 3, "seed": 98}, {"seed": 99},
                  {"temperature": 1.0, "repetition_penalty": 1.5}]
    sub_logits = np.concatenate([others[:1], logits[sel], others[1:]])
    sub_rows = other_rows[:1] + [rows[i] for i in sel] + other_rows[1:]
    sub_pos = np.concatenate([[0], pos[sel], [0, 0]])
    counts = np.zeros((6, _V), np.int32)
    counts[5, :10] = 2
    sub = _sample(sub_logits, sub_rows, sub_pos, counts=counts).tokens
    np.testing.assert_array_equal(sub[1:4], full[sel])

    # The seed matters, and so does the position.
    flat = _tile(np.zeros(_V), 32)
    by_seed = _sample(flat, [{"temperature": 1.0, "seed": s} for s in range(32)], np.zeros(32))
    by_pos = _sample(flat, [{"temperature": 1.0}] * 32, np.arange(32))
    assert len(set(by_seed.tokens.tolist())) > 10
    assert len(set(by_pos.tokens.tolist())) > 10


def test_request_keys_depend_on_seed_and_position_only():
    keys = sampling.request_keys(jnp.array([5, 5, 6], jnp.uint32), jnp.array([2, 2, 2]))
    want = jax.random.fold_in(jax.random.PRNGKey(5), 2)
    np.testing.assert_array_equal(keys[0], want)
    np.testing.assert_array_equal(keys[1], want)
    assert not np.array_equal(keys[2], want)


# --- filters -----------------------------------------------------------------------------------


def test_top_k_never_samples_outside_top_k():
    rng = np.random.default_rng(3)
    row = rng.normal(size=48).astype(np.float32)
    k = 5
    out = _sample(_tile(row, _B), [{"temperature": 3.0, "top_k": k, "seed": 1}] * _B,
                  np.arange(_B))
    # Never outside the top k, and every one of the k is reachable.
    assert set(out.tokens.tolist()) == set(np.argsort(-row)[:k].tolist())


def test_top_p_keeps_smallest_prefix_with_mass_p():
    probs = np.array([0.1, 0.4, 0.05, 0.3, 0.15])  # sorted: 0.4, 0.3, 0.15, 0.1, 0.05
    row = np.log(probs).astype(np.float32)
    cases = {0.35: {1}, 0.6: {1, 3}, 0.8: {1, 3, 4}, 0.9: {1, 3, 4, 0}, 0.99: {0, 1, 2, 3, 4},
             0.0: {1}}
    out = _process(_tile(row, len(cases)), [{"temperature": 1.0, "top_p": p} for p in cases])
    for i, (p, want) in enumerate(cases.items()):
        assert set(np.flatnonzero(np.isfinite(out[i])).tolist()) == want, p
    np.testing.assert_array_equal(out[1][[1, 3]], row[[1, 3]])  # kept logits unchanged


def test_top_k_top_p_match_vllm_reference():
    rng = np.random.default_rng(4)
    b = 48
    logits = rng.normal(size=(b, _V)).astype(np.float32) * rng.uniform(0.5, 4, (b, 1))
    k = rng.integers(-1, _V + 5, size=b)
    k[:4] = [0, 1, _V, _V - 1]
    p = rng.uniform(0.05, 1.0, size=b)
    p[4:8] = [1.0, 1.0, 0.5, 0.999]
    rows = [{"temperature": 1.0, "top_k": int(k[i]), "top_p": float(p[i])} for i in range(b)]
    got = np.isfinite(_process(logits, rows))
    np.testing.assert_array_equal(got, np.isfinite(_np_top_k_top_p(logits, k, p)))


def test_filters_follow_temperature_and_skip_greedy_rows():
    row = np.log(np.array([0.5, 0.3, 0.2])).astype(np.float32)
    # At temperature 2 the distribution flattens to 0.41, 0.32, 0.27: top-p 0.75 keeps all three.
    out = _process(_tile(row, 3), [{"temperature": 2.0, "top_p": 0.75},
                                   {"temperature": 1.0, "top_p": 0.75},
                                   {"top_p": 0.1, "top_k": 1}])  # greedy: untouched
    np.testing.assert_array_equal(np.isfinite(out), [[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    np.testing.assert_allclose(out[0], row / 2.0, rtol=1e-6)
    np.testing.assert_array_equal(out[2], row)


def test_min_p():
    row = np.log(np.array([0.25, 0.5, 0.15, 0.1])).astype(np.float32)
    out = _process(_tile(row, 4), [
        {"temperature": 1.0, "min_p": 0.25},  # keep p >= 0.125
        {"temperature": 1.0, "min_p": 0.4},  # keep p >= 0.2
        {"temperature": 1.0, "min_p": 0.0},
        {"temperature": 1.0, "top_k": 2, "min_p": 0.6}])  # after top-k: keep p >= 0.3 * 2/3
    np.testing.assert_array_equal(np.isfinite(out), [
        [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0]])


# --- penalties ---------------------------------------------------------------------------------


def test_penalties_match_numpy():
    rng = np.random.default_rng(5)
    b = 16
    logits = rng.normal(size=(b, _V)).astype(np.float32) * 2
    counts = (rng.integers(0, 4, size=(b, _V)) * (rng.random((b, _V)) < 0.3)).astype(np.int32)
    prompt = rng.random((b, _V)) < 0.1
    rp = rng.uniform(0.8, 1.6, b).astype(np.float32)
    fp = rng.uniform(-0.5, 1.0, b).astype(np.float32)
    pp = rng.uniform(-0.5, 1.0, b).astype(np.float32)
    rp[0], fp[0], pp[0] = 1.0, 0.0, 0.0  # a neutral row stays bit-exact
    rows = [{"repetition_penalty": float(rp[i]), "frequency_penalty": float(fp[i]),
             "presence_penalty": float(pp[i])} for i in range(b)]
    want = _np_penalties(logits, rp, fp, pp, counts, prompt)
    got = jax.jit(sampling.apply_penalties)(jnp.asarray(logits), _arrays(rows),
                                            jnp.asarray(counts), jnp.asarray(prompt))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[0], logits[0])
    # process_logits applies them (greedy rows: penalized, not scaled), and greedy sampling
    # takes the argmax of the penalized logits.
    np.testing.assert_allclose(_process(logits, rows, counts, prompt), want, rtol=1e-5, atol=1e-5)
    tokens = _sample(logits, rows, np.zeros(b), counts, prompt).tokens
    np.testing.assert_array_equal(tokens, want.argmax(-1))
    assert not np.array_equal(want.argmax(-1), logits.argmax(-1))


# --- distribution and logprobs -----------------------------------------------------------------


def _empirical(row, params, calls=10):
    """Token histogram of `calls * _B` draws (distinct positions) from one row."""
    tokens = [_sample(_tile(row, _B), [dict(params, seed=7)] * _B, np.arange(_B) + i * _B).tokens
              for i in range(calls)]
    return np.bincount(np.concatenate(tokens), minlength=row.size), calls * _B


def test_sample_distribution_matches_softmax():
    rng = np.random.default_rng(6)
    row = rng.normal(size=12).astype(np.float32)
    counts, n = _empirical(row, {"temperature": 0.7})
    row64 = row.astype(np.float64)
    want = np.exp(row64 / 0.7 - np.max(row64 / 0.7))
    assert stats.chisquare(counts, want / want.sum() * n).pvalue > 1e-3
    untempered = np.exp(row64) / np.exp(row64).sum()
    assert stats.chisquare(counts, untempered * n).pvalue < 1e-6


def test_sample_draws_from_probs_from_logits():
    # The speculative verifier relies on this: `sample` draws exactly from probs_from_logits.
    rng = np.random.default_rng(7)
    row = rng.normal(size=40).astype(np.float32) * 1.5
    params = {"temperature": 0.9, "top_k": 12, "top_p": 0.8, "min_p": 0.05}
    counts, n = _empirical(row, params)
    probs = _probs(row[None], [params])[0].astype(np.float64)
    np.testing.assert_allclose(probs.sum(), 1.0, rtol=1e-5)
    keep = probs > 0
    assert 2 < keep.sum() < 12
    assert np.all(counts[~keep] == 0)
    assert stats.chisquare(counts[keep], probs[keep] / probs[keep].sum() * n).pvalue > 1e-3


def test_logprobs_are_raw_log_softmax():
    rng = np.random.default_rng(8)
    logits = rng.normal(size=(5, 30)).astype(np.float32) * 3
    rows = [{"temperature": 0.5, "top_k": 3, "seed": i} for i in range(4)] + [{}]
    out = _sample(logits, rows, np.arange(5))
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits)))
    np.testing.assert_allclose(out.logprobs, raw[np.arange(5), out.tokens], atol=1e-5)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-logits, -1)[:, :4])
    np.testing.assert_allclose(out.top_logprobs, np.sort(raw, -1)[:, ::-1][:, :4], atol=1e-5)
    empty = jax.eval_shape(sampling.sample, jnp.asarray(logits), _arrays(rows), jnp.arange(5))
    assert empty.top_ids.shape == (5, 0) and empty.top_logprobs.shape == (5, 0)


def test_update_counts():
    counts = jnp.zeros((3, 5), jnp.int32)
    counts = sampling.update_counts(counts, jnp.array([1, 4, 2]), jnp.array([True, False, True]))
    counts = sampling.update_counts(counts, jnp.array([1, 0, 0]), jnp.array([True, True, True]))
    np.testing.assert_array_equal(counts, [[0, 2, 0, 0, 0], [1, 0, 0, 0, 0], [1, 0, 1, 0, 0]])


# --- compilation -------------------------------------------------------------------------------


def test_no_recompilation_when_values_change():
    b, vocab = 4, 32

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(logits, arrays, positions, counts, prompt_mask):
        out = sampling.sample(logits, arrays, positions, counts, prompt_mask, num_logprobs=2)
        probs = sampling.probs_from_logits(logits, arrays, counts, prompt_mask)
        return out, probs, sampling.update_counts(counts, out.tokens, jnp.ones(b, bool))

    rng = np.random.default_rng(9)
    counts = jnp.zeros((b, vocab), jnp.int32)
    prompt = jnp.asarray(rng.random((b, vocab)) < 0.2)
    configs = [
        [{}] * b,  # all greedy, no penalties: every cond takes its cheap branch
        [{"temperature": 0.7, "seed": 3}] * b,
        [{"temperature": 1.0, "top_k": 5, "top_p": 0.9, "min_p": 0.1, "seed": i,
          "repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": 0.3}
         for i in range(b)],
        [{"top_k": 2}, {"temperature": 0.3}, {"top_p": 0.5, "temperature": 2.0}, {}],
    ]
    chex.clear_trace_counter()
    for i, rows in enumerate(configs):
        logits = jnp.asarray(rng.normal(size=(b, vocab)).astype(np.float32))
        _, probs, counts = step(logits, _arrays(rows), jnp.full((b,), i), counts, prompt)
        np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    assert step._cache_size() == 1
    np.testing.assert_array_equal(counts.sum(-1), len(configs))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="native CPU kernel")
def test_fixed_order_logsumexp_matches_jax_and_is_row_invariant():
    """The batch-invariant mode's log-sum-exp (native, fixed order) equals jax.nn.logsumexp to
    1e-6 relative on random logits with -inf entries and an all -inf row, and a row's value is
    bitwise the same alone, in a batch of 33 and inside a larger jitted program."""
    from llmserve.ops import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    rng = np.random.default_rng(0)
    x = rng.standard_normal((33, 49152)).astype(np.float32) * 4
    x[3, ::7] = -np.inf  # suppressed tokens
    x[5] = -np.inf  # a row that allows nothing
    x = jnp.asarray(x)
    got = np.asarray(jax.jit(sampling.logsumexp)(x))
    want = np.asarray(jax.nn.logsumexp(x, axis=-1))
    assert got[5] == -np.inf
    np.testing.assert_allclose(np.delete(got, 5), np.delete(want, 5), rtol=1e-6)
    alone = np.asarray(jax.jit(sampling.logsumexp)(x[7:8]))
    fused = jax.jit(lambda a: sampling.logsumexp(a.reshape(11, 3, -1).reshape(33, -1) * 1.0)
                    + 0.0)(x)
    assert alone[0] == got[7] == np.asarray(fused)[7]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="native CPU kernel")
def test_logsumexp_default_path_is_the_native_kernel_with_edge_rows():
    """On CPU every log-sum-exp (the emitted tokens' logprobs, not only the batch-invariant
    mode's) is the native kernel's, spread over threads: bitwise the kernel's own values, equal
    to jax.nn.logsumexp to 1e-6 relative on a vocabulary that is not a multiple of 16, and a
    NaN row gives NaN, a +inf entry +inf, an all -inf row -inf."""
    from llmserve.ops import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    rng = np.random.default_rng(1)
    x = rng.standard_normal((40, 1003)).astype(np.float32) * 8
    x[1, 500] = np.nan
    x[2, 7] = np.inf
    x[3] = -np.inf
    x = jnp.asarray(x)
    plain = np.asarray(jax.jit(sampling.logsumexp)(x))
    native = np.asarray(jax.jit(cpu_kernels.row_logsumexp_cpu)(x))
    np.testing.assert_array_equal(plain, native)
    assert np.isnan(plain[1]) and plain[2] == np.inf and plain[3] == -np.inf
    want = np.asarray(jax.nn.logsumexp(x, axis=-1))
    np.testing.assert_allclose(plain[4:], want[4:], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(jax.jit(sampling.logsumexp)(x[17:18]))[0], plain[17])


@pytest.mark.parametrize("kind", ["normal", "ties", "few_finite"])
@pytest.mark.parametrize("shape", [(10, 49152), (2, 5, 49152), (3, 4096), (2, 1000)])
def test_top_k_equals_lax_top_k(kind, shape):
    """The two-stage top-k (block maxima, then the best blocks' entries) returns exactly
    jax.lax.top_k's values and indices: descending, equal values in index order (many ties:
    values from 7 integers), rows with only a few finite entries, and a vocabulary that is not
    a multiple of the block (the direct path)."""
    rng = np.random.default_rng(len(shape) + shape[-1])
    if kind == "normal":
        x = rng.standard_normal(shape).astype(np.float32)
    elif kind == "ties":
        x = rng.integers(0, 7, shape).astype(np.float32)
    else:
        x = np.full(shape, -np.inf, np.float32)
        x[..., rng.integers(0, shape[-1], 3)] = rng.standard_normal(3)
    for k in (1, 2, 5, 20):
        vals, ids = jax.jit(sampling.top_k, static_argnums=1)(jnp.asarray(x), k)
        want_vals, want_ids = jax.lax.top_k(jnp.asarray(x), k)
        np.testing.assert_array_equal(np.asarray(vals), np.asarray(want_vals))
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
        assert ids.dtype == jnp.int32


# ------------------------------------------------------------------------- native row argmax
@pytest.mark.parametrize("b,v", [(1, 49152), (10, 49152), (33, 1000), (3, 17), (4, 1), (6, 31)])
def test_native_row_argmax_equals_jnp_argmax(b, v):
    """The native greedy argmax (one pass per row, rows over the thread pool) against
    jnp.argmax on random rows with ties (the first index wins), a NaN (its first index wins,
    as jnp.argmax), an all -inf row (index 0) and vocabularies that are not a multiple of the
    16-lane vector (the masked tail)."""
    from llmserve.ops import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    rng = np.random.default_rng(b * 1000 + v)
    x = rng.standard_normal((b, v)).astype(np.float32)
    x[0, v // 2] = 50.0
    if v > 3:
        x[-1, 1] = x[-1, v - 1] = x[-1, 2] = 60.0  # a three-way tie
    if b > 2:
        x[1] = -np.inf
    if b > 3:
        x[2, v - 1] = np.nan
        x[2, 0] = 1e30
        x[3, : v // 2] = x[3, v // 2:][: v // 2]  # duplicated halves: the first copy wins
    got = np.asarray(jax.jit(cpu_kernels.row_argmax_cpu)(x))
    np.testing.assert_array_equal(got, np.asarray(cpu_kernels.row_argmax_reference(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


def test_greedy_argmax_runs_the_native_kernel_on_cpu():
    """sampling.argmax (the greedy token of ``sample`` and of the verifier) lowers to the
    native kernel on CPU and gives jnp.argmax's tokens through ``sample``."""
    from llmserve.ops import cpu_kernels

    if jax.default_backend() != "cpu" or not cpu_kernels.available():
        pytest.skip("the native kernels run on CPU only")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 300)), jnp.float32)
    assert "llmserve_row_argmax_cpu" in jax.jit(sampling.argmax).lower(x).as_text()
    arrays = SamplingArrays.neutral(5)
    out = jax.jit(lambda x: sampling.sample(x, arrays, jnp.zeros(5, jnp.int32)))(x)
    np.testing.assert_array_equal(out.tokens, np.argmax(np.asarray(x), axis=-1))


# ------------------------------------------------------------------------- native sampling
def _jit_paths(monkeypatch, fn, **kw):
    """fn jitted twice: traced with the native kernel (the CPU default) and with the jnp path."""
    native = jax.jit(lambda *a: fn(*a), **kw)  # distinct callables: distinct trace caches
    plain = jax.jit(lambda *a: fn(*a), **kw)

    def run_native(*args):
        with monkeypatch.context() as m:
            m.delenv("LLMSERVE_NATIVE_SAMPLING", raising=False)
            return native(*args)

    def run_plain(*args):
        with monkeypatch.context() as m:
            m.setenv("LLMSERVE_NATIVE_SAMPLING", "0")
            return plain(*args)

    run_native.lower = native.lower
    return run_native, run_plain


@pytest.mark.parametrize("v", [64, 1003, 49152])
def test_native_sampling_matches_the_jnp_path_and_vllm(monkeypatch, v):
    """On CPU the filters and the draw run in ``cpu_kernels.sample_cpu`` (radix selection, not
    bisection). Against the jnp path, the oracle, on random rows of SmolLM2's vocabulary, one not
    a multiple of the 16-lane vector, and a small one: the same kept tokens with the same
    values for every mix of temperature, top-k (off, 1, V - 1, V, > V), top-p (off, 0, random),
    min-p and greedy rows, rows with many ties at the k-th value and -inf entries; both agree
    with the numpy vLLM reference; the same drawn tokens for the same seeds and positions, each
    among the kept ones; and the kernel is what the jitted functions run."""
    from llmserve.ops import cpu_kernels

    if jax.default_backend() != "cpu" or not cpu_kernels.available():
        pytest.skip("the native kernels run on CPU only")
    rng = np.random.default_rng(v)
    b = 24
    logits = (rng.standard_normal((b, v)) * rng.uniform(0.5, 4, (b, 1))).astype(np.float32)
    logits[0] = rng.integers(0, 7, v)  # many ties
    logits[1, ::3] = -np.inf
    temp = rng.uniform(0.3, 2.0, b)
    k = rng.integers(1, min(v, 200), b)
    k[:6] = [5, 0, 1, v - 1, v, v + 7]
    p = rng.uniform(0.05, 1.0, b)
    p[6:10] = [1.0, 0.0, 0.9, 1.0]
    k[6:10] = [0, 0, 0, 40]
    min_p = np.where(rng.random(b) < 0.25, rng.uniform(0.01, 0.3, b), 0.0)
    p[0], min_p[0] = 1.0, 0.0
    # One token 10 nats above a flat rest: the top-k / top-p window around the maximum holds
    # too few tokens (k = 5) or too little mass (p = 0.9 at V = 49152), so the kernel selects
    # over the whole row.
    for i, (ki, pi) in ((10, (0, 0.9)), (12, (5, 1.0))):
        logits[i] = 0.0
        logits[i, 3] = 10.0
        temp[i], k[i], p[i], min_p[i] = 1.0, ki, pi, 0.0
    rows = [{"temperature": float(temp[i]), "top_k": int(k[i]), "top_p": float(p[i]),
             "min_p": float(min_p[i]), "seed": 100 + i} for i in range(b)]
    for i in (11, 17):
        rows[i] = {"top_k": 3, "top_p": 0.5, "seed": i}  # greedy rows: untouched
    arrays = _arrays(rows)
    x = jnp.asarray(logits)

    native, plain = _jit_paths(monkeypatch, sampling.process_logits)
    got, want = np.asarray(native(x, arrays)), np.asarray(plain(x, arrays))
    assert "llmserve_sample_cpu" in native.lower(x, arrays).as_text()
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_array_equal(got, want)
    sampled = [i for i in range(b) if i not in (11, 17)]
    kept = np.isfinite(got).sum(-1)
    assert kept[7] == 1 and kept[2] == 1 and kept[6] == v and kept[sampled].min() >= 1
    assert kept[0] == (logits[0] >= np.sort(logits[0])[-5]).sum() > 5  # ties at the 5th kept
    assert kept[12] == v and kept[10] == (v if v == 49152 else 1)  # e^-10 * 49151 > 2
    # vLLM's top-k / top-p on the scaled logits (rows without min-p).
    scaled = logits / temp[:, None].astype(np.float32)
    ref = np.isfinite(_np_top_k_top_p(scaled, k, p))
    # (Row 10's top-p cut falls inside 49,151 tied logits: vLLM's sort keeps part of the tie,
    # llmserve keeps ties together, as its top-k does.)
    plain_rows = [i for i in sampled if min_p[i] == 0.0 and i != 10]
    np.testing.assert_array_equal(np.isfinite(got[plain_rows]), ref[plain_rows])
    np.testing.assert_array_equal(got[[11, 17]], logits[[11, 17]])

    # Signed zeros tie as floats do: top-4 of [1, 1, 0, -0, 0, -0, -1] keeps every zero.
    row = jnp.asarray([[1.0, 1.0, 0.0, -0.0, 0.0, -0.0, -1.0]], jnp.float32)
    _, thresh = jax.jit(cpu_kernels.sample_cpu, static_argnames="draw")(
        row, jnp.ones(1), jnp.full(1, 4, jnp.int32), jnp.ones(1), jnp.zeros(1), jnp.zeros(1),
        draw=False)
    assert float(thresh[0]) == 0.0 and int((row[0] >= thresh[0]).sum()) == 6

    def draw(x, arrays, positions):
        return sampling.sample(x, arrays, positions).tokens

    native, plain = _jit_paths(monkeypatch, draw)
    for _ in range(3):
        pos = jnp.asarray(rng.integers(0, 1000, b), jnp.int32)
        tokens = np.asarray(native(x, arrays, pos))
        np.testing.assert_array_equal(tokens, np.asarray(plain(x, arrays, pos)))
        assert np.isfinite(got[np.arange(b), tokens]).all()
        np.testing.assert_array_equal(tokens[[11, 17]], logits[[11, 17]].argmax(-1))
