r"""Collectives and bytes moved by the sharded engine step, per TP / DP configuration (issue 14).

  python -m experiments.sharding --config=configs/sharding.py[:smoke]

See configs/sharding.py. Compiles (never times) the decode and prefill steps of a Runner on a
[dp, tp] mesh of fake CPU devices and reads the partitioned HLO. Writes
results/sharding/<timestamp>/results.json and sharding.png.
"""

from __future__ import annotations

import os
import re

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):  # before jax starts: fake CPU devices
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()

from absl import app  # noqa: E402
from ml_collections import config_flags  # noqa: E402

try:
    from experiments import common
except ImportError:  # run as a script: python experiments/sharding.py
    import common

common.quiet_startup()

_CONFIG = config_flags.DEFINE_config_file("config", "configs/sharding.py", "sharding config",
                                          lock_config=True)


def model_config(name: str):
    """The ModelConfig of a configs/sharding.py MODELS entry."""
    from configs.sharding import MODELS
    from llmserve.config import preset

    base, overrides = MODELS[name]
    return preset(base).replace(**overrides)


def wire_bytes(op: str, nbytes: int, n: int) -> float:
    """Bytes one device sends in a ring implementation over a group of n devices."""
    if n <= 1:
        return 0.0
    return (2.0 if op in ("all-reduce", "all-to-all") else 1.0) * (n - 1) / n * nbytes


def summarize(text: str, tp: int) -> dict:
    """Collectives of one compiled step: the list, and totals by op."""
    from llmserve.sharding import hlo_collectives

    coll = hlo_collectives(text)
    by_op: dict = {}
    for c in coll:
        d = by_op.setdefault(c["op"], {"count": 0, "bytes": 0, "shapes": {}})
        d["count"] += 1
        d["bytes"] += c["bytes"]
        key = ",".join(c["shapes"])
        d["shapes"][key] = d["shapes"].get(key, 0) + 1
    return {"collectives": coll, "by_op": by_op, "count": len(coll),
            "buffer_bytes": sum(c["bytes"] for c in coll),
            "wire_bytes_per_device": sum(wire_bytes(c["op"], c["bytes"], tp) for c in coll),
            "gathers_cache_or_weights": _gathers_big(coll)}


def _gathers_big(coll) -> bool:
    """An all-gather whose output is not [.., rows, V] logits (a cache or weight gather)."""
    return any(c["op"] == "all-gather" and not re.fullmatch(r"f32\[(1, )?\d+, \d+\]",
                                                             ",".join(c["shapes"]))
               for c in coll)


def measure(mcfg, tp: int, dp: int, embed: str, cfg) -> dict:
    """Builds each replica's Runner and reads its compiled decode and prefill steps."""
    import jax

    from llmserve.model import init_params
    from llmserve.runner import Runner
    from llmserve.sharding import Shardings, engine_shardings

    params = init_params(mcfg, seed=0)
    replicas = []
    for sh in engine_shardings(tp, dp, embed=embed):
        sh_used = None if sh is None else Shardings(sh.mesh, embed)  # None: one device
        runner = Runner(mcfg, params, num_pages=cfg.num_pages, page_size=cfg.page_size,
                        max_slots=cfg.rows, max_model_len=cfg.max_model_len, backend="xla",
                        decode_buckets=(cfg.rows,), prefill_buckets=((1, cfg.chunk),),
                        shardings=sh_used)
        steps = {}
        for kind, shape in (("decode", (cfg.rows, None)), ("prefill", (0, (1, cfg.chunk)))):
            text = runner.lower_step(runner.empty_batch(shape)).compile().as_text()
            steps[kind] = summarize(text, tp)
        leaf = runner.cache.k[0]
        dev0 = leaf.addressable_shards[0].device if sh_used else jax.devices()[0]
        weight = sum(next(s.data.nbytes for s in x.addressable_shards if s.device == dev0)
                     for x in jax.tree_util.tree_leaves(runner.params))
        cache = sum(next(s.data.nbytes for s in x.addressable_shards if s.device == dev0)
                    for x in runner.cache.k + runner.cache.v)
        replicas.append({"devices": sorted(d.id for d in leaf.devices()), "steps": steps,
                         "weight_bytes_per_device": int(weight),
                         "kv_bytes_per_token_per_device": cache / (cfg.num_pages
                                                                   * cfg.page_size),
                         "kv_heads_per_device": int(leaf.addressable_shards[0].data.shape[0])})
        del runner
    first = replicas[0]
    same = all(r["steps"]["decode"]["by_op"] == first["steps"]["decode"]["by_op"]
               for r in replicas)
    return {"replicas": replicas, "replicas_identical": same, **first}


