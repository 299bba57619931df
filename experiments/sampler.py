r"""The sampler alone, native CPU kernel against the jnp path, per sampling setting and batch.

  python -m experiments.sampler                            # batches 32 and 256, ~2 min
  python -m experiments.sampler --batches=8,32 --iters=5

Each point is ``sampling.sample`` jitted on its own over random logits [B, 49152] (SmolLM2's
vocabulary, N(0, 3)), every row with the same setting and its own seed. Two builds of it are
traced, one with the native kernel (``cpu_kernels.sample_cpu``: thresholds by radix selection,
the CPU default) and one with ``LLMSERVE_NATIVE_SAMPLING=0`` (the jnp path: thresholds by
bisection, each round one pass over [B, V]). Calls alternate between the two; each point is the
minimum over ``iters`` calls, so other load on a shared machine inflates both alike. The two
paths' tokens are compared call by call (``differing``, of ``draws``): they draw from the same
distribution with the same uniforms, but XLA:CPU divides by the temperature with a refined
reciprocal and sums masses in float32 while the kernel divides exactly and sums in float64, so
a uniform that lands within rounding of a token boundary can pick the neighbouring token (a
handful in 10^4). Prints the table; writes results/sampler/<timestamp>/results.json and
sampler.png.

Measured (2-core AMD EPYC Zen 4, 2026-12-06), ms native / jnp at 32 and at 256 rows: see README,
"Sampling on CPU".
"""

from __future__ import annotations

import os
import time

import numpy as np
from absl import app, flags

try:
    from experiments import common
except ImportError:  # run as a script: python experiments/sampler.py
    import common

common.quiet_startup()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from llmserve import sampling  # noqa: E402
from llmserve.sampling_params import SamplingArrays  # noqa: E402

_BATCHES = flags.DEFINE_list("batches", ["32", "256"], "rows per call")
_VOCAB = flags.DEFINE_integer("vocab", 49152, "vocabulary size (SmolLM2's by default)")
_ITERS = flags.DEFINE_integer("iters", 7, "timed calls per point and path (minimum)")
_OUT = flags.DEFINE_string("out_root", "", "results root ('' = results/ or $LLMSERVE_RESULTS)")

SETTINGS = {
    "greedy": {},
    "temperature 0.7": {"temperature": 0.7},
    "top-k 50": {"temperature": 0.7, "top_k": 50},
    "top-p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "top-k 50 + top-p 0.9": {"temperature": 0.7, "top_k": 50, "top_p": 0.9},
    "min-p 0.05": {"temperature": 0.7, "min_p": 0.05},
}


def build(native: bool):
    """``sampling.sample``'s tokens, jitted and traced with (or without) the native kernel."""
    fn = jax.jit(lambda x, arrays, pos: sampling.sample(x, arrays, pos).tokens)

    def call(*args):
        old = os.environ.get("LLMSERVE_NATIVE_SAMPLING")
        os.environ["LLMSERVE_NATIVE_SAMPLING"] = "1" if native else "0"
        try:  # the flag is read while tracing: the first call fixes the path
            return fn(*args)
        finally:
            if old is None:
                os.environ.pop("LLMSERVE_NATIVE_SAMPLING")
            else:
                os.environ["LLMSERVE_NATIVE_SAMPLING"] = old

    return call


def point(batch: int, vocab: int, setting: dict, iters: int, seed: int = 0) -> dict:
    """Min ms of each path over ``iters`` alternated calls, and how many tokens differed."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((batch, vocab), np.float32) * 3)
    arrays = SamplingArrays.from_lists([dict(setting, seed=i) for i in range(batch)])
    paths = {"native": build(True), "jnp": build(False)}
    times = {name: [] for name in paths}
    differing = 0
    for i in range(iters + 1):  # call 0 compiles
        pos = jnp.full((batch,), i, jnp.int32)
        out = {}
        for name, fn in paths.items():
            t0 = time.perf_counter()
            out[name] = np.asarray(jax.block_until_ready(fn(x, arrays, pos)))
            if i:
                times[name].append(1e3 * (time.perf_counter() - t0))
        differing += int(np.sum(out["native"] != out["jnp"]))
    ms = {name: min(t) for name, t in times.items()}
    return {"batch": batch, "vocab": vocab, **ms, "speedup": ms["jnp"] / ms["native"],
            "differing": differing, "draws": batch * (iters + 1)}


def plot(path: str, rows: list[dict], batches: list[int], notes: list[str]) -> str:
    """One panel per batch: each setting's native and jnp times side by side (log scale)."""
    plt = common.pyplot()
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        mine = [r for r in rows if r["batch"] == batch]
        xs = np.arange(len(mine))
        for off, key, label in ((-0.2, "native", "native kernel"), (0.2, "jnp", "jnp path")):
            bars = ax.bar(xs + off, [r[key] for r in mine], 0.4, label=label)
            for bar, r in zip(bars, mine):
                ax.annotate(f"{r[key]:.3g}", (bar.get_x() + bar.get_width() / 2,
                                              bar.get_height()), ha="center", va="bottom",
                            fontsize=7)
        ax.set_yscale("log")
        ax.set_xticks(xs, [r["setting"] for r in mine], rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("ms per call (log scale)")
        ax.set_title(f"{batch} rows", fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle("sampling.sample alone: native CPU kernel vs jnp path", fontsize=10)
    fig.text(0.01, 0.01, "\n".join(notes), fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
    return common.save_figure(fig, path)


def main(argv):
    del argv
    batches = [int(b) for b in _BATCHES.value]
    out = common.run_dir("sampler", _OUT.value or None)
    rows = []
    for batch in batches:
        for name, setting in SETTINGS.items():
            r = {"setting": name, **point(batch, _VOCAB.value, setting, _ITERS.value)}
            print(f"B={batch:4d} {name:22s} native {r['native']:8.2f} ms  jnp {r['jnp']:8.2f} ms"
                  f"  {r['speedup']:6.1f}x  differing tokens: {r['differing']}/{r['draws']}",
                  flush=True)
            rows.append(r)
    table = common.markdown_table(
        ["rows", "setting", "native ms", "jnp ms", "jnp / native", "differing tokens"],
        [(r["batch"], r["setting"], f"{r['native']:.2f}", f"{r['jnp']:.2f}",
          f"{r['speedup']:.1f}", f"{r['differing']}/{r['draws']}") for r in rows])
    print("\n" + table)
    notes = [f"sampling.sample jitted alone on random logits [B, {_VOCAB.value}]; min of "
             f"{_ITERS.value} alternated calls per path; {jax.default_backend()}, "
             f"{os.cpu_count()} cores"]
    png = plot(os.path.join(out, "sampler.png"), rows, batches, notes)
    summary = {f"{r['setting'].replace(' ', '_')}_b{r['batch']}_{k}_ms": r[k]
               for r in rows for k in ("native", "jnp")}
    summary["differing_token_fraction"] = (sum(r["differing"] for r in rows)
                                           / sum(r["draws"] for r in rows))
    path = common.write_results(out, "sampler", {"name": "sampler", "batches": batches,
                                                 "vocab": _VOCAB.value, "iters": _ITERS.value},
                                rows, summary, notes, [png], table=table)
    print(f"\nwrote {path} and {png}")


if __name__ == "__main__":
    from llmserve.host_memory import reexec_with_hugepages

    reexec_with_hugepages()  # first: glibc reads its huge-page tunable only at process start
    app.run(main)
