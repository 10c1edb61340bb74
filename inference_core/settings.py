"""The lane settings, declared once: the switches a person flips for one configuration (KV cache, sampling,
speculative decoding, compiled decode, weights, KV dtype, sliding window, an external engine), each with its type,
default, choices or bounds, when it applies, and its words on the page, in the API and on the command line.

`LaneSettings` is that table: every field carries a `Setting` (`SETTINGS` lists them in order), and what each surface
offers is derived from it: the page's widgets and their enabling (`ui.layout`), the API's extra body fields
(`server.openai_api`), `generate`'s flags (`add_setting_arguments`, `from_args`) and the command that reproduces a
configuration (`command_flags`). `engine_config`, `quant`, `sampling` and `spec` map a lane onto the engine's own
settings, which check every value, so a bad one fails with the engine's `ConfigError`; `words(surface)` names each
setting the way that surface's refusals quote it. Adding a setting means a field here and the code that implements
it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Callable

from inference_core.config import ATTENTIONS, KV_DTYPES, KV_MODES, MAX_DECODE_STEPS, ConfigError, EngineConfig
from inference_core.quant.linear import ACTIVATIONS, GROUP_SIZES, INT4_SCHEMES, SCHEMES, QuantConfig
from inference_core.sampling import SamplingParams
from inference_core.spec.decoding import HIDDEN_READERS, MAX_K, MAX_TREE_WIDTH, SPEC_METHODS, SpecConfig
from inference_core.structured import KINDS as CONSTRAINT_KINDS
from inference_core.structured import Constraint

BLOCK_SIZES = (4, 8, 16, 32)
DEFAULT_LAYERS = "default"  # draft_layers' value for "the engine's default depth" (a widget needs a value for it)
AUTO = "auto"  # spec_k's and spec_tree_width's value for "the best measured for the source on this setup"
KV_MODE_LABELS = {"paged": "paged KV cache", "contiguous": "contiguous KV cache", "none": "no KV cache (recompute)"}
SPEC_METHOD_LABELS = {"none": "none", "ngram": "prompt lookup", "early-exit": "early exit", "draft": "draft model",
                      "medusa": "Medusa heads (trained)", "eagle": "EAGLE layer (trained)"}
WEIGHTS_LABELS = {"none": "model dtype", "int8": "int8 per channel", "int4": "int4 per group",
                  "awq": "AWQ int4 per group (calibrated)", "gptq": "GPTQ int4 per group (calibrated)"}
ACTIVATIONS_LABELS = {"model": "model dtype", "int8": "int8 (int4 weights: per block of 32; int8: per token)"}
KV_DTYPE_LABELS = {"auto": "model dtype", "int8": "int8 + scale per token and head",
                   "int4": "int4: keys per channel, values per token (newest block in the model dtype)"}
ATTENTION_LABELS = {"gather": "gather a copy (reference)", "flex": "FlexAttention through the block table"}
CONSTRAINT_LABELS = {"none": "no constraint", "json_object": "any JSON object", "json_schema": "a JSON schema",
                     "regex": "a regular expression", "choice": "one of a list of choices"}
UNSET = object()  # a Setting's flag_default or off_value that was not given


@dataclass(frozen=True)
class Setting:
    """How one lane setting appears on each surface and when it applies."""

    label: str  # the page's label; the page's refusals quote it
    widget: str  # the page's control: radio, dropdown, checkbox, slider, number or text
    info: str = ""  # a line under the page's control (a surface with more to say about this model adds it there)
    choices: tuple = ()  # the values offered (the API refuses others the engine would take)
    labels: dict | None = None  # choice -> the page's words for it
    bounds: tuple[float, float, float] | None = None  # slider or number: (low, high, step)
    kinds: tuple[type, ...] = ()  # the API's accepted JSON types (default: the default value's type)
    api: str | None = "extra"  # "extra": a playground body field; "openai": read from OpenAI's own field; None: none
    flag: str | None = None  # `generate`'s flag (a bool defaulting to True gets --no-<flag>); None: not on the CLI
    flag_default: object = UNSET  # the CLI's default where it differs from the page's
    help: str = ""  # the flag's help
    # When the setting does something: (another setting, values of it); outside them the page disables the control
    # (`hidden`: hides it) and sets it to `off_value` where one is given.
    applies: tuple[str, Callable[[object], bool]] | None = None
    hidden: bool = False
    off_value: object = UNSET
    # Whether the command that reproduces a lane names this setting whenever its switch (`applies`) is on, as a
    # detail of it (int4's group size), or only where it differs from its default.
    detail: bool = True


def _setting(default, **declared) -> field:
    return field(default=default, metadata={"setting": Setting(**declared)})


def _one_of(*values) -> Callable[[object], bool]:
    return lambda value: value in values


def _sampling(temperature) -> bool:
    try:
        return float(temperature or 0) > 0
    except (TypeError, ValueError):
        return False


def _left_open(value) -> bool:
    """Whether a setting with a "best measured" choice (`AUTO`) leaves its value to the engine."""
    return value in (None, "", AUTO)


def _whole(value):
    """A widget's whole number as an int (sliders give 5.0); anything else unchanged, for the engine to refuse."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


