"""Sampling: logits + per-slot parameter arrays + keys -> tokens, logprobs (vLLM semantics).

Everything here is a pure, jittable function of fixed-shape arrays. Sampling parameters are
per-slot arrays ([B]) inside ``SamplingArrays``, so changing a temperature or a top-k never
recompiles. Letters as in ``model.py``: B slots, V vocab.

Pipeline (the order of vLLM):
  penalties (repetition, frequency, presence) -> temperature -> top-k -> top-p -> min-p
  -> greedy argmax (temperature 0) or a categorical draw with the request's own key.

XLA:CPU shapes the implementation (measured on [32, 49152]): a sort costs ~0.5 s, a threefry
draw of [B, V] noise ~20 ms, a variadic argmax ~8 ms, while a plain reduction is ~0.3 ms. So
top-k / top-p thresholds are found by bisection (exact, no sort), the categorical draw is a
two-level inverse CDF on one uniform per row, and argmax is two float reductions. On CPU the
native kernel (``cpu_kernels.sample_cpu``, see ``native_sampling``) replaces the filters and the
draw: thresholds by radix selection, a few passes per row (``sample`` on 256 rows of 49,152
logits: top-p 0.9 268 -> 15 ms, top-k 50 192 -> 14, temperature alone 33 -> 8;
``python -m experiments.sampler``); the jnp path is its oracle and what other platforms run.

The expensive stages sit behind ``lax.cond`` on "does any row need it", so an all-greedy
batch without penalties costs one argmax and one log-softmax per step:
  * penalties are skipped when every row is neutral;
  * the top-k / top-p bisection runs only when a sampled (non-greedy) row asks for it;
  * temperature, filters and the draw run only when some row samples.

Randomness is pure: a row's key is ``fold_in(PRNGKey(seed), position)``, so a request's tokens
depend on its seed and positions only, never on which other requests share the batch.
"""

from __future__ import annotations

import os

import flax
import jax
import jax.numpy as jnp

from llmserve.sampling_params import NEUTRAL, SamplingArrays  # noqa: F401 (re-exported)

Array = jax.Array

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS).
GREEDY_EPS = 1e-5

# SamplingArrays is a host type (numpy, llmserve.sampling_params): a pytree from here on.
jax.tree_util.register_dataclass(SamplingArrays)


@flax.struct.dataclass
class SampleOutput:
    """What `sample` returns; logprobs are of the raw (unprocessed) model distribution."""

    tokens: Array  # [B] i32
    logprobs: Array  # [B] f32, log p_raw(token)
    top_ids: Array  # [B, n] i32, the n most likely raw tokens (n = num_logprobs)
    top_logprobs: Array  # [B, n] f32


def _is_greedy(arrays: SamplingArrays) -> Array:
    return arrays.temperature < GREEDY_EPS  # [B] bool


def apply_penalties(
    logits: Array, arrays: SamplingArrays, output_counts: Array, prompt_mask: Array
) -> Array:
    """Repetition, frequency and presence penalties (vLLM rules), unconditionally.

    logits [B, V] f32; output_counts [B, V] i32 (times each token was generated);
    prompt_mask [B, V] bool (token occurs in the prompt). Returns [B, V] f32.

    Repetition (HF/vLLM): a token seen in the prompt or the output has its logit divided by rp
    when positive and multiplied by rp otherwise. Frequency and presence count OUTPUT tokens only:
    logit -= fp * count + pp * (count > 0).
    """
    logits = logits.astype(jnp.float32)
    in_output = output_counts > 0  # [B, V]
    seen = in_output | prompt_mask
    rp = arrays.repetition_penalty[:, None]  # [B, 1]
    penalized = jnp.where(logits > 0, logits / rp, logits * rp)
    logits = jnp.where(seen, penalized, logits)
    logits = logits - arrays.frequency_penalty[:, None] * output_counts.astype(jnp.float32)
    return logits - arrays.presence_penalty[:, None] * in_output.astype(jnp.float32)


