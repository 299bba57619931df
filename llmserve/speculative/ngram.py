"""N-gram prompt lookup: drafts copied from earlier in the sequence (host numpy, no model)."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


class NgramProposer:
    """Prompt lookup: continue an earlier occurrence of the sequence's last n tokens.

    For n = n_max down to n_min, the last n tokens are searched in prompt + output so far; the
    first n with a match wins and the (up to) k tokens that followed the match are proposed.
    ``match`` picks among equally long matches: "earliest" (vLLM's prompt lookup, the default)
    or "latest". Replayed over the speculative benchmark's input-grounded workload (greedy
    outputs of its 40 prompts, R = 4 at every position), the earliest match gives 2.22-2.23
    tokens a verify step against 2.13 for the latest. Deterministic, so
    ``verify`` takes draft_probs=None.
    """

    def __init__(self, n_max: int = 3, n_min: int = 1, k: int = 4, match: str = "earliest"):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"NgramProposer needs 1 <= n_min <= n_max, got {n_min}, {n_max}")
        if k < 1:
            raise ValueError(f"NgramProposer needs k >= 1, got {k}")
        if match not in ("earliest", "latest"):
            raise ValueError(f"NgramProposer match={match!r}: use 'earliest' or 'latest'")
        self.n_max, self.n_min, self.k, self.match = n_max, n_min, k, match

    def lookup(self, token_ids: Sequence[int], k: Optional[int] = None) -> tuple[np.ndarray, int]:
        """(tokens [k] i32 zero-padded, number proposed 0..k) for one sequence.

        One pass instead of one sliding-window search per n: every earlier position e holding
        the last token ends a candidate window; its match length m(e) is how many tokens before
        it also match the sequence's tail (up to n_max). The longest n >= n_min with a match
        wins and, among windows of that length, the earliest (or the latest, by ``match``);
        the k tokens after it are proposed
        (the same choice as searching n = n_max .. n_min in turn, at a tenth of the cost on a
        700-token row: ~0.01 instead of ~0.1 ms)."""
        k = self.k if k is None else k
        ids = np.asarray(token_ids, np.int32)
        out = np.zeros(k, np.int32)
        size = len(ids)
        if size < 2 or min(self.n_max, size - 1) < self.n_min:
            return out, 0
        ends = np.flatnonzero(ids[:-1] == ids[-1])  # window ends e <= size - 2
        if not ends.size:
            return out, 0
        match = np.ones(ends.size, np.int32)  # m(e), counted while every earlier token matched
        alive = np.ones(ends.size, bool)
        for j in range(1, min(self.n_max, size - 1)):
            alive &= ends >= j
            alive[alive] = ids[ends[alive] - j] == ids[-1 - j]
            match += alive
        best = match.max()
        if best < self.n_min:
            return out, 0
        e = ends[np.flatnonzero(match == best)[0 if self.match == "earliest" else -1]]
        follow = ids[e + 1: e + 1 + k]
        out[: len(follow)] = follow
        return out, len(follow)

    def propose_batch(self, token_lists: Sequence[Sequence[int]], k: Optional[int] = None
                      ) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [B, k] i32 zero-padded, lengths [B] i32) for a batch of sequences."""
        k = self.k if k is None else k
        tokens = np.zeros((len(token_lists), k), np.int32)
        lengths = np.zeros(len(token_lists), np.int32)
        for i, ids in enumerate(token_lists):
            tokens[i], lengths[i] = self.lookup(ids, k)
        return tokens, lengths
