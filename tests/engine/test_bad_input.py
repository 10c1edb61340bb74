"""Bad input is refused with a `ConfigError` (a ValueError) whose message says what to change, and a refused or failed
request leaves no KV block or active request behind.

Request-level checks (empty prompts, prompts longer than the context, bad max_new_tokens) use the bundled model with a
64-token context; checkpoint-level checks (missing files, unsupported architectures, remote code) use a tiny random
Llama written into a temporary directory, so that loading it costs milliseconds.
"""

from __future__ import annotations

import re

import json
import shutil

import pytest
import torch
from tokenizers import Tokenizer as FastTokenizer
from tokenizers import models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM

import inference_core
from inference_core import ConfigError, EngineConfig, SamplingParams, load_model
from conftest import assert_nothing_held, make_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest: stable run times on a busy CPU

CONTEXT = 64


@pytest.fixture(scope="module")
def paged(bundled):
    return make_engine(bundled, "paged", max_seq_len=CONTEXT)


def text_ids(loaded, count: int) -> list[int]:
    ids = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 40, add_special_tokens=False)
    assert len(ids) >= count
    return ids[:count]


# --- Request validation -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, words", [
    ("", ["prompt is empty", "type some text"]),
    ("  \n\t ", ["prompt is empty"]),
    ([], ["conversation is empty", "type a message"]),
    ([{"role": "user", "content": "   "}], ["conversation is empty"]),
    ([{"role": "system", "content": ""}, {"role": "user", "content": ""}], ["conversation is empty"]),
])
def test_empty_prompt(paged, prompt, words):
    with pytest.raises(ConfigError) as error:
        paged.generate(prompt, SamplingParams(max_new_tokens=4))
    for word in words:
        assert word in str(error.value)
    assert_nothing_held(paged)


def test_empty_plain_completion_prompt(paged):
    with pytest.raises(ConfigError, match="prompt is empty"):
        paged.generate(" ", SamplingParams(max_new_tokens=4), chat=False)
    assert_nothing_held(paged)


def test_prompt_longer_than_context(paged):
    prompt = "Tell me everything about " + "the history of tea, " * 30
    num_tokens = len(paged.prompt_ids(prompt))
    assert num_tokens > CONTEXT
    with pytest.raises(ConfigError) as error:
        paged.generate(prompt, SamplingParams(max_new_tokens=4))
    message = str(error.value)
    assert f"the prompt has {num_tokens} tokens but the context holds {CONTEXT}" in message
    assert f"shorten the prompt by at least {num_tokens - CONTEXT + 1} tokens" in message
    assert "--max-seq-len" in message
    # The playground names what to change on the page: no command-line flag.
    assert error.value.in_words({"longer_context": ""}).endswith(
        f"shorten the prompt by at least {num_tokens - CONTEXT + 1} tokens.")
    assert_nothing_held(paged)


def test_prompt_filling_the_whole_context_is_refused(bundled, paged):
    with pytest.raises(ConfigError, match=f"has {CONTEXT} tokens but the context holds {CONTEXT}"):
        paged.generate(text_ids(bundled, CONTEXT), SamplingParams(max_new_tokens=1))
    assert_nothing_held(paged)


@pytest.mark.parametrize("value", [0, -1, 2.5, "8", True])
def test_max_new_tokens_must_be_a_positive_integer(value):
    with pytest.raises(ConfigError, match=re.escape(f"max_new_tokens must be an integer of at least 1 "
                                                    f"(--max-new-tokens), got {value!r}")):
        SamplingParams(max_new_tokens=value)


def test_max_new_tokens_beyond_the_context(bundled, paged):
    prompt_ids = text_ids(bundled, 56)  # room for 64 - 56 = 8 new tokens
    with pytest.raises(ConfigError) as error:
        paged.generate(prompt_ids, SamplingParams(max_new_tokens=9))
    message = str(error.value)
    assert "9 new tokens do not fit" in message
    assert "the prompt has 56 tokens and the context holds 64" in message
    assert "set --max-new-tokens to 8 or less" in message
    assert "set 'max new tokens' to 8 or less" in error.value.in_words({"max_new_tokens": "'max new tokens'"})
    assert_nothing_held(paged)


def test_default_max_new_tokens_is_refused_on_a_short_context(bundled, paged):
    with pytest.raises(ConfigError, match="set --max-new-tokens to 54 or less"):
        paged.generate(text_ids(bundled, 10), SamplingParams())  # the default asks for 256
    assert_nothing_held(paged)


