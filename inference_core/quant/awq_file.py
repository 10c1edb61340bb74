"""AWQ weights on disk: calibrate once, save, and load them again with no calibration (`inference_core.quant.awq`
owns the method).

`calibrate_and_save(loaded, group_size)` runs the calibration on the text shipped in `data/calibration_text.txt`
(the first five chapters of Jane Austen's *Pride and Prejudice*, 1813, public domain: Project Gutenberg eBook #1342,
line endings as LF) and writes one safetensors file: the int4 weights (`quantized_tensors`), the folded norm
weights, and metadata (group size, alpha per projection, the model's fingerprint, the calibration text's hash).
`load(loaded, path)` rebuilds the quantized model from it and refuses a file made for other weights or another
group size; it loads onto the CPU or CUDA, in each device's int4 layout (`inference_core.quant.kernels`), whichever
device calibrated it. Files live in `$INFERENCE_CORE_AWQ_CACHE`, else `awq/` in the local cache
(~/.cache/inference-playground), as `<model fingerprint>-g<group>.safetensors`; `load_or_calibrate` (behind
`quantize(loaded, QuantConfig("awq", g))`) loads that file when it exists and calibrates and saves it otherwise.
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
from inference_core.quant import awq
from inference_core.quant.kernels import check_device
from inference_core.quant.linear import Int4Weight, QuantConfig, QuantLinear, compute_dtype, round_int4, shared_copy

CALIBRATION_TEXT = DATA_DIR / "calibration_text.txt"
SEQUENCE_TOKENS = 512  # tokens per calibration sequence
MAX_SEQUENCES = 16
FORMAT = "awq-int4-v1"


def awq_cache_dir() -> Path:
    """Where AWQ files are kept: env INFERENCE_CORE_AWQ_CACHE, else `awq/` in the local cache."""
    return Path(os.environ.get("INFERENCE_CORE_AWQ_CACHE") or cache_root() / "awq")


def default_path(loaded, group_size: int) -> Path:
    return awq_cache_dir() / f"{model_fingerprint(loaded.model)}-g{group_size}.safetensors"


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
                       clip_ratios=awq.CLIP_RATIOS, on_projection=None, lm_head: bool = True):
    """Calibrate `loaded` (a float model) at `group_size`, write the AWQ file (default: `default_path`) and return
    (the quantized LoadedModel, the Calibration, seconds taken). `sequences` default to the shipped text's."""
    started = time.perf_counter()
    path = Path(path) if path is not None else default_path(loaded, group_size)
    text_hash = hashlib.sha256(CALIBRATION_TEXT.read_bytes()).hexdigest()[:16] if sequences is None else "-"
    sequences = sequences if sequences is not None else calibration_sequences(loaded.tokenizer)
    calibration = awq.calibrate(loaded, group_size, sequences, alphas, clip_ratios, on_projection)
    folded = awq.fold_scales(loaded, {name: choice.scale for name, choice in calibration.choices.items()})
    tensors = {key: tensor.cpu() for key, tensor in quantized_tensors(folded, calibration).items()}
    seconds = time.perf_counter() - started
    metadata = {
        "format": FORMAT, "group_size": str(group_size), "model_fingerprint": model_fingerprint(loaded.model),
        "model": loaded.display_name, "dtype": loaded.dtype_name,
        "calibration_text_sha256": text_hash, "calibration_tokens_sha256": sequences_hash(sequences),
        "calibration_tokens": str(calibration.num_tokens), "calibration_seconds": f"{seconds:.1f}",
        "alphas": json.dumps({name: choice.alpha for name, choice in calibration.choices.items()}),
        "clipped": json.dumps([name for name, choice in calibration.choices.items() if choice.clip is not None]),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    save_file(tensors, str(partial), metadata)
    partial.replace(path)  # whole or absent: a reader never sees half a file
    return assemble(loaded, tensors, QuantConfig("awq", group_size, lm_head)), calibration, seconds


def quantized_tensors(folded, calibration: awq.Calibration) -> dict[str, torch.Tensor]:
    """The int4 weights of a folded model as flat tensors (what the AWQ file holds): per projection '<name>.q'
    (uint8 [out, in / 2], two 4-bit values a byte, even columns in the low nibble), '.scale' and '.zero' (fp32
    [out, in / group]) and '.bias' if any; the folded norms' '<name>.weight'."""
    tensors = {}
    for name, choice in calibration.choices.items():
        linear = folded.model.get_submodule(name)
        rounded = round_int4(awq.out_in(linear), calibration.group_size, choice.clip)
        q = rounded.q.to(torch.uint8)
        tensors[f"{name}.q"] = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
        tensors[f"{name}.scale"], tensors[f"{name}.zero"] = rounded.scale.contiguous(), rounded.zero.contiguous()
        if linear.bias is not None:
            tensors[f"{name}.bias"] = linear.bias.detach().contiguous()
    norms = [f"layers.{i}.{norm}" for i in range(len(folded.model.layers)) for _, norm in awq.LAYER_PROJECTIONS if norm]
    for name in [*norms, "norm"]:
        tensors[f"{name}.weight"] = folded.model.get_submodule(name).weight.detach().contiguous()
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
                                      None if bias is None else nn.Parameter(bias, requires_grad=False), compute, name)
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


