r"""Speculative decoding: decode tokens/s with and without speculation (issue 5).

  python -m experiments.speculative --config=configs/speculative.py:smoke
  python -m experiments.speculative --config=configs/speculative.py

See configs/speculative.py for the workload, the sweep and the overrides. The target
(SmolLM2-135M-Instruct fp32) and the draft are loaded once and handed to every ``LLM``; the
jitted steps are module-level, so each shape compiles once per process however many engines run.

Per row (batch, method, K, adaptive) it reports decode tokens/s (steps after the last prefill of
a round only), the speedup over the no-speculation row of the same batch, the acceptance rate
(accepted / proposed drafts, from ``engine.stats`` and per request from ``RequestMetrics``),
acceptance per draft position j (the fraction of verify rows carrying draft j in which draft j
was accepted; greedy acceptance is a prefix, so draft j is accepted iff num_accepted > j, read
from each verify result), and whether the greedy tokens equal the baseline's.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from typing import Optional

from absl import app, logging
from ml_collections import config_flags

try:
    from experiments import common
except ImportError:  # run as a script: python experiments/speculative.py
    import common

common.quiet_startup()

_CONFIG = config_flags.DEFINE_config_file("config", "configs/speculative.py",
                                          "benchmark config", lock_config=True)

KINDS = ("chat", "code")
HELD_OUT = 0.15  # configs/distill_draft.py eval_fraction: prompts the draft never trained on


# ---------------------------------------------------------------------------------- workload
@dataclasses.dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: its kind ("chat" | "code"), token ids and where it came from."""

    kind: str
    ids: tuple[int, ...]
    source: str


def _ordered(items: list, key) -> list:
    """Held-out items first (the distilled draft never saw them), then the rest."""
    from llmserve.training import prompts as prompt_lib

    return sorted(items, key=lambda x: not prompt_lib.is_held_out(key(x), HELD_OUT))


def build_prompts(cfg, tokenizer, count: int) -> dict[str, list[Prompt]]:
    """``count`` chat and ``count`` code-completion prompts of <= max_prompt_tokens tokens."""
    from llmserve.training import prompts as prompt_lib

    out: dict[str, list[Prompt]] = {k: [] for k in KINDS}
    for q in _ordered(list(prompt_lib.CHAT_QUESTIONS), lambda q: q):
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True)
        ids = tokenizer.encode(text)
        if len(ids) <= cfg.max_prompt_tokens and len(out["chat"]) < count:
            out["chat"].append(Prompt("chat", tuple(ids), q))
    held, rest = [], []
    for fn in prompt_lib.stdlib_functions():
        ids = tokenizer.encode(prompt_lib.code_prompts(fn)[0]["text"])
        if not 16 <= len(ids) <= cfg.max_prompt_tokens:
            continue
        p = Prompt("code", tuple(ids), f"{fn['module']}.{fn['name']}")
        (held if prompt_lib.is_held_out(fn["module"], HELD_OUT) else rest).append(p)
        if len(held) >= count:
            break
    out["code"] = (held + rest)[:count]
    for kind, ps in out.items():
        if len(ps) < count:
            raise ValueError(f"only {len(ps)} {kind} prompts of <= {cfg.max_prompt_tokens} "
                             f"tokens; need {count}")
    return out


