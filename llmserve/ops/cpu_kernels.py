"""Native CPU kernels as XLA FFI custom calls (``csrc/cpu_kernels.cc``): paged attention, and a
row log-sum-exp with a fixed reduction order.

Paged attention. Why: XLA:CPU can only express paged attention as a gather of the pages
through the block table followed by batched matmuls (``paged_attention.paged_attention_xla``):
7-9x the memory roof, and the gather alone 2.3-5x. The C++ kernel walks each (sequence, kv
head)'s pages in place, so every K/V byte is read once, converts each page to float32 in L1 and
scores all T*G query rows of the head group against it with an online softmax (float32
throughout). Items are spread over XLA's own CPU thread pool. Each item's arithmetic has a fixed
order and depends only on its own row, so the kernel is batch invariant by construction.

Row log-sum-exp (``row_logsumexp_cpu``): XLA:CPU compiles exp and the sum over the vocabulary
differently in different fusions, so one logits row's log-sum-exp could differ by an ulp between
a decode step and a verify step; the batch-invariant mode takes it from here instead.

Row argmax (``row_argmax_cpu``): the greedy token of every row. XLA:CPU runs it as two
reductions over the vocabulary (0.19 ms for a verify step's 10 rows of 49,152 logits, jitted
alone); the kernel makes one pass per row, rows spread over XLA's thread pool.

Sampling (``sample_cpu``): temperature, top-k, top-p, min-p and the categorical draw of every
sampled row. The jnp path finds the top-k / top-p thresholds by bisection, up to 32 passes over
the logits each (281 ms for top-p on 256 rows of 49,152); the kernel selects them by radix
selection in a few passes per row. Oracle: ``sampling``'s jnp path.

Weight matmuls (``matmul_bf16_cpu``, ``matmul_f32_cpu``, ``matmul_blocked_many``): float32
accumulation, each row independent of the others; AVX512_BF16 (AVX2 + FMA without AVX-512),
and on CPUs with AMX the tile unit for bf16 (``amx_matmul``), which reads its weights in the
paired layout (``block_weight(..., paired=True)``) in place.

Build: the first call compiles the source with the system C++ compiler (``$CXX``, else ``g++``,
``-O3 -march=native``) into a cache directory (``$LLMSERVE_CACHE_DIR``, else
``~/.cache/llmserve``; the temporary directory when that is not writable) keyed by the source,
the flags, the compiler and the host CPU, and registers it with XLA; later processes load the
cached library (~3 s to build once).
``available()`` says whether that worked; ``attention.default_backend()`` picks this kernel
("cpu") on CPU when it is available and falls back to the XLA path otherwise, logging why.

Semantics: those of every backend (``attention.py``); the oracle is
``paged_attention.paged_attention_reference``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from llmserve.config import cpu_flags
from llmserve.ops.paged_attention import check_paged_shapes, paged_attention_reference

Array = jax.Array
logger = logging.getLogger("llmserve")

TARGETS = {"llmserve_paged_attention_cpu": "LlmservePagedAttention",
           "llmserve_row_logsumexp_cpu": "LlmserveRowLogsumexp",
           "llmserve_row_argmax_cpu": "LlmserveRowArgmax",
           "llmserve_sample_cpu": "LlmserveSample",
           "llmserve_matmul_bf16_cpu": "LlmserveMatmulBf16",
           "llmserve_matmul_f32_cpu": "LlmserveMatmulF32",
           "llmserve_matmul_blocked_many_cpu": "LlmserveMatmulBlockedMany"}  # XLA name -> C
SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cc"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-shared",
         "-fPIC", "-w")


MAX_PAGE_SIZE = 64  # the kernel's per-page score accumulators hold at most this many keys


class NativeBuildError(RuntimeError):
    """The native kernel could not be built or loaded (no compiler, a compile error, ...)."""


def cache_dir() -> Path:
    """Where built libraries are kept: ``$LLMSERVE_CACHE_DIR`` or ``~/.cache/llmserve``."""
    root = os.environ.get("LLMSERVE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "llmserve")
    return Path(root) / "native"


def _cpu_fingerprint() -> str:
    """The host CPU's model and feature flags (``-march=native`` code runs only on such CPUs)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _compiler() -> str:
    cxx = os.environ.get("CXX") or "g++"
    path = shutil.which(cxx)
    if path is None:
        raise NativeBuildError(f"no C++ compiler: {cxx!r} is not on PATH (set $CXX)")
    return path


