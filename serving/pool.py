"""The engines behind the page and the API, over the one loaded model, and what every run on the device shares.

`EnginePool` keeps one `Engine` per (slot, configuration) over the loaded model (and the optional draft model, which
every engine gets for the 'draft' method): a race lane's KV cache survives between races (so the prefix cache has
something to reuse) and two lanes never share one (so neither sees the other's cached prefixes); visitors with the
same lane or chat settings share that engine, and their requests are batched in its steps (the API shares the
chat's slot). The pool also holds what every run on the device shares: the engine loop that owns the device (every
request goes through it), the measured step costs behind the estimate shown before a run, the deployment's caps and
per-caller limits, the limit on a run's device time, and which lane takes a race's first step. `submit` is the one
way in (`serving.admission`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import replace

from inference_core.bench.profile import profile_requests, tokens_needed
from inference_core.config import EngineConfig
from inference_core.engine.engine import Engine
from inference_core.engine.loop import EngineLoop
from inference_core.engine.precompile import build_all
from inference_core.engine.runner import wake_device
from inference_core.model.loader import LoadedModel
from inference_core.quant.calibrated_file import default_path
from inference_core.quant.kernels import DEVICES as QUANT_DEVICES
from inference_core.quant.linear import CALIBRATED, GROUP_SIZES, SCHEMES, QuantConfig
from inference_core.planner import engine_figures, plan_memory
from inference_core.quant.quantize import quantize
from inference_core.roofline import Ceilings, measure_ceilings
from inference_core.sampling import SamplingParams
from inference_core.settings import SPEC_METHOD_LABELS, LaneSettings
from inference_core.spec.decoding import SpecConfig
from inference_core.spec.draft_heads import find_heads
from serving.admission import Job, Run, admit
from serving.build import ServingBuild, child_command, precompile_arguments
from serving.cost import StepCosts
from serving.policy import CallerLimits, ServePolicy

MAX_WEIGHT_VARIANTS = 3  # quantized copies of the model kept at once (each lane may pick its own)
DEFAULT_MAX_RUN_S = 180.0  # device time one race (both lanes) or one chat turn may take
SETTLE_S = 0.3  # see EnginePool.settle_before_timed_work
PROFILE_WARMUP_STEPS = 3  # steps a profile lets pass after every request's first token before it records


class EnginePool:
    """Engines over one loaded model, by (slot, EngineConfig), least recently used dropped past `max_engines`.
    Every engine gets the optional `draft` model (its tokenizer is checked by the engine on construction). An engine
    dropped from the pool while it still serves requests finishes them (its requests and the loop hold it)."""

    def __init__(self, loaded: LoadedModel, max_seq_len: int | None = None, max_engines: int = 10,
                 draft: LoadedModel | None = None, max_run_s: float = DEFAULT_MAX_RUN_S,
                 policy: ServePolicy | None = None, serving: LaneSettings | None = None):
        self.loaded = loaded
        # The chat's and the API's default settings (`serving.build.serving_settings`), and the background build of
        # their compiled steps while the pool serves them eager (`build_serving`).
        self.serving = serving or LaneSettings(kv_mode="paged")
        self.build: ServingBuild | None = None
        self.draft = draft
        self.max_seq_len = min(max_seq_len or 2048, loaded.config.max_position_embeddings)
        self.max_engines = max_engines
        self.engines: OrderedDict[tuple[str, EngineConfig, QuantConfig], Engine] = OrderedDict()
        self.weight_variants: OrderedDict[QuantConfig, LoadedModel] = OrderedDict()  # quantized copies, LRU
        self.perplexities: dict[tuple[QuantConfig, str], float] = {}  # the Stack tab's quality, by (weights, KV dtype)
        self.max_run_s = max_run_s
        # What this deployment lets callers do (caps, public mode) and each caller's use so far: page and API alike.
        self.policy = policy or ServePolicy()
        self.limits = CallerLimits(self.policy)
        self.races_started = 0
        self._lock = threading.Lock()  # `get` is called from the page's worker threads and the API's at once
        # The one thread that owns the device: every tab's requests go through it, batched per engine.
        self.loop = EngineLoop()
        # Cost estimates: probed on the device between the loop's steps, then learned from the steps themselves.
        self.costs = StepCosts(loaded, self.max_seq_len, on_device=self.loop.call)
        self.loop.add_step_observer(self.costs.observe)

    def _engine(self, config: EngineConfig, quant: QuantConfig = QuantConfig()) -> Engine:
        return Engine(self.weights(quant), config, draft_model=self.draft)

    def weights(self, quant: QuantConfig) -> LoadedModel:
        """The model with `quant`'s projections: the loaded model itself, or a quantized copy sharing its other
        tensors, made on first use (seconds on a small model) and kept while lanes use it."""
        if quant.scheme == "none":
            return self.loaded
        if quant not in self.weight_variants:
            while len(self.weight_variants) >= MAX_WEIGHT_VARIANTS:
                self.weight_variants.popitem(last=False)  # engines still using it keep it alive
            self.weight_variants[quant] = quantize(self.loaded, quant)
        self.weight_variants.move_to_end(quant)
        return self.weight_variants[quant]

    def weight_schemes(self) -> list[str]:
        """The weight settings this model can use: quantization on the CPU and on CUDA (the devices with weight-only
        kernels), AWQ and GPTQ where a calibrated file exists."""
        if self.loaded.device.type not in QUANT_DEVICES:
            return ["none"]
        return [scheme for scheme in SCHEMES
                if scheme not in CALIBRATED
                or any(default_path(self.loaded, group, scheme).exists() for group in GROUP_SIZES)]

    def first_lane(self) -> str:
        """The lane that takes the next race's first step: A and B take turns, so neither always meets whatever a
        first step still costs (the browser drawing the race's first update on the same CPU, for one)."""
        self.races_started += 1
        return "AB"[(self.races_started - 1) % 2]

    def settle_before_timed_work(self) -> None:
        """Just before a race's or a chat turn's first step, untimed: wait SETTLE_S while the page and the server
        finish reacting to the click on the same CPU, then wake the device with one forward (`wake_device`).
        Measured in Chromium on a 2-core machine, 16 races per setting (default race, 32 tokens): without either,
        the lane taking the first step had a TTFT 30-45 ms longer than when it took the second (lane A's TTFT is
        about 130 ms, lane B's about 250); with both, 13-17 ms longer for lane A and no longer for lane B."""
        time.sleep(SETTLE_S)
        self.loop.call(wake_device, self.loaded)  # between the loop's steps: never on top of another visitor's

    def spec_methods(self) -> list[str]:
        """The draft sources this model can use: a draft model only where the app has one, trained heads only where
        a heads file for this model exists (shipped for the bundled model, or written by train-draft)."""
        return [method for method in SPEC_METHOD_LABELS
                if (method != "draft" or self.draft is not None)
                and (method not in ("medusa", "eagle") or find_heads(self.loaded.name, self.loaded.config, method))]

    def check_draft_model(self) -> None:
        """Run one short speculative request with the draft model, which refuses an unusable one at start-up."""
        if self.draft is not None:
            engine = self._engine(EngineConfig(kv_mode="paged", max_seq_len=64))
            engine.complete("Hello", SamplingParams(max_new_tokens=4), spec=SpecConfig("draft", k=2))

    def estimate_s(self, settings: list[LaneSettings], prompt_tokens: int, new_tokens: int) -> list[float]:
        """Estimated device time of one request per lane (see `serving.cost`); an external lane uses none of
        this device."""
        return [0.0 if s.external else self.costs.request_seconds(s.kv_mode, prompt_tokens, new_tokens)
                for s in settings]

    def build_serving(self) -> None:
        """Build the serving settings' compiled steps in a process of their own (`serving.build`), the pool serving
        them eager meanwhile; once built, load them here between the loop's steps, one batch bucket at a time."""
        if not self.serving.compile or self.build is not None:
            return
        command = child_command(precompile_arguments(self.loaded, self.serving, self.max_seq_len))

        def load() -> None:  # admission still runs the eager twin until this returns
            build_all(self.get("chat", self.serving), self.loop.call)

        self.build = ServingBuild(command, load)

    def runnable(self, settings: LaneSettings) -> LaneSettings:
        """`settings`, or while the serving settings' compiled steps are still being built (or failed to build),
        the same settings eager where they are the serving settings: a turn or request does not wait minutes."""
        if self.build is None or self.build.state == "ready" or not settings.compile or settings.external:
            return settings
        if self._engine_key(settings) != self._engine_key(self.serving):
            return settings
        return replace(settings, compile=False)

    def serving_note(self, settings: LaneSettings) -> str:
        """Where `settings` are the serving settings eager and their compiled steps are not loaded yet: the build's
        state in words; otherwise ""."""
        if self.build is None or settings.compile or \
                self._engine_key(settings) != self._engine_key(replace(self.serving, compile=False)):
            return ""
        return self.build.note()

    def serving_state(self) -> dict:
        """The serving engine in words and its compiled steps' build: building, ready, failed, or None (no build:
        eager settings, or compiled ones that compile on first use)."""
        return {"engine": self.serving.describe(), "build": self.build.state if self.build is not None else None}

    def _engine_key(self, settings: LaneSettings) -> tuple[EngineConfig, QuantConfig]:
        return settings.engine_config(self.max_seq_len), settings.quant()

    def get(self, slot: str, settings: LaneSettings) -> Engine:
        key = (slot, *self._engine_key(settings))
        with self._lock:
            return self._get(key)

    def _get(self, key) -> Engine:
        if key in self.engines:
            self.engines.move_to_end(key)
            return self.engines[key]
        # Idle engines only: a slot's previous engine is never in use while a new request for that slot starts.
        while len(self.engines) >= self.max_engines:
            self.engines.popitem(last=False)
        engine = self.engines[key] = self._engine(key[1], key[2])
        return engine

    def submit(self, job: Job) -> Run:
        """Admit `job` (the engines, its requests made and checked, every cap and limit) and return the `Run` that
        starts and tracks it; a ConfigError (a `LimitExceeded` when waiting helps) says why not."""
        return admit(self, job)

    def needs_compiling(self, engine: Engine, spec: SpecConfig | None = None) -> bool:
        """Whether `engine` decodes compiled and has not compiled its batch-1 graph yet, or the query steps that
        requests with `spec` verify through."""
        return engine.decoder is not None and not all(
            engine.decoder.ready(1, queries) for queries in (0, *engine.compiled_queries(spec)))

    def compile(self, engine: Engine, spec: SpecConfig | None = None) -> float:
        """Compile `engine`'s batch-1 decode graph (and the query steps of `spec`) now, in the loop thread (the device
        is busy meanwhile); returns the seconds it took, which the race and the chat report apart from decode
        speed."""
        return self.loop.call(engine.warm_up_compiled, (1,), spec)

    def plan(self, settings: LaneSettings, context_len: int, engine: Engine | None = None) -> dict:
        """The memory plan of a lane's settings on this pool's model for sequences of `context_len` tokens
        (`inference_core.planner`), with what `engine` (the lane's, when it ran) allocated beside it."""
        plan = plan_memory(self.loaded, settings.engine_config(self.max_seq_len), settings.quant(), context_len)
        return {"plan": plan.as_dict(), "engine": engine_figures(engine) if engine is not None else None}

    def profile(self, config: EngineConfig, quant: QuantConfig, prompts: list[list[int]], params: SamplingParams,
                steps: int, trace: str, spec: SpecConfig | None = None) -> dict:
        """Where a step's time goes (`inference_core.bench.profile`): a fresh engine with `config` (not one that
        serves visitors) takes `prompts` at once with `params`, lengthened to outlast the recording, and `steps` of
        its steps are recorded with the torch profiler in the loop thread, the device its own meanwhile. Returns the
        profile's report; the steps' Chrome trace goes to `trace`."""
        engine = self._engine(config, quant)
        params = replace(params, max_new_tokens=tokens_needed(steps, PROFILE_WARMUP_STEPS), ignore_eos=True)
        requests = [engine.make_request(list(ids), params, spec=spec) for ids in prompts]
        return self.loop.call(profile_requests, engine, requests, steps, PROFILE_WARMUP_STEPS, trace)

    def ceilings(self) -> Ceilings:
        """The device's roofline ceilings in the model's dtype (measured once per host and kept; the probe runs
        between the engine loop's steps, alone on the device)."""
        return self.loop.call(measure_ceilings, self.loaded.device, self.loaded.dtype)

    def active_requests(self) -> int:
        """Requests queued or running right now, over every engine (0 whenever nothing is generating)."""
        return sum(engine.num_requests() for engine in self.engines.values())

    def blocks_in_use(self) -> int:
        """KV blocks (paged) and slots (contiguous) held over every engine, the draft model's own caches included."""
        return sum(engine.blocks_in_use() for engine in self.engines.values())
