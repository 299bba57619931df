"""LLM: the offline batch API, shaped like vLLM's ``LLM.generate`` / ``LLM.chat``."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from llmserve.data_parallel import make_engine
from llmserve.engine import EngineConfig
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams

Prompt = Union[str, Sequence[int], dict]


class LLM:
    """Loads a model and serves batches of prompts with continuous batching.

    ``model`` is a Hugging Face directory (config.json + safetensors + tokenizer.json), a
    ``.gguf`` file, or None for the built-in SmolLM2-135M-Instruct. Engine knobs follow vLLM:
    ``max_model_len``, ``max_num_seqs``, ``page_size`` (vLLM's block_size), ``num_pages`` or
    ``kv_cache_memory`` (bytes), ``enable_prefix_caching``, ``scheduling`` and ``backend``;
    ``tensor_parallel_size`` (weights and KV cache split over that many devices) and
    ``data_parallel_size`` (independent replicas behind one router), see llmserve/sharding.py.
    ``skip_tokenizer_init=True`` (as in vLLM) loads no tokenizer: prompts must be token ids and
    outputs carry token ids with empty text (random-weight benchmarks on machines without the
    SmolLM2 package).
    """

    def __init__(self, model: Optional[str] = None, *, dtype: str = "auto",
                 max_model_len: int = 2048, max_num_seqs: int = 32, page_size: int = 16,
                 num_pages: Optional[int] = None, kv_cache_memory: Optional[int] = None,
                 backend: Optional[str] = None, enable_prefix_caching: bool = True,
                 max_num_batched_tokens: int = 512, scheduling: str = "continuous",
                 seed: int = 0, tokenizer: Any = None, params: Any = None,
                 model_config: Any = None, warmup: bool = True,
                 gpu_memory_utilization: Optional[float] = None,
                 speculative_model: Optional[str] = None,
                 num_speculative_tokens: Optional[int] = None,
                 skip_tokenizer_init: bool = False, **engine_kwargs):
        from llmserve.checkpoint import load_checkpoint
        from llmserve.progress import phase

        engine_kwargs = _speculative_kwargs(engine_kwargs, speculative_model,
                                            num_speculative_tokens)
        if backend is not None:
            _check_backend_here(backend)
        # Every engine knob is checked before the (slow) checkpoint load.
        config = EngineConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                              page_size=page_size, num_pages=num_pages,
                              kv_cache_memory=kv_cache_memory, backend=backend,
                              enable_prefix_caching=enable_prefix_caching,
                              max_num_batched_tokens=max_num_batched_tokens,
                              scheduling=scheduling, seed=seed,
                              gpu_memory_utilization=gpu_memory_utilization, **engine_kwargs)
        config.validate()
        if params is not None:
            if model_config is None:
                raise ValueError("LLM(params=...) also needs model_config=")
            cfg = model_config
        else:
            with phase(f"loading {model or 'SmolLM2-135M-Instruct'} ({dtype})"):
                cfg, params = load_checkpoint(model, dtype=dtype)
        if skip_tokenizer_init and tokenizer is not None:
            raise ValueError("LLM(skip_tokenizer_init=True) takes no tokenizer=")
        if not skip_tokenizer_init and tokenizer is None and (model is None
                                                              or isinstance(model, str)):
            tokenizer = _load_tokenizer(model)
        self.model = model
        self.tokenizer = tokenizer
        config.max_model_len = min(max_model_len, cfg.max_position_embeddings)
        with phase("building the engine (KV cache, device params)"):
            self.engine = make_engine(cfg, params, tokenizer, config)
        if warmup:
            with phase("compiling the step shapes (once per process)") as info:
                self.engine.warmup()
                count = getattr(self.engine.runner, "num_compilations", None)
                info["detail"] = f"{count()} executables" if count else ""

    @property
    def config(self):
        return self.engine.cfg

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates completions for all prompts; returns outputs in prompt order.

        Every prompt is validated before any is queued: one bad prompt raises ValueError and
        nothing from this call runs.
        """
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} SamplingParams for "
                                 f"{len(prompts)} prompts")
        ids = self._add_all(prompts, params_list)
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Chat: one conversation (a list of {"role", "content"}) or a list of them."""
        if self.tokenizer is None:
            raise ValueError("LLM.chat needs a tokenizer with a chat template")
        convs = _as_conversations(messages)
        prompts = [self.tokenizer.apply_chat_template(
            c, add_generation_prompt=add_generation_prompt) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _add_all(self, prompts, params_list) -> list[str]:
        engine = self.engine
        # Validate everything first so a bad prompt leaves no request behind.
        for p, sp in zip(prompts, params_list):
            engine.check_request(p, sp)
        base = engine._counter
        return [engine.add_request(f"gen-{base}-{i}", p, sp)
                for i, (p, sp) in enumerate(zip(prompts, params_list))]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        wanted = set(ids)
        while len(done) < len(ids):
            if not self.engine.has_unfinished_requests():
                raise RuntimeError("engine has no work but requests are unfinished")
            for out in self.engine.step():
                if out.finished and out.request_id in wanted and out.request_id not in done:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]


def _as_conversations(messages) -> list[list[dict]]:
    """One conversation or a list of them, each checked (``check_conversation``)."""
    from llmserve.tokenizer import check_conversation

    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("LLM.chat needs a non-empty list of messages (or of conversations)")
    convs = [messages] if isinstance(messages[0], dict) else list(messages)
    for c, conv in enumerate(convs):
        check_conversation(conv, f"conversation {c}")
    return [list(c) for c in convs]


def _speculative_kwargs(engine_kwargs: dict, model, num_tokens) -> dict:
    """vLLM's older spelling (``speculative_model=``, ``num_speculative_tokens=``) as a
    ``speculative_config``."""
    if model is None and num_tokens is None:
        return engine_kwargs
    if engine_kwargs.get("speculative_config") is not None:
        raise ValueError("give speculative_config or speculative_model/num_speculative_tokens, "
                         "not both")
    if model is None or num_tokens is None:
        raise ValueError("speculative_model and num_speculative_tokens go together")
    method = "ngram" if model in ("[ngram]", "ngram") else "draft"
    spec = {"method": method, "num_speculative_tokens": num_tokens}
    if method == "draft":
        spec["model"] = model
    return dict(engine_kwargs, speculative_config=spec)


def _check_backend_here(backend: str) -> None:
    """The compiled Pallas backend needs a GPU and the "cpu" backend a CPU with its native
    kernel built; say so before anything is loaded."""
    import jax

    from llmserve.ops import cpu_kernels
    from llmserve.ops.attention import check_backend

    check_backend(backend)
    if backend == "pallas" and jax.default_backend() != "gpu":
        raise ValueError(f"backend='pallas' compiles Triton kernels and needs a GPU; this "
                         f"machine runs jax on {jax.default_backend()!r}. Use 'pallas_interpret' "
                         "(the same kernels, interpreted), 'cpu' or 'xla' on CPU")
    if backend == "cpu":
        if jax.default_backend() != "cpu":
            raise ValueError(f"backend='cpu' runs a native CPU kernel; this machine runs jax on "
                             f"{jax.default_backend()!r}: use 'pallas' or 'xla'")
        reason = cpu_kernels.unavailable_reason()
        if reason is not None:
            raise ValueError(f"backend='cpu' needs its native kernel, which cannot be built "
                             f"here ({reason}); use 'xla'")


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts


def _load_tokenizer(model: Optional[str]):
    import os

    from llmserve import tokenizer as tok

    if model is None:
        from llmserve.checkpoint.gguf import default_model_path

        return tok.Tokenizer.from_gguf(default_model_path())
    if model.endswith(".gguf"):
        return tok.Tokenizer.from_gguf(model)
    if os.path.exists(os.path.join(model, "tokenizer.json")):
        return tok.Tokenizer.from_pretrained_dir(model)
    return None