def build(force: bool = False) -> Path:
    """Compiles the kernel (or finds it cached) and returns the shared library's path."""
    cxx = _compiler()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeBuildError(f"{cxx} --version failed: {e}") from e
    source = SOURCE.read_bytes()
    include = jax.ffi.include_dir()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(),
                                     _cpu_fingerprint().encode(), include.encode()]))
    name = f"cpu_kernels-{key.hexdigest()[:16]}.so"
    out = cache_dir() / name
    if out.exists() and not force:
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(out.parent, os.W_OK):
            raise PermissionError(str(out.parent))
    except OSError:  # a read-only home: build into the temporary directory instead
        out = Path(tempfile.gettempdir()) / f"llmserve-native-{os.getuid()}" / name
        if out.exists() and not force:
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
    # Build into a temporary name, then rename: parallel test workers may build at once.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *FLAGS, f"-I{include}", str(SOURCE), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        os.unlink(tmp)
        raise NativeBuildError(f"compiling {SOURCE.name} failed: {e}") from e
    if proc.returncode != 0:
        os.unlink(tmp)
        raise NativeBuildError(f"compiling {SOURCE.name} failed ({' '.join(cmd)}):\n"
                               f"{proc.stderr[-2000:]}")
    os.replace(tmp, out)
    return out


@functools.lru_cache(maxsize=None)
def _load() -> Optional[str]:
    """Builds, loads and registers the kernel once per process; returns why not, or None."""
    if os.environ.get("LLMSERVE_NATIVE", "1") == "0":
        return "disabled by LLMSERVE_NATIVE=0"
    try:
        path = build()
        lib = ctypes.cdll.LoadLibrary(str(path))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")
        _HAS_BF16_MATMUL.append(bool(lib.LlmserveHasBf16Matmul()))
        _HAS_F32_MATMUL.append(bool(lib.LlmserveHasF32Matmul()))
        _LIB.append(lib)
        if os.environ.get(AMX_OPT_OUT) == "0":
            lib.LlmserveAmxMatmul(0)
    except (NativeBuildError, OSError, AttributeError) as e:
        return str(e)
    return None


_HAS_BF16_MATMUL: list = []  # filled by _load: whether the build has a bf16 matmul
_HAS_F32_MATMUL: list = []  # ... and a float32 matmul
_LIB: list = []  # ... and the loaded library
AMX_OPT_OUT = "LLMSERVE_AMX"  # "0": the native bf16 matmuls keep to AVX512_BF16 on AMX CPUs


def amx_matmul(enabled: Optional[bool] = None) -> bool:
    """Whether the native bf16 matmuls run on AMX tiles (``csrc/cpu_kernels.cc``: on CPUs with
    AMX, where the build has it and Linux grants the tile state; ``LLMSERVE_AMX=0`` turns it off
    at load). ``enabled`` switches it for the process from the next call on: True where
    available, False for the AVX512_BF16 kernels (A/B runs and tests). The choice is made inside
    each call, so compiled steps are unchanged and nothing recompiles."""
    if _load() is not None or not _LIB:
        return False
    return bool(_LIB[0].LlmserveAmxMatmul(-1 if enabled is None else int(bool(enabled))))


def has_bf16_matmul() -> bool:
    """True when the native bf16 matmul is usable here (the kernel built, and the CPU has
    AVX512_BF16, or AVX2 + FMA, where bf16 is widened to float32 in registers); the model then
    routes its bf16 weight matmuls to it on the "cpu" backend where ``native_matmul_wins``."""
    if os.environ.get("LLMSERVE_NATIVE_MATMUL", "1") == "0":
        return False
    return _load() is None and bool(_HAS_BF16_MATMUL and _HAS_BF16_MATMUL[0])


