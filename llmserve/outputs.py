"""RequestOutput and CompletionOutput, shaped like vLLM's, and the output processor that
turns sampled tokens into them (detokenization, stop checks, logprobs)."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence

if TYPE_CHECKING:
    from llmserve.sampling_params import SamplingParams


@dataclasses.dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list[dict[int, float]]] = None  # per token: {token_id: logprob}
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | None while running
    stop_reason: Optional[object] = None  # the stop string or token id that ended it
    cumulative_logprob: Optional[float] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Timing of one request (seconds since the epoch) and its speculative-decoding counters."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0


@dataclasses.dataclass
class RequestOutput:
    """The state of one request: its prompt and its completions so far."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: Optional[RequestMetrics] = None


@dataclasses.dataclass
class RequestState:
    """The engine's record of one request: its sequences and their text so far."""

    request_id: str
    prompt: Optional[str]
    prompt_ids: list[int]
    params: "SamplingParams"
    seqs: list  # scheduler Sequences, one per completion
    metrics: RequestMetrics
    detok: list  # IncrementalDetokenizer per completion ([] without a tokenizer)
    texts: list[str]
    stop_from: list[int]  # per completion: stop strings may only match from here (min_tokens)


class OutputProcessor:
    """Host side of every sampled token: logprobs, detokenization, stop checks, and the
    ``RequestOutput`` a step returns. Holds the requests in flight; imports no jax.

    ``finish(seq, reason, stop_reason)`` is the engine's way to end a sequence (it frees the
    sequence's pages and slot at once).
    """

    def __init__(self, tokenizer, eos_ids: set, max_model_len: int,
                 finish: Callable[..., None], stats: dict):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.finish = finish
        self.stats = stats
        self.requests: dict[str, RequestState] = {}

    def add(self, request_id: str, prompt: Optional[str], prompt_ids: list[int], params,
            seqs: list) -> None:
        """Registers a validated request and its sequences."""
        detok = []
        if self.tokenizer is not None:
            from llmserve.tokenizer import IncrementalDetokenizer

            detok = [IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
                     for _ in seqs]
        self.requests[request_id] = RequestState(
            request_id, prompt, prompt_ids, params, seqs, RequestMetrics(time.time()), detok,
            ["" for _ in seqs], [0 for _ in seqs])

    def stop_ids(self, seq) -> set:
        """Token ids that end ``seq`` (its stop_token_ids, plus EOS unless ignore_eos)."""
        ids = set(seq.params.stop_token_ids)
        if not seq.params.ignore_eos:
            ids |= self.eos_ids
        return ids

    def append(self, seq, token: int, logprob: float, top: Sequence[tuple] = ()) -> None:
        """Adds one sampled token to ``seq``: logprobs, text, then the stop checks in vLLM's
        order (stop token, stop string, max_tokens / max_model_len)."""
        p = seq.params
        seq.output_ids.append(token)
        self.stats["generated_tokens"] += 1
        if p.logprobs is not None:
            entry = {token: logprob}
            for tid, lp in list(top)[: p.logprobs]:
                entry.setdefault(int(tid), float(lp))
            seq.logprobs.append(entry)
        seq.cumulative_logprob += logprob
        req = self.requests.get(seq.request_id)
        if req is not None and req.metrics.first_token_time is None:
            req.metrics.first_token_time = time.time()
        n_out = len(seq.output_ids)
        prev_len = 0
        if req is not None and req.detok:
            prev_len = len(req.texts[seq.index])
            req.texts[seq.index] += req.detok[seq.index].add(token)
            if n_out == p.min_tokens:
                req.stop_from[seq.index] = len(req.texts[seq.index])
        if n_out >= p.min_tokens and token in self.stop_ids(seq):
            self.finish(seq, "stop", token)
        elif req is not None and p.stop and n_out >= p.min_tokens and \
                self._hit_stop_str(req, seq, prev_len):
            pass
        elif (p.max_tokens is not None and n_out >= p.max_tokens) or \
                seq.num_tokens >= self.max_model_len:
            self.finish(seq, "length")

    def _hit_stop_str(self, req: RequestState, seq, prev_len: int) -> bool:
        """Ends ``seq`` at the first stop string that ends in the text this token added.

        A match may start in earlier text only as far back as the stop string reaches
        (``prev_len - len(stop) + 1``), and never before the text of the first ``min_tokens``
        tokens (``stop_from``): text already returned is never cut retroactively.
        """
        text = req.texts[seq.index]
        best = None
        for s in seq.params.stop:
            pos = text.find(s, max(prev_len - len(s) + 1, req.stop_from[seq.index], 0))
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return False
        pos, s = best
        keep = pos + len(s) if seq.params.include_stop_str_in_output else pos
        req.texts[seq.index] = text[:keep]
        self.finish(seq, "stop", s)
        return True

    def output(self, req: RequestState) -> RequestOutput:
        """The request's ``RequestOutput`` now (text is cumulative, as in vLLM); a finished
        request is dropped from ``requests``."""
        outs = []
        for seq in req.seqs:
            if req.detok:
                text = req.texts[seq.index]
            elif self.tokenizer is not None:
                text = self.tokenizer.decode(seq.output_ids,
                                             skip_special_tokens=seq.params.skip_special_tokens)
            else:
                text = ""
            outs.append(CompletionOutput(
                index=seq.index, text=text, token_ids=list(seq.output_ids),
                logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                cumulative_logprob=seq.cumulative_logprob))
        finished = all(s.finished for s in req.seqs)
        req.metrics.num_preemptions = sum(s.num_preemptions for s in req.seqs)
        req.metrics.num_cached_tokens = req.seqs[0].num_cached
        if finished:
            for seq in req.seqs:  # emit text held back for an incomplete character
                if req.detok and not isinstance(seq.stop_reason, str):
                    outs[seq.index].text += req.detok[seq.index].flush()
            req.metrics.finished_time = req.metrics.finished_time or time.time()
            self.requests.pop(req.request_id, None)
        return RequestOutput(request_id=req.request_id, prompt=req.prompt,
                             prompt_token_ids=list(req.prompt_ids), outputs=outs,
                             finished=finished, metrics=req.metrics)
