"""The engine: `Engine` (one configuration over a loaded model: its scheduler, runner and KV cache, stepped request by
request), the `EngineLoop` thread that shares one device among many callers, the compiled decode step, and
`interleave` for racing requests from one thread. Imports `kv`, `model`, `spec` and the root vocabulary; never
`bench`, `training` or a front end."""
