"""Activation-aware weight quantization (AWQ) to int4 per group: the calibration, the search and the folding.

Round to nearest treats every input channel alike, yet a few channels carry much larger activations than the rest,
and the rounding errors of their weights dominate the output error. AWQ multiplies each projection's weight columns
by s = mean|x|^alpha before rounding (so those channels' weights get relatively finer steps within their group) and
divides the inputs by s. We fold 1/s into the op that produces the inputs, so no op is added and the int4 layers are
`quant.QuantLinear`'s: the RMSNorm weight before qkv_proj, gate_up_proj and the LM head, the v rows of qkv_proj
before o_proj (o_proj's scales are shared by the query heads that read one KV head), the up rows of gate_up_proj
before down_proj. Folding is exact in real arithmetic: the float model computes the same function.

Per projection, alpha comes from a grid by the output error on the calibration inputs x [tokens, in], measured as
trace(E G E^T) with E the weight error and G = x^T x (every calibration token counts, at the cost of one [in, in]
matrix). alpha = 0 is plain round to nearest (s = 1 exactly), so the choice is never worse than RTN on those inputs.
Then each group's range may be clipped to a fraction of its max |w|, per output row and group, by the same error
restricted to the group (kept only where it lowers the whole projection's error).

The model runs in its own dtype over the calibration text layer by layer (only one layer's statistics are held),
each layer fed the float model's outputs of the one before, on the model's device (the CPU or CUDA: statistics and
search stay there). Saving, loading and the CLI are `calibrated_file`'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from inference_core.config import ConfigError
from inference_core.engine.runner import ModelRunner
from inference_core.kv.cache import RecomputeKVCache
from inference_core.model.llama import Linear
from inference_core.quant.linear import compute_dtype, round_int4, shared_copy
from inference_core.sequence import Sequence

ALPHAS = tuple(i / 20 for i in range(21))  # 0, 0.05, ..., 1; 0 is round to nearest
CLIP_RATIOS = tuple(1 - i / 20 for i in range(11))  # 1 (no clipping), 0.95, ..., 0.5 of a group's max |w|
SEARCH_ROWS = 8192  # alpha is scored on about this many rows of a taller weight
# Per decoder layer, each projection with the norm whose output it reads (None: its input is not a norm's).
LAYER_PROJECTIONS = (("self_attn.qkv_proj", "input_layernorm"), ("self_attn.o_proj", None),
                     ("mlp.gate_up_proj", "post_attention_layernorm"), ("mlp.down_proj", None))


@dataclass
class InputStats:
    """What the search needs of one projection's calibration inputs x [tokens, in]."""

    abs_sum: torch.Tensor  # [in] fp64: sum over tokens of |x|
    gram: torch.Tensor  # [in, in] fp64: x^T x
    count: int = 0

    @classmethod
    def empty(cls, in_features: int, device: torch.device | str = "cpu") -> InputStats:
        return cls(torch.zeros(in_features, dtype=torch.float64, device=device),
                   torch.zeros(in_features, in_features, dtype=torch.float64, device=device))

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.abs_sum += x.abs().sum(0, dtype=torch.float64)
        for chunk in x.split(2048):  # fp32 products, summed in fp64
            self.gram += (chunk.t() @ chunk).double()
        self.count += x.shape[0]


@dataclass
class ProjectionChoice:
    """The search's result for one projection; errors are output MSE relative to the output's mean square."""

    alpha: float
    scale: torch.Tensor  # [in] s: weight columns times s, inputs divided by s
    clip: torch.Tensor | None  # [out, in / group] fraction of each group's max |w| kept, None: no clipping
    rtn_error: float
    awq_error: float


@dataclass
class Calibration:
    group_size: int
    choices: dict[str, ProjectionChoice] = field(default_factory=dict)  # by module name, e.g. 'layers.0.mlp.down_proj'
    num_tokens: int = 0


def out_in(linear: Linear) -> torch.Tensor:
    """The fp32 [out, in] weight of a `model.Linear`, whichever its layout."""
    return (linear.weight.t() if linear.in_out else linear.weight).detach().float()


class _Recorder(nn.Module):
    """A projection that adds its inputs to `stats` on the way through."""

    def __init__(self, linear: Linear, stats: InputStats):
        super().__init__()
        self.linear, self.stats = linear, stats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.stats.add(x)
        return self.linear.forward(x)


