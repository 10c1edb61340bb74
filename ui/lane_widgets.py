"""The controls of one lane's settings (a race lane's or the chat's), built from the settings' table
(`inference_core.settings`): one control per setting, in the table's order (the order `ui.race.LANE_SETTING_FIELDS`
hands the values to the handlers), of the kind the table names, with its label, choices, bounds and the line under
it; the sampling and constraint settings (`SAMPLING_GROUP`) are folded into an accordion of their own. A setting that
does not apply to the rest is disabled or hidden as its row says (block size and prefix cache without the paged
cache, top-p, seed and min-p when greedy, draft length without a draft source, the early-exit depth for other
sources, the constraint's text without a constraint), and set to its row's value for "off" where it has one.

What the table cannot know comes from the loaded model and the deployment (`_model_facts`): the draft sources this
model has (a draft model only when the app loaded one), the early-exit depths, the weight schemes that run here and
what they save, each KV dtype's bytes per token, the checkpoint's own window, whether compiled decode runs here, and
in public mode the external engines allowed at launch (none: that choice is hidden).
"""

from __future__ import annotations

import gradio as gr

from inference_core.config import KV_DTYPES
from inference_core.engine.compiled import compile_unavailable
from inference_core.quant.kernels import DEVICES as QUANT_DEVICES
from inference_core.quant.linear import compute_dtype, weight_bytes
from inference_core.settings import DEFAULT_LAYERS, DEFAULTS, SETTINGS, UNSET, LaneSettings, applies
from serving.pool import EnginePool

QUICK = {"queue": False, "show_progress": "hidden", "api_visibility": "private"}  # the page's own events
# Each control's element id after the settings group's prefix (lane-a, lane-b, chat), what tests and scripts find:
# the setting's name with dashes, but for these.
ELEMENT_IDS = {"kv_mode": "kv", "spec_method": "spec", "spec_tree_width": "spec-tree", "draft_layers": "spec-layers",
               "sliding_window": "window"}
SIDE_BY_SIDE = ("spec_k", "spec_adaptive", "spec_tree_width", "spec_tree_prune", "draft_layers")  # drawn in one row
# Folded into an accordion of their own (closed), so that a lane's panel stays short: the sampling controls people
# expect besides temperature and top-p, and the output constraint.
SAMPLING_GROUP = ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "constraint",
                  "constraint_spec")


def settings_widgets(pool: EnginePool, defaults: LaneSettings, label: str,
                     prefix: str) -> list[gr.components.Component]:
    """One control per setting for `defaults`, in the table's order, wired so that settings that do not apply are
    disabled or hidden."""
    facts = _model_facts(pool, label)
    widgets = {}

    def add(name: str) -> None:
        elem_id = f"{prefix}-{ELEMENT_IDS.get(name, name.replace('_', '-'))}"
        widgets[name] = _widget(name, getattr(defaults, name), elem_id, facts.get(name, {}), applies(defaults, name))

    for name in SETTINGS:
        if name == SIDE_BY_SIDE[0]:
            with gr.Row():
                for side in SIDE_BY_SIDE:
                    add(side)
        elif name == SAMPLING_GROUP[0]:
            with gr.Accordion("Sampling and constraints", open=False, elem_id=f"{prefix}-sampling"):
                for grouped in SAMPLING_GROUP:
                    add(grouped)
        elif name not in SIDE_BY_SIDE + SAMPLING_GROUP:
            add(name)
    _wire(widgets, facts)
    return [widgets[name] for name in SETTINGS]  # the table's order, whatever order they were drawn in


def _widget(name: str, value, elem_id: str, facts: dict, applying: bool) -> gr.components.Component:
    """The control the table's row names for setting `name`, `facts` overriding what the model decides."""
    setting = SETTINGS[name]
    labels = facts.get("labels", setting.labels or {})
    offered = facts.get("choices", setting.choices)
    choices = [(str(labels.get(choice, choice)), choice) if labels else choice for choice in offered]
    if offered and value not in offered:  # not offered here (a weight scheme this device cannot run, say)
        value = getattr(DEFAULTS, name)
    kind = facts.get("widget", setting.widget)
    common = {"label": facts.get("label", setting.label), "elem_id": elem_id, **_state(setting, applying, facts)}
    info = facts.get("info", setting.info)
    common.update({"info": info} if info else {}, **{key: facts[key] for key in ("visible",) if key in facts})
    value = facts.get("value", value)
    if kind == "radio":
        return gr.Radio(choices, value=value, **common)
    if kind == "dropdown":
        return gr.Dropdown(choices, value=value, **common)
    if kind == "checkbox":
        return gr.Checkbox(value=value, **common)
    if kind == "slider":
        low, high, step = setting.bounds
        return gr.Slider(low, high, value=value, step=step, **common)
    if kind == "number":
        return gr.Number(value=value or 0, precision=0, minimum=setting.bounds[0] if setting.bounds else None, **common)
    return gr.Textbox(value, **common)


