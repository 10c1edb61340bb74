"""Our forward against Hugging Face transformers (the oracle) on tiny random models of every supported family.

Each case builds a small random transformers model (2 layers, 4 query heads over 2 KV heads, head_dim 16), saves it as
safetensors next to a word-level tokenizer covering its vocabulary, and loads that directory with our own loader. We
then compare prefill logits, greedy token ids over 64 new tokens in every KV mode (paged with 4-token blocks, so a
sequence spans many blocks, with the prefix cache on and off), the two weight layouts, and bf16 against fp32.
The tiny models keep the whole file to a few seconds on the CPU while still exercising GQA, q/k/v bias (Qwen2),
q/k norm (Qwen3), tied embeddings and Llama-3 RoPE scaling.
"""

from __future__ import annotations


import pytest
import torch

import inference_core
from inference_core import Engine, EngineConfig, SamplingParams
from inference_core.model.llama import packed_bf16_available
from inference_core.sequence import Sequence
from tiny_models import BLOCK_SIZE, FAMILIES, NEW_TOKENS, TinyFamily, VOCAB_SIZE

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest: stable run times on a busy CPU

PROMPTS = {
    "one-token": [1],
    "short": [5, 17, 200, 3, 99, 42, 7],
    # 37 tokens: 9 full 4-token blocks and one partial block.
    "long": [(31 * i + 7) % VOCAB_SIZE for i in range(37)],
}
KV_CONFIGS = {
    "none": dict(kv_mode="none"),
    "contiguous": dict(kv_mode="contiguous"),
    "paged-prefix-cache": dict(kv_mode="paged", block_size=BLOCK_SIZE, prefix_cache=True),
    "paged-no-prefix-cache": dict(kv_mode="paged", block_size=BLOCK_SIZE, prefix_cache=False),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> TinyFamily:
    return TinyFamily(request.param, tmp_path_factory.mktemp(request.param))


def our_last_logits(loaded, prompt_ids: list[int]) -> torch.Tensor:
    """Prefill `prompt_ids` with no KV cache and return our fp32 logits for the last position."""
    engine = Engine(loaded, EngineConfig(kv_mode="none"))
    return engine.runner.run([Sequence(list(prompt_ids))])[0]


def greedy(engine: Engine, prompt_ids: list[int]):
    return engine.complete(list(prompt_ids), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))


def test_loader_reads_the_family(family):
    config, hf_config = family.loaded.config, family.hf_model.config
    assert config.architecture == family.architecture
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.tie_word_embeddings == hf_config.tie_word_embeddings
    assert config.qkv_bias == (family.architecture == "qwen2")
    assert config.qk_norm == (family.architecture == "qwen3")
    expected_scaling = ("llama3", 8.0, 1.0, 4.0, 64) if family.name == "llama-rope-llama3" else None
    assert config.rope_scaling == expected_scaling


@pytest.mark.parametrize("prompt_name", sorted(PROMPTS))
def test_prefill_logits_match_transformers(family, prompt_name):
    prompt_ids = PROMPTS[prompt_name]
    ours = our_last_logits(family.loaded, prompt_ids)
    reference = family.hf_last_logits(prompt_ids)
    assert ours.shape == (VOCAB_SIZE,)
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kv_name", sorted(KV_CONFIGS))
def test_greedy_ids_match_transformers(family, kv_name):
    engine = Engine(family.loaded, EngineConfig(**KV_CONFIGS[kv_name]))
    for prompt_name in ("short", "long"):
        prompt_ids = PROMPTS[prompt_name]
        result = greedy(engine, prompt_ids)
        assert result.token_ids == family.hf_greedy(prompt_ids), f"{prompt_name} prompt diverges from transformers"
        assert result.stats.finish_reason == "length"
        assert result.stats.cached_prompt_tokens == 0  # no earlier request shared this prompt
    assert engine.num_requests() == 0 and engine.blocks_in_use() == 0


def test_prefix_cache_hits_give_transformers_ids(family):
    """Repeat a prompt, then extend it by part of its own answer: both reuse cached 4-token blocks (the second also
    blocks written while decoding) and must still continue exactly as transformers does."""
    engine = Engine(family.loaded, EngineConfig(kv_mode="paged", block_size=BLOCK_SIZE, prefix_cache=True))
    prompt_ids = PROMPTS["long"]
    first = greedy(engine, prompt_ids)
    assert first.stats.cached_prompt_tokens == 0

    repeat = greedy(engine, prompt_ids)
    # Only full blocks within the first len - 1 tokens are reused: (37 - 1) // 4 = 9 blocks.
    assert repeat.stats.cached_prompt_tokens == 36
    assert repeat.token_ids == family.hf_greedy(prompt_ids)

    extended_ids = prompt_ids + first.token_ids[:10]  # 47 tokens; blocks 9 and 10 were filled by decoding
    extended = greedy(engine, extended_ids)
    assert extended.stats.cached_prompt_tokens == 44
    assert extended.token_ids == family.hf_greedy(extended_ids)
    assert extended.token_ids[:NEW_TOKENS - 10] == first.token_ids[10:]
    assert engine.blocks_in_use() == 0


