"""What a person picks in a lane or in the chat, turned into engine settings, and the engines those settings need.

`LaneSettings` holds one configuration as the widgets give it (KV mode, block size, prefix cache, sampling,
speculative decoding) and turns it into an `EngineConfig`, `SamplingParams` and `SpecConfig`, so a bad value fails
with the engine's own `ConfigError` message; PAGE_WORDS names the page's controls in those messages. `EnginePool`
keeps one `Engine` per (slot, configuration) over the one loaded model (and the optional draft model, which every
engine gets for the 'draft' method): a lane's KV cache survives between races (so the prefix cache has something to
reuse) and two lanes never share one (so neither sees the other's cached prefixes); visitors with the same lane or
chat settings share that engine, and their requests are batched in its steps. The pool also holds what every run on
the device shares: the engine loop that owns the device (every request goes through it), the measured step costs
behind the estimate shown before a run, the limit on a run's device time, and which lane takes a race's first step.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from inference_core import ConfigError, Engine, EngineConfig, LoadedModel, SamplingParams, wake_device
from inference_core.cost import StepCosts
from inference_core.engine_loop import EngineLoop
from inference_core.quant import GROUP_SIZES, SCHEMES, QuantConfig, quantize
from inference_core.speculative import SpecConfig
from server.policy import CallerLimits, ServePolicy

KV_MODE_LABELS = {"paged": "paged KV cache", "contiguous": "contiguous KV cache", "none": "no KV cache (recompute)"}
BLOCK_SIZES = (4, 8, 16, 32)
SPEC_METHOD_LABELS = {"none": "none", "ngram": "prompt lookup", "early-exit": "early exit", "draft": "draft model",
                      "medusa": "Medusa heads (trained)", "eagle": "EAGLE layer (trained)"}
WEIGHTS_LABELS = {"none": "model dtype", "int8": "int8 per channel", "int4": "int4 per group",
                  "awq": "AWQ int4 per group (calibrated)"}
KV_DTYPE_LABELS = {"auto": "model dtype", "int8": "int8 + scale per token and head"}
MAX_WEIGHT_VARIANTS = 3  # quantized copies of the model kept at once (each lane may pick its own)
DEFAULT_LAYERS = "default"  # the early-exit depth widget's value for "the engine's default depth"
# The page's names for what a ConfigError tells the user to change (see inference_core.config.CLI_WORDS).
PAGE_WORDS = {"max_new_tokens": "'max new tokens'", "spec_k": "'draft length k'", "tree_width": "'tree width'",
              "draft_layers": "'early-exit draft layers'", "draft_model": "start the app with a draft model",
              "longer_context": ""}
DEFAULT_MAX_RUN_S = 180.0  # device time one race (both lanes) or one chat turn may take
SETTLE_S = 0.3  # see EnginePool.settle_before_timed_work


def _whole(value):
    """A widget's whole number as an int (sliders give 5.0); anything else unchanged, for the engine to refuse."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