def plot(path: str, rows: list[dict]) -> str:
    """Per configuration: decode collective bytes (wire, per device) and weights per device."""
    labels = [r["label"] for r in rows]
    return common.bar_chart(
        path, labels,
        [("decode step: KiB sent per device (ring)",
          [r["steps"]["decode"]["wire_bytes_per_device"] / 1024 for r in rows]),
         ("decode step: collectives", [r["steps"]["decode"]["count"] for r in rows]),
         ("weights MiB per device", [r["weight_bytes_per_device"] / 2**20 for r in rows])],
        title="Sharded engine step (compiled HLO, fake CPU devices; no times)")


def main(argv) -> None:
    del argv
    cfg = _CONFIG.value
    out = common.run_dir("sharding", cfg.out_root or None)
    rows = []
    for entry in cfg.configs.split(","):
        name, tp, dp = entry.split(":")
        tp, dp = int(tp), int(dp)
        mcfg = model_config(name)
        modes = cfg.embed_modes.split(",") if tp > 1 else ["vocab"]
        if tp > 1 and mcfg.vocab_size % tp:
            modes = ["replicated"]  # the engine's fallback when tp does not divide V
        for embed in modes:
            r = measure(mcfg, tp, dp, embed, cfg)
            label = f"{name} TP{tp}" + (f" DP{dp}" if dp > 1 else "") + (
                " emb-rep" if embed == "replicated" and tp > 1 else "")
            rows.append({"config": entry, "label": label, "model": name, "tp": tp, "dp": dp,
                         "embed": embed, **r})
            d = r["steps"]["decode"]
            print(f"{label:32s} decode: {d['count']:3d} collectives "
                  f"{d['wire_bytes_per_device'] / 1024:10.1f} KiB/device  weights "
                  f"{r['weight_bytes_per_device'] / 2**20:8.1f} MiB/device", flush=True)
    table = common.markdown_table(
        ["configuration", "embed / LM head", "kv heads / device", "decode collectives",
         "decode KiB sent / device", "prefill collectives", "prefill KiB sent / device",
         "weights MiB / device", "cache or weight gather"],
        [[r["label"], r["embed"], r["kv_heads_per_device"], _ops(r["steps"]["decode"]),
          f"{r['steps']['decode']['wire_bytes_per_device'] / 1024:.1f}",
          _ops(r["steps"]["prefill"]),
          f"{r['steps']['prefill']['wire_bytes_per_device'] / 1024:.1f}",
          f"{r['weight_bytes_per_device'] / 2**20:.1f}",
          "yes" if r["steps"]["decode"]["gathers_cache_or_weights"] else "no"] for r in rows])
    notes = [f"decode = {cfg.rows} rows x 1 token; prefill = 1 chunk of {cfg.chunk} tokens; "
             "bytes from the partitioned HLO (buffer sizes; 'sent' = ring estimate); fake CPU "
             "devices, so no step times",
             "DP replicas compile separately on disjoint devices: their steps hold no "
             "collective across replicas"]
    print(f"\n{table}\n\n" + "\n".join(f"- {n}" for n in notes))
    png = plot(os.path.join(out, "sharding.png"), rows)
    summary = {}
    for r in rows:
        key = re.sub(r"[^a-z0-9]+", "_", r["label"].lower()).strip("_")
        summary[f"{key}_decode_collectives"] = r["steps"]["decode"]["count"]
        summary[f"{key}_decode_kib_sent_per_device"] = (
            r["steps"]["decode"]["wire_bytes_per_device"] / 1024)
    for r in rows:  # the full collective lists stay in results.json, not in the summary
        for rep in r["replicas"]:
            for step in rep["steps"].values():
                step["collectives"] = step["collectives"][:64]
    path = common.write_results(out, "sharding", cfg, rows, summary, notes, [png], table=table)
    print(f"\nwrote {path} and {png}")


def _ops(step: dict) -> str:
    return ", ".join(f"{d['count']}x {op}" for op, d in sorted(step["by_op"].items())) or "none"


if __name__ == "__main__":
    from llmserve.host_memory import reexec_with_hugepages

    reexec_with_hugepages()  # first: glibc reads its huge-page tunable only at process start
    app.run(main)
