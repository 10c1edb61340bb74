"""inference_core: a small LLM inference engine for the Llama family, with every optimization behind a switch. It
imports no front end and not the runtime above it (`serving`, `ui`, `server`): a script, the CLI and the tests use it
alone.

Typical use:

    from inference_core import Engine, EngineConfig, SamplingParams, load_model
    engine = Engine(load_model("bundled"), EngineConfig(kv_mode="paged"))
    for event in engine.generate("Why is the sky blue?", SamplingParams(max_new_tokens=64)):
        ...  # TokenEvent per token, then one FinishEvent with stats

Several requests at once share the engine's steps (continuous batching): `engine.submit(...)` each, then
`engine.step()` until `engine.has_work()` is false; from several threads, `inference_core.engine.loop.EngineLoop`.
"""

from inference_core.config import ConfigError, EngineConfig, ModelConfig
from inference_core.engine.engine import Engine, StepReport
from inference_core.engine.request import FinishEvent, GenerationStats, StopGeneration, TokenEvent
from inference_core.engine.runner import wake_device
from inference_core.model.loader import LoadedModel, load_model
from inference_core.sampling import SamplingParams

__all__ = ["ConfigError", "Engine", "EngineConfig", "FinishEvent", "GenerationStats", "LoadedModel", "ModelConfig",
           "SamplingParams", "StepReport", "StopGeneration", "TokenEvent", "load_model", "wake_device"]
