"""N-gram prompt lookup: drafts copied from earlier in the sequence (host numpy, no model)."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


class NgramProposer:
    """Prompt lookup: continue the latest earlier occurrence of the sequence's last n tokens.

    For n = n_max down to n_min, the last n tokens are searched in prompt + output so far; the
    most recent earlier match wins and the (up to) k tokens that followed it are proposed.
    Deterministic, so ``verify`` takes draft_probs=None.
    """

    def __init__(self, n_max: int = 3, n_min: int = 1, k: int = 4):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"NgramProposer needs 1 <= n_min <= n_max, got {n_min}, {n_max}")
        if k < 1:
            raise ValueError(f"NgramProposer needs k >= 1, got {k}")
        self.n_max, self.n_min, self.k = n_max, n_min, k

    def lookup(self, token_ids: Sequence[int], k: Optional[int] = None) -> tuple[np.ndarray, int]:
        """(tokens [k] i32 zero-padded, number proposed 0..k) for one sequence."""
        k = self.k if k is None else k
        ids = np.asarray(token_ids, np.int32)
        out = np.zeros(k, np.int32)
        for n in range(min(self.n_max, len(ids) - 1), self.n_min - 1, -1):
            # Windows of ids[:-1] start at i <= len - 1 - n, so a token always follows them.
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # [len - n, n]
            hits = np.flatnonzero(np.all(windows == ids[-n:], axis=1))
            if hits.size:
                follow = ids[hits[-1] + n: hits[-1] + n + k]
                out[: len(follow)] = follow
                return out, len(follow)
        return out, 0

    def propose_batch(self, token_lists: Sequence[Sequence[int]], k: Optional[int] = None
                      ) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [B, k] i32 zero-padded, lengths [B] i32) for a batch of sequences."""
        k = self.k if k is None else k
        tokens = np.zeros((len(token_lists), k), np.int32)
        lengths = np.zeros(len(token_lists), np.int32)
        for i, ids in enumerate(token_lists):
            tokens[i], lengths[i] = self.lookup(ids, k)
        return tokens, lengths