@dataclass(frozen=True, slots=True)
class LaneSettings:
    kv_mode: str = "paged"
    block_size: int = 16
    prefix_cache: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = 0  # None: a fresh seed per request; the widget shows the same 0 the engine gets
    spec_method: str = "none"  # draft source: one of SPEC_METHOD_LABELS
    spec_k: int = 4  # draft length (where it starts when adaptive)
    spec_adaptive: bool = False
    spec_tree_width: int = 1  # Medusa / EAGLE, greedy: candidates verified per draft position (1: a chain)
    draft_layers: int | str | None = DEFAULT_LAYERS  # early exit only; DEFAULT_LAYERS (or None): the engine's default
    compile: bool = False  # decode steps through the compiled step (inference_core.compiled); needs a KV cache
    weights: str = "none"  # projections' quantization: one of WEIGHTS_LABELS (inference_core.quant)
    quant_group: int = 32  # int4 and AWQ: input features per scale and zero
    kv_dtype: str = "auto"  # KV cache storage: one of KV_DTYPE_LABELS
    sliding_window: int | None = 0  # attend to the last N tokens; 0 (or None): the checkpoint's own window, if any
    # An external OpenAI-compatible server (vLLM, SGLang, llama.cpp's server, this app's API elsewhere): the lane runs
    # there through `server.remote` instead of on this engine, and only the sampling settings above apply.
    endpoint: str = ""  # its URL; empty: this app's own engine
    endpoint_model: str = ""  # the model id to ask it for; empty: the first one it lists

    def engine_config(self, max_seq_len: int) -> EngineConfig:
        window = _whole(self.sliding_window) or None
        return EngineConfig(kv_mode=self.kv_mode, block_size=int(self.block_size), prefix_cache=bool(self.prefix_cache),
                            max_seq_len=max_seq_len, compile=bool(self.compile), kv_dtype=self.kv_dtype,
                            sliding_window=window)

    def quant(self) -> QuantConfig:
        return QuantConfig(self.weights or "none", _whole(self.quant_group))

    def sampling(self, max_new_tokens: int) -> SamplingParams:
        seed = None if self.seed in (None, "") else int(self.seed)
        return SamplingParams(max_new_tokens=int(max_new_tokens), temperature=float(self.temperature),
                              top_p=float(self.top_p), seed=seed)

    def spec(self) -> SpecConfig:
        """The speculative settings (raises ConfigError for a bad one). The early-exit depth is passed only with
        that method, so a value left in its hidden box cannot affect another draft source."""
        layers = self.draft_layers if self.spec_method == "early-exit" else None
        layers = None if layers in ("", DEFAULT_LAYERS) else layers
        method = self.spec_method or "none"
        return SpecConfig(method=method, k=_whole(self.spec_k), adaptive=bool(self.spec_adaptive),
                          draft_layers=_whole(layers),
                          tree_width=_whole(self.spec_tree_width) if method != "none" else 1)

    @property
    def external(self) -> bool:
        return bool((self.endpoint or "").strip())

    @property
    def greedy(self) -> bool:
        return float(self.temperature) == 0.0

    @property
    def speculates(self) -> bool:
        return not self.external and self.spec_method not in (None, "", "none")

    def describe(self) -> str:
        if self.external:
            model = f" ({self.endpoint_model})" if self.endpoint_model else ""
            sampling = "greedy" if self.greedy else \
                f"temperature {float(self.temperature):g}, top-p {float(self.top_p):g}"
            return f"external engine {self.endpoint.strip()}{model}, {sampling}"
        parts = [KV_MODE_LABELS.get(self.kv_mode, self.kv_mode)]
        if self.kv_mode == "paged":
            parts.append(f"block {int(self.block_size)}")
            parts.append("prefix cache" if self.prefix_cache else "no prefix cache")
        parts.append("greedy" if self.greedy
                     else f"temperature {float(self.temperature):g}, top-p {float(self.top_p):g}")
        if self.speculates:
            draft = SPEC_METHOD_LABELS.get(self.spec_method, self.spec_method)
            if self.spec_method == "early-exit" and self.draft_layers not in (None, "", DEFAULT_LAYERS):
                draft += f" ({_whole(self.draft_layers)} layers)"
            width = _whole(self.spec_tree_width)
            parts.append(f"{draft} k={_whole(self.spec_k)}" + (" adaptive" if self.spec_adaptive else "")
                         + (f" tree {width} wide" if width != 1 else ""))
        if self.compile:
            parts.append("compiled decode")
        if self.weights not in (None, "", "none"):
            parts.append(f"{self.quant().name} weights")
        if self.kv_dtype == "int8":
            parts.append("int8 KV")
        if _whole(self.sliding_window):
            parts.append(f"window {_whole(self.sliding_window)}")
        return ", ".join(parts)


