r"""Soak with faults: many random requests, aborts and bad requests, then every invariant.

  python -m experiments.soak --config=configs/soak.py:smoke
  python -m experiments.soak --config=configs/soak.py

See configs/soak.py for the workload and llmserve/testing/soak.py for the checks. Prints the
figures per run, writes results.json and a plot, and exits with status 1 if any check failed.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from absl import app
from ml_collections import config_flags

try:
    from experiments import common
except ImportError:  # run as a script: python experiments/soak.py
    import common

common.quiet_startup()

_CONFIG = config_flags.DEFINE_config_file("config", "configs/soak.py", "soak config",
                                          lock_config=True)


def soak_config(cfg):
    """The library's SoakConfig from the experiment's ConfigDict."""
    from llmserve.testing.soak import SoakConfig

    fields = {f.name for f in dataclasses.fields(SoakConfig)}
    kw = {k: v for k, v in cfg.to_dict().items() if k in fields}
    kw["runs"] = tuple(r.strip() for r in cfg.runs.split(",") if r.strip())
    kw["prefill_buckets"] = tuple(tuple(b) for b in cfg.prefill_buckets)
    kw["decode_buckets"] = tuple(cfg.decode_buckets)
    return SoakConfig(**kw)


def plot(path: str, timeline: dict, num_pages: int) -> str:
    """Running and waiting requests and free pages per engine step, one panel per run."""
    plt = common.pyplot()
    fig, axes = plt.subplots(1, len(timeline), figsize=(4.5 * len(timeline), 3.6),
                             squeeze=False)
    for ax, (run, steps) in zip(axes[0], timeline.items()):
        running, waiting, free = zip(*steps) if steps else ((), (), ())
        ax.plot(running, label="running", linewidth=1)
        ax.plot(waiting, label="waiting", linewidth=1)
        ax.plot(free, label=f"free pages (of {num_pages - 1})", linewidth=1)
        ax.set_title(run, fontsize=10)
        ax.set_xlabel("engine step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return common.save_figure(fig, path)


def main(argv) -> None:
    del argv
    from llmserve.testing.soak import run_soak

    cfg = _CONFIG.value
    out = common.run_dir("soak", cfg.out_root or None)
    report = run_soak(soak_config(cfg), log=print)
    keys = list(report.figures["total"])
    rows = [[run] + [figs.get(k) for k in keys] for run, figs in report.figures.items()]
    table = common.markdown_table(["run"] + keys, rows)
    print(f"\n{table}\n")
    for failure in report.failures[:50]:
        print("FAIL", failure)
    png = plot(os.path.join(out, "soak.png"), report.timeline, cfg.num_pages)
    total = report.figures["total"]
    summary = {"requests": total["requests"], "aborted_requests": total["aborted_requests"],
               "preemptions": total["preemptions"],
               "generated_tokens": total["generated_tokens"],
               "compared_with_lone_run": total["compared_with_lone_run"],
               "failures": len(report.failures), "wall_s": total["wall_s"]}
    notes = ["pass = every check of llmserve/testing/soak.py holds; failures lists each one",
             "wall_s includes warm-up (compilation) and the lone runs"]
    path = common.write_results(out, "soak", cfg, {"figures": report.figures,
                                                   "failures": report.failures},
                                summary, notes, [png], table=table)
    print(f"{'PASS' if report.ok else 'FAIL'}: {len(report.failures)} failed checks; "
          f"wrote {path} and {png}")
    if not report.ok:
        sys.exit(1)


if __name__ == "__main__":
    from llmserve.host_memory import reexec_with_hugepages

    reexec_with_hugepages()  # first: glibc reads its huge-page tunable only at process start
    app.run(main)
