"""Serving the engine beyond the page: the OpenAI-compatible HTTP API (`openai_api`), Prometheus metrics (`metrics`),
the deployment's caps and public mode (`policy`), and the one FastAPI app that serves them with the Gradio page
(`app`)."""