def load(loaded, path: Path | str, lm_head: bool = True, group_size: int | None = None):
    """The quantized LoadedModel from an AWQ file made for `loaded`'s weights (no calibration)."""
    path = Path(path)
    check_device(loaded.device)
    if not path.exists():
        raise ConfigError(f"no AWQ file at {path}; make one with `python -m inference_core awq`.")
    metadata = read_metadata(path)
    if metadata.get("format") != FORMAT:
        raise ConfigError(f"{path} is not an AWQ file of ours ({FORMAT}); delete it or calibrate again with "
                          "`python -m inference_core awq`.")
    fingerprint = model_fingerprint(loaded.model)
    if metadata["model_fingerprint"] != fingerprint:
        raise ConfigError(f"{path} was calibrated for other weights ({metadata['model']} in {metadata['dtype']}, "
                          f"fingerprint {metadata['model_fingerprint']}), not for {loaded.display_name} in "
                          f"{loaded.dtype_name} (fingerprint {fingerprint}); calibrate this model with "
                          f"`python -m inference_core awq --model {loaded.name} --dtype {loaded.dtype_name}`.")
    stored_group = int(metadata["group_size"])
    if group_size is not None and stored_group != group_size:
        raise ConfigError(f"{path} holds int4 groups of {stored_group}, not {group_size}; pick --quant-group "
                          f"{stored_group} or calibrate group {group_size}.")
    return assemble(loaded, load_file(str(path)), QuantConfig("awq", stored_group, lm_head))


def load_or_calibrate(loaded, config: QuantConfig):
    """`quantize(loaded, QuantConfig("awq", g))`: the saved AWQ weights for this model and group size, calibrated
    and saved first if there are none (about a minute for the bundled model on a CPU)."""
    path = default_path(loaded, config.group_size)
    if path.exists():
        return load(loaded, path, config.lm_head, config.group_size)
    print(f"[awq: calibrating {loaded.display_name} at group {config.group_size} on {CALIBRATION_TEXT.name}; saved "
          f"to {path} for next time]", file=sys.stderr, flush=True)
    quantized, _, seconds = calibrate_and_save(loaded, config.group_size, path, lm_head=config.lm_head)
    print(f"[awq: calibrated in {seconds:.0f} s]", file=sys.stderr, flush=True)
    return quantized


def add_awq_arguments(parser: argparse.ArgumentParser) -> None:
    """`python -m inference_core awq`'s flags."""
    add_model_arguments(parser, dtype="float32")
    parser.add_argument("--quant-group", type=int, default=32, help="input features per int4 scale and zero")
    parser.add_argument("--out", help="the file to write (default: the AWQ cache, where --quant awq looks)")


def run_awq(args) -> int:
    """`python -m inference_core awq`: calibrate, save, print the time taken and each projection's alpha."""
    QuantConfig("awq", args.quant_group)  # checks the group size before the model loads
    loaded = load_model(args.model, args.device, args.dtype)
    check_device(loaded.device)

    def show(name: str, choice: awq.ProjectionChoice) -> None:
        clip = "clipped" if choice.clip is not None else ""
        print(f"{name:32} alpha {choice.alpha:.2f}  output error {choice.awq_error:.2e} (RTN {choice.rtn_error:.2e}, "
              f"x{choice.awq_error / max(choice.rtn_error, 1e-30):.2f}) {clip}", flush=True)

    _, calibration, seconds = calibrate_and_save(loaded, args.quant_group, args.out, on_projection=show)
    path = Path(args.out) if args.out else default_path(loaded, args.quant_group)
    print(f"calibrated on {calibration.num_tokens} tokens in {seconds:.1f} s; wrote {path} "
          f"({path.stat().st_size / 2**20:.1f} MiB)")
    return 0
