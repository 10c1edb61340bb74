"""Stop, per visitor: how the Stop buttons reach a running race or chat turn.

Each visitor's page holds a `RunControl` in a `gr.State` (Gradio hands the handlers of one session the same object,
and no other session ever sees it). Run or Send arms it before the generation is queued; Stop asks the armed run to
stop; the run checks before every model step and then stops after the step in flight, so it still ends with a final
update that puts every panel in its final state. (Gradio's own cancel would end the handler mid-stream, with no final
update and stale panels.) A Stop pressed while the run waits in the queue is seen as soon as the run starts. The same
object carries the visitor's private cache salt (`visitor`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from serving.policy import client_address


@dataclass
class RunControl:
    armed: bool = False  # a run was started (Run or Send pressed) and has not ended yet
    stop_requested: bool = False
    caller: str | None = None  # the visitor's client address, for the deployment's per-caller limits
    _visitor: str | None = None

    @property
    def visitor(self) -> str:
        """This visitor's private id, made on first use (after Gradio has copied the State's default for the
        session, so every session gets its own). It salts the prefix cache's block hashes: one visitor's requests
        never hit blocks another visitor's text filled, so neither the KV view nor a cache hit's timing can reveal
        someone else's prompt. It never leaves the server."""
        if self._visitor is None:
            self._visitor = uuid.uuid4().hex
        return self._visitor

    def arm(self, caller: str | None = None) -> None:
        self.armed, self.stop_requested = True, False
        self.caller = caller or self.caller

    def request_stop(self) -> bool:
        """Ask the armed run to stop; False when nothing is running (then Stop does nothing)."""
        if self.armed:
            self.stop_requested = True
        return self.armed

    def end(self) -> None:
        self.armed = self.stop_requested = False


def caller_of(request) -> str | None:
    """A page visitor's client address from Gradio's request (`serving.policy.client_address`, trusting a proxy's
    X-Forwarded-For); None outside a served page (tests driving a handler directly)."""
    if request is None:
        return None
    peer = request.client.host if getattr(request, "client", None) else None
    return client_address(request.headers or {}, peer, behind_proxy=True)