@pytest.mark.parametrize("kv_mode", ["paged", "contiguous"])
def test_max_new_tokens_that_exactly_fill_the_context_run(bundled, paged, kv_mode):
    engine = paged if kv_mode == "paged" else make_engine(bundled, "contiguous", max_seq_len=CONTEXT)
    result = engine.complete(text_ids(bundled, 56), SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert len(result.token_ids) == 8 and result.stats.finish_reason == "length"
    assert_nothing_held(engine)


@pytest.mark.parametrize("settings, words", [
    (dict(temperature=-1.0), ["temperature must be 0 (greedy) or at least 0.001", "got -1.0"]),
    (dict(temperature=1e-300), ["temperature must be 0 (greedy) or at least 0.001", "overflow"]),
    (dict(top_p=0.0), ["top_p must be in (0, 1]", "got 0.0"]),
    (dict(top_p=1.5), ["top_p must be in (0, 1]", "got 1.5"]),
    (dict(top_k=-1), ["top_k must be >= 0", "got -1"]),
    (dict(stop=("end", "")), ["stop strings must not be empty"]),
])
def test_bad_sampling_values(settings, words):
    with pytest.raises(ConfigError) as error:
        SamplingParams(**settings)
    for word in words:
        assert word in str(error.value)


@pytest.mark.parametrize("token_id", [49152, -1])
def test_prompt_ids_outside_the_vocabulary(paged, token_id):
    with pytest.raises(ConfigError, match="(?i)vocab"):
        paged.generate([1, token_id], SamplingParams(max_new_tokens=2))


@pytest.mark.parametrize("token_id", [49152, -1])
def test_failed_out_of_vocabulary_request_holds_nothing(paged, token_id):
    with pytest.raises((ConfigError, IndexError)):
        list(paged.generate([1, token_id], SamplingParams(max_new_tokens=2)))
    assert_nothing_held(paged)


@pytest.mark.parametrize("prompt_tokens, max_new_tokens", [(40, 2), (20, 20)])
def test_request_larger_than_the_kv_pool(bundled, prompt_tokens, max_new_tokens):
    engine = make_engine(bundled, "paged", max_seq_len=CONTEXT, kv_cache_tokens=32)
    with pytest.raises(ConfigError, match="(?i)kv"):
        engine.generate(text_ids(bundled, prompt_tokens), SamplingParams(max_new_tokens=max_new_tokens))


@pytest.mark.parametrize("prompt_tokens, max_new_tokens", [(40, 2), (20, 20)])
def test_request_larger_than_the_kv_pool_holds_nothing(bundled, prompt_tokens, max_new_tokens):
    """A 32-token pool (2 blocks): a 40-token prompt cannot be placed; a 20-token prompt runs out of blocks while
    decoding. Either way every block comes back."""
    engine = make_engine(bundled, "paged", max_seq_len=CONTEXT, kv_cache_tokens=32)
    with pytest.raises((ConfigError, RuntimeError), match="(?i)kv"):
        list(engine.generate(text_ids(bundled, prompt_tokens),
                             SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)))
    assert_nothing_held(engine)


# --- Engine settings ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("settings, words", [
    (dict(kv_mode="flash"), ["unknown KV mode 'flash'", "none, contiguous, paged"]),
    (dict(block_size=0), ["block size must be a positive integer", "got 0"]),
    (dict(block_size=-16), ["block size must be a positive integer"]),
    (dict(block_size=8.0), ["block size must be a positive integer"]),
    (dict(max_seq_len=1), ["max_seq_len must be at least 2"]),
    (dict(kv_cache_tokens=8, block_size=16), ["kv_cache_tokens (8) must hold at least one block of 16 tokens"]),
])
def test_bad_engine_settings(settings, words):
    with pytest.raises(ConfigError) as error:
        EngineConfig(**settings)
    for word in words:
        assert word in str(error.value)


def test_context_beyond_the_model(bundled):
    with pytest.raises(ConfigError, match="max_seq_len 100000 exceeds the model's context of 8192 tokens"):
        make_engine(bundled, "paged", max_seq_len=100000)


@pytest.mark.parametrize("dtype", ["float64", "int8", "fp8"])
def test_bad_dtype(dtype):
    with pytest.raises(ConfigError) as error:
        load_model("bundled", device="cpu", dtype=dtype)
    message = str(error.value)
    assert f"unknown dtype {dtype!r}" in message and "float32, bfloat16, float16" in message