@torch.inference_mode()
def walk_inputs(loaded, sequences: list[list[int]]):
    """Yields (module name, Linear, InputStats of its inputs) for every projection, layer by layer, the LM head
    last, running the float model over `sequences` (each a causal sequence of its own)."""
    model = loaded.model
    runner = ModelRunner(model, RecomputeKVCache(), loaded.device)
    seqs = [Sequence(list(ids)) for ids in sequences]
    batch = runner.prepare(seqs, [len(seq) for seq in seqs])
    # The first lines of CausalLM.forward, then one decoder layer at a time.
    x = F.embedding(batch.input_ids, model.embed_tokens.weight)  # [tokens, hidden]
    cos_table, sin_table = model.rope_tables(x.dtype)
    cos, sin = cos_table[batch.positions].unsqueeze(1), sin_table[batch.positions].unsqueeze(1)
    for index, layer in enumerate(model.layers):
        recording = shared_copy(layer)  # recorders go into a copy: the shared model is never touched
        recorded = []
        for path, _ in LAYER_PROJECTIONS:
            parent, _, attr = path.rpartition(".")
            linear = getattr(recording.get_submodule(parent), attr)
            stats = InputStats.empty(linear.weight.shape[0 if linear.in_out else 1], x.device)
            setattr(recording.get_submodule(parent), attr, _Recorder(linear, stats))
            recorded.append((f"layers.{index}.{path}", getattr(layer.get_submodule(parent), attr), stats))
        x = recording.forward(x, cos, sin, batch, runner.kv_cache)
        yield from recorded
    stats = InputStats.empty(x.shape[-1], x.device)
    stats.add(model.norm.forward(x))
    yield "lm_head", model.lm_head, stats


