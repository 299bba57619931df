"""How llmserve spends a run: a probe on the engine's steps (KV use, occupancy, and in profile
mode the decode / prefill / host split), per-bucket step costs, and the ideal continuous
schedule simulated from them (experiments/throughput.py's "ideal schedule" row)."""

from __future__ import annotations

import time
from typing import Callable, Optional

try:
    from experiments.workloads import Request
except ImportError:  # run as a script
    from workloads import Request


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


def step_times(llm, iters: int = 3, context: int = 0) -> dict:
    """Median seconds of one decode step per batch bucket, and of one prefill step per
    (rows, chunk) bucket (fixed shapes: the cost of a real step).

    Decode rows attend over ``context`` keys each, on distinct pages (the workload's mean
    context: attention is part of a real step's cost; all-padding rows would attend to
    nothing and make the "ideal" schedule too cheap). Prefill steps are all padding; every
    padding row is computed (``empty_batch(full=True)``), as a real row would be.
    Reads the runner's bucket lists; returns {} when the runner does not expose them.
    """
    import jax
    import numpy as np

    runner = llm.engine.runner
    if not all(hasattr(runner, a) for a in ("decode_buckets", "prefill_buckets", "empty_batch")):
        return {}

    def timed(shape):
        batch = runner.empty_batch(shape, full=True)  # every row computed, as real ones are
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
    per_token = min(t / (rows * chunk) for rows, chunk, t in _prefill_buckets(times))
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
            "decode_steps": steps, "generated_tokens": sum(r.max_tokens for r in workload),
            "bucketed": bucketed_schedule(workload, slots, times)}


def _prefill_buckets(times: dict) -> list[tuple[int, int, float]]:
    """The probe's prefill costs as (rows, chunk, seconds), fewest rows first ("16x8" keys)."""
    return sorted((int(k.split("x")[0]), int(k.split("x")[1]), t)
                  for k, t in times["prefill"].items())


def bucketed_schedule(workload: list[Request], slots: int, times: dict,
                      max_seqs: int = 8) -> Optional[dict]:
    """Wall time of greedy continuous batching on the measured per-bucket step costs: a
    yardstick between the ideal (prefill at the cheapest rate, no padding) and the engine.

    Every step admits waiting requests (FCFS) into free slots, as many prompt chunks as one
    step's largest prefill bucket holds (``max_seqs`` at most; a longer prompt continues next
    step), each chunk taking ceil(len / C) rows of C tokens. A step with prompt rows costs its
    prefill bucket plus, when decode rows ride beside them, what those rows add to a decode
    step (decode bucket minus the smallest one: the weights are read once); a decode-only step
    costs its decode bucket. No host time, every step at the probe's context. A request emits
    its first token from its last chunk's step, then one token per decode step.
    """
    if not times or not times.get("decode") or not times.get("prefill"):
        return None
    decode = {int(b): t for b, t in times["decode"].items()}
    dbuckets = sorted(decode)
    prefill = _prefill_buckets(times)
    chunk = prefill[-1][1]
    max_rows = prefill[-1][0]

    def decode_cost(rows: int) -> float:
        return decode[next((b for b in dbuckets if b >= rows), dbuckets[-1])]

    queue = [[len(r.prompt_ids), r.max_tokens] for r in workload]  # [prompt left, tokens left]
    nxt, wall, steps, prefill_steps = 0, 0.0, 0, 0
    filling: list[list[int]] = []  # admitted, prompt not yet computed
    decoding: list[int] = []  # tokens still to emit
    while nxt < len(queue) or filling or decoding:
        while len(filling) + len(decoding) < slots and nxt < len(queue):
            filling.append(queue[nxt])
            nxt += 1
        rows, carried = 0, []
        for req in filling[:max_seqs]:
            take = min(-(-req[0] // chunk), max_rows - rows)
            if take <= 0:
                break
            rows += take
            carried.append((req, take))
        steps += 1
        if rows:
            prefill_steps += 1
            cost = next((t for r, _, t in prefill if r >= rows), prefill[-1][2])
            if decoding:
                cost += decode_cost(len(decoding)) - decode[dbuckets[0]]
        else:
            cost = decode_cost(len(decoding))
        wall += cost
        decoding = [n - 1 for n in decoding if n > 1]
        for req, take in carried:
            req[0] = max(0, req[0] - take * chunk)
            if req[0] == 0 and req[1] > 1:
                decoding.append(req[1] - 1)  # its first token came from this step
        filling = [req for req in filling if req[0] > 0]
    return {"wall_s": wall, "steps": steps, "prefill_steps": prefill_steps}