# On a CPU with AMX the native bf16 matmuls run on the tiles themselves (``amx_matmul``; the
# weights in the paired layout, ``paired_weights_apply``) and win at every row count. SmolLM2's
# weight matmuls of one step (``python -m experiments.matmul``, 2-core AMX Xeon, 2026-12-07),
# ms, XLA's dot / native AVX512_BF16 (blocked) / native AMX (paired): 1 row 29.8 / 13.1 / 15.6,
# 8 rows 28.8 / 24.8 / 14.7, 16 rows 37.9 / 37.5 / 19.0, 32 rows 35.6 / 65.3 / 24.4, 64 rows
# 42.1 / 111 / 27.0, 256 rows 85.9 / - / 85.3, 512 rows 143.2 / - / 149.0 (the last within
# noise: every row count stays native, so a verify row is bitwise a decode row).
# Without the tiles (``LLMSERVE_AMX=0``, or a build or kernel without them), from this many rows
# XLA's dot beats the native matmuls on a CPU with AMX: XLA:CPU's dot kernels use the tiles
# there (oneDNN), the AVX-512 kernels cannot. Measured on a 2-core AMX Xeon
# (SmolLM2's [576, 1536] and tied [49152, 576] weights, jax 0.10.2): bf16 XLA / native time 0.86
# and 0.39 at 8 rows, 0.23 / 0.30 at 32, 0.11 / 0.29 at 512, but 6.3 / 13.9 at one row and
# 2.0 / 0.76 at two. AMX has no float32 tiles: fp32 XLA / native time is 0.37-1.17 by shape
# and row count, and a whole SmolLM2 run (32 requests x 64 tokens) is 5% faster native, so
# float32 keeps the native kernel.
AMX_XLA_MIN_ROWS = 8
# Without AMX, bf16 stays native at every row count, though XLA's dot is faster per step from
# about 96 rows on an AVX512_BF16 Zen 4 (whole SmolLM2 step probes, the two rules in
# alternating processes: a 512-token prefill step 307.5 vs 341.7-345.5 ms, a 128-row decode
# step 160.8 vs 173.5). End to end it lost or tied: the bf16 heavy tail (512 requests,
# 16 slots) 124.8 / 124.7 s against 123.1 / 122.3 native, and 256 requests at 256 slots
# 78.8 / 76.8 s against 77.4 / 78.6 (2026-12-06; README, the `cpu` backend).


