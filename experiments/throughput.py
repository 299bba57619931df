r"""Offline throughput: llmserve (continuous / static) vs Hugging Face generate (issue 4).

  python -m experiments.throughput --config=configs/throughput.py:runlocal
  python -m experiments.throughput --config=configs/throughput.py            # 32 prompts
  python -m experiments.throughput --config=configs/throughput.py:256

See configs/throughput.py for the workload and the overrides. Every system serves the same
requests (prompt token ids + a per-request max_tokens, greedy, EOS ignored) in one process, one
after another. Model loading, compilation and a short warm-up generate are outside the timed
region. Throughput counts only the tokens each request asked for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import importlib
import os
import time
from typing import Callable, Optional

from absl import app, logging
from ml_collections import config_flags

try:
    from experiments import common
except ImportError:  # run as a script: python experiments/throughput.py
    import common

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch's OpenMP threads spin at barriers; on cores shared with other jobs that made HF generate
# ~8x slower at 2 threads (measured). Passive waiting keeps the comparison about the frameworks.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_CONFIG = config_flags.DEFINE_config_file("config", "configs/throughput.py",
                                          "benchmark config", lock_config=True)

LABELS = {"llmserve_continuous": "llmserve continuous", "llmserve_static": "llmserve static",
          "hf_single": "HF generate 1-by-1", "hf_batch": "HF generate batch"}

# ---------------------------------------------------------------------------------- workload
@dataclasses.dataclass(frozen=True)
class Request:
    """One benchmark request: prompt token ids and how many tokens to generate."""

    prompt_ids: tuple[int, ...]
    max_tokens: int


def build_workload(wcfg, tokenizer) -> list[Request]:
    """Cuts ``num_prompts`` prompts from the tokenized corpus at distinct random offsets.

    Distinct offsets keep prefix caching from sharing pages between prompts.
    """
    import numpy as np

    ids = tokenizer.encode(common.corpus_text())
    lo, hi = wcfg.prompt_len
    n = wcfg.num_prompts
    if len(ids) - hi < n:
        raise ValueError(f"corpus of {len(ids)} tokens is too small for {n} prompts")
    rng = np.random.default_rng(wcfg.seed)
    lengths = rng.integers(lo, hi, size=n, endpoint=True)
    new_tokens = rng.integers(*wcfg.new_tokens, size=n, endpoint=True)
    offsets = rng.choice(len(ids) - hi, size=n, replace=False)
    return [Request(tuple(int(t) for t in ids[o: o + length]), int(m))
            for o, length, m in zip(offsets, lengths, new_tokens)]


def workload_summary(workload: list[Request]) -> dict:
    """Sizes and a hash of the request list, so runs (and vLLM's) can be matched up."""
    digest = hashlib.sha256(repr([(r.prompt_ids, r.max_tokens) for r in workload]).encode())
    plen = [len(r.prompt_ids) for r in workload]
    new = [r.max_tokens for r in workload]
    return {"num_prompts": len(workload), "prompt_tokens": sum(plen), "new_tokens": sum(new),
            "prompt_len_min_max": [min(plen), max(plen)],
            "new_tokens_min_max": [min(new), max(new)],
            "sha256": digest.hexdigest()[:16]}


def warmup_prompts(cfg) -> list[list[int]]:
    """Short prompts that share no page with the workload (so no prefix-cache hits)."""
    return [[100 + 7 * i + j for j in range(8)] for i in range(cfg.warmup_prompts)]


# ---------------------------------------------------------------------------------- llmserve
class StepProbe:
    """Wraps ``engine.step`` to sample KV-page usage and running sequences after every step.

    In profile mode it also wraps ``runner.run`` / ``copy_pages`` with a ``block_until_ready``
    so device time splits into decode and prefill steps; host time is the rest of the step.
    """

    def __init__(self, engine, profile: bool):
        self.engine = engine
        self.profile = profile
        self.steps = self.reserved = self.used = self.running = 0
        self.times = {"step": 0.0, "decode": 0.0, "prefill": 0.0, "copy": 0.0}
        self.calls = {"decode": 0, "prefill": 0}

    def __enter__(self) -> "StepProbe":
        engine, runner = self.engine, self.engine.runner
        step, run, copy = engine.step, runner.run, runner.copy_pages

        def probed_step():
            t0 = time.perf_counter()
            outs = step()
            self.times["step"] += time.perf_counter() - t0
            usage = engine.page_usage()
            self.steps += 1
            self.reserved += usage["reserved_slots"]
            self.used += usage["used_slots"]
            self.running += len(engine.scheduler.running)
            return outs

        engine.step = probed_step
        if self.profile:
            runner.run = self._timed(run, lambda host: "prefill" if host["tokens"].shape[1] > 1
                                     else "decode")
            runner.copy_pages = self._timed(copy, lambda pairs: "copy" if pairs else None)
        return self

    def __exit__(self, *exc) -> None:
        for obj, name in ((self.engine, "step"), (self.engine.runner, "run"),
                          (self.engine.runner, "copy_pages")):
            obj.__dict__.pop(name, None)  # the class methods show through again

    def _timed(self, fn: Callable, kind_of: Callable) -> Callable:
        import jax

        def timed(arg):
            kind = kind_of(arg)
            if kind is None:
                return fn(arg)
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(arg))
            self.times[kind] += time.perf_counter() - t0
            self.calls[kind] = self.calls.get(kind, 0) + 1
            return out

        return timed

    def summary(self, max_slots: int) -> dict:
        """KV waste (reserved-but-unused / reserved, summed over steps) and slot occupancy."""
        out = {"kv_waste": 1 - self.used / self.reserved if self.reserved else None,
               "mean_running": self.running / max(self.steps, 1),
               "occupancy": self.running / max(self.steps * max_slots, 1)}
        if self.profile:
            device = self.times["decode"] + self.times["prefill"] + self.times["copy"]
            out["profile_s"] = {**{k: round(v, 3) for k, v in self.times.items()},
                                "host": round(self.times["step"] - device, 3),
                                "calls": dict(self.calls)}
        return out


