"""Training an EAGLE draft head on target features (optax + Orbax via ``loop.train``).

* ``target_features``: the frozen target over padded sequences -> per position its feature
  h_p (last layer before the final norm) and its greedy next token (argmax of its logits).
* ``eagle_rows``: a dict of [N, T] rows for ``TokenDataset`` (features stored as bf16 bits).
* ``make_eagle_train_step``: the jitted step (dense "reference" attention, the same function
  as the engine's paged forward). Loss (EAGLE-1): smooth-L1((f_p - h_p) / rms(h)) (mean over
  D; rms over the batch's real positions, so the weights do not depend on the feature scale) +
  ``ce_weight`` * cross-entropy of the draft logits against the target's greedy next token
  (positions whose token is outside the draft vocabulary count for the regression only).
  ``noise`` adds U(-noise, noise) * rms(h) to the input features (EAGLE's augmentation);
  ``self_feed`` adds a second pass whose input features are the head's own (stop-gradient)
  predictions, as in the chain at drafting time.
* ``chain_acceptance``: held-out greedy acceptance of R chained drafts, teacher-forced along
  the target's greedy text, run through the engine-time ``eagle_propose``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from llmserve.config import ModelConfig
from llmserve.kv_cache import AttentionMetadata, DenseKVCache
from llmserve.model import Transformer
from llmserve.ops.paged_attention import BF16_BITS
from llmserve.sampling import SamplingArrays
from llmserve.speculative import eagle
from llmserve.training import losses
from llmserve.training.step import TrainState

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class EagleLossConfig:
    """Weights of the EAGLE loss (see the module docstring)."""

    ce_weight: float = 0.1
    noise: float = 0.0  # uniform feature noise, in units of the batch's feature rms
    self_feed: bool = False
    smooth_l1_beta: float = 1.0

    def __post_init__(self):
        for name in ("ce_weight", "noise"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"EagleLossConfig.{name} must be >= 0, got "
                                 f"{getattr(self, name)!r}")
        if not self.smooth_l1_beta > 0:
            raise ValueError(f"EagleLossConfig.smooth_l1_beta must be > 0, got "
                             f"{self.smooth_l1_beta!r}")


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float array -> its bf16 bit patterns (uint16): half the bytes, numpy-storable."""
    return np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.bfloat16), BF16_BITS))


def from_bf16_bits(x) -> Array:
    """uint16 bf16 bits -> float32."""
    return jax.lax.bitcast_convert_type(jnp.asarray(x), jnp.bfloat16).astype(jnp.float32)


def target_features(cfg: ModelConfig, params, seqs: Sequence[Sequence[int]], seq_len: int, *,
                    batch_size: int = 8, backend: str = "reference",
                    progress: bool = False) -> dict:
    """The target over each sequence (truncated / right-padded to seq_len): {"tokens" [N, T]
    int32, "features" [N, T, D] bf16 bits (h_p), "top1" [N, T] int32 (argmax of its logits at
    p: its greedy token for p + 1), "mask" [N, T] f32 (real tokens)}."""
    from tqdm.auto import tqdm

    @jax.jit
    def run(p, tokens):
        b, t = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        meta = AttentionMetadata.for_dense(pos, jnp.full((b,), t, jnp.int32))
        cache = DenseKVCache.create(cfg, b, t)
        logits, _, hidden = Transformer(cfg).apply({"params": p}, tokens, meta, cache,
                                                   backend=backend, return_hidden=True)
        return hidden.astype(jnp.bfloat16), jnp.argmax(logits, axis=-1).astype(jnp.int32)

    n = len(seqs)
    tokens = np.zeros((n, seq_len), np.int32)
    mask = np.zeros((n, seq_len), np.float32)
    for i, s in enumerate(seqs):
        s = list(s)[:seq_len]
        tokens[i, :len(s)] = s
        mask[i, :len(s)] = 1.0
    feats, top1 = [], []
    for start in tqdm(range(0, n, batch_size), desc="target features", disable=not progress):
        chunk = tokens[start:start + batch_size]
        pad = batch_size - len(chunk)  # one compiled shape
        if pad:
            chunk = np.concatenate([chunk, np.zeros((pad, seq_len), np.int32)])
        h, t1 = run(params, jnp.asarray(chunk))
        feats.append(np.asarray(jax.lax.bitcast_convert_type(h, BF16_BITS))[:batch_size - pad])
        top1.append(np.asarray(t1)[:batch_size - pad])
    return {"tokens": tokens, "features": np.concatenate(feats), "top1": np.concatenate(top1),
            "mask": mask}


