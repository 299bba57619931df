"""Helpers shared by the experiment entry points: result files, tables and bar charts."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import platform
import time
from typing import Any, Optional, Sequence

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
    """Versions and machine facts recorded next to every result."""
    import jax

    env = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(),
           "machine": platform.machine(), "cpu_count": os.cpu_count(),
           "jax": jax.__version__, "jax_backend": jax.default_backend()}
    for name in ("torch", "transformers"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            pass
    return env


def write_json(path: str, payload: dict) -> str:
    """Writes ``payload`` (plus ``environment()``) as indented JSON; returns the path."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        json.dump({"environment": environment(), **payload}, fh, indent=2)
    return path


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats keep what the caller formatted, None prints as '-'."""
    cells = [[("-" if v is None else str(v)) for v in row] for row in rows]
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def bar_chart(path: str, labels: Sequence[str], panels: Sequence[tuple[str, Sequence[float]]],
              title: str, notes: Optional[Sequence[str]] = None) -> str:
    """Side-by-side bar panels (one per metric) with values printed on the bars; writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (ylabel, values) in zip(axes[0], panels):
        bars = ax.bar(range(len(labels)), values, color=colors[: len(labels)])
        ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        for bar, v in zip(bars, values):
            ax.annotate(f"{v:.3g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
    fig.suptitle(title, fontsize=10)
    if notes:
        fig.text(0.01, 0.01, "\n".join(notes), fontsize=7, va="bottom")
        fig.tight_layout(rect=(0, 0.04 * len(notes), 1, 0.95))
    else:
        fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