def tie_heads(values: torch.Tensor, config) -> torch.Tensor:
    """o_proj input values [heads * head_dim] averaged over the query heads that share a KV head (its v rows)."""
    grouped = values.view(config.num_kv_heads, config.num_heads // config.num_kv_heads, config.head_dim)
    return grouped.mean(1, keepdim=True).expand_as(grouped).reshape(-1)


def mean_square(weight: torch.Tensor, gram: torch.Tensor) -> float:
    """The mean over tokens of |x W^T|^2, from weight [out, in] and gram [in, in] = x^T x / tokens."""
    return ((weight @ gram) * weight).sum().item()


def output_error(weight: torch.Tensor, effective: torch.Tensor, gram: torch.Tensor) -> float:
    """The mean square of x (W - W')^T relative to that of x W^T (see `mean_square`)."""
    return mean_square(weight - effective, gram) / mean_square(weight, gram)


def search_projection(weight: torch.Tensor, stats: InputStats, group_size: int, compute: torch.dtype,
                      alphas=ALPHAS, clip_ratios=CLIP_RATIOS, tie=None) -> ProjectionChoice:
    """The scale (and clipping) of one projection's fp32 [out, in] weight with the least output error."""
    gram = (stats.gram / stats.count).float()  # [in, in]
    mean_abs = (stats.abs_sum / stats.count).float().clamp(min=1e-6)  # [in]
    if tie is not None:
        mean_abs = tie(mean_abs)
    log_mean_abs = mean_abs.log()
    log_mean_abs -= log_mean_abs.mean()  # scales normalized to a geometric mean of 1

    # 1. alpha, s = mean|x|^alpha, scored on every k-th row of a tall matrix (the LM head: 49,152 rows), then
    # checked against round to nearest on all rows.
    sample = weight[::max(1, weight.shape[0] // SEARCH_ROWS)]
    references = {id(weight): mean_square(weight, gram), id(sample): mean_square(sample, gram)}

    def error_of(rows: torch.Tensor, scale: torch.Tensor, clip: torch.Tensor | None = None) -> float:
        # The layer computes (x / s) Q(W s)^T: its weight is Q(W s) / s.
        effective = round_int4(rows * scale, group_size, clip).dequantized(compute) / scale
        return mean_square(rows - effective, gram) / references[id(rows)]

    scored = {}
    for alpha in alphas:
        scored[alpha] = error_of(sample, torch.exp(alpha * log_mean_abs))  # s = 1 exactly for alpha = 0
        if scored[alpha] == 0:  # already on an int4 grid (a Q4 checkpoint's weights): nothing can do better
            break
    alpha = min(scored, key=scored.get)
    ones = torch.ones_like(log_mean_abs)
    rtn_error = error_of(weight, ones)
    scale = torch.exp(alpha * log_mean_abs)
    error = rtn_error if alpha == 0 else error_of(weight, scale)
    if error >= rtn_error:
        alpha, scale, error = 0.0, ones, rtn_error
    # 2. clipping, per output row and group, in the scaled space (weight W s, inputs x / s).
    clip = None if error == 0 else search_clip(weight * scale, gram / (scale[:, None] * scale[None, :]), group_size,
                                               compute, clip_ratios)
    if clip is not None:
        clipped = error_of(weight, scale, clip)
        if clipped < error:
            error = clipped
        else:
            clip = None
    return ProjectionChoice(alpha, scale, clip, rtn_error, error)


def search_clip(weight: torch.Tensor, gram: torch.Tensor, group_size: int, compute: torch.dtype,
                ratios=CLIP_RATIOS) -> torch.Tensor | None:
    """Per output row and group of the [out, in] weight, the clip ratio with the least error on that group's part
    of the output (the group's diagonal block of the Gram matrix); None when no ratio below 1 is tried."""
    if not any(ratio < 1 for ratio in ratios):
        return None
    out_features, in_features = weight.shape
    groups = in_features // group_size
    blocks = gram.view(groups, group_size, groups, group_size).diagonal(dim1=0, dim2=2).permute(2, 0, 1)  # [g, gs, gs]
    best_loss = torch.full((out_features, groups), float("inf"), device=weight.device)
    best_clip = torch.ones(out_features, groups, device=weight.device)
    for ratio in ratios:
        clip = torch.full((out_features, groups), ratio, device=weight.device)
        error = (weight - round_int4(weight, group_size, clip).dequantized(compute)).view(out_features, groups, -1)
        per_group = error.transpose(0, 1)  # [groups, out, group_size]
        loss = (torch.bmm(per_group, blocks) * per_group).sum(-1).t()  # [out, groups]
        better = loss < best_loss
        best_loss = torch.where(better, loss, best_loss)
        best_clip = torch.where(better, clip, best_clip)
    return best_clip


def check_group_size(loaded, group_size: int) -> None:
    """Refuse a group size that does not divide the input features of every projection (ConfigError)."""
    widths = {module.weight.shape[0 if module.in_out else 1] for module in loaded.model.modules()
              if isinstance(module, Linear)}
    if any(width % group_size for width in widths):
        raise ConfigError(f"int4 groups of {group_size} do not divide the input features of every projection of "
                          f"this model ({', '.join(map(str, sorted(widths)))}); pick another --quant-group.")


def calibrate(loaded, group_size: int, sequences: list[list[int]], alphas=ALPHAS, clip_ratios=CLIP_RATIOS,
              on_projection=None) -> Calibration:
    """The AWQ choice of every projection (the LM head included) of `loaded`'s float model."""
    check_group_size(loaded, group_size)
    compute = compute_dtype(loaded.device.type, loaded.dtype, "awq")
    calibration = Calibration(group_size, num_tokens=sum(len(ids) for ids in sequences))
    for name, linear, stats in walk_inputs(loaded, sequences):
        tie = (lambda values: tie_heads(values, loaded.config)) if name.endswith("o_proj") else None
        choice = search_projection(out_in(linear), stats, group_size, compute, alphas, clip_ratios, tie)
        calibration.choices[name] = choice
        if on_projection is not None:
            on_projection(name, choice)
    return calibration


def fold_scales(loaded, scales: dict[str, torch.Tensor], lm_head: bool = True):
    """A float LoadedModel computing the same function with every projection's columns multiplied by its scale and
    1/scale folded into the op before (new tensors; `loaded`'s are shared where unchanged, never modified)."""
    config, model = loaded.config, shared_copy(loaded.model)
    q_and_k = (config.num_heads + config.num_kv_heads) * config.head_dim
    for index, layer in enumerate(model.layers):
        prefix = f"layers.{index}"
        s_qkv, s_o = scales[f"{prefix}.self_attn.qkv_proj"], scales[f"{prefix}.self_attn.o_proj"]
        s_gate_up, s_down = scales[f"{prefix}.mlp.gate_up_proj"], scales[f"{prefix}.mlp.down_proj"]
        # o_proj's scales are tied per KV head: one per v row. [q_and_k + kv_size] row divisors of qkv_proj.
        s_v = s_o.view(config.num_kv_heads, -1, config.head_dim)[:, 0].reshape(-1)
        qkv_rows = torch.cat([torch.ones(q_and_k, device=s_v.device), s_v])
        up_rows = torch.cat([torch.ones(config.intermediate_size, device=s_down.device), s_down])  # gate, then up rows
        attention, mlp = layer.self_attn, layer.mlp
        attention.qkv_proj = _scaled_linear(attention.qkv_proj, s_qkv, qkv_rows)
        attention.o_proj = _scaled_linear(attention.o_proj, s_o)
        mlp.gate_up_proj = _scaled_linear(mlp.gate_up_proj, s_gate_up, up_rows)
        mlp.down_proj = _scaled_linear(mlp.down_proj, s_down)
        _divide_norm(layer.input_layernorm, s_qkv)
        _divide_norm(layer.post_attention_layernorm, s_gate_up)
    if lm_head:
        model.lm_head = _scaled_linear(model.lm_head, scales["lm_head"])
        _divide_norm(model.norm, scales["lm_head"])
    return dataclasses.replace(loaded, model=model)


def _scaled_linear(linear: Linear, columns: torch.Tensor, row_divisors: torch.Tensor | None = None) -> Linear:
    """A new Linear, in `linear`'s layout and dtype, with weight W[o, i] * columns[i] / row_divisors[o] (and bias
    divided by row_divisors)."""
    weight = out_in(linear) * columns[None, :]  # [out, in]
    bias = None if linear.bias is None else linear.bias.detach().float()
    if row_divisors is not None:
        weight = weight / row_divisors[:, None]
        bias = None if bias is None else bias / row_divisors
    dtype = linear.weight.dtype
    scaled = Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    scaled.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    if bias is not None:
        scaled.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    scaled.use_layout(linear.layout)
    return scaled


def _divide_norm(norm: nn.Module, scale: torch.Tensor) -> None:
    """Give the (copied) RMSNorm a new weight, divided by `scale`."""
    norm.weight = nn.Parameter((norm.weight.detach().float() / scale).to(norm.weight.dtype), requires_grad=False)