@pytest.mark.parametrize("device", ["tpu", "gpu", "mps"])
def test_bad_device(device):
    with pytest.raises(ConfigError) as error:
        load_model("bundled", device=device)
    message = str(error.value)
    assert repr(device) in message and "use cpu, cuda, cuda:N or auto" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda(device):
    with pytest.raises(ConfigError) as error:
        load_model("bundled", device=device)
    message = str(error.value)
    assert "CUDA is not available" in message and "--device cpu" in message


# --- Checkpoints ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A loadable tiny random Llama: config.json, model.safetensors, tokenizer.json, tokenizer_config.json."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, intermediate_size=64, vocab_size=64, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(str(directory))
    tokenizer = FastTokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2"}))
    assert load_model(str(directory), device="cpu").config.vocab_size == 64  # the unmodified copy loads
    return directory


def variant(tiny_checkpoint, tmp_path, drop=(), **config_changes):
    """A copy of the tiny checkpoint without the files in `drop` and with config.json fields changed (None: delete)."""
    directory = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, directory)
    for name in drop:
        (directory / name).unlink()
    if config_changes:
        config = json.loads((directory / "config.json").read_text())
        for key, value in config_changes.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


@pytest.mark.parametrize("spec", ["./no-such-dir", "not a model id", "/no/such/absolute/dir", "a/b/c"])
def test_unknown_model(spec):
    with pytest.raises(ConfigError) as error:
        load_model(spec, device="cpu")
    message = str(error.value)
    assert repr(spec) in message and "existing directory" in message and "Hub id" in message


def test_missing_gguf_file(tmp_path):
    path = str(tmp_path / "missing.gguf")
    with pytest.raises(ConfigError, match="does not exist"):
        load_model(path, device="cpu")


def test_directory_without_config(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_model(str(tmp_path), device="cpu")
    assert "has no config.json" in str(error.value) and "--model" in str(error.value)


def test_unsupported_architecture(tiny_checkpoint, tmp_path):
    directory = variant(tiny_checkpoint, tmp_path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ConfigError) as error:
        load_model(directory, device="cpu")
    message = str(error.value)
    assert "unsupported architecture ['GPT2LMHeadModel']" in message
    assert "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM" in message


def test_remote_code_is_refused(tiny_checkpoint, tmp_path):
    directory = variant(tiny_checkpoint, tmp_path, auto_map={"AutoModelForCausalLM": "modeling_custom.CustomLM"})
    with pytest.raises(ConfigError) as error:
        load_model(directory, device="cpu")
    assert "trust_remote_code" in str(error.value) and "auto_map" in str(error.value)


@pytest.mark.parametrize("changes, words", [
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}),
     ["RoPE scaling type 'yarn' is not supported", "default, linear, llama3"]),
    (dict(mlp_bias=True), ["mlp_bias=true is not supported"]),
    (dict(num_key_value_heads=3, num_attention_heads=2), ["2 attention heads do not divide into 3 KV heads"]),
])
def test_unsupported_config_fields(tiny_checkpoint, tmp_path, changes, words):
    with pytest.raises(ConfigError) as error:
        load_model(variant(tiny_checkpoint, tmp_path, **changes), device="cpu")
    for word in words:
        assert word in str(error.value)


@pytest.mark.parametrize("dropped, words", [
    ("tokenizer.json", ["has no tokenizer.json"]),
    ("model.safetensors", ["has no *.safetensors weights"]),
])
def test_missing_checkpoint_files(tiny_checkpoint, tmp_path, dropped, words):
    with pytest.raises(ConfigError) as error:
        load_model(variant(tiny_checkpoint, tmp_path, drop=(dropped,)), device="cpu")
    for word in words:
        assert word in str(error.value)


def test_missing_weight(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = variant(tiny_checkpoint, tmp_path)
    weights = load_file(f"{directory}/model.safetensors")
    del weights["model.layers.0.mlp.up_proj.weight"]
    save_file(weights, f"{directory}/model.safetensors")
    with pytest.raises(ConfigError, match="weight 'model.layers.0.mlp.up_proj.weight' is missing"):
        load_model(directory, device="cpu")


def test_bad_weight_layout(tiny_checkpoint):
    with pytest.raises(ConfigError, match="layout 'row_major'"):
        inference_core.load_model(str(tiny_checkpoint), device="cpu", layout="row_major")
