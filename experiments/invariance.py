r"""Bitwise batch invariance: the matrix (conditions x differing bits) and the mode's cost.

  python -m experiments.invariance --config=configs/invariance.py[:smoke]

See configs/invariance.py. Writes results/invariance/<timestamp>/results.json and a plot.
"""

from __future__ import annotations

import os
import time

import numpy as np
from absl import app
from ml_collections import config_flags

try:
    from experiments import common
except ImportError:  # run as a script: python experiments/invariance.py
    import common

common.quiet_startup()

_CONFIG = config_flags.DEFINE_config_file("config", "configs/invariance.py", "config",
                                          lock_config=True)


def load(cfg):
    """(ModelConfig, params): SmolLM2-135M-Instruct, or a random-weight preset."""
    return common.load_model_or_preset(cfg)


def engine_kwargs(cfg) -> dict:
    return dict(max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
                page_size=cfg.page_size, max_num_batched_tokens=4 * cfg.page_size * 8,
                prefill_buckets=((1, 2 * cfg.page_size), (4, 8 * cfg.page_size)),
                decode_buckets=(8, cfg.max_num_seqs), max_logprobs=2)


def cost(cfg, mcfg, params) -> dict:
    """tok/s of one greedy workload with and without the mode, interleaved."""
    from llmserve.engine import Engine, EngineConfig
    from llmserve.sampling_params import SamplingParams
    from llmserve.testing.invariance import run

    rng = np.random.default_rng(cfg.seed + 1)
    reqs = [(f"r{i}", rng.integers(1, mcfg.vocab_size, int(rng.integers(8, cfg.max_prompt)))
             .tolist(), SamplingParams(temperature=0, max_tokens=cfg.max_new, ignore_eos=True))
            for i in range(cfg.cost_requests)]
    engines = {}
    for mode in (False, True):
        eng = Engine(mcfg, params, None, EngineConfig(**engine_kwargs(cfg), batch_invariant=mode,
                                                      enable_prefix_caching=False))
        eng.warmup()
        engines["invariant" if mode else "default"] = eng
    times = {k: [] for k in engines}
    for _ in range(cfg.repeats):
        for name, eng in engines.items():
            t0 = time.perf_counter()
            run(eng, reqs)
            times[name].append(time.perf_counter() - t0)
    tokens = len(reqs) * cfg.max_new
    out = {name: tokens / float(np.median(t)) for name, t in times.items()}
    out["invariant_over_default"] = out["invariant"] / out["default"]
    return out


def main(argv):
    del argv
    from llmserve.sampling_params import SamplingParams
    from llmserve.testing.invariance import Target, engine_factory, invariance_matrix

    cfg = _CONFIG.value
    out = common.run_dir("invariance", cfg.out_root or None)
    mcfg, params = load(cfg)
    rng = np.random.default_rng(cfg.seed)
    targets = [Target(rng.integers(1, mcfg.vocab_size, int(rng.integers(4, cfg.max_prompt)))
                      .tolist(),
                      SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, seed=i,
                                     max_tokens=cfg.max_new, logprobs=1, ignore_eos=True))
               for i in range(cfg.num_targets)]
    make = engine_factory(mcfg, params, **engine_kwargs(cfg))
    t0 = time.perf_counter()
    matrix = invariance_matrix(make, targets, vocab=mcfg.vocab_size,
                               cotenants=[int(x) for x in cfg.cotenants.split(",")],
                               max_prompt=cfg.max_prompt, max_new=cfg.max_new, seed=cfg.seed)
    elapsed = time.perf_counter() - t0
    preemptions = matrix.pop("preemptions")[0]
    costs = cost(cfg, mcfg, params)
    rows = [[k, v[0], v[1]] for k, v in matrix.items()]
    table = common.markdown_table(["condition", "differing token ids", "differing logprob bits"],
                                  rows)
    print(f"\n{mcfg.dtype}, {len(targets)} targets, {preemptions} preemptions\n{table}\n"
          f"cost: {costs['invariant']:.1f} vs {costs['default']:.1f} tok/s "
          f"({costs['invariant_over_default']:.2f}x)")
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh([r[0] for r in rows], [r[2] for r in rows], color="tab:blue")
    ax.set_xlabel("differing logprob bits (0 = bitwise identical)")
    ax.set_title(f"batch invariance, {mcfg.dtype}; cost {costs['invariant_over_default']:.2f}x")
    png = common.save_figure(fig, os.path.join(out, "invariance.png"))
    summary = {"differing_bits_total": sum(v[1] for v in matrix.values()),
               "differing_tokens_total": sum(v[0] for v in matrix.values()),
               "invariant_tok_s_ratio": costs["invariant_over_default"],
               "preemptions": preemptions, "matrix_seconds": elapsed}
    path = common.write_results(out, "invariance", cfg, {"matrix": matrix, "cost": costs},
                                summary, [f"{len(targets)} targets"], [png], table=table)
    print(f"wrote {path}")


if __name__ == "__main__":
    from llmserve.host_memory import reexec_with_hugepages

    reexec_with_hugepages()  # first: glibc reads its huge-page tunable only at process start
    app.run(main)
