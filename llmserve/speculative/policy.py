"""Host side of speculation: the vLLM-style config and the never-slower policy (no jax)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class SpeculativeConfig:
    """vLLM-style ``speculative_config``: method "ngram", "draft" (a small model) or "eagle"
    (an EAGLE head, ``scripts/train_eagle.py``), D = num_speculative_tokens, and the model: a
    path, or (ModelConfig, params) for a draft / (EagleConfig, params, vocab_map) for a head."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: Any = None  # draft: a path, or a (ModelConfig, params) pair
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    adaptive: bool = True  # the "never slower" rule below

    @classmethod
    def from_dict(cls, d) -> "SpeculativeConfig":
        if isinstance(d, cls):
            return d
        d = dict(d)
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}")
        cfg = cls(**d)
        if cfg.method not in ("ngram", "draft", "eagle"):
            raise ValueError(f"speculative_config.method={cfg.method!r}: use 'ngram', 'draft' "
                             "or 'eagle'")
        if not 1 <= cfg.num_speculative_tokens <= 16:
            raise ValueError("speculative_config.num_speculative_tokens must be in [1, 16]")
        if cfg.method in ("draft", "eagle") and cfg.model is None:
            raise ValueError(f"speculative_config: method {cfg.method!r} needs 'model'")
        return cfg


class SpeculationPolicy:
    """Decides per step whether to verify R drafts or decode one token, so it is never slower.

    Rule: each request keeps an EMA ``a`` of its per-token acceptance rate (prior 0.4). A row
    with R drafts is expected to emit 1 + a + a^2 + ... + a^R tokens. A step speculates when
    (expected tokens of all rows) / t_verify > rows / t_decode, with both step times measured
    (EMA per batch bucket, seeded at warm-up). A request whose EMA falls below ``min_rate``
    after ``min_steps`` verify steps stops proposing (its rows then carry 0 drafts) for
    ``probe_every`` of its steps, then proposes once more: acceptance comes in bursts (a rewrite
    copies its input for a while, then writes new text), so a pause is never final.
    """

    def __init__(self, k: int, *, prior: float = 0.4, decay: float = 0.8,
                 min_rate: float = 0.1, min_steps: int = 4, probe_every: int = 8,
                 adaptive: bool = True):
        self.k, self.prior, self.decay = k, prior, decay
        self.min_rate, self.min_steps, self.adaptive = min_rate, min_steps, adaptive
        self.probe_every = probe_every
        self.rate: dict[int, float] = {}
        self.steps: dict[int, int] = {}
        self.paused: dict[int, int] = {}  # seq -> its steps since it stopped proposing
        self.t_decode: dict[int, float] = {}
        self.t_verify: dict[int, float] = {}

    def proposes(self, seq_id: int) -> bool:
        """False while a request that has shown it rarely accepts drafts is paused."""
        if not self.adaptive:
            return True
        return not (self.steps.get(seq_id, 0) >= self.min_steps
                    and self.rate.get(seq_id, self.prior) < self.min_rate)

    def tick(self, seq_ids) -> None:
        """One step passed for these running sequences: a paused one that has waited
        ``probe_every`` steps gets one more verify step (a single miss pauses it again)."""
        for s in seq_ids:
            if self.proposes(s):
                self.paused.pop(s, None)
                continue
            self.paused[s] = self.paused.get(s, 0) + 1
            if self.paused[s] >= self.probe_every:
                self.paused.pop(s)
                self.rate[s] = self.min_rate  # at the threshold: one more miss pauses it
                self.steps[s] = self.min_steps - 1

    def expected_tokens(self, seq_id: int, num_draft: int | None = None) -> float:
        """Tokens a verify row is expected to emit with ``num_draft`` drafts (default R)."""
        if not self.proposes(seq_id):
            return 1.0
        a = self.rate.get(seq_id, self.prior)
        return sum(a ** j for j in range(1 + (self.k if num_draft is None else num_draft)))

    def speculate(self, seq_ids, decode_bucket: int, verify_bucket: int,
                  num_draft=None) -> bool:
        """Whether verifying beats decoding for these rows (steps timed per bucket).

        ``num_draft``: the drafts each row actually carries when known (n-gram proposals are
        made on the host first), else R for every proposing row."""
        if not self.adaptive:
            return True
        td, tv = self.t_decode.get(decode_bucket), self.t_verify.get(verify_bucket)
        if td is None or tv is None:
            return True
        counts = [None] * len(seq_ids) if num_draft is None else [int(n) for n in num_draft]
        gain = sum(self.expected_tokens(s, n) for s, n in zip(seq_ids, counts)) / tv
        return gain > len(seq_ids) / td

    def record(self, seq_id: int, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        r = accepted / proposed
        old = self.rate.get(seq_id, self.prior)
        self.rate[seq_id] = self.decay * old + (1 - self.decay) * r
        self.steps[seq_id] = self.steps.get(seq_id, 0) + 1

    def time(self, kind: str, bucket: int, seconds: float) -> None:
        table = self.t_verify if kind == "verify" else self.t_decode
        old = table.get(bucket)
        table[bucket] = seconds if old is None else 0.7 * old + 0.3 * seconds

    def forget(self, seq_id: int) -> None:
        self.rate.pop(seq_id, None)
        self.steps.pop(seq_id, None)
        self.paused.pop(seq_id, None)