class EnginePool:
    """Engines over one loaded model, by (slot, EngineConfig), least recently used dropped past `max_engines`.
    Every engine gets the optional `draft` model (its tokenizer is checked by the engine on construction). An engine
    dropped from the pool while it still serves requests finishes them (its requests and the loop hold it)."""

    def __init__(self, loaded: LoadedModel, max_seq_len: int | None = None, max_engines: int = 10,
                 draft: LoadedModel | None = None, max_run_s: float = DEFAULT_MAX_RUN_S,
                 policy: ServePolicy | None = None):
        self.loaded = loaded
        self.draft = draft
        self.max_seq_len = min(max_seq_len or 2048, loaded.config.max_position_embeddings)
        self.max_engines = max_engines
        self.engines: OrderedDict[tuple[str, EngineConfig, QuantConfig], Engine] = OrderedDict()
        self.weight_variants: OrderedDict[QuantConfig, LoadedModel] = OrderedDict()  # quantized copies, LRU
        self.perplexities: dict[tuple[QuantConfig, str], float] = {}  # the Stack tab's quality, by (weights, KV dtype)
        self.costs = StepCosts(loaded, self.max_seq_len)
        self.max_run_s = max_run_s
        # What this deployment lets callers do (caps, public mode) and each caller's use so far: page and API alike.
        self.policy = policy or ServePolicy()
        self.limits = CallerLimits(self.policy)
        self.races_started = 0
        self._lock = threading.Lock()  # `get` is called from the page's worker threads and the API's at once
        # The one thread that owns the device: every tab's requests go through it, batched per engine.
        self.loop = EngineLoop()

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
        """The weight settings this model can use: quantization on the CPU only, AWQ where a calibrated file
        exists."""
        if self.loaded.device.type != "cpu":
            return ["none"]
        from inference_core.awq_file import default_path

        return [scheme for scheme in SCHEMES
                if scheme != "awq" or any(default_path(self.loaded, group).exists() for group in GROUP_SIZES)]

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
        from inference_core.draft_heads import find_heads

        return [method for method in SPEC_METHOD_LABELS
                if (method != "draft" or self.draft is not None)
                and (method not in ("medusa", "eagle") or find_heads(self.loaded.name, self.loaded.config, method))]

    def check_draft_model(self) -> None:
        """Run one short speculative request with the draft model, which refuses an unusable one at start-up."""
        if self.draft is not None:
            engine = self._engine(EngineConfig(kv_mode="paged", max_seq_len=64))
            engine.complete("Hello", SamplingParams(max_new_tokens=4), spec=SpecConfig("draft", k=2))

    def estimate_s(self, settings: list[LaneSettings], prompt_tokens: int, new_tokens: int) -> list[float]:
        """Estimated device time of one request per lane (see `inference_core.cost`); an external lane uses none of
        this device."""
        return [0.0 if s.external else self.costs.request_seconds(s.kv_mode, prompt_tokens, new_tokens)
                for s in settings]

    def get(self, slot: str, settings: LaneSettings) -> Engine:
        key = (slot, settings.engine_config(self.max_seq_len), settings.quant())
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

    def needs_compiling(self, engine: Engine) -> bool:
        """Whether `engine` decodes compiled and has not compiled its batch-1 graph yet."""
        return engine.decoder is not None and not engine.decoder.ready(1)

    def compile(self, engine: Engine) -> float:
        """Compile `engine`'s batch-1 decode graph now, in the loop thread (the device is busy meanwhile); returns the
        seconds it took, which the race and the chat report apart from decode speed."""
        return self.loop.call(engine.warm_up_compiled)

    def active_requests(self) -> int:
        """Requests queued or running right now, over every engine (0 whenever nothing is generating)."""
        return sum(engine.num_requests() for engine in self.engines.values())

    def blocks_in_use(self) -> int:
        """KV blocks (paged) and slots (contiguous) held over every engine, the draft model's own caches included."""
        return sum(engine.blocks_in_use() for engine in self.engines.values())


def duration(seconds: float) -> str:
    """A device time as a person reads it: '40 s', 'about 3 minutes'."""
    if seconds < 90:
        return f"{seconds:.0f} s" if seconds >= 1 else f"{seconds:.1f} s"
    return f"{seconds / 60:.0f} minutes" if seconds % 60 == 0 else f"about {seconds / 60:.0f} minutes"


