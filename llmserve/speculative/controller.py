"""The engine's speculation: one object with fixed hooks at the points of an engine step.

The engine calls every hook whatever the config; with speculation off (``config`` None) each
one does nothing. Before the step the controller decides whether it verifies (the never-slower
``SpeculationPolicy`` over the running rows), asks its ``Proposer`` for each row's drafts and
hands a draft model's device drafts to the runner; after it, it records acceptance for the
policy, the proposer, the request metrics and ``spec_metrics``. Host only: it imports no jax
itself (device calls go through the runner and the proposers).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import numpy as np

from llmserve.runner import wait
from llmserve.speculative.policy import SpeculationPolicy, SpeculativeConfig

SHADOW_ROWS = 2  # n-gram lookups per plain decode step of an adaptive engine (``shadow``)


def num_speculative_tokens(spec_cfg: Optional[dict]) -> int:
    """D, the drafts a verify row carries (0 without speculation): the runner's verify width."""
    if spec_cfg is None:
        return 0
    return SpeculativeConfig.from_dict(spec_cfg).num_speculative_tokens


CPU_MAX_VERIFY_TOKENS = 16  # SpeculativeConfig.max_verify_tokens=None on the "cpu" backend


def max_verify_tokens(spec_cfg: Optional[dict], backend: str) -> Optional[int]:
    """The cap on a verify step's tokens (``SpeculativeConfig.max_verify_tokens``; None: 16 on
    the "cpu" backend, no cap elsewhere, where many tokens cost little more than a few; 0: no
    cap). None is returned for no cap."""
    if spec_cfg is None:
        return None
    cap = SpeculativeConfig.from_dict(spec_cfg).max_verify_tokens
    if cap is None:
        return CPU_MAX_VERIFY_TOKENS if backend == "cpu" else None
    return cap or None


def device_ngram(config, shardings=None) -> Optional[tuple]:
    """(n_max, n_min) when an engine of ``config`` (an ``EngineConfig``) looks its n-gram
    drafts up on the device, else None: n-gram speculation with ``prompt_lookup_on_device``,
    async scheduling, one device (no mesh) and the default, not batch-invariant, mode."""
    if config.speculative_config is None or not config.async_scheduling:
        return None
    spec = SpeculativeConfig.from_dict(config.speculative_config)
    if (spec.method != "ngram" or not spec.prompt_lookup_on_device or shardings is not None
            or config.batch_invariant):
        return None
    return spec.prompt_lookup_max, spec.prompt_lookup_min


def load_eagle(spec_cfg: Optional[dict], cfg):
    """The EAGLE head the runner runs inside its step ((EagleConfig, params, vocab_map)), or
    None when the method is not "eagle"; a head that does not fit the target is a ValueError."""
    if spec_cfg is None or dict(spec_cfg).get("method") != "eagle":
        return None
    from llmserve.speculative.proposers import load_eagle_head

    eagle = load_eagle_head(dict(spec_cfg)["model"], cfg.dtype)
    if eagle[0].vocab_size != cfg.vocab_size or eagle[0].d_model != cfg.d_model:
        raise ValueError(f"EAGLE head for vocab {eagle[0].vocab_size} / d_model "
                         f"{eagle[0].d_model} does not fit this model "
                         f"({cfg.vocab_size} / {cfg.d_model})")
    return eagle


def spec_metrics(stats: dict) -> dict:
    """Speculative decoding so far (from an engine's ``stats``): acceptance rate, mean accepted
    length per verify row, acceptance per draft position, the tokens per verify row the policy
    expected when it chose to verify (its calibration: realized = 1 + mean accepted length;
    the policy's expectation whatever ``adaptive``), the first drafts checked against
    plain steps' tokens (``SpeculationController.shadow``) and how often they matched, and the
    time spent in verify (draft + verify) and in plain decode steps."""
    st = stats
    proposed, rows = st.get("spec_proposed", 0), st.get("spec_verify_rows", 0)
    per_pos = [a / p if p else None for a, p in zip(st.get("spec_accepted_per_pos", []),
                                                    st.get("spec_proposed_per_pos", []))]
    return {"acceptance_rate": st.get("spec_accepted", 0) / proposed if proposed else None,
            "mean_accepted_length": st.get("spec_accepted", 0) / rows if rows else None,
            "acceptance_per_position": per_pos,
            "predicted_tokens_per_row": (st.get("spec_predicted_tokens", 0.0) / rows
                                         if rows else None),
            "shadow_checks": st.get("spec_shadow_rows", 0),
            "shadow_acceptance": (st.get("spec_shadow_hits", 0) / st["spec_shadow_rows"]
                                  if st.get("spec_shadow_rows") else None),
            "verify_time_s": st.get("spec_verify_time_s", 0.0),
            "decode_time_s": st.get("spec_decode_time_s", 0.0)}


