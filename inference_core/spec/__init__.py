"""Speculative decoding: draft sources, verification (chains and trees) and the acceptance rule (`decoding`), and the
trained Medusa and EAGLE draft heads (`draft_heads`). Imports `model` and the root vocabulary; never the engine,
which builds a request's drafter from these."""
