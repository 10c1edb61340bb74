"""The same engine on CUDA (skipped without a GPU): every KV mode runs in bf16, in fp32 greedy ids on the GPU equal
those on the CPU over a short output, batches equal their requests run alone, and the compiled decode step (CUDA
graphs, one inductor compile for every batch bucket above 1) equals eager, and so do its prompts, mixed steps and
prompt lookup's verifications through the flat step (a CUDA graph a token bucket). `python -m inference_core
gpu-report` runs these with `-m cuda`; the bundled model's tests skip where it is not installed (it does not travel
to a GPU machine with the repository)."""

from __future__ import annotations

import os

import pytest
import torch

from inference_core import Engine, EngineConfig, SamplingParams, load_model
from inference_core.model.bundled import bundled_gguf_path

from conftest import assert_nothing_held, make_engine

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"), pytest.mark.cuda]


def _bundled_installed() -> bool:
    try:
        return bundled_gguf_path().is_file()
    except Exception:  # the package is missing or broken: the same answer
        return False


# The flat step on CUDA (our Triton attention), unless the GPU run turned it off after its kernel's test failed.
FLAT = os.environ.get("INFERENCE_CORE_TRITON_FLAT", "1") != "0"
needs_bundled = pytest.mark.skipif(not _bundled_installed(), reason="the bundled model is not installed")


@pytest.fixture(scope="module")
def cuda_bf16():
    return load_model("bundled", device="cuda", dtype="bfloat16")


@needs_bundled
@pytest.mark.parametrize("kv_mode", ["none", "contiguous", "paged"])
def test_bf16_generates_in_every_kv_mode(cuda_bf16, kv_mode):
    engine = make_engine(cuda_bf16, kv_mode)
    event = engine.complete("Why is the sky blue?", SamplingParams(max_new_tokens=32, ignore_eos=True))
    assert len(event.token_ids) == 32 and event.text.strip()
    assert event.stats.decode_tokens_per_s > 0
    assert_nothing_held(engine)


@needs_bundled
def test_fp32_greedy_matches_cpu(bundled):
    cuda = load_model("bundled", device="cuda", dtype="float32")
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    on_gpu = make_engine(cuda, "paged").complete("Why is the sky blue?", params).token_ids
    on_cpu = make_engine(bundled, "paged").complete("Why is the sky blue?", params).token_ids
    assert on_gpu == on_cpu


@pytest.fixture(scope="module")
def tiny_cuda(tmp_path_factory):
    """test_scheduler's tiny random Llama, on the GPU in fp32 (no bundled model needed)."""
    from tiny_models import build_tiny_model

    directory = tmp_path_factory.mktemp("tiny-llama-cuda")
    build_tiny_model(directory)
    return load_model(str(directory), device="cuda", dtype="float32")


@pytest.mark.parametrize("kv_mode,batching", [("paged", "continuous"), ("contiguous", "continuous"),
                                              ("paged", "static")])
def test_batch_matches_solo_on_cuda(tiny_cuda, kv_mode, batching):
    """The batched decode path on the GPU (one gather and one masked SDPA for every decode, chunked prefill, a paged
    pool small enough to force preemption, a static batch's padding): every request's greedy ids equal its run
    alone, and nothing is left held."""
    from tiny_models import assert_pool_free, assert_solo_ids, BLOCK_SIZE, greedy, prompt, run_to_end

    pool = dict(kv_cache_tokens=24 * BLOCK_SIZE) if kv_mode == "paged" else {}
    engine = Engine(tiny_cuda, EngineConfig(kv_mode=kv_mode, batching=batching, block_size=BLOCK_SIZE,
                                            max_num_seqs=6, max_num_batched_tokens=16, **pool))
    requests = [engine.submit(prompt(3 + 5 * i, seed=i), greedy(10 + 3 * i)) for i in range(8)]
    reports = run_to_end(engine)
    if batching == "static":
        assert sum(r.prompt_padding_tokens for r in reports) > 0
    elif kv_mode == "paged":
        assert sum(len(r.preempted) for r in reports) > 0
    assert_solo_ids(tiny_cuda, requests)
    assert_pool_free(engine)


@pytest.mark.parametrize("kv_mode", ["contiguous", "paged"])
def test_compiled_decode_with_cuda_graphs_equals_eager(tiny_cuda, kv_mode):
    """Six requests of different lengths, 4 at a time, through the compiled step (CUDA graphs): buckets 4, 2 and 1
    and widths that grow past a power of two, and (paged) the prompts and mixed steps through the flat step's token
    buckets; greedy ids equal eager's (or part at a near-tie), and a second round compiles nothing."""
    from conftest import compiled_matches_eager, mixed_requests
    from tiny_models import BLOCK_SIZE, greedy, run_to_end

    compiled, _ = compiled_matches_eager(tiny_cuda, kv_mode=kv_mode, block_size=BLOCK_SIZE, max_num_seqs=4,
                                         max_num_batched_tokens=32)
    stats = compiled.compile_stats()
    assert stats["compiled_steps"] > 0 and stats["recompiles"] == 0
    if kv_mode == "paged" and FLAT:  # prompts and mixed steps in the flat step (our Triton attention), nothing eager
        assert stats["fallbacks"] == {} and stats["steps_by_bucket"]["flat"] > 0
    # The graphs read the KV pool and the buckets' input buffers in place (not copied in before each replay).
    inputs = [compiled.kv_cache.k, compiled.kv_cache.v] + [
        buffer for buffers in compiled.decoder._buffers.values() for buffer in buffers.values()]
    assert {getattr(tensor, "_dynamo_static_input_type", None) for tensor in inputs} == {"unguarded"}
    graphs = stats["graphs"]
    for ids, new_tokens in mixed_requests():
        compiled.submit(ids, greedy(new_tokens))
    run_to_end(compiled)
    assert compiled.compile_stats()["graphs"] == graphs
    assert_nothing_held(compiled)


