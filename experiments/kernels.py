r"""Attention kernel benchmark: memory on CPU, speed on GPU. Writes results/kernels/<timestamp>/.

CPU (any machine):
  python -m experiments.kernels --config=configs/kernels.py[:smoke]
  prints compiled temp memory of naive attention (attention_reference) vs our XLA prefill path
  (flash_attention_xla) at 1k/4k/16k tokens, plus CPU wall times of the XLA serving paths.
  Expected (jax 0.10.2, N=9, K=3, H=64, float32): at 16k tokens ~18 GiB naive vs ~84 MiB (~220x).

  It also measures decode attention against its memory roof (``roof`` in the JSON): at B=32,
  context 512, SmolLM2 heads, page size 16, in float32 and bfloat16, the XLA paged path
  (``paged_attention_xla`` at each ``--decode_chunks`` pages per loop step) is timed beside a
  copy kernel over as many bytes as the K/V it reads. roof = K/V bytes / copy bandwidth, with
  the copy's bandwidth counted STREAM-style (bytes read + bytes written), so roof = copy time / 2;
  ratio = attention time / roof (1.0 = reads K/V at the copy's speed). Also shown: a read-only
  sum over the same bytes and the gather of K and V alone (what any gather-based XLA path pays).
  Every point is the minimum over ``--roof_reps`` interleaved rounds of ``--iters`` calls, so
  other processes on a shared machine inflate all of them alike. ``--profile`` adds the
  per-fusion thread time of one call (jax.profiler trace).
  Measured (2 shared cores, jax 0.10.2): paged_xla_c4 6.9-9.2x roof in f32, 7.6-9.8x in bf16;
  gather_kv alone 2.3-3.6x (f32) and 2.2-5.1x (bf16); the native CPU kernel
  (``paged_cpu_native``, ``ops/cpu_kernels.py``) 3.8x (f32) and 3.7x (bf16).

GPU:
  python -m experiments.kernels --config=configs/kernels.py --config.decode_batch=8,32,64
  compares, in bfloat16:
    prefill (causal, B=1): ours (Pallas/Triton flash_attention) vs jax.nn.dot_product_attention
      (implementation="xla" and "cudnn") vs jax.experimental.pallas.ops.gpu.attention.mha (which
      needs K/V repeated to N heads; the repeat is done outside the timed call);
    decode (T=1, paged, L=16): ours (paged_attention) vs
      jax.experimental.pallas.ops.gpu.paged_attention.paged_attention;
  reporting milliseconds, TFLOP/s (causal FLOPs: 2 matmuls x 2 x N*H*T*S/2) and GB/s (K/V bytes
  read once per kv head: decode is bandwidth bound).
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from typing import Callable

import numpy as np
from absl import app, logging
from ml_collections import config_flags

try:
    from experiments import common
except ImportError:  # run as a script: python experiments/kernels.py
    import common

common.quiet_startup()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from llmserve.ops import cpu_kernels as cpa  # noqa: E402
from llmserve.ops import flash_attention as fa  # noqa: E402
from llmserve.ops import paged_attention as pa  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/kernels.py", "benchmark config",
                                          lock_config=True)


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def heads() -> tuple[int, int, int]:
    """(N, K, H) from the config."""
    n, k, h = _ints(_CONFIG.value.heads)
    return n, k, h


def temp_bytes(f: Callable, *shapes) -> int:
    """Compiled temp (scratch) memory of jit(f) for these shapes, in bytes."""
    return int(jax.jit(f).lower(*shapes).compile().memory_analysis().temp_size_in_bytes)


def time_ms(f: Callable, *args, iters: int) -> float:
    """Median wall time of a compiled call, in milliseconds (at least 3 timed calls)."""
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(max(iters, 3)):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def memory_table() -> list[dict]:
    """Naive vs flash_attention_xla compiled temp memory at several token counts (B=1)."""
    n, kh, h = heads()
    spec = jax.ShapeDtypeStruct
    rows = []
    for t in _ints(_CONFIG.value.memory_tokens):
        shapes = (spec((1, t, n, h), jnp.float32), spec((1, t, kh, h), jnp.float32),
                  spec((1, t, kh, h), jnp.float32), spec((1,), jnp.int32),
                  spec((1,), jnp.int32))
        naive = temp_bytes(fa.attention_reference, *shapes)
        ours = temp_bytes(fa.flash_attention_xla, *shapes)
        rows.append(dict(tokens=t, naive_temp_bytes=naive, xla_temp_bytes=ours,
                         ratio=naive / max(ours, 1)))
    print(f"\ncompiled temp memory, B=1, N={n} K={kh} H={h}, float32")
    print(f"{'tokens':>8} {'naive (MiB)':>12} {'ours (MiB)':>11} {'ratio':>7}")
    for r in rows:
        print(f"{r['tokens']:>8} {r['naive_temp_bytes'] / 2**20:>12.1f} "
              f"{r['xla_temp_bytes'] / 2**20:>11.1f} {r['ratio']:>7.1f}")
    return rows


def random(shape, dtype, seed):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def paged_inputs(b: int, ctx: int, dtype, page_size: int):
    """Decode inputs: every sequence has ctx tokens in ctx/L shuffled pages (page 0 = dummy)."""
    n, kh, h = heads()
    m = math.ceil(ctx / page_size)
    pages = 1 + b * m
    q = random((b, 1, n, h), dtype, 0)
    k_pages = random((kh, pages, page_size, h), dtype, 1)
    v_pages = random((kh, pages, page_size, h), dtype, 2)
    perm = np.random.default_rng(0).permutation(np.arange(1, pages))
    tables = jnp.asarray(perm.reshape(b, m), jnp.int32)
    lengths = jnp.full((b,), ctx, jnp.int32)
    return q, k_pages, v_pages, tables, lengths - 1, lengths


def cpu_times() -> list[dict]:
    """Wall times of the XLA serving paths on this machine (the common CPU cases)."""
    n, kh, h = heads()
    rows = []
    cfg = _CONFIG.value
    for t in _ints(cfg.cpu_prefill_tokens):
        q, k, v = (random((1, t, x, h), jnp.float32, i) for i, x in enumerate((n, kh, kh)))
        args = (q, k, v, jnp.zeros(1, jnp.int32), jnp.full(1, t, jnp.int32))
        ms = time_ms(jax.jit(fa.flash_attention_xla), *args, iters=cfg.iters)
        rows.append(dict(kind="prefill", backend="xla", tokens=t, ms=ms))
    decode = {"xla": pa.paged_attention_xla}
    if cpa.available():
        decode["cpu"] = cpa.paged_attention_cpu
    for b, ctx in (tuple(int(x) for x in bc.split("x")) for bc in cfg.cpu_decode.split(",")):
        args = paged_inputs(b, ctx, jnp.float32, cfg.page_size)
        for backend, fn in decode.items():
            ms = time_ms(jax.jit(fn), *args, iters=cfg.iters)
            rows.append(dict(kind="decode", backend=backend, batch=b, context=ctx, ms=ms))
    if cpa.available():
        rows += native_blocks(cfg)
    for r in rows:
        print(r)
    return rows


def native_blocks(cfg) -> list[dict]:
    """The native kernel on bf16 query blocks (``cpu_native_blocks``, B x T x context): T query
    tokens a sequence after `context` cached ones, as a decode (T = 1), verify (1 + R) or
    prefill block; one call (one layer), fastest of ``iters``."""
    n, kh, h = heads()
    rows = []
    for spec in cfg.cpu_native_blocks.split(","):
        b, t, ctx = (int(x) for x in spec.split("x"))
        q, k_pages, v_pages, tables, _, _ = paged_inputs(b, ctx + t, jnp.bfloat16, cfg.page_size)
        q = random((b, t, n, h), jnp.bfloat16, 3)
        bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.uint16)
        args = (q, bits(k_pages), bits(v_pages), tables, jnp.full((b,), ctx, jnp.int32),
                jnp.full((b,), ctx + t, jnp.int32))
        ms = min_ms(jax.jit(cpa.paged_attention_cpu), *args, iters=cfg.iters * 5)
        rows.append(dict(kind="native_block", backend="cpu", dtype="bfloat16", batch=b,
                         query_tokens=t, context=ctx, ms=ms))
    return rows


def min_ms(f: Callable, *args, iters: int) -> float:
    """Minimum wall time of a compiled call over ``iters`` calls, in milliseconds."""
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def op_profile(f: Callable, *args, iters: int = 5, top: int = 12) -> list[tuple[str, float]]:
    """Per-op thread time (us per call) of jit(f) from a jax.profiler trace, largest first.

    Thread time: a fusion split over both cores counts both, so entries can sum past the wall
    time; read them as shares of the work.
    """
    import collections
    import glob
    import gzip
    import tempfile

    f = jax.jit(f)
    jax.block_until_ready(f(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(iters):
                jax.block_until_ready(f(*args))
        path = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)[0]
        with gzip.open(path) as fh:
            events = json.load(fh)
    events = events["traceEvents"] if isinstance(events, dict) else events
    total = collections.Counter()
    for e in events:
        name = e.get("name", "")
        if e.get("ph") == "X" and ("fusion" in name or name.startswith(("dot", "gather", "copy",
                                                                         "while", "reduce"))):
            total[name] += e["dur"] / iters
    return total.most_common(top)


def decode_roof(extra: dict[str, Callable] | None = None) -> list[dict]:
    """Decode attention (XLA paged path) vs the copy-bandwidth roof, float32 and bfloat16.

    ``extra`` maps names to other paged attention functions (same signature) timed alongside,
    e.g. an older version for a before/after table.
    """
    cfg = _CONFIG.value
    n, kh, h = heads()
    b, ctx, size = cfg.roof_batch, cfg.roof_context, cfg.page_size
    rows = []
    for dtype in (jnp.float32, jnp.bfloat16):
        args = paged_inputs(b, ctx, dtype, size)
        q, k_pages, v_pages, tables = args[:4]
        kv_bytes = 2 * b * ctx * kh * h * jnp.dtype(dtype).itemsize
        flat = jnp.ones((kv_bytes // jnp.dtype(dtype).itemsize,), dtype)
        rows_ids = pa.page_rows(tables, kh, k_pages.shape[1])

        def gather_kv(kp, vp, ids):
            return tuple(jnp.take(p.reshape(-1, size * h), ids, axis=0) for p in (kp, vp))

        fns = {"copy": (jax.jit(lambda x: x + 1), (flat,)),
               "sum": (jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32)), (flat,)),
               "gather_kv": (jax.jit(gather_kv), (k_pages, v_pages, rows_ids))}
        for c in _ints(cfg.decode_chunks):
            f = jax.jit(lambda *a, c=c: pa.paged_attention_xla(*a, pages_per_chunk=c))
            fns[f"paged_xla_c{c}"] = (f, args)
        if cpa.available():
            fns["paged_cpu_native"] = (jax.jit(cpa.paged_attention_cpu), args)
        for key, f in (extra or {}).items():
            fns[key] = (jax.jit(f), args)
        best = {name: float("inf") for name in fns}
        for _ in range(cfg.roof_reps):
            for name, (f, a) in fns.items():
                best[name] = min(best[name], min_ms(f, *a, iters=cfg.iters))
        roof = best["copy"] / 2  # K/V bytes at the copy's (read + write) bandwidth
        name = jnp.dtype(dtype).name
        print(f"\ndecode roof, {name}, B={b} context={ctx} N={n} K={kh} H={h} L={size}: "
              f"K/V {kv_bytes / 2**20:.1f} MiB, copy {best['copy']:.3f} ms "
              f"({2 * kv_bytes / best['copy'] / 1e6:.1f} GB/s r+w) -> roof {roof:.3f} ms")
        for key, ms in best.items():
            row = dict(kind="decode_roof", dtype=name, batch=b, context=ctx, what=key, ms=ms,
                       roof_ms=roof, ratio=ms / roof, kv_bytes=kv_bytes)
            rows.append(row)
            print(f"  {key:16} {ms:8.3f} ms  {ms / roof:6.2f} x roof")
        if cfg.profile:
            c = _ints(cfg.decode_chunks)[0]
            prof = op_profile(lambda *a, c=c: pa.paged_attention_xla(*a, pages_per_chunk=c),
                              *args)
            print(f"  profile (paged_xla_c{c}, us thread time per call):")
            for op, us in prof:
                print(f"    {us:9.1f}  {op}")
            rows.append(dict(kind="decode_profile", dtype=name, chunk=c, ops=prof))
    return rows


def _point(kind: str, name: str, f: Callable, args, flops: float, nbytes: float, **meta) -> dict:
    try:
        ms = time_ms(jax.jit(f), *args, iters=_CONFIG.value.iters)
    except Exception as e:  # a baseline may not support a shape/dtype (e.g. cuDNN)
        logging.warning("%s %s %s failed: %s", kind, name, meta, e)
        return dict(kind=kind, backend=name, error=str(e)[:300], **meta)
    row = dict(kind=kind, backend=name, ms=ms, tflops=flops / ms / 1e9,
               gbps=nbytes / ms / 1e6, **meta)
    print(f"{kind:8} {name:14} {meta} {ms:8.3f} ms {row['tflops']:7.2f} TFLOP/s "
          f"{row['gbps']:8.1f} GB/s")
    return row


def gpu_prefill() -> list[dict]:
    """Causal prefill, B=1, bfloat16: ours vs XLA / cuDNN SDPA vs jax's Pallas mha (if any)."""
    try:  # deprecated in jax; a peer for comparison only, never used by the library
        from jax.experimental.pallas.ops.gpu import attention as jax_mha
    except ImportError as e:
        logging.warning("jax's Pallas mha is not importable (%s): skipped", e)
        jax_mha = None

    n, kh, h = heads()
    dtype = jnp.bfloat16
    rows = []
    for t in _ints(_CONFIG.value.prefill_tokens):
        q = random((1, t, n, h), dtype, 0)
        k = random((1, t, kh, h), dtype, 1)
        v = random((1, t, kh, h), dtype, 2)
        q_start, lengths = jnp.zeros(1, jnp.int32), jnp.full(1, t, jnp.int32)
        flops = 4.0 * n * h * t * t / 2  # causal: half the score matrix
        nbytes = 2.0 * (q.size + 2 * k.size) * q.dtype.itemsize  # q, k, v read + out write
        meta = dict(tokens=t, heads=(n, kh, h))
        rows.append(_point("prefill", "ours", fa.flash_attention,
                           (q, k, v, q_start, lengths), flops, nbytes, **meta))
        for impl in ("xla", "cudnn"):
            f = lambda q, k, v, impl=impl: jax.nn.dot_product_attention(  # noqa: E731
                q, k, v, is_causal=True, implementation=impl)
            rows.append(_point("prefill", f"sdpa_{impl}", f, (q, k, v), flops, nbytes, **meta))
        if jax_mha is None:
            continue
        # jax's mha has no GQA: K/V repeated to N heads (outside the timed call).
        k_rep, v_rep = jnp.repeat(k, n // kh, axis=2), jnp.repeat(v, n // kh, axis=2)
        f = lambda q, k, v: jax_mha.mha(q, k, v, None, sm_scale=1 / math.sqrt(h),  # noqa: E731
                                        causal=True)
        rows.append(_point("prefill", "jax_pallas_mha", f, (q, k_rep, v_rep), flops, nbytes,
                           **meta))
    return rows


def gpu_decode() -> list[dict]:
    """Paged decode (T=1), bfloat16: ours vs jax's Pallas paged_attention (if importable)."""
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
    except ImportError as e:
        logging.warning("jax's Pallas paged_attention is not importable (%s): skipped", e)
        jax_paged = None

    cfg = _CONFIG.value
    n, kh, h = heads()
    dtype = jnp.bfloat16
    rows = []
    for b in _ints(cfg.decode_batch):
        for ctx in _ints(cfg.decode_context):
            q, k_pages, v_pages, tables, q_start, lengths = paged_inputs(b, ctx, dtype,
                                                                        cfg.page_size)
            flops = 4.0 * b * n * h * ctx
            nbytes = 2.0 * b * ctx * kh * h * k_pages.dtype.itemsize  # K and V, once
            meta = dict(batch=b, context=ctx, page_size=cfg.page_size, heads=(n, kh, h))
            rows.append(_point("decode", "ours", pa.paged_attention,
                               (q, k_pages, v_pages, tables, q_start, lengths), flops, nbytes,
                               **meta))
            if jax_paged is None:
                continue
            f = lambda q, kp, vp, bt, ln: jax_paged.paged_attention(  # noqa: E731
                q[:, 0] / math.sqrt(h), kp, vp, bt, ln)
            rows.append(_point("decode", "jax_pallas_paged", f,
                               (q, k_pages, v_pages, tables, lengths), flops, nbytes, **meta))
    return rows


def plot(path: str, results: dict) -> str:
    """Compiled temp memory, naive vs ours (log scale); on GPU also prefill/decode speed, on CPU
    decode attention against its memory roof."""
    plt = common.pyplot()
    gpu = "prefill" in results
    roof = [r for r in results.get("roof", []) if r.get("kind") == "decode_roof"]
    fig, axes = plt.subplots(1, 3 if gpu else 1 + bool(roof),
                             figsize=(16 if gpu else 6.5 * (1 + bool(roof)), 4.2), squeeze=False)
    mem = results["memory"]
    ax = axes[0][0]
    ax.plot([r["tokens"] for r in mem], [r["naive_temp_bytes"] / 2**20 for r in mem], "o-",
            label="naive (materialized scores)")
    ax.plot([r["tokens"] for r in mem], [r["xla_temp_bytes"] / 2**20 for r in mem], "s-",
            label="ours (flash_attention_xla)")
    for r in mem:
        ax.annotate(f"{r['ratio']:.0f}x", (r["tokens"], r["xla_temp_bytes"] / 2**20),
                    fontsize=8, textcoords="offset points", xytext=(0, 6))
    ax.set(xscale="log", yscale="log", xlabel="tokens (B=1)", ylabel="compiled temp MiB",
           title="attention scratch memory (memory, CPU compile)")
    ax.legend(fontsize=8)
    if roof and not gpu:
        ax = axes[0][1]
        whats = list(dict.fromkeys(r["what"] for r in roof if r["what"] != "copy"))
        dtypes = list(dict.fromkeys(r["dtype"] for r in roof))
        width = 0.8 / len(dtypes)
        for i, dt in enumerate(dtypes):
            ratio = {r["what"]: r["ratio"] for r in roof if r["dtype"] == dt}
            ax.bar([j + i * width for j in range(len(whats))], [ratio[w] for w in whats], width,
                   label=dt)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(1.5, color="k", lw=0.8, ls="--", label="1.5x roof (target)")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(whats))], whats, rotation=20,
                      fontsize=8)
        b, ctx = roof[0]["batch"], roof[0]["context"]
        ax.set(ylabel="time / roof", title=f"decode attention vs memory roof (B={b}, ctx={ctx})")
        ax.legend(fontsize=8)
    if gpu:
        for ax, kind, x, y in ((axes[0][1], "prefill", "tokens", "tflops"),
                               (axes[0][2], "decode", "context", "gbps")):
            rows = [r for r in results[kind] if "ms" in r]
            if kind == "decode":
                rows = [r for r in rows if r["batch"] == max(r2["batch"] for r2 in rows)]
            for backend in sorted({r["backend"] for r in rows}):
                pts = [r for r in rows if r["backend"] == backend]
                ax.plot([r[x] for r in pts], [r[y] for r in pts], "o-", label=backend)
            ax.set(xscale="log", xlabel=x, ylabel=y, title=f"{kind}, bfloat16")
            ax.legend(fontsize=8)
    fig.suptitle(f"{results['devices'][0]}, N,K,H={results['heads']}", fontsize=10)
    fig.tight_layout()
    return common.save_figure(fig, path)