WITH_KV_CACHE = ("kv_mode", _one_of("contiguous", "paged"))
SPECULATING = ("spec_method", lambda method: method not in (None, "", "none"))


@dataclass(frozen=True, slots=True)
class LaneSettings:
    kv_mode: str = _setting(
        "paged", label="KV cache", widget="radio", choices=KV_MODES[::-1], labels=KV_MODE_LABELS, flag="kv",
        help="KV cache mode (default: paged)")
    block_size: int = _setting(
        16, label="block size (paged)", widget="dropdown", choices=BLOCK_SIZES, flag="block-size",
        help="paged KV block size in tokens", applies=("kv_mode", _one_of("paged")))
    prefix_cache: bool = _setting(
        True, label="prefix cache (paged)", widget="checkbox", flag="prefix-cache",
        help="paged: do not reuse cached prefixes", applies=("kv_mode", _one_of("paged")))
    temperature: float = _setting(
        0.0, label="temperature (0 = greedy)", widget="slider", bounds=(0.0, 1.5, 0.05), api="openai",
        flag="temperature", help="0 is greedy")
    top_p: float = _setting(
        1.0, label="top-p (when sampling)", widget="slider", bounds=(0.05, 1.0, 0.05), api="openai", flag="top-p",
        help="1 is off", applies=("temperature", _sampling))
    seed: int | None = _setting(  # None: a fresh seed per request; the page shows the 0 the engine gets
        0, label="seed (when sampling)", widget="number", api="openai", flag="seed", flag_default=None,
        applies=("temperature", _sampling))
    min_p: float = _setting(
        0.0, label="min-p (when sampling)", widget="slider", bounds=(0.0, 0.5, 0.01), api="openai", flag="min-p",
        help="drop tokens less likely than min-p x the likeliest one (0 is off)", applies=("temperature", _sampling))
    repetition_penalty: float = _setting(
        1.0, label="repetition penalty", widget="slider", bounds=(0.5, 2.0, 0.05), api="openai",
        info="divides a positive logit (multiplies a negative one) of every token already in the prompt or output",
        flag="repetition-penalty", help="divide the positive logits (multiply the negative ones) of tokens already "
                                        "in the prompt or output (1 is off)")
    presence_penalty: float = _setting(
        0.0, label="presence penalty", widget="slider", bounds=(-2.0, 2.0, 0.1), api="openai",
        flag="presence-penalty", help="subtract from the logits of tokens already generated (0 is off)")
    frequency_penalty: float = _setting(
        0.0, label="frequency penalty", widget="slider", bounds=(-2.0, 2.0, 0.1), api="openai",
        flag="frequency-penalty", help="subtract from a generated token's logit once per time it occurred (0 is off)")
    logit_bias: str = _setting(
        "", label="logit bias (token id: bias, ...)", widget="text", api=None,
        info="e.g. 30:-100, 2:5 adds -100 to token 30's logit and 5 to token 2's", flag="logit-bias",
        help="add a bias to token ids' logits: 'id:bias,id:bias' (bias -100 to 100)")
    constraint: str = _setting(
        "none", label="constrain the output", widget="dropdown", choices=("none", *CONSTRAINT_KINDS),
        labels=CONSTRAINT_LABELS, api=None, flag="constraint",
        help="constrain the output to any JSON object, a JSON schema, a regular expression or a list of choices "
             "(--constraint-spec gives the schema, pattern or choices)")
    constraint_spec: str = _setting(
        "", label="constraint: the JSON schema, the pattern, or the choices separated by |", widget="text", api=None,
        flag="constraint-spec", help="--constraint json_schema: the schema as JSON; regex: the pattern; choice: the "
                                     "choices separated by |",
        applies=("constraint", _one_of("json_schema", "regex", "choice")), hidden=True)
    spec_method: str = _setting(
        "none", label="speculative decoding: draft source", widget="radio", choices=SPEC_METHODS,
        labels=SPEC_METHOD_LABELS, flag="spec",
        help="speculative decoding draft source: ngram = prompt lookup, early-exit = the model's first "
             "--draft-layers layers, draft = --draft-model, medusa / eagle = trained draft heads (shipped for the "
             "bundled model; others: train-draft, or --draft-heads)")
    spec_k: int | str = _setting(  # where it starts when adaptive; AUTO: the best measured for the source
        AUTO, label="draft length k", widget="dropdown", choices=(AUTO, *range(1, MAX_K + 1)),
        labels={AUTO: "best measured"}, kinds=(int, str), flag="spec-k", flag_default=None,
        info="best measured: the k that decoded fastest for this draft source on this host and setup "
             "(`spec-bench --keep`), else the project's measurement",
        help="draft length k (where adaptive k starts; default: the k measured fastest for the source on this host "
             "and setup, kept by `spec-bench --keep`, else the project's measurement)", applies=SPECULATING,
        hidden=True)
    spec_adaptive: bool = _setting(
        False, label="adaptive k", widget="checkbox", flag="spec-adaptive",
        help="adapt k: longer after a fully accepted draft, shorter after an early rejection", applies=SPECULATING,
        hidden=True)
    spec_tree_width: int | str = _setting(  # a tree needs ranked candidates: for other sources it goes back to a chain
        AUTO, label="tree width", widget="dropdown", choices=(AUTO, *range(1, MAX_TREE_WIDTH + 1)),
        labels={AUTO: "best measured"}, kinds=(int, str), flag="spec-tree-width", flag_default=None,
        info="greedy: each position's next-best tokens as leaves beside the chain, verified in the same forward (1: "
             "a chain; best measured: the width that decoded fastest for this source on this host and setup, "
             "`spec-bench --keep`, else the project's measurement; sampling verifies a chain)",
        help="medusa, eagle, greedy: verify a tree with this many candidates per draft position (the best ones "
             "chained, the others as leaves beside them; 1: a chain; default: the width measured fastest for the "
             "source on this host and setup, kept by `spec-bench --keep`, else the project's measurement, and a "
             "chain when sampling)",
        applies=("spec_method", _one_of(*HIDDEN_READERS)), hidden=True, off_value=AUTO)
    spec_tree_prune: bool = _setting(
        True, label="prune the tree by the drafter's confidence", widget="checkbox", flag="spec-tree-prune",
        info="a tree's next level only where the chain's draft probabilities hold at least even odds, a next-best "
             "token only at 5% or more (EAGLE-2's dynamic tree); off: every level and candidate",
        help="medusa, eagle trees: verify every level and candidate (by default a tree drafts its next level only "
             "where the chain's draft probabilities hold at least even odds, and keeps a next-best token only at "
             "5%% or more)",
        applies=("spec_method", _one_of(*HIDDEN_READERS)), hidden=True)
    draft_layers: int | str | None = _setting(  # DEFAULT_LAYERS (or None): the engine's default depth
        DEFAULT_LAYERS, label="early-exit draft layers", widget="dropdown", kinds=(int, str), flag="draft-layers",
        flag_default=None, help="early-exit: layers the draft runs (default: half)",
        applies=("spec_method", _one_of("early-exit")), hidden=True)
    compile: bool = _setting(
        False, label="compiled decode", widget="checkbox",
        info="needs a KV cache; compiles once per configuration and batch size (1-2 minutes on a CPU), kept on disk "
             "for the next start", flag="compile",
        help="decode steps through torch.compile (contiguous or paged KV; the first decode step at each batch size "
             "compiles first, 1-2 minutes on a CPU)", applies=WITH_KV_CACHE, off_value=False)
    decode_steps: int = _setting(
        1, label="decode steps per host round trip (compiled)", widget="slider", bounds=(1, MAX_DECODE_STEPS, 1),
        info="greedy: up to N compiled decode steps back to back, each step's token fed to the next on the device, "
             "the tokens read once after them; the host's work between steps (scheduling, sampling, streaming) then "
             "stops holding up a GPU, and tokens stream N at a time", flag="decode-steps",
        help="compiled decode, greedy: run up to N decode steps back to back, each step's token fed to the next on "
             "the device, and read the tokens once after them (1: every step; none runs while a request waits to "
             "be admitted)", applies=("compile", bool), off_value=1)
    weights: str = _setting(
        "none", label="weights", widget="dropdown", choices=SCHEMES, labels=WEIGHTS_LABELS, flag="quant",
        help="weight-only quantization of the projections: int8 per output channel, int4 per group, awq: int4 per "
             "group after activation-aware scaling, gptq: int4 per group with each column's rounding error "
             "compensated (both calibrated once and cached)")
    quant_group: int = _setting(
        32, label="int4 group size", widget="dropdown", choices=GROUP_SIZES, flag="quant-group",
        help="int4: input features per scale and zero", applies=("weights", _one_of(*INT4_SCHEMES)))
    quant_activations: str = _setting(
        "model", label="activations", widget="radio", choices=ACTIVATIONS, labels=ACTIVATIONS_LABELS,
        info="int8: each projection's input rounded to int8 (int4 weights: per block of 32, llama.cpp's way, our CPU "
             "kernel; int8 weights: per token, oneDNN's int8 matmul, twice bf16's multiply-adds a cycle) and "
             "multiplied by the weights in integers",
        flag="quant-activations",
        help="int4 or int8 weights: multiply them by the activations in the model dtype (model) or by the "
             "activations rounded to int8 (int4: per block of 32 input features; int8: per token), in integer dot "
             "products (int8: CPU only)",
        applies=("weights", _one_of(*INT4_SCHEMES, "int8")), off_value="model", detail=False)
    kv_dtype: str = _setting(
        "auto", label="KV cache dtype", widget="radio", choices=KV_DTYPES, labels=KV_DTYPE_LABELS, flag="kv-dtype",
        help="KV cache storage: auto (the model dtype), int8 (per token and head scales) or int4 (KIVI: keys per "
             "channel over a block, values per token in groups, each sequence's newest block in the model dtype)",
        applies=WITH_KV_CACHE,
        off_value="auto")
    attention: str = _setting(
        "gather", label="attention (paged)", widget="radio", choices=ATTENTIONS, labels=ATTENTION_LABELS,
        info="how attention reads the paged pool: a contiguous copy of each sequence's blocks per step, or "
             "FlexAttention through the block table with no copy (compiled on its first use of each shape, about 5 s "
             "each on a CPU)", flag="attention",
        help="paged attention: gather (copy each sequence's blocks, then SDPA; the reference and the default, "
             "measured faster) or flex (FlexAttention over the pool through the block tables, no copy; compiles "
             "each shape bucket on first use)",
        applies=("kv_mode", _one_of("paged")), off_value="gather")
    sliding_window: int | None = _setting(  # 0 (or None): the checkpoint's own window, if any
        0, label="sliding window (tokens)", widget="number", bounds=(0, 1 << 20, 1),
        info="attend to the last N tokens only; the paged cache gives back blocks that fall out of the window, so "
             "its memory stays flat as the text grows", flag="sliding-window", flag_default=None,
        help="attend to the last N tokens only (default: the checkpoint's own window, if any); paged KV gives back "
             "the blocks that fall out of it")
    attention_sinks: int = _setting(
        0, label="attention sinks (tokens)", widget="number", bounds=(0, 64, 1),
        info="with a sliding window, every token also attends to the text's first N tokens (StreamingLLM: 4), whose "
             "blocks stay in the pool; a model trained with full attention keeps its footing past the window",
        flag="attention-sinks",
        help="with --sliding-window: every token also attends to its sequence's first N tokens (StreamingLLM's "
             "attention sinks; the paged cache keeps their blocks)",
        applies=("sliding_window", lambda window: bool(_whole(window))), off_value=0)
    # An external OpenAI-compatible server (vLLM, SGLang, llama.cpp's server, this app's API elsewhere): the lane runs
    # there through `serving.remote` instead of on this engine, and only the sampling settings above apply.
    endpoint: str = _setting(
        "", label="external engine URL (empty: this app's engine)", widget="text", api=None,
        info="run this lane on an OpenAI-compatible server instead (vLLM, SGLang, llama.cpp's server, this app on "
             "another machine): only temperature, top-p and seed apply there; its TTFT and tokens/s are wall-clock "
             "as this app sees them")
    endpoint_model: str = _setting(
        "", label="external model id (empty: the first it lists)", widget="text", api=None)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "LaneSettings":
        """A lane from `generate`'s flags (see `add_setting_arguments`)."""
        return cls(**{name: getattr(args, name) for name, setting in SETTINGS.items() if setting.flag})

    def engine_config(self, max_seq_len: int | None, **engine) -> EngineConfig:
        """The engine's settings for this lane; `engine`: settings that are not the lane's (batching, pool size)."""
        window = _whole(self.sliding_window) or None
        steps = _whole(self.decode_steps)
        if steps != 1 and not self.external:
            if self.speculates:
                raise ConfigError("speculative decoding runs steps of its own (draft, verify): set {decode_steps} to "
                                  "1, or {spec_method} to none.")
            if not self.greedy or self.sampling(1).shapes_logits:
                raise ConfigError("{decode_steps} above 1 feed each step's greedy token to the next on the device, "
                                  "with nothing reading the logits: set {temperature} to 0 and turn off penalties, "
                                  "logit bias and constraints, or set {decode_steps} to 1.")
        return EngineConfig(kv_mode=self.kv_mode, block_size=_whole(self.block_size),
                            prefix_cache=bool(self.prefix_cache), max_seq_len=max_seq_len, compile=bool(self.compile),
                            kv_dtype=self.kv_dtype, sliding_window=window, attention=self.attention,
                            attention_sinks=_whole(self.attention_sinks) or 0, decode_steps=steps, **engine)

    def quant(self, lm_head: bool = True) -> QuantConfig:
        return QuantConfig(self.weights or "none", _whole(self.quant_group), lm_head,
                           self.quant_activations if self.weights in (*INT4_SCHEMES, "int8") else "model")

    def sampling(self, max_new_tokens: int, **more) -> SamplingParams:
        """The sampling settings for `max_new_tokens`; `more`: top-k, stop strings and the like, and any of the lane's
        own sampling fields given another way (the API's body)."""
        seed = None if self.seed in (None, "") else int(self.seed)
        lane = dict(min_p=float(self.min_p), repetition_penalty=float(self.repetition_penalty),
                    presence_penalty=float(self.presence_penalty), frequency_penalty=float(self.frequency_penalty),
                    logit_bias=parse_logit_bias(self.logit_bias), constraint=self.constraint_object())
        return SamplingParams(max_new_tokens=int(max_new_tokens), temperature=float(self.temperature),
                              top_p=float(self.top_p), seed=seed, **{**lane, **more})

    def constraint_object(self) -> Constraint | None:
        """The lane's constraint for the engine (None: unconstrained); a ConfigError says what to change."""
        kind = self.constraint or "none"
        if kind == "none":
            return None
        spec = (self.constraint_spec or "").strip()
        if kind == "json_object":
            return Constraint(kind)
        if not spec:
            raise ConfigError(f"{{constraint}} is {CONSTRAINT_LABELS.get(kind, kind)}: give it in "
                              "{constraint_spec}.")
        if kind == "choice":
            return Constraint(kind, tuple(choice.strip() for choice in spec.split("|") if choice.strip()))
        return Constraint(kind, spec)

    def spec(self) -> SpecConfig:
        """The speculative settings (raises ConfigError for a bad one). The early-exit depth is passed only with
        that method, so a value left in its hidden box cannot affect another draft source."""
        layers = self.draft_layers if self.spec_method == "early-exit" else None
        layers = None if layers in ("", DEFAULT_LAYERS) else layers
        method = self.spec_method or "none"
        k = None if _left_open(self.spec_k) else _whole(self.spec_k)
        if method in HIDDEN_READERS:  # the sources that rank candidates: a width left open is the engine's to choose
            width = None if _left_open(self.spec_tree_width) else _whole(self.spec_tree_width)
        else:  # a chain; a width named for one of them is refused by SpecConfig
            width = 1 if _left_open(self.spec_tree_width) or method == "none" else _whole(self.spec_tree_width)
        return SpecConfig(method=method, k=k, adaptive=bool(self.spec_adaptive), draft_layers=_whole(layers),
                          tree_width=width, tree_prune=bool(self.spec_tree_prune))

    def check(self) -> None:
        """Refuse a bad value or a combination the engine cannot run (ConfigError), without building an engine."""
        self.engine_config(1 << 16), self.quant(), self.spec(), self.sampling(1)

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
        """This lane in a line of words, as the page's summaries and the API's reports say it."""
        sampling = "greedy" if self.greedy else f"temperature {float(self.temperature):g}, top-p {float(self.top_p):g}"
        if self.external:
            model = f" ({self.endpoint_model})" if self.endpoint_model else ""
            return f"external engine {self.endpoint.strip()}{model}, {sampling}"
        parts = [KV_MODE_LABELS.get(self.kv_mode, self.kv_mode)]
        if self.kv_mode == "paged":
            parts.append(f"block {int(self.block_size)}")
            parts.append("prefix cache" if self.prefix_cache else "no prefix cache")
        parts.append(sampling)
        if self.speculates:
            draft = SPEC_METHOD_LABELS.get(self.spec_method, self.spec_method)
            if self.spec_method == "early-exit" and self.draft_layers not in (None, "", DEFAULT_LAYERS):
                draft += f" ({_whole(self.draft_layers)} layers)"
            k = "k best measured" if _left_open(self.spec_k) else f"k={_whole(self.spec_k)}"
            if self.spec_method not in HIDDEN_READERS:
                tree = ""
            elif _left_open(self.spec_tree_width):  # sampled or adaptive: a chain (`Engine.default_tree_width`)
                tree = " tree width best measured" if self.greedy and not self.spec_adaptive else ""
            else:
                width = _whole(self.spec_tree_width)
                tree = f" tree {width} wide" if width != 1 else ""
            if tree and not self.spec_tree_prune:
                tree += ", every node"
            parts.append(f"{draft} {k}" + (" adaptive" if self.spec_adaptive else "") + tree)
        if float(self.min_p or 0) and not self.greedy:
            parts.append(f"min-p {float(self.min_p):g}")
        for name, label, off in (("repetition_penalty", "repetition penalty", 1.0),
                                 ("presence_penalty", "presence penalty", 0.0),
                                 ("frequency_penalty", "frequency penalty", 0.0)):
            if float(getattr(self, name)) != off:
                parts.append(f"{label} {float(getattr(self, name)):g}")
        if (self.logit_bias or "").strip():
            parts.append("logit bias")
        if (self.constraint or "none") != "none":
            parts.append(f"constrained to {CONSTRAINT_LABELS.get(self.constraint, self.constraint)}")
        if self.compile:
            parts.append("compiled decode")
            if _whole(self.decode_steps) != 1:
                parts.append(f"{_whole(self.decode_steps)} steps a round trip")
        if self.weights not in (None, "", "none"):
            parts.append(f"{self.quant().name} weights")
        if self.kv_dtype in ("int8", "int4"):
            parts.append(f"{self.kv_dtype} KV")
        if self.attention == "flex" and self.kv_mode == "paged":
            parts.append("flex attention")
        if _whole(self.sliding_window):
            parts.append(f"window {_whole(self.sliding_window)}")
            if _whole(self.attention_sinks):
                parts.append(f"{_whole(self.attention_sinks)} sinks")
        return ", ".join(parts)


