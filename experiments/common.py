"""Helpers shared by the experiment entry points: result folders, repeats, tables and plots.

Every experiment writes one folder per run, ``results/<experiment>/<timestamp>/``, holding
``results.json`` and at least one PNG. ``results.json`` always has the keys of ``RESULT_KEYS``:
the experiment and config names, the command that produced it, the config, the machine, library
versions, every measurement (``results``), the headline numbers ``experiments/report.py`` reads
(``summary``), caveats (``notes``) and the plot file names (``plots``).
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging as std_logging
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Any, Callable, Optional, Sequence

RESULT_KEYS = ("experiment", "name", "command", "config", "machine", "versions", "results",
               "summary", "notes", "plots")
RESULTS_ROOT = "results"


def quiet_startup() -> None:
    """Keeps harmless start-up noise out of experiment logs.

    jax probes for a TPU and logs "Unable to initialize backend 'tpu'" at INFO; under absl that
    line reaches stderr and looks like a failure. Raising that one logger to WARNING hides it
    without changing which platform jax picks (a GPU is still used when present). Hugging Face's
    GGUF conversion bars and download chatter are switched off too.
    """
    std_logging.getLogger("jax._src.xla_bridge").setLevel(std_logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    except ImportError:
        pass


def machine() -> dict[str, Any]:
    """Facts about the machine a result was measured on."""
    import jax

    info = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "platform": platform.platform(),
            "machine": platform.machine(),
            "processor": platform.processor(), "cpu_count": os.cpu_count(),
            "loadavg_1m": round(os.getloadavg()[0], 2), "jax_backend": jax.default_backend(),
            "devices": [d.device_kind for d in jax.devices()], **cpu_model()}
    return info


CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # what picks the native kernels


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> dict[str, Any]:
    """The CPU's model name and which of ``CPU_FEATURES`` it has (the machines CI and the
    sessions run on change between an AMD Zen 4 and an AMX Xeon: results name theirs)."""
    try:
        with open(cpuinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    return {"cpu_model": model, "cpu_features": [f for f in CPU_FEATURES if f in flags]}


def describe_cpu(m: dict[str, Any]) -> str:
    """" (model, AMX)"-style words for a result's machine dict; "" for older results."""
    if not m.get("cpu_model"):
        return ""
    amx = "amx_bf16" in m.get("cpu_features", [])
    return f" ({m['cpu_model']}{', AMX' if amx else ''})"


def versions() -> dict[str, str]:
    """Versions of the libraries a result depends on (those that are importable)."""
    out = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "flax", "numpy", "torch", "transformers", "llmserve"):
        try:
            out[name] = getattr(__import__(name), "__version__", "?")
        except ImportError:
            pass
    return out

# Real English text, stable for a given Python version: docstrings of these stdlib modules and
# of their public members, in sorted order.
CORPUS_MODULES = ("argparse", "collections", "functools", "itertools", "json", "pathlib",
                  "subprocess", "threading", "logging", "re", "datetime", "textwrap", "unittest",
                  "dataclasses", "heapq", "bisect", "shutil", "tempfile", "csv", "string")


def corpus_text() -> str:
    """Deduplicated docstrings of ``CORPUS_MODULES`` (module first, then public members)."""
    parts, seen = [], set()
    for name in CORPUS_MODULES:
        mod = importlib.import_module(name)
        members = [getattr(mod, m) for m in sorted(dir(mod)) if not m.startswith("_")]
        for obj in [mod] + [o for o in members if getattr(o, "__module__", None) == name]:
            doc = inspect.getdoc(obj)
            if doc and doc not in seen:
                seen.add(doc)
                parts.append(doc)
    return "\n\n".join(parts)


def environment() -> dict[str, Any]:
    """Machine facts and library versions in one dict (kept for older callers)."""
    return {**machine(), **versions()}


def command_line() -> str:
    """The command that started this process, as ``python -m experiments.x ...`` when possible."""
    argv = list(sys.argv)
    script = argv[0] if argv else ""
    rel = os.path.relpath(script) if script else ""
    if rel.startswith("experiments/") and rel.endswith(".py"):
        return "python -m " + rel[:-3].replace("/", ".") + " " + shlex.join(argv[1:])
    return "python " + shlex.join([rel] + argv[1:])


