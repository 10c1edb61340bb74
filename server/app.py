"""One FastAPI app on one port: the OpenAI-compatible API (`server.openai_api`), vLLM's tokenizer endpoints
(`server.tokenizer_api`), `/health`, `/metrics`, and the Gradio playground mounted at `/`. `python app.py` serves
it with uvicorn; tests serve it in-process (`serve_in_thread`)."""

from __future__ import annotations

import threading
import time

import gradio as gr
import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from server.metrics import Metrics
from server.openai_api import OpenAIAPI
from server.tokenizer_api import TokenizerAPI


def create_app(demo: gr.Blocks, pool) -> FastAPI:
    """The API routes first (they win over the mounted page), then the Gradio app at `/`. The pool's engine loop
    reports every request to the metrics, the page's included."""
    app = FastAPI(title="Inference Playground", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = Metrics(pool)
    pool.loop.add_observer(metrics.observe)
    api = OpenAIAPI(pool, metrics)
    app.include_router(api.router)
    app.include_router(TokenizerAPI(api).router)
    app.state.api, app.state.metrics = api, metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, error):  # FastAPI's own validation (none of our routes declare a model; kept as a guard)
        return JSONResponse({"error": {"message": str(error), "type": "invalid_request_error", "param": None,
                                       "code": None}}, status_code=400)

    return gr.mount_gradio_app(app, demo, path="/")


class serve_in_thread:
    """Serve `app` on host:port from a background thread (tests and scripts); `stop()` shuts it down."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        sock = self.server.servers[0].sockets[0]
        self.url = f"http://{host}:{sock.getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
