r"""PagedAttention ablation: paged vs contiguous max-length KV reservation (issue 13).

  python -m experiments.paged --config=configs/paged.py[:smoke]

See configs/paged.py. Runs the real host allocator and scheduler in both reservation modes over
the same heavy-tailed requests (no model: KV placement does not depend on the values), then
writes results/paged/<timestamp>/results.json and paged.png.
"""

from __future__ import annotations

import os

import numpy as np
from absl import app
from ml_collections import config_flags

try:
    from experiments import common
except ImportError:  # run as a script: python experiments/paged.py
    import common

common.quiet_startup()

_CONFIG = config_flags.DEFINE_config_file("config", "configs/paged.py", "ablation config",
                                          lock_config=True)
MODES = ("paged", "contiguous")


def requests(cfg, seed: int) -> list[tuple[int, int]]:
    """(prompt length, max_tokens) pairs of the heavy-tailed mix."""
    rng = np.random.default_rng(seed)
    lo, hi = cfg.prompt_len
    prompts = rng.integers(lo, hi, size=cfg.num_requests, endpoint=True)
    new = rng.lognormal(np.log(cfg.median_new_tokens), cfg.sigma, size=cfg.num_requests)
    new = np.clip(np.rint(new), cfg.min_new_tokens, cfg.max_new_tokens).astype(int)
    return list(zip(prompts.tolist(), new.tolist()))


def serve(cfg, reqs: list[tuple[int, int]], mode: str) -> dict:
    """Drives the scheduler and block manager to completion; returns occupancy and waste.

    Bookkeeping mirrors ``Engine.step``: a prefill chunk marks its tokens computed and, when it
    is the last, emits the first token; a decode row computes its last token and emits one.
    Prompt ids are distinct per request, so prefix caching never shares a page.
    """
    from llmserve.block_manager import BlockManager
    from llmserve.sampling_params import SamplingParams
    from llmserve.scheduler import Scheduler, Sequence

    blocks = BlockManager(cfg.num_pages, cfg.page_size, enable_prefix_caching=False,
                          reservation=mode, max_model_len=cfg.max_model_len)
    sched = Scheduler(blocks, max_slots=cfg.max_num_seqs, max_prefill_rows=cfg.max_prefill_rows,
                      max_chunk=cfg.max_chunk, max_num_batched_tokens=cfg.max_num_batched_tokens)
    for i, (plen, new) in enumerate(reqs):
        sched.add(Sequence(request_id=str(i), index=0, prompt_ids=[1 + i] * plen,
                           params=SamplingParams(max_tokens=new, ignore_eos=True), seed=i))
    steps = preempted = 0
    running, backlogged, reserved, used = [], [], 0, 0
    while sched.has_work():
        plan = sched.schedule(0, cfg.max_model_len)
        preempted += len(plan.preempted)
        emit = list(plan.decode)
        for seq in plan.decode:
            seq.num_computed += 1
        for chunk in plan.prefill:
            chunk.seq.num_computed += chunk.length
            if chunk.final:
                emit.append(chunk.seq)
        for seq in sched.running:  # KV held vs written, after this step's writes
            reserved += len(blocks.block_table(seq.seq_id)) * cfg.page_size
            used += seq.num_computed
        running.append(len(sched.running))
        if sched.waiting:  # memory (not a lack of requests) limits concurrency here
            backlogged.append(len(sched.running))
        for seq in emit:
            seq.output_ids.append(0)
            if len(seq.output_ids) >= seq.params.max_tokens:
                sched.finish(seq, "length")
        steps += 1
        if steps > 100 * sum(new for _, new in reqs):
            raise RuntimeError(f"{mode}: the schedule made no progress")
    blocks.check_invariants()
    assert blocks.all_free(), f"{mode}: pages leaked"
    return {"steps": steps, "mean_concurrent": float(np.mean(running)),
            "max_concurrent": int(max(running)), "kv_waste": 1 - used / reserved,
            "fit_concurrent": float(np.mean(backlogged)) if backlogged else float(max(running)),
            "preemptions": preempted, "running_per_step": running}


