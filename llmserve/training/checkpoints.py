"""Orbax training checkpoints: (TrainState, data position) every N steps, restorable exactly.

Each checkpoint is one step directory holding the state pytree (params, optimizer state,
step) and a small JSON item (``data_position``: batches consumed, plus anything the caller
adds). Saves are synchronous so a killed run leaves only complete checkpoints behind.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax

from llmserve.training.step import TrainState


class TrainCheckpointer:
    """Saves and restores (TrainState, meta dict) under ``directory`` (keeps ``max_to_keep``)."""

    def __init__(self, directory: str, max_to_keep: int = 2):
        import orbax.checkpoint as ocp

        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=False)
        self._ocp = ocp
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=("state", "meta"))

    def latest_step(self) -> Optional[int]:
        """The newest saved step, or None."""
        return self._manager.latest_step()

    def save(self, state: TrainState, meta: dict) -> None:
        """Saves at step ``int(state.step)`` (overwrites nothing: steps are unique)."""
        ocp = self._ocp
        step = int(jax.device_get(state.step))
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta))), force=True)
        self._manager.wait_until_finished()

    def restore(self, like: TrainState, step: Optional[int] = None) -> tuple[TrainState, dict]:
        """(state, meta) at ``step`` (default: latest), shaped like the pytree ``like``."""
        ocp = self._ocp
        step = self.latest_step() if step is None else step
        if step is None:
            raise ValueError(f"{self.directory}: no checkpoint to restore")
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, like)
        out = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"])

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> "TrainCheckpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def quiet_orbax_logs() -> None:
    """Drops Orbax's per-save INFO lines from the absl log (our own lines stay)."""
    import logging as py_logging

    class _Filter(py_logging.Filter):
        def filter(self, record):
            return "orbax" not in record.pathname or record.levelno >= py_logging.WARNING

    py_logging.getLogger("absl").addFilter(_Filter())
