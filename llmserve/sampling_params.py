"""SamplingParams: the per-request knobs, with vLLM's names, defaults and validation; and
SamplingArrays, their per-row array form in a step batch (host numpy; ``llmserve.sampling``
registers it as a pytree). No jax here."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import numbers
from typing import Any, Optional, Sequence, Union

import numpy as np

_SEED_MASK = 0x7FFFFFFF  # seeds are 31-bit: they fit a signed int32 and a uint32 alike


def child_seed(seed: int, index: int) -> int:
    """The seed of completion ``index`` of a request seeded ``seed`` (n > 1), 31 bits.

    ``child_seed(s, 0) == s & 0x7FFFFFFF``, so the first completion of an n > 1 request equals
    the n = 1 request with the same seed. Other children take the first 4 bytes (little-endian)
    of ``sha256(b"llmserve-child" + seed.to_bytes(8, "little") + index.to_bytes(8, "little"))``
    masked to 31 bits: a stable mix, the same in every process, and unlike ``seed + index`` it
    does not collide with the request seeded ``seed + 1``.
    """
    if index == 0:
        return int(seed) & _SEED_MASK
    data = (b"llmserve-child" + (int(seed) & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
            + int(index).to_bytes(8, "little"))
    return int.from_bytes(hashlib.sha256(data).digest()[:4], "little") & _SEED_MASK


def request_seed(engine_seed: int, request_id: str) -> int:
    """The seed of an unseeded request: a stable 31-bit mix of the engine seed and request id.

    Python's ``hash`` of a string is randomised per process; this is not, so ``LLM(seed=0)``
    gives the same samples in every run.
    """
    data = f"llmserve-request\0{int(engine_seed)}\0{request_id}".encode("utf-8")
    return int.from_bytes(hashlib.sha256(data).digest()[:4], "little") & _SEED_MASK


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request (vLLM-compatible fields).

    temperature 0 means greedy. top_k <= 0 (or -1) and top_p = 1 disable truncation.
    ``seed`` makes a request's samples reproducible and independent of its batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: Optional[Union[str, Sequence[str]]] = None
    stop_token_ids: Optional[Sequence[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None  # top-n per prompt position (scored outside the step)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise TypeError(f"SamplingParams.stop={self.stop!r}: must be a string or a list of "
                            "strings")
        self.stop = list(self.stop or [])
        ids = list(self.stop_token_ids or [])
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in ids):
            raise TypeError(f"SamplingParams.stop_token_ids={self.stop_token_ids!r}: must be a "
                            "list of ints")
        self.stop_token_ids = [int(t) for t in ids]
        self.validate()

    def validate(self) -> None:
        """Raises TypeError (wrong type) or ValueError (bad value) naming the first bad field."""
        def bad(field, why, exc=ValueError):
            raise exc(f"SamplingParams.{field}={getattr(self, field)!r}: {why}")

        def real(field):  # a finite real number (bool is not a number here)
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                bad(field, "must be a number", TypeError)
            if not math.isfinite(v):
                bad(field, "must be finite (not NaN or inf)")
            return v

        def integer(field, optional=False):
            v = getattr(self, field)
            if v is None and optional:
                return None
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                bad(field, "must be an int", TypeError)
            return v

        if integer("n") < 1:
            bad("n", "must be an int >= 1")
        if real("temperature") < 0:
            bad("temperature", "must be >= 0")
        if not 0.0 < real("top_p") <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if integer("top_k") < -1:
            bad("top_k", "must be -1 (disabled), 0 (disabled) or a positive int")
        if not 0.0 <= real("min_p") <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not -2.0 <= real("presence_penalty") <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= real("frequency_penalty") <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if real("repetition_penalty") <= 0:
            bad("repetition_penalty", "must be > 0")
        max_tokens = integer("max_tokens", optional=True)
        if max_tokens is not None and max_tokens < 1:
            bad("max_tokens", "must be an int >= 1")
        if integer("min_tokens") < 0 or (max_tokens is not None and self.min_tokens > max_tokens):
            bad("min_tokens", "must be in [0, max_tokens]")
        logprobs = integer("logprobs", optional=True)
        if logprobs is not None and not 0 <= logprobs <= 20:
            bad("logprobs", "must be in [0, 20]")
        prompt_logprobs = integer("prompt_logprobs", optional=True)
        if prompt_logprobs is not None and not 0 <= prompt_logprobs <= 20:
            bad("prompt_logprobs", "must be in [0, 20]")
        integer("seed", optional=True)
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str)
                                                           for s in self.stop):
            bad("stop", "must be a string or a list of strings", TypeError)
        if any(not s for s in self.stop):
            bad("stop", "stop strings must be non-empty")
        if not isinstance(self.stop_token_ids, (list, tuple)) or any(
                isinstance(t, bool) or not isinstance(t, numbers.Integral)
                for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of ints", TypeError)
        for field in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, field), bool):
                bad(field, "must be a bool", TypeError)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# The neutral value of each per-row sampling field; the field order of SamplingArrays.
NEUTRAL: dict[str, Any] = {
    "temperature": 0.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "seed": 0,
}
_ARRAY_DTYPES = {
    "temperature": np.float32,
    "top_k": np.int32,
    "top_p": np.float32,
    "min_p": np.float32,
    "presence_penalty": np.float32,
    "frequency_penalty": np.float32,
    "repetition_penalty": np.float32,
    "seed": np.uint32,
}


@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters; every field is an array of shape [B] (numpy on the host,
    jax arrays inside a step)."""

    temperature: Any  # [B] f32; < 1e-5 => greedy
    top_k: Any  # [B] i32; <= 0 (or >= V) => disabled
    top_p: Any  # [B] f32; >= 1.0 => disabled
    min_p: Any  # [B] f32; <= 0 => disabled
    presence_penalty: Any  # [B] f32; 0 => disabled
    frequency_penalty: Any  # [B] f32; 0 => disabled
    repetition_penalty: Any  # [B] f32; 1.0 => disabled
    seed: Any  # [B] u32; per-request seed

    def replace(self, **changes) -> SamplingArrays:
        return dataclasses.replace(self, **changes)

    @classmethod
    def neutral(cls, batch: int) -> SamplingArrays:
        """Greedy, every filter and penalty disabled, seed 0, for `batch` rows."""
        return cls.from_lists([{}] * batch)

    @classmethod
    def from_lists(cls, rows: Sequence[dict[str, Any]]) -> SamplingArrays:
        """One dict per row (keys = field names; missing or None => neutral), as numpy arrays
        (a runner batch moves to the device in one ``device_put``)."""
        for row in rows:
            unknown = set(row) - set(NEUTRAL)
            if unknown:
                raise ValueError(f"unknown sampling fields {sorted(unknown)}; know {list(NEUTRAL)}")
        cols = {}
        for name, default in NEUTRAL.items():
            vals = [default if row.get(name) is None else row[name] for row in rows]
            if name == "seed":  # Python ints of any size wrap into u32.
                vals = [int(v) & 0xFFFFFFFF for v in vals]
            cols[name] = np.asarray(vals, dtype=_ARRAY_DTYPES[name]).reshape(len(rows))
        return cls(**cols)
