"""Loading a checkpoint once onto a device and dtype (`load_model` -> `LoadedModel`: weights, config, tokenizer), to be
shared by every engine over it, plus two checks on a loaded model: `wake_device` before timed work and
`check_draft_model` for speculative decoding with a second model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_core.checkpoint import read_config, read_weights, resolve_model_dir
from inference_core.config import ConfigError, ModelConfig, parse_device, parse_dtype
from inference_core.kv_cache import RecomputeKVCache
from inference_core.model import WEIGHT_LAYOUTS, CausalLM
from inference_core.runner import ModelRunner
from inference_core.sequence import Sequence
from inference_core.tokenizer import Tokenizer


@dataclass(slots=True)
class LoadedModel:
    """Weights on a device plus the tokenizer: load once, share among engines."""

    name: str
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype

    @property
    def display_name(self) -> str:
        """The model as a person knows it: the bundled GGUF's own model name rather than 'bundled'."""
        if self.name != "bundled":
            return self.name
        from inference_core.bundled import BUNDLED_FILE

        model, quantization = BUNDLED_FILE.removesuffix(".gguf").rsplit(".", 1)
        return f"{model} (the bundled {quantization} GGUF)"

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self.config.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)


def load_model(model: str = "bundled", device: str | None = "auto", dtype: str = "float32",
               layout: str = "auto") -> LoadedModel:
    """Read a checkpoint onto `device` in `dtype`. `layout` picks how projection weights are stored (see
    `model.Linear`): 'auto' takes the measured-faster one for this device and dtype."""
    torch_device, torch_dtype = parse_device(device), parse_dtype(dtype)
    if layout != "auto" and layout not in WEIGHT_LAYOUTS:
        raise ConfigError(f"unknown weight layout {layout!r}; use auto, out_in or in_out.")
    model_dir = resolve_model_dir(model)
    config = read_config(model_dir)
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
    return LoadedModel(model, config, network.eval(), tokenizer, torch_device, torch_dtype)


@torch.inference_mode()
def wake_device(loaded: LoadedModel) -> None:
    """One untimed single-token forward, to run just before timed work. After the device has sat idle for a second
    or more, its first forward runs slower: on a 2-core CPU, after 1.5 s idle a race's lanes reached their first
    token 25-70 ms later (TTFTs of 100-250 ms) than with one forward run just before."""
    ModelRunner(loaded.model, RecomputeKVCache(), loaded.device).run([Sequence([0])])
    if loaded.device.type == "cuda":
        torch.cuda.synchronize(loaded.device)



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
