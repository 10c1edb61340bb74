"""Tiny random models that tests build on the spot, and the helpers that run them.

A 2-layer model of each family (Llama, Mistral, Qwen2, Qwen3) is saved with transformers and loaded by our loader in
milliseconds, with a word-level tokenizer ('tN' <-> id N); `build_tiny_model` is the 256-token Llama most engine tests
use, `build_tiny` the 16-token one whose every distribution can be summed exactly (speculative sampling). Beside them:
random prompts, greedy settings, a paged engine with a small pool, a request's solo run (memoized) and stepping an
engine until it is idle.
"""

from __future__ import annotations

import json
import math
import random

import torch
from tokenizers import Tokenizer as FastTokenizer
from tokenizers import models, pre_tokenizers
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

import inference_core
from inference_core import Engine, EngineConfig, SamplingParams
from inference_core.engine.request import FinishEvent, TokenEvent
from inference_core.model.loader import LoadedModel


VOCAB_SIZE = 256
NEW_TOKENS = 64
BLOCK_SIZE = 4
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=VOCAB_SIZE, max_position_embeddings=512, rms_norm_eps=1e-6,
            # Wider than the default 0.02 so logits are spread out and greedy choices are not near-ties.
            initializer_range=0.1, bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# Family name -> (transformers config class, model class, extra config fields, our ModelConfig.architecture).
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": False}, "llama"),
    "llama-tied": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": True}, "llama"),
    "llama-rope-llama3": (LlamaConfig, LlamaForCausalLM,
                          {"tie_word_embeddings": False, "rope_parameters": LLAMA3_ROPE}, "llama"),
    "mistral": (MistralConfig, MistralForCausalLM, {"tie_word_embeddings": False, "sliding_window": None}, "mistral"),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": False}, "qwen2"),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"tie_word_embeddings": False}, "qwen3"),
}


def write_word_level_tokenizer(directory, vocab_size: int = VOCAB_SIZE) -> None:
    """tokenizer.json mapping token 'tN' <-> id N for the whole vocabulary, plus a tokenizer_config naming the EOS."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = FastTokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2", "bos_token": "t1"}))


class TinyFamily:
    """A saved tiny checkpoint of one family, its transformers model, and our fp32 load of it."""

    def __init__(self, name: str, directory):
        config_class, model_class, extra, self.architecture = FAMILIES[name]
        self.name, self.directory = name, directory
        torch.manual_seed(0)
        self.hf_model = model_class(config_class(**TINY, **extra)).eval()
        self.hf_model.generation_config.eos_token_id = None
        self.hf_model.save_pretrained(str(directory))
        write_word_level_tokenizer(directory)
        self.loaded = inference_core.load_model(str(directory), device="cpu", dtype="float32")
        self._greedy: dict[tuple[int, ...], list[int]] = {}

    @torch.no_grad()
    def hf_last_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        return self.hf_model(torch.tensor([prompt_ids])).logits[0, -1].float()

    @torch.no_grad()
    def hf_greedy(self, prompt_ids: list[int]) -> list[int]:
        """transformers' greedy continuation (memoized per prompt)."""
        key = tuple(prompt_ids)
        if key not in self._greedy:
            input_ids = torch.tensor([prompt_ids])
            # An explicit all-ones mask: otherwise transformers masks every token equal to pad_token_id.
            output = self.hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                            max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                            pad_token_id=0)
            self._greedy[key] = output[0, len(prompt_ids):].tolist()
            assert len(self._greedy[key]) == NEW_TOKENS, "transformers stopped early; the comparison would be short"
        return self._greedy[key]


def build_tiny_model(directory):
    """A saved random 2-layer Llama (tiny_models.TINY) loaded by our loader, fp32 on the CPU."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=False)).eval()
    model.save_pretrained(str(directory))
    write_word_level_tokenizer(directory)
    return inference_core.load_model(str(directory), device="cpu", dtype="float32")


def prompt(length: int, seed: int) -> list[int]:
    """Random token ids (3..255: no BOS or EOS), different for every seed."""
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(length)]


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)


def paged(tiny, num_blocks: int = 256, **settings) -> Engine:
    return Engine(tiny, EngineConfig(kv_mode="paged", block_size=BLOCK_SIZE, kv_cache_tokens=num_blocks * BLOCK_SIZE,
                                     **settings))


_solo: dict[tuple, list[int]] = {}


def solo(tiny, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    """The request alone on a fresh engine with a big pool (memoized per model directory, prompt and settings)."""
    key = (tiny.name, tuple(prompt_ids), params)
    if key not in _solo:
        _solo[key] = paged(tiny).complete(list(prompt_ids), params).token_ids
    return _solo[key]


def run_to_end(engine: Engine, max_steps: int = 20_000) -> list:
    """Step until nothing is queued or running; returns the StepReports."""
    reports = []
    while engine.has_work():
        if engine.seconds_until_ready() == math.inf:
            engine.drain()  # a static batch that is not full: no more requests are coming
        reports.append(engine.step())
        assert len(reports) < max_steps, "the engine stopped making progress"
    return reports


def final(request) -> FinishEvent:
    """The request's one FinishEvent, which must be its last event, after a TokenEvent per generated token."""
    events = list(request.events)
    assert [type(e) for e in events] == [TokenEvent] * (len(events) - 1) + [FinishEvent]
    assert [e.token_id for e in events[:-1]] == events[-1].token_ids
    return events[-1]


def assert_solo_ids(tiny, requests) -> None:
    for request in requests:
        assert final(request).token_ids == solo(tiny, request.seq.token_ids[:request.seq.num_prompt_tokens],
                                                request.params), f"request {request.request_id} differs from solo"


def assert_pool_free(engine) -> None:
    assert engine.num_requests() == 0
    assert engine.blocks_in_use() == 0


TINY_VOCAB = 16
SPEC_TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                 intermediate_size=64, vocab_size=TINY_VOCAB, max_position_embeddings=64, rms_norm_eps=1e-6,
                 bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def build_tiny(directory, seed: int, initializer_range: float) -> LoadedModel:
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**SPEC_TINY, initializer_range=initializer_range)).save_pretrained(str(directory))
    write_word_level_tokenizer(directory, TINY_VOCAB)
    return inference_core.load_model(str(directory), device="cpu", dtype="float32")
