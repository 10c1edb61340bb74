"""The engine loop: one background thread owns a set of engines and the device, so that many callers (browser tabs,
the chat, the race, an HTTP API) can submit and stream at the same time.

`EngineLoop.submit(engine, prompt, params, ...)` validates the request in the caller's thread (a `ConfigError`
comes back at once), queues it on `engine`, and returns a `LoopHandle`, an iterator of that request's events that
blocks until the loop thread produces them. Whatever another thread asks of the loop (queue a request, cancel one,
read an engine's state with `call`) runs in the loop thread between two steps, so engines need no locks and a
caller waits at most one step. Requests on the same engine are batched together by its scheduler; the
loop steps one engine at a time. Between engines (two configurations, say a race's two lanes) it shares the device
by busy time: it steps the engine with work that has used the least device time since it last became busy, so two
busy engines each get half of it, step by step.

Ending a request from any thread: `handle.stop()` ends it after the step in flight with a final event; `cancel()`
(or closing the handle's iterator) frees it at once. A step that fails delivers the error to the requests in it
(their iterators raise it) and the loop goes on with the rest.

The threads that hand the loop work free their idle OpenMP workers as they do (`engine.openmp`): on a 2-core host a
second team of workers made the loop's steps run at about 0.6x.

`status()` says, per engine, what is queued and running and how long its recent steps took: what a waiting caller
needs to tell a person what it waits for and for about how long.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from concurrent.futures import Future
from functools import partial
from typing import Callable, Iterator

from inference_core.engine.engine import Engine, StepReport
from inference_core.engine.openmp import release_idle_workers
from inference_core.engine.request import FinishEvent, Request, TokenEvent

log = logging.getLogger(__name__)
RECENT_STEPS = 20  # steps per engine whose durations `status()` averages
CANCELLED = "cancelled"  # what observers see when a request is cancelled (it gets no final event)


class EventHandle(ABC):
    """A request's events seen from the thread that submitted it, through `queue` ((handle, event) pairs; several
    handles may share one sink, see `merge`). Iterate it for its events (TokenEvent..., then one FinishEvent); the
    iterator raises the error of a failed step. Subclasses say how to `stop` and `cancel` the request: `LoopHandle`
    for our engine loop, `serving.remote.RemoteHandle` for an external engine."""

    def __init__(self, tag=None, sink: queue.Queue | None = None):
        self.tag = tag
        self.queue: queue.Queue = sink if sink is not None else queue.Queue()
        self.done = False

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

    @abstractmethod
    def stop(self) -> None:
        """End the request after the work in flight, with a final event (finish_reason "stopped")."""

    @abstractmethod
    def cancel(self) -> None:
        """End the request now, with no final event, and free what it holds."""


class LoopHandle(EventHandle):
    """One request submitted to the engine loop."""

    def __init__(self, loop: "EngineLoop", engine: Engine, request: Request, tag=None,
                 sink: queue.Queue | None = None):
        super().__init__(tag, sink)
        self.loop, self.engine, self.request = loop, engine, request

    @property
    def request_id(self) -> int:
        return self.request.request_id

    def stop(self) -> None:
        """End after the step in flight, with a final event (finish_reason "stopped")."""
        self.request.stop_requested = True
        self.loop.wake()

    def cancel(self) -> None:
        """End now with no final event; the request's KV goes back to the pool."""
        if not self.request.finished:
            self.loop.cancel(self)

    def _deliver(self, request: Request, event) -> None:  # called in the loop thread
        self.loop.observe(self, event)
        self.queue.put((self, event))


