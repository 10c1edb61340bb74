"""Racing requests on one device from one thread: `interleave` advances several request generators so each gets an
equal share of device time.

It always advances the lane that has used the least busy time so far (each lane's own clock, from its events), one
model step at a time; the lane that takes the very first step is the caller's choice (the playground alternates it
between races, so no lane always meets whatever a first step still costs). Because every request times only its own
steps (see `engine`), a lane's reported TTFT and tokens/s are what the same configuration gives alone, and on screen
both lanes move at a pace that reflects their own speed (`inference_core.bench.race` measures that this holds).
"""

from __future__ import annotations

from typing import Callable, Iterator

from inference_core.engine.engine import Engine
from inference_core.engine.request import FinishEvent, StopGeneration, TokenEvent
from inference_core.sampling import SamplingParams


def interleave(lanes: dict[str, Iterator[TokenEvent | FinishEvent]], first: str | None = None,
               should_stop: Callable[[], bool] | None = None) -> Iterator[tuple[str, TokenEvent | FinishEvent]]:
    """Yield (lane name, event) from every lane until all have finished, next stepping the lane with the least busy
    time; ties (the first step above all) go to `first`, by default the lane named first.

    Once `should_stop()` returns true (it is asked before every step), each lane is stopped after the step it has in
    flight (`StopGeneration`): its remaining events still arrive, the last a FinishEvent with finish_reason
    "stopped"; a lane that had not started yet just ends, with no events. Closing this generator instead closes every
    lane at once, which cancels its request with no final event."""
    busy_s = {name: 0.0 for name in lanes}
    running = {name: lanes[name] for name in sorted(lanes, key=lambda name: name != first)}
    stopped: set[str] = set()
    try:
        while running:
            name = min(running, key=lambda lane: busy_s[lane])
            if should_stop is not None and name not in stopped and should_stop():
                stopped.add(name)
                try:
                    event = running[name].throw(StopGeneration)
                except StopGeneration:  # it had not started: no step to finish, nothing to report
                    running.pop(name)
                    continue
            else:
                event = next(running[name])
            finished = isinstance(event, FinishEvent)
            busy_s[name] = event.stats.total_ms / 1e3 if finished else event.time_s
            yield name, event
            if finished:  # the request is still held while the caller looks at its last event; now free it
                running.pop(name).close()
    finally:
        for lane in lanes.values():
            lane.close()


def race_to_end(engines: dict[str, Engine], prompt_ids: list[int],
                params: SamplingParams) -> dict[str, FinishEvent]:
    """Run one prompt on every engine at once, interleaved; return each lane's final event."""
    lanes = {name: engine.generate(prompt_ids, params) for name, engine in engines.items()}
    return {name: event for name, event in interleave(lanes) if isinstance(event, FinishEvent)}