def _maybe_penalize(
    logits: Array, arrays: SamplingArrays, output_counts: Array | None, prompt_mask: Array | None,
    history: tuple[Array, Array, Array] | None = None,
) -> Array:
    """apply_penalties behind a cond, skipped when no row has a penalty (or no history given).

    ``history`` = (counts table [S, V], prompt-mask table [S, V], rows [B]): the rows are gathered
    inside the cond, so a step without penalties never reads the [B, V] history at all.
    """
    return _penalized_then(lambda x: x, logits, arrays, output_counts, prompt_mask, history)


def _penalized_then(fn, logits: Array, arrays: SamplingArrays, output_counts: Array | None,
                    prompt_mask: Array | None,
                    history: tuple[Array, Array, Array] | None = None):
    """fn(the penalized logits), with apply_penalties behind a cond as in ``_maybe_penalize``.

    fn runs inside both branches, so when it returns [B]-sized results (``sample``'s tokens)
    the cond never outputs a [B, V] copy of the logits (XLA:CPU copies a branch's [B, V]
    result; ``sample`` alone at 32 rows: 1.2 -> 0.8 ms with the native argmax)."""
    logits = logits.astype(jnp.float32)
    if history is not None:
        if output_counts is not None or prompt_mask is not None:
            raise ValueError("pass either history or output_counts/prompt_mask, not both")
        counts_table, mask_table, rows = history
        gather = lambda: (counts_table[rows], mask_table[rows])  # noqa: E731  (inside the cond)
    elif output_counts is None and prompt_mask is None:
        return fn(logits)
    else:
        counts = jnp.zeros(logits.shape, jnp.int32) if output_counts is None else output_counts
        mask = jnp.zeros(logits.shape, jnp.bool_) if prompt_mask is None else prompt_mask
        gather = lambda: (counts, mask)  # noqa: E731
    active = (
        (arrays.repetition_penalty != 1.0)
        | (arrays.frequency_penalty != 0.0)
        | (arrays.presence_penalty != 0.0)
    )
    return jax.lax.cond(
        jnp.any(active),
        lambda x: fn(apply_penalties(x, arrays, *gather())),
        fn,
        logits,
    )


def argmax(x: Array) -> Array:
    """First index of the row maximum, [B, V] -> [B] i32.

    Same result as jnp.argmax. On CPU, the native kernel (``cpu_kernels.row_argmax_cpu``: one
    pass per row, 0.04 against 0.19 ms for a verify step's 10 rows of 49,152 logits, jitted
    alone); elsewhere two plain float reductions: XLA:CPU's variadic (value,
    index) reduce is several times slower on [32, 49152].
    """
    if x.ndim == 2 and x.shape[-1] and jax.default_backend() == "cpu":
        from llmserve.ops import cpu_kernels

        if cpu_kernels.available():
            return cpu_kernels.row_argmax_cpu(x.astype(jnp.float32))
    top = jnp.max(x, axis=-1, keepdims=True)  # [B, 1]
    iota = jnp.arange(x.shape[-1], dtype=jnp.float32)  # exact for V < 2**24
    return jnp.min(jnp.where(x == top, iota, jnp.inf), axis=-1).astype(jnp.int32)


TOP_K_BLOCK = 128  # vocabulary entries per block of top_k's first stage