def test_weight_layouts_agree(family):
    out_in = inference_core.load_model(str(family.directory), device="cpu", dtype="float32", layout="out_in")
    in_out = inference_core.load_model(str(family.directory), device="cpu", dtype="float32", layout="in_out")
    # The switch really changed the stored layout: [out, in] versus [in, out].
    assert not out_in.model.lm_head.in_out and in_out.model.lm_head.in_out
    qkv_out_in = out_in.model.layers[0].self_attn.qkv_proj.weight
    qkv_in_out = in_out.model.layers[0].self_attn.qkv_proj.weight
    assert qkv_out_in.shape == (4 * 16 + 2 * 2 * 16, 64) and qkv_in_out.shape == (64, 4 * 16 + 2 * 2 * 16)
    for prompt_ids in PROMPTS.values():
        torch.testing.assert_close(our_last_logits(in_out, prompt_ids), our_last_logits(out_in, prompt_ids),
                                   atol=1e-5, rtol=0)


@pytest.mark.skipif(not packed_bf16_available(), reason="needs a CPU with native bf16 math and oneDNN")
def test_packed_bf16_weights_agree_with_the_reference_layout(family):
    """bf16 projections through oneDNN's prepacked weights (auto's choice on such a CPU) against F.linear on the
    same weights: only the summation order differs. One row (a decode) and several (a prompt, a verification)."""
    packed = inference_core.load_model(str(family.directory), device="cpu", dtype="bfloat16")
    reference = inference_core.load_model(str(family.directory), device="cpu", dtype="bfloat16", layout="out_in")
    assert packed.model.lm_head.packed is not None and reference.model.lm_head.packed is None
    for prompt_ids in PROMPTS.values():
        torch.testing.assert_close(our_last_logits(packed, prompt_ids), our_last_logits(reference, prompt_ids),
                                   atol=0.05, rtol=0)
    rows = torch.randn(5, 64).bfloat16()
    qkv, reference_qkv = packed.model.layers[0].self_attn.qkv_proj, reference.model.layers[0].self_attn.qkv_proj
    for count in (1, 5):
        torch.testing.assert_close(qkv.forward(rows[:count]), reference_qkv.forward(rows[:count]), atol=0.05, rtol=0)


def test_a_tied_in_out_head_scores_several_rows_through_the_shared_embedding():
    """Several rows (a speculative verification, batched decodes) through an in_out LM head tied to the embedding
    use the embedding as its [out, in] form, which costs no memory; an untied head keeps no second copy."""
    from torch import nn

    from inference_core.model.llama import Linear

    embedding = nn.Parameter(torch.randn(300, 64), requires_grad=False)
    head = Linear(64, 300, bias=False)
    head.weight = embedding
    head.use_in_out_layout(keep_out_in=True)
    assert head.weight.shape == (64, 300) and head.out_in_rows.data_ptr() == embedding.data_ptr()
    rows = torch.randn(5, 64)
    for count in (1, 2, 5):
        torch.testing.assert_close(head.forward(rows[:count]), rows[:count] @ embedding.t(), atol=1e-5, rtol=0)
    untied = Linear(64, 300, bias=False)
    untied.weight = nn.Parameter(torch.randn(300, 64), requires_grad=False)
    untied.use_in_out_layout()
    assert untied.out_in_rows is None


def test_bfloat16_close_to_float32(family):
    loaded = inference_core.load_model(str(family.directory), device="cpu", dtype="bfloat16")
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    prompt_ids = PROMPTS["long"]
    ours = our_last_logits(loaded, prompt_ids)
    assert ours.dtype == torch.float32  # logits come back in fp32 whatever the model dtype
    # bf16 keeps ~3 significant digits; logits here are of order 1, a wrong cast or RoPE table would be off by ~1.
    torch.testing.assert_close(ours, family.hf_last_logits(prompt_ids), atol=0.1, rtol=0)
    result = Engine(loaded, EngineConfig(kv_mode="paged", block_size=BLOCK_SIZE)).complete(
        list(prompt_ids), SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert len(result.token_ids) == 16 and all(0 <= t < VOCAB_SIZE for t in result.token_ids)


def test_batched_bfloat16_decodes_close_to_float32(family, monkeypatch):
    """A step's decodes, attended together (through bf16 matmuls where the CPU has native bf16 math), against
    transformers in fp32."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)  # the matmul kernel on any host
    loaded = inference_core.load_model(str(family.directory), device="cpu", dtype="bfloat16")
    assert {layer.self_attn.decode_kernel for layer in loaded.model.layers} == {"matmul"}
    engine = Engine(loaded, EngineConfig(kv_mode="paged", block_size=BLOCK_SIZE))
    seqs = [Sequence(list(PROMPTS["long"])), Sequence(list(PROMPTS["short"]))]
    for seq in seqs:
        engine.kv_cache.allocate(seq)
    engine.runner.run(seqs)  # the prompts
    for seq, token in zip(seqs, (11, 250)):
        seq.append(token)
    logits = engine.runner.run(seqs)  # one decode each, in one batch
    for seq, row in zip(seqs, logits):
        torch.testing.assert_close(row, family.hf_last_logits(seq.token_ids), atol=0.1, rtol=0)
    for seq in seqs:
        engine.kv_cache.free(seq)
