"""Loading a checkpoint once onto a device and dtype (`load_model` -> `LoadedModel`: weights, config, tokenizer), to be
shared by every engine over it, plus `check_draft_model`, which refuses a second model that cannot draft for the
first.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from inference_core.config import ConfigError, ModelConfig, parse_device, parse_dtype
from inference_core.model.bundled import BUNDLED_FILE
from inference_core.model.checkpoint import read_config, read_weights, resolve_model_dir
from inference_core.model.dtype_choice import choose_dtype
from inference_core.model.llama import WEIGHT_LAYOUTS, CausalLM, weight_layout
from inference_core.model.tokenizer import Tokenizer


@dataclass(slots=True)
class LoadedModel:
    """Weights on a device plus the tokenizer: load once, share among engines."""

    name: str
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype
    dtype_reason: str = ""  # why this dtype: 'as asked', or what `--dtype auto` found (see choose_dtype)
    quant: object = None  # the projections' quantization (`quant.QuantConfig`), None: the model dtype

    @property
    def display_name(self) -> str:
        """The model as a person knows it: the bundled GGUF's own model name rather than 'bundled'."""
        if self.name != "bundled":
            return self.name

        model, quantization = BUNDLED_FILE.removesuffix(".gguf").rsplit(".", 1)
        return f"{model} (the bundled {quantization} GGUF)"

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self.config.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)


def load_model(model: str = "bundled", device: str | None = "auto", dtype: str = "float32",
               layout: str = "auto") -> LoadedModel:
    """Read a checkpoint onto `device` in `dtype` ('auto': the fastest for this device, see `choose_dtype`).
    `layout` picks how projection weights are stored (see `model.Linear`): 'auto' takes the measured-faster one for
    this device and dtype."""
    torch_device = parse_device(device)
    if dtype != "auto":
        torch_dtype, reason = parse_dtype(dtype), "as asked"
    if layout != "auto" and layout not in WEIGHT_LAYOUTS:
        raise ConfigError(f"unknown weight layout {layout!r}; use auto, {', '.join(WEIGHT_LAYOUTS)}.")
    model_dir = resolve_model_dir(model)
    config = read_config(model_dir)
    if dtype == "auto":
        torch_dtype, reason = choose_dtype(torch_device, config)
    if layout == "packed" and weight_layout(torch_device, torch_dtype) != "packed":
        raise ConfigError("the packed weight layout is for bfloat16 on a CPU with native bf16 math and oneDNN; use "
                          "auto, out_in or in_out here.")
    tokenizer = Tokenizer(model_dir)
    weights = read_weights(model_dir, config)
    with torch.device("meta"):  # no random init: every parameter is assigned from the checkpoint below
        network = CausalLM(config)
    tensors = {name: w.to(device=torch_device, dtype=torch_dtype) for name, w in weights.items()}
    missing, unexpected = network.load_state_dict(tensors, strict=False, assign=True)
    missing = [name for name in missing if not (name == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ConfigError(f"checkpoint does not match the model: missing {missing}, unexpected {unexpected}.")
    if config.tie_word_embeddings:  # the LM head reads the embedding matrix (a copy only if it gets transposed)
        network.lm_head.weight = network.embed_tokens.weight
    network.configure_kernels(torch_device, torch_dtype, layout)
    network.rope_inv_freq = network.rope_inv_freq.to(torch_device)
    return LoadedModel(model, config, network.eval(), tokenizer, torch_device, torch_dtype, reason)


def check_draft_model(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft model that cannot draft for `target`: its token ids must mean the same text (the same
    tokenizer vocabulary), and it must live on the same device."""
    if draft.device != target.device:
        raise ConfigError(f"the draft model is on {draft.device} but the target is on {target.device}; load both on "
                          "one device.")
    if draft.tokenizer.vocabulary() != target.tokenizer.vocabulary():
        raise ConfigError(f"the draft model {draft.name!r} has a different tokenizer from {target.name!r} "
                          f"({draft.tokenizer.vocab_size} vs {target.tokenizer.vocab_size} tokens, or the same ids "
                          "for different text); a draft model must share the target's tokenizer.")


def add_model_arguments(parser: argparse.ArgumentParser, dtype: str = "auto") -> None:
    """The flags every command that loads a model shares: --model, --device, --dtype."""
    parser.add_argument("--model", default="bundled",
                        help="'bundled' (SmolLM2-135M-Instruct), a local directory, a .gguf file or a Hub id")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default=dtype,
                        help="auto (the fastest here: bfloat16 on CUDA, and on a CPU with native bf16 math where it "
                             "measures faster, measured once per host and model shape; float32 otherwise), float32, "
                             f"bfloat16 or float16 (default: {dtype})")
