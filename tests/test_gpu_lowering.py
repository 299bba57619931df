"""The Pallas kernels lower for "cuda" on a CPU-only jaxlib, as Triton custom calls.

Every kernel configuration the engine uses on GPU is traced with abstract shapes and lowered
with ``lowering_platforms=("cuda",)``; the module must hold the Triton custom call
(jaxlib <= 0.10.2: ``__gpu$xla.gpu.triton`` carrying the serialized Triton IR; later jaxlibs
compile in the lowering and emit ``triton_kernel_call``). This runs JAX's whole Pallas->Triton
lowering (power-of-two shapes, supported primitives, compiler params) without a GPU; only PTX
generation and the run itself are left to a GPU machine.

The lowering runs under an abstract mesh of one abstract H200 where jax has
``AbstractDevice`` (jax 0.11 wants a device kind to lower for an absent platform; 0.10.2 works
with or without it).
"""

from __future__ import annotations

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import pytest

from llmserve.ops import flash_attention as fa
from llmserve.ops import paged_attention as pa

TRITON_CALL = re.compile(r"__gpu\$xla\.gpu\.triton|triton_kernel_call")
spec = jax.ShapeDtypeStruct
i32 = jnp.int32


def abstract_gpu():
    """A context with one abstract "NVIDIA H200" device, or a null context on old jax."""
    try:
        from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
    except ImportError:
        return contextlib.nullcontext()
    try:
        device = AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    except TypeError:  # a jax with different AbstractDevice fields
        device = AbstractDevice(device_kind="NVIDIA H200")
    return use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device))


def lower_for_cuda(f, *args) -> str:
    """StableHLO text of f lowered for cuda (no GPU needed)."""
    with abstract_gpu():
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# Prefill: (N, K, H) — SmolLM2 9/3, and G = 1, 4, 8 at H = 64/128.
FLASH = [(9, 3, 64), (4, 4, 64), (8, 2, 128), (8, 1, 128)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n,kh,h", FLASH, ids=lambda x: str(x))
def test_flash_attention_lowers_to_triton(n, kh, h, dtype):
    b, t, s = 2, 300, 512  # T not a block multiple: the padding path lowers too
    args = (spec((b, t, n, h), dtype), spec((b, s, kh, h), dtype), spec((b, s, kh, h), dtype),
            spec((b,), i32), spec((b,), i32))
    text = lower_for_cuda(fa.flash_attention, *args)
    assert TRITON_CALL.search(text), text[:2000]
    assert "llmserve_flash_attention" in text


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("t", [1, 5, 8])  # decode, verify (R = 4), a prefill block
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("n,kh,h", [(9, 3, 64), (8, 1, 128)], ids=lambda x: str(x))
def test_paged_attention_lowers_to_triton(n, kh, h, page_size, t, dtype):
    b, pages, m = 8, 64, 8
    args = (spec((b, t, n, h), dtype), spec((kh, pages, page_size, h), dtype),
            spec((kh, pages, page_size, h), dtype), spec((b, m), i32), spec((b,), i32),
            spec((b,), i32))
    text = lower_for_cuda(pa.paged_attention, *args)
    assert TRITON_CALL.search(text), text[:2000]


def test_compiler_params_reach_the_kernel():
    """num_warps / num_stages are passed explicitly (else jax >= 0.10 may pick Mosaic GPU)."""
    args = (spec((1, 64, 4, 64), jnp.bfloat16), spec((1, 64, 1, 64), jnp.bfloat16),
            spec((1, 64, 1, 64), jnp.bfloat16), spec((1,), i32), spec((1,), i32))
    f = functools.partial(fa.flash_attention, num_warps=8, num_stages=3)
    text = lower_for_cuda(f, *args)
    if "__gpu$xla.gpu.triton" in text:  # jaxlib <= 0.10.2 keeps the params as attributes
        assert re.search(r"num_warps = 8", text) and re.search(r"num_stages = 3", text)
    else:
        assert TRITON_CALL.search(text)
