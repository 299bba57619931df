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


# ------------------------------------------------------------------ transparent huge pages
# glibc (2.35+) madvises the memory it maps for malloc as transparent-huge-page memory when
# started with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``. On a kernel whose THP mode is
# "madvise" (the common default) that is what XLA:CPU's weights and its per-step temporaries
# otherwise miss: a wide step then faults its temporaries in 2 MiB at a time instead of 4 KiB,
# and the weight matmuls walk fewer TLB entries. Measured on the 2-core machine (2026-12-07,
# SmolLM2-135M bf16, 256 requests at 256 slots, alternating processes): 611 / 618 tok/s with the
# tunable against 566 / 561 without (+9%); see the README's "Host memory" section.
#
# glibc reads tunables only when a process starts, so the ``llmserve`` command, ``make demo``
# and the experiments re-execute themselves once with it (``reexec_with_hugepages``, before any
# work); a library user sets it in the environment. ``LLMSERVE_HUGEPAGES=0`` opts out.
HUGEPAGES_OPT_OUT = "LLMSERVE_HUGEPAGES"  # "0": never re-execute for huge pages
HUGETLB_TUNABLE = "glibc.malloc.hugetlb=1"
# Set in the re-executed process, to GLIBC_TUNABLES as the user launched it: it stops a second
# re-exec and lets subprocesses that should run as they ship (the vLLM baseline) get it back.
REEXEC_MARK = "LLMSERVE_HUGEPAGES_REEXEC"
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_ENABLED) -> str | None:
    """The kernel's THP mode ("always", "madvise" or "never"), or None where it cannot be read."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def _glibc_version(libc: tuple[str, str]) -> tuple[int, ...]:
    name, version = libc
    if name != "glibc":
        return ()
    try:
        return tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        return ()


def hugepage_env(environ, *, libc: tuple[str, str] | None = None,
                 thp: str | None = None, system: str | None = None) -> dict | None:
    """The environment to re-execute this process with so that glibc's malloc asks for
    transparent huge pages, or None when that would change nothing: opted out, already
    re-executed, not glibc >= 2.35 on Linux, a THP mode other than "madvise" ("always" already
    gives them, "never" refuses them), or the tunable already chosen by the user."""
    if environ.get(HUGEPAGES_OPT_OUT) == "0" or REEXEC_MARK in environ:
        return None
    if (sys.platform if system is None else system) != "linux":
        return None
    if _glibc_version(platform.libc_ver() if libc is None else libc) < (2, 35):
        return None
    if (thp_mode() if thp is None else thp) != "madvise":
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb=" in tunables:
        return None
    env = dict(environ)
    env[REEXEC_MARK] = tunables
    env["GLIBC_TUNABLES"] = f"{tunables}:{HUGETLB_TUNABLE}" if tunables else HUGETLB_TUNABLE
    return env


def reexec_with_hugepages() -> None:
    """Replace this process with itself, started with the huge-page tunable, when
    ``hugepage_env`` says that changes something; otherwise return. Call it first thing in an
    entry point (``__main__``), never from library code: the process starts over."""
    env = hugepage_env(os.environ)
    argv = list(getattr(sys, "orig_argv", ()))
    if env is None or not argv or argv[1:2] == ["-"]:  # (stdin is consumed: cannot rerun)
        return
    _LOG.info("re-executing with GLIBC_TUNABLES=%s (transparent huge pages for malloc; "
              "%s=0 opts out)", env["GLIBC_TUNABLES"], HUGEPAGES_OPT_OUT)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)


def launch_environ(environ=None) -> dict:
    """The environment as the user launched this process: without what the huge-page re-exec
    added (for subprocesses that should run as they ship, like the vLLM baseline)."""
    env = dict(os.environ if environ is None else environ)
    if REEXEC_MARK in env:
        original = env.pop(REEXEC_MARK)
        if original:
            env["GLIBC_TUNABLES"] = original
        else:
            env.pop("GLIBC_TUNABLES", None)
    return env


def hugepages_active(environ=None) -> bool:
    """True when this process's malloc was started with the huge-page tunable on."""
    tunables = (os.environ if environ is None else environ).get("GLIBC_TUNABLES", "")
    return any(t.startswith("glibc.malloc.hugetlb=") and t != "glibc.malloc.hugetlb=0"
               for t in tunables.split(":"))


_hinted = False


def log_hugepage_hint_once() -> None:
    """Logs (at INFO, once per process) how to get huge pages when this process could have had
    them but has not: library use on a "madvise" THP kernel."""
    global _hinted
    if _hinted or hugepage_env(os.environ) is None:
        return
    _hinted = True
    _LOG.info("glibc malloc runs without transparent huge pages; start Python with "
              "GLIBC_TUNABLES=%s for faster wide CPU steps (the llmserve command and the "
              "experiments do this themselves; %s=0 silences this)", HUGETLB_TUNABLE,
              HUGEPAGES_OPT_OUT)
