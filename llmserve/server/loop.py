"""The engine thread: one thread owns the engine; every other thread talks to it through a queue.

``EngineLoop`` adds and aborts requests, runs side calls (prompt scoring) and ``engine.step()``,
and hands each ``RequestOutput`` to the asyncio queue of the HTTP request that asked for it.
HTTP handlers never touch the engine, so the engine needs no locks and the event loop never
blocks on a device step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable, Optional

from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams
from llmserve.server.metrics import ServerMetrics
from llmserve.server.protocol import APIError


class Overloaded(Exception):
    """The waiting queue is at its limit (answered with 429)."""


@dataclasses.dataclass
class _Stream:
    """Where one engine request's outputs go, and its timing for the latency metrics."""

    aio: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    tag: int  # which prompt of the HTTP request
    arrival: float
    started: bool = False
    last_time: Optional[float] = None
    num_tokens: int = 0


class EngineLoop:
    """The one thread that drives the engine; every other thread talks to it through a queue.

    ``max_waiting`` bounds the requests accepted but not yet started: past it, ``add`` raises
    ``Overloaded``. A ``ValueError`` from ``engine.add_request`` fails only that request; an
    exception from ``engine.step()`` fails every request in the engine with a 500, the device
    state is rebuilt (see ``recover``) and the loop keeps serving.
    """

    def __init__(self, engine, *, max_waiting: int = 256,
                 metrics: Optional[ServerMetrics] = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics or ServerMetrics()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._lock = threading.Lock()
        self._num_waiting = 0  # accepted, no output yet (incl. those still in the inbox)
        self._num_running = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.step_errors = 0

    # ----------------------------------------------------------- any thread
    def start(self) -> None:
        """Starts the engine thread (idempotent)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="llmserve-engine",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stops the engine thread; unfinished requests are aborted."""
        self._stop.set()
        self._inbox.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return self._num_running

    async def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                  out: asyncio.Queue, tag: int = 0) -> None:
        """Queues a request whose outputs go to ``out`` as ``(tag, RequestOutput | error)``.

        Returns once the engine has accepted it; raises ``ValueError`` if the engine rejects it
        and ``Overloaded`` if the waiting queue is full.
        """
        with self._lock:
            if self._num_waiting >= self.max_waiting:
                raise Overloaded(f"the server is at its limit of {self.max_waiting} waiting "
                                 "requests; retry later")
            self._num_waiting += 1
        aio = asyncio.get_running_loop()
        done = aio.create_future()
        stream = _Stream(aio, out, tag, time.time())
        self._inbox.put(("add", request_id, prompt_ids, params, stream, done))
        try:
            await done
        except asyncio.CancelledError:  # the client left while the engine was busy
            self.abort(request_id)
            raise

    def abort(self, request_id: str) -> None:
        """Aborts a request (no-op if it already ended); its pages are free after this step."""
        self._inbox.put(("abort", request_id))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn()`` on the engine thread between steps (device side calls); its result."""
        aio = asyncio.get_running_loop()
        done = aio.create_future()
        self._inbox.put(("call", fn, aio, done))
        return await done

    # ----------------------------------------------------------- engine thread
    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._drain(block=not engine.has_unfinished_requests())
            if self._stop.is_set() or not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a device or engine failure: fail this step's requests
                self._fail_all(e)
                continue
            now = time.time()
            for out in outputs:
                self._dispatch(out, now)
            self.metrics.update_engine(engine, self._num_running, self._num_waiting)
        for rid in list(self._streams):  # shutting down: tell the waiting handlers
            stream = self._streams[rid]
            self._abort(rid)
            _put(stream, APIError(503, "the server is shutting down", type="server_error"))

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        if kind == "add":
            _, rid, ids, params, stream, done = item
            try:
                self.engine.add_request(rid, ids, params)
            except Exception as e:  # noqa: BLE001 - any rejection fails only this request
                with self._lock:
                    self._num_waiting -= 1
                _resolve(stream.aio, done, exc=e)
                return
            self._streams[rid] = stream
            self.metrics.prompt_tokens.inc(len(ids))
            _resolve(stream.aio, done, value=None)
        elif kind == "abort":
            self._abort(item[1])
        elif kind == "call":
            _, fn, aio, done = item
            try:
                _resolve(aio, done, value=fn())
            except Exception as e:  # noqa: BLE001 - the caller gets the error
                _resolve(aio, done, exc=e)

    def _forget(self, rid: str) -> Optional[_Stream]:
        stream = self._streams.pop(rid, None)
        if stream is not None:
            with self._lock:
                if stream.started:
                    self._num_running -= 1
                else:
                    self._num_waiting -= 1
        return stream

    def _abort(self, rid: str) -> None:
        if self._forget(rid) is not None:
            self.engine.abort(rid)
            self.metrics.finished.labels("abort").inc()

    def _dispatch(self, out: RequestOutput, now: float) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return  # aborted: the client is gone
        try:
            self._observe(stream, out, now)
        except Exception as e:  # noqa: BLE001 - a host-side failure ends only this request
            self._abort(out.request_id)
            _put(stream, APIError(500, f"request failed: {e!r}", type="server_error"))
            return
        if out.finished:
            self._forget(out.request_id)
            reasons = {o.finish_reason for o in out.outputs}
            self.metrics.finished.labels(",".join(sorted(str(r) for r in reasons))).inc()
            self.metrics.e2e.observe(now - stream.arrival)
        _put(stream, out)

    def _observe(self, stream: _Stream, out: RequestOutput, now: float) -> None:
        if not stream.started:
            stream.started = True
            with self._lock:
                self._num_waiting -= 1
                self._num_running += 1
        n = sum(len(o.token_ids) for o in out.outputs)
        if n > stream.num_tokens:
            if stream.last_time is None:
                self.metrics.ttft.observe(now - stream.arrival)
            else:
                gap = (now - stream.last_time) / (n - stream.num_tokens)
                for _ in range(n - stream.num_tokens):
                    self.metrics.itl.observe(gap)
            stream.last_time, stream.num_tokens = now, n

    def _fail_all(self, error: Exception) -> None:
        """A failed step: its requests get a 500; the engine rebuilds its device state and
        every other request keeps going (preempted and recomputed)."""
        self.step_errors += 1
        logging.getLogger(__name__).exception("engine step failed; failing its requests")
        try:
            failed = self.engine.recover()
        except Exception:  # noqa: BLE001 - keep the loop alive; fail everything instead
            logging.getLogger(__name__).exception("engine recovery failed")
            failed = list(self._streams)
        for rid in failed:
            stream = self._streams.get(rid)
            if stream is None:
                continue
            self._abort(rid)
            _put(stream, APIError(500, f"engine step failed: {error!r}", type="server_error"))


def _resolve(aio: asyncio.AbstractEventLoop, fut: asyncio.Future, value=None, exc=None) -> None:
    def set_():
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)

    aio.call_soon_threadsafe(set_)


def _put(stream: _Stream, item) -> None:
    try:
        stream.aio.call_soon_threadsafe(stream.queue.put_nowait, (stream.tag, item))
    except RuntimeError:
        pass  # the event loop is closed: the server is shutting down