def run_dir(experiment: str, root: Optional[str] = None) -> str:
    """Creates and returns a fresh ``<root>/<experiment>/<timestamp>/`` folder.

    Runs never overwrite each other: a second run within the same second gets a ``-2`` suffix.
    """
    root = root or os.environ.get("LLMSERVE_RESULTS", RESULTS_ROOT)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = os.path.join(root, experiment, stamp)
    path, i = base, 1
    while True:
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            i += 1
            path = f"{base}-{i}"


def _jsonable(obj):
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def write_results(directory: str, experiment: str, config, results: Any, summary: dict,
                  notes: Sequence[str] = (), plots: Sequence[str] = (), **extra) -> str:
    """Writes ``directory/results.json`` with every key of ``RESULT_KEYS``; returns its path.

    ``summary`` holds the headline numbers (plain floats, named by what they measure);
    ``plots`` are file names inside ``directory``.
    """
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    payload = {"experiment": experiment, "name": cfg.get("name", ""), "command": command_line(),
               "config": cfg, "machine": machine(), "versions": versions(), "results": results,
               "summary": summary, "notes": list(notes),
               "plots": [os.path.basename(p) for p in plots], **extra}
    path = os.path.join(directory, "results.json")
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=2, default=_jsonable)
    return path


def write_json(path: str, payload: dict) -> str:
    """Writes ``payload`` (plus ``environment()``) as indented JSON; returns the path."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        json.dump({"environment": environment(), **payload}, fh, indent=2, default=_jsonable)
    return path


def latest_run(experiment: str, name: Optional[str] = None,
               root: Optional[str] = None) -> Optional[dict]:
    """The newest ``results.json`` of an experiment (and config name), with its folder, or None."""
    root = root or os.environ.get("LLMSERVE_RESULTS", RESULTS_ROOT)
    base = os.path.join(root, experiment)
    if not os.path.isdir(base):
        return None
    for stamp in sorted(os.listdir(base), reverse=True):
        path = os.path.join(base, stamp, "results.json")
        if not os.path.isfile(path):
            continue
        with open(path) as fh:
            data = json.load(fh)
        if name is None or data.get("name") == name:
            data["_dir"] = os.path.join(base, stamp)
            return data
    return None


# ---------------------------------------------------------------------------------- repeats
def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and the relative spread ((max - min) / median) of repeated measures."""
    vals = [float(v) for v in values]
    med = statistics.median(vals)
    return {"median": med, "min": min(vals), "max": max(vals), "n": len(vals),
            "rel_spread": (max(vals) - min(vals)) / med if med else 0.0}


def interleaved(fns: dict[str, Callable[[int], dict]], repeats: int,
                log: Callable[[str], None] = print) -> dict[str, list[dict]]:
    """Runs ``fns[name](repeat)`` round-robin ``repeats`` times, the order rotated each repeat
    (A B C, B C A, C A B, ...).

    Interleaving spreads slow drifts of a shared machine (other jobs, thermal state) evenly over
    every side of a comparison; rotating means no system always runs right after the same one
    (a fixed order had llmserve continuous always follow vLLM's subprocess). Returns each name's
    list of per-repeat results, in repeat order.
    """
    out: dict[str, list[dict]] = {name: [] for name in fns}
    names = list(fns)
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            t0 = time.perf_counter()
            out[name].append(fns[name](rep))
            log(f"  repeat {rep + 1}/{repeats} {name}: {time.perf_counter() - t0:.1f} s")
    return out


def fmt_spread(s: dict, spec: str = ".1f") -> str:
    """``median [min-max]`` for a table cell."""
    return f"{s['median']:{spec}} [{s['min']:{spec}}-{s['max']:{spec}}]"