def test_compiled_verifications_in_the_flat_step_equal_plain_greedy(tiny_cuda):
    """Prompt lookup on a compiled paged engine (CUDA graphs): each verification (the last token and its drafts) runs
    in the flat step, whose token buckets are CUDA graphs, beside the other requests' decodes; ids equal plain
    greedy decoding's, with drafts accepted and rejected, and nothing falls back to eager."""
    from conftest import assert_same_or_near_tie
    from tiny_models import BLOCK_SIZE, greedy, prompt

    from inference_core.spec.decoding import SpecConfig

    settings = dict(kv_mode="paged", block_size=BLOCK_SIZE, max_num_seqs=4, max_num_batched_tokens=64)
    eager, compiled = Engine(tiny_cuda, EngineConfig(**settings)), Engine(tiny_cuda, EngineConfig(**settings,
                                                                                                   compile=True))
    prompts = [prompt(9, seed) * 3 for seed in range(3)]
    want = [eager.complete(ids, greedy(32)).token_ids for ids in prompts]
    requests = [compiled.submit(ids, greedy(32), spec=SpecConfig("ngram", k=4, ngram_min=1)) for ids in prompts]
    while compiled.has_work():
        compiled.step()
    for ids, expected, request in zip(prompts, want, requests):
        assert_same_or_near_tie(tiny_cuda, ids, expected, request.events[-1].token_ids)
    spec = [request.events[-1].stats.spec for request in requests]
    assert 0 < sum(s["accepted"] for s in spec) < sum(s["drafted"] for s in spec)
    stats = compiled.compile_stats()
    assert stats["recompiles"] == 0
    if FLAT:
        assert stats["fallbacks"] == {} and stats["steps_by_bucket"]["flat"] > 0


@pytest.mark.parametrize("kv_mode", ["contiguous", "paged"])
def test_two_compiled_engines_stepping_in_turn_keep_their_own_kv(tiny_cuda, kv_mode):
    """A race's two lanes: two compiled engines of one model share its compile, each with a KV pool of its own that
    its CUDA graphs read in place; stepped in turn, each one's ids equal its text alone."""
    from tiny_models import BLOCK_SIZE, greedy, prompt

    settings = dict(kv_mode=kv_mode, block_size=BLOCK_SIZE, max_num_seqs=2, compile=True)
    alone = [Engine(tiny_cuda, EngineConfig(**settings)).complete(prompt(length, seed), greedy(24)).token_ids
             for length, seed in ((9, 1), (14, 2))]
    lanes = [Engine(tiny_cuda, EngineConfig(**settings)) for _ in range(2)]
    requests = [lane.submit(prompt(length, seed), greedy(24)) for lane, (length, seed) in zip(lanes, ((9, 1), (14, 2)))]
    while any(lane.has_work() for lane in lanes):
        for lane in lanes:
            if lane.has_work():
                lane.step()
    assert [request.events[-1].token_ids for request in requests] == alone
    assert all(lane.compile_stats()["recompiles"] == 0 for lane in lanes)


def _sdpa_ops(run) -> set[str]:
    """The names of the SDPA ops `run()` calls, from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as recorded:
        run()
    return {event.name for event in recorded.events() if "scaled_dot_product" in event.name}


def test_eager_batched_steps_leave_cudnn_attention_out(tiny_cuda):
    """cuDNN's SDPA builds a graph for every new shape (1.3 ms of host time a call on an H100 host), and a batched
    step's padded key width changes every step: the eager forward runs SDPA without it (`llama.attention_backends`).
    Skipped where SDPA would not pick cuDNN for such a call anyway."""
    from tiny_models import BLOCK_SIZE, greedy, prompt, run_to_end

    bf16 = load_model(tiny_cuda.name, device="cuda", dtype="bfloat16")
    q = torch.randn(3, 4, 1, 16, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(3, 2, 40, 16, device="cuda", dtype=torch.bfloat16)
    mask = torch.rand(3, 1, 1, 40, device="cuda") < 0.8
    default = _sdpa_ops(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask,
                                                                                enable_gqa=True))
    if not any("cudnn" in name for name in default):
        pytest.skip(f"SDPA does not pick cuDNN on this device for such a call ({sorted(default)})")
    engine = Engine(bf16, EngineConfig(kv_mode="paged", block_size=BLOCK_SIZE, max_num_seqs=4))
    for i in range(4):
        engine.submit(prompt(5 + 7 * i, seed=i), greedy(6))
    used = _sdpa_ops(lambda: run_to_end(engine))
    assert used and not any("cudnn" in name for name in used), used
    assert_nothing_held(engine)
