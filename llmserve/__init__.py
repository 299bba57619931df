"""llmserve: a JAX research framework for fast LLM inference.

Public face: ``LLM`` (offline batch API, vLLM-compatible), ``SamplingParams``, ``RequestOutput``,
``EngineConfig`` and ``Engine`` (add_request / step / abort).
"""

from llmserve.engine import Engine, EngineConfig
from llmserve.llm import LLM
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig",
           "Engine"]
