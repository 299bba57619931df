"""The OpenAI wire format: request models and errors in, JSON and server-sent events out.

Pure translation between OpenAI's HTTP bodies and llmserve's ``SamplingParams`` /
``RequestOutput``: ``parse_body`` and the pydantic request models (unknown, unsupported or
badly typed fields are an ``APIError`` 400 naming the parameter), and the response pieces:
logprobs, streamed text deltas, SSE events, echoed prompts, usage and stop reasons. No engine,
no threads, no routes.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from llmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llmserve.server.app import OpenAIServing  # only CompletionEcho's annotation

# OpenAI parameters we know and do not implement: rejected by name rather than ignored.
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format",
               "logit_bias", "parallel_tool_calls", "suffix", "best_of", "audio", "modalities",
               "prediction", "web_search_options")


# ---------------------------------------------------------------------------------- errors
class APIError(Exception):
    """An error answered as OpenAI's JSON: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: Optional[str] = None) -> APIError:
    """A 400 naming the offending parameter."""
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def params_error(e: ValueError) -> APIError:
    """Maps SamplingParams' ``ValueError("SamplingParams.<field>=...")`` to a 400 on the field."""
    m = re.search(r"SamplingParams\.(\w+)", str(e))
    return bad_request(str(e), m.group(1) if m else None)


# ---------------------------------------------------------------------------------- requests
class _Strict(BaseModel):
    # Unknown fields, NaN/inf and type coercions ("5" for an int) are all 400s.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields both endpoints share; vLLM's extensions (top_k, min_p, ...) included."""

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    max_tokens: Optional[int] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # accepted and ignored

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int]
                        ) -> SamplingParams:
        """SamplingParams for these fields; a bad value raises APIError(400, param=field)."""
        kw = {k: getattr(self, k) for k in (
            "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty") if getattr(self, k) is not None}
        try:
            return SamplingParams(
                n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output, **kw)
        except ValueError as e:
            raise params_error(e) from None


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    echo: bool = False
    logprobs: Optional[int] = None


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None


class ChatRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True


_FIELD_NAMES = {name for m in (CompletionRequest, ChatRequest, ChatMessage, StreamOptions)
                for name in m.model_fields}


def parse_body(raw: bytes, model: type[BaseModel]):
    """JSON body -> request model; malformed JSON, unknown or unsupported fields -> 400."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    for name in UNSUPPORTED:
        if name in data:
            raise bad_request(f"'{name}' is not supported by this server", name)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        # loc mixes field names with list indices and union tags ("str", "list[int]").
        param = ".".join(x for x in err["loc"] if x in _FIELD_NAMES) or None
        if err["type"] == "extra_forbidden":
            param = ".".join(str(x) for x in err["loc"] if not isinstance(x, int))
            raise bad_request(f"unknown parameter '{param}'", param) from None
        raise bad_request(f"invalid value for '{param}': {err['msg']}", param) from None

# ---------------------------------------------------------------------------------- text
class TextDelta:
    """Streamed text of one choice: what is new since the last chunk.

    With stop strings, the last ``max(len(stop)) - 1`` characters are held back until the
    request ends, because the engine trims a stop string that completes in a later token; so
    the chunks always concatenate to exactly the final (non-streamed) text.
    """

    def __init__(self, stop: list[str]):
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.sent = ""
        self.num_tokens = 0

    def update(self, text: str, finished: bool) -> str:
        """The text to send now, given the choice's cumulative ``text``."""
        end = len(text) if finished else max(len(self.sent), len(text) - self.holdback)
        if not text.startswith(self.sent):  # never expected: resend nothing, keep going
            return ""
        delta = text[len(self.sent):end]
        self.sent += delta
        return delta


def _token_str(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer, ids: list[int], entries: list, num_top: int,
                        offset: int = 0) -> dict:
    """OpenAI completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset.

    ``entries`` are the engine's (or scorer's) per-token dicts, chosen token first; ``None``
    for the first prompt token.
    """
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, entry in zip(ids, entries):
        s = _token_str(tokenizer, tid)
        out["tokens"].append(s)
        out["text_offset"].append(offset)
        offset += len(s)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(entry[tid])
        top = {}
        for t, lp in _top(entry, num_top):
            top.setdefault(_token_str(tokenizer, t), lp)
        out["top_logprobs"].append(top)
    return out


def _top(entry: dict, num_top: int) -> list:
    """The top-n alternatives of an entry ``{chosen: lp, alternatives...}``: the chosen token
    counts among them when it is one of the n most likely (the entry then has n items)."""
    items = list(entry.items())
    return items[1:] if len(items) > num_top else items


def chat_logprobs(tokenizer, ids: list[int], entries: list, num_top: int) -> dict:
    """OpenAI chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for tid, entry in zip(ids, entries):
        s = _token_str(tokenizer, tid)
        top = [{"token": _token_str(tokenizer, t), "logprob": lp,
                "bytes": list(_token_str(tokenizer, t).encode())}
               for t, lp in _top(entry, num_top)]
        content.append({"token": s, "logprob": entry[tid], "bytes": list(s.encode()),
                        "top_logprobs": top})
    return {"content": content}


def sse(payload: Union[dict, str]) -> str:
    """One server-sent event: ``data: <payload as JSON, or the string as is>`` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


# ---------------------------------------------------------------------------------- responses
@dataclasses.dataclass
class Prompt:
    """One prompt of a request: its text (None when sent as token ids) and its token ids."""

    text: Optional[str]
    ids: list[int]


class CompletionEcho:
    """The echoed prompt text and its logprobs for each prompt of a completions request."""

    def __init__(self, serving: OpenAIServing, req: CompletionRequest, prompts: list[Prompt],
                 scores: Optional[list[list]], n: int):
        self.serving, self.req, self.prompts, self.scores = serving, req, prompts, scores

    def text(self, i: int) -> str:
        if not self.req.echo:
            return ""
        p = self.prompts[i]
        return p.text if p.text is not None else self.serving.tokenizer.decode(p.ids)

    def logprobs(self, i: int, out) -> dict:
        """Prompt logprobs (when echoing) followed by the completion's."""
        tok = self.serving.tokenizer
        ids, entries = [], []
        if self.req.echo:
            ids += self.prompts[i].ids
            entries += self.scores[i]
        if out is not None:
            ids += out.token_ids
            entries += out.logprobs or []
        return completion_logprobs(tok, ids, entries, self.req.logprobs)


def stop_reason(o) -> Optional[Union[int, str]]:
    """A choice's ``stop_reason`` (the stop string or token id that ended it), else None."""
    return None if o is None or o.stop_reason is None else o.stop_reason


def usage(prompts: list[Prompt], finals, n: int) -> dict:
    """OpenAI ``usage``: prompt, completion and total tokens over all prompts and choices."""
    prompt_tokens = sum(len(p.ids) for p in prompts)
    completion = sum(len(o.token_ids) for f in finals if f is not None for o in f.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}