def run_llmserve(cfg, workload: list[Request], scheduling: str) -> dict:
    """Serves the workload with llmserve; returns timings, engine stats and output ids."""
    from llmserve.llm import LLM
    from llmserve.sampling_params import SamplingParams

    lcfg = cfg.llmserve
    t0 = time.perf_counter()
    llm = LLM(None, dtype="float32", max_model_len=lcfg.max_model_len,
              max_num_seqs=lcfg.max_num_seqs, page_size=lcfg.page_size,
              max_num_batched_tokens=lcfg.max_num_batched_tokens,
              enable_prefix_caching=lcfg.enable_prefix_caching, scheduling=scheduling,
              backend=lcfg.backend or None, warmup=True)
    setup_s = time.perf_counter() - t0
    llm.generate(warmup_prompts(cfg), SamplingParams(temperature=0.0, max_tokens=cfg.warmup_tokens,
                                                     ignore_eos=True), use_tqdm=False)
    engine = llm.engine
    prompts = [list(r.prompt_ids) for r in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
              for r in workload]
    before, compiled = dict(engine.stats), engine.runner.num_compilations()
    trace = contextlib.nullcontext()
    if cfg.trace_dir and scheduling == "continuous":
        import jax

        trace = jax.profiler.trace(cfg.trace_dir)
    with StepProbe(engine, cfg.profile) as probe, trace:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    stats = {k: engine.stats[k] - before[k] for k in before}
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    result = {"wall_s": wall, "generated_tokens": sum(len(t) for t in tokens),
              "setup_s": setup_s, "stats": stats,
              "slot_utilization": stats["decode_rows"] / max(stats["decode_slots"], 1),
              "prefill_utilization": stats["prefill_tokens"] / max(stats["prefill_slots"], 1),
              "recompiles": engine.runner.num_compilations() - compiled,
              "max_prefill_rows": engine.runner.max_prefill_rows,
              "backend": engine.runner.backend, **probe.summary(lcfg.max_num_seqs)}
    del llm, engine
    gc.collect()
    return {**result, "_tokens": tokens}


