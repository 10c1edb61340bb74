"""The engine loop: one background thread owns a set of engines and the device, so that many callers (browser tabs,
the chat, the race, an HTTP API) can submit and stream at the same time.

`EngineLoop.submit(engine, prompt, params, ...)` validates the request in the caller's thread (a `ConfigError`
comes back at once), queues it on `engine`, and returns a `LoopHandle`, an iterator of that request's events that
blocks until the loop thread produces them. Requests on the same engine are batched together by its scheduler; the
loop steps one engine at a time. Between engines (two configurations, say a race's two lanes) it shares the device
by busy time: it steps the engine with work that has used the least device time since it last became busy, so two
busy engines each get half of it, step by step.

Ending a request from any thread: `handle.stop()` ends it after the step in flight with a final event; `cancel()`
(or closing the handle's iterator) frees it at once. A step that fails delivers the error to the requests in it
(their iterators raise it) and the loop goes on with the rest.

`status()` says, per engine, what is queued and running and how long its recent steps took: what a waiting caller
needs to tell a person what it waits for and for about how long.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections import deque
from typing import Callable, Iterator

from inference_core.engine import Engine, FinishEvent, StepReport, TokenEvent
from inference_core.request import Request

log = logging.getLogger(__name__)
RECENT_STEPS = 20  # steps per engine whose durations `status()` averages


class LoopHandle:
    """One submitted request, seen from the submitting thread. Iterate it for its events (TokenEvent..., then one
    FinishEvent); the iterator raises the error of a failed step."""

    def __init__(self, loop: "EngineLoop", engine: Engine, request: Request, tag=None,
                 sink: queue.Queue | None = None):
        self.loop, self.engine, self.request, self.tag = loop, engine, request, tag
        # (handle, event) pairs; several handles may share one sink (see `merge`).
        self.queue: queue.Queue = sink if sink is not None else queue.Queue()
        self.done = False

    @property
    def request_id(self) -> int:
        return self.request.request_id

    def __iter__(self) -> Iterator[TokenEvent | FinishEvent]:
        try:
            while not self.done:
                yield self.next_event()
        finally:
            self.cancel()

    def next_event(self, timeout: float | None = None) -> TokenEvent | FinishEvent:
        """The next event of a handle with its own queue (blocking up to `timeout` seconds; queue.Empty after)."""
        return self.received(self.queue.get(timeout=timeout)[1])

    def received(self, event):
        """Note what arrived for this handle: the end, or an error to raise."""
        if isinstance(event, BaseException):
            self.done = True
            raise event
        if isinstance(event, FinishEvent):
            self.done = True
        return event

    def stop(self) -> None:
        """End after the step in flight, with a final event (finish_reason "stopped")."""
        self.request.stop_requested = True
        self.loop.wake()

    def cancel(self) -> None:
        """End now with no final event; the request's KV goes back to the pool."""
        if not self.request.finished:
            self.loop.cancel(self)

    def _deliver(self, request: Request, event) -> None:  # called in the loop thread
        self.queue.put((self, event))


