r"""GQA / MQA ablation: KV cache size, requests per KV budget, decode speed (issue 13).

  python -m experiments.gqa --config=configs/gqa.py[:smoke]

See configs/gqa.py. Random-weight variants of one model shape that differ only in n_kv_heads.
Writes results/gqa/<timestamp>/results.json and gqa.png.
"""

from __future__ import annotations

import os
import time

import numpy as np
from absl import app
from ml_collections import config_flags

try:
    from experiments import common
except ImportError:  # run as a script: python experiments/gqa.py
    import common

common.quiet_startup()

_CONFIG = config_flags.DEFINE_config_file("config", "configs/gqa.py", "ablation config",
                                          lock_config=True)
NAMES = {1: "MQA"}


def variant_name(n_heads: int, kv: int) -> str:
    """"MHA" (kv = n), "MQA" (kv = 1) or "GQA-<kv>"."""
    return "MHA" if kv == n_heads else NAMES.get(kv, f"GQA-{kv}")


def kv_bytes_per_token(mcfg, page_size: int) -> int:
    """Bytes of one token's K and V over all layers, measured on an allocated paged cache."""
    from llmserve.kv_cache import PagedKVCache

    cache = PagedKVCache.create(mcfg, 2, page_size)
    nbytes = sum(x.nbytes for x in cache.k + cache.v)
    per_token = nbytes // (2 * page_size)
    itemsize = np.dtype(mcfg.jnp_dtype).itemsize
    assert per_token == 2 * mcfg.n_layers * mcfg.n_kv_heads * mcfg.head_dim * itemsize
    return int(per_token)


def requests_that_fit(mcfg, cfg) -> dict:
    """Requests of ``fit_context`` tokens the block manager admits into the KV budget."""
    from llmserve.block_manager import BlockManager
    from llmserve.engine import EngineConfig

    budget = cfg.kv_budget_mib * 2**20
    pages = EngineConfig(page_size=cfg.page_size, kv_cache_memory=budget,
                         max_model_len=cfg.fit_context).resolve_num_pages(mcfg)
    if pages < 2:
        return {"num_pages": pages, "requests": 0}
    blocks = BlockManager(pages, cfg.page_size, enable_prefix_caching=False)
    n = 0
    while blocks.can_allocate([n + 1] * cfg.fit_context):
        blocks.allocate(n, [n + 1] * cfg.fit_context)
        n += 1
    return {"num_pages": pages, "requests": n}


