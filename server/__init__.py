"""The HTTP front end: the OpenAI-compatible API (`openai_api`), Prometheus metrics (`metrics`), the one FastAPI app
that serves them with the Gradio page (`app`), and a load test (`load_test`). It stands on `serving` and
`inference_core` and never imports `ui` (the page is handed to `app.create_app` already built)."""
