"""The speculative benchmark's reporting: the markdown table, the caveats under it, the plot and
the headline numbers ``experiments/report.py`` collects. ``experiments/speculative.py`` measures;
this module only formats its rows (one dict per workload, method, adaptive, R and batch).
"""

from __future__ import annotations

import os
from typing import Optional

try:
    from experiments import common
    from experiments.spec_workloads import CHAT, GROUNDED
except ImportError:  # run as a script: python experiments/speculative.py
    import common
    from spec_workloads import CHAT, GROUNDED


def _f(v, spec: str) -> Optional[str]:
    return None if v is None else format(v, spec)


def _positions(values) -> Optional[str]:
    if not values:
        return None
    return "/".join("-" if v is None else f"{v:.2f}" for v in values)


def row_order(r: dict) -> tuple:
    return (r["workload"] != GROUNDED, r["method"], r["adaptive"], r["R"], r["batch"])


def report(rows: list[dict]) -> str:
    """The markdown table printed at the end of a run."""
    cells = []
    for r in sorted(rows, key=row_order):
        s = r["speedup"]
        cells.append([
            r["workload"], r["method"], "on" if r["adaptive"] else "off", r["R"], r["batch"],
            r["pairs"],
            f"{s['median']:.2f}x [{s['min']:.2f}-{s['max']:.2f}]",
            f"{r['plain_tok_s']['median']:.1f}", f"{r['spec_tok_s']['median']:.1f}",
            "yes" if r["identical"] else
            f"{r['greedy_equal']['identical']}/{r['greedy_equal']['requests']}"
            + (" (rest: near-ties)" if r["identical_up_to_near_ties"] else " NO"),
            _f(r["mean_accepted_length"], ".2f"),
            _f(r["spec_metrics"].get("predicted_tokens_per_row"), ".2f"),
            _positions(r["acceptance_per_position"]),
            _f(r["verify_decode_cost"], ".2f"), _f(r["verify_step_fraction"], ".0%")])
    headers = ["workload", "method", "adaptive", "R", "batch", "pairs",
               "speedup, median [min-max]", "plain tok/s", "spec tok/s", "greedy identical",
               "mean accepted length", "policy's expected tokens / verify row",
               "accept @ pos 1..R", "verify / decode step",
               "verify steps"]
    return common.markdown_table(headers, cells)


def notes(cfg, models: dict, rows: list[dict], prompts: dict, skipped: dict,
          loads: list[float]) -> list[str]:
    """Caveats printed under the table and stored in the JSON."""
    target = (f"{cfg.target_model} (random weights: pipeline check only)" if cfg.target_model
              else "SmolLM2-135M-Instruct")
    lens = {w: [len(p.ids) for p in ps] for w, ps in prompts.items() if ps}
    r_by_method: dict = {}  # the draft lengths each method ran with
    for r in rows:
        r_by_method.setdefault(r["method"], set()).add(r["R"])
    r_values = "; ".join(f"{m} {','.join(map(str, sorted(v)))}" for m, v in r_by_method.items())
    out = [f"{target} {cfg.dtype}, {os.cpu_count()} shared CPU cores (1-min load "
           f"{min(loads):.1f}-{max(loads):.1f}); greedy, EOS ignored; R (drafts per row) = "
           f"{r_values}; batch = concurrent requests "
           "(max_num_seqs = decode bucket = batch)",
           "prompt tokens (chat template included): " + ", ".join(
               f"{w} {min(v)}-{max(v)}" for w, v in lens.items()),
           "speedup: per pair (plain and every speculative variant on the same prompts, in "
           f"lockstep: turns of {cfg.steps_per_turn if cfg.async_scheduling else 1} "
           f"engine.step() of each, async_scheduling={bool(cfg.async_scheduling)}, each turn "
           "ending with its device work, order rotated each pair), speculative "
           "/ plain decode tok/s; median [min-max] over the pairs. Decode tok/s = tokens an "
           "engine produced after every request of the round had its first token / the summed "
           "wall time of its own steps since then",
           "mean accepted length = accepted drafts per verify row; accept @ pos j = fraction of "
           "verify rows carrying draft j that accepted it (engine.spec_metrics())",
           "policy's expected tokens / verify row = what the never-slower policy expected the "
           "rows it verified to emit (1 + p_0 + p_0 p_1 + ... per row); they emitted 1 + the "
           "mean accepted length: the gap is the policy's optimism",
           "verify / decode step = median wall time of an engine.step() that verified drafts "
           "(engine.stats['spec_verify_time_s'] grew) over the median plain decode step of the "
           "same pair and batch, host work included (for draft/EAGLE: the draft's own steps); "
           "verify steps = share of the speculative run's timed steps that verified (the "
           "adaptive policy may decode plainly)",
           f"draft model: {models['draft_desc']}; chat rows at batch > "
           f"{sum(p.held_out for p in prompts.get(CHAT, []))} include questions the draft "
           "trained on (held_out_prompts in the JSON)"]
    out += list(skipped.values())
    for r in rows:
        c = r.get("replay_lookup")
        if c:
            need = c["verify_cost_for_2x"]
            out.append(
                f"{r['method']} R={r['R']} batch 1 replay (replay_lookup): the plain runs' "
                f"{c['outputs']} greedy outputs replayed through the n-gram lookup at the "
                f"measured verify / decode cost {c['verify_decode_cost']:.2f}: "
                f"{c['informed_speedup']:.2f}x "
                f"verifying whenever drafts are found, {c['blind_speedup']:.2f}x at every "
                "step; 2x needs a verify step of "
                + (f"at most {need:.2f} decode steps" if need else "less than a decode step"))
    ties = [r for r in rows if not r["identical"] and r["identical_up_to_near_ties"]]
    if ties:
        out.append(f"greedy output split at bf16 near-ties (plain top-2 logprob gap < "
                   f"{cfg.near_tie}) in: " + ", ".join(
                       f"{r['method']} batch {r['batch']} (gaps "
                       + ", ".join(f"{g:.3f}" for g in r["divergence_top2_gaps"]) + ")"
                       for r in ties))
    bad = [r for r in rows if not r["identical_up_to_near_ties"]]
    if bad:
        out.append("GREEDY OUTPUT DIFFERS from plain decoding in: " + ", ".join(
            f"{r['method']} adaptive={'on' if r['adaptive'] else 'off'} batch {r['batch']}"
            for r in bad))
    if any(r.get("recompiles") for r in rows):
        out.append("some engines compiled during serving (recompiles in the JSON)")
    return out


