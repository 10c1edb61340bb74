"""The GGUF conversion cache (`inference_core.model.bundled`): a valid cache is reused without converting or reading its
files, a partial or corrupt one is detected and rebuilt (a byte changed under the same size and time only by the
on-demand full check), a cache without the bundled package is used after its check, a failed conversion leaves
nothing behind, and what the conversion writes equals transformers' own reading of the same GGUF file (every
dequantized weight, q/k un-permutation included, and the chat-template token ids).

The bundled GGUF is converted once into a module-level temporary cache (about 20 s); the tests that damage it each end
with a rebuilt, valid cache. transformers' GGUF model and tokenizer are loaded once for the module (about 20 s).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from inference_core.model import bundled as bundled_module
from inference_core import cli
from inference_core.model.bundled import (VERIFY_ENV, bundled_gguf_path, bundled_model_dir, cache_is_valid, cache_root,
                                    converted_gguf_dir, verify_cache)
from inference_core.config import ConfigError
from inference_core.model.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest: stable run times on a busy CPU

EXPECTED_FILES = ["chat_template.jinja", "config.json", "manifest.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json"]
CHATS = [
    [{"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name a prime."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello. How can I help?"},
     {"role": "user", "content": "Translate 'thé glacé' to English, s'il vous plaît. 🍵"}],
]


@pytest.fixture(autouse=True)
def cheap_check_by_default(monkeypatch):
    """Every test starts with the default start-up check, whatever the environment asks for."""
    monkeypatch.delenv(VERIFY_ENV, raising=False)


@pytest.fixture(scope="module")
def gguf_path():
    return bundled_gguf_path()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("inference-core-cache")


@pytest.fixture(scope="module")
def converted(gguf_path, cache_dir):
    """A fresh conversion of the bundled GGUF into the module's own cache."""
    directory = converted_gguf_dir(gguf_path, cache_dir=cache_dir)
    assert directory == cache_dir / "converted" / gguf_path.stem
    return directory