def round_prompts(prompts: dict[str, list[Prompt]], batch: int, index: int) -> list[Prompt]:
    """The ``index``-th group of ``batch`` prompts, alternating chat and code."""
    start = index * batch
    return [prompts[KINDS[i % 2]][i // 2] for i in range(start, start + batch)]


def rounds_for(cfg, batch: int) -> int:
    return -(-cfg.min_requests // batch)


# ---------------------------------------------------------------------------------- models
def load_models(cfg) -> dict:
    """Target (config, params, tokenizer) and the draft (config, params, description)."""
    from llmserve.checkpoint import load_checkpoint
    from llmserve.checkpoint.gguf import default_model_path
    from llmserve.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_model_path())
    if cfg.target_model:  # a random-weight preset: the smoke variant (speed path only)
        from llmserve.config import preset
        from llmserve.model import init_params

        tcfg = preset(cfg.target_model)
        tparams = init_params(tcfg, 0)
    else:
        tcfg, tparams = load_checkpoint(None, dtype="float32")
    models = {"target": (tcfg, tparams), "tokenizer": tok}
    if os.path.isdir(cfg.draft_model) and not cfg.target_model:
        dcfg, dparams = load_checkpoint(cfg.draft_model, dtype="float32")
        models["draft"] = (dcfg, dparams)
        models["draft_desc"] = f"distilled {dcfg.n_layers}-layer draft ({cfg.draft_model})"
    else:
        from llmserve.model import init_params

        dcfg = tcfg.replace(n_layers=cfg.untrained_draft_layers, tie_embeddings=True)
        dparams = dict(init_params(dcfg))
        dparams["embed"] = tparams["embed"]  # the LM head is final norm + tied embedding
        models["draft"] = (dcfg, dparams)
        models["draft_desc"] = (f"UNTRAINED {dcfg.n_layers}-layer draft sharing the target's "
                                f"embedding ({cfg.draft_model} not found)")
    return models


# ---------------------------------------------------------------------------------- probing
class VerifyProbe:
    """Counts decode / verify steps and per-position acceptance by wrapping engine methods.

    ``_accept_verified(seq, res, i)`` sees every verify row: ``engine._num_draft[i]`` drafts were
    carried and ``res.num_accepted[i]`` accepted, so (greedy) draft j was accepted iff
    num_accepted > j. Instance attributes shadow the methods; the engine is discarded after.
    """

    def __init__(self, engine, k: int, kind_of: dict):
        self.k = k
        self.kind_of = kind_of  # request_id -> prompt kind
        self.calls = {"decode": 0, "verify": 0}
        self.carried = {kind: [0] * k for kind in KINDS}  # rows carrying draft j
        self.accepted = {kind: [0] * k for kind in KINDS}  # rows accepting draft j
        self.rows = {kind: 0 for kind in KINDS}  # verify rows (any number of drafts)
        accept, execute = engine._accept_verified, engine._execute

        def probed_accept(seq, res, i):
            kind = self.kind_of.get(seq.request_id, "chat")
            num, acc = int(engine._num_draft[i]), int(res.num_accepted[i])
            self.rows[kind] += 1
            for j in range(min(num, self.k)):
                self.carried[kind][j] += 1
                self.accepted[kind][j] += int(acc > j)
            return accept(seq, res, i)

        def counted(plan):
            if plan.decode:
                self.calls["verify" if plan.lookahead else "decode"] += 1
            return execute(plan)

        engine._accept_verified = probed_accept
        engine._execute = counted

    def per_position(self, kinds=KINDS) -> list[Optional[float]]:
        """Acceptance of draft j (j = 0..K-1) over the verify rows that carried it."""
        out = []
        for j in range(self.k):
            carried = sum(self.carried[kd][j] for kd in kinds)
            accepted = sum(self.accepted[kd][j] for kd in kinds)
            out.append(accepted / carried if carried else None)
        return out


# ---------------------------------------------------------------------------------- running
def _prefilling(engine) -> bool:
    sched = engine.scheduler
    return bool(sched.waiting) or any(s.in_prefill for s in sched.running)


def serve_round(engine, prompts: list[Prompt], params, prefix: str, probe) -> dict:
    """Serves one batch of concurrent requests; times the steps after the last prefill."""
    kind_of = probe.kind_of if probe is not None else {}
    ids = []
    for i, p in enumerate(prompts):
        rid = engine.add_request(f"{prefix}-{i}", list(p.ids), params)
        kind_of[rid] = p.kind
        ids.append(rid)
    done, t_start, tok_start, calls_start = {}, None, 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if t_start is None and not _prefilling(engine):
            t_start = time.perf_counter()
            tok_start = engine.stats["generated_tokens"]
            calls_start = dict(probe.calls) if probe is not None else {}
    wall = time.perf_counter() - t_start
    calls = {k: v - calls_start[k] for k, v in probe.calls.items()} if probe else {}
    return {"outputs": [done[r] for r in ids], "decode_s": wall,
            "decode_tokens": engine.stats["generated_tokens"] - tok_start, "calls": calls}


def run_row(cfg, models: dict, prompts: dict, batch: int, spec: Optional[dict]) -> dict:
    """One configuration: builds the engine (compiles once per shape), serves its rounds."""
    from llmserve.llm import LLM
    from llmserve.sampling_params import SamplingParams

    tcfg, tparams = models["target"]
    t0 = time.perf_counter()
    llm = LLM(None, params=tparams, model_config=tcfg, tokenizer=models["tokenizer"],
              max_num_seqs=batch, max_model_len=cfg.max_model_len, page_size=cfg.page_size,
              max_num_batched_tokens=cfg.max_num_batched_tokens,
              backend=cfg.backend or None, decode_buckets=(batch,),
              prefill_buckets=tuple(tuple(b) for b in cfg.prefill_buckets),
              speculative_config=spec, warmup=True)
    engine = llm.engine
    as_built = _policy_times(engine, batch)
    if spec is not None and spec["adaptive"]:
        reseed_policy(engine)
    setup_s = time.perf_counter() - t0
    seeded = _policy_times(engine, batch)
    k = spec["num_speculative_tokens"] if spec else 0
    probe = VerifyProbe(engine, k, {}) if spec else None
    params = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens, ignore_eos=True)
    compiled = engine.runner.num_compilations()
    # The same rounds ``repeats`` times on this engine: decode tok/s is their median.
    reps = [[serve_round(engine, round_prompts(prompts, batch, r), params, f"x{x}r{r}", probe)
             for r in range(rounds_for(cfg, batch))] for x in range(cfg.repeats)]
    rounds = [r for rep in reps for r in rep]
    outs = [o for r in rounds for o in r["outputs"]]
    kinds = [p.kind for _ in reps for r in range(len(reps[0]))
             for p in round_prompts(prompts, batch, r)]
    decode_s = sum(r["decode_s"] for r in rounds)
    decode_tokens = sum(r["decode_tokens"] for r in rounds)
    per_rep = [sum(r["decode_tokens"] for r in rep) / max(sum(r["decode_s"] for r in rep), 1e-9)
               for rep in reps]
    spread = common.spread(per_rep)
    result = {"batch": batch, "method": spec["method"] if spec else "none", "k": k,
              "adaptive": spec["adaptive"] if spec else None, "setup_s": setup_s,
              "decode_s": decode_s, "decode_tokens": decode_tokens,
              "decode_tok_s": spread["median"], "decode_tok_s_spread": spread,
              "recompiles": engine.runner.num_compilations() - compiled,
              "_tokens": [list(o.outputs[0].token_ids) for r in reps[0] for o in r["outputs"]]}
    if spec:
        calls = {c: sum(r["calls"][c] for r in rounds) for c in probe.calls}
        result.update(spec_stats(engine, probe, outs, kinds, calls))
        result["policy_times"] = {"as_built": as_built, "warmup": seeded,
                                  "end": _policy_times(engine, batch)}
    del llm, engine
    gc.collect()
    return result


def reseed_policy(engine) -> None:
    """Re-measures the never-slower policy's step times with every shape already compiled.

    ``Engine.warmup`` times each step twice and feeds both into the policy's EMA, the first
    including compilation (seconds, vs ~0.1 s per step), so the engine that first compiles a
    verify shape starts with t_verify inflated ~100x and never speculates. A second warm-up
    (all shapes cached now) over cleared tables gives the steady-state seed.
    """
    engine.policy.t_decode.clear()
    engine.policy.t_verify.clear()
    engine.warmup()


def _policy_times(engine, batch: int) -> Optional[dict]:
    """The never-slower policy's step-time estimates (s) for this batch's bucket."""
    policy = getattr(engine, "policy", None)
    if engine.spec is None or policy is None:
        return None
    td, tv = policy.t_decode.get(batch), policy.t_verify.get(batch)
    return {"t_decode": td, "t_verify": tv, "ratio": tv / td if td and tv else None}


def spec_stats(engine, probe: VerifyProbe, outs, kinds: list[str], calls: dict) -> dict:
    """Acceptance overall, per prompt kind (per-request metrics) and per draft position."""
    proposed, accepted = engine.stats.get("spec_proposed", 0), engine.stats.get("spec_accepted", 0)
    per_kind = {}
    for kind in KINDS:
        ms = [o.metrics for o, kd in zip(outs, kinds) if kd == kind]
        prop, acc = sum(m.spec_proposed for m in ms), sum(m.spec_accepted for m in ms)
        per_kind[kind] = {"proposed": prop, "accepted": acc,
                          "rate": acc / prop if prop else None,
                          "per_position": probe.per_position((kind,)),
                          "carried_at": list(probe.carried[kind]),
                          "accepted_at": list(probe.accepted[kind])}
    rows = sum(probe.rows.values())
    return {"spec_proposed": proposed, "spec_accepted": accepted,
            "acceptance_rate": accepted / proposed if proposed else None,
            "tokens_per_verify_row": 1 + accepted / rows if rows else None,
            "verify_rows": rows, "window_steps": calls,
            "verify_step_fraction": calls["verify"] / max(calls["verify"] + calls["decode"], 1),
            "per_position": probe.per_position(), "per_kind": per_kind}


def sweep(cfg) -> list[tuple[int, Optional[dict]]]:
    """(batch, speculative_config or None) in run order: each batch's baseline first."""
    batches = [int(b) for b in str(cfg.batches).split(",")]
    ks = [int(k) for k in str(cfg.ks).split(",")]
    all_k = {int(b) for b in str(cfg.all_k_batches).split(",") if b}
    methods = [m.strip() for m in cfg.methods.split(",") if m.strip()]
    adaptive = [a.strip().lower() == "true" for a in cfg.adaptive.split(",")]
    out = []
    for b in batches:
        out.append((b, None))
        first = len(out)
        for method in methods:
            for k in (ks if b in all_k else [cfg.main_k]):
                for a in adaptive:
                    spec = {"method": method, "num_speculative_tokens": k, "adaptive": a}
                    if method == "ngram":
                        spec.update(prompt_lookup_max=cfg.ngram_max,
                                    prompt_lookup_min=cfg.ngram_min)
                    out.append((b, spec))
        if cfg.repeat_baseline and len(out) > first:
            out.append((b, None))  # again after the speculative rows: a drift / noise check
    return out


def compare(results: list[dict]) -> None:
    """Adds speedup (vs the mean of the batch's no-speculation rows) and greedy equality (vs
    the first of them)."""
    base: dict[int, list[dict]] = {}
    for r in results:
        if r["method"] == "none":
            base.setdefault(r["batch"], []).append(r)
    for r in results:
        refs = base.get(r["batch"])
        if not refs:
            continue
        ref = refs[0]
        r["baseline_tok_s"] = sum(b["decode_tok_s"] for b in refs) / len(refs)
        r["speedup"] = r["decode_tok_s"] / r["baseline_tok_s"]
        same = [a == b for a, b in zip(r["_tokens"], ref["_tokens"])]
        r["greedy_equal"] = {"requests": len(same), "identical": sum(same)}
        r["identical"] = all(same)


# ---------------------------------------------------------------------------------- reporting
def _f(v, spec: str) -> Optional[str]:
    return None if v is None else format(v, spec)


def _positions(values) -> str:
    return "/".join("-" if v is None else f"{v:.2f}" for v in values)


def report(results: list[dict]) -> str:
    """The markdown table printed at the end of a run."""
    rows = []
    for r in results:
        spec = r["method"] != "none"
        kinds = r.get("per_kind", {})
        rows.append([
            r["batch"], r["method"], r["k"] or None,
            None if r["adaptive"] is None else ("on" if r["adaptive"] else "off"),
            common.fmt_spread(r["decode_tok_s_spread"]), _f(r.get("speedup"), ".2f"),
            _f(r.get("acceptance_rate"), ".2f") if spec else None,
            _f(kinds.get("chat", {}).get("rate"), ".2f"),
            _f(kinds.get("code", {}).get("rate"), ".2f"),
            _positions(r["per_position"]) if spec else None,
            _f(r.get("tokens_per_verify_row"), ".2f"),
            _f(r.get("verify_step_fraction"), ".0%"),
            _f((r.get("policy_times") or {}).get("warmup", {}).get("ratio"), ".2f")
            if r["adaptive"] else None,
            str(r.get("identical", "-"))])
    headers = ["batch", "method", "K", "adaptive", "decode tok/s, median [min-max]", "speedup",
               "accept",
               "accept chat", "accept code", "accept @ pos 1..K", "tok / verify row",
               "verify steps", "t_verify / t_decode", "greedy == base"]
    return common.markdown_table(headers, rows)


def notes(cfg, models: dict, results: list[dict], prompts: dict) -> list[str]:
    """Caveats printed under the table and stored in the JSON."""
    lens = {k: [len(p.ids) for p in v] for k, v in prompts.items()}
    target = (f"{cfg.target_model} (random weights: pipeline check only)" if cfg.target_model
              else "SmolLM2-135M-Instruct")
    out = [f"{target} fp32, {os.cpu_count()} shared CPU cores; greedy, ignore_eos, "
           f"{cfg.max_tokens} new tokens per request; batch = concurrent requests "
           f"(max_num_seqs = decode bucket = batch); batches < {cfg.min_requests} run "
           f"{cfg.min_requests} requests one round after another",
           "prompts alternate chat (chat template) / code completion (stdlib signature + "
           "docstring); prompt tokens chat " + "-".join(map(str, _span(lens["chat"])))
           + ", code " + "-".join(map(str, _span(lens["code"]))),
           "decode tok/s: tokens generated after the last prefill step of each round / that "
           "time (prefill, compilation and warm-up excluded)",
           f"draft model: {models['draft_desc']}",
           "accept = accepted / proposed drafts; accept @ pos j = fraction of verify rows "
           "carrying draft j that accepted it; tok / verify row = 1 + accepted / verify rows; "
           "verify steps = verify / (verify + plain decode) steps in the timed window (the "
           "adaptive policy may decode plainly)",
           "speedup = decode tok/s / the mean of the batch's no-speculation rows (run before "
           "and after its speculative rows); greedy == base compares every request's tokens "
           "with the first no-speculation row's",
           "t_verify / t_decode (adaptive rows) = the policy's warm-up measurement of one "
           "verify step (with the draft's proposal) over one plain decode step at this batch; "
           "the adaptive policy "
           "speculates only while (1 + a + ... + a^K) / t_verify > 1 / t_decode (a = EMA "
           "acceptance, prior 0.6); a and t_verify learn only from verify steps, so once off it "
           "turns on again only if the measured decode step time grows. Adaptive rows re-run "
           "Engine.warmup over cleared policy tables first: the engine's own warm-up feeds the "
           "compiling run into the t_verify EMA (policy_times.as_built in the JSON)",
           f"sweep trimmed to fit ~15 min: K={cfg.ks} at batch {cfg.all_k_batches}, "
           f"K={cfg.main_k} at the other batches"]
    out.append(noise_note(results))
    if any(r.get("recompiles") for r in results):
        out.append("some rows compiled during serving (see recompiles in the JSON)")
    return out


def noise_note(results: list[dict]) -> str:
    """The load range and how far apart each batch's repeated no-speculation rows landed."""
    loads = [r["loadavg_1m"] for r in results]
    spread = {}
    for r in results:
        if r["method"] == "none":
            spread.setdefault(r["batch"], []).append(r["decode_tok_s"])
    parts = [f"batch {b}: " + "/".join(f"{v:.1f}" for v in vs)
             for b, vs in spread.items() if len(vs) > 1]
    note = (f"1-min load average during the run: {min(loads):.1f}-{max(loads):.1f}; other jobs "
            "share the cores, so tokens/s are noisy")
    if parts:
        note += ("; the no-speculation rows (before/after) gave " + ", ".join(parts)
                 + " tok/s: read speedups within that spread as 'no difference'")
    return note


def _span(values: list[int]) -> tuple[int, int]:
    return (min(values), max(values)) if values else (0, 0)


def plot(path: str, results: list[dict], title: str) -> str:
    """Speedup vs batch per (method, K, adaptive); acceptance per draft position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 6))
    groups: dict[tuple, list] = {}
    for r in results:
        if r["method"] != "none" and "speedup" in r:
            groups.setdefault((r["method"], r["k"], r["adaptive"]), []).append(r)
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    keys = sorted({(r["method"], r["k"]) for r in results if r["method"] != "none"})
    color = {key: cycle[i % len(cycle)] for i, key in enumerate(keys)}  # one per (method, K)
    for (method, k, adaptive), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["batch"])
        ax1.plot([r["batch"] for r in rs], [r["speedup"] for r in rs], color=color[method, k],
                 marker="o" if method == "ngram" else "s",
                 linestyle="-" if adaptive else "--",
                 markerfacecolor=None if adaptive else "none",  # hollow: always speculate
                 label=f"{method} K={k} adaptive={'on' if adaptive else 'off'}")
    ax1.axhline(1.0, color="gray", linewidth=0.8)
    ax1.set_xscale("log", base=2)
    batches = sorted({r["batch"] for r in results})
    ax1.set_xticks(batches, [str(b) for b in batches])
    ax1.set_xlabel("batch (concurrent requests)")
    ax1.set_ylabel("decode tokens/s vs no speculation")
    ax1.legend(fontsize=6, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    pooled: dict[tuple, list] = {}  # (method, K) over every batch, always-speculate rows
    for r in results:
        if r["method"] != "none" and r["adaptive"] is False:
            pooled.setdefault((r["method"], r["k"]), []).append(r)
    for (method, k), rs in sorted(pooled.items()):
        carried = [0] * k
        accepted = [0] * k
        for r in rs:
            for kind in KINDS:
                pk = r["per_kind"][kind]
                carried = [a + b for a, b in zip(carried, pk["carried_at"])]
                accepted = [a + b for a, b in zip(accepted, pk["accepted_at"])]
        ax2.plot(range(1, k + 1), [a / c if c else float("nan")
                                   for a, c in zip(accepted, carried)],
                 marker="o" if method == "ngram" else "s", color=color[method, k],
                 label=f"{method} K={k}")
    ax2.set_xticks(range(1, max([k for _, k in pooled] or [1]) + 1))
    ax2.set_xlabel("draft position j")
    ax2.set_ylabel("P(draft j accepted | carried)")
    ax2.set_ylim(0, 1)
    ax2.legend(fontsize=7, title="adaptive off, all batches", title_fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv) -> None:
    del argv
    cfg = _CONFIG.value
    t_all = time.perf_counter()
    models = load_models(cfg)
    plan = sweep(cfg)
    need = max(b * rounds_for(cfg, b) for b, _ in plan)
    prompts = build_prompts(cfg, models["tokenizer"], -(-need // 2))
    if cfg.target_model:  # token ids of SmolLM2's tokenizer folded into the preset's vocab
        vocab = models["target"][0].vocab_size
        prompts = {k: [dataclasses.replace(p, ids=tuple(t % vocab for t in p.ids)) for p in ps]
                   for k, ps in prompts.items()}
    logging.info("draft: %s", models["draft_desc"])
    results = []
    for batch, spec in plan:
        if spec and spec["method"] == "draft":
            spec = dict(spec, model=models["draft"])
        label = "none" if spec is None else (
            f"{spec['method']} K={spec['num_speculative_tokens']} adaptive={spec['adaptive']}")
        load = os.getloadavg()[0]
        r = run_row(cfg, models, prompts, batch, spec)
        r["loadavg_1m"] = round(load, 2)
        results.append(r)
        print(f"batch {batch:3d} {label:28s} {r['decode_tok_s']:7.1f} decode tok/s "
              f"(setup {r['setup_s']:.0f} s, decode {r['decode_s']:.1f} s, "
              f"elapsed {time.perf_counter() - t_all:.0f} s)", flush=True)
    compare(results)
    table = report(results)
    caveats = notes(cfg, models, results, prompts)
    print(f"\n{table}\n\n" + "\n".join(f"- {c}" for c in caveats))
    out = common.run_dir("speculative", cfg.out_root or None)
    model = cfg.target_model or "SmolLM2-135M"
    png = plot(os.path.join(out, "speculative.png"), results,
               f"Speculative decoding, {model} fp32, {cfg.max_tokens} greedy tokens, "
               f"{os.cpu_count()} CPU cores")
    clean = [{k: v for k, v in r.items() if not k.startswith("_")} for r in results]
    path = common.write_results(
        out, "speculative", cfg, clean, summarize(results), caveats, [png],
        prompts={k: [p.source for p in v] for k, v in prompts.items()}, table=table,
        total_s=time.perf_counter() - t_all)
    print(f"\nwrote {path} and {png} ({time.perf_counter() - t_all:.0f} s in all)")


def summarize(results: list[dict]) -> dict:
    """Headline numbers: the best speedup over no speculation (per mode) and its acceptance."""
    out = {}
    for adaptive in (False, True):
        rows = [r for r in results if r["method"] != "none" and r["adaptive"] is adaptive
                and r.get("speedup") is not None]
        if rows:
            best = max(rows, key=lambda r: r["speedup"])
            tag = "adaptive" if adaptive else "always"
            out[f"best_speedup_{tag}"] = best["speedup"]
            out[f"best_speedup_{tag}_row"] = f"{best['method']} K={best['k']} batch {best['batch']}"
            out[f"acceptance_{tag}"] = best.get("acceptance_rate")
    return out


if __name__ == "__main__":
    app.run(main)