def _state(setting, applying: bool, facts: dict) -> dict:
    """Where a setting does not apply its control is hidden (its row says so) or disabled; one the model rules out
    (`facts["can"]`, compiled decode where it cannot run) stays disabled."""
    return {"visible": applying} if setting.hidden else {"interactive": applying and facts.get("can", True)}


def _wire(widgets: dict, facts: dict) -> None:
    """Each control whose setting depends on another follows it: enabled (or shown) only where it applies, set to
    its row's "off" value where it stops applying."""
    followers: dict[str, list[str]] = {}
    for name, setting in SETTINGS.items():
        if setting.applies is not None:
            followers.setdefault(setting.applies[0], []).append(name)
    for leader, names in followers.items():
        def follow(value, names=tuple(names)):
            updates = []
            for name in names:
                setting = SETTINGS[name]
                on = setting.applies[1](value)
                off = {} if on or setting.off_value is UNSET else {"value": setting.off_value}
                updates.append(gr.update(**_state(setting, on, facts.get(name, {})), **off))
            return tuple(updates) if len(updates) > 1 else updates[0]
        widgets[leader].change(follow, widgets[leader], [widgets[name] for name in names], **QUICK)


def _model_facts(pool: EnginePool, label: str) -> dict[str, dict]:
    """What the loaded model and the deployment decide about each control, by setting."""
    loaded, policy = pool.loaded, pool.policy
    methods, schemes = pool.spec_methods(), pool.weight_schemes()
    unavailable = compile_unavailable(loaded.device)
    per_token = {kv_dtype: loaded.config.kv_bytes_per_token(loaded.dtype, kv_dtype) for kv_dtype in KV_DTYPES}
    own = loaded.config.sliding_window
    facts = {
        "kv_mode": {"label": f"{label} KV cache"},
        "spec_method": {"choices": methods,
                        "labels": {**SETTINGS["spec_method"].labels,
                                   "draft": f"draft model ({pool.draft.name})" if pool.draft else ""}},
        # A dropdown, not a number box: an empty gr.Number arrives as 0, and "engine default" needs its own value.
        "draft_layers": {"choices": [DEFAULT_LAYERS] + list(range(1, loaded.config.num_layers)),
                         "labels": {DEFAULT_LAYERS: "engine default"}},
        "compile": {"can": unavailable is None, **({"info": f"not available here: {unavailable}", "value": False}
                                                   if unavailable else {})},
        "weights": {"choices": schemes, "can": len(schemes) > 1, "info": _weights_info(pool)},
        "kv_dtype": {"labels": {name: f"{SETTINGS['kv_dtype'].labels[name]} ({per_token[name] / 1024:.1f} KiB per "
                                      "token)" for name in KV_DTYPES},
                     "info": f"int8 holds {per_token['auto'] / per_token['int8']:.1f}x the tokens in the same memory, "
                             f"int4 {per_token['auto'] / per_token['int4']:.1f}x; int8 decodes eager only, int4 "
                             "compiled too (paged)"},
        "sliding_window": {"label": "sliding window (tokens; 0 = "
                                    f"{f'the checkpoint window, {own}' if own else 'off'})"},
    }
    if policy.public:  # only the external engines allowed at launch, in a list (none: the choice is hidden)
        facts["endpoint"] = {"widget": "dropdown", "label": "engine", "visible": bool(policy.allowed_endpoints),
                             "choices": [""] + list(policy.allowed_endpoints), "labels": {"": "this app's engine"}}
        facts["endpoint_model"] = {"visible": bool(policy.allowed_endpoints)}
    return facts


def _weights_info(pool: EnginePool) -> str:
    loaded = pool.loaded
    base_mib = weight_bytes(loaded.model) / 2 ** 20
    if loaded.device.type == "cuda":
        return (f"{base_mib:.0f} MiB in {loaded.dtype_name}; int4 (tinygemm) stores about a quarter of bf16's "
                "bytes; eager int8 measured slower than bf16 on an H100 (its cast fuses only in a compiled step); "
                "the race table shows each lane's weight memory")
    if loaded.device.type not in QUANT_DEVICES:
        return f"{base_mib:.0f} MiB in {loaded.dtype_name}; weight quantization runs on the CPU and on CUDA only"
    if compute_dtype("cpu", loaded.dtype) != loaded.dtype:
        return (f"{base_mib:.0f} MiB in {loaded.dtype_name}; the quantized kernels (bf16 activations) are faster on "
                "this CPU as well as smaller; the race table shows each lane's weight memory")
    return (f"{base_mib:.0f} MiB in {loaded.dtype_name}; quantized weights save memory, not time, on this CPU (its "
            "quantized kernels measured no faster); the race table shows each lane's size")
