"""``EngineConfig``: the serving knobs (vLLM names where they exist), validated before an
engine builds anything, and the KV pool's size from them. ``llmserve.engine`` re-exports it."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from llmserve.config import ModelConfig


@dataclasses.dataclass
class EngineConfig:
    """Serving knobs (vLLM names where they exist)."""

    max_model_len: int = 2048
    max_num_seqs: int = 32
    page_size: int = 16
    num_pages: Optional[int] = None  # default: every slot can hold max_model_len tokens
    kv_cache_memory: Optional[int] = None  # bytes; alternative to num_pages
    max_num_batched_tokens: int = 512
    # Prefill parts [rows, tokens per row]: blocks of 8 tokens, a chunk spanning as many rows
    # as it needs, so chunks of any length pack into 32-512 flat tokens (the step's cost
    # follows them) and every block attends in the native CPU kernel (8 tokens x G heads per
    # kv head). Measured (SmolLM2 bf16 beside 16 decode rows): 512 prompt tokens 214 ms as
    # 64 x 8 vs 306 ms as the old 4 x 128 rectangles; 128 tokens 83 vs 112 ms. Steps of
    # 1.5x between the powers of two (96, 192, 384 tokens): a freed slot's prompt of ~100
    # tokens otherwise pads to 128, and the heavy-tailed workload (512 requests, bf16, two
    # alternations) ran 55.5 / 55.5 s against 59.9 / 58.7 s with the powers of two alone
    # (prefill slots 89.3% vs 85.8% real tokens), for 6 more executables at warm-up.
    prefill_buckets: tuple = ((4, 8), (8, 8), (12, 8), (16, 8), (24, 8), (32, 8), (48, 8),
                              (64, 8))
    max_prefill_seqs: int = 8  # prompt chunks one step may carry (its prefill sampled rows)
    decode_buckets: Optional[tuple] = None  # default: by dtype (batch.default_decode_buckets)
    mixed_decode_buckets: Optional[tuple] = None  # decode rows beside prefill chunks
    # Speculation's verify rows [B, 1 + D] (default: 1, 2, 4 and the decode buckets; the
    # largest must hold max_num_seqs rows). Fewer buckets, fewer step shapes to compile.
    verify_buckets: Optional[tuple] = None
    # Bitwise batch invariance: a request's tokens and logprobs never depend on what shares
    # its steps, on chunking, caching or preemption (runner.invariant_min_rows).
    batch_invariant: bool = False
    enable_prefix_caching: bool = True
    scheduling: str = "continuous"  # or "static"
    # Continuous: while every waiting request fits the free slots and their prompts need more
    # than one step, steps carry prefill only (scheduler.py); False always mixes decode rows in
    # (steadier inter-token latency for running streams, the server's default).
    prefill_first: bool = True
    # "paged": pages as a sequence grows; "contiguous": max_model_len reserved at admission
    # (the pre-PagedAttention baseline, for ablations; see block_manager.py)
    kv_reservation: str = "paged"
    backend: Optional[str] = None  # None: ops.attention.default_backend() ("cpu" on CPU)
    max_logprobs: int = 5
    seed: int = 0
    speculative_config: Optional[dict] = None  # {"method": "ngram"|"draft", "model": ..., K}
    # vLLM's knob: the fraction of device memory (system memory on CPU) for weights + KV cache.
    gpu_memory_utilization: Optional[float] = None
    # Model parallelism over a ("data", "model") mesh (vLLM names; see llmserve/sharding.py):
    # weights and KV cache split over tensor_parallel_size devices; data_parallel_size
    # replicas, each with its own slots and pages (llmserve/data_parallel.py routes to them).
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # vLLM's knob: schedule and launch step n + 1 before step n's tokens reach the host (the
    # device feeds each row its slot's last token), then process step n's outputs while step
    # n + 1 runs. A speculative engine verifies synchronously (its drafts need every token on
    # the host), and with an EAGLE head or multi-host serving the engine steps synchronously.
    async_scheduling: bool = True

    def validate(self) -> None:
        """Raises TypeError/ValueError naming the first bad field (before anything is built)."""
        def check(field, ok, why, optional=False, kind=int):
            v = getattr(self, field)
            if v is None and optional:
                return
            if isinstance(v, bool) or not isinstance(v, kind):
                raise TypeError(f"EngineConfig.{field}={v!r}: must be {kind.__name__}")
            if not ok(v):
                raise ValueError(f"EngineConfig.{field}={v!r}: {why}")

        check("max_model_len", lambda v: v >= 2, "must be an int >= 2")
        check("max_num_seqs", lambda v: v >= 1, "must be an int >= 1")
        check("page_size", lambda v: v >= 1, "must be an int >= 1")
        check("num_pages", lambda v: v >= 2, "must be an int >= 2", optional=True)
        check("kv_cache_memory", lambda v: v > 0, "must be > 0 bytes", optional=True)
        check("max_num_batched_tokens", lambda v: v >= 1, "must be an int >= 1")
        check("max_prefill_seqs", lambda v: v >= 1, "must be an int >= 1")
        check("max_logprobs", lambda v: 0 <= v <= 20, "must be in [0, 20]")
        check("seed", lambda v: True, "")
        check("tensor_parallel_size", lambda v: v >= 1, "must be an int >= 1")
        check("data_parallel_size", lambda v: v >= 1, "must be an int >= 1")
        check("gpu_memory_utilization", lambda v: 0 < v <= 1, "must be in (0, 1]",
              optional=True, kind=float)
        for flag in ("prefill_first", "async_scheduling"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"EngineConfig.{flag}={getattr(self, flag)!r}: must be bool")
        if self.scheduling not in ("continuous", "static"):
            raise ValueError(f"EngineConfig.scheduling={self.scheduling!r}: use 'continuous' "
                             "or 'static'")
        pages_per_seq = -(-self.max_model_len // self.page_size)
        if self.num_pages is not None and self.num_pages < pages_per_seq + 1:
            raise ValueError(
                f"KV cache of {self.num_pages} pages cannot hold one sequence of max_model_len="
                f"{self.max_model_len} ({pages_per_seq} pages of {self.page_size} + 1 dummy)")
        if self.verify_buckets is not None:
            vb = self.verify_buckets
            if (not isinstance(vb, (tuple, list)) or not vb
                    or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in vb)):
                raise ValueError(f"EngineConfig.verify_buckets={vb!r}: must be a non-empty tuple "
                                 "of ints >= 1")
            if max(vb) < self.max_num_seqs:
                raise ValueError(f"EngineConfig.verify_buckets={vb!r}: the largest must hold "
                                 f"max_num_seqs={self.max_num_seqs} rows")
        if self.speculative_config is not None:
            from llmserve.speculative.policy import SpeculativeConfig

            SpeculativeConfig.from_dict(self.speculative_config)
        given = [k for k in ("num_pages", "kv_cache_memory", "gpu_memory_utilization")
                 if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"EngineConfig: give at most one of num_pages, kv_cache_memory, "
                             f"gpu_memory_utilization (got {', '.join(given)})")

    def resolve_num_pages(self, cfg: ModelConfig, weight_bytes: int = 0) -> int:
        """Pages in the pool: given, from a byte budget, or enough for every slot at full length.

        ``gpu_memory_utilization`` sizes the pool as that fraction of the device's memory (on
        CPU: of the system's available memory) minus the weights' bytes.
        """
        itemsize = np.dtype(cfg.jnp_dtype).itemsize
        per_page = 2 * cfg.n_layers * cfg.n_kv_heads * self.page_size * cfg.head_dim * itemsize
        if self.num_pages is not None:
            return int(self.num_pages)
        if self.kv_cache_memory is not None:
            return int(self.kv_cache_memory // per_page)
        if self.gpu_memory_utilization is not None:
            from llmserve.runner import device_memory_bytes  # (jax: only when asked)

            budget = self.gpu_memory_utilization * device_memory_bytes() - weight_bytes
            if budget < 2 * per_page:
                raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} leaves "
                                 f"{max(budget, 0) / 2**20:.1f} MiB for the KV cache after "
                                 f"{weight_bytes / 2**20:.1f} MiB of weights")
            return int(budget // per_page)
        return self.max_num_seqs * -(-self.max_model_len // self.page_size) + 1