class EngineLoop:
    def __init__(self):
        # Everything another thread asks of the loop is a command run by the loop thread between two steps, so no
        # engine is ever touched by two threads and a caller waits at most one step.
        self._commands: queue.Queue[tuple[Callable, Future]] = queue.Queue()
        self._busy_s: dict[Engine, float] = {}  # device time used since the engine last became busy (fair share)
        self._busy_since: dict[Engine, int] = {}  # ties go to the engine that became busy first
        self._became_busy = 0
        self._recent_ms: dict[Engine, deque[float]] = {}
        self._step_listeners: dict[Engine, list[Callable[[StepReport], None]]] = {}
        self._observers: list[Callable[[LoopHandle, object], None]] = []
        self._step_observers: list[Callable[[Engine, StepReport], None]] = []
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._closed = False

    # --- callers' side --------------------------------------------------------------------------------------------

    def submit(self, engine: Engine, prompt, params=None, *, tag=None, sink: queue.Queue | None = None,
               **kwargs) -> LoopHandle:
        """Validate (raises ConfigError here, in the caller's thread) and queue a request on `engine`; keywords as
        `Engine.make_request`. `sink`: a queue shared with other handles, read with `merge`."""
        return self.enqueue(engine, engine.make_request(prompt, params, **kwargs), tag=tag, sink=sink)

    def enqueue(self, engine: Engine, request: Request, *, tag=None, sink: queue.Queue | None = None) -> LoopHandle:
        """Queue a request already made (and so validated) by `engine.make_request`."""
        handle = LoopHandle(self, engine, request, tag, sink)
        request.listener = handle._deliver
        self.call(self._enqueue, engine, request)
        return handle

    def _enqueue(self, engine: Engine, request: Request) -> None:
        if engine not in self._busy_s:  # newly busy: start level with the engines already busy, not far behind
            busy = [self._busy_s[e] for e in self._busy_s if e.has_work()]
            self._busy_s[engine] = min(busy, default=0.0)
            self._became_busy += 1
            self._busy_since[engine] = self._became_busy
        engine.enqueue(request)

    def cancel(self, handle: LoopHandle, wait: bool = True) -> None:
        """Free `handle`'s request between two steps. wait=False returns at once (an asyncio handler must not block
        its event loop for a step)."""
        if wait:
            self.call(self._cancel, handle)
        elif not self._closed:
            self._commands.put((lambda: self._cancel(handle), Future()))
            self._start()
        handle.done = True

    def _cancel(self, handle: LoopHandle) -> None:
        if not handle.request.finished:
            handle.engine.cancel(handle.request)
            self.observe(handle, CANCELLED)

    def add_observer(self, observer: Callable[["LoopHandle", object], None]) -> None:
        """Call `observer(handle, event)` in the loop thread for every event of every request (a TokenEvent, a
        FinishEvent, the error of a failed step, or CANCELLED): how the metrics see the page's and the API's requests
        alike. An observer that raises is logged and does not affect the request."""
        self.call(self._observers.append, observer)

    def add_step_observer(self, observer: Callable[[Engine, StepReport], None]) -> None:
        """Call `observer(engine, report)` in the loop thread after every step of every engine: how the pool's cost
        estimates learn from the steps requests actually take. One that raises is logged. (Appended here, not in
        the loop thread, so that adding one does not start the loop; the loop reads the list as it stands.)"""
        self._step_observers.append(observer)

    def observe(self, handle: "LoopHandle", event) -> None:
        for observer in self._observers:
            try:
                observer(handle, event)
            except Exception:
                log.exception("observer failed")

    def drain(self, engine: Engine) -> None:
        """No more requests are coming to `engine` (a static batch may start partial)."""
        self.call(engine.drain)

    def wake(self) -> None:
        self.call(lambda: None)

    def call(self, function: Callable, *args):
        """Run `function(*args)` in the loop thread between two steps and return its result (or raise its error):
        how another thread reads an engine's state, changes its queues, or uses the device alone."""
        if threading.current_thread() is self._thread:
            return function(*args)
        if self._closed:
            raise RuntimeError("the engine loop has been closed")
        future: Future = Future()
        self._commands.put((lambda: function(*args), future))
        self._start()
        release_idle_workers()  # this thread waits: the loop's OpenMP team is then the only one (`engine.openmp`)
        return future.result()

    def on_step(self, engine: Engine, listener: Callable[[StepReport], None]) -> Callable[[], None]:
        """Call `listener(report)` (in the loop thread) after every step of `engine`; returns a function that stops."""
        self.call(lambda: self._step_listeners.setdefault(engine, []).append(listener))

        def remove() -> None:
            self.call(self._remove_listener, engine, listener)
        return remove

    def _remove_listener(self, engine: Engine, listener: Callable[[StepReport], None]) -> None:
        listeners = self._step_listeners.get(engine, [])
        if listener in listeners:
            listeners.remove(listener)
        if not listeners:  # keep no reference to an engine nobody listens to
            self._step_listeners.pop(engine, None)

    def status(self) -> list[dict]:
        """Per engine with work: requests queued and running, the mean of its recent step times (ms), and the fewest
        steps until one of its running requests may end (its max_new_tokens reached)."""
        return self.call(self._status)

    def _status(self) -> list[dict]:
        return [{"engine": engine, "waiting": len(engine.scheduler.waiting), "running": len(engine.scheduler.running),
                 "mean_step_ms": self._mean_step_ms(engine),
                 "steps_until_a_slot": min((r.room() for r in engine.scheduler.running), default=0)}
                for engine in self._busy_s if engine.has_work()]

    def mean_step_ms(self, engine: Engine) -> float | None:
        return self.call(self._mean_step_ms, engine)

    def _mean_step_ms(self, engine: Engine) -> float | None:
        recent = self._recent_ms.get(engine)
        return sum(recent) / len(recent) if recent else None

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self.call(self._close)
            self._thread.join(timeout=5)
        self._closed = True

    def _close(self) -> None:
        self._closed = True

    # --- the loop thread ------------------------------------------------------------------------------------------

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
                self._thread.start()

    def _next_engine(self) -> tuple[Engine | None, float]:
        """The busy engine with the least device time used that can step now, or None and how long to wait. An
        engine with nothing left (finished or cancelled) is forgotten: the loop keeps no reference to idle engines,
        so one its owner dropped is freed with its KV pool."""
        ready, wait_s = [], math.inf
        for engine in list(self._busy_s):
            if not engine.has_work():
                self._forget(engine)
                continue
            until = engine.seconds_until_ready()
            if until == 0:
                ready.append(engine)
            wait_s = min(wait_s, until)
        if not ready:
            return None, wait_s
        return min(ready, key=lambda engine: (self._busy_s[engine], self._busy_since[engine])), 0.0

    def _forget(self, engine: Engine) -> None:
        for table in (self._busy_s, self._busy_since, self._recent_ms):
            table.pop(engine, None)

    def _run_commands(self, timeout: float | None) -> None:
        """Run every queued command; wait up to `timeout` seconds for the first (0: do not wait, None: forever)."""
        try:
            command, future = self._commands.get(timeout=timeout) if timeout != 0 else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                future.set_result(command())
            except BaseException as error:  # the caller gets it; the loop goes on
                future.set_exception(error)
            try:
                command, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        while not self._closed:
            # 1. What callers asked for, between steps. 2. One step of the engine whose turn it is.
            engine, wait_s = self._next_engine()
            self._run_commands(0 if engine is not None else (None if wait_s == math.inf else wait_s))
            if not self._closed:
                self._step_next()

    def _step_next(self) -> None:
        """One step of the engine whose turn it is (a method of its own, so that nothing of it stays referenced
        while the loop waits)."""
        engine, _ = self._next_engine()
        if engine is None:
            return
        try:
            report = engine.step()
        except Exception:  # the requests of the failed step already got the error; the loop goes on
            log.exception("engine step failed")
            report = None
        if report is not None:
            self._busy_s[engine] += report.duration_ms / 1e3
            self._recent_ms.setdefault(engine, deque(maxlen=RECENT_STEPS)).append(report.duration_ms)
            listeners = [partial(observer, engine) for observer in self._step_observers]
            for listener in listeners + list(self._step_listeners.get(engine, ())):
                try:
                    listener(report)
                except Exception:
                    log.exception("step listener failed")
        if not engine.has_work():
            self._forget(engine)


