"""Multi-host serving: one scheduler, every process running the same SPMD step.

With a mesh that spans processes (``jax.distributed``), every process must enter each jitted
call with the same arguments. Process 0 (the leader) runs the whole engine; its runner is a
``LeaderRunner``, which broadcasts every device call's host arrays before making it. The other
processes build the same engine and call ``follow(engine.runner)``: they receive each call and
run it on their own devices, until the leader's ``stop_followers()``.

The broadcast is ``multihost_utils.broadcast_one_to_all``: a fixed-size header (which call,
which bucket), then the payload received into a template of that shape (``empty_batch``), so
its pytree structure is known on both sides. Speculative decoding is not mirrored yet.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from llmserve.batch import StepInput
from llmserve.runner import Runner

# Header: [op, parts, then per part (rows, tokens per row, sampled rows)].
OP_STOP, OP_STEP, OP_COPY, OP_SAMPLER = 0, 1, 2, 3
HEADER = 8


def _broadcast(tree, is_source: bool):
    from jax.experimental import multihost_utils

    out = multihost_utils.broadcast_one_to_all(tree, is_source=is_source)
    return jax.tree_util.tree_map(np.asarray, out)


def _send(header: Sequence[int], payload=None) -> None:
    head = np.zeros(HEADER, np.int32)
    head[: len(header)] = header
    _broadcast(head, True)
    if payload is not None:
        _broadcast(payload, True)


class LeaderRunner(Runner):
    """A Runner that, on process 0 of a multi-process mesh, broadcasts each device call's
    inputs first (on other processes it is a plain Runner driven by ``follow``)."""

    @property
    def _leads(self) -> bool:
        return jax.process_index() == 0

    def run(self, batch: StepInput, drafts=None, draft_probs=None):
        if batch.verify:
            raise NotImplementedError("speculative decoding is not mirrored across processes "
                                      "yet")
        if self._leads:
            shape = [x for p in batch.parts
                     for x in (p.block_tables.shape[0], p.t, p.num_samples)]
            _send([OP_STEP, len(batch.parts), *shape], batch)
        return super().run(batch)

    def copy_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        if self._leads and pairs:
            _send([OP_COPY, len(pairs)], np.asarray(pairs, np.int32).reshape(-1, 2))
        super().copy_pages(pairs)

    def init_sampler_rows(self, rows) -> None:
        if self._leads and rows:
            ids = [np.asarray(t, np.int32) for _, t, _ in rows]
            meta = np.asarray([(s, len(t), n) for s, t, n in rows], np.int32)  # [n, 3]
            _send([OP_SAMPLER, len(rows), sum(len(t) for t in ids)],
                  (meta, np.concatenate(ids)))
        super().init_sampler_rows(rows)

    def stop_followers(self) -> None:
        """Ends every follower's ``follow`` loop (call once, on the leader, when done)."""
        if self._leads:
            _send([OP_STOP])


def follow(runner: Runner) -> int:
    """The loop of a non-leader process: receives and runs the leader's device calls until
    it stops them; returns how many calls ran."""
    calls = 0
    while True:
        head = _broadcast(np.zeros(HEADER, np.int32), False)
        op = int(head[0])
        if op == OP_STOP:
            return calls
        if op == OP_STEP:
            parts = int(head[1])
            spec = [int(x) for x in head[2:2 + 3 * parts]]
            template = runner.build([([], *spec[3 * i:3 * i + 3]) for i in range(parts)])
            Runner.run(runner, _broadcast(template, False))
        elif op == OP_COPY:
            pairs = _broadcast(np.zeros((int(head[1]), 2), np.int32), False)
            Runner.copy_pages(runner, [tuple(p) for p in pairs.tolist()])
        elif op == OP_SAMPLER:
            n, total = int(head[1]), int(head[2])
            meta, ids = _broadcast((np.zeros((n, 3), np.int32), np.zeros(total, np.int32)),
                                   False)
            rows, off = [], 0
            for slot, length, n_prompt in meta.tolist():
                rows.append((slot, ids[off:off + length].tolist(), n_prompt))
                off += length
            Runner.init_sampler_rows(runner, rows)
        else:
            raise RuntimeError(f"unknown multi-host op {op} in header {head.tolist()}")
        calls += 1