def plot(path: str, runs: dict, cfg) -> str:
    """Concurrent requests per step (seed 0) and the median waste per mode."""
    plt = common.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in MODES:
        ax1.plot(runs[mode][0]["running_per_step"], label=mode, linewidth=1)
    ax1.set_xlabel("scheduler step")
    ax1.set_ylabel("requests holding KV")
    ax1.legend()
    waste = [common.spread([r["kv_waste"] for r in runs[m]]) for m in MODES]
    ax2.bar(range(len(MODES)), [100 * w["median"] for w in waste], color=["C0", "C1"])
    for i, w in enumerate(waste):
        ax2.annotate(f"{100 * w['median']:.1f}%", (i, 100 * w["median"]), ha="center",
                     va="bottom", fontsize=8)
    ax2.set_xticks(range(len(MODES)), MODES)
    ax2.set_ylabel("KV waste (% of reserved slots)")
    fig.suptitle(f"{cfg.num_requests} heavy-tailed requests, KV budget {cfg.num_pages} pages x "
                 f"{cfg.page_size} tokens, max_model_len {cfg.max_model_len}", fontsize=10)
    fig.tight_layout()
    return common.save_figure(fig, path)


def main(argv) -> None:
    del argv
    cfg = _CONFIG.value
    out = common.run_dir("paged", cfg.out_root or None)
    seeds = [int(s) for s in cfg.seeds.split(",")]
    workloads = [requests(cfg, s) for s in seeds]
    runs = common.interleaved({m: (lambda rep, m=m: serve(cfg, workloads[rep], m))
                               for m in MODES}, len(seeds))
    stats = {m: {k: common.spread([r[k] for r in runs[m]])
                 for k in ("fit_concurrent", "mean_concurrent", "max_concurrent", "kv_waste",
                           "steps",
                           "preemptions")} for m in MODES}
    ratio = common.spread([p["fit_concurrent"] / c["fit_concurrent"]
                           for p, c in zip(runs["paged"], runs["contiguous"])])
    rows = [[m, common.fmt_spread(s["fit_concurrent"]), common.fmt_spread(s["mean_concurrent"]),
             common.fmt_spread(s["max_concurrent"], ".0f"),
             common.fmt_spread({k: 100 * v if k in ("median", "min", "max") else v
                                for k, v in s["kv_waste"].items()}), common.fmt_spread(
                 s["steps"], ".0f"), common.fmt_spread(s["preemptions"], ".0f")]
            for m, s in stats.items()]
    table = common.markdown_table(["reservation", "requests that fit", "mean concurrent",
                                   "max concurrent",
                                   "KV waste %", "steps", "preemptions"], rows)
    notes = [f"real allocator and scheduler, no model; {cfg.num_requests} requests per seed, "
             f"seeds {cfg.seeds}; budget {cfg.num_pages} pages of {cfg.page_size} tokens; "
             f"max_model_len {cfg.max_model_len}; median [min-max] over seeds",
             "requests that fit = mean requests holding KV over the steps where others still "
             "wait (memory is the limit there)",
             "KV waste = reserved-but-unwritten token slots / reserved, summed over steps"]
    print(f"\n{table}\n\npaged / contiguous requests that fit: "
          f"{common.fmt_spread(ratio, '.1f')}\n" + "\n".join(f"- {n}" for n in notes))
    png = plot(os.path.join(out, "paged.png"), runs, cfg)
    summary = {"paged_kv_waste": stats["paged"]["kv_waste"]["median"],
               "contiguous_kv_waste": stats["contiguous"]["kv_waste"]["median"],
               "paged_fit_concurrent": stats["paged"]["fit_concurrent"]["median"],
               "contiguous_fit_concurrent": stats["contiguous"]["fit_concurrent"]["median"],
               "concurrency_ratio": ratio["median"]}
    clean = {m: [{k: v for k, v in r.items() if k != "running_per_step"} for r in rs]
             for m, rs in runs.items()}
    path = common.write_results(out, "paged", cfg, {"stats": stats, "per_seed": clean,
                                                    "concurrency_ratio": ratio},
                                summary, notes, [png], table=table)
    print(f"\nwrote {path} and {png}")


if __name__ == "__main__":
    from llmserve.host_memory import reexec_with_hugepages

    reexec_with_hugepages()  # first: glibc reads its huge-page tunable only at process start
    app.run(main)