def merge(handles: list[LoopHandle], should_stop: Callable[[], bool] | None = None, poll_s: float = 0.05,
          heartbeat_s: float | None = None) -> Iterator[tuple[LoopHandle | None, TokenEvent | FinishEvent | None]]:
    """(handle, event) from handles that share one sink queue, as they arrive, until every one has finished. Once
    `should_stop()` is true (asked at least every `poll_s`), every handle is stopped: it ends after its step in
    flight, with a final event. With `heartbeat_s`, (None, None) comes whenever that long passed without an event
    (a caller that waits can say so). Closing this iterator cancels every handle that has not finished."""
    sink = handles[0].queue if handles else None
    if any(handle.queue is not sink for handle in handles):
        raise ValueError("merge() needs handles submitted with one shared sink queue")
    stopped = False
    last_event = time.perf_counter()
    try:
        while not all(handle.done for handle in handles):
            if not stopped and should_stop is not None and should_stop():
                stopped = True
                for handle in handles:
                    handle.stop()
            try:
                handle, event = sink.get(timeout=poll_s)
            except queue.Empty:
                if heartbeat_s is not None and time.perf_counter() - last_event >= heartbeat_s:
                    last_event = time.perf_counter()
                    yield None, None
                continue
            last_event = time.perf_counter()
            yield handle, handle.received(event)
    finally:
        for handle in handles:
            handle.cancel()
