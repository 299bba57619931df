r"""Attention kernel benchmark: memory on CPU, speed on GPU. Writes results/kernels/<timestamp>/.

CPU (any machine):
  python -m experiments.kernels --config=configs/kernels.py[:smoke]
  prints compiled temp memory of naive attention (attention_reference) vs our XLA prefill path
  (flash_attention_xla) at 1k/4k/16k tokens, plus CPU wall times of the XLA serving paths.
  Expected (jax 0.10.2, N=9, K=3, H=64, float32): at 16k tokens ~18 GiB naive vs ~84 MiB (~220x).

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

from llmserve.ops import attention as attn  # noqa: E402
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
        naive = temp_bytes(attn.attention_reference, *shapes)
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
    for b, ctx in (tuple(int(x) for x in bc.split("x")) for bc in cfg.cpu_decode.split(",")):
        args = paged_inputs(b, ctx, jnp.float32, cfg.page_size)
        ms = time_ms(jax.jit(pa.paged_attention_xla), *args, iters=cfg.iters)
        rows.append(dict(kind="decode", backend="xla", batch=b, context=ctx, ms=ms))
    for r in rows:
        print(r)
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
    """Compiled temp memory, naive vs ours (log scale); on GPU also prefill/decode speed."""
    plt = common.pyplot()
    gpu = "prefill" in results
    fig, axes = plt.subplots(1, 3 if gpu else 1, figsize=(16 if gpu else 6.5, 4.2),
                             squeeze=False)
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
    notes = ["CPU: flash attention measured as memory (compiled temp bytes), not speed"]
    table = common.markdown_table(
        ["tokens (B=1)", "naive MiB", "ours MiB", "ratio"],
        [[r["tokens"], f"{r['naive_temp_bytes'] / 2**20:.1f}", f"{r['xla_temp_bytes'] / 2**20:.1f}",
          f"{r['ratio']:.1f}x"] for r in results["memory"]])
    png = plot(os.path.join(out, "kernels.png"), results)
    path = common.write_results(out, "kernels", cfg, results, summary, notes, [png], table=table)
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    app.run(main)