def waiting_note(pool: EnginePool, engines) -> str:
    """What a run that has had no event for a while is waiting for, and about how long, from the engine loop's
    measured step times: other configurations sharing the device (the loop alternates between them step by step),
    or a full batch on its own configuration (it waits for a running request to end)."""
    status = pool.loop.status()
    mine = set(engines)
    others = [s for s in status if s["engine"] not in mine]
    notes = []
    if others:
        requests = sum(s["waiting"] + s["running"] for s in others)
        steps = [s["mean_step_ms"] for s in others if s["mean_step_ms"]]
        took = f" (their steps take about {sum(steps) / len(steps):.0f} ms each, measured)" if steps else ""
        notes.append(f"The device is shared with {requests} other request{'s' if requests != 1 else ''} on "
                     f"{len(others)} other configuration{'s' if len(others) != 1 else ''}: the engine loop takes "
                     f"turns between configurations, step by step{took}.")
    for s in status:
        if s["engine"] in mine and s["waiting"] and s["running"] and s["mean_step_ms"]:
            wait_s = s["steps_until_a_slot"] * s["mean_step_ms"] / 1e3 * (1 + len(others))
            notes.append(f"This configuration's batch is full ({s['running']} requests run together); the next "
                         f"place frees in about {duration(wait_s)}, from its measured step time.")
    return " ".join(notes) or "Waiting for the device..."


def check_run_cost(pool: EnginePool, lanes: dict[str, LaneSettings], prompt_tokens: int, new_tokens: int,
                   what: str) -> list[float]:
    """Estimated device seconds of each lane's request (one request per lane, run one after another on the device);
    raises ConfigError, in the page's words, when together they exceed the pool's `max_run_s`."""
    estimates = pool.estimate_s(list(lanes.values()), prompt_tokens, new_tokens)
    if sum(estimates) <= pool.max_run_s:
        return estimates
    slowest = max(zip(lanes, estimates), key=lambda pair: pair[1])[0]
    here = [s.kv_mode for s in lanes.values() if not s.external]
    fits = pool.costs.most_new_tokens(here, prompt_tokens, pool.max_run_s, new_tokens)
    changes = [f"lower {{max_new_tokens}} to {fits} or less" if fits else "shorten the prompt"]
    why = ""
    if lanes[slowest].kv_mode == "none":
        why = ": with no KV cache, each new token recomputes the whole text"
        changes.append(f"give {'lane ' + slowest if len(lanes) > 1 else 'it'} a KV cache")
    whose = f" (lane {slowest} {duration(max(estimates))}{why})" if len(lanes) > 1 else why
    raise ConfigError(f"this {what} would hold the shared device for {duration(sum(estimates))}{whose}, over this "
                      f"app's limit of {duration(pool.max_run_s)} per {what}. To run it, "
                      f"{' or '.join(changes)}.")


def admit(pool: EnginePool, caller: str | None, prompt_tokens: int, new_tokens: int, requests: int = 1) -> None:
    """The deployment's caps on a page run (`pool.policy`) and the caller's own limits (`pool.limits`; in public mode
    a visitor's requests per minute and tokens per hour): a ConfigError in the page's words (a `LimitExceeded` says
    when to try again) instead of a run. `requests`: lanes running the prompt (a race has two)."""
    pool.policy.check_sizes(prompt_tokens, new_tokens)
    try:
        pool.limits.admit(caller or "local", requests * (prompt_tokens + new_tokens))
    except ConfigError as error:
        retry = getattr(error, "retry_after_s", None)
        raise ConfigError(str(error) + (f" Try again in {duration(retry)}." if retry else "")) from None


def external_lane(pool: EnginePool, settings: LaneSettings) -> tuple[str, str]:
    """(URL, model id) of an external lane: the URL checked against the deployment's policy (public mode: only the
    allowed ones), the model asked of the server when none was named. ConfigError with the reason otherwise."""
    from server.remote import list_models

    url = settings.endpoint.strip()
    pool.policy.check_endpoint(url)
    if settings.endpoint_model.strip():
        return url, settings.endpoint_model.strip()
    models = list_models(url)
    if not models:
        raise ConfigError(f"the external engine at {url} lists no models.")
    return url, models[0]
