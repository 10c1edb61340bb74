"""Benchmarks and measurements, each a command that prints a table and writes JSON: `bench` (`speed`), `batch-bench`
(`batching`), `spec-bench` (`speculation`), `race`, `quality`, the llama.cpp peer and the compile options; plus the
benchmark prompts. Imports anything in `inference_core`; nothing in the engine imports it back."""
