"""The optimizer: AdamW with linear warmup + cosine decay and global-norm gradient clipping."""

from __future__ import annotations

import dataclasses

import jax
import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW hyper-parameters; the learning rate warms up linearly, then decays (cosine)."""

    learning_rate: float = 1e-3
    warmup_steps: int = 20
    total_steps: int = 200
    end_lr_fraction: float = 0.1
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95


def lr_schedule(cfg: OptimConfig) -> optax.Schedule:
    """0 -> learning_rate over warmup_steps, then cosine to end_lr_fraction * learning_rate."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate,
        warmup_steps=max(cfg.warmup_steps, 1),
        decay_steps=max(cfg.total_steps, cfg.warmup_steps + 1),
        end_value=cfg.learning_rate * cfg.end_lr_fraction)


def _decay_mask(params):
    # Decay matrices only: norms' scales and biases keep their values.
    return jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """clip_by_global_norm(clip_norm) then AdamW(schedule) with decay on matrices only."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                    mask=_decay_mask))