def eagle_rows(feats: dict, vocab_map: np.ndarray, vocab_size: int) -> dict:
    """Training rows from ``target_features``: adds "inputs" (= tokens, the name ``loop.train``
    reads) and "top1_draft" [N, T] (the draft-vocab index of top1, -1 outside it). The last
    real position has no next token: masked out of the CE."""
    index = np.full(vocab_size, -1, np.int32)
    index[np.asarray(vocab_map)] = np.arange(len(vocab_map), dtype=np.int32)
    top1_draft = index[feats["top1"]]
    last = np.zeros_like(feats["mask"])
    lengths = feats["mask"].sum(1).astype(np.int64)
    rows = np.arange(len(lengths))
    last[rows[lengths > 0], lengths[lengths > 0] - 1] = 1.0
    top1_draft = np.where(last > 0, -1, top1_draft)
    return dict(feats, inputs=feats["tokens"], top1_draft=top1_draft.astype(np.int32))


def shift_features(h: Array) -> Array:
    """h [B, T, D] (h_0..h_{T-1}) -> head input features [0, h_0, .., h_{T-2}]."""
    return jnp.pad(h[:, :-1], ((0, 0), (1, 0), (0, 0)))


def _smooth_l1(x: Array, beta: float) -> Array:
    a = jnp.abs(x)
    return jnp.where(a < beta, 0.5 * a * a / beta, a - 0.5 * beta)


def eagle_loss(params, frozen: dict, batch: dict, key: Array, *, ecfg: eagle.EagleConfig,
               loss: EagleLossConfig, backend: str = "reference") -> tuple[Array, dict]:
    """(scalar loss, metrics) for one batch; frozen = {"embed", "norm", "vocab_map"}."""
    h = from_bf16_bits(batch["features"])  # [B, T, D]
    mask = batch["mask"]
    ce_mask = mask * (batch["top1_draft"] >= 0)
    target = jnp.maximum(batch["top1_draft"], 0)
    feats = shift_features(h)
    # SmolLM2's features have rms ~60 with outlier dims ~800: the regression is measured in
    # units of the batch's feature rms so its weight against the CE does not depend on it.
    rms = jnp.sqrt(losses.masked_mean(jnp.mean(jnp.square(h), -1), mask) + 1e-6)
    if loss.noise > 0:
        feats = feats + rms * loss.noise * jax.random.uniform(key, feats.shape, jnp.float32,
                                                              -1.0, 1.0)

    def terms(feats):
        f, logits = eagle.eagle_forward_dense(params, frozen["embed"], frozen["norm"],
                                              frozen["vocab_map"], feats, batch["inputs"],
                                              ecfg=ecfg, backend=backend)
        reg = losses.masked_mean(jnp.mean(_smooth_l1((f - h) / rms, loss.smooth_l1_beta), -1),
                                 mask)
        ce = losses.cross_entropy(logits, target, ce_mask)
        hit = (jnp.argmax(logits, -1) == batch["top1_draft"]).astype(jnp.float32)
        return f, reg, ce, losses.masked_mean(hit, mask)

    f, reg, ce, acc = terms(feats)
    value = reg + loss.ce_weight * ce
    metrics = {"reg": reg, "ce": ce, "accuracy": acc}
    if loss.self_feed:
        _, reg2, ce2, acc2 = terms(shift_features(jax.lax.stop_gradient(f)))
        value = value + reg2 + loss.ce_weight * ce2
        metrics.update(reg_self=reg2, ce_self=ce2, accuracy_self=acc2)
    return value, metrics


def make_eagle_train_step(ecfg: eagle.EagleConfig, optimizer: optax.GradientTransformation,
                          loss: EagleLossConfig = EagleLossConfig(), *,
                          schedule: Optional[optax.Schedule] = None, seed: int = 0,
                          backend: str = "reference"):
    """Jitted ``step(state, batch, frozen, _unused) -> (state, metrics)`` for ``loop.train``.

    frozen: {"embed": E [V, D], "norm": final-norm scale [D], "vocab_map": [Vd] int32}. The
    state is donated; the noise key is fold_in(PRNGKey(seed), step), so a resumed run repeats
    the same draws. Metrics: loss, reg, ce, accuracy (top-1 == target's greedy token), (the
    self-fed terms), grad_norm, lr, tokens.
    """
    fn = functools.partial(eagle_loss, ecfg=ecfg, loss=loss, backend=backend)

    @functools.partial(jax.jit, donate_argnames=("state",))
    def step(state: TrainState, batch, frozen, teacher_params=None):
        del teacher_params
        key = jax.random.fold_in(jax.random.PRNGKey(seed), state.step)
        (value, metrics), grads = jax.value_and_grad(fn, has_aux=True)(state.params, frozen,
                                                                       batch, key)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics, loss=value, grad_norm=optax.tree.norm(grads),
                       tokens=jnp.sum(batch["mask"]))
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return step