def top_k(x: Array, k: int) -> tuple[Array, Array]:
    """The k largest entries of each row of x [..., V] and their indices, like jax.lax.top_k
    (descending; equal values in index order), in two stages on CPU.

    XLA:CPU's TopK over SmolLM2's 49,152-entry vocabulary costs ~0.1 ms a row (1 ms for a verify
    step's 10 rows). Here: the maximum of each block of TOP_K_BLOCK entries (one plain reduce),
    the k best blocks (TopK over V / 128), then TopK over those blocks' entries gathered in
    vocabulary order. Exact: a block holding one of the k largest entries has a maximum that no
    k other blocks' maxima precede (each would be an entry ahead of it). Other platforms, or a
    V that is not a multiple of the block, take jax.lax.top_k directly.
    """
    v = x.shape[-1]
    blocks = v // TOP_K_BLOCK
    if jax.default_backend() != "cpu" or v % TOP_K_BLOCK or blocks < 4 * k:
        return jax.lax.top_k(x, k)
    lead = x.shape[:-1]
    xb = x.reshape(lead + (blocks, TOP_K_BLOCK))
    _, best = jax.lax.top_k(jnp.max(xb, axis=-1), k)  # [..., k] block ids
    best = jnp.sort(best, axis=-1)  # vocabulary order: ties resolve as in one TopK
    cand = jnp.take_along_axis(xb, best[..., None], axis=-2)  # [..., k, block]
    vals, pos = jax.lax.top_k(cand.reshape(lead + (k * TOP_K_BLOCK,)), k)
    ids = jnp.take_along_axis(best, pos // TOP_K_BLOCK, axis=-1) * TOP_K_BLOCK + pos % TOP_K_BLOCK
    return vals, ids.astype(jnp.int32)


def logsumexp(x: Array) -> Array:
    """Row log-sum-exp [B, V] -> [B] for finite rows (raw model logits); cheaper than jax.nn's.

    On CPU, always the native kernel (``cpu_kernels.row_logsumexp_cpu``): every row reduced in
    the same order whatever program it sits in (XLA:CPU's exp and sum differ by an ulp between
    fusions, e.g. a decode step's and a verify step's), over both cores, and faster than
    XLA:CPU's fusion (rows of 49,152 logits jitted alone: 0.44 vs 1.03 ms at 32 rows, 4.0 vs
    38.6 ms at 256, ``/tmp`` script, 2026-12-06), so the batch-invariant mode needs no path
    of its own. Other platforms take the plain path.
    """
    if x.ndim == 2 and x.shape[-1] and jax.default_backend() == "cpu":
        from llmserve.ops import cpu_kernels

        if cpu_kernels.available():
            return cpu_kernels.row_logsumexp_cpu(x.astype(jnp.float32))
    top = jnp.max(x, axis=-1)  # [B]
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    return top + jnp.log(jnp.sum(jnp.exp(x - top[:, None]), axis=-1))


def _f32_to_key(x: Array) -> Array:
    """Order-preserving map f32 -> u32 (x < y  <=>  key(x) < key(y), for non-NaN x, y)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _key_to_f32(k: Array) -> Array:
    """Inverse of _f32_to_key."""
    bits = jnp.where(k >> 31 == 1, k & jnp.uint32(0x7FFFFFFF), ~k)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _bisect(pred, lo: Array, hi: Array, done: Array) -> Array:
    """Largest u32 key t in [lo, hi) with pred(t) true, per row ([B] each); pred monotone.

    pred(t [B] f32 thresholds) -> (ok [B] bool, finished [B] bool). Invariant: pred(lo) holds and
    pred(hi) does not. A row stops when its interval is one key wide or pred says the kept set
    {x >= lo} can no longer change; at most 32 rounds, each one pass over [B, V].
    """

    def cond(state):
        return ~jnp.all(state[2])

    def body(state):
        lo, hi, done = state
        mid = lo + (hi - lo) // 2
        ok, finished = pred(_key_to_f32(mid))
        lo = jnp.where(ok & ~done, mid, lo)
        hi = jnp.where(~ok & ~done, mid, hi)
        done = done | (hi - lo <= 1) | (ok & finished)
        return lo, hi, done

    lo, _, _ = jax.lax.while_loop(cond, body, (lo, hi, done | (hi - lo <= 1)))
    return lo


def _top_k_top_p(logits: Array, top_k: Array, top_p: Array, active: Array) -> Array:
    """Masks to -inf what top-k and then top-p drop; rows with active=False pass unchanged.

    Exact thresholds by bisection on the (order-preserving integer) bits of the values, not a
    sort: XLA:CPU sorts [32, 49152] in ~0.5 s, while a bisection round is one ~1 ms pass.
      top-k: t_k = the k-th largest value; keep x >= t_k (ties kept, as vLLM).
      top-p: over the survivors, keep the smallest top set whose mass reaches p, i.e. keep x >= t
        for the largest t with mass(x >= t) >= p * mass(x >= t_k) (ties at t kept together).
    """
    vocab = logits.shape[-1]
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)  # [B]
    row_min = jnp.min(logits, axis=-1)  # [B]
    row_max = jnp.max(logits, axis=-1)
    lo = _f32_to_key(row_min)
    hi = _f32_to_key(row_max) + 1

    def count_at_least_k(t):  # count(x >= t) >= k; finished when the count is exactly k
        count = jnp.sum(jnp.where(logits >= t[:, None], 1.0, 0.0), axis=-1)
        return count >= k, count == k

    t_k = _bisect(count_at_least_k, lo, hi, ~active | (k == vocab))

    # e(max) = 1, so the mass of any non-empty top set is >= 1: a target <= 1 keeps just the
    # top token(s), and 0.5 keeps pred(hi) false (mass 0) when p = 0.
    e = jnp.exp(logits - row_max[:, None])  # [B, V]
    mass_k = jnp.sum(jnp.where(logits >= _key_to_f32(t_k)[:, None], e, 0.0), axis=-1)  # [B]
    target = jnp.maximum(top_p * mass_k, 0.5)

    def mass_reaches_p(t):  # finished when one value is left in [t, hi): nothing to refine
        kept = logits >= t[:, None]
        mass = jnp.sum(jnp.where(kept, e, 0.0), axis=-1)
        return mass >= target, jnp.zeros_like(mass, jnp.bool_)

    t_p = _bisect(mass_reaches_p, t_k, hi, ~active | (top_p >= 1.0))
    thresh = jnp.where(active, _key_to_f32(t_p), -jnp.inf)[:, None]  # [B, 1]
    return jnp.where(logits >= thresh, logits, -jnp.inf)


def _min_p(logits: Array, min_p: Array) -> Array:
    """Keeps tokens with p >= min_p * p_max, compared in log space (normalization cancels)."""
    top = jnp.max(logits, axis=-1, keepdims=True)  # [B, 1]
    floor = top + jnp.log(jnp.maximum(min_p, 0.0))[:, None]  # -inf where disabled
    return jnp.where(logits >= floor, logits, -jnp.inf)


def _filter(scaled: Array, arrays: SamplingArrays) -> Array:
    """Top-k, top-p and min-p on temperature-scaled logits [B, V], each behind a cond."""
    vocab = scaled.shape[-1]
    sampled = ~_is_greedy(arrays)  # greedy rows: the argmax survives every filter anyway
    wants_k = (arrays.top_k > 0) & (arrays.top_k < vocab)
    needs_sort = sampled & (wants_k | (arrays.top_p < 1.0))
    scaled = jax.lax.cond(
        jnp.any(needs_sort),
        lambda x: _top_k_top_p(x, arrays.top_k, arrays.top_p, needs_sort),
        lambda x: x,
        scaled,
    )
    needs_min_p = sampled & (arrays.min_p > 0.0)
    return jax.lax.cond(
        jnp.any(needs_min_p),
        lambda x: _min_p(x, jnp.where(needs_min_p, arrays.min_p, 0.0)),
        lambda x: x,
        scaled,
    )


def native_sampling() -> bool:
    """Whether the filters and the draw run in the native CPU kernel (``cpu_kernels.sample_cpu``):
    on CPU when it is built, unless ``LLMSERVE_NATIVE_SAMPLING=0`` (the jnp path, the oracle).
    Read when a function is traced."""
    if jax.default_backend() != "cpu" or os.environ.get("LLMSERVE_NATIVE_SAMPLING") == "0":
        return False
    from llmserve.ops import cpu_kernels

    return cpu_kernels.available()


def _native_sample(penalized: Array, arrays: SamplingArrays, uniform: Array | None
                   ) -> tuple[Array, Array]:
    """cpu_kernels.sample_cpu on penalized logits: (tokens, thresholds) [B] (greedy rows: 0,
    -inf); ``uniform`` None skips the draw."""
    from llmserve.ops import cpu_kernels

    temp = jnp.where(_is_greedy(arrays), 0.0, arrays.temperature)
    draw = uniform is not None
    uniform = jnp.zeros_like(temp) if uniform is None else uniform
    return cpu_kernels.sample_cpu(penalized, temp, arrays.top_k, arrays.top_p, arrays.min_p,
                                  uniform, draw=draw)


def _scale_and_filter(penalized: Array, arrays: SamplingArrays) -> Array:
    """Temperature (greedy rows left unscaled), then the filters. [B, V] -> [B, V] f32."""
    temp = jnp.where(_is_greedy(arrays), 1.0, arrays.temperature)[:, None]  # [B, 1]
    scaled = penalized / temp
    if native_sampling():  # thresholds in penalized-logit units: no rounding of `scaled` moves them
        _, thresh = _native_sample(penalized, arrays, None)
        return jnp.where(penalized >= thresh[:, None], scaled, -jnp.inf)
    return _filter(scaled, arrays)


def process_logits(
    logits: Array,
    arrays: SamplingArrays,
    output_counts: Array | None = None,
    prompt_mask: Array | None = None,
) -> Array:
    """Penalties -> temperature -> top-k -> top-p -> min-p; dropped tokens become -inf.

    logits [B, V]; returns [B, V] f32, the logits `sample` draws from (softmax of them is the
    sampling distribution of non-greedy rows). Greedy rows are penalized but not scaled or
    filtered (their argmax would survive the filters anyway).
    """
    return _scale_and_filter(_maybe_penalize(logits, arrays, output_counts, prompt_mask), arrays)


def probs_from_logits(
    logits: Array,
    arrays: SamplingArrays,
    output_counts: Array | None = None,
    prompt_mask: Array | None = None,
) -> Array:
    """The exact distribution `sample` draws from: [B, V] f32.

    softmax(process_logits(...)) for sampled rows; a one-hot on the argmax of the penalized
    logits for greedy rows. The speculative verifier takes its p and q from here.
    """
    penalized = _maybe_penalize(logits, arrays, output_counts, prompt_mask)  # [B, V]
    greedy = _is_greedy(arrays)
    one_hot = jax.nn.one_hot(argmax(penalized), penalized.shape[-1], dtype=jnp.float32)

    def mixed(x):
        probs = jax.nn.softmax(_scale_and_filter(x, arrays), axis=-1)
        return jnp.where(greedy[:, None], one_hot, probs)

    return jax.lax.cond(jnp.all(greedy), lambda x: one_hot, mixed, penalized)


_CDF_BLOCK = 256  # tokens per block of the two-level inverse CDF


def _inverse_cdf(logits: Array, uniform: Array) -> Array:
    """Draws from softmax(logits) [B, V] with one uniform [B] per row (see ``draw_from_mass``).

    A threefry draw of [32, 49152] Gumbel noise alone costs ~20 ms on CPU; this is about one pass.
    """
    return draw_from_mass(jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)), uniform)


def draw_from_mass(mass: Array, uniform: Array) -> Array:
    """Draws from unnormalized masses [B, V] (>= 0) with one uniform [B] per row, in two levels.

    Block masses [B, V/256] are cumulated to pick a block, then the 256 token masses inside it:
    no sort and no [B, V] noise. Tokens of mass 0 (logit -inf) are never drawn, even when
    rounding pushes the target past the last positive mass (clamped back to it).
    """
    batch, vocab = mass.shape
    nb = -(-vocab // _CDF_BLOCK)
    mass = jnp.pad(mass, ((0, 0), (0, nb * _CDF_BLOCK - vocab))).reshape(batch, nb, _CDF_BLOCK)
    block_mass = jnp.sum(mass, axis=-1)  # [B, nb]
    block_cum = jnp.cumsum(block_mass, axis=-1)
    target = uniform * block_cum[:, -1]  # [B]
    block = jnp.sum(block_cum <= target[:, None], axis=-1)
    last_block = jnp.max(jnp.where(block_mass > 0, jnp.arange(nb), 0), axis=-1)
    block = jnp.minimum(block, last_block)  # [B]
    inner = jnp.take_along_axis(mass, block[:, None, None], axis=1)[:, 0]  # [B, 256]
    before = jnp.take_along_axis(block_cum - block_mass, block[:, None], axis=-1)[:, 0]
    inner_cum = jnp.cumsum(inner, axis=-1)
    idx = jnp.sum(inner_cum <= (target - before)[:, None], axis=-1)
    last = jnp.max(jnp.where(inner > 0, jnp.arange(_CDF_BLOCK), 0), axis=-1)
    return (block * _CDF_BLOCK + jnp.minimum(idx, last)).astype(jnp.int32)


def request_keys(seed: Array, positions: Array) -> Array:
    """Per-row keys [B, 2] u32: fold_in(PRNGKey(seed), position).

    A request's randomness depends only on its seed and the position of the token being drawn,
    never on the batch it shares or its slot index.
    """
    seed = jnp.asarray(seed).astype(jnp.uint32)
    positions = jnp.asarray(positions).astype(jnp.uint32)
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p))(seed, positions)


def sample(
    logits: Array,
    arrays: SamplingArrays,
    positions: Array,
    output_counts: Array | None = None,
    prompt_mask: Array | None = None,
    *,
    num_logprobs: int = 0,
    history: tuple[Array, Array, Array] | None = None,
    want_top: Array | None = None,
) -> SampleOutput:
    """Draws one token per row.

    logits [B, V]; positions [B] (the position of the token being drawn, for its key).
    Greedy rows take the argmax of the penalized logits; the others draw from
    softmax(process_logits(...)) by inverse CDF on one uniform from
    `request_keys(arrays.seed, positions)`.
    Logprobs are of the RAW model distribution (vLLM's default), and `top_ids`/`top_logprobs`
    hold the num_logprobs (static) best raw tokens, shape [B, 0] when 0 (their log-sum-exp:
    ``logsumexp``, in one fixed order on CPU).
    ``history`` = (counts table, prompt-mask table, rows [B]) instead of ``output_counts`` and
    ``prompt_mask``: the penalty rows are gathered only when some row has a penalty.
    ``want_top`` [B] bool: the top-n search runs only when some row asks for it (zeros else).
    """
    logits = logits.astype(jnp.float32)
    greedy = _is_greedy(arrays)

    def pick(penalized):  # [B, V] -> [B] (inside the penalty cond: no [B, V] result)
        greedy_tokens = argmax(penalized)

        def draw(x):
            uniform = jax.vmap(jax.random.uniform)(request_keys(arrays.seed, positions))  # [B]
            if native_sampling():
                sampled, _ = _native_sample(x, arrays, uniform)
            else:
                sampled = _inverse_cdf(_scale_and_filter(x, arrays), uniform)
            return jnp.where(greedy, greedy_tokens, sampled)

        return jax.lax.cond(jnp.all(greedy), lambda x: greedy_tokens, draw, penalized)

    tokens = _penalized_then(pick, logits, arrays, output_counts, prompt_mask, history)

    lse = logsumexp(logits)  # [B]
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    if num_logprobs > 0:
        def top(x):
            vals, ids = top_k(x, num_logprobs)  # [B, n]
            return vals - lse[:, None], ids.astype(jnp.int32)

        def skip(x):
            return (jnp.zeros((x.shape[0], num_logprobs), jnp.float32),
                    jnp.zeros((x.shape[0], num_logprobs), jnp.int32))

        if want_top is None:
            top_logprobs, top_ids = top(logits)
        else:  # top-k over the vocabulary costs ~2.5 ms at 32 rows: only when asked for
            top_logprobs, top_ids = jax.lax.cond(jnp.any(want_top), top, skip, logits)
    else:
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
        top_logprobs = jnp.zeros((logits.shape[0], 0), jnp.float32)
    return SampleOutput(
        tokens=tokens,
        logprobs=chosen - lse,
        top_ids=top_ids.astype(jnp.int32),
        top_logprobs=top_logprobs,
    )


def update_counts(output_counts: Array, tokens: Array, mask: Array) -> Array:
    """Adds 1 at each live slot's sampled token: counts [B, V] i32, tokens [B], mask [B] bool."""
    rows = jnp.arange(output_counts.shape[0])
    return output_counts.at[rows, tokens].add(mask.astype(output_counts.dtype))