def tables(results: dict, cfg) -> tuple[list[str], str]:
    """(notes, markdown): the attention scratch memory table; on a GPU also the timed kernels,
    each row with our time over the other kernel's (>1: ours is faster)."""
    table = common.markdown_table(
        ["tokens (B=1)", "naive MiB", "ours MiB", "ratio"],
        [[r["tokens"], f"{r['naive_temp_bytes'] / 2**20:.1f}", f"{r['xla_temp_bytes'] / 2**20:.1f}",
          f"{r['ratio']:.1f}x"] for r in results["memory"]])
    if results["platform"] != "gpu":
        notes = ["CPU: flash attention measured as memory (compiled temp bytes), not speed"]
        blocks = [r for r in results.get("cpu_times", []) if r["kind"] == "native_block"]
        if blocks:
            n, kh, _ = heads()
            page = cfg.page_size

            def per_row_page(r):  # ns per (query row, page it reads)
                pages = math.ceil((r["context"] + r["query_tokens"]) / page)
                return 1e6 * r["ms"] / (r["batch"] * n * r["query_tokens"] * pages)

            table += "\n\n" + common.markdown_table(
                ["native kernel, bf16: B x query tokens x context", "ms (one layer)",
                 "ns per query row per page"],
                [[f"{r['batch']} x {r['query_tokens']} x {r['context']}", f"{r['ms']:.3f}",
                  f"{per_row_page(r):.0f}"] for r in blocks])
            notes.append("native_block: the native paged kernel on bf16 query blocks, one call "
                         "(one layer) over both cores, fastest of the calls")
        return notes, table
    rows = []
    for kind in ("prefill", "decode"):
        for r in results.get(kind, []):
            if "ms" not in r:
                continue
            shape = (f"{r['tokens']} tokens" if kind == "prefill"
                     else f"B={r['batch']}, context {r['context']}")
            speed = (f"{r['tflops']:.1f} TFLOP/s" if kind == "prefill"
                     else f"{r['gbps']:.0f} GB/s")
            rows.append([kind, shape, r["backend"], f"{r['ms']:.3f}", speed,
                         f"{r['ours_speedup']:.2f}x" if "ours_speedup" in r else "-"])
    timed = common.markdown_table(["kernel", "shape", "backend", "ms", "rate",
                                   "ours faster by"], rows)
    notes = [f"GPU: each time the median wall time (dispatch included) of {max(cfg.iters, 3)} "
             "calls after a warm-up call; prefill is "
             "causal bfloat16 attention at B=1 with SmolLM2's heads (9 query, 3 KV, dim 64); "
             "decode is one query token per row over bfloat16 pages of 16 tokens, rate = KV "
             "bytes read / time"]
    return notes, table + "\n\n" + timed