def chain_acceptance(ecfg: eagle.EagleConfig, head_params, target_embed, target_norm,
                     vocab_map, feats: dict, starts: Sequence[int], *, num_draft: int = 4,
                     page_size: int = 16, backend: str = "xla") -> dict:
    """Greedy acceptance of R = num_draft chained drafts along the target's greedy text.

    feats: ``target_features`` of prompt + greedy continuation (N rows); starts[i]: the length
    of row i's prompt. For every continuation position c (c from starts[i] to the text's end),
    the head sees the true prefix (features of the target, fed as the engine feeds its tail),
    then ``eagle_propose`` drafts R tokens for positions c..c+R-1; a draft counts while it
    equals the text's token (the target's greedy choice), capped at the text's end. Rows run
    as a batch, one position per call, exactly as the engine streams.

    Returns {"accepted": [N] lists of a_c, "per_position": acceptance of draft j given drafts
    < j accepted, "cumulative": P(a > j), "mean_accepted_len", "tokens_per_step" (simulated
    greedy decode), ...}.
    """
    tokens, mask = feats["tokens"], feats["mask"]
    h = np.asarray(from_bf16_bits(feats["features"]))  # [N, T, D]
    n, t = tokens.shape
    lengths = mask.sum(1).astype(np.int32)
    starts = np.asarray(starts, np.int32)
    pages_per_row = -(-(t + num_draft + 1) // page_size)
    tables = 1 + np.arange(n * pages_per_row, dtype=np.int32).reshape(n, pages_per_row)
    cache = eagle.create_cache(ecfg, 1 + n * pages_per_row, page_size)
    hin = np.concatenate([np.zeros_like(h[:, :1]), h[:, :-1]], axis=1)  # input features
    arrays = SamplingArrays.neutral(n)
    args = (head_params, target_embed, target_norm, jnp.asarray(vocab_map))
    kw = dict(ecfg=ecfg, num_draft=num_draft, backend=backend, with_probs=False)
    # Call 0: inputs for output positions 0..c0-1 (tail of the prompt); draft 0 sits at c0.
    p0 = int(starts.max())
    feat0 = np.zeros((n, p0, h.shape[-1]), np.float32)
    tok0 = np.zeros((n, p0), np.int32)
    for i in range(n):
        feat0[i, :starts[i]] = hin[i, :starts[i]]
        tok0[i, :starts[i]] = tokens[i, :starts[i]]
    out, cache = eagle.eagle_propose(*args, cache, jnp.asarray(feat0), jnp.asarray(tok0),
                                     jnp.zeros(n, jnp.int32), jnp.asarray(starts),
                                     jnp.asarray(tables), arrays, **kw)
    accepted: list[list[int]] = [[] for _ in range(n)]
    pos = starts.copy()  # where draft 0 of this call sits

    def record(drafts):
        for i in range(n):
            c = int(pos[i])
            if c >= lengths[i]:
                continue
            a = 0
            while a < num_draft and c + a < lengths[i] and drafts[i, a] == tokens[i, c + a]:
                a += 1
            accepted[i].append(a)

    record(np.asarray(out.tokens))
    while np.any(pos + 1 < lengths):
        live = pos + 1 < lengths
        # Commit the text's token at pos: the head's input (h_pos-1, x_pos) -> output pos.
        rows = np.arange(n)
        c = np.minimum(pos, t - 1)
        feat = hin[rows, c][:, None].astype(np.float32)
        tok = tokens[rows, c][:, None]
        out, cache = eagle.eagle_propose(*args, cache, jnp.asarray(feat), jnp.asarray(tok),
                                         jnp.asarray(np.where(live, pos, 0)),
                                         jnp.asarray(live.astype(np.int32)),
                                         jnp.asarray(tables), arrays, **kw)
        done = ~live  # rows already at their text's end record nothing more
        pos = np.where(live, pos + 1, lengths)
        drafts = np.where(done[:, None], -1, np.asarray(out.tokens))
        record(drafts)
    return acceptance_summary(accepted, num_draft)


def acceptance_summary(accepted: Sequence[Sequence[int]], num_draft: int) -> dict:
    """Per-position and mean acceptance from per-start accepted counts a (0..R)."""
    flat = np.asarray([a for row in accepted for a in row], np.int64)
    if flat.size == 0:
        raise ValueError("acceptance_summary: no positions")
    cumulative = [float(np.mean(flat > j)) for j in range(num_draft)]  # P(a > j)
    per_position = [cumulative[0]] + [cumulative[j] / max(cumulative[j - 1], 1e-12)
                                      for j in range(1, num_draft)]
    steps = []
    for row in accepted:  # simulated greedy decode: accept a, the target adds one, jump
        i = 0
        while i < len(row):
            steps.append(row[i])
            i += row[i] + 1
    return {"num_draft": num_draft, "num_positions": int(flat.size),
            "per_position": per_position, "cumulative": cumulative,
            "mean_accepted_len": float(flat.mean()),
            "tokens_per_step": float(np.mean(steps) + 1.0),
            "accepted": [list(map(int, r)) for r in accepted]}
