"""Speculative-decoding acceptance of a draft, measured offline against the target's own text.

For a held-out prompt the target writes its greedy continuation y_1..y_n. Teacher-forcing the
draft along prompt + y, position i "matches" when argmax draft(prompt, y_<i) == y_i. With
greedy verification, a K-token proposal starting at i is accepted up to its first mismatch:
  accepted(i) = number of consecutive matches from i, capped at K (and at the text's end).
Once a match run starts at i, the draft's own proposals equal y, so teacher forcing is exact.
We report the per-token match rate, the mean accepted(i) over all starting points, and a
simulated decode: from i, accept a = accepted(i) tokens, the target adds one, jump to i+a+1;
tokens_per_step is the mean a + 1 (target forward passes saved per step).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from llmserve.config import ModelConfig
from llmserve.training.step import forward_logits


def greedy_matches(cfg: ModelConfig, params, prompts: Sequence[Sequence[int]],
                   continuations: Sequence[Sequence[int]], *, batch_size: int = 8,
                   backend: str = "reference") -> list[np.ndarray]:
    """Per sequence, bool [len(continuation)]: draft argmax == continuation token."""
    seqs = [list(p) + list(c) for p, c in zip(prompts, continuations)]
    t = max(len(s) for s in seqs)

    @jax.jit
    def argmax(p, tokens):
        return jnp.argmax(forward_logits(cfg, p, tokens, backend), axis=-1).astype(jnp.int32)

    out: list[np.ndarray] = []
    for start in range(0, len(seqs), batch_size):
        rows = np.zeros((batch_size, t), np.int32)  # one compiled shape
        chunk = seqs[start:start + batch_size]
        for i, s in enumerate(chunk):
            rows[i, : len(s)] = s
        pred = np.asarray(argmax(params, jnp.asarray(rows)))
        for i, s in enumerate(chunk):
            p_len = len(prompts[start + i])
            # Logits at position j predict token j + 1.
            out.append(pred[i, p_len - 1:len(s) - 1] == np.asarray(s[p_len:]))
    return out


def accepted_lengths(match: np.ndarray, k: int) -> np.ndarray:
    """accepted(i) [n] for each start i: consecutive matches from i, at most k."""
    n = len(match)
    acc = np.zeros(n, np.int64)
    run = 0
    for i in range(n - 1, -1, -1):
        run = run + 1 if match[i] else 0
        acc[i] = min(run, k)
    return acc


def simulated_steps(match: np.ndarray, k: int) -> list[int]:
    """Accepted counts a per verify step of a greedy K-token speculative decode of the text."""
    acc = accepted_lengths(match, k)
    steps, i = [], 0
    while i < len(match):
        a = int(acc[i])
        steps.append(a)
        i += a + 1
    return steps


def acceptance_stats(matches: Sequence[np.ndarray], k: int = 4) -> dict:
    """Aggregates ``greedy_matches`` output: match rate, mean accepted length, tokens/step."""
    matches = [np.asarray(m, bool) for m in matches if len(m)]
    if not matches:
        raise ValueError("acceptance_stats: no continuation tokens")
    flat = np.concatenate(matches)
    acc = np.concatenate([accepted_lengths(m, k) for m in matches])
    steps = [a for m in matches for a in simulated_steps(m, k)]
    return {"k": k, "num_sequences": len(matches), "num_tokens": int(flat.size),
            "token_match_rate": float(flat.mean()),
            "mean_accepted_len": float(acc.mean()),
            "acceptance_rate": float(acc.mean() / k),
            "tokens_per_step": float(np.mean(steps) + 1.0)}