def main(argv):
    del argv
    cfg = _CONFIG.value
    platform = jax.default_backend()
    out = common.run_dir("kernels", cfg.out_root or None)
    results = dict(platform=platform, devices=[d.device_kind for d in jax.devices()],
                   heads=heads(), memory=memory_table())
    if platform == "gpu":
        results["prefill"] = gpu_prefill()
        results["decode"] = gpu_decode()
    else:
        results["cpu_times"] = cpu_times()
        results["roof"] = decode_roof()
    largest = max(results["memory"], key=lambda r: r["tokens"])
    summary = {"memory_ratio": largest["ratio"], "memory_tokens": largest["tokens"],
               "naive_temp_mib": largest["naive_temp_bytes"] / 2**20,
               "flash_temp_mib": largest["xla_temp_bytes"] / 2**20}
    if platform == "gpu":
        for kind in ("prefill", "decode"):
            ours = {tuple(sorted((k, v) for k, v in r.items() if k in ("tokens", "batch",
                                                                        "context"))): r["ms"]
                    for r in results[kind] if r["backend"] == "ours" and "ms" in r}
            for r in results[kind]:
                key = tuple(sorted((k, v) for k, v in r.items()
                                   if k in ("tokens", "batch", "context")))
                if r["backend"] != "ours" and "ms" in r and key in ours:
                    r["ours_speedup"] = r["ms"] / ours[key]
            for backend in sorted({r["backend"] for r in results[kind] if "ours_speedup" in r}):
                summary[f"{kind}_speedup_vs_{backend}"] = float(np.median(
                    [r["ours_speedup"] for r in results[kind] if r["backend"] == backend
                     and "ours_speedup" in r]))
    for r in results.get("roof", []):
        if r.get("kind") == "decode_roof" and r["what"].startswith("paged_"):
            kind = "native" if r["what"] == "paged_cpu_native" else "xla"
            key = f"decode_roof_ratio_{kind}_{r['dtype']}"
            summary[key] = min(summary.get(key, float("inf")), r["ratio"])
    notes, table = tables(results, cfg)
    png = plot(os.path.join(out, "kernels.png"), results)
    path = common.write_results(out, "kernels", cfg, results, summary, notes, [png], table=table)
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    from llmserve.host_memory import reexec_with_hugepages

    reexec_with_hugepages()  # first: glibc reads its huge-page tunable only at process start
    app.run(main)