@pytest.fixture(scope="module")
def transformers_gguf(gguf_path):
    """transformers' own GGUF reading: (model state dict, model config, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    return model.state_dict(), model.config, tokenizer


@pytest.fixture
def count_conversions(monkeypatch):
    """Wrap the real converter and record the staging directory of every conversion."""
    calls = []
    real_convert = bundled_module.convert_gguf

    def spy(gguf_path, out_dir):
        calls.append(out_dir)
        real_convert(gguf_path, out_dir)

    monkeypatch.setattr(bundled_module, "convert_gguf", spy)
    return calls


@pytest.fixture
def count_hashes(monkeypatch):
    """Wrap the real SHA-256 reader and record every file it reads."""
    calls = []
    real_sha256 = bundled_module._sha256

    def spy(path):
        calls.append(path.name)
        return real_sha256(path)

    monkeypatch.setattr(bundled_module, "_sha256", spy)
    return calls


@pytest.fixture
def forbid_conversion(monkeypatch):
    def refuse(gguf_path, out_dir):
        raise AssertionError("a valid cache was converted again")

    monkeypatch.setattr(bundled_module, "convert_gguf", refuse)


def modification_times(directory) -> dict[str, int]:
    return {path.name: path.stat().st_mtime_ns for path in directory.iterdir()}


def assert_clean_valid_cache(directory, gguf_path) -> None:
    assert cache_is_valid(directory, gguf_path, full=True)
    assert sorted(path.name for path in directory.iterdir()) == EXPECTED_FILES
    assert os.listdir(directory.parent) == [directory.name]  # no staging directory left behind


# --- Cache reuse ---------------------------------------------------------------------------------------------------

def test_manifest_describes_every_file(converted, gguf_path):
    manifest = json.loads((converted / "manifest.json").read_text())
    assert manifest["format"] == bundled_module.CACHE_FORMAT
    stat = gguf_path.stat()
    assert manifest["source"] == {"path": str(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    assert sorted(manifest["files"]) == [name for name in EXPECTED_FILES if name != "manifest.json"]
    for name, entry in manifest["files"].items():
        stat = (converted / name).stat()
        assert (entry["size"], entry["mtime_ns"]) == (stat.st_size, stat.st_mtime_ns)
        assert entry["sha256"] == bundled_module._sha256(converted / name)
    assert_clean_valid_cache(converted, gguf_path)


def test_valid_cache_is_reused_without_reading_it(converted, gguf_path, cache_dir, forbid_conversion, count_hashes):
    before = modification_times(converted)
    assert converted_gguf_dir(gguf_path, cache_dir=cache_dir) == converted
    assert modification_times(converted) == before
    assert count_hashes == []  # sizes and modification times only


def test_touched_file_is_rehashed_once(converted, gguf_path, cache_dir, forbid_conversion, count_hashes):
    """A newer modification time with the same content (a copy, a touch): that file alone is re-hashed, the manifest
    records its new time, and the next start reads nothing again."""
    weights = converted / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert converted_gguf_dir(gguf_path, cache_dir=cache_dir) == converted
    assert count_hashes == ["model.safetensors"]
    manifest = json.loads((converted / "manifest.json").read_text())
    assert manifest["files"]["model.safetensors"]["mtime_ns"] == stat.st_mtime_ns + 10**9
    count_hashes.clear()
    assert converted_gguf_dir(gguf_path, cache_dir=cache_dir) == converted
    assert count_hashes == []
    assert_clean_valid_cache(converted, gguf_path)


def test_verify_cache_rehashes_every_file(converted, gguf_path, cache_dir, forbid_conversion, count_hashes,
                                          monkeypatch, capsys):
    monkeypatch.setenv("INFERENCE_CORE_CACHE", str(cache_dir))
    assert verify_cache() == (converted, False)
    assert sorted(count_hashes) == [name for name in EXPECTED_FILES if name != "manifest.json"]
    assert cli.main(["verify-cache"]) == 0
    assert capsys.readouterr().out.startswith(f"{converted}: every file matches its SHA-256 (")
    assert cli.main(["verify-cache", "--model", "Qwen/Qwen3-0.6B"]) == 2
    assert "give 'bundled' or an existing .gguf file" in capsys.readouterr().err


def test_cache_without_the_bundled_package(converted, gguf_path, cache_dir, monkeypatch, forbid_conversion):
    """The Docker image ships the converted cache without the GGUF: the cache is checked against its own manifest and
    used; a damaged one is refused with what to install, since there is nothing to convert it from."""
    def not_installed():
        raise ConfigError("the bundled model is not installed")

    monkeypatch.setattr(bundled_module, "bundled_gguf_path", not_installed)
    assert bundled_model_dir(cache_dir=cache_dir) == converted
    config = converted / "config.json"
    original = config.read_text()
    try:
        config.write_text(original.replace('"num_hidden_layers": 30', '"num_hidden_layers": 29'))  # same size
        with pytest.raises(ConfigError, match="requirements-tools.txt"):
            bundled_model_dir(cache_dir=cache_dir)
    finally:
        config.write_text(original)
    with pytest.raises(ConfigError, match="not installed"):
        bundled_model_dir(cache_dir=cache_dir / "empty")
    assert_clean_valid_cache(converted, gguf_path)


def test_conversion_without_the_tools_says_what_to_install(gguf_path, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"needs gguf, .*pip install -r requirements-tools.txt"):
        bundled_module.convert_gguf(gguf_path, tmp_path)
    assert os.listdir(tmp_path) == []


def test_cache_root_follows_the_environment(converted, gguf_path, cache_dir, monkeypatch, forbid_conversion):
    monkeypatch.setenv("INFERENCE_CORE_CACHE", str(cache_dir))
    assert cache_root() == cache_dir
    assert converted_gguf_dir(gguf_path) == converted  # found through the variable, not converted again
    monkeypatch.delenv("INFERENCE_CORE_CACHE")
    assert cache_root() != cache_dir


# --- Damaged caches -------------------------------------------------------------------------------------------------

def test_partial_cache_is_rebuilt(converted, gguf_path, cache_dir, count_conversions):
    (converted / "manifest.json").unlink()  # what a conversion cut short looks like
    assert not cache_is_valid(converted, gguf_path)
    assert converted_gguf_dir(gguf_path, cache_dir=cache_dir) == converted
    assert len(count_conversions) == 1 and count_conversions[0].parent == converted.parent
    assert_clean_valid_cache(converted, gguf_path)


def truncate(path) -> None:
    os.truncate(path, path.stat().st_size - 4096)


def flip_byte_keeping_time(path) -> None:
    """Flip one bit in the middle of the weight data: same size and modification time, different content."""
    stat = path.stat()
    with open(path, "r+b") as f:
        f.seek(stat.st_size // 2)
        value = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([value ^ 0x01]))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_truncated_weights_are_detected_and_rebuilt(converted, gguf_path, cache_dir, count_conversions):
    weights = converted / "model.safetensors"
    size = weights.stat().st_size
    truncate(weights)
    assert not cache_is_valid(converted, gguf_path)  # the size alone tells
    assert converted_gguf_dir(gguf_path, cache_dir=cache_dir) == converted
    assert len(count_conversions) == 1
    assert weights.stat().st_size == size
    assert_clean_valid_cache(converted, gguf_path)


def test_flipped_byte_is_found_by_the_full_check_only(converted, gguf_path, cache_dir, count_conversions,
                                                      monkeypatch):
    """A byte changed under the same size and time passes the start-up check; INFERENCE_CORE_VERIFY_CACHE=1 finds it
    and rebuilds."""
    flip_byte_keeping_time(converted / "model.safetensors")
    assert cache_is_valid(converted, gguf_path)
    assert not cache_is_valid(converted, gguf_path, full=True)
    assert converted_gguf_dir(gguf_path, cache_dir=cache_dir) == converted
    assert count_conversions == []
    monkeypatch.setenv(VERIFY_ENV, "1")
    assert converted_gguf_dir(gguf_path, cache_dir=cache_dir) == converted
    assert len(count_conversions) == 1
    assert_clean_valid_cache(converted, gguf_path)


@pytest.mark.parametrize("change", ["config", "format", "source"])
def test_other_mismatches_invalidate_the_cache(converted, gguf_path, change):
    """Edited metadata is detected too (checked without rebuilding; the files are restored afterwards)."""
    name = "config.json" if change == "config" else "manifest.json"
    path = converted / name
    original = path.read_text()
    try:
        if change == "config":
            path.write_text(original.replace('"num_hidden_layers": 30', '"num_hidden_layers": 29'))
        else:
            manifest = json.loads(original)
            if change == "format":
                manifest["format"] = bundled_module.CACHE_FORMAT + 1
            else:
                manifest["source"]["mtime_ns"] += 1  # the GGUF file was replaced since the conversion
            path.write_text(json.dumps(manifest))
        assert path.read_text() != original
        assert not cache_is_valid(converted, gguf_path)
    finally:
        path.write_text(original)
    assert cache_is_valid(converted, gguf_path)


def test_failed_conversion_leaves_nothing(gguf_path, tmp_path, monkeypatch):
    def crash(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(bundled_module, "convert_gguf", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        converted_gguf_dir(gguf_path, cache_dir=tmp_path)
    assert os.listdir(tmp_path / "converted") == []  # neither the target nor the staging directory


# --- Equality with transformers -------------------------------------------------------------------------------------

def test_weights_equal_transformers_dequantization(converted, transformers_gguf):
    reference, _, _ = transformers_gguf
    ours = load_file(str(converted / "model.safetensors"))
    # The bundled model ties its LM head to the embedding: transformers lists it, the converted file does not.
    assert set(reference) - set(ours) == {"lm_head.weight"} and set(ours) <= set(reference)
    assert torch.equal(reference["lm_head.weight"], reference["model.embed_tokens.weight"])
    assert len(ours) == 2 + 30 * 9  # embedding, final norm, 9 tensors per layer
    assert "model.layers.0.self_attn.q_proj.weight" in ours and "model.layers.29.self_attn.k_proj.weight" in ours
    mismatched = [name for name, tensor in ours.items()
                  if tensor.dtype != torch.float32 or not torch.equal(tensor, reference[name])]
    assert mismatched == []


def test_config_equals_transformers(converted, transformers_gguf):
    _, reference, _ = transformers_gguf
    ours = json.loads((converted / "config.json").read_text())
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "vocab_size", "bos_token_id", "eos_token_id",
                  "tie_word_embeddings"):
        assert ours[field] == getattr(reference, field), field
    assert ours["rms_norm_eps"] == pytest.approx(reference.rms_norm_eps, rel=1e-6)
    assert ours["rope_theta"] == reference.rope_parameters["rope_theta"]
    assert (ours["num_hidden_layers"], ours["num_key_value_heads"], ours["head_dim"]) == (30, 3, 64)


@pytest.mark.parametrize("chat_index", range(len(CHATS)))
def test_chat_encoding_equals_transformers(converted, transformers_gguf, chat_index):
    _, _, reference = transformers_gguf
    messages = CHATS[chat_index]
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else list(expected)
    ours = Tokenizer(converted).encode_chat(messages)
    assert ours == expected
    generation_prompt = reference.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ours[-len(generation_prompt):] == generation_prompt


def test_plain_text_round_trip_equals_transformers(converted, transformers_gguf):
    _, _, reference = transformers_gguf
    tokenizer = Tokenizer(converted)
    text = "Once upon a time, in a village by the sea — naïve café owners counted 1,234 fish.\n\tdef f(x): return x"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.eos_token == reference.eos_token and tokenizer.eos_token_ids == (reference.eos_token_id,)