# ---------------------------------------------------------------------------------- HF
def load_hf_model(threads: int):
    """transformers' own loading of the same GGUF file, dequantized to float32."""
    import torch
    import transformers
    import transformers.modeling_utils as modeling_utils

    from llmserve.checkpoint.gguf import default_model_path

    torch.set_num_threads(threads)
    path = default_model_path()
    original = modeling_utils.is_accelerate_available
    if importlib.util.find_spec("accelerate") is None:
        # from_pretrained insists on `accelerate` for GGUF but does not use it on this path.
        modeling_utils.is_accelerate_available = lambda: True
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    finally:
        modeling_utils.is_accelerate_available = original
    model.eval()
    gen = model.generation_config
    gen.eos_token_id = None  # ignore EOS: every request runs to its own max_tokens
    gen.pad_token_id = model.config.eos_token_id if model.config.eos_token_id is not None else 0
    gen.do_sample = False
    gen.temperature = gen.top_p = gen.top_k = None
    return model


def hf_generate(model, batch: list[Request]) -> tuple[list[list[int]], float]:
    """One left-padded ``generate`` call up to the batch's largest max_tokens; returns each
    request's own tokens and the wall time."""
    import torch

    longest = max(len(r.prompt_ids) for r in batch)
    pad = model.generation_config.pad_token_id
    ids = torch.full((len(batch), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, longest - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        mask[i, longest - len(r.prompt_ids):] = 1
    new = max(r.max_tokens for r in batch)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                             do_sample=False)
        wall = time.perf_counter() - t0
    if out.shape[1] - longest != new:
        raise RuntimeError(f"HF generate stopped after {out.shape[1] - longest} of {new} tokens")
    gen = out[:, longest:].tolist()
    return [g[: r.max_tokens] for g, r in zip(gen, batch)], wall


def hf_warmup(model, cfg) -> None:
    hf_generate(model, [Request(tuple(p), cfg.warmup_tokens) for p in warmup_prompts(cfg)])


def run_hf_single(cfg, model, workload: list[Request]) -> dict:
    """One request per ``generate`` call, on the first ``hf_single_subset`` requests; the wall
    time for the whole workload is extrapolated from the subset's tokens/s."""
    hf_warmup(model, cfg)
    k = cfg.hf_single_subset or len(workload)
    subset = workload[:k]
    tokens, wall = [], 0.0
    for r in subset:
        toks, dt = hf_generate(model, [r])
        tokens.append(toks[0])
        wall += dt
    generated = sum(len(t) for t in tokens)
    total = sum(r.max_tokens for r in workload)
    extrapolated = k < len(workload)
    return {"wall_s": wall * total / generated if extrapolated else wall, "mean_running": 1.0,
            "measured_wall_s": wall, "generated_tokens": generated, "measured_requests": k,
            "extrapolated": extrapolated, "tokens_per_s": generated / wall,
            "_tokens": tokens}


def run_hf_batch(cfg, model, workload: list[Request]) -> dict:
    """Consecutive batches of ``hf_batch_size`` (left padding; max_new_tokens = the batch's
    largest request). KV waste is the same step-summed ratio as llmserve's, for a padded cache:
    at decode step t a batch holds B * (longest prompt + t) positions, of which the unfinished
    requests use their own prompt + t."""
    hf_warmup(model, cfg)
    b = cfg.hf_batch_size
    tokens, wall, reserved, used, rows, steps, slots = [], 0.0, 0, 0, 0, 0, 0
    for start in range(0, len(workload), b):
        batch = workload[start: start + b]
        toks, dt = hf_generate(model, batch)
        tokens += toks
        wall += dt
        longest = max(len(r.prompt_ids) for r in batch)
        for t in range(max(r.max_tokens for r in batch)):
            reserved += len(batch) * (longest + t)
            used += sum(len(r.prompt_ids) + t for r in batch if t < r.max_tokens)
            rows += sum(t < r.max_tokens for r in batch)
            steps += 1
            slots += len(batch)  # finished rows keep computing until the batch ends
    return {"wall_s": wall, "generated_tokens": sum(len(t) for t in tokens), "batch_size": b,
            "kv_waste": 1 - used / reserved, "mean_running": rows / steps,
            "slot_utilization": rows / slots, "_tokens": tokens}


# ---------------------------------------------------------------------------------- report
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


def finish_results(results: dict) -> str | None:
    """Adds tokens/s, ratios vs HF batch and agreement with a reference; returns its name."""
    for r in results.values():
        r.setdefault("tokens_per_s", r["generated_tokens"] / r["wall_s"])
    base = results.get("hf_batch", {}).get("tokens_per_s")
    for r in results.values():
        r["vs_hf_batch"] = r["tokens_per_s"] / base if base else None
    ref = next((s for s in ("hf_single", "hf_batch", "llmserve_continuous") if s in results), None)
    for name, r in results.items():
        if name != ref:
            r["agreement"] = agreement(r["_tokens"], results[ref]["_tokens"])
    return ref


def _fmt(v: Optional[float], spec: str) -> Optional[str]:
    return None if v is None else format(v, spec)


def report(cfg, results: dict, ref: Optional[str]) -> str:
    """The markdown table printed at the end of a run."""
    rows = []
    for name, r in results.items():
        label = LABELS[name] + (f" ({r['batch_size']})" if name == "hf_batch" else "")
        if r.get("extrapolated"):
            label += f" [{r['measured_requests']} req, extrap.]"
        a = r.get("agreement")
        rows.append([label, r["generated_tokens"], _fmt(r["wall_s"], ".1f"),
                     _fmt(r["tokens_per_s"], ".1f"), _fmt(r["vs_hf_batch"], ".2f"),
                     _fmt(r.get("mean_running"), ".1f"),
                     _fmt(r.get("slot_utilization"), ".1%"), _fmt(r.get("kv_waste"), ".1%"),
                     f"{a['exact']}/{a['compared']} ({a['mean_prefix_fraction']:.0%})" if a
                     else "reference"])
    headers = ["system", "gen tokens", "wall s", "tok/s", "x HF batch", "mean batch", "slot util",
               "KV waste", f"greedy = {ref}"]
    return common.markdown_table(headers, rows)


def notes(cfg, results: dict) -> list[str]:
    """Caveats printed under the table and stored in the JSON."""
    out = [f"timed after model load, compilation and a {cfg.warmup_prompts}-prompt x "
           f"{cfg.warmup_tokens}-token warm-up generate per system; torch threads = "
           f"{cfg.torch_threads}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}; fp32 on "
           f"{os.cpu_count()} CPU cores",
           "mean batch = unfinished requests per step; slot util = useful rows / computed rows "
           "(llmserve: decode_rows / decode_slots, padded up to a decode bucket); "
           "KV waste = sum over steps of (reserved - used) / reserved KV token slots"]
    loads = {n: r["loadavg_1m"] for n, r in results.items() if "loadavg_1m" in r}
    if loads:
        out.append("1-min load average before/after each system (other jobs share the cores): "
                   + ", ".join(f"{n} {a}/{b}" for n, (a, b) in loads.items()))
    single = results.get("hf_single")
    if single and single.get("extrapolated"):
        out.append(f"HF 1-by-1 ran the first {single['measured_requests']} requests; its wall "
                   "time is extrapolated to the whole workload at the measured tokens/s")
    static = results.get("llmserve_static")
    if static:
        out.append("llmserve static admits a batch only when every slot is free, prefills all of "
                   "it, then decodes until the whole batch has finished")
    if cfg.profile:
        out.append("profile mode: every device call is synchronized, so wall times run high")
    return out


def save(cfg, workload: list[Request], results: dict, ref: Optional[str], table: str,
         caveats: list[str]) -> tuple[str, str]:
    """Writes the JSON and the bar chart; returns their paths."""
    stem = os.path.join(cfg.out_dir, f"throughput_{cfg.name}")
    clean = {k: {f: v for f, v in r.items() if not f.startswith("_")}
             for k, r in results.items()}
    json_path = common.write_json(stem + ".json", {
        "config": cfg.to_dict(), "workload": workload_summary(workload), "results": clean,
        "agreement_reference": ref, "notes": caveats, "table": table})
    names = list(results)
    summary = workload_summary(workload)
    png = common.bar_chart(
        stem + ".png", [LABELS[n] for n in names],
        [("generated tokens / s", [results[n]["tokens_per_s"] for n in names]),
         ("wall time (s)", [results[n]["wall_s"] for n in names])],
        title=f"SmolLM2-135M fp32, {summary['num_prompts']} prompts "
              f"({summary['prompt_tokens']} prompt / {summary['new_tokens']} new tokens), "
              f"{os.cpu_count()} CPU cores",
        notes=[c for c in caveats if c.startswith("HF 1-by-1")])
    return json_path, png


def write_workload(cfg, workload: list[Request]) -> str:
    """The request list as JSON, for scripts/bench_vllm_cpu.sh."""
    path = os.path.join(cfg.out_dir, f"workload_{cfg.name}.json")
    return common.write_json(path, {"workload": workload_summary(workload), "requests": [
        {"prompt_token_ids": list(r.prompt_ids), "max_tokens": r.max_tokens} for r in workload]})


def export_hf_dir(cfg) -> str:
    """The GGUF dequantized to an fp32 Hugging Face directory (what vLLM on CPU can load)."""
    from llmserve.checkpoint import load_checkpoint, save_hf_dir
    from llmserve.checkpoint.gguf import default_model_path
    from llmserve.tokenizer import Tokenizer

    directory = os.path.join(cfg.out_dir, "smollm2-135m-fp32-hf")
    model_cfg, params = load_checkpoint(None, dtype="float32")
    save_hf_dir(directory, model_cfg, params, Tokenizer.from_gguf(default_model_path()).files())
    return directory


def main(argv) -> None:
    del argv
    cfg = _CONFIG.value
    from llmserve.checkpoint.gguf import default_model_path
    from llmserve.tokenizer import Tokenizer

    workload = build_workload(cfg.workload, Tokenizer.from_gguf(default_model_path()))
    summary = workload_summary(workload)
    logging.info("workload: %s", summary)
    print(f"workload written to {write_workload(cfg, workload)}")
    if cfg.prepare_only:
        print(f"fp32 HF directory written to {export_hf_dir(cfg)}")
        return
    systems = [s.strip() for s in cfg.systems.split(",") if s.strip()]
    unknown = set(systems) - set(LABELS)
    if unknown:
        raise app.UsageError(f"unknown systems {sorted(unknown)}; choose from {list(LABELS)}")
    results, model = {}, None
    for name in [s for s in LABELS if s in systems]:  # fixed order: tables line up across runs
        print(f"running {LABELS[name]} ...", flush=True)
        load = os.getloadavg()[0]
        if name.startswith("llmserve"):
            results[name] = run_llmserve(cfg, workload, name.split("_")[1])
        else:
            model = model or load_hf_model(cfg.torch_threads)
            run = run_hf_single if name == "hf_single" else run_hf_batch
            results[name] = run(cfg, model, workload)
        r = results[name]
        r["loadavg_1m"] = [round(load, 2), round(os.getloadavg()[0], 2)]  # before, after
        print(f"  {r['generated_tokens']} tokens in {r['wall_s']:.1f} s", flush=True)
    ref = finish_results(results)
    table = report(cfg, results, ref)
    caveats = notes(cfg, results)
    print(f"\n{summary}\n\n{table}\n\n" + "\n".join(f"- {c}" for c in caveats))
    for name, r in results.items():
        if "profile_s" in r:
            print(f"profile {name}: {r['profile_s']}")
    json_path, png = save(cfg, workload, results, ref, table, caveats)
    print(f"\nwrote {json_path} and {png}")


if __name__ == "__main__":
    app.run(main)