@functools.lru_cache(maxsize=None)
def cpu_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the CPU advertises AMX bf16 tiles (``amx_bf16`` in /proc/cpuinfo's flags)."""
    return "amx_bf16" in cpu_flags(cpuinfo)


# CPUs without AVX-512 (AMD Zen 2/3, older Intel) get the AVX2 + FMA kernels. Measured on a
# 2-core AMD EPYC (Zen 3), a whole SmolLM2 step's weight matmuls streaming all weights
# (``python -m experiments.matmul --rows=1,2,4,8,16,32,64,128,256,512``, jax 0.10.2), ms:
#   bf16 XLA / native: 27.9 / 23.6 at 1 row, 63.3 / 36.6 at 8, 112.5 / 81.3 at 32, 354.5 /
#         254.5 at 128, 1366 / 1034 at 512: native at every row count (XLA's bf16 dots are
#         emulated there);
#   fp32 XLA / native: 24.0 / 35.2 at 1 row (XLA's matrix-vector path), 36.3 / 32.8 at 2, 54.6
#         / 48.5 at 8, 64.4 / 62.0 at 16, 94 / 92-96 at 32, 132.5 / 156.6 at 64, 854 / 1084
#         at 512: native from 2 to 31 rows.
AVX2_F32_ROWS = (2, 32)  # fp32: native for lo <= rows < hi


@functools.lru_cache(maxsize=None)
def cpu_has_avx512(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the CPU advertises AVX-512F (``avx512f`` in /proc/cpuinfo's flags)."""
    return "avx512f" in cpu_flags(cpuinfo)


def native_matmul_wins(dtype, rows: int) -> bool:
    """Whether the native matmul is the faster one for ``rows`` rows of ``dtype`` weights here.

    ``LLMSERVE_NATIVE_MATMUL``: "1" always (where it applies), "0" never (``has_*_matmul``),
    unset or "auto" by measurement:
      - AVX-512 without AMX: the native kernels win (1.3-1.6x XLA's bf16 dots at 1-64 rows on
        an AVX512_BF16 Xeon);
      - AMX (``cpu_has_amx``): the native kernels' AMX tiles (``amx_matmul``) win at every row
        count; without them (``LLMSERVE_AMX=0``, or a build or kernel that has none) XLA's dot
        wins bf16 from ``AMX_XLA_MIN_ROWS`` rows up; float32 stays native;
      - AVX2 only (no ``cpu_has_avx512``): bf16 always native, float32 native for row
        counts in ``AVX2_F32_ROWS`` and XLA's dot elsewhere.
    The choice is made at trace time from static shapes, so a compiled step never branches."""
    mode = os.environ.get("LLMSERVE_NATIVE_MATMUL", "auto")
    if mode == "1":
        return True
    bf16 = jnp.dtype(dtype) == jnp.bfloat16
    if not cpu_has_avx512():
        lo, hi = AVX2_F32_ROWS
        return bf16 or lo <= rows < hi
    if not bf16:
        return True
    return rows < AMX_XLA_MIN_ROWS or not cpu_has_amx() or amx_matmul()


# The blocked weight layout of the native [K, N] matmuls: w [K, N] stored as [N / 64, K, 64],
# each 64-column block (one work item of the kernels) K contiguous rows. Why: in the [K, N]
# layout a block is 128 (bf16) or 256 (f32) bytes of every N-wide row, a strided walk that this
# CPU's hardware prefetchers serve at ~10 GB/s a core, against ~25-30 for a contiguous stream
# (AMD Zen 4, a C++ harness over SmolLM2's down projection, one core: 1 row 0.185 -> 0.058 ms,
# 16 rows 0.215 -> 0.139, 32 rows 0.354 -> 0.263). Decode steps of few rows stream every weight
# once, so they run at that bandwidth. The kernels read the same values in the same order from
# either layout: results are bitwise equal. ``Runner`` blocks a model's Dense kernels once, at
# construction, where ``blocked_weights_apply``; ``model.Dense`` takes either layout.
BLOCK_COLUMNS = 64
PAIRED_WIDTH = 2 * BLOCK_COLUMNS  # the paired layout's rows: 64 columns of bf16 pairs
BLOCKED_WEIGHTS_OPT_OUT = "LLMSERVE_BLOCKED_WEIGHTS"  # "0": keep the [K, N] layout


def block_weight(w, paired: bool = False):
    """w [K, N] (N % 64 == 0; numpy or jax) -> the blocked layout [N / 64, K, 64], same type;
    ``paired`` (bf16, K even): the paired layout [N / 64, K / 2, 128] instead, each block's rows
    k and k + 1 interleaved (element (p, 2 c + j) of block b is w[2 p + j, 64 b + c]): the
    operand layout of AMX's tile multiply and of vdpbf16ps, read in place by both."""
    k, n = w.shape
    if n % BLOCK_COLUMNS:
        raise ValueError(f"block_weight: N={n} is not a multiple of {BLOCK_COLUMNS}")
    if paired and k % 2:
        raise ValueError(f"block_weight: a paired layout needs an even K, got K={k}")
    xp = np if isinstance(w, np.ndarray) else jnp
    if paired:  # [K / 2, 2, N / 64, 64] -> [N / 64, K / 2, 64, 2]
        out = xp.transpose(w.reshape(k // 2, 2, n // BLOCK_COLUMNS, BLOCK_COLUMNS), (2, 0, 3, 1))
        out = out.reshape(n // BLOCK_COLUMNS, k // 2, PAIRED_WIDTH)
    else:
        out = xp.transpose(w.reshape(k, n // BLOCK_COLUMNS, BLOCK_COLUMNS), (1, 0, 2))
    return np.ascontiguousarray(out) if xp is np else out


def is_paired(w) -> bool:
    """Whether a 3-D weight is in the paired layout (``block_weight(..., paired=True)``)."""
    return getattr(w, "ndim", 0) == 3 and w.shape[2] == PAIRED_WIDTH


def unblock_weight(w):
    """The blocked layout [N / 64, K, 64] or the paired one [N / 64, K / 2, 128] -> w [K, N]
    (``block_weight``'s inverse)."""
    xp = np if isinstance(w, np.ndarray) else jnp
    nb = w.shape[0]
    if is_paired(w):
        p = w.shape[1]
        out = xp.transpose(w.reshape(nb, p, BLOCK_COLUMNS, 2), (1, 3, 0, 2))
        out = out.reshape(2 * p, nb * BLOCK_COLUMNS)
    else:
        out = xp.transpose(w, (1, 0, 2)).reshape(w.shape[1], nb * w.shape[2])
    return np.ascontiguousarray(out) if xp is np else out


def unblocked_shape(w) -> tuple:
    """[K, N] of a weight in the blocked or paired layout (``block_weight``)."""
    return (weight_rows(w), w.shape[0] * BLOCK_COLUMNS)


def weight_rows(w) -> int:
    """K of a weight in the blocked or paired layout (``block_weight``)."""
    return 2 * w.shape[1] if is_paired(w) else w.shape[1]


def paired_weights_apply(dtype) -> bool:
    """Whether ``dtype`` weights take the paired layout here rather than the blocked one: bf16
    where the native matmuls run on AMX tiles (``amx_matmul``), which load the paired layout in
    place. Elsewhere (AVX512_BF16 alone, float32) the blocked layout stays."""
    return jnp.dtype(dtype) == jnp.bfloat16 and amx_matmul()


def blocked_shape(k: int, n: int, dtype) -> Optional[tuple]:
    """The shape ``block_params`` gives a [k, n] weight of ``dtype`` here (blocked, or paired
    where ``paired_weights_apply``), or None where the native matmul does not take it (N % 64,
    and the [K, N] kernel's own shape rule)."""
    supported = (matmul_bf16_supported if jnp.dtype(dtype) == jnp.bfloat16
                 else matmul_f32_supported)
    if n % BLOCK_COLUMNS or not supported(k, n, False):
        return None
    if paired_weights_apply(dtype):
        return (n // BLOCK_COLUMNS, k // 2, PAIRED_WIDTH)
    return (n // BLOCK_COLUMNS, k, BLOCK_COLUMNS)


def blocked_matmul_supported(dtype) -> bool:
    """Whether this CPU's native matmul for ``dtype`` takes blocked weights (the AVX-512
    kernels: AVX512_BF16 for bf16, AVX-512F for float32; the AVX2 ones do not)."""
    if jnp.dtype(dtype) == jnp.bfloat16:
        return has_bf16_matmul() and "avx512_bf16" in cpu_flags()
    if jnp.dtype(dtype) == jnp.float32:
        return has_f32_matmul() and cpu_has_avx512()
    return False


FUSED_MATMULS_OPT_OUT = "LLMSERVE_FUSED_MATMULS"  # "0": a layer's q/k/v and gate/up apart


def fused_matmuls_apply(weights) -> bool:
    """Whether ``matmul_blocked_many`` serves these weights: all blocked ([N / 64, K, 64]), of
    one dtype and K, on a CPU whose native matmul takes blocked weights of that dtype (the
    choice is made at trace time), unless ``LLMSERVE_FUSED_MATMULS=0``."""
    if os.environ.get(FUSED_MATMULS_OPT_OUT) == "0" or not 1 <= len(weights) <= 8:
        return False
    first = weights[0]
    width = PAIRED_WIDTH if is_paired(first) and first.dtype == jnp.bfloat16 else BLOCK_COLUMNS
    return (all(getattr(w, "ndim", 0) == 3 and w.shape[1:] == first.shape[1:]
                and w.shape[2] == width and w.dtype == first.dtype for w in weights)
            and blocked_matmul_supported(first.dtype))


def matmul_blocked_many(x: Array, weights, live_rows: Optional[Array] = None) -> list:
    """x [M, K] @ each blocked w_j [N_j / 64, K, 64] (x's dtype, bf16 or float32) -> a list of
    [M, N_j] float32, in one native call whose work items are all the weights' column blocks
    (a layer's q/k/v or gate/up: the threads share them as they would one matmul's). Bitwise
    equal to ``matmul_bf16_cpu`` / ``matmul_f32_cpu`` of each weight alone; ``live_rows``: as
    there. Serving only (no derivative)."""
    weights = list(weights)
    if x.ndim != 2 or not fused_matmuls_apply(weights) or x.dtype != weights[0].dtype or (
            x.shape[1] != weight_rows(weights[0])):
        raise ValueError(f"want x [M, K] and 1-8 blocked weights [N / {BLOCK_COLUMNS}, K, "
                         f"{BLOCK_COLUMNS}] of x's dtype, on a CPU that takes them; got x "
                         f"{x.dtype}{x.shape}, w {[(w.dtype, w.shape) for w in weights]}")
    _require()
    shapes = [jax.ShapeDtypeStruct((x.shape[0], w.shape[0] * BLOCK_COLUMNS), jnp.float32)
              for w in weights]
    call = jax.ffi.ffi_call("llmserve_matmul_blocked_many_cpu", shapes,
                            vmap_method="sequential")
    return list(call(x, _live(x, live_rows), *weights))


def blocked_weights_apply(dtype) -> bool:
    """Whether a model's ``dtype`` weights should be blocked here (paired where
    ``paired_weights_apply``): the native matmul takes them and is the faster one at every row
    count (``native_matmul_wins``: not bf16 on an AMX CPU whose native kernels have no tiles,
    where XLA's dot, which reads the [K, N] layout, wins from 8 rows), unless
    ``LLMSERVE_BLOCKED_WEIGHTS=0``."""
    if os.environ.get(BLOCKED_WEIGHTS_OPT_OUT) == "0" or not blocked_matmul_supported(dtype):
        return False
    return all(native_matmul_wins(dtype, r) for r in (1, AMX_XLA_MIN_ROWS, 4096))


def block_params(params, dtype):
    """The weights with every blockable Dense kernel (a "kernel" leaf [K, N] of ``dtype``,
    ``blocked_shape``) in the blocked layout (the paired one where ``paired_weights_apply``);
    the rest, and the tree's structure, unchanged."""
    paired = paired_weights_apply(dtype)

    def leaf(path, value):
        if (getattr(path[-1], "key", None) == "kernel" and getattr(value, "ndim", 0) == 2
                and jnp.dtype(value.dtype) == jnp.dtype(dtype)
                and blocked_shape(*value.shape, dtype) is not None):
            return block_weight(value, paired=paired)
        return value
    return jax.tree_util.tree_map_with_path(leaf, params)


def device_weights(params, dtype, backend: str, sharded: bool = False):
    """A model's weights as a runner (or a draft model) keeps them: blocked
    (``block_params``) on the "cpu" backend, unsharded, where ``blocked_weights_apply``."""
    if backend == "cpu" and not sharded and blocked_weights_apply(dtype):
        return block_params(params, dtype)
    return params


def matmul_bf16_supported(k: int, n: int, transpose_w: bool) -> bool:
    """Whether the native matmul takes x [M, k] against a weight with n output columns."""
    return k % 32 == 0 and n % (4 if transpose_w else 32) == 0 and k > 0 and n > 0


def matmul_bf16_cpu(x: Array, w: Array, transpose_w: bool = False,
                    live_rows: Optional[Array] = None) -> Array:
    """x [M, K] bf16 @ w [K, N] (or w [N, K].T when ``transpose_w``) bf16 -> [M, N] float32,
    accumulated in float32 (vdpbf16ps: each bf16 product exact). Every row's arithmetic is
    independent of the other rows. CPU with AVX512_BF16 or AVX2 + FMA (``has_bf16_matmul``); the
    derivative is the plain jnp one (for training code that reaches it).

    ``live_rows`` (an int32 scalar, traced): only x's first ``live_rows`` rows are real (a
    step's bucket padding follows them); the kernel computes those and returns zeros for the
    rest, so a padded step costs what its real rows do. None: every row."""
    return _matmul_bf16(x, w, _live(x, live_rows), transpose_w)


def _live(x: Array, live_rows: Optional[Array]) -> Array:
    """The live-row operand of the native matmuls: an int32 scalar (all of x's rows when None)."""
    if live_rows is None:
        return jnp.asarray(x.shape[0], jnp.int32)
    return jnp.asarray(live_rows, jnp.int32).reshape(())


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _matmul_bf16(x: Array, w: Array, live: Array, transpose_w: bool) -> Array:
    return _native_matmul(x, w, live, transpose_w, "bf16", jnp.bfloat16, 32, 32, has_bf16_matmul,
                          "llmserve_matmul_bf16_cpu")


def _native_matmul(x: Array, w: Array, live: Array, transpose_w: bool, name: str, dtype,
                   k_mult: int, n_mult: int, usable, target: str) -> Array:
    """The shared checks and FFI call of the native matmuls (K % k_mult; N % n_mult for [K, N],
    N % 4 for the transposed [N, K]); ``live``: see ``matmul_bf16_cpu``."""
    if x.ndim != 2 or w.ndim not in (2, 3) or x.dtype != dtype or w.dtype != dtype:
        raise ValueError(f"want {name} x [M, K] and w 2-D (or blocked), got x {x.dtype}{x.shape}, "
                         f"w {w.dtype}{w.shape}")
    if w.ndim == 3:  # the blocked or paired layout (block_weight)
        widths = (BLOCK_COLUMNS, PAIRED_WIDTH) if dtype == jnp.bfloat16 else (BLOCK_COLUMNS,)
        if transpose_w or w.shape[2] not in widths:
            raise ValueError(f"blocked w must be [N / {BLOCK_COLUMNS}, K, {BLOCK_COLUMNS}] (or, "
                             f"bf16, paired [N / {BLOCK_COLUMNS}, K / 2, {PAIRED_WIDTH}]) and not "
                             f"transposed, got {w.shape} (transpose_w={transpose_w})")
        if not blocked_matmul_supported(dtype):
            raise NativeBuildError(f"this CPU (or build) has no blocked {name} matmul (AVX-512)")
        k, n = weight_rows(w), w.shape[0] * BLOCK_COLUMNS
    else:
        k, n = (w.shape[1], w.shape[0]) if transpose_w else w.shape
    n_need = 4 if transpose_w else n_mult
    if x.shape[1] != k or k % k_mult or n % n_need or k == 0 or n == 0:
        raise ValueError(f"matmul shapes x {x.shape}, w {w.shape} (transpose_w={transpose_w}): "
                         f"need matching K with K % {k_mult} == 0 and N % {n_need} == 0")
    _require()
    if not usable():
        raise NativeBuildError(f"this CPU (or build) has no native {name} matmul")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    return call(x, w, live, transpose_w=bool(transpose_w))


def matmul_bf16_reference(x: Array, w: Array, transpose_w: bool = False) -> Array:
    """The oracle: XLA's dot with float32 accumulation (a blocked w is unblocked first)."""
    if w.ndim == 3:
        w = unblock_weight(w)
    return jax.lax.dot_general(x, w, (((1,), (1 if transpose_w else 0,)), ((), ())),
                               preferred_element_type=jnp.float32)


def has_f32_matmul() -> bool:
    """True when the native float32 matmul is usable here (the kernel built, AVX-512F or AVX2 +
    FMA)."""
    if os.environ.get("LLMSERVE_NATIVE_MATMUL", "1") == "0":
        return False
    return _load() is None and bool(_HAS_F32_MATMUL and _HAS_F32_MATMUL[0])


def matmul_f32_supported(k: int, n: int, transpose_w: bool) -> bool:
    """Whether the native float32 matmul takes x [M, k] against n output columns."""
    return k % 16 == 0 and n % (4 if transpose_w else 16) == 0 and k > 0 and n > 0


def matmul_f32_cpu(x: Array, w: Array, transpose_w: bool = False,
                   live_rows: Optional[Array] = None) -> Array:
    """x [M, K] f32 @ w [K, N] (or w [N, K].T) f32 -> [M, N] f32: FMA in k order, every row
    independent of the others. CPU with AVX-512F or AVX2 + FMA (``has_f32_matmul``); the
    derivative is the plain jnp one. ``live_rows``: as in ``matmul_bf16_cpu``."""
    return _matmul_f32(x, w, _live(x, live_rows), transpose_w)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _matmul_f32(x: Array, w: Array, live: Array, transpose_w: bool) -> Array:
    return _native_matmul(x, w, live, transpose_w, "float32", jnp.float32, 16, 16,
                          has_f32_matmul, "llmserve_matmul_f32_cpu")


def _native_matmul_jvp(fn, transpose_w, primals, tangents):
    """Both native matmuls' derivative: XLA's dot (padding rows included; training passes every
    row as live)."""
    x, w, live = primals
    dx, dw, _ = tangents
    y = fn(x, w, live, transpose_w)
    return y, (matmul_bf16_reference(dx, w, transpose_w)
               + matmul_bf16_reference(x, dw, transpose_w))


_matmul_f32.defjvp(functools.partial(_native_matmul_jvp, _matmul_f32))
_matmul_bf16.defjvp(functools.partial(_native_matmul_jvp, _matmul_bf16))


def available() -> bool:
    """True when the kernel is built and registered (building it on the first call)."""
    return _load() is None


def unavailable_reason() -> Optional[str]:
    """Why the kernel cannot be used here (None when it can)."""
    return _load()


def paged_attention_cpu(q: Array, k_pages: Array, v_pages: Array, block_tables: Array,
                        q_start: Array, lengths: Array) -> Array:
    """Paged GQA attention: q [B, T, N, H] over pages [K, P, L, H] -> [B, T, N, H], like q.

    q is float32 or bfloat16; pages float32, bfloat16 or uint16 bit patterns of bfloat16 (the
    CPU cache's storage). Accumulation and softmax are float32. CPU only.

    Query token t of sequence b is real when ``q_start[b] + t < lengths[b]``; the others are a
    step's padding (a prefill block's short tail, a verify row's unused draft slots) and come
    out as zeros, at no cost (the reference lets them attend to the whole sequence: their
    values are never used).
    """
    check_paged_shapes(q, k_pages, v_pages, block_tables, q_start, lengths)
    _require()
    if k_pages.shape[2] > MAX_PAGE_SIZE:
        raise ValueError(f"the native kernel takes pages of up to {MAX_PAGE_SIZE} tokens, got "
                         f"pages {k_pages.shape} (page size {k_pages.shape[2]})")
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise TypeError(f"q must be float32 or bfloat16, got {q.dtype}")
    call = jax.ffi.ffi_call("llmserve_paged_attention_cpu",
                            jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")
    return call(q, k_pages, v_pages, block_tables.astype(jnp.int32),
                q_start.astype(jnp.int32), lengths.astype(jnp.int32),
                scale=np.float32(1.0 / math.sqrt(q.shape[-1])))


def _row_reduce(target: str, x: Array, out_dtype) -> Array:
    """A native reduction of each float32 row [B, V] (V > 0) -> [B] of ``out_dtype``."""
    if x.ndim != 2 or x.dtype != jnp.float32 or x.shape[-1] == 0:
        raise ValueError(f"want float32 logits [B, V] with V > 0, got {x.dtype} {x.shape}")
    _require()
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape[:1], out_dtype),
                            vmap_method="sequential")
    return call(x)


def row_logsumexp_cpu(x: Array) -> Array:
    """log(sum(exp(x), -1)) of float32 rows [B, V] -> [B], every row in the same fixed order
    (an all -inf row gives -inf). CPU only."""
    return _row_reduce("llmserve_row_logsumexp_cpu", x, jnp.float32)


def row_argmax_cpu(x: Array) -> Array:
    """First index of each row's maximum, float32 [B, V] -> [B] int32: jnp.argmax's result
    (a row with a NaN gives its first NaN's index). CPU only."""
    return _row_reduce("llmserve_row_argmax_cpu", x, jnp.int32)


def sample_cpu(logits: Array, temperature: Array, top_k: Array, top_p: Array, min_p: Array,
               uniform: Array, *, draw: bool = True) -> tuple[Array, Array]:
    """Temperature, top-k, top-p and min-p filters and a categorical draw, row by row (CPU only).

    logits float32 [B, V]; per-row [B]: temperature (<= 0 marks a greedy row, left alone),
    top_k (0 or >= V: off), top_p (1: off), min_p (0: off), uniform in [0, 1).
    Returns (tokens [B] int32, thresholds [B] float32): a sampled row keeps the tokens whose
    logit is >= its threshold (-inf: all; a raw logit, so the caller's own rounding of
    logits / temperature cannot move a token across it) and draws among them, with probability
    proportional to exp(logits / temperature), by inverse CDF at ``uniform``; greedy rows get
    threshold -inf and token 0. ``draw=False`` skips the draw (tokens 0). The semantics of
    ``sampling.process_logits`` and ``sampling.sample``, whose jnp path is the oracle.
    """
    if logits.ndim != 2 or logits.dtype != jnp.float32 or logits.shape[-1] == 0:
        raise ValueError(f"want float32 logits [B, V] with V > 0, got {logits.dtype} "
                         f"{logits.shape}")
    _require()
    b = logits.shape[0]
    call = jax.ffi.ffi_call("llmserve_sample_cpu", (jax.ShapeDtypeStruct((b,), jnp.int32),
                                                    jax.ShapeDtypeStruct((b,), jnp.float32)),
                            vmap_method="sequential")
    f32 = lambda a: jnp.asarray(a, jnp.float32).reshape(b)  # noqa: E731
    return call(logits, f32(temperature), jnp.asarray(top_k, jnp.int32).reshape(b), f32(top_p),
                f32(min_p), f32(uniform), draw=bool(draw))


def _require() -> None:
    reason = _load()
    if reason is not None:
        raise NativeBuildError(f"the native CPU kernels are unavailable: {reason}")


# ----------------------------------------------------------------------------------------------
# References (the oracles): the gather-everything jnp paged attention shared by every paged
# backend, and the plain jnp log-sum-exp.
reference = paged_attention_reference


def row_logsumexp_reference(x: Array) -> Array:
    """jax.nn.logsumexp over the last axis of [B, V]."""
    return jax.nn.logsumexp(x, axis=-1)


def row_argmax_reference(x: Array) -> Array:
    """jnp.argmax over the last axis of [B, V], as int32."""
    return jnp.argmax(x, axis=-1).astype(jnp.int32)


__all__ = ["paged_attention_cpu", "row_logsumexp_cpu", "row_logsumexp_reference", "available",
           "row_argmax_cpu", "row_argmax_reference", "sample_cpu",
           "matmul_bf16_cpu", "cpu_has_avx512", "matmul_bf16_reference", "has_bf16_matmul",
           "matmul_bf16_supported", "matmul_f32_cpu", "has_f32_matmul", "matmul_f32_supported",
           "unavailable_reason", "build", "cache_dir", "NativeBuildError", "reference",
           "MAX_PAGE_SIZE"]
