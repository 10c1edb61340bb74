"""Finding and reading checkpoints: the bundled GGUF, a local directory (config.json + safetensors), or a Hugging
Face Hub id. Returns our `ModelConfig`, the weights renamed and fused for our model, and the tokenizer directory.

Anything we cannot run is refused here with a message that says what to change: a missing path or file, an
unsupported architecture, a model that needs trust_remote_code, a Hub id while offline.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from safetensors.torch import load_file

from inference_core.config import ConfigError, ModelConfig
from inference_core.model.bundled import BUNDLED_NAMES, bundled_model_dir, converted_gguf_dir

# What a Hub id downloads: the files this module and the tokenizer read (a chat_template.jinja only where the
# repository has one), and the shard index transformers needs for the benches' peer. The README's `preload_from_hub`
# lists the same files of the Space's default model, so that a Space starts without downloading.
HUB_FILE_PATTERNS = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                     "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def resolve_model_dir(spec: str) -> Path:
    """'bundled' | path to a .gguf file | local directory | Hub id (owner/name) -> a local directory."""
    if spec in BUNDLED_NAMES:
        return bundled_model_dir()
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ConfigError(f"GGUF file {spec!r} does not exist.")
        return converted_gguf_dir(path.resolve())
    if path.is_dir():
        return path
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise ConfigError(f"model {spec!r} is neither 'bundled', an existing directory, a .gguf file, nor a Hugging "
                          "Face Hub id like Qwen/Qwen3-0.6B.")
    return _download_from_hub(spec)


def _download_from_hub(repo_id: str) -> Path:
    try:
        return Path(snapshot_download(repo_id, allow_patterns=list(HUB_FILE_PATTERNS)))
    except Exception as error:  # network down, gated repo, unknown id: all need the same advice
        raise ConfigError(f"could not fetch {repo_id!r} from the Hugging Face Hub ({type(error).__name__}: "
                          f"{error}). Check the id and the network, or pass a local directory.") from error


def read_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir} has no config.json; point --model at a Hugging Face model directory.")
    hf = json.loads(path.read_text())
    generation = model_dir / "generation_config.json"
    config = ModelConfig.from_hf_dict(hf, source=str(path))
    if generation.is_file():  # chat models often list their end-of-turn token only here
        eos = json.loads(generation.read_text()).get("eos_token_id")
        extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        merged = tuple(dict.fromkeys([*config.eos_token_ids, *extra]))
        config = dataclasses.replace(config, eos_token_ids=merged)
    return config


def read_weights(model_dir: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Load safetensors (single or sharded) and fuse q/k/v and gate/up into our model's parameter names."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir} has no *.safetensors weights (other weight formats are not supported).")
    raw: dict[str, torch.Tensor] = {}
    for file in files:
        raw.update(load_file(str(file)))
    fused: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        try:
            return raw.pop(name)
        except KeyError:
            raise ConfigError(f"{model_dir}: weight {name!r} is missing from the checkpoint.") from None

    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        fused[dst + "self_attn.qkv_proj.weight"] = torch.cat(
            [take(attn + "q_proj.weight"), take(attn + "k_proj.weight"), take(attn + "v_proj.weight")])
        if config.qkv_bias:
            fused[dst + "self_attn.qkv_proj.bias"] = torch.cat(
                [take(attn + "q_proj.bias"), take(attn + "k_proj.bias"), take(attn + "v_proj.bias")])
        if config.qk_norm:
            fused[dst + "self_attn.q_norm.weight"] = take(attn + "q_norm.weight")
            fused[dst + "self_attn.k_norm.weight"] = take(attn + "k_norm.weight")
        fused[dst + "self_attn.o_proj.weight"] = take(attn + "o_proj.weight")
        fused[dst + "mlp.gate_up_proj.weight"] = torch.cat(
            [take(src + "mlp.gate_proj.weight"), take(src + "mlp.up_proj.weight")])
        fused[dst + "mlp.down_proj.weight"] = take(src + "mlp.down_proj.weight")
        fused[dst + "input_layernorm.weight"] = take(src + "input_layernorm.weight")
        fused[dst + "post_attention_layernorm.weight"] = take(src + "post_attention_layernorm.weight")
    fused["embed_tokens.weight"] = take("model.embed_tokens.weight")
    fused["norm.weight"] = take("model.norm.weight")
    if not config.tie_word_embeddings:
        fused["lm_head.weight"] = take("lm_head.weight")
    raw.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
    return fused