def parse_logit_bias(text: str) -> dict[int, float]:
    """'30:-100, 2:5' -> {30: -100.0, 2: 5.0}; a ConfigError says the expected form."""
    bias = {}
    for pair in (text or "").replace(";", ",").split(","):
        if not pair.strip():
            continue
        token, _, value = pair.partition(":")
        try:
            bias[int(token.strip())] = float(value.strip())
        except ValueError:
            raise ConfigError(f"{{logit_bias}} takes 'token id: bias' pairs separated by commas, like '30:-100, "
                              f"2:5'; {pair.strip()!r} is not one.") from None
    return bias


SETTINGS: dict[str, Setting] = {f.name: f.metadata["setting"] for f in fields(LaneSettings)}
DEFAULTS = LaneSettings()


def cli_default(name: str):
    """Setting `name`'s default on the command line (where it differs from the page's, the row says so)."""
    setting = SETTINGS[name]
    return getattr(DEFAULTS, name) if setting.flag_default is UNSET else setting.flag_default


def kinds(name: str) -> tuple[type, ...]:
    """The JSON types the API accepts for setting `name`."""
    return SETTINGS[name].kinds or (type(getattr(DEFAULTS, name)),)


def applies(settings: LaneSettings, name: str) -> bool:
    """Whether setting `name` does something with the rest of `settings`."""
    condition = SETTINGS[name].applies
    return condition is None or condition[1](getattr(settings, condition[0]))


