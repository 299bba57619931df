r"""Where one engine decode step's time goes, per attention backend: a jax.profiler breakdown.

  python -m experiments.step_profile --config=configs/step_profile.py[:smoke]

See configs/step_profile.py. Writes results/step_profile/<timestamp>/results.json and a stacked
bar plot (device time per part, plus host time, per backend).

The trace's XLA op events are attributed by name: an ``ffi_call`` (a native CPU kernel) by its
custom-call target, read from the optimized HLO that XLA dumps into a temporary directory
(``--xla_dump_to``): the bf16 matmul is a matmul, paged attention is attention, the fixed-order
log-sum-exp is "other"; ``while`` loops (the XLA paged-attention path's page walk) are
attention; ``ynn_fusion`` /
``dot`` / ``onednn`` / ``matmul`` / ``convolution`` are matmuls (XLA:CPU hands the weight dots to
XNNPACK); ``gather`` / ``scatter`` / ``dynamic-update-slice`` are the embedding and K/V moves;
the rest (norms, RoPE, sampling, elementwise fusions) is "other". An op nested inside another
(the body of a while loop) is counted once, in its enclosing op. Times are summed over threads
(an op split over both cores counts both), so parts are shares of the work; the wall time of a
step is measured separately, without the profiler.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import shutil
import tempfile
import time

import numpy as np
from absl import app
from ml_collections import config_flags

try:
    from experiments import common
except ImportError:  # run as a script: python experiments/step_profile.py
    import common

common.quiet_startup()

# XLA dumps every compiled module's optimized HLO here (set before jax starts its backend), so
# FFI calls can be told apart by their custom-call target.
_DUMP_DIR = tempfile.mkdtemp(prefix="llmserve-step-profile-hlo-")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={_DUMP_DIR}"
                           " --xla_dump_hlo_as_text").strip()

_CONFIG = config_flags.DEFINE_config_file("config", "configs/step_profile.py", "config",
                                          lock_config=True)

PARTS = ("matmul", "attention", "gather/scatter", "other")


def part_of(name: str, target: str = "") -> str:
    """The part of a step an XLA op event belongs to, from its name (and an FFI call's
    custom-call target, when known)."""
    low = name.lower()
    if target:
        if "matmul" in target:
            return "matmul"
        return "attention" if "attention" in target else "other"
    if low.startswith(("ffi_call", "custom-call", "custom_call", "while")):
        return "attention"
    if any(k in low for k in ("ynn_fusion", "dot", "onednn", "matmul", "convolution", "xnn")):
        return "matmul"
    if any(k in low for k in ("gather", "scatter", "dynamic-update-slice",
                              "dynamic_update_slice")):
        return "gather/scatter"
    return "other"


def is_op(event: dict) -> bool:
    """An XLA op execution (not a Python frame, a runtime wrapper or a thunk executor)."""
    name = event.get("name", "")
    return (event.get("ph") == "X" and not name.startswith("$") and "::" not in name
            and not name.startswith(("PjitFunction", "np.asarray", "ThunkExecutor")))


def custom_call_targets(dump_dir: str, rows: int) -> dict[str, str]:
    """Instruction name -> custom-call target in the traced program, from XLA's optimized HLO
    dumps. Every step shape compiles a module named ``jit__packed_step`` (instruction names repeat
    across them), so the traced one is told apart by its attention calls: the decode-only
    program of ``rows`` rows has only [rows, 1, N, H] paged-attention queries."""
    best = {}
    for path in sorted(glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))):
        with open(path) as fh:
            text = fh.read()
        calls = re.findall(r"%?([\w.\-]+) = (\w+)\[([\d,]*)\][^\n]*"
                           r"custom_call_target=\"([^\"]+)\"", text)
        # calls with several outputs (a tuple type: the fused blocked matmuls) by name only
        tuples = re.findall(r"%?([\w.\-]+) = \([^\n]*custom_call_target=\"([^\"]+)\"", text)
        shapes = {dims for _, _, dims, target in calls if "attention" in target}
        if shapes and all(d.split(",")[:2] == [str(rows), "1"] for d in shapes):
            best = {name: target for name, _, _, target in calls}
            best.update(dict(tuples))
            break
    return best


def breakdown(events: list[dict], steps: int,
              targets: dict[str, str] | None = None) -> dict[str, float]:
    """Milliseconds per step in each part, nested ops counted once (in their outermost op)."""
    targets = targets or {}
    by_thread = collections.defaultdict(list)
    for e in events:
        if is_op(e):
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out = dict.fromkeys(PARTS, 0.0)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        end = -1.0
        for e in evs:
            if e["ts"] >= end:  # not inside the previous outermost op
                out[part_of(e["name"], targets.get(e["name"], ""))] += e["dur"] / 1e3 / steps
                end = e["ts"] + e["dur"]
    return out


def load(cfg):
    """(ModelConfig, params): SmolLM2-135M-Instruct, or a random-weight preset."""
    return common.load_model_or_preset(cfg)


def fill(engine, cfg, vocab: int) -> None:
    """``batch`` requests of ``context`` random tokens, stepped until every row decodes."""
    from llmserve.sampling_params import SamplingParams

    rng = np.random.default_rng(0)
    for i in range(cfg.batch):
        engine.add_request(f"r{i}", rng.integers(1, vocab, cfg.context).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True))
    while engine.scheduler.waiting or any(s.num_computed < s.num_tokens - 1
                                          for s in engine.scheduler.running):
        engine.step()
    for _ in range(2):  # the first decode steps may still allocate
        engine.step()


def profile(engine, cfg) -> dict:
    """Median decode-step wall time, then a traced breakdown of ``trace_steps`` more steps."""
    import jax

    walls = []
    for _ in range(cfg.steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(cfg.trace_steps):
                engine.step()
        path = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)[0]
        with gzip.open(path) as fh:
            trace = json.load(fh)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    parts = breakdown(events, cfg.trace_steps, custom_call_targets(_DUMP_DIR, cfg.batch))
    top = collections.Counter()
    for e in events:
        if is_op(e):
            top[e["name"]] += e["dur"] / 1e3 / cfg.trace_steps
    wall = float(np.median(walls)) * 1e3
    device = sum(parts.values())
    return {"wall_ms": wall, "wall_min_ms": min(walls) * 1e3, "parts_ms": parts,
            "device_thread_ms": device, "top_ops_ms": top.most_common(15)}


def host_share(engine, cfg) -> dict:
    """How much of a step is host work, and how much of it async scheduling leaves exposed.

    Synchronized steps (a wait right after each dispatch) give the device time of a step: the
    wait for its results once the dispatch returns. Host work = 1 - device / (that step's
    wall): scheduling, building the host batch, moving it to the device, dispatching the jitted
    call, processing outputs (counting the whole synchronized ``runner.run`` as device time,
    before 2026-12-04, left out the input transfer and the dispatch, ~1.5 ms a step on 2 CPU
    cores). Exposed = 1 - device / (the engine's own step wall time, unsynchronized): near 0
    when async scheduling hides the host work behind the device's. Rounds of each alternate
    (the machine is shared and noisy)."""
    import jax

    runner = engine.runner
    step = runner.programs.step
    waited, synced, free = [], [], []

    def timed(*args, **kw):
        out = step(*args, **kw)
        t0 = time.perf_counter()
        jax.block_until_ready(out)
        waited.append(time.perf_counter() - t0)
        return out

    for _ in range(3):
        runner.programs.step = timed
        try:
            for _ in range(cfg.steps):
                t0 = time.perf_counter()
                engine.step()
                synced.append(time.perf_counter() - t0)
        finally:
            runner.programs.step = step
        for _ in range(cfg.steps):
            t0 = time.perf_counter()
            engine.step()
            free.append(time.perf_counter() - t0)
    device = float(np.mean(waited))
    return {"host_share": float(1 - device / np.mean(synced)),
            "exposed_host_share": float(1 - device / np.mean(free)),
            "synced_step_ms": float(np.mean(synced)) * 1e3,
            "async_step_ms": float(np.mean(free)) * 1e3, "device_step_ms": device * 1e3,
            "async_scheduling": bool(engine.async_scheduling)}


def main(argv):
    del argv
    from llmserve.engine import Engine, EngineConfig

    cfg = _CONFIG.value
    out = common.run_dir("step_profile", cfg.out_root or None)
    mcfg, params = load(cfg)
    results = {}
    for backend in cfg.backends.split(","):
        engine = Engine(mcfg, params, None, EngineConfig(
            max_model_len=cfg.context + 256, max_num_seqs=cfg.batch, backend=backend,
            enable_prefix_caching=False, **common.prefill_buckets(cfg.prefill_buckets)))
        engine.warmup()
        fill(engine, cfg, mcfg.vocab_size)
        res = profile(engine, cfg)
        res.update(host_share(engine, cfg))
        results[backend] = res
        parts = ", ".join(f"{k} {v:.1f}" for k, v in res["parts_ms"].items())
        print(f"{backend}: step {res['wall_ms']:.1f} ms (min {res['wall_min_ms']:.1f}); device "
              f"thread-ms: {parts}; host work {100 * res['host_share']:.1f}% of a synchronized "
              f"step ({res['synced_step_ms']:.1f} ms, device {res['device_step_ms']:.1f} ms); "
              f"engine steps {res['async_step_ms']:.1f} ms: "
              f"{100 * res['exposed_host_share']:.1f}% exposed",
              flush=True)
        del engine
    names = list(results)
    rows = [[b, f"{results[b]['wall_ms']:.1f}"]
            + [f"{results[b]['parts_ms'][p]:.1f}" for p in PARTS]
            + [f"{100 * results[b]['host_share']:.1f}%",
               f"{100 * results[b]['exposed_host_share']:.1f}%"] for b in names]
    table = common.markdown_table(["backend", "step wall ms"] + [f"{p} (thread-ms)"
                                                                 for p in PARTS]
                                  + ["host work", "host exposed (async)"], rows)
    desc = (f"{'SmolLM2-135M' if not cfg.model else cfg.model} {cfg.dtype}, {cfg.batch} rows, "
            f"context {cfg.context}")
    print(f"\n{desc}\n{table}")
    summary = {f"{b}_step_ms": results[b]["wall_ms"] for b in names}
    summary.update({f"{b}_attention_thread_ms": results[b]["parts_ms"]["attention"]
                    for b in names})
    if len(names) == 2:
        summary[f"step_speedup_{names[1]}_over_{names[0]}"] = (results[names[0]]["wall_ms"]
                                                               / results[names[1]]["wall_ms"])
    png = plot(os.path.join(out, "step_profile.png"), results, desc)
    notes = ["parts are thread time summed over both cores (shares of the work), from a "
             "jax.profiler trace; step wall time is measured without the profiler",
             "host work: 1 - (the wait for the device's results after each dispatch) / "
             "(the step's wall time), each step synchronized right after its dispatch",
             "host exposed (async): 1 - (the same device time) / (the engine's own step "
             "wall time, async scheduling, unsynchronized); rounds alternate"]
    path = common.write_results(out, "step_profile", cfg, results, summary, notes, [png],
                                table=table)
    shutil.rmtree(_DUMP_DIR, ignore_errors=True)
    print(f"wrote {path} and {png}")


def plot(path: str, results: dict, desc: str) -> str:
    """Stacked bars of device thread-ms per part, with the step's wall time marked."""
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    names = list(results)
    bottom = np.zeros(len(names))
    for part in PARTS:
        vals = np.array([results[b]["parts_ms"][part] for b in names])
        ax.bar(names, vals, bottom=bottom, label=part)
        bottom += vals
    ax.scatter(names, [results[b]["wall_ms"] for b in names], color="k", marker="_", s=900,
               label="step wall ms", zorder=3)
    ax.set(ylabel="ms per decode step (device: thread time)", title=desc)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return common.save_figure(fig, path)


if __name__ == "__main__":
    from llmserve.host_memory import reexec_with_hugepages

    reexec_with_hugepages()  # first: glibc reads its huge-page tunable only at process start
    app.run(main)
