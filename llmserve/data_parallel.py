"""Data parallelism: independent engine replicas behind one front that routes requests.

Each replica is a whole ``Engine`` (its own scheduler, slots, block manager and page pool) on
one row of the ``("data", "model")`` mesh, i.e. on its own ``tensor_parallel_size`` devices.
Replicas share nothing on the device, so a step holds no collective over ``data``: replicas
may run different bucket shapes in the same instant, a long prefill on one never stalls the
decode of another, and across hosts a replica needs no cross-host traffic at all. The front
(host only, no jax) assigns each request to the least-loaded replica and steps every replica
with work in its own thread; jax releases the GIL while a step runs, so the replicas' devices
work at the same time.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from llmserve.engine import Engine, EngineConfig
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams


class Router:
    """Least-loaded routing: a request goes to the replica with the fewest outstanding
    sequences (ties: the lowest index). Host bookkeeping only."""

    def __init__(self, num_replicas: int):
        self.load = [0] * num_replicas

    def pick(self, num_seqs: int) -> int:
        """The replica for a new request of ``num_seqs`` sequences; counts them there."""
        i = min(range(len(self.load)), key=lambda r: (self.load[r], r))
        self.load[i] += num_seqs
        return i

    def done(self, replica: int, num_seqs: int) -> None:
        """A request of ``num_seqs`` sequences finished on ``replica``."""
        self.load[replica] -= num_seqs


class DataParallelEngine:
    """``data_parallel_size`` Engine replicas with one ``add_request`` / ``step`` front.

    Request ids are global: a request's seed comes from its id (``request_seed``), so its
    output does not depend on which replica serves it.
    """

    def __init__(self, cfg, params, tokenizer=None, config: Optional[EngineConfig] = None,
                 devices=None):
        from llmserve.sharding import engine_shardings, kv_head_plan

        config = config or EngineConfig()
        config.validate()
        kv_head_plan(cfg, config.tensor_parallel_size)
        shardings = engine_shardings(config.tensor_parallel_size, config.data_parallel_size,
                                     devices)
        one = dataclasses.replace(config, data_parallel_size=1)
        self.replicas = [Engine(cfg, params, tokenizer, one, shardings=s) for s in shardings]
        self.config = config
        self.cfg, self.tokenizer = cfg, tokenizer
        self.router = Router(len(self.replicas))
        self._where: dict[str, int] = {}
        self._counter = 0
        self._pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="dp-replica")

    @property
    def runner(self):
        """Replica 0's runner (compile counts are process-wide, the same for every replica)."""
        return self.replicas[0].runner

    @property
    def stats(self) -> dict:
        """Counters summed over replicas."""
        out: dict = {}
        for eng in self.replicas:
            for k, v in eng.stats.items():
                if isinstance(v, (int, float)):
                    out[k] = out.get(k, 0) + v
        return out

    def warmup(self) -> None:
        """Compiles every replica's step shapes (each replica's devices need their own)."""
        list(self._pool.map(lambda e: e.warmup(), self.replicas))

    def check_request(self, prompt, params: SamplingParams, cache_salt: Optional[str] = None):
        """Validates without queuing (replicas share model and limits)."""
        return self.replicas[0].check_request(prompt, params, cache_salt)

    def add_request(self, request_id: Optional[str], prompt, params=None,
                    cache_salt: Optional[str] = None) -> str:
        """Validates the request, then queues it on the least-loaded replica."""
        params = params or SamplingParams()
        request_id = str(self._counter) if request_id is None else str(request_id)
        if request_id in self._where:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.check_request(prompt, params, cache_salt)  # errors before any routing state
        i = self.router.pick(params.n)
        try:
            self.replicas[i].add_request(request_id, prompt, params, cache_salt)
        except Exception:
            self.router.done(i, params.n)
            raise
        self._where[request_id] = i
        self._counter += 1
        return request_id

    def abort(self, request_id: str) -> None:
        """Aborts a request on its replica (unknown ids are ignored)."""
        i = self._where.get(str(request_id))
        if i is not None:
            self.replicas[i].abort(str(request_id))

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.replicas)

    def step(self) -> list[RequestOutput]:
        """One step of every replica that has work, concurrently; their outputs together."""
        busy = [i for i, e in enumerate(self.replicas) if e.has_unfinished_requests()]
        results = list(self._pool.map(lambda i: self.replicas[i].step(), busy))
        outs = []
        for i, res in zip(busy, results):
            for out in res:
                if out.finished and self._where.pop(out.request_id, None) is not None:
                    self.router.done(i, len(out.outputs))
                outs.append(out)
        return outs


def make_engine(cfg, params, tokenizer=None, config: Optional[EngineConfig] = None):
    """An ``Engine`` (one replica) or a ``DataParallelEngine`` (``data_parallel_size > 1``)."""
    config = config or EngineConfig()
    if config.data_parallel_size > 1:
        return DataParallelEngine(cfg, params, tokenizer, config)
    return Engine(cfg, params, tokenizer, config)
