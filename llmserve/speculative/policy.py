"""Host side of speculation: the vLLM-style config and the never-slower policy (no jax)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional


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
    # n-gram with async scheduling: True looks the drafts up inside the step on the device, so
    # verify steps run ahead like plain ones, but the policy then chooses to verify without
    # knowing whether a row has drafts (measured: verify/decode step 1.37 vs 1.51 at batch 1,
    # the same speedup; README "Speculative decoding"). False: looked up on the host.
    prompt_lookup_on_device: bool = False
    # A verify step of b rows carries at most max(1, max_verify_tokens // b - 1) drafts a row
    # (BatchBuilder.verify_drafts). On a CPU a step's matmuls turn compute-bound past ~16
    # tokens, so at batch 4 (24 tokens at D = 5) a verify step cost 2.4 decode steps; with 3
    # drafts a row (16 tokens) n-gram ran 1.14x [1.01-1.45] against 1.08x [0.90-1.32] at D = 5
    # (results/speculative/20261207-141310). None: 16 on the "cpu" backend, else no cap; 0:
    # no cap (every bucket verifies D drafts a row).
    max_verify_tokens: Optional[int] = None

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
        cap = cfg.max_verify_tokens
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int)
                                or cap < 2 and cap != 0):
            raise ValueError(f"speculative_config.max_verify_tokens={cap!r}: "
                             "must be an int >= 2 (a row's token and one draft), 0 (no cap) "
                             "or None (the backend's default)")
        if not isinstance(cfg.prompt_lookup_on_device, bool):
            raise TypeError("speculative_config.prompt_lookup_on_device="
                            f"{cfg.prompt_lookup_on_device!r}: must be bool")
        if cfg.method in ("draft", "eagle") and cfg.model is None:
            raise ValueError(f"speculative_config: method {cfg.method!r} needs 'model'")
        return cfg


class SpeculationPolicy:
    """Decides per step whether to verify R drafts or decode one token, so it is never slower.

    Rule: each request estimates, per draft position j, p_j = P(draft j is accepted | drafts
    0..j-1 were). Acceptance is correlated: a row that copies its input keeps copying
    (input-grounded rewrites, SmolLM2, n-gram: 0.42 at the first position, then 0.71, 0.87 and
    0.92 given the earlier ones), so one per-token rate with independent positions predicted
    1.5-2.0 tokens per row where steps emitted 2.4-3.3. A row with n drafts is expected to
    emit 1 + p_0 + p_0 p_1 + ... + p_0 ... p_{n-1} tokens. A step speculates when (expected
    tokens of all rows) / t_verify > (1 + ``margin``) rows / t_decode, with both step times
    measured (EMA per batch bucket, seeded at warm-up).

    The estimates, against the winner's curse (a step verifies when its rows' estimates are
    high, so noise in them shows up as optimism: before this rule, batch 32 expected 3.2
    tokens per verify row and got 1.9): a request's p_j = (h_j + m prior_j) / (n_j + m), its
    hits h_j and trials n_j discounted by ``decay`` per outcome, with m = ``shrink``
    pseudo-trials at the engine-wide rate prior_j, so a few lucky outcomes move it only part
    of the way. The engine-wide rates (start: ``prior`` at the first position, ``prior_after``
    at the later ones) average every row's outcomes with ``prior_decay`` each, about 50
    outcomes, not the last few rows of one step.

    A request whose own first-position rate h_0 / n_0 falls below ``min_rate`` after
    ``min_steps`` verify steps stops proposing (its rows then carry 0 drafts) for
    ``probe_every`` of its steps, then proposes once more: acceptance comes in bursts (a
    rewrite copies its input for a while, then writes new text), so a pause is never final;
    a miss then pauses it again, a hit clears its first-position record.
    """

    def __init__(self, k: int, *, prior: float = 0.4, prior_after: float = 0.7,
                 decay: float = 0.8, prior_decay: float = 0.98, shrink: float = 2.0,
                 margin: float = 0.1, min_rate: float = 0.1, min_steps: int = 4,
                 probe_every: int = 8, adaptive: bool = True):
        self.k, self.decay, self.prior_decay = k, decay, prior_decay
        self.shrink, self.margin = shrink, margin
        self.min_rate, self.min_steps, self.adaptive = min_rate, min_steps, adaptive
        self.probe_every = probe_every
        self.prior = [prior] + [prior_after] * (k - 1)  # engine-wide, learned from every row
        self.hits: dict[int, list[float]] = {}  # seq -> discounted accepted drafts at j
        self.trials: dict[int, list[float]] = {}  # seq -> discounted tested drafts at j
        self.steps: dict[int, int] = {}
        self.paused: dict[int, int] = {}  # seq -> its steps since it stopped proposing
        self.probing: set[int] = set()  # paused long enough: proposing once more
        self.t_decode: dict[int, float] = {}
        self.t_verify: dict[int, float] = {}

    def _rates(self, seq_id: int) -> list[float]:
        """p_j of a request: its record shrunk toward the current engine-wide rates."""
        if seq_id not in self.hits:
            return self.prior
        m = self.shrink
        return [(h + m * p) / (n + m)
                for h, n, p in zip(self.hits[seq_id], self.trials[seq_id], self.prior)]

    @property
    def rate(self) -> dict[int, list[float]]:
        """seq -> p_j, for every request with a record (derived from hits and trials)."""
        return {s: self._rates(s) for s in self.hits}

    def proposes(self, seq_id: int) -> bool:
        """False while a request that has shown it rarely accepts drafts is paused."""
        if not self.adaptive or seq_id in self.probing:
            return True
        if self.steps.get(seq_id, 0) < self.min_steps:
            return True
        # Its own first-position rate, unshrunk: the pause is about this request's evidence.
        return self.hits[seq_id][0] >= self.min_rate * self.trials[seq_id][0]

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
                self.probing.add(s)  # its next outcome decides: a miss pauses it again

    def expected_tokens(self, seq_id: int, num_draft: int | None = None) -> float:
        """Tokens a verify row is expected to emit with ``num_draft`` drafts (default R)."""
        if not self.proposes(seq_id):
            return 1.0
        n = self.k if num_draft is None else min(int(num_draft), self.k)
        total, reach = 1.0, 1.0
        for p in self._rates(seq_id)[:n]:
            reach *= p
            total += reach
        return total

    def speculate(self, seq_ids, decode_bucket: int, verify_bucket: int,
                  num_draft=None, room: int | None = None) -> bool:
        """Whether verifying beats decoding for these rows (steps timed per bucket).

        ``num_draft``: the drafts each row actually carries when known (n-gram proposals are
        made on the host first), else ``room`` (the verify bucket's drafts a row; default R)
        for every proposing row."""
        if not self.adaptive:
            return True
        td, tv = self.t_decode.get(decode_bucket), self.t_verify.get(verify_bucket)
        if td is None or tv is None:
            return True
        counts = ([room] * len(seq_ids) if num_draft is None
                  else [int(n) for n in num_draft])
        gain = sum(self.expected_tokens(s, n) for s, n in zip(seq_ids, counts)) / tv
        return gain > (1 + self.margin) * len(seq_ids) / td

    def record(self, seq_id: int, proposed: int, accepted: int) -> None:
        """A verify row's outcome: draft j was tested when drafts 0..j-1 were accepted."""
        if proposed <= 0:
            return
        hits = self.hits.setdefault(seq_id, [0.0] * self.k)
        trials = self.trials.setdefault(seq_id, [0.0] * self.k)
        if seq_id in self.probing:
            self.probing.discard(seq_id)
            if accepted:  # copying again: its old misses no longer describe it
                hits[0] = trials[0] = 0.0
        for j in range(min(proposed, accepted + 1)):
            hit = 1.0 if j < accepted else 0.0
            hits[j] = self.decay * hits[j] + hit
            trials[j] = self.decay * trials[j] + 1.0
            self.prior[j] = self.prior_decay * self.prior[j] + (1 - self.prior_decay) * hit
        self.steps[seq_id] = self.steps.get(seq_id, 0) + 1

    def time(self, kind: str, bucket: int, seconds: float) -> None:
        table = self.t_verify if kind == "verify" else self.t_decode
        old = table.get(bucket)
        table[bucket] = seconds if old is None else 0.7 * old + 0.3 * seconds

    def forget(self, seq_id: int) -> None:
        self.hits.pop(seq_id, None)
        self.trials.pop(seq_id, None)
        self.probing.discard(seq_id)
        self.steps.pop(seq_id, None)
        self.paused.pop(seq_id, None)
