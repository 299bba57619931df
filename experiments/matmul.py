r"""SmolLM2-135M's weight matmuls at 1..512 rows, bfloat16 vs float32: which dtype, which buckets.

  python experiments/matmul.py                      # rows 1,2,4,...,512, both dtypes
  python experiments/matmul.py --rows=8,16,32 --iters=5

One timed call runs every weight matmul of one forward step of the model at ``rows`` tokens:
per layer q/k/v/o (576->576/192/192, 576->576) and gate/up/down (576->1536 x2, 1536->576), 30
layers, then the tied LM head (576->49152); each through ``llmserve.model.matmul_f32`` (inputs
in the storage dtype, float32 accumulation), exactly as the model runs them. The weights are
distinct per layer, so each call streams all of them (270 MB bf16, 540 MB fp32) as a real step
does. Also times both dtypes through the native matmuls (``matmul_f32(..., native="always")``:
the kernels the "cpu" backend may pick; AVX512_BF16 for bf16, AVX-512F for fp32) when this CPU
has them (the "cpu" backend takes whichever `cpu_kernels.native_matmul_wins` says is faster),
and again with the layers' [K, N] weights in the native kernels' blocked layout
(``cpu_kernels.block_weight``: what ``Runner`` passes them as where
``cpu_kernels.blocked_weights_apply``; bf16 in the paired layout where the native matmuls run
on AMX tiles, ``cpu_kernels.amx_matmul``). Prints the table (ms per call, bf16/fp32, XLA/native and
native/blocked ratios); writes results/matmul/matmul_<platform>.json.
"""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments.common import markdown_table, write_json
from llmserve.config import auto_dtype, cpu_has_bf16_matmul, preset
from llmserve.model import matmul_f32
from llmserve.ops import cpu_kernels

_ROWS = flags.DEFINE_list("rows", ["1", "2", "4", "8", "16", "32", "64", "128", "256", "512"],
                          "token rows per call")
_ITERS = flags.DEFINE_integer("iters", 5, "timed calls per point (median)")
_OUT = flags.DEFINE_string("out_dir", "results/matmul", "where the JSON goes")


def make_weights(dtype, seed: int = 0) -> dict:
    """Random SmolLM2-shaped weights in ``dtype`` (made per layer: no full f32 copy for bf16)."""
    cfg = preset("smollm2-135m")
    d, f, h = cfg.d_model, cfg.ffn_dim, cfg.head_dim
    shapes = {"q": (d, cfg.n_heads * h), "k": (d, cfg.n_kv_heads * h),
              "v": (d, cfg.n_kv_heads * h), "o": (cfg.n_heads * h, d),
              "gate": (d, f), "up": (d, f), "down": (f, d)}
    key = jax.random.key(seed)
    layers = []
    for _ in range(cfg.n_layers):
        layer = {}
        for name, shape in shapes.items():
            key, sub = jax.random.split(key)
            layer[name] = (0.02 * jax.random.normal(sub, shape, jnp.float32)).astype(dtype)
        layers.append(layer)
    key, sub = jax.random.split(key)
    head = (0.02 * jax.random.normal(sub, (cfg.vocab_size, d), jnp.float32)).astype(dtype)
    return {"layers": layers, "head": head}


@functools.partial(jax.jit, static_argnames="native")
def weight_pass(weights: dict, x: jax.Array, native: bool | str = False) -> jax.Array:
    """x [R, D] f32 through every weight matmul of one step -> logits [R, V] f32."""
    mm = functools.partial(matmul_f32, native=native)
    for w in weights["layers"]:
        q, k, v = mm(x, w["q"]), mm(x, w["k"]), mm(x, w["v"])
        x = x + mm(q, w["o"]) + 1e-3 * (k.sum(-1, keepdims=True) + v.sum(-1, keepdims=True))
        x = x + mm(jax.nn.silu(mm(x, w["gate"])) * mm(x, w["up"]), w["down"])
    return mm(x, weights["head"], transpose_w=True)  # tied: logits = x @ embedding.T


def time_ms(weights: dict, rows: int, iters: int, native: bool | str = False) -> float:
    """Median wall time of one weight pass at ``rows`` rows, in milliseconds."""
    x = jax.random.normal(jax.random.key(1), (rows, 576), jnp.float32)
    jax.block_until_ready(weight_pass(weights, x, native))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(weight_pass(weights, x, native))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main(argv):
    del argv
    rows = [int(r) for r in _ROWS.value]
    results = {}
    native = {"bfloat16": cpu_kernels.has_bf16_matmul(), "float32": cpu_kernels.has_f32_matmul()}
    for name, dtype in (("bfloat16", jnp.bfloat16), ("float32", jnp.float32)):
        weights = make_weights(dtype)
        results[name] = {r: time_ms(weights, r, _ITERS.value) for r in rows}
        if native[name]:  # same weights, XLA's dot vs the native kernel
            results[f"{name}_native"] = {r: time_ms(weights, r, _ITERS.value, "always")
                                         for r in rows}
        if cpu_kernels.blocked_matmul_supported(dtype):  # the same values, blocked
            paired = cpu_kernels.paired_weights_apply(dtype)  # as Runner lays them out
            weights["layers"] = [{key: cpu_kernels.block_weight(w, paired=paired)
                                  for key, w in layer.items()} for layer in weights["layers"]]
            results[f"{name}_blocked"] = {r: time_ms(weights, r, _ITERS.value, "always")
                                          for r in rows}
        del weights
    bf, fp = results["bfloat16"], results["float32"]
    nb, nf = results.get("bfloat16_native", {}), results.get("float32_native", {})
    bb, bfb = results.get("bfloat16_blocked", {}), results.get("float32_blocked", {})
    cell = lambda d, r: f"{d[r]:.1f}" if d else "-"  # noqa: E731
    ratio = lambda a, b, r: f"{a[r] / b[r]:.2f}" if a and b else "-"  # noqa: E731
    table = [(r, f"{bf[r]:.1f}", cell(nb, r), cell(bb, r), f"{fp[r]:.1f}", cell(nf, r),
              cell(bfb, r), f"{bf[r] / fp[r]:.2f}", ratio(bf, nb, r), ratio(fp, nf, r),
              ratio(nb, bb, r), ratio(nf, bfb, r))
             for r in rows]
    print(f"\nSmolLM2-135M weight matmuls per step ({jax.default_backend()}, "
          f"{os.cpu_count()} cores, cpu bf16 flags: {cpu_has_bf16_matmul()}, "
          f"auto dtype: {auto_dtype()}, AMX tiles: {cpu_kernels.amx_matmul()})")
    print(markdown_table(["rows", "bf16 XLA (ms)", "bf16 native (ms)", "bf16 native blocked (ms)",
                          "fp32 XLA (ms)", "fp32 native (ms)", "fp32 native blocked (ms)",
                          "bf16/fp32 (XLA)", "bf16 XLA/native", "fp32 XLA/native",
                          "bf16 native/blocked", "fp32 native/blocked"], table))
    path = write_json(os.path.join(_OUT.value, f"matmul_{jax.default_backend()}.json"), {
        "rows": rows, "ms": results, "iters": _ITERS.value,
        "cpu_bf16_matmul": cpu_has_bf16_matmul(), "auto_dtype": auto_dtype(),
        "amx_matmul": cpu_kernels.amx_matmul()})
    print(f"wrote {path}")


if __name__ == "__main__":
    from llmserve.host_memory import reexec_with_hugepages

    reexec_with_hugepages()  # first: glibc reads its huge-page tunable only at process start
    app.run(main)
