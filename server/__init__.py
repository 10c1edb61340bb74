"""The HTTP front end: the OpenAI-compatible API (`openai_api`), Prometheus metrics (`metrics`), the one FastAPI app
that serves them with the Gradio page (`app`), a load test of the API (`load_test`) and a soak test of page and API
together (`soak`). It stands on `serving` and `inference_core` and never imports `ui` (the page is handed to
`app.create_app` already built; the soak starts `python app.py` in a process of its own)."""
