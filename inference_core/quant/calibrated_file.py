"""Calibrated int4 weights on disk, AWQ's and GPTQ's: calibrate once, save, and load them again with no calibration
(`inference_core.quant.awq` and `inference_core.quant.gptq` own the methods).

`calibrate_and_save(loaded, group_size, method=...)` runs the calibration on the text shipped in
`data/calibration_text.txt` (the first five chapters of Jane Austen's *Pride and Prejudice*, 1813, public domain:
Project Gutenberg eBook #1342, line endings as LF) and writes one safetensors file: the int4 weights
(`int4_tensors`), the norm weights (AWQ's folded ones), and metadata (the method, group size, each projection's
choice or error, the model's fingerprint, the calibration text's hash). `load(loaded, path, method=...)` rebuilds the
quantized model from it and refuses a file made for other weights, another method or another group size; it loads
onto the CPU or CUDA, in each device's int4 layout (`inference_core.quant.kernels`), whichever device calibrated it.
Files live in `$INFERENCE_CORE_AWQ_CACHE`, else `awq/` in the local cache (~/.cache/inference-playground), as
`<model fingerprint>-g<group>.safetensors` (AWQ) and `<model fingerprint>-gptq-g<group>.safetensors` (GPTQ);
`load_or_calibrate` (behind `quantize(loaded, QuantConfig("awq" or "gptq", g))`) loads that file when it exists and
calibrates and saves it otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from inference_core.config import ConfigError
from inference_core.model.llama import model_fingerprint
from inference_core.model.loader import add_model_arguments, load_model
from inference_core.model.paths import DATA_DIR, cache_root
from inference_core.quant import awq, gptq
from inference_core.quant.kernels import check_device
from inference_core.quant.linear import (CALIBRATED, Int4Weight, QuantConfig, QuantLinear, compute_dtype, round_int4,
                                         shared_copy)

CALIBRATION_TEXT = DATA_DIR / "calibration_text.txt"
SEQUENCE_TOKENS = 512  # tokens per calibration sequence
MAX_SEQUENCES = 16
FORMATS = {"awq": "awq-int4-v1", "gptq": "gptq-int4-v1"}
# How `--quant gptq` calibrates the file it loads: what measured best on the bundled model (docs/benchmarks.md, "GPTQ")
DEFAULT_OPTIONS = {"gptq": {"act_order": True, "on_awq": True}}


def awq_cache_dir() -> Path:
    """Where calibrated files are kept: env INFERENCE_CORE_AWQ_CACHE, else `awq/` in the local cache."""
    return Path(os.environ.get("INFERENCE_CORE_AWQ_CACHE") or cache_root() / "awq")


def default_path(loaded, group_size: int, method: str = "awq") -> Path:
    infix = "" if method == "awq" else f"-{method}"
    return awq_cache_dir() / f"{model_fingerprint(loaded.model)}{infix}-g{group_size}.safetensors"


def calibration_sequences(tokenizer, text: str | None = None) -> list[list[int]]:
    """The calibration text's tokens cut into up to MAX_SEQUENCES sequences of SEQUENCE_TOKENS (the rest unused)."""
    ids = tokenizer.encode(CALIBRATION_TEXT.read_text() if text is None else text)
    count = min(MAX_SEQUENCES, len(ids) // SEQUENCE_TOKENS)
    if count == 0:
        raise ConfigError(f"the calibration text has {len(ids)} tokens; AWQ needs at least {SEQUENCE_TOKENS}.")
    return [ids[i * SEQUENCE_TOKENS:(i + 1) * SEQUENCE_TOKENS] for i in range(count)]


def sequences_hash(sequences: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(sequences).encode()).hexdigest()[:16]


def calibrate_and_save(loaded, group_size: int, path: Path | str | None = None, sequences=None, alphas=awq.ALPHAS,
                       clip_ratios=awq.CLIP_RATIOS, on_projection=None, lm_head: bool = True, method: str = "awq",
                       act_order: bool = True, on_awq: bool = False, activations: str = "model"):
    """Calibrate `loaded` (a float model) at `group_size` with `method` (awq, gptq: with `act_order`, and on AWQ's
    folded weights with `on_awq`), write the file (default: `default_path`) and return (the quantized LoadedModel,
    the Calibration, seconds taken). `sequences` default to the shipped text's."""
    started = time.perf_counter()
    path = Path(path) if path is not None else default_path(loaded, group_size, method)
    text_hash = hashlib.sha256(CALIBRATION_TEXT.read_bytes()).hexdigest()[:16] if sequences is None else "-"
    sequences = sequences if sequences is not None else calibration_sequences(loaded.tokenizer)
    if method == "awq" or on_awq:
        scaling = awq.calibrate(loaded, group_size, sequences, alphas, clip_ratios,
                                on_projection if method == "awq" else None)
        scales = {name: choice.scale for name, choice in scaling.choices.items()}
        folded = awq.fold_scales(loaded, scales)
    else:
        scaling, scales, folded = None, None, loaded
    if method == "awq":
        calibration = scaling
        weights = {name: round_int4(awq.out_in(folded.model.get_submodule(name)), group_size, choice.clip)
                   for name, choice in calibration.choices.items()}
        details = {"alphas": json.dumps({name: choice.alpha for name, choice in calibration.choices.items()}),
                   "clipped": json.dumps([name for name, choice in calibration.choices.items()
                                          if choice.clip is not None])}
    else:
        calibration = gptq.calibrate(loaded, group_size, sequences, act_order, scales, on_projection)
        weights = {name: result.weight for name, result in calibration.results.items()}
        details = {"act_order": str(act_order), "on_awq": str(on_awq),
                   "output_errors": json.dumps({name: [round(r.rtn_error, 8), round(r.gptq_error, 8)]
                                                for name, r in calibration.results.items()})}
    tensors = {key: tensor.cpu() for key, tensor in int4_tensors(folded, weights, norms=scales is not None).items()}
    seconds = time.perf_counter() - started
    metadata = {
        "format": FORMATS[method], "group_size": str(group_size), "model_fingerprint": model_fingerprint(loaded.model),
        "model": loaded.display_name, "dtype": loaded.dtype_name,
        "calibration_text_sha256": text_hash, "calibration_tokens_sha256": sequences_hash(sequences),
        "calibration_tokens": str(calibration.num_tokens), "calibration_seconds": f"{seconds:.1f}", **details,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    save_file(tensors, str(partial), metadata)
    partial.replace(path)  # whole or absent: a reader never sees half a file
    return assemble(loaded, tensors, QuantConfig(method, group_size, lm_head, activations)), calibration, seconds


def int4_tensors(model, weights: dict[str, Int4Weight], norms: bool = True) -> dict[str, torch.Tensor]:
    """The int4 weights of `model`'s projections as flat tensors (what the file holds): per projection '<name>.q'
    (uint8 [out, in / 2], two 4-bit values a byte, even columns in the low nibble), '.scale' and '.zero' (fp32
    [out, in / group]) and '.bias' if any; with `norms`, the norms' '<name>.weight' (AWQ's folded ones)."""
    tensors = {}
    for name, rounded in weights.items():
        linear = model.model.get_submodule(name)
        q = rounded.q.to(torch.uint8)
        tensors[f"{name}.q"] = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
        tensors[f"{name}.scale"], tensors[f"{name}.zero"] = rounded.scale.contiguous(), rounded.zero.contiguous()
        if linear.bias is not None:
            tensors[f"{name}.bias"] = linear.bias.detach().contiguous()
    if not norms:
        return tensors
    names = [f"layers.{i}.{norm}" for i in range(len(model.model.layers)) for _, norm in awq.LAYER_PROJECTIONS if norm]
    for name in [*names, "norm"]:
        tensors[f"{name}.weight"] = model.model.get_submodule(name).weight.detach().contiguous()
    return tensors


def assemble(loaded, tensors: dict[str, torch.Tensor], config):
    """A LoadedModel whose projections are the int4 layers in `tensors` (on any device) and whose norms are the
    folded ones, on `loaded`'s device; the LM head (and the final norm) stay `loaded`'s when `config.lm_head` is off.
    Shares every other tensor with `loaded`."""
    check_device(loaded.device)
    compute = compute_dtype(loaded.device.type, loaded.dtype, "awq")
    tensors = {key: tensor.to(loaded.device) for key, tensor in tensors.items()}
    model = shared_copy(loaded.model)
    names = {key.rpartition(".")[0] for key in tensors if key.endswith(".q")}
    for name in sorted(names):
        if name == "lm_head" and not config.lm_head:
            continue
        packed = tensors[f"{name}.q"]
        q = torch.stack([packed & 15, packed >> 4], -1).view(packed.shape[0], -1).to(torch.int32)  # [out, in]
        bias = tensors.get(f"{name}.bias")
        layer = QuantLinear.from_int4(Int4Weight(q, tensors[f"{name}.scale"], tensors[f"{name}.zero"]),
                                      None if bias is None else nn.Parameter(bias, requires_grad=False), compute, name,
                                      config.activations)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
    for key, weight in tensors.items():
        name = key.removesuffix(".weight")
        if key.endswith(".weight") and (name != "norm" or config.lm_head):
            model.get_submodule(name).weight = nn.Parameter(weight, requires_grad=False)
    return dataclasses.replace(loaded, model=model, quant=config)


def read_metadata(path: Path | str) -> dict[str, str]:
    with safe_open(str(path), "pt") as file:
        return file.metadata() or {}


def load(loaded, path: Path | str, lm_head: bool = True, group_size: int | None = None, method: str = "awq",
         activations: str = "model"):
    """The quantized LoadedModel from a `method` (awq, gptq) file made for `loaded`'s weights (no calibration)."""
    path = Path(path)
    check_device(loaded.device)
    name = method.upper()
    if not path.exists():
        raise ConfigError(f"no {name} file at {path}; make one with `python -m inference_core {method}`.")
    metadata = read_metadata(path)
    if metadata.get("format") != FORMATS[method]:
        article = "an" if method == "awq" else "a"
        raise ConfigError(f"{path} is not {article} {name} file of ours ({FORMATS[method]}); delete it or calibrate "
                          f"again with `python -m inference_core {method}`.")
    fingerprint = model_fingerprint(loaded.model)
    if metadata["model_fingerprint"] != fingerprint:
        raise ConfigError(f"{path} was calibrated for other weights ({metadata['model']} in {metadata['dtype']}, "
                          f"fingerprint {metadata['model_fingerprint']}), not for {loaded.display_name} in "
                          f"{loaded.dtype_name} (fingerprint {fingerprint}); calibrate this model with "
                          f"`python -m inference_core {method} --model {loaded.name} --dtype {loaded.dtype_name}`.")
    stored_group = int(metadata["group_size"])
    if group_size is not None and stored_group != group_size:
        raise ConfigError(f"{path} holds int4 groups of {stored_group}, not {group_size}; pick --quant-group "
                          f"{stored_group} or calibrate group {group_size}.")
    return assemble(loaded, load_file(str(path)), QuantConfig(method, stored_group, lm_head, activations))


def load_or_calibrate(loaded, config: QuantConfig):
    """`quantize(loaded, QuantConfig("awq" or "gptq", g))`: the saved weights for this model, method and group size,
    calibrated and saved first if there are none (a minute or two for the bundled model on a CPU)."""
    method = config.scheme
    if method not in CALIBRATED:
        raise ValueError(f"{method} is not a calibrated scheme")
    path = default_path(loaded, config.group_size, method)
    if path.exists():
        return load(loaded, path, config.lm_head, config.group_size, method, config.activations)
    print(f"[{method}: calibrating {loaded.display_name} at group {config.group_size} on {CALIBRATION_TEXT.name}; "
          f"saved to {path} for next time]", file=sys.stderr, flush=True)
    quantized, _, seconds = calibrate_and_save(loaded, config.group_size, path, lm_head=config.lm_head,
                                               method=method, activations=config.activations,
                                               **DEFAULT_OPTIONS.get(method, {}))
    print(f"[{method}: calibrated in {seconds:.0f} s]", file=sys.stderr, flush=True)
    return quantized


def add_awq_arguments(parser: argparse.ArgumentParser) -> None:
    """`python -m inference_core awq`'s flags."""
    add_model_arguments(parser, dtype="float32")
    parser.add_argument("--quant-group", type=int, default=32, help="input features per int4 scale and zero")
    parser.add_argument("--out", help="the file to write (default: the AWQ cache, where --quant awq looks)")


def _show_awq(name: str, choice: awq.ProjectionChoice) -> None:
    clip = "clipped" if choice.clip is not None else ""
    print(f"{name:32} alpha {choice.alpha:.2f}  output error {choice.awq_error:.2e} (RTN {choice.rtn_error:.2e}, "
          f"x{choice.awq_error / max(choice.rtn_error, 1e-30):.2f}) {clip}", flush=True)


def _show_gptq(name: str, result: gptq.ProjectionResult) -> None:
    print(f"{name:32} output error {result.gptq_error:.2e} (RTN {result.rtn_error:.2e}, "
          f"x{result.gptq_error / max(result.rtn_error, 1e-30):.2f})", flush=True)


def _calibrate_command(args, method: str, show, **options) -> int:
    """`awq` and `gptq`: calibrate, save, print each projection's result and the time taken."""
    QuantConfig(method, args.quant_group)  # checks the group size before the model loads
    loaded = load_model(args.model, args.device, args.dtype)
    check_device(loaded.device)
    _, calibration, seconds = calibrate_and_save(loaded, args.quant_group, args.out, on_projection=show,
                                                 method=method, **options)
    path = Path(args.out) if args.out else default_path(loaded, args.quant_group, method)
    print(f"calibrated on {calibration.num_tokens} tokens in {seconds:.1f} s; wrote {path} "
          f"({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


def run_awq(args) -> int:
    """`python -m inference_core awq`: each projection's alpha and output error against RTN's."""
    return _calibrate_command(args, "awq", _show_awq)


def add_gptq_arguments(parser: argparse.ArgumentParser) -> None:
    """`python -m inference_core gptq`'s flags."""
    add_model_arguments(parser, dtype="float32")
    parser.add_argument("--quant-group", type=int, default=32, help="input features per int4 scale and zero")
    defaults = DEFAULT_OPTIONS["gptq"]
    parser.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=defaults["act_order"],
                        help="static activation order: columns in order of decreasing input energy (diag H), each "
                             "group's grid fixed from the original weights (nothing reordered at run time)")
    parser.add_argument("--on-awq", action=argparse.BooleanOptionalAction, default=defaults["on_awq"],
                        help="run GPTQ on AWQ's scaled weights (AWQ's calibration first, its scales folded; "
                             "--no-on-awq: GPTQ alone, about half the time)")
    parser.add_argument("--out", help="the file to write (default: the cache, where --quant gptq looks)")


def run_gptq(args) -> int:
    """`python -m inference_core gptq`: each projection's output error against RTN's."""
    return _calibrate_command(args, "gptq", _show_gptq, act_order=args.act_order, on_awq=args.on_awq)
