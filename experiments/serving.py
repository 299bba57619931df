r"""Online serving: latency percentiles under Poisson load, through the HTTP server (issue 12).

  python -m experiments.serving --config=configs/serving.py:smoke
  python -m experiments.serving --config=configs/serving.py

See configs/serving.py for the workload and overrides. The server (unless ``--config.url``)
runs in this process on 127.0.0.1 with a free port; the load generator is an asyncio client that
streams every request and times each server-sent event. Model loading, compilation and
``warmup_requests`` untimed requests come first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import time

import numpy as np
from absl import app, logging
from ml_collections import config_flags

try:
    from experiments import common
except ImportError:  # run as a script: python experiments/serving.py
    import common

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_CONFIG = config_flags.DEFINE_config_file("config", "configs/serving.py", "benchmark config",
                                          lock_config=True)


# ---------------------------------------------------------------------------------- workload
@dataclasses.dataclass(frozen=True)
class Request:
    """One request: a chat question or a completions prompt (token ids), and its length."""

    kind: str  # "chat" | "completion"
    prompt: object  # question text (chat) or token ids (completion)
    max_tokens: int


def build_workload(c, tokenizer) -> list[Request]:
    """``num_prompts`` requests, a ``chat_fraction`` of them chat questions (numpy seed)."""
    from llmserve.cli import DEFAULT_PROMPTS

    rng = np.random.default_rng(c.seed)
    ids = tokenizer.encode(common.corpus_text())
    lo, hi = c.prompt_len
    out = []
    for i in range(c.num_prompts):
        new = int(rng.integers(c.new_tokens[0], c.new_tokens[1], endpoint=True))
        if rng.random() < c.chat_fraction:
            out.append(Request("chat", DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)], new))
        else:
            n = int(rng.integers(lo, hi, endpoint=True))
            start = int(rng.integers(0, len(ids) - n))
            out.append(Request("completion", [int(t) for t in ids[start: start + n]], new))
    return out


# ---------------------------------------------------------------------------------- client
@dataclasses.dataclass
class Result:
    """Client-side timing of one streamed request (seconds)."""

    ok: bool
    ttft: float = math.nan
    e2e: float = math.nan
    itl: list = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float:
        """Time per output token after the first."""
        if self.output_tokens < 2:
            return math.nan
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def request_body(req: Request, model: str) -> tuple[str, dict]:
    body = {"model": model, "max_tokens": req.max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    if req.kind == "chat":
        return "/v1/chat/completions", dict(body, messages=[{"role": "user",
                                                             "content": req.prompt}])
    return "/v1/completions", dict(body, prompt=req.prompt)


async def send(client, url: str, model: str, req: Request) -> Result:
    """Streams one request; times its first text chunk and the gaps between chunks."""
    path, body = request_body(req, model)
    t0 = time.perf_counter()
    times = []
    res = Result(ok=False)
    try:
        async with client.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                for ch in chunk.get("choices", []):
                    text = ch.get("text") if "text" in ch else ch["delta"].get("content")
                    if text:
                        times.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001 - recorded as a failed request
        res.error = repr(e)
        return res
    res.e2e = time.perf_counter() - t0
    if times:
        res.ttft = times[0] - t0
        res.itl = list(np.diff(times))
    res.ok = bool(times)
    return res


async def run_rate(url: str, model: str, workload: list[Request], rate: float, seed: int
                   ) -> tuple[list[Result], float]:
    """Sends the workload with exponential inter-arrival gaps (mean 1/rate); all if inf."""
    import httpx

    rng = np.random.default_rng(seed)
    gaps = np.zeros(len(workload)) if math.isinf(rate) else rng.exponential(1 / rate,
                                                                             len(workload))
    limits = httpx.Limits(max_connections=len(workload) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for req, gap in zip(workload, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(send(client, url, model, req)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def summarize(results: list[Result], duration: float) -> dict:
    """Percentiles in milliseconds, throughput, and failure count."""
    ok = [r for r in results if r.ok]

    def pct(values):
        v = np.array([x for x in values if not math.isnan(x)]) * 1e3
        if not len(v):
            return {"mean": None, "p50": None, "p90": None, "p99": None}
        return {"mean": float(v.mean()), **{f"p{q}": float(np.percentile(v, q))
                                            for q in (50, 90, 99)}}

    out_tokens = sum(r.output_tokens for r in ok)
    return {"completed": len(ok), "failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if r.error})[:5],
            "duration_s": duration, "request_throughput": len(ok) / duration,
            "output_throughput": out_tokens / duration, "output_tokens": out_tokens,
            "prompt_tokens": sum(r.prompt_tokens for r in ok),
            "ttft_ms": pct(r.ttft for r in ok), "tpot_ms": pct(r.tpot for r in ok),
            "itl_ms": pct(x for r in ok for x in r.itl), "e2e_ms": pct(r.e2e for r in ok)}


# ---------------------------------------------------------------------------------- server
def start_server(c):
    """Loads the model, compiles, starts the server on a free port; (server, name, tokenizer)."""
    from llmserve.server import BackgroundServer, create_app

    s = c.server
    kw = dict(max_model_len=s.max_model_len, max_num_seqs=s.max_num_seqs, page_size=s.page_size,
              max_num_batched_tokens=s.max_num_batched_tokens, backend=s.backend or None,
              **common.prefill_buckets(s.prefill_buckets, "server.prefill_buckets"))
    if c.model == "tiny-random":
        from llmserve import Engine, EngineConfig
        from llmserve.checkpoint.gguf import default_model_path
        from llmserve.config import preset
        from llmserve.model import init_params
        from llmserve.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf(default_model_path())
        cfg = preset("tiny-9-3").replace(vocab_size=tok.vocab_size,
                                         max_position_embeddings=s.max_model_len)
        engine = Engine(cfg, init_params(cfg, seed=c.seed), tok, EngineConfig(**kw))
        engine.warmup()
        target, name = engine, "tiny-random"
    else:
        from llmserve import LLM
        from llmserve.serve import default_model_name

        target = LLM(model=c.model or None, **kw)
        tok, name = target.tokenizer, default_model_name(c.model or None)
    srv = BackgroundServer(create_app(target, model_name=name, scorer=None)).start()
    return srv, name, tok


# ---------------------------------------------------------------------------------- report
def rates_of(spec: str) -> list[float]:
    return [float(x) for x in spec.split(",") if x.strip()]


def table(rows: list[dict]) -> str:
    headers = ["rate (req/s)", "req/s", "out tok/s", "TTFT p50/p90/p99 ms",
               "TPOT p50/p90/p99 ms", "ITL p50/p90/p99 ms", "E2E p50/p99 ms", "failed"]

    def three(d, keys=("p50", "p90", "p99")):
        return " / ".join("-" if d[k] is None else f"{d[k]:.0f}" for k in keys)

    body = [[r["rate"], f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.1f}",
             three(r["ttft_ms"]), three(r["tpot_ms"]), three(r["itl_ms"]),
             three(r["e2e_ms"], ("p50", "p99")), r["failed"]] for r in rows]
    return common.markdown_table(headers, body)


def plot(path: str, rows: list[dict], title: str) -> str:
    """TTFT, TPOT and ITL percentiles against the request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(r["rate"]) for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, name in zip(axes, ("ttft_ms", "tpot_ms", "itl_ms"), ("TTFT", "TPOT", "ITL")):
        for q in ("p50", "p90", "p99"):
            vals = [np.nan if r[key][q] is None else r[key][q] for r in rows]
            ax.plot(range(len(rows)), vals, marker="o", label=q)
        ax.set_xticks(range(len(rows)), labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv):
    del argv
    import logging as std_logging

    std_logging.getLogger("httpx").setLevel(std_logging.WARNING)  # one line per request
    c = _CONFIG.value
    t0 = time.time()
    srv = None
    if c.url:
        import httpx

        from llmserve.checkpoint.gguf import default_model_path
        from llmserve.tokenizer import Tokenizer

        url, tok = c.url.rstrip("/"), Tokenizer.from_gguf(default_model_path())
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    else:
        srv, name, tok = start_server(c)
        url = srv.url
    logging.info("server %s (%s) ready in %.1fs", url, name, time.time() - t0)
    try:
        workload = build_workload(c, tok)
        warm = [dataclasses.replace(r, max_tokens=4) for r in workload[: c.warmup_requests]]
        asyncio.run(run_rate(url, name, warm, math.inf, c.seed))
        rows = []
        for rate in rates_of(c.request_rates):
            results, duration = asyncio.run(run_rate(url, name, workload, rate, c.seed))
            rows.append({"rate": rate, **summarize(results, duration)})
            logging.info("rate %s: %.1fs, %d failed", rate, duration, rows[-1]["failed"])
    finally:
        if srv is not None:
            srv.stop()
    out = common.run_dir("serving")
    desc = (f"{name}, {c.num_prompts} requests per rate, prompts {tuple(c.prompt_len)} tokens "
            f"or chat, {tuple(c.new_tokens)} new tokens, max_num_seqs={c.server.max_num_seqs}")
    png = plot(os.path.join(out, "latency.png"), rows, desc)
    best = max(rows, key=lambda r: r.get("output_throughput", 0) or 0) if rows else {}
    summary = {k: v for k, v in best.items() if isinstance(v, (int, float))}
    common.write_results(out, "serving", c, rows, summary, [desc], [png], model=name)
    print(f"\n{desc}\n\n{table(rows)}\n\nwrote {out}/results.json and latency.png")


if __name__ == "__main__":
    from llmserve.host_memory import reexec_with_hugepages

    reexec_with_hugepages()  # first: glibc reads its huge-page tunable only at process start
    app.run(main)
