"""Training and distillation for llmserve models (optax + Orbax).

* ``step``: ``TrainState``, ``LossConfig``, ``make_train_step`` (the jitted step: forward, CE or
  distillation KL, AdamW update), ``precompute_teacher_topk``.
* ``optim``: ``OptimConfig`` and ``make_optimizer`` (AdamW, warmup + cosine, clipping).
* ``losses``: masked cross-entropy, forward / reverse KL (full vocabulary or teacher top-k).
* ``data``: ``pad_sequences`` / ``pack_sequences`` -> [N, T] rows; ``TokenDataset`` batches.
* ``loop``: ``train`` (tqdm, JSON-lines metrics, Orbax checkpoints, exact resume).
* ``checkpoints``: ``TrainCheckpointer`` (state + data position).
* ``acceptance``: greedy-draft acceptance against the target's own text.
* ``eagle``: EAGLE draft-head training (target features, loss, step, chain acceptance).
* ``bpe``: ``train_bpe_tokenizer``; ``prompts``: stdlib and chat prompt sources.
* ``export``: ``save_model`` (Orbax params + Hugging Face directory).
"""

from llmserve.training.data import TokenDataset, pack_sequences, pad_sequences
from llmserve.training.export import save_model
from llmserve.training.loop import train
from llmserve.training.optim import OptimConfig, lr_schedule, make_optimizer
from llmserve.training.step import (
    LossConfig,
    TrainState,
    forward_logits,
    init_train_state,
    make_train_step,
    merge_params,
    precompute_teacher_topk,
    split_params,
)

__all__ = ["TokenDataset", "pack_sequences", "pad_sequences", "train", "OptimConfig",
           "lr_schedule", "make_optimizer", "LossConfig", "TrainState", "forward_logits",
           "init_train_state", "make_train_step", "merge_params", "precompute_teacher_topk",
           "split_params", "save_model"]
