"""The Gradio playground over `inference_core`: layout builders (`layout`), streaming handlers (`race`, `chat`),
the API for programs (`api`), plotly figures (`figures`) and the KV pool picture (`kv_view`). UI code sees only plain
values from the engine."""

from ui.layout import build_demo, warm_up

__all__ = ["build_demo", "warm_up"]
