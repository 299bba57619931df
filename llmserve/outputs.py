"""RequestOutput and CompletionOutput, shaped like vLLM's."""

from __future__ import annotations

import dataclasses
from typing import Optional


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