# ---------------------------------------------------------------------------------- tables
def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats keep what the caller formatted, None prints as '-'."""
    cells = [[("-" if v is None else str(v)) for v in row] for row in rows]
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- plots
def pyplot():
    """matplotlib.pyplot with the file-only Agg backend (no display needed)."""
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str) -> str:
    """Saves and closes a figure; returns the path."""
    plt = pyplot()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def bar_chart(path: str, labels: Sequence[str], panels: Sequence[tuple[str, Sequence[float]]],
              title: str, notes: Optional[Sequence[str]] = None,
              errors: Optional[Sequence[Optional[Sequence[tuple[float, float]]]]] = None,
              hatched: Sequence[bool | str] = ()) -> str:
    """Side-by-side bar panels (one per metric) with values printed on the bars; writes a PNG.

    ``errors[p][i]`` is an optional (min, max) range drawn as an error bar on bar i of panel p
    (the spread of repeats). A bar with ``hatched[i]`` set is drawn hollow and hatched, with the
    word "extrapolated" (True) or ``hatched[i]`` itself (a string, e.g. "simulated") under its
    value: the value was not measured directly.
    """
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    hatched = list(hatched) + [False] * (len(labels) - len(hatched))
    for p, (ax, (ylabel, values)) in enumerate(zip(axes[0], panels)):
        for i, v in enumerate(values):
            color = colors[i % len(colors)]
            style = (dict(facecolor="none", edgecolor=color, hatch="//") if hatched[i]
                     else dict(color=color))
            bar = ax.bar(i, v, **style)[0]
            rng = errors[p][i] if errors and errors[p] else None
            if rng is not None:
                ax.errorbar(i, v, yerr=[[v - rng[0]], [rng[1] - v]], color="black", capsize=3,
                            linewidth=0.8)
            mark = "extrapolated" if hatched[i] is True else (hatched[i] or "")
            text = f"{v:.3g}" + (f"\n{mark}" if mark else "")
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
    fig.suptitle(title, fontsize=10)
    if notes:
        fig.text(0.01, 0.01, "\n".join(notes), fontsize=7, va="bottom")
        fig.tight_layout(rect=(0, 0.04 * len(notes), 1, 0.95))
    else:
        fig.tight_layout()
    return save_figure(fig, path)


def line_plot(path: str, series: dict[str, tuple[Sequence[float], Sequence[float]]],
              xlabel: str, ylabel: str, title: str, logy: bool = False) -> str:
    """One panel of lines, one per ``series`` entry (label -> (xs, ys)); writes a PNG."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), marker="o" if len(xs) < 30 else None, label=label)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if len(series) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def loss_curve(directory: str, history: Sequence[dict], title: str) -> str:
    """The training-loss curve of a ``llmserve.training.loop.train`` history, as loss.png."""
    steps = [h["step"] for h in history if "loss" in h]
    losses = [h["loss"] for h in history if "loss" in h]
    return line_plot(os.path.join(directory, "loss.png"), {"train loss": (steps, losses)},
                     "step", "loss", title)


def prefill_buckets(spec: str, key: str = "prefill_buckets") -> dict:
    """A config's bucket string as EngineConfig keywords: ``"4x8,8x8"`` -> {"prefill_buckets":
    ((4, 8), (8, 8))}; "" -> {} (the engine's default). ``key`` names the field in the error."""
    if not spec:
        return {}
    try:
        buckets = tuple(tuple(int(v) for v in b.split("x")) for b in spec.split(","))
    except ValueError:
        buckets = ()
    if not buckets or any(len(b) != 2 or min(b) < 1 for b in buckets):
        raise ValueError(f"{key}={spec!r}: use rows x tokens, e.g. 4x8,8x8")
    return {"prefill_buckets": buckets}


def load_model_or_preset(cfg):
    """(ModelConfig, params) for ``cfg.model`` / ``cfg.dtype``: SmolLM2-135M-Instruct when
    ``cfg.model`` is empty, else that random-weight preset (seed 3)."""
    from llmserve.checkpoint import load_checkpoint
    from llmserve.config import preset
    from llmserve.model import init_params

    if cfg.model:
        mcfg = preset(cfg.model).replace(dtype=cfg.dtype)
        return mcfg, init_params(mcfg, seed=3)
    return load_checkpoint(None, dtype=cfg.dtype)
