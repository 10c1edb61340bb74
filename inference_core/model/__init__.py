"""The model and how it is loaded: our Llama-family forward (`llama`), checkpoints and the bundled GGUF, the tokenizer,
random-weight checkpoints for benchmarks, the dtype `--dtype auto` picks (`dtype_choice`), and where files and caches
live (`paths`). Imports the root vocabulary and
`kv` (the forward takes its cache as an argument); never the engine."""
