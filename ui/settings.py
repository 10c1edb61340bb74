"""What a person picks in a lane or in the chat, turned into engine settings, and the engines those settings need.

`LaneSettings` holds one configuration as the widgets give it (KV mode, block size, prefix cache, sampling) and turns
it into an `EngineConfig` and `SamplingParams`, so a bad value fails with the engine's own `ConfigError` message.
`EnginePool` keeps one `Engine` per (slot, configuration) over the one loaded model: a lane's KV cache survives
between races (so the prefix cache has something to reuse) and two lanes never share one (so neither sees the
other's cached prefixes, and each contiguous cache serves one request).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from inference_core import Engine, EngineConfig, LoadedModel, SamplingParams

KV_MODE_LABELS = {"paged": "paged KV cache", "contiguous": "contiguous KV cache", "none": "no KV cache (recompute)"}
BLOCK_SIZES = (4, 8, 16, 32)


@dataclass(frozen=True, slots=True)
class LaneSettings:
    kv_mode: str = "paged"
    block_size: int = 16
    prefix_cache: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def engine_config(self, max_seq_len: int) -> EngineConfig:
        return EngineConfig(kv_mode=self.kv_mode, block_size=int(self.block_size), prefix_cache=bool(self.prefix_cache),
                            max_seq_len=max_seq_len)

    def sampling(self, max_new_tokens: int) -> SamplingParams:
        seed = None if self.seed in (None, "") else int(self.seed)
        return SamplingParams(max_new_tokens=int(max_new_tokens), temperature=float(self.temperature),
                              top_p=float(self.top_p), seed=seed)

    @property
    def greedy(self) -> bool:
        return float(self.temperature) == 0.0

    def describe(self) -> str:
        parts = [KV_MODE_LABELS.get(self.kv_mode, self.kv_mode)]
        if self.kv_mode == "paged":
            parts.append(f"block {int(self.block_size)}")
            parts.append("prefix cache" if self.prefix_cache else "no prefix cache")
        parts.append("greedy" if self.greedy else f"temperature {float(self.temperature):g}, top-p {float(self.top_p):g}")
        return ", ".join(parts)


class EnginePool:
    """Engines over one loaded model, by (slot, EngineConfig), least recently used dropped past `max_engines`.
    Callers run one request at a time per engine (the app's queue runs one generation at a time)."""

    def __init__(self, loaded: LoadedModel, max_seq_len: int | None = None, max_engines: int = 6):
        self.loaded = loaded
        self.max_seq_len = min(max_seq_len or 2048, loaded.config.max_position_embeddings)
        self.max_engines = max_engines
        self.engines: OrderedDict[tuple[str, EngineConfig], Engine] = OrderedDict()

    def warm_up(self) -> None:
        """One short untimed request per KV mode, so the first race does not pay one-time start-up costs."""
        for kv_mode in ("contiguous", "paged", "none"):
            engine = Engine(self.loaded, EngineConfig(kv_mode=kv_mode, max_seq_len=64))
            engine.complete("Hello", SamplingParams(max_new_tokens=4))

    def get(self, slot: str, settings: LaneSettings) -> Engine:
        key = (slot, settings.engine_config(self.max_seq_len))
        if key in self.engines:
            self.engines.move_to_end(key)
            return self.engines[key]
        # Idle engines only: a slot's previous engine is never in use while a new request for that slot starts.
        while len(self.engines) >= self.max_engines:
            self.engines.popitem(last=False)
        engine = self.engines[key] = Engine(self.loaded, key[1])
        return engine

    def active_requests(self) -> int:
        """Requests holding KV memory right now, over every engine (0 whenever nothing is generating)."""
        return sum(len(engine.active) for engine in self.engines.values())

    def blocks_in_use(self) -> int:
        return sum(engine.kv_cache.manager.num_used_blocks for engine in self.engines.values()
                   if engine.config.kv_mode == "paged")
