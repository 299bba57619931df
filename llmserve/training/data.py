"""Token sequences -> fixed [B, T] batches, with a resumable position.

A dataset is a dict of equal-length numpy arrays (rows): ``inputs`` [N, T], ``targets`` [N, T]
(inputs shifted by one), ``loss_mask`` [N, T] float32, and optionally precomputed teacher
top-k (``teacher_ids`` [N, T, k], ``teacher_logprobs`` [N, T, k+1]). Batch ``i`` is a pure
function of (seed, i): each epoch visits the rows in a fresh seeded permutation, so the data
position to checkpoint is one integer.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np


def pad_sequences(seqs: Sequence[Sequence[int]], seq_len: int, pad_id: int = 0,
                  loss_masks: Optional[Sequence[Sequence[float]]] = None) -> dict:
    """One sequence per row, truncated to seq_len + 1 tokens and right-padded.

    ``loss_masks[i][j]`` says whether token j of sequence i is a training target (default:
    all). Padding never counts. Returns inputs/targets [N, T] int32 and loss_mask [N, T].
    """
    n = len(seqs)
    tokens = np.full((n, seq_len + 1), pad_id, np.int32)
    mask = np.zeros((n, seq_len + 1), np.float32)
    for i, seq in enumerate(seqs):
        seq = list(seq)[: seq_len + 1]
        tokens[i, : len(seq)] = seq
        m = np.ones(len(seq)) if loss_masks is None else np.asarray(loss_masks[i][: len(seq)])
        mask[i, : len(seq)] = m
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask[:, 1:]}


def pack_sequences(seqs: Sequence[Sequence[int]], seq_len: int,
                   sep_id: Optional[int] = None) -> dict:
    """Concatenates sequences (joined by ``sep_id`` if given) and cuts rows of seq_len + 1.

    Rows overlap by one token so every token is a target once; the tail that does not fill a
    row is dropped. Attention crosses document boundaries (GPT-style packing).
    """
    stream: list[int] = []
    for seq in seqs:
        stream.extend(int(t) for t in seq)
        if sep_id is not None:
            stream.append(int(sep_id))
    n = (len(stream) - 1) // seq_len
    if n < 1:
        raise ValueError(f"pack_sequences: {len(stream)} tokens do not fill one row of "
                         f"{seq_len + 1}")
    arr = np.asarray(stream[: n * seq_len + 1], np.int32)
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    rows = arr[idx]
    return {"inputs": rows[:, :-1], "targets": rows[:, 1:],
            "loss_mask": np.ones((n, seq_len), np.float32)}


class TokenDataset:
    """Seeded, epoch-shuffled fixed-size batches over the rows of a dict of arrays."""

    def __init__(self, arrays: Mapping[str, np.ndarray], batch_size: int, seed: int = 0):
        sizes = {k: len(v) for k, v in arrays.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"TokenDataset: arrays have different row counts {sizes}")
        self.arrays = dict(arrays)
        self.num_rows = next(iter(sizes.values()))
        if not 1 <= batch_size <= self.num_rows:
            raise ValueError(f"TokenDataset: batch_size={batch_size} must be in "
                             f"[1, {self.num_rows}] (rows)")
        self.batch_size = batch_size
        self.seed = seed

    @property
    def batches_per_epoch(self) -> int:
        return self.num_rows // self.batch_size

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def batch(self, position: int) -> dict:
        """Batch number ``position`` (0-based) of the infinite epoch-shuffled stream."""
        epoch, j = divmod(int(position), self.batches_per_epoch)
        rows = self._permutation(epoch)[j * self.batch_size:(j + 1) * self.batch_size]
        return {k: v[rows] for k, v in self.arrays.items()}
