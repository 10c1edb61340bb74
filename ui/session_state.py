"""A fix for Gradio 6.31's per-session state, which otherwise grows with every streamed update (found by the soak
test, `python -m server.soak`: about 10 MiB a minute with three visitors).

Gradio keeps a copy of the page's components per session. An update that changes anything but a value (a property,
or `gr.skip()`, which Gradio treats the same way) replaces the session's copy of that output with a new component
instance, stored under the output's id; the new instance gets a fresh id of its own. The next plain value sent to the
same output looks the output up in the session, gets the replacement, and (served, where the replacement's id is
new) stores it again under the replacement's own id (`Blocks.postprocess_data`: `if block._id not in state: state[block._id] = block`). The session then holds
that instance forever, under a key nothing reads, and every race, chat turn and lab run adds a few (measured over ten
races: about 10 HTML, 3 Plot, 3 DataFrame and 1 Markdown instance each, with their configurations). Giving a
replacement the id it stands for makes the lookup find it where it already is.
"""

from __future__ import annotations

from gradio.blocks import Block
from gradio.state_holder import SessionState


def keep_replacement_ids() -> None:
    """Patch `SessionState.__setitem__` (once per process) so that a component stored under an output's id carries
    that id."""
    store = SessionState.__setitem__
    if getattr(store, "keeps_replacement_ids", False):
        return

    def set_item(self: SessionState, key: int, value) -> None:
        if isinstance(value, Block) and not value.stateful:
            value._id = key  # a replacement instance stands for output `key`, never for an id of its own
        store(self, key, value)

    set_item.keeps_replacement_ids = True
    SessionState.__setitem__ = set_item
