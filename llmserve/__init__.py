"""llmserve: a JAX research framework for fast LLM inference.

Public face: ``LLM`` (offline batch API, vLLM-compatible), ``SamplingParams``, ``RequestOutput``,
``EngineConfig`` and ``Engine`` (add_request / step / abort).
"""

from llmserve import host_memory

# Before anything below can start JAX's CPU backend: see llmserve/host_memory.py.
host_memory.configure()

from llmserve.engine import Engine, EngineConfig  # noqa: E402
from llmserve.llm import LLM  # noqa: E402
from llmserve.outputs import CompletionOutput, RequestOutput  # noqa: E402
from llmserve.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig",
           "Engine"]