def decode_stepper(mcfg, params, cfg):
    """A function timing one jitted decode step of ``batch`` rows at ``context`` tokens.

    The rows' block tables point at distinct pages; their K/V are zeros (cost does not depend
    on the values), so no prefill is needed to reach a long context.
    """
    import jax

    from llmserve.ops.attention import default_backend
    from llmserve.runner import Runner

    b, ctx, size = cfg.batch, cfg.context, cfg.page_size
    per_seq = -(-(ctx + 1) // size)
    runner = Runner(mcfg, params, num_pages=1 + b * per_seq, page_size=size, max_slots=b,
                    max_model_len=per_seq * size, backend=cfg.backend or default_backend(),
                    decode_buckets=(b,), prefill_buckets=((1, size),))
    from llmserve.runner import ScheduledRow

    host = runner.prepare([
        ScheduledRow(tokens=[1 + i], start=ctx - 1,
                     block_table=(1 + i * per_seq + np.arange(per_seq)).tolist(), slot=i,
                     emit=True, sampling={"temperature": 0.0, "seed": i}) for i in range(b)])
    jax.block_until_ready(runner.run(host).tokens)  # compile

    def step_s(iters: int) -> float:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(runner.run(host).tokens)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    return step_s


def plot(path: str, rows: list[dict], cfg) -> str:
    """Three panels: KV KiB per token, requests that fit, decode tokens/s (median, min-max)."""
    labels = [r["variant"] for r in rows]
    return common.bar_chart(
        path, labels,
        [("KV cache KiB / token", [r["kv_bytes_per_token"] / 1024 for r in rows]),
         (f"requests of {cfg.fit_context} tokens in {cfg.kv_budget_mib} MiB",
          [r["requests_fit"] for r in rows]),
         (f"decode tok/s, B={cfg.batch}, context {cfg.context}",
          [r["decode_tok_s"]["median"] for r in rows])],
        title=f"{cfg.base} shape, RANDOM weights, {cfg.dtype}, {os.cpu_count()} CPU cores",
        errors=[None, None, [(r["decode_tok_s"]["min"], r["decode_tok_s"]["max"])
                             for r in rows]])


def main(argv) -> None:
    del argv
    import jax

    from llmserve.config import preset
    from llmserve.model import init_params

    cfg = _CONFIG.value
    out = common.run_dir("gqa", cfg.out_root or None)
    base = preset(cfg.base).replace(dtype=cfg.dtype)
    variants = {}
    for kv in (int(k) for k in cfg.kv_heads.split(",")):
        if base.n_heads % kv:
            raise ValueError(f"kv_heads {kv} does not divide n_heads {base.n_heads}")
        mcfg = base.replace(n_kv_heads=kv)
        dtype = mcfg.jnp_dtype
        params = jax.tree_util.tree_map(lambda x, d=dtype: x.astype(d), init_params(mcfg, 0))
        variants[variant_name(base.n_heads, kv)] = (mcfg, decode_stepper(mcfg, params, cfg))
    times = common.interleaved({name: (lambda rep, f=f: {"step_s": f(cfg.iters)})
                                for name, (_, f) in variants.items()}, cfg.repeats)
    rows = []
    for name, (mcfg, _) in variants.items():
        fit = requests_that_fit(mcfg, cfg)
        tok_s = common.spread([cfg.batch / t["step_s"] for t in times[name]])
        rows.append({"variant": name, "n_kv_heads": mcfg.n_kv_heads,
                     "kv_bytes_per_token": kv_bytes_per_token(mcfg, cfg.page_size),
                     "requests_fit": fit["requests"], "num_pages": fit["num_pages"],
                     "decode_tok_s": tok_s, "step_s": [t["step_s"] for t in times[name]]})
    mha = next((r for r in rows if r["variant"] == "MHA"), rows[0])
    for r in rows:
        r["kv_reduction_vs_mha"] = mha["kv_bytes_per_token"] / r["kv_bytes_per_token"]
        r["decode_speedup_vs_mha"] = r["decode_tok_s"]["median"] / mha["decode_tok_s"]["median"]
    table = common.markdown_table(
        ["variant", "K/V heads", "KV KiB / token", "x smaller than MHA",
         f"requests of {cfg.fit_context} in {cfg.kv_budget_mib} MiB",
         f"decode tok/s (B={cfg.batch}, ctx {cfg.context}), median [min-max]", "vs MHA"],
        [[r["variant"], r["n_kv_heads"], f"{r['kv_bytes_per_token'] / 1024:.1f}",
          f"{r['kv_reduction_vs_mha']:.1f}", r["requests_fit"],
          common.fmt_spread(r["decode_tok_s"]), f"{r['decode_speedup_vs_mha']:.2f}"]
         for r in rows])
    notes = [f"{cfg.base} shape with RANDOM weights (only n_kv_heads differs); {cfg.dtype}; "
             f"decode = one jitted engine step, {cfg.repeats} interleaved repeats x median of "
             f"{cfg.iters} steps; {os.cpu_count()} CPU cores"]
    print(f"\n{table}\n\n" + "\n".join(f"- {n}" for n in notes))
    png = plot(os.path.join(out, "gqa.png"), rows, cfg)
    summary = {"fit_context": cfg.fit_context, "kv_budget_mib": cfg.kv_budget_mib}
    for r in rows:
        key = r["variant"].lower().replace("-", "")
        summary[f"{key}_kv_reduction_vs_mha"] = r["kv_reduction_vs_mha"]
        summary[f"{key}_requests_fit"] = r["requests_fit"]
        summary[f"{key}_decode_speedup_vs_mha"] = r["decode_speedup_vs_mha"]
    path = common.write_results(out, "gqa", cfg, rows, summary, notes, [png], table=table)
    print(f"\nwrote {path} and {png}")


if __name__ == "__main__":
    from llmserve.host_memory import reexec_with_hugepages

    reexec_with_hugepages()  # first: glibc reads its huge-page tunable only at process start
    app.run(main)
