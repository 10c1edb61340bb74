"""The GGUF conversion cache (`inference_core.bundled`): a valid cache is reused without converting, a partial or
corrupt one is detected and rebuilt, a failed conversion leaves nothing behind, and what the conversion writes equals
transformers' own reading of the same GGUF file (every dequantized weight, q/k un-permutation included, and the
chat-template token ids).

The bundled GGUF is converted once into a module-level temporary cache (about 20 s); the tests that damage it each end
with a rebuilt, valid cache. transformers' GGUF model and tokenizer are loaded once for the module (about 20 s).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from inference_core import bundled as bundled_module
from inference_core.bundled import bundled_gguf_path, cache_is_valid, cache_root, converted_gguf_dir
from inference_core.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest: stable run times on a busy CPU

EXPECTED_FILES = ["chat_template.jinja", "config.json", "manifest.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json"]
CHATS = [
    [{"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name a prime."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello. How can I help?"},
     {"role": "user", "content": "Translate 'thé glacé' to English, s'il vous plaît. 🍵"}],
]


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
def forbid_conversion(monkeypatch):
    def refuse(gguf_path, out_dir):
        raise AssertionError("a valid cache was converted again")

    monkeypatch.setattr(bundled_module, "convert_gguf", refuse)


def modification_times(directory) -> dict[str, int]:
    return {path.name: path.stat().st_mtime_ns for path in directory.iterdir()}


def assert_clean_valid_cache(directory, gguf_path) -> None:
    assert cache_is_valid(directory, gguf_path)
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
        assert entry["size"] == (converted / name).stat().st_size
        assert entry["sha256"] == bundled_module._sha256(converted / name)
    assert_clean_valid_cache(converted, gguf_path)


def test_valid_cache_is_reused(converted, gguf_path, cache_dir, forbid_conversion):
    before = modification_times(converted)
    assert converted_gguf_dir(gguf_path, cache_dir=cache_dir) == converted
    assert modification_times(converted) == before


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


def flip_byte(path) -> None:
    """Flip one bit in the middle of the weight data: same size, different content."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        value = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([value ^ 0x01]))


@pytest.mark.parametrize("damage", [truncate, flip_byte], ids=["truncated", "flipped-byte"])
def test_corrupt_weights_are_detected_and_rebuilt(converted, gguf_path, cache_dir, count_conversions, damage):
    weights = converted / "model.safetensors"
    size = weights.stat().st_size
    damage(weights)
    assert not cache_is_valid(converted, gguf_path)
    assert converted_gguf_dir(gguf_path, cache_dir=cache_dir) == converted
    assert len(count_conversions) == 1
    assert weights.stat().st_size == size
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
