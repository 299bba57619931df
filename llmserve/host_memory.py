"""Opt-in host allocator settings that keep XLA:CPU's large per-step buffers off the page-fault
path: ``LLMSERVE_MALLOC_TUNING=1``.

XLA:CPU allocates each step's temporary arena (about 250 MB for a 256-row SmolLM2 step, most of
it for the LM head) with ``malloc`` from its worker threads and frees it at the end of the step.
glibc serves any request above its mmap threshold (at most 32 MB) with a fresh ``mmap``, and a
worker thread's own arena does the same for anything larger than its 64 MB heap, so every wide
step maps, faults in page by page and unmaps a quarter of a gigabyte.

Three ``mallopt`` settings stop it: one arena (``M_ARENA_MAX=1``) so the big buffers come from
the main heap, no mmap for large chunks (``M_MMAP_MAX=0``) and no trimming of the heap's top
(``M_TRIM_THRESHOLD`` at its maximum). Once the heap has grown to its working size (the first
few wide steps), the next step reuses the freed arena without a fault.

Why it is opt-in (measured on the 2-core CI machine, SmolLM2-135M bf16, see the README's
"Host memory" section): at 256 decode rows it takes a step from ~24,000 minor faults and
50-80 ms of kernel time to 0-3 faults and ~10-20 ms, but the step's wall time moved only
~5% (median 343 vs 360 ms, alternating processes, inside the machine's noise), end-to-end
256-slot throughput not at all (524 vs 527 tok/s side by side), and peak RSS rose 6-7% (the heap
keeps its high-water mark and fragments while it grows). vLLM's CPU backend answers the same
problem by asking for tcmalloc through ``LD_PRELOAD``.

The settings only work before the threads that allocate exist (a thread keeps the arena it
attached to first), so ``configure()`` runs when ``llmserve`` is imported. If JAX's backend
already exists by then, it does nothing and says how to set the same from the environment at
process start (``MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647``).
Only glibc is touched; elsewhere this is a no-op.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys

_LOG = logging.getLogger(__name__)

OPT_IN = "LLMSERVE_MALLOC_TUNING"  # "1" applies the settings at import

# (mallopt parameter number from glibc's <malloc.h>, value, the environment variable glibc reads
# for the same setting at process start).
SETTINGS = ((-8, 1, "MALLOC_ARENA_MAX"),  # M_ARENA_MAX: one arena
            (-4, 0, "MALLOC_MMAP_MAX_"),  # M_MMAP_MAX: never mmap a chunk
            (-1, 2**31 - 1, "MALLOC_TRIM_THRESHOLD_"))  # M_TRIM_THRESHOLD: never trim
ENV_HINT = " ".join(f"{env}={value}" for _, value, env in SETTINGS)

# What configure() decided, for logs and tests: "applied", "disabled" (not asked for),
# "unsupported", "too_late" (the backend already existed), "environment" (too late, but the
# environment set it at process start), or None before the first call.
status: str | None = None


def _jax_backend_started() -> bool:
    """True when a JAX backend (and so XLA's worker threads) already exists in this process."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(getattr(bridge, "_backends", None))


def _glibc():
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _decide() -> str:
    if os.environ.get(OPT_IN, "0") != "1":
        return "disabled"
    libc = _glibc()
    if libc is None:
        return "unsupported"
    if _jax_backend_started():
        if all(os.environ.get(env) for _, _, env in SETTINGS[:2]):
            return "environment"
        _LOG.warning(
            "llmserve was imported after JAX started its backend, so glibc's allocator keeps "
            "mmapping XLA:CPU's large per-step buffers (page faults every step). Set %s in the "
            "environment at process start, or import llmserve before running any JAX "
            "computation.", ENV_HINT)
        return "too_late"
    ok = all(libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1
             for param, value, _ in SETTINGS)
    _LOG.info("glibc malloc: one arena, no mmap for large chunks, no heap trimming (%s=1)", OPT_IN)
    return "applied" if ok else "unsupported"


def configure() -> str:
    """Apply the allocator settings once per process; returns what happened (see ``status``)."""
    global status
    if status is None:
        status = _decide()
    return status
