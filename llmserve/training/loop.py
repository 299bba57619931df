"""The training loop: batches -> jitted step, tqdm progress, JSON-lines metrics, checkpoints.

``train`` resumes from the newest checkpoint in ``ckpt_dir`` if there is one: the state and
the data position come back exactly, so an interrupted run that is restarted ends with the
same parameters as one that never stopped (bit-exact on CPU).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Optional

import jax
import numpy as np

from llmserve.training.checkpoints import TrainCheckpointer
from llmserve.training.data import TokenDataset
from llmserve.training.step import TrainState


def _to_float(x: Any) -> float:
    return float(np.asarray(x))


def train(step_fn: Callable, state: TrainState, dataset: TokenDataset, *, num_steps: int,
          frozen: Any = None, teacher_params: Any = None, ckpt_dir: Optional[str] = None,
          ckpt_every: int = 0, log_path: Optional[str] = None, log_every: int = 10,
          stop_after: Optional[int] = None, progress: bool = True,
          desc: str = "train") -> tuple[TrainState, list[dict]]:
    """Runs ``step_fn`` until ``state.step == num_steps``; returns (state, logged metrics).

    Checkpoints every ``ckpt_every`` steps and at the end when ``ckpt_dir`` is set.
    ``stop_after`` ends this call after that many steps (simulates an interruption).
    Each logged record: step, loss (and the step's other metrics), tokens_per_s, elapsed_s.
    """
    from tqdm.auto import tqdm

    position = 0
    ckpt = TrainCheckpointer(ckpt_dir) if ckpt_dir else None
    if ckpt is not None and ckpt.latest_step() is not None:
        state, meta = ckpt.restore(state)
        position = int(meta["data_position"])
    start = int(jax.device_get(state.step))
    history: list[dict] = []
    log_file = None
    if log_path:
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        log_file = open(log_path, "a")
    bar = tqdm(total=num_steps, initial=start, desc=desc, disable=not progress,
               dynamic_ncols=True)
    t0 = t_last = time.perf_counter()
    try:
        for i in range(start, num_steps):
            if stop_after is not None and i - start >= stop_after:
                break
            batch = dataset.batch(position)
            state, metrics = step_fn(state, batch, frozen, teacher_params)
            position += 1
            done = i + 1
            if done % max(log_every, 1) == 0 or done == num_steps:
                metrics = {k: _to_float(v) for k, v in jax.device_get(metrics).items()}
                now = time.perf_counter()
                steps_since = done - (history[-1]["step"] if history else start)
                batch_tokens = float(np.prod(batch["inputs"].shape))
                record = {"step": done, **metrics,
                          "tokens_per_s": batch_tokens * steps_since / max(now - t_last, 1e-9),
                          "elapsed_s": now - t0}
                t_last = now
                history.append(record)
                bar.set_postfix(loss=f"{record['loss']:.4f}",
                                tok_s=f"{record['tokens_per_s']:.0f}")
                if log_file is not None:
                    log_file.write(json.dumps(record) + "\n")
                    log_file.flush()
            bar.update(1)
            if ckpt is not None and ckpt_every and (done % ckpt_every == 0 or done == num_steps):
                ckpt.save(state, {"data_position": position, "step": done})
    finally:
        bar.close()
        if log_file is not None:
            log_file.close()
        if ckpt is not None:
            ckpt.close()
    return state, history
