"""The jitted training step: forward, loss, gradients, AdamW update.

Parameters are split by top-level name into a trainable tree (kept in ``TrainState`` with its
optimizer state) and a frozen tree passed in each call; e.g. a draft that shares the target's
tied embedding / LM head keeps ``{"embed": ...}`` frozen, so no gradient or Adam moment is
ever computed for it. The model is merged back as ``{**frozen, **params}`` inside the step.

Losses (``LossConfig.kind``):
  "ce"       next-token cross-entropy on ``targets`` under ``loss_mask``;
  "distill"  KL from the teacher: ``teacher="online"`` runs the frozen target in the same jitted
             step (full-vocabulary KL); ``teacher="precomputed"`` reads the batch's top-k
             ``teacher_ids`` / ``teacher_logprobs`` (see ``precompute_teacher_topk``).
             ``ce_weight`` optionally adds the hard-target cross-entropy.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from llmserve.config import ModelConfig
from llmserve.kv_cache import AttentionMetadata, DenseKVCache
from llmserve.model import Transformer
from llmserve.training import losses

Array = jax.Array


@flax.struct.dataclass
class TrainState:
    """What a checkpoint holds besides the data position."""

    step: Array  # [] int32: optimizer steps taken
    params: Any  # trainable params (the frozen ones live outside)
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Which loss the step minimizes (see the module docstring)."""

    kind: str = "ce"  # "ce" | "distill"
    direction: str = "forward"  # KL direction for "distill": "forward" | "reverse"
    teacher: str = "online"  # "online" | "precomputed"
    ce_weight: float = 0.0  # extra hard-target cross-entropy weight for "distill"

    def __post_init__(self):
        if self.kind not in ("ce", "distill"):
            raise ValueError(f"LossConfig.kind={self.kind!r}: use 'ce' or 'distill'")
        if self.direction not in losses.KL_DIRECTIONS:
            raise ValueError(f"LossConfig.direction={self.direction!r}: use one of "
                             f"{losses.KL_DIRECTIONS}")
        if self.teacher not in ("online", "precomputed"):
            raise ValueError(f"LossConfig.teacher={self.teacher!r}: use 'online' or "
                             "'precomputed'")


def forward_logits(cfg: ModelConfig, params, tokens: Array, backend: str = "reference") -> Array:
    """Full-sequence logits [B, T, V] (float32) for tokens [B, T] (right padding is harmless:
    attention is causal, so padding never changes earlier positions)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    meta = AttentionMetadata.for_dense(positions, jnp.full((b,), t, jnp.int32))
    cache = DenseKVCache.create(cfg, b, t)  # written and discarded: training needs no cache
    logits, _ = Transformer(cfg).apply({"params": params}, tokens, meta, cache, backend=backend)
    return logits


def split_params(params: Mapping, frozen_names: Sequence[str] = ()) -> tuple[dict, dict]:
    """(trainable, frozen) by top-level name; raises ValueError for an unknown frozen name."""
    unknown = [n for n in frozen_names if n not in params]
    if unknown:
        raise ValueError(f"frozen params {unknown} not in the model (have {sorted(params)})")
    frozen = {k: v for k, v in params.items() if k in frozen_names}
    trainable = {k: v for k, v in params.items() if k not in frozen_names}
    return trainable, frozen


def merge_params(trainable: Mapping, frozen: Optional[Mapping]) -> dict:
    """The full param tree for the model."""
    return {**(frozen or {}), **trainable}


def init_train_state(params, optimizer: optax.GradientTransformation) -> TrainState:
    """Step 0 with fresh optimizer state for the trainable ``params``."""
    # Copies: the step donates the state, which must not free the caller's arrays.
    params = jax.tree_util.tree_map(lambda p: jnp.array(p, copy=True), params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params))


def compute_loss(student_logits: Array, batch: Mapping[str, Array], loss: LossConfig,
                 teacher_logits: Optional[Array] = None) -> tuple[Array, dict]:
    """(scalar loss, metrics) for one batch of student logits [B, T, V]."""
    mask = batch["loss_mask"]
    ce = losses.cross_entropy(student_logits, batch["targets"], mask)
    metrics = {"ce": ce, "accuracy": losses.token_accuracy(student_logits, batch["targets"],
                                                           mask)}
    if loss.kind == "ce":
        return ce, metrics
    if loss.teacher == "online":
        kl = losses.distill_kl(student_logits, teacher_logits, mask, loss.direction)
    else:
        kl = losses.distill_kl_topk(student_logits, batch["teacher_ids"],
                                    batch["teacher_logprobs"], mask, loss.direction)
    metrics["kl"] = kl
    return kl + loss.ce_weight * ce, metrics


def make_train_step(cfg: ModelConfig, optimizer: optax.GradientTransformation,
                    loss: LossConfig = LossConfig(), *, teacher_cfg: Optional[ModelConfig] = None,
                    schedule: Optional[optax.Schedule] = None, backend: str = "reference"):
    """Returns jitted ``step(state, batch, frozen, teacher_params) -> (state, metrics)``.

    ``batch``: inputs/targets [B, T] int32, loss_mask [B, T] (+ teacher top-k when
    precomputed). ``frozen``: the frozen part of the student's params (or None).
    ``teacher_params``: the target's params for ``teacher="online"`` distillation, else None.
    The state is donated. Metrics: loss, ce, accuracy, (kl), grad_norm, lr, tokens.
    """
    online = loss.kind == "distill" and loss.teacher == "online"
    if online and teacher_cfg is None:
        raise ValueError("online distillation needs teacher_cfg")

    def loss_fn(params, frozen, batch, teacher_logits):
        logits = forward_logits(cfg, merge_params(params, frozen), batch["inputs"], backend)
        return compute_loss(logits, batch, loss, teacher_logits)

    @functools.partial(jax.jit, donate_argnames=("state",))
    def step(state: TrainState, batch, frozen=None, teacher_params=None):
        teacher_logits = None
        if online:
            teacher_logits = jax.lax.stop_gradient(
                forward_logits(teacher_cfg, teacher_params, batch["inputs"], backend))
        (value, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, frozen, batch, teacher_logits)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics, loss=value, grad_norm=optax.tree.norm(grads),
                       tokens=jnp.sum(batch["loss_mask"]))
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return step


def precompute_teacher_topk(cfg: ModelConfig, params, inputs: np.ndarray, k: int, *,
                            batch_size: int = 8, backend: str = "reference",
                            progress: bool = False) -> dict:
    """Teacher top-k over rows inputs [N, T]: {"teacher_ids" [N, T, k] int32,
    "teacher_logprobs" [N, T, k+1] float32} (last column: log-mass of all other tokens)."""
    from tqdm.auto import tqdm

    @jax.jit
    def run(p, tokens):
        return losses.teacher_topk(forward_logits(cfg, p, tokens, backend), k)

    n = len(inputs)
    ids, logprobs = [], []
    for start in tqdm(range(0, n, batch_size), desc="teacher top-k", disable=not progress):
        chunk = inputs[start:start + batch_size]
        pad = batch_size - len(chunk)  # keep one compiled shape
        if pad:
            chunk = np.concatenate([chunk, np.zeros((pad,) + chunk.shape[1:], chunk.dtype)])
        i, lp = jax.device_get(run(params, jnp.asarray(chunk)))
        ids.append(i[: batch_size - pad])
        logprobs.append(lp[: batch_size - pad])
    return {"teacher_ids": np.concatenate(ids), "teacher_logprobs": np.concatenate(logprobs)}
