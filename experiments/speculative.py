r"""Speculative decoding: speedup over plain decoding from interleaved A/B pairs (issue 11).

  python -m experiments.speculative --config=configs/speculative.py:smoke
  python -m experiments.speculative --config=configs/speculative.py:small
  python -m experiments.speculative --config=configs/speculative.py
  python -m experiments.speculative --config=configs/speculative.py --config.dtype=float32

See configs/speculative.py for the workloads, the pairs and the overrides (the prompts are built
in experiments/spec_workloads.py). n-gram runs on the input-grounded workload (stdlib functions
to rewrite with type hints or docstrings), the draft model and the EAGLE head on held-out chat
questions. Only the public API is used:
``LLM(..., speculative_config={...})``, ``Engine.add_request`` / ``step``, ``engine.stats`` and
``engine.spec_metrics()``.

Per row (workload, method, adaptive, batch) it reports:
- speedup: per pair, speculative decode tok/s over the same pair's plain decode tok/s; the median
  and [min-max] over the pairs. A pair runs plain and every variant on the same prompts in
  lockstep (turns of ``steps_per_turn`` ``engine.step()`` calls of each, each turn ending with
  the engine's device work; one step a turn with ``async_scheduling=False``), so the shared
  machine's load changes hit them alike; an engine's decode tok/s = the tokens it produced
  after every request of the round had its first token / the summed wall time of its own
  steps since then;
- plain and speculative decode tok/s (medians), and whether every greedy output equals the plain
  run's on the same prompts;
- mean accepted length (accepted drafts per verify row) and acceptance per draft position, from
  ``engine.spec_metrics()`` over the engine's pairs;
- the verify / decode step cost: the wall time of each ``engine.step()`` call in the timed
  window, host work included (proposing, the draft's own steps, acceptance, detokenizing). A
  step is a verify step when ``engine.stats["spec_verify_time_s"]`` grew during it; plain decode
  steps come from the plain engine of the same pair. The ratio is median verify step / median
  plain decode step, per pair, then the median over pairs.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import time
from typing import Optional

from absl import app, logging
from ml_collections import config_flags

try:
    from experiments import common
    from experiments.spec_report import CHAT, GROUNDED, notes, plot, report, row_order, summarize
    from experiments.spec_workloads import (
        Prompt,
        chat_prompts,
        grounded_prompts,
        groups,
        rewrite_request,
    )
except ImportError:  # run as a script: python experiments/speculative.py
    import common
    from spec_report import CHAT, GROUNDED, notes, plot, report, row_order, summarize
    from spec_workloads import Prompt, chat_prompts, grounded_prompts, groups, rewrite_request

common.quiet_startup()

_CONFIG = config_flags.DEFINE_config_file("config", "configs/speculative.py",
                                          "benchmark config", lock_config=True)

VERIFY_KEY = "spec_verify_time_s"  # engine.stats: grows on every verify step


# ---------------------------------------------------------------------------------- config
def per_batch(spec: str, batch: int) -> int:
    """``"1:9,4:7,16:5"`` at ``batch``: the value of the largest listed batch <= it."""
    table = sorted((int(b), int(v)) for b, v in (kv.split(":") for kv in str(spec).split(",")))
    value = table[0][1]
    for b, v in table:
        if b <= batch:
            value = v
    return value


def _list(s: str) -> list[str]:
    return [x.strip() for x in str(s).split(",") if x.strip()]


def draft_lengths(cfg, method: Optional[str] = None) -> list[int]:
    """The R values compared side by side: ``draft_lengths`` ("4,6,8"), else the method's own
    (``ngram_speculative_tokens`` for n-gram, ``num_speculative_tokens`` for the others);
    ``method`` None: every R any method may use."""
    listed = [int(r) for r in _list(cfg.draft_lengths)]
    if listed:
        return listed
    ngram = [int(cfg.get("ngram_speculative_tokens") or cfg.num_speculative_tokens)]
    if method is None:
        return sorted({int(cfg.num_speculative_tokens), *ngram})
    return ngram if method.startswith("ngram") else [int(cfg.num_speculative_tokens)]


def check_config(cfg) -> None:
    """Clear errors for a bad override before any model is loaded."""
    for r in _list(cfg.draft_lengths):
        if not r.isdigit() or not 1 <= int(r) <= 16:
            raise ValueError(f"draft_lengths={cfg.draft_lengths!r}: integers in [1, 16]")
    for b in _list(cfg.batches):
        if not b.isdigit() or int(b) < 1:
            raise ValueError(f"batches={cfg.batches!r}: positive integers")
    for field, least in (("pairs", 1), ("grounded_pairs", 1),
                         ("max_tokens", 2)):  # 2: one timed decode step at least
        for kv in _list(cfg.get(field) or ""):
            parts = kv.split(":")
            if len(parts) != 2 or not all(x.isdigit() for x in parts) or int(parts[1]) < least:
                raise ValueError(f"{field}={getattr(cfg, field)!r}: use batch:value,... with "
                                 f"values >= {least}")
    cap = cfg.get("max_verify_tokens", -1)
    if not isinstance(cap, int) or cap < -1 or cap == 1:
        raise ValueError(f"max_verify_tokens={cap!r}: -1 (the engine's default), 0 (no cap) "
                         "or an int >= 2")
    for a in _list(cfg.adaptive):
        if a.lower() not in ("true", "false"):
            raise ValueError(f"adaptive={cfg.adaptive!r}: true and/or false")
    unknown = set(_list(cfg.grounded_methods) + _list(cfg.chat_methods)) - {
        "ngram", "draft", "eagle"}
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}: use ngram, draft, eagle")
    longest = max(per_batch(cfg.max_tokens, int(b)) for b in _list(cfg.batches))
    need = cfg.max_chat_prompt_tokens + longest + max(draft_lengths(cfg))
    if need > cfg.chat_max_model_len:
        raise ValueError(f"chat_max_model_len={cfg.chat_max_model_len} < {need} (prompt + "
                         "max_tokens + R)")


# ---------------------------------------------------------------------------------- models
def load_models(cfg) -> dict:
    """Target (config, params) in ``cfg.dtype``, the tokenizer, and the draft (a path or a
    (config, params) pair) with a description."""
    from llmserve.checkpoint.gguf import default_model_path
    from llmserve.model import init_params
    from llmserve.progress import phase
    from llmserve.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_model_path())
    with phase(f"loading the target ({cfg.target_model or 'SmolLM2-135M-Instruct'}, "
               f"{cfg.dtype})"):
        if cfg.target_model:  # a random-weight preset: the smoke variant (pipeline check only)
            from llmserve.config import preset

            tcfg = preset(cfg.target_model).replace(dtype=cfg.dtype)
            tparams = init_params(tcfg, 0)
        else:
            from llmserve.checkpoint import load_checkpoint

            tcfg, tparams = load_checkpoint(None, dtype=cfg.dtype)
    models = {"target": (tcfg, tparams), "tokenizer": tok}
    if os.path.isdir(cfg.draft_model) and not cfg.target_model:
        models["draft"] = cfg.draft_model  # loaded by the engine, in the target's dtype
        models["draft_desc"] = f"distilled draft ({cfg.draft_model})"
    else:
        dcfg = tcfg.replace(n_layers=cfg.untrained_draft_layers, tie_embeddings=True)
        dparams = dict(init_params(dcfg))
        dparams["embed"] = tparams["embed"]  # the LM head is final norm + tied embedding
        models["draft"] = (dcfg, dparams)
        models["draft_desc"] = (f"UNTRAINED {dcfg.n_layers}-layer draft sharing the target's "
                                f"embedding ({cfg.draft_model} not found)")
    return models


def spec_config(cfg, models: dict, method: str, adaptive: bool, r: int) -> dict:
    """The ``speculative_config`` a user would pass for this method ("ngram-device": n-gram
    drafts looked up on the device) with R = ``r``."""
    on_device = method == "ngram-device"
    method = "ngram" if on_device else method
    spec = {"method": method, "num_speculative_tokens": r,
            "adaptive": adaptive}
    if int(cfg.get("max_verify_tokens", -1)) >= 0:  # else the engine's default
        spec["max_verify_tokens"] = int(cfg.max_verify_tokens)
    if method == "ngram":
        spec.update(prompt_lookup_max=cfg.ngram_max, prompt_lookup_min=cfg.ngram_min,
                    prompt_lookup_on_device=on_device)
    elif method == "draft":
        spec["model"] = models["draft"]
    else:
        spec["model"] = cfg.eagle_model
    return spec


def build_llm(cfg, models: dict, workload: str, batch: int, spec: Optional[dict]):
    """An ``LLM`` over the shared target weights; every step shape compiled (warm-up)."""
    from llmserve.llm import LLM

    tcfg, tparams = models["target"]
    buckets = cfg.grounded_prefill_buckets if workload == GROUNDED else cfg.chat_prefill_buckets
    return LLM(None, params=tparams, model_config=tcfg, tokenizer=models["tokenizer"],
               max_num_seqs=batch, page_size=cfg.page_size,
               max_model_len=(cfg.grounded_max_model_len if workload == GROUNDED
                              else cfg.chat_max_model_len),
               max_num_batched_tokens=cfg.max_num_batched_tokens,
               backend=cfg.backend or None, decode_buckets=(batch,),
               prefill_buckets=tuple(tuple(b) for b in buckets),
               speculative_config=spec, warmup=True,
               # Async (the default): plain steps run ahead in both engines, and each turn
               # of the lockstep ends with the engine's device work (serve_lockstep).
               async_scheduling=bool(cfg.async_scheduling))


def engine_of(llm):
    """The engine behind an ``LLM`` (vLLM's name ``llm_engine`` when it exists)."""
    return getattr(llm, "llm_engine", None) or llm.engine


def _compilations(engine) -> Optional[int]:
    count = getattr(getattr(engine, "runner", None), "num_compilations", None)
    return count() if callable(count) else None


# ---------------------------------------------------------------------------------- running
def serve(engine, prompts: list[Prompt], params, tag: str) -> dict:
    """Serves one round of concurrent requests on one engine (see ``serve_lockstep``)."""
    return serve_lockstep({"only": engine}, prompts, params, tag)["only"]


def serve_lockstep(engines: dict, prompts: list[Prompt], params, tag: str,
                   turn: int = 1) -> dict:
    """Serves the same round of concurrent requests on every engine, in lockstep: ``turn``
    ``engine.step()`` calls of each in turn (in ``engines``' order) until all are done, so a
    change in the machine's load (this 2-core machine is shared) hits every engine alike.

    An async engine's step leaves its device work running after ``step()`` returns; each
    turn ends with ``engine.wait_device()``, timed as part of the turn's last step, so no
    engine's work runs into another's turn (the cost: the turn's first launch does not
    overlap the previous step, one host launch per ``turn`` steps).

    Per engine: decode tok/s over its own steps after its last first token (the tokens it
    produced then / the summed wall time of those steps), each such step's seconds and whether
    it verified drafts, and every request's token ids and top-2 logprob gaps.
    """
    state = {}
    for name, engine in engines.items():
        rids = [engine.add_request(f"{tag}-{name}-{i}", list(p.ids), params)
                for i, p in enumerate(prompts)]
        state[name] = {"rids": rids, "count": dict.fromkeys(rids, 0), "final": {}, "gaps": {},
                       "start": None, "time": 0.0, "steps": []}
    live = list(engines)
    while live:
        for name in list(live):
            engine, st = engines[name], state[name]
            for i in range(turn):
                before = engine.stats.get(VERIFY_KEY, 0.0)
                t0 = time.perf_counter()
                outs = engine.step()
                done = not engine.has_unfinished_requests()
                if (i == turn - 1 or done) and hasattr(engine, "wait_device"):
                    engine.wait_device()
                dt = time.perf_counter() - t0
                if st["start"] is not None:
                    st["time"] += dt
                    st["steps"].append((dt, engine.stats.get(VERIFY_KEY, 0.0) != before))
                for out in outs:
                    st["count"][out.request_id] = len(out.outputs[0].token_ids)
                    if out.finished:
                        st["final"][out.request_id] = list(out.outputs[0].token_ids)
                        st["gaps"][out.request_id] = [_top2_gap(lp)
                                                      for lp in out.outputs[0].logprobs or []]
                if st["start"] is None and all(st["count"].values()):
                    st["start"] = sum(st["count"].values())
                if done:
                    live.remove(name)
                    break
    results = {}
    for name, st in state.items():
        tokens = sum(st["count"].values()) - st["start"]
        results[name] = {
            "tok_s": tokens / st["time"] if st["time"] > 0 else None, "tokens": tokens,
            "wall_s": st["time"], "steps": st["steps"],
            "token_ids": [st["final"][r] for r in st["rids"]],
            "top2_gaps": [st["gaps"].get(r, []) for r in st["rids"]]}
    return results


def _top2_gap(entry: dict) -> float:
    """The gap between the two largest logprobs of one position (inf if fewer than two)."""
    top = sorted(entry.values(), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def near_tie_divergences(plain: dict, spec: dict, tol: float) -> tuple[int, list[float]]:
    """(requests whose tokens differ NOT at a near-tie, the plain run's top-2 gaps at each
    first divergence). Where a verify step's rows could round differently from a decode
    step's (XLA's dots and attention on the ``xla`` backend), greedy output may split where the
    two best tokens are within rounding of each other; on the ``cpu`` backend every row is
    computed alone (native kernels, fixed-order RMSNorm), so any split there is a bug."""
    hard, at = 0, []
    for a, b, gaps in zip(plain["token_ids"], spec["token_ids"], plain["top2_gaps"]):
        if a == b:
            continue
        i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
        gap = gaps[i] if i < len(gaps) else float("inf")
        at.append(gap)
        hard += gap >= tol
    return hard, at


def _median(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def measure(cfg, models: dict, workload: str, methods: list[str], batch: int,
            prompts: list[Prompt], skipped: dict) -> list[dict]:
    """The interleaved A/B pairs of one (workload, batch): one row per speculative variant."""
    from tqdm.auto import tqdm

    from llmserve.sampling_params import SamplingParams

    pairs = per_batch((workload == GROUNDED and cfg.get("grounded_pairs")) or cfg.pairs, batch)
    max_tokens = per_batch(cfg.max_tokens, batch)
    adaptive = [a.lower() == "true" for a in _list(cfg.adaptive)]
    engines, setup = {}, {}
    if "ngram" in methods:  # one variant per lookup place (configs/speculative.py)
        where = _list(cfg.ngram_lookup)
        if not where or set(where) - {"device", "host"}:
            raise ValueError(f"ngram_lookup={cfg.ngram_lookup!r}: use device, host or both")
        i = methods.index("ngram")
        methods = (methods[:i] + [{"host": "ngram", "device": "ngram-device"}[w] for w in where]
                   + methods[i + 1:])
    variants = [(f"{m} adaptive={'on' if a else 'off'}"
                 + (f" R={r}" if len(draft_lengths(cfg, m)) > 1 else ""),
                 spec_config(cfg, models, m, a, r))
                for m in methods if m not in skipped for a in adaptive
                for r in draft_lengths(cfg, m)]
    for name, spec in variants + [("plain", None)]:
        if spec is None and not engines:
            return []  # every variant skipped: no plain run needed
        if spec is not None and spec["method"] in skipped:
            continue
        if spec is not None and spec["method"] == "eagle" and not os.path.exists(
                cfg.eagle_model):
            skipped["eagle"] = f"EAGLE rows skipped: {cfg.eagle_model} does not exist"
            logging.warning(skipped["eagle"])
            continue
        t0 = time.perf_counter()
        try:
            llm = build_llm(cfg, models, workload, batch, spec)
        except (ValueError, TypeError, NotImplementedError, KeyError, OSError) as e:
            if spec is None or spec["method"] != "eagle":
                raise
            skipped["eagle"] = f"EAGLE rows skipped: the engine rejected it ({e})"
            logging.warning(skipped["eagle"])
            continue
        engines[name], setup[name] = engine_of(llm), time.perf_counter() - t0
    plan, reused = groups(prompts, batch, pairs)
    if reused:  # long prompts: prefill the one group once per engine, outside any timing
        warm = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for name, engine in engines.items():
            serve(engine, plan[0], warm, f"warm-{name}")
    # logprobs=2: the top-2 gap tells a bf16 near-tie split from a real divergence (the step
    # computes the engine's top-N logprobs whether a request asks or not).
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=2)
    compiled = {n: _compilations(e) for n, e in engines.items()}
    names = ["plain"] + [n for n in engines if n != "plain"]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    bar = tqdm(range(pairs), desc=f"{workload} batch {batch}", leave=False)
    for p in bar:
        order = names[p % len(names):] + names[:p % len(names)]  # rotated every pair
        out = serve_lockstep({n: engines[n] for n in order}, plan[p], params, f"p{p}",
                             turn=int(cfg.steps_per_turn) if cfg.async_scheduling else 1)
        for name in order:
            runs[name].append(out[name])
        plain = runs["plain"][-1]["tok_s"]
        bar.set_postfix_str(" ".join(
            f"{n.replace(' adaptive=', '/').replace(' R=', '/R')} "
            f"{runs[n][-1]['tok_s'] / plain:.2f}x"
            for n in names[1:]))
    bar.close()
    rows = [variant_row(cfg, workload, name, batch, max_tokens, runs["plain"], runs[name],
                        engines[name], plan, reused)
            for name in names[1:]]
    for row, name in zip(rows, names[1:]):
        row["setup_s"] = {"plain": setup["plain"], "spec": setup[name]}
        after = _compilations(engines[name])
        row["recompiles"] = None if after is None else after - compiled[name]
    engines.clear()
    gc.collect()
    return rows


def variant_row(cfg, workload: str, name: str, batch: int, max_tokens: int, plain: list[dict],
                spec: list[dict], engine, plan: list[list[Prompt]], reused: bool) -> dict:
    """Speedups, tok/s, greedy equality, acceptance and step cost of one variant's pairs."""
    speedups = [s["tok_s"] / b["tok_s"] for b, s in zip(plain, spec)]
    same = [a == b for bp, sp in zip(plain, spec)
            for a, b in zip(bp["token_ids"], sp["token_ids"])]
    ties = [near_tie_divergences(b, s, cfg.near_tie) for b, s in zip(plain, spec)]
    ratios, verify_fracs = [], []
    for b, s in zip(plain, spec):
        t_decode = _median(dt for dt, _ in b["steps"])
        t_verify = _median(dt for dt, verified in s["steps"] if verified)
        ratios.append(t_verify / t_decode if t_verify and t_decode else None)
        verify_fracs.append(sum(v for _, v in s["steps"]) / max(len(s["steps"]), 1))
    metrics = engine.spec_metrics()
    method, mode = name.split(" ")[:2]
    r = engine.spec.num_speculative_tokens
    return {
        "workload": workload, "method": method, "adaptive": mode.endswith("on"),
        "batch": batch, "R": r, "pairs": len(spec),
        "max_tokens": max_tokens, "prompt_group_reused": reused,
        "prompts": sorted({p.source for g in plan for p in g}),
        "held_out_prompts": sum(p.held_out for p in plan[0]),
        "speedup": common.spread(speedups), "speedups": speedups,
        "plain_tok_s": common.spread([b["tok_s"] for b in plain]),
        "spec_tok_s": common.spread([s["tok_s"] for s in spec]),
        "identical": all(same), "greedy_equal": {"requests": len(same), "identical": sum(same)},
        # Divergences where plain decoding's top-2 logprob gap was >= near_tie: real ones.
        "identical_up_to_near_ties": not any(h for h, _ in ties),
        "divergence_top2_gaps": [g for _, gs in ties for g in gs],
        "acceptance_rate": metrics.get("acceptance_rate"),
        "mean_accepted_length": metrics.get("mean_accepted_length"),
        "acceptance_per_position": metrics.get("acceptance_per_position"),
        "decode_step_ms": _median(1e3 * _median(dt for dt, _ in b["steps"]) for b in plain),
        "verify_step_ms": _median(1e3 * t for t in (
            _median(dt for dt, v in s["steps"] if v) for s in spec) if t),
        "verify_decode_cost": _median(ratios), "verify_decode_cost_per_pair": ratios,
        "verify_step_fraction": _median(verify_fracs),
        "replay_lookup": (replay_lookup(cfg, plan, plain, 1.0, _median(ratios), r)
                           if method.startswith("ngram") and batch == 1 and _median(ratios)
                           else None),
        "spec_metrics": metrics}


def replay_lookup(cfg, plan: list[list[Prompt]], plain: list[dict], t_decode: float,
                   t_verify: float, r: int) -> dict:
    """What the n-gram lookup allows at batch 1, from the plain runs' greedy outputs: each
    output is replayed through ``NgramProposer`` (R = ``r``), verifying
    whenever it finds drafts ("informed", as the host lookup does) or at every step ("blind",
    as the device lookup does), each verify costing ``t_verify`` and each plain step
    ``t_decode``. Returns both speedups at the measured costs and the verify / decode cost
    at which the informed replay reaches 2x (None: not even at a verify as cheap as a
    decode)."""
    from llmserve.speculative.ngram import NgramProposer

    prop = NgramProposer(cfg.ngram_max, cfg.ngram_min, r)
    runs = [(list(group[0].ids), list(out["token_ids"][0])) for group, out in zip(plan, plain)]

    def replay(cost: float, blind: bool) -> float:
        total = spent = 0.0
        for prompt, out in runs:
            t = 0
            while t < len(out):
                drafts, n = prop.lookup(prompt + out[:t])
                if n or blind:
                    kept = 0
                    while kept < n and t + kept < len(out) - 1 and drafts[kept] == out[t + kept]:
                        kept += 1
                    spent, t = spent + cost, t + kept + 1
                else:
                    spent, t = spent + 1.0, t + 1
            total += len(out)
        return total / spent  # tokens per decode-step time, over plain's 1

    ratio = t_verify / t_decode
    lo, hi = 1.0, 4.0
    if replay(lo, False) < 2.0:
        need = None
    else:
        for _ in range(30):  # bisection: the speedup falls as a verify costs more
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if replay(mid, False) >= 2.0 else (lo, mid)
        need = lo
    return {"informed_speedup": replay(ratio, False), "blind_speedup": replay(ratio, True),
            "verify_decode_cost": ratio, "verify_cost_for_2x": need,
            "outputs": len(runs)}


def main(argv) -> None:
    del argv
    cfg = _CONFIG.value
    check_config(cfg)
    t_all = time.perf_counter()
    models = load_models(cfg)
    batches = [int(b) for b in _list(cfg.batches)]
    tok = models["tokenizer"]
    work = {GROUNDED: _list(cfg.grounded_methods), CHAT: _list(cfg.chat_methods)}
    prompts = {GROUNDED: grounded_prompts(cfg, tok) if work[GROUNDED] else [],
               CHAT: chat_prompts(cfg, tok, max(batches)) if work[CHAT] else []}
    for p in prompts[GROUNDED]:
        need = len(p.ids) + per_batch(cfg.max_tokens, max(batches)) + max(draft_lengths(cfg))
        if need > cfg.grounded_max_model_len:
            raise ValueError(f"grounded_max_model_len={cfg.grounded_max_model_len} < {need} "
                             f"({p.source})")
    if cfg.target_model:  # SmolLM2 token ids folded into the preset's vocabulary
        vocab = models["target"][0].vocab_size
        prompts = {w: [dataclasses.replace(p, ids=tuple(t % vocab for t in p.ids)) for p in ps]
                   for w, ps in prompts.items()}
    logging.info("draft: %s", models["draft_desc"])
    rows, skipped, loads = [], {}, []
    for workload, methods in work.items():
        for batch in batches:
            if not methods:
                continue
            loads.append(os.getloadavg()[0])
            t0 = time.perf_counter()
            new = measure(cfg, models, workload, methods, batch, prompts[workload], skipped)
            rows += new
            for r in new:
                mode = "on " if r["adaptive"] else "off"
                print(f"{workload:14s} {r['method']:6s} adaptive={mode} batch {batch:3d}: "
                      f"{common.fmt_spread(r['speedup'], '.2f')}x "
                      f"(plain {r['plain_tok_s']['median']:.1f}, spec "
                      f"{r['spec_tok_s']['median']:.1f} tok/s)", flush=True)
            print(f"  {workload} batch {batch}: {time.perf_counter() - t0:.0f} s (elapsed "
                  f"{time.perf_counter() - t_all:.0f} s)", flush=True)
    if not rows:
        raise SystemExit("no speculative variant ran (every method skipped)")
    table = report(rows)
    caveats = notes(cfg, models, rows, prompts, skipped, loads)
    print(f"\n{table}\n\n" + "\n".join(f"- {c}" for c in caveats))
    out = common.run_dir("speculative", cfg.out_root or None)
    model = cfg.target_model or "SmolLM2-135M"
    png = plot(os.path.join(out, "speculative.png"), rows,
               f"Speculative decoding, {model} {cfg.dtype}, "
               f"R={','.join(map(str, draft_lengths(cfg)))}, "
               f"{os.cpu_count()} CPU cores")
    path = common.write_results(
        out, "speculative", cfg, sorted(rows, key=row_order), summarize(rows), caveats, [png],
        prompts={w: [{"source": p.source, "tokens": len(p.ids), "held_out": p.held_out,
                      "function_tokens": p.function_tokens} for p in ps]
                 for w, ps in prompts.items()},
        grounded_requests={v: rewrite_request("<module>", "<function>", v)
                           for v in ("type hints", "docstring")}, table=table,
        skipped=skipped, total_s=time.perf_counter() - t_all)
    print(f"\nwrote {path} and {png} ({time.perf_counter() - t_all:.0f} s in all)")
    if cfg.fail_on_mismatch and not all(r["identical_up_to_near_ties"] for r in rows):
        raise SystemExit("greedy output differs from plain decoding (see the notes)")


if __name__ == "__main__":
    from llmserve.host_memory import reexec_with_hugepages

    reexec_with_hugepages()  # first: glibc reads its huge-page tunable only at process start
    app.run(main)
