"""Random-weight checkpoints at real shapes (`inference_core.model.random_weights`), shrunk for the test: our loader and
transformers load the same directory and agree, and every id of the padded vocabulary decodes."""

from __future__ import annotations

import pytest
import torch

from inference_core import ConfigError, Engine, EngineConfig, SamplingParams, load_model
from inference_core.cli import main
from inference_core.model.random_weights import write_random_checkpoint

SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16)


@pytest.fixture(scope="module")
def small_qwen3(tmp_path_factory, bundled):  # bundled: the tokenizer comes from the converted bundled model
    return write_random_checkpoint("qwen3-0.6b", tmp_path_factory.mktemp("random-qwen3"), dtype="float32", **SMALL)


def test_ours_and_transformers_load_it_and_agree(small_qwen3):
    from transformers import AutoModelForCausalLM

    loaded = load_model(str(small_qwen3), device="cpu", dtype="float32")
    assert loaded.config.vocab_size == 151936 and loaded.tokenizer.vocab_size == 151936
    engine = Engine(loaded, EngineConfig(kv_mode="paged"))
    ids = engine.prompt_ids("Why is the sky blue?")
    ours = engine.complete(list(ids), SamplingParams(max_new_tokens=6, ignore_eos=True)).token_ids
    hf = AutoModelForCausalLM.from_pretrained(str(small_qwen3), dtype=torch.float32)
    theirs = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
    assert ours == theirs


def test_every_id_of_the_padded_vocabulary_decodes(small_qwen3, bundled):
    tokenizer = load_model(str(small_qwen3), device="cpu", dtype="float32").tokenizer
    assert tokenizer.decode([49152, 100000, 151935]) == "<r49152><r100000><r151935>"
    assert tokenizer.encode("Why is the sky blue?") == bundled.tokenizer.encode("Why is the sky blue?")


def test_bad_preset_is_refused(tmp_path, capsys):
    with pytest.raises(ConfigError, match="unknown preset 'qwen9'"):
        write_random_checkpoint("qwen9", tmp_path)
    assert main(["random-weights", "--preset", "qwen3-0.6b", "--out", str(tmp_path), "--dtype", "int3"]) == 2
    assert "unknown dtype 'int3'" in capsys.readouterr().err