def words(surface: str) -> dict[str, str]:
    """How `surface` ("page", "api" or "cli") names each setting in a `ConfigError`'s message (see
    `ConfigError.in_words`): the page quotes its label, the API the field's name, the command line its flag."""
    if surface == "page":
        return {name: f"'{setting.label}'" for name, setting in SETTINGS.items()}
    if surface == "api":
        return {name: f"'{name}'" for name, setting in SETTINGS.items() if setting.api}
    return {name: f"--{setting.flag}" for name, setting in SETTINGS.items() if setting.flag}


def add_setting_arguments(parser: argparse.ArgumentParser) -> None:
    """`generate`'s flags for the lane settings, one per setting with a flag, in the table's order."""
    for name, setting in SETTINGS.items():
        if not setting.flag:
            continue
        default = cli_default(name)
        if isinstance(default, bool):
            flag = f"--no-{setting.flag}" if default else f"--{setting.flag}"
            parser.add_argument(flag, dest=name, action="store_false" if default else "store_true",
                                help=setting.help)
            continue
        kind = kinds(name)[0] if name != "draft_layers" else int
        parser.add_argument(f"--{setting.flag}", dest=name, type=kind, default=default,
                            choices=setting.choices if kind is str and setting.choices else None, help=setting.help)


def command_flags(settings: LaneSettings, always: tuple[str, ...] = ()) -> list[str]:
    """`generate`'s flags that reproduce `settings`: every setting changed from its default, the details of every
    switch that is on (the group size of int4 weights, the draft length of a draft source, top-p and seed when
    sampling), and the settings named in `always`."""
    words = []
    for name, setting in SETTINGS.items():
        value = getattr(settings, name)
        if not setting.flag or value in (None, "", DEFAULT_LAYERS, AUTO):
            continue
        default = cli_default(name)
        changed = value != getattr(DEFAULTS, name) and value != default
        switched_on = setting.detail and setting.applies is not None and \
            getattr(settings, setting.applies[0]) != getattr(DEFAULTS, setting.applies[0])
        if name not in always and not (applies(settings, name) and (changed or switched_on)):
            continue
        if isinstance(default, bool):
            if value != default:
                words.append(f"--no-{setting.flag}" if default else f"--{setting.flag}")
        else:
            words += [f"--{setting.flag}", str(_whole(value))]
    return words