class EngineLoop:
    def __init__(self):
        self._lock = threading.Condition()
        self._busy_s: dict[Engine, float] = {}  # device time used since the engine last became busy (fair share)
        self._recent_ms: dict[Engine, deque[float]] = {}
        self._step_listeners: dict[Engine, list[Callable[[StepReport], None]]] = {}
        self._thread: threading.Thread | None = None
        self._closed = False

    # --- callers' side --------------------------------------------------------------------------------------------

    def submit(self, engine: Engine, prompt, params=None, *, tag=None, sink: queue.Queue | None = None,
               **kwargs) -> LoopHandle:
        """Validate (raises ConfigError here, in the caller's thread) and queue a request on `engine`; keywords as
        `Engine.make_request`. `sink`: a queue shared with other handles, read with `merge`."""
        request = engine.make_request(prompt, params, **kwargs)
        handle = LoopHandle(self, engine, request, tag, sink)
        request.listener = handle._deliver
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine loop has been closed")
            if not engine.has_work():  # newly busy: start level with the engines already busy, not far behind
                busy = [self._busy_s[e] for e in self._busy_s if e.has_work()]
                self._busy_s[engine] = min(busy, default=0.0)
            engine.enqueue(request)
            self._start()
            self._lock.notify_all()
        return handle

    def cancel(self, handle: LoopHandle) -> None:
        with self._lock:
            handle.engine.cancel(handle.request)
            handle.done = True

    def drain(self, engine: Engine) -> None:
        """No more requests are coming to `engine` (a static batch may start partial)."""
        with self._lock:
            engine.drain()
            self._lock.notify_all()

    def wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def on_step(self, engine: Engine, listener: Callable[[StepReport], None]) -> Callable[[], None]:
        """Call `listener(report)` (in the loop thread) after every step of `engine`; returns a function that stops."""
        with self._lock:
            self._step_listeners.setdefault(engine, []).append(listener)

        def remove() -> None:
            with self._lock:
                listeners = self._step_listeners.get(engine, [])
                if listener in listeners:
                    listeners.remove(listener)
        return remove

    def status(self) -> list[dict]:
        """Per engine with work: requests queued and running, and the mean of its recent step times (ms)."""
        with self._lock:
            return [{"engine": engine, "waiting": len(engine.scheduler.waiting),
                     "running": len(engine.scheduler.running),
                     "mean_step_ms": (sum(self._recent_ms[engine]) / len(self._recent_ms[engine])
                                      if self._recent_ms.get(engine) else None)}
                    for engine in self._busy_s if engine.has_work()]

    def mean_step_ms(self, engine: Engine) -> float | None:
        with self._lock:
            recent = self._recent_ms.get(engine)
            return sum(recent) / len(recent) if recent else None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # --- the loop thread ------------------------------------------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    def _next_engine(self) -> tuple[Engine | None, float]:
        """The busy engine with the least device time used that can step now, or None and how long to wait."""
        ready, wait_s = [], math.inf
        for engine in self._busy_s:
            if engine.has_work():
                until = engine.seconds_until_ready()
                if until == 0:
                    ready.append(engine)
                wait_s = min(wait_s, until)
        if not ready:
            return None, wait_s
        return min(ready, key=lambda engine: self._busy_s[engine]), 0.0

    def _run(self) -> None:
        while True:
            with self._lock:
                engine, wait_s = self._next_engine()
                while engine is None and not self._closed:
                    self._lock.wait(None if wait_s == math.inf else wait_s)
                    engine, wait_s = self._next_engine()
                if self._closed:
                    return
                try:
                    report = engine.step()
                except Exception:  # the requests of the failed step already got the error; the loop goes on
                    log.exception("engine step failed")
                    continue
                self._busy_s[engine] += report.duration_ms / 1e3
                self._recent_ms.setdefault(engine, deque(maxlen=RECENT_STEPS)).append(report.duration_ms)
                listeners = list(self._step_listeners.get(engine, ()))
            for listener in listeners:  # outside the lock: a listener may be slow, or ask for status()
                try:
                    listener(report)
                except Exception:
                    log.exception("step listener failed")


def merge(handles: list[LoopHandle], should_stop: Callable[[], bool] | None = None,
          poll_s: float = 0.05) -> Iterator[tuple[LoopHandle, TokenEvent | FinishEvent]]:
    """(handle, event) from handles that share one sink queue, as they arrive, until every one has finished. Once
    `should_stop()` is true (asked at least every `poll_s`), every handle is stopped: it ends after its step in
    flight, with a final event. Closing this iterator cancels every handle that has not finished."""
    sink = handles[0].queue if handles else None
    if any(handle.queue is not sink for handle in handles):
        raise ValueError("merge() needs handles submitted with one shared sink queue")
    stopped = False
    try:
        while not all(handle.done for handle in handles):
            if not stopped and should_stop is not None and should_stop():
                stopped = True
                for handle in handles:
                    handle.stop()
            try:
                handle, event = sink.get(timeout=poll_s)
            except queue.Empty:
                continue
            yield handle, handle.received(event)
    finally:
        for handle in handles:
            handle.cancel()
