"""The Gradio page: layout builders (`layout`, `lane_widgets`), streaming handlers (`race`, `chat`, `batching`,
`stack`), the API for programs (`api`), plotly figures and the KV pool picture. It stands on `serving` and
`inference_core`, sees only plain values from the engine, and never imports `server`."""

from ui.layout import build_demo, warm_up

__all__ = ["build_demo", "warm_up"]