def plot(path: str, rows: list[dict], title: str) -> str:
    """Speedup vs batch per (method, adaptive), with [min-max]; acceptance per draft position."""
    plt = common.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5.5))
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    methods = sorted({r["method"] for r in rows})
    color = {m: cycle[i % len(cycle)] for i, m in enumerate(methods)}
    many_r = len({r["R"] for r in rows}) > 1
    for (method, adaptive, r_) in sorted({(r["method"], r["adaptive"], r["R"]) for r in rows}):
        rs = sorted((r for r in rows if (r["method"], r["adaptive"], r["R"])
                     == (method, adaptive, r_)), key=lambda r: r["batch"])
        med = [r["speedup"]["median"] for r in rs]
        err = [[m - r["speedup"]["min"] for m, r in zip(med, rs)],
               [r["speedup"]["max"] - m for m, r in zip(med, rs)]]
        ax1.errorbar([r["batch"] for r in rs], med, yerr=err, color=color[method], capsize=3,
                     marker="o", linestyle="-" if adaptive else "--",
                     markerfacecolor=None if adaptive else "none",
                     label=f"{method} ({rs[0]['workload']}) adaptive {'on' if adaptive else 'off'}"
                     + (f" R={r_}" if many_r else ""))
    ax1.axhline(1.0, color="gray", linewidth=0.8)
    ax1.set_xscale("log", base=2)
    batches = sorted({r["batch"] for r in rows})
    ax1.set_xticks(batches, [str(b) for b in batches])
    ax1.set_xlabel("batch (concurrent requests)")
    ax1.set_ylabel("speedup over plain decoding (median of pairs, [min-max])")
    ax1.legend(fontsize=7)
    for r in sorted((r for r in rows if not r["adaptive"] and r["acceptance_per_position"]),
                    key=lambda r: (r["method"], r["batch"])):
        acc = [float("nan") if v is None else v for v in r["acceptance_per_position"]]
        shade = 0.35 + 0.65 * (batches.index(r["batch"]) + 1) / len(batches)
        ax2.plot(range(1, len(acc) + 1), acc, marker="o", color=color[r["method"]], alpha=shade,
                 label=f"{r['method']} batch {r['batch']}" + (f" R={r['R']}" if many_r else ""))
    ax2.set_xticks(range(1, max(r["R"] for r in rows) + 1))
    ax2.set_xlabel("draft position j")
    ax2.set_ylabel("P(draft j accepted | carried)")
    ax2.set_ylim(0, 1)
    if ax2.get_legend_handles_labels()[0]:  # (no rows without the policy: no legend)
        ax2.legend(fontsize=7, ncol=2, title="adaptive off", title_fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return common.save_figure(fig, path)


def summarize(rows: list[dict]) -> dict:
    """Headline numbers for experiments/report.py: batch-1 speedups, the worst adaptive row,
    the batch-1 verify cost and whether every greedy output matched. With several R values
    (``draft_lengths``) each method's smallest R gives its plain keys, its other rows' keys
    end in ``_R<r>``."""
    out: dict = {"all_identical": all(r["identical"] for r in rows),
                 "all_identical_up_to_near_ties": all(r.get("identical_up_to_near_ties",
                                                            r["identical"]) for r in rows)}
    first_r: dict = {}  # per method: the R of its headline keys (others end in _R<r>)
    for r in rows:
        first_r[r["method"]] = min(first_r.get(r["method"], r.get("R", 0)), r.get("R", 0))
    for r in rows:
        suffix = "" if r.get("R", 0) == first_r[r["method"]] else f"_R{r['R']}"
        tag = ("adaptive" if r["adaptive"] else "always") + suffix
        if r["batch"] == min(x["batch"] for x in rows):
            out[f"{r['method']}_b{r['batch']}_speedup_{tag}"] = r["speedup"]["median"]
            out[f"{r['method']}_b{r['batch']}_mean_accepted_{tag}"] = r["mean_accepted_length"]
            cost = f"{r['method']}_b{r['batch']}_verify_decode_cost" + suffix
            if not r["adaptive"] or cost not in out:  # always verifying's, else the adaptive's
                out[cost] = r["verify_decode_cost"]
    adaptive = [r for r in rows if r["adaptive"]]
    if adaptive:
        worst = min(adaptive, key=lambda r: r["speedup"]["median"])
        out["min_speedup_adaptive"] = worst["speedup"]["median"]
        out["min_speedup_adaptive_row"] = f"{worst['method']} batch {worst['batch']}"
    out["first_batch"] = min((r["batch"] for r in rows), default=None)
    out["batches"] = sorted({r["batch"] for r in rows})
    return out