class SpeculationController:
    """Speculation glue of one engine: its config, policy and proposer, and the per-step hooks.

    ``runner``, ``scheduler``, ``stats`` and ``requests`` are the engine's own (read, and
    ``stats`` / request metrics updated in place); ``config`` None: speculation is off.
    """

    def __init__(self, config: Optional[dict], *, cfg, runner, scheduler, stats: dict,
                 requests: dict, num_pages: int, page_size: int, max_model_len: int,
                 backend: str):
        self.runner = runner
        self.scheduler = scheduler
        self.stats = stats
        self.requests = requests
        self.max_model_len = max_model_len
        self.spec: Optional[SpeculativeConfig] = None
        self.policy: Optional[SpeculationPolicy] = None
        self.proposer = None
        self._drafted = False  # an EAGLE head left drafts for the next step
        self._predicted = 0.0  # tokens the policy expected this step's verify rows to emit
        self._shadow_next = 0  # round-robin start of the next plain step's lookups
        if config is not None:
            self._init_speculation(config, cfg, num_pages, page_size, backend)

    def _init_speculation(self, spec_cfg, cfg, num_pages: int, page_size: int,
                          backend: str) -> None:
        from llmserve.speculative import proposers

        self.spec = spec = SpeculativeConfig.from_dict(spec_cfg)
        k = spec.num_speculative_tokens
        self.policy = SpeculationPolicy(k, adaptive=spec.adaptive)
        if spec.method == "ngram":
            self.proposer = proposers.NgramLookup(spec.prompt_lookup_max, spec.prompt_lookup_min,
                                                  k)
            return
        if spec.method == "eagle":
            self.proposer = proposers.EagleHeadProposer(k)
            return
        if isinstance(spec.model, (tuple, list)):
            dcfg, dparams = spec.model
        else:
            from llmserve.checkpoint import load_checkpoint

            dcfg, dparams = load_checkpoint(spec.model, dtype=cfg.dtype)
        self.proposer = proposers.DraftModelProposer(
            dcfg, dparams, num_pages=num_pages, page_size=page_size,
            num_speculative_tokens=k, backend=backend, target_vocab=cfg.vocab_size,
            shardings=self.runner.shardings)

    @property
    def device_lookup(self) -> bool:
        """n-gram drafts are looked up inside the step (the runner keeps each slot's token
        history): verify rows are built without their drafts, and may be fed (launched while
        the step before them runs)."""
        return self.runner.ngram is not None

    @property
    def device_drafts(self) -> bool:
        """Verify steps take a draft model's device drafts (compiled so at warm-up)."""
        return self.spec is not None and self.proposer.device_drafts

    # ------------------------------------------------------------------ lifetime
    def warmup(self) -> None:
        """Compiles the proposer's calls and times decode against verify per bucket, seeding
        the never-slower policy (after the runner's own warm-up)."""
        if self.spec is None:
            return
        self.proposer.warmup(self.runner)
        for shape in self.runner.step_shapes():
            d, p, w = shape
            if p is not None or d == 0:
                continue
            batch = self.runner.empty_batch(shape, full=True)  # a full bucket's cost
            for attempt in range(2):  # the first run may still allocate; the second is timed
                t0 = time.perf_counter()
                drafts, probs = self.proposer.drafts([], batch) if w > 1 else (None, None)
                wait(self.runner.run(batch, drafts, probs))
                if attempt == 1:
                    self.policy.time("verify" if w > 1 else "decode", d,
                                     time.perf_counter() - t0)

    def reset(self) -> None:
        """After a failed step: the device drafts are gone with the rebuilt state."""
        self._drafted = False
        if self.spec is not None:
            self.proposer.reset()

    def forget(self, seq_id) -> None:
        """A sequence finished: its policy and proposer state go."""
        if self.spec is not None:
            self.policy.forget(seq_id)
            self.proposer.forget(seq_id)

    # ------------------------------------------------------------------ before the step
    def reserve(self, lookahead: int) -> int:
        """Cache slots to reserve past each decode row's token: its drafts when it verifies;
        an EAGLE head drafts at the end of every step, writing D positions on: always D."""
        return self.spec.num_speculative_tokens if (
            self.spec is not None and self.spec.method == "eagle") else lookahead

    def lookahead(self, ahead: bool = False) -> int:
        """D when this step should verify drafts (see SpeculationPolicy), else 0."""
        if self.spec is None:
            return 0
        if not ahead and self.spec.method == "eagle" and not self._drafted:
            return 0  # the head made no drafts at the end of the last step
        rows = [s for s in self.scheduler.running if not s.in_prefill]
        if not rows:
            return 0
        if not any(self.policy.proposes(s.seq_id) for s in rows):
            return 0
        ids = [s.seq_id for s in rows]
        n = len(rows)
        if not self.policy.speculate(ids, self.runner.decode_bucket(n),
                                     self.runner.decode_bucket(n, verify=True),
                                     room=self.runner.verify_drafts(n)):
            return 0
        return self.spec.num_speculative_tokens

    def copy_pages(self, copies) -> None:
        """Copy-on-write of the proposer's own cache (a draft model's follows the target's)."""
        if self.spec is not None:
            self.proposer.copy_pages(copies)

    def verify_rows(self, seqs: list, row: Callable, mixed: bool = False) -> list:
        """Each sequence's verify row: its last token, then the drafts the proposer gives it
        (placeholders when the drafts come from the device inside the step). ``row(seq, start,
        tokens, emit)`` is the engine's ``ScheduledRow`` for a sequence; ``mixed``: the step
        carries prefill chunks too (its verify bucket, and so its rows' room, is the largest)."""
        d = self.runner.verify_drafts(len(seqs), mixed)
        room = np.zeros(len(seqs), np.int32)  # drafts each row may carry (max_model_len, policy)
        for i, seq in enumerate(seqs):
            if self.policy.proposes(seq.seq_id):
                room[i] = max(0, min(d, self.max_model_len - seq.num_tokens - seq.pending))
        if self.device_lookup:
            # The step looks each row's drafts up (at most its room). A row whose last token is
            # still in flight is fed: the device places it after that step's tokens.
            self._predicted = sum(self.policy.expected_tokens(seq.seq_id, d) for seq in seqs)
            rows = []
            for seq, k in zip(seqs, room):
                fed = bool(seq.pending or seq.verifying)
                r = row(seq, seq.num_tokens + seq.pending - 1,
                        [0 if fed else seq.all_ids[-1]] + [0] * int(k), True)
                r.feed = fed
                rows.append(r)
            return rows
        proposal = self.proposer.propose(seqs, room)
        # What the policy expects these rows to emit, for its calibration (``spec_metrics``).
        self._predicted = sum(self.policy.expected_tokens(seq.seq_id, n)
                              for seq, n in zip(seqs, proposal.num_draft))
        rows = []
        for i, seq in enumerate(seqs):
            k = int(proposal.num_draft[i])
            extra = [0] * k if proposal.tokens is None else list(proposal.tokens[i, :k])
            rows.append(row(seq, seq.num_tokens - 1, [seq.all_ids[-1]] + extra, True))
        return rows

    def worth_verifying(self, seqs: list, rows: list) -> bool:
        """The policy's choice again, now that each row's number of drafts is known (host
        proposals only: device drafts always fill each row's room, as ``lookahead`` assumed)."""
        drafts = [len(r.tokens) - 1 for r in rows]
        if self.device_lookup and any(seq.verifying for seq in seqs):
            return True  # a row after a verify in flight is placed on the device only
        if not any(drafts):
            return False
        if self.proposer.device_drafts or self.spec.method == "eagle" or self.device_lookup:
            return True
        n = len(seqs)
        return self.policy.speculate([s.seq_id for s in seqs], self.runner.decode_bucket(n),
                                     self.runner.decode_bucket(n, verify=True), drafts)

    def shadow(self, seqs: list, rows: Optional[list] = None) -> dict:
        """For a plain decode step of an adaptive n-gram engine: the first draft of some rows
        (seq_id -> draft), which ``note_decoded`` checks against the token the step emits.

        The policy's acceptance estimates move only on verify steps, so once they fall below
        break-even the step-level rule would never verify again, even after a request starts
        copying its input. Checking a draft against a plain step's token observes exactly the
        first-position acceptance event (a point-mass draft x is accepted with probability
        p(x), the chance of drawing x), without verifying. ``rows``: the verify rows this step
        already proposed (then every row's first draft is checked); else SHADOW_ROWS rows,
        round-robin, are looked up (~0.1 ms each on a 700-token row). ``seqs`` must hold every
        token before the one their row takes (async scheduling looks a row up once its input
        token has landed, while the step runs)."""
        if (self.spec is None or self.spec.method != "ngram" or not self.policy.adaptive
                or not seqs):
            return {}
        if rows is not None:
            return {seq.seq_id: int(row.tokens[1]) for seq, row in zip(seqs, rows)
                    if len(row.tokens) > 1}
        n = min(SHADOW_ROWS, len(seqs))
        pick = [seqs[(self._shadow_next + i) % len(seqs)] for i in range(n)]
        self._shadow_next = (self._shadow_next + n) % len(seqs)
        proposal = self.proposer.propose(pick, np.ones(n, np.int32))
        return {seq.seq_id: int(proposal.tokens[i, 0]) for i, seq in enumerate(pick)
                if proposal.num_draft[i] > 0}

    def note_decoded(self, seqs: list, res, shadow: dict) -> None:
        """After a plain decode step: each shadowed row's first draft (``shadow``, from
        ``shadow``) against its token, as one first-position outcome for the policy."""
        if not shadow:
            return
        for j, seq in enumerate(seqs):
            draft = shadow.get(seq.seq_id)
            if draft is None:
                continue
            hit = int(int(res.tokens[j, 0]) == draft)
            self.policy.record(seq.seq_id, 1, hit)
            self.stats["spec_shadow_rows"] = self.stats.get("spec_shadow_rows", 0) + 1
            self.stats["spec_shadow_hits"] = self.stats.get("spec_shadow_hits", 0) + hit

    def tick(self, seqs: list) -> None:
        """One more step for the policy's per-sequence bookkeeping (verified or not)."""
        if self.spec is not None:
            self.policy.tick([seq.seq_id for seq in seqs])

    def head_drafts(self) -> bool:
        """Whether an EAGLE head drafts at the end of this step: the policy decides the next
        step's verify now (from the same rows), and a step verifies only after one drafted."""
        if self.spec is None or self.spec.method != "eagle":
            return False
        self._drafted = self.lookahead(ahead=True) > 0
        return self._drafted

    def drafts(self, plan, batch, verify: bool):
        """The proposer's share of the step: a draft model mirrors the prefill chunks, and
        gives a verify step its device drafts and distributions ((None, None) otherwise)."""
        drafts = probs = None
        if self.spec is not None:
            if plan.prefill:
                self.proposer.prefill(batch, len(batch.parts) - 1, plan.prefill)
            if verify:
                drafts, probs = self.proposer.drafts(plan.decode, batch)
        return drafts, probs

    # ------------------------------------------------------------------ after the step
    def timed(self, plan, batch, verify: bool, elapsed: float) -> None:
        """The step's time (draft + verify, or plain decode) for ``spec_metrics`` and, for a
        step without prefill chunks, for the policy's per-bucket step times."""
        if self.spec is not None and plan.decode:
            key = "spec_verify_time_s" if verify else "spec_decode_time_s"
            self.stats[key] = self.stats.get(key, 0.0) + elapsed  # draft + verify, or decode
            if not plan.prefill:
                bucket = batch.parts[0].block_tables.shape[0]
                self.policy.time("verify" if verify else "decode", bucket, elapsed)

    def note_verified(self, seqs: list, res) -> None:
        """Acceptance statistics of a verify step, for the policy, the proposer and metrics."""
        d = self.spec.num_speculative_tokens
        accepted = np.asarray(res.num_accepted[: len(seqs)])
        self.proposer.accepted(seqs, accepted)
        num_draft = np.asarray(res.num_draft[: len(seqs)])  # each row's drafts (the step's)
        self.stats["spec_predicted_tokens"] = (self.stats.get("spec_predicted_tokens", 0.0)
                                               + self._predicted)
        proposed_at = self.stats.setdefault("spec_proposed_per_pos", [0] * d)
        accepted_at = self.stats.setdefault("spec_accepted_per_pos", [0] * d)
        for seq, drafted, n in zip(seqs, num_draft, accepted):
            drafted, n = int(drafted), int(n)
            # (device lookup: the policy chose to verify not knowing whether drafts exist, so
            # a row that found none counts as a first-position miss)
            self.policy.record(seq.seq_id, max(drafted, int(
                self.device_lookup and self.policy.proposes(seq.seq_id))), n)
            req = self.requests.get(seq.request_id)
            if req is not None:
                req.metrics.spec_proposed += drafted
                req.metrics.spec_accepted += n
            self.stats["spec_proposed"] = self.stats.get("spec_proposed", 0) + drafted
            self.stats["spec_accepted"] = self.stats.get("spec_accepted", 0) + n
            self.stats["spec_verify_rows"] = self.stats.get("spec_verify_rows", 0) + 1
            for j in range(drafted):
                proposed_at[j] += 1
            for j in range(n):
                accepted_at[j] += 1

    def metrics(self) -> dict:
        """``spec_metrics`` of this engine's stats."""
        return spec_metrics(self.stats)
