"""Compiled decode (`inference_core.engine.compiled`) against the eager path it replaces.

Greedy ids of a compiled engine must equal the eager engine's, batch 1 and batched (padded to a bucket), contiguous
and paged. Compiled kernels sum in another order than eager ones, so two ids may differ only where the eager run's
top two logits were a near-tie: within NEAR_TIE (fp32 logits; measured differences between the two paths are
around 1e-4). After a divergence the two texts are different and not compared further. Once a bucket's graph is
compiled, generating triggers no compile at all (`stats.compile`: graphs and recompiles unchanged).
"""

from __future__ import annotations

import gc
import json
from dataclasses import replace

import pytest
import torch
from conftest import assert_same_or_near_tie, compiled_matches_eager, mixed_requests
from tiny_models import build_tiny_model, prompt, run_to_end

from inference_core import ConfigError, Engine, EngineConfig, SamplingParams, load_model
from inference_core.cli import main
from inference_core.engine import compiled as compiled_module
from inference_core.engine import engine as engine_module
from inference_core.engine.compiled import batch_buckets, compile_unavailable
from inference_core.engine.engine import make_kv_cache
from inference_core.model import row_kernel
from inference_core.model.llama import model_fingerprint
from inference_core.roofline import read_rate

pytestmark = pytest.mark.skipif(compile_unavailable(torch.device("cpu")) is not None,
                                reason=f"{compile_unavailable(torch.device('cpu'))}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-compiled"))


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(8) == [1, 2, 4, 8]


@pytest.mark.parametrize("kv_mode", ["contiguous", "paged"])
def test_tiny_batches_match_eager_and_compile_once_per_bucket(tiny, kv_mode):
    """Six prompts of different lengths through continuous batching, 4 at a time: steps of 4, then 3 (padded to the
    bucket of 4), 2 and 1 sequences, with chunked prefills sharing steps (those stay eager); then the same with
    several decode steps a host round trip. Paged, the prefills and mixed steps run through the flat step: nothing
    runs eager; contiguous, they do, for the reason the decoder gives."""
    compiled, reports = compiled_matches_eager(tiny, kv_mode=kv_mode, block_size=4, max_num_seqs=4,
                                               max_num_batched_tokens=32)
    stats = compiled.compile_stats()
    graphs = 3 + (kv_mode == "paged")  # buckets 1, 2 and 4, and the flat step
    assert stats["graphs"] == graphs and stats["recompiles"] == 0
    assert stats["compiled_steps"] > 0
    if kv_mode == "paged":
        assert stats["fallbacks"] == {} and stats["steps_by_bucket"]["flat"] > 0
    else:
        assert list(stats["fallbacks"]) == [compiled.decoder.flat_off]
    assert sum(r.compile_ms for r in reports) > 0  # the steps that compiled say so
    # Warm: the same work again compiles nothing, and the final event's stats say so.
    again = [compiled.submit(ids, greedy(new_tokens)) for ids, new_tokens in mixed_requests()]
    reports = run_to_end(compiled)
    assert compiled.compile_stats()["graphs"] == graphs
    assert all(r.compile_ms == 0 for r in reports)
    finish = again[0].events[-1]
    assert finish.stats.compile["recompiles"] == 0 and finish.stats.compile["compile_s"] == 0
    assert compiled.blocks_in_use() == 0
    decode_steps_match_one_step_at_a_time(tiny, compiled, [request.events[-1].token_ids for request in again])


def decode_steps_match_one_step_at_a_time(tiny, single: Engine, want: list[list[int]]) -> None:
    """The mixed requests with up to 5 compiled decode steps a host round trip (the graphs `single` compiled serve
    them): the same greedy ids as `single`'s one step at a time (`want`; a request's own new-token count shortens a
    run, and none runs while requests wait), in steps that ran several tokens each; a stop token met inside a run
    ends the request there, the rest dropped and its KV given back. The new engine finds every bucket's package on
    disk, as a second start would, whichever bucket `single` compiled first."""
    compiled_module._LOADED_PACKAGES.clear()  # as in a new process: from the disk cache
    burst = Engine(tiny, replace(single.config, decode_steps=5))
    submitted = [burst.submit(ids, greedy(new_tokens)) for ids, new_tokens in mixed_requests()]
    reports = run_to_end(burst)
    assert [request.events[-1].token_ids for request in submitted] == want
    runs = [tokens for report in reports for _, kind, tokens in report.work if kind == "decode"]
    assert max(runs) == 5 and len(reports) < sum(new_tokens for _, new_tokens in mixed_requests())
    assert burst.blocks_in_use() == 0
    assert burst.compile_stats()["from_disk"] == burst.compile_stats()["graphs"] > 1
    prompt_ids, _ = mixed_requests()[0]
    reference = single.complete(prompt_ids, greedy(24)).token_ids
    at = next(i for i in range(7, 24) if reference[i] not in reference[:i])  # inside the second run of 5
    stopped = burst.complete(prompt_ids, SamplingParams(max_new_tokens=24, stop_token_ids=(reference[at],)))
    assert stopped.token_ids == reference[:at + 1] and stopped.stats.finish_reason == "stop"
    assert burst.blocks_in_use() == 0


def test_decode_steps_refuse_what_they_cannot_run(tiny):
    from inference_core.settings import LaneSettings

    with pytest.raises(ConfigError, match="--decode-steps above 1 run through the compiled decode step"):
        EngineConfig(decode_steps=4)
    with pytest.raises(ConfigError, match="from 1 to 16"):
        EngineConfig(compile=True, decode_steps=17)
    with pytest.raises(ConfigError, match="set --temperature to 0"):
        LaneSettings(compile=True, decode_steps=4, temperature=0.7).engine_config(256)
    with pytest.raises(ConfigError, match="set --temperature to 0"):
        LaneSettings(compile=True, decode_steps=4, repetition_penalty=1.2).engine_config(256)
    with pytest.raises(ConfigError, match="speculative decoding runs steps of its own"):
        LaneSettings(compile=True, decode_steps=4, spec_method="ngram").engine_config(256)
    assert LaneSettings(compile=True, decode_steps=4).engine_config(256).decode_steps == 4
    assert "4 steps a round trip" in LaneSettings(compile=True, decode_steps=4).describe()


def test_warm_up_compiles_before_the_first_request(tiny):
    # The bucket test's shapes: its package of bucket 1, where that test ran first, is loaded from the disk cache
    # instead of compiled (once its engines are gone: a package loaded in this process would count no graph here).
    gc.collect()
    engine = Engine(tiny, EngineConfig(kv_mode="paged", block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                                       compile=True))
    assert not engine.decoder.ready(1)
    assert engine.warm_up_compiled() > 0
    assert engine.compile_stats()["graphs"] == 2 and engine.decoder.ready(1)  # the flat step and bucket 1's
    finish = engine.complete(prompt(7, 1), greedy(12))
    assert finish.stats.compile["compile_s"] == 0 and finish.stats.compile["graphs"] == 2
    assert finish.stats.decode_tokens_per_s > 0


def test_bench_has_compiled_rows_with_their_warm_up(tiny, tmp_path):
    path, prompts = tmp_path / "bench.json", tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "words", "kind": "completion", "prompt": "t5 t9 t33 t7 t81"}) + "\n")
    assert main(["bench", "--model", tiny.name, "--device", "cpu", "--dtype", "bfloat16", "--prompts", str(prompts),
                 "--configs", "paged,paged+compile", "--no-hf", "--repeats", "1", "--max-new-tokens", "8",
                 "--json", str(path)]) == 0
    rows = {row["name"]: row for row in json.loads(path.read_text())["rows"]}
    assert rows["paged"]["compile"] is None and rows["paged+compile"]["kv"] == "paged"
    compiled = rows["paged+compile"]
    assert compiled["compile_warmup_s"] > 0 and compiled["compile"]["recompiles"] == 0
    assert compiled["decode_tokens_per_s"] > 0 and compiled["roofline_pct"] > 0
    # The limit again at the rate its package's weights read in place, measured at the same moments as the 1 GiB
    # probes: one before the runs, one after the repeat. In bf16 every projection runs through our kernel where it
    # builds, and the weights then lie in a buffer of ours (`package_weights`); elsewhere there is no such row.
    if row_kernel.unavailable() is not None:
        assert "weights_read_gb_s" not in compiled
    else:
        assert len(compiled["weights_read_probes_gb_s"]) == 2 and compiled["weights_read_gb_s"] > 0
        bandwidth = json.loads(path.read_text())["read_bandwidth_gb_s"]
        assert compiled["roofline_pct_weights"] == pytest.approx(  # the same bytes a step, at the other rate
            compiled["roofline_pct"] * bandwidth / compiled["weights_read_gb_s"], rel=0.05, abs=0.1)
    assert "weights_read_gb_s" not in rows["paged"]
    assert main(["bench", "--model", tiny.name, "--configs", "paged+fast", "--no-hf"]) == 2  # unknown suffix


def test_a_package_with_inductors_matmuls_keeps_its_constants_in_its_library(tiny):
    """The fp32 model's projections run through inductor's matmuls, whose packed weights AOTInductor cannot yet write
    beside the library (`package_weights.can_keep_beside`): the package keeps them inside, and there is no buffer of
    ours to probe (the bf16 model's is checked in test_bundled_greedy_compiled_equals_eager)."""
    engine = Engine(tiny, EngineConfig(kv_mode="paged", max_num_seqs=1, compile=True))
    engine.warm_up_compiled()
    assert engine.decoder.weight_memory() == []
    programs = engine.decoder._programs.values()  # the flat step's and the decode step's
    assert len(programs) == 2
    assert all(program.weights is None for program in programs)  # no constants beside the library


def test_generate_compile_flag(tiny, capsys):
    cpu = ["--model", tiny.name, "--device", "cpu", "--dtype", "float32", "--no-chat", "--max-new-tokens", "6",
           "--ignore-eos"]
    assert main(["generate", "--prompt", "t5 t9 t33", *cpu, "--compile", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)[0]["stats"]
    assert stats["compile"]["graphs"] + stats["compile"]["compiled_steps"] > 0 and stats["compile"]["recompiles"] == 0
    assert main(["generate", "--prompt", "t5", *cpu, "--compile", "--kv", "none"]) == 2
    assert "compiled decode needs a KV cache" in capsys.readouterr().err


def test_compile_needs_a_kv_cache_and_a_compiler(tiny, monkeypatch):
    with pytest.raises(ConfigError, match="needs a KV cache"):
        EngineConfig(kv_mode="none", compile=True)
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(ConfigError, match="no C[+][+] compiler"):
        Engine(tiny, EngineConfig(kv_mode="paged", compile=True))
    Engine(tiny, EngineConfig(kv_mode="paged"))  # eager still runs


def test_bundled_greedy_compiled_equals_eager(bench_prompts):
    """The bundled model in bf16 (what `--dtype auto` picks on a CPU with native bf16 math; on an AVX-512 CPU its
    projections run through our kernel, `model.row_kernel`), paged (the app's mode): two benchmark prompts (code, and
    a long grounded one), 64 new tokens, one at a time (batch 1). Each batch bucket is a compile of one to two minutes
    here, so batches are the tiny model's test, which covers every bucket of both cache kinds (in fp32). bf16 logits
    often tie exactly, so the two runs may part at a tie, and the comparison ends there (measured on an AVX2 host:
    code after 37 tokens, the long one not within 64; a short chat prompt parted after 7 and is left out)."""
    torch.manual_seed(0)
    bundled = load_model("bundled", device="cpu", dtype="bfloat16")
    ids = ["code-2", "long-2"]
    settings = dict(kv_mode="paged", max_seq_len=1024, max_num_seqs=1)
    eager = Engine(bundled, EngineConfig(**settings))
    compiled = Engine(bundled, EngineConfig(**settings, compile=True))
    prompts = [eager.prompt_ids(bench_prompts[i]["prompt"], bench_prompts[i].get("system"),
                                chat=bench_prompts[i]["kind"] != "completion") for i in ids]
    for p in prompts:
        want = eager.complete(p, greedy(64)).token_ids
        assert_same_or_near_tie(bundled, p, want, compiled.complete(p, greedy(64)).token_ids)
    stats = compiled.compile_stats()
    assert (stats["graphs"], stats["recompiles"]) == (2, 0)  # the flat step (the prompts) and the decode step
    assert stats["fallbacks"] == {} and stats["steps_by_bucket"]["flat"] == 1  # the first (its load) is not counted
    assert ("row-kernel" in stats["mode"]) == (compiled.decoder.row_kernel_off is None)
    if compiled.decoder.row_kernel_off is None:  # every projection ours: the weights in our buffer (`package_weights`)
        views = compiled.decoder.weight_memory()
        weights = sum(parameter.numel() * parameter.element_size() for parameter in bundled.model.parameters())
        assert len(views) == 1 and views[0].dtype == torch.int64 and views[0].numel() * 8 >= weights
        assert read_rate(views, repeats=1) > 0


def test_a_second_start_loads_the_compiled_step_from_disk(tiny):
    """The CPU's AOTInductor package is written once; an engine in a new process (here: with nothing of the first
    engine's left in this one) loads it instead of compiling, and decodes the same ids."""
    settings = EngineConfig(kv_mode="contiguous", max_seq_len=96, max_num_seqs=1, compile=True)  # shapes of its own
    first = Engine(tiny, settings)
    compile_s = first.warm_up_compiled()
    assert first.compile_stats()["from_disk"] == 0 and first.compile_stats()["mode"].startswith("AOTInductor")
    want = first.complete(prompt(9, 3), greedy(16)).token_ids
    del first
    gc.collect()
    assert not compiled_module._LOADED_PACKAGES  # the package is no longer loaded in this process
    second = Engine(tiny, settings)
    load_s = second.warm_up_compiled()
    assert second.compile_stats()["from_disk"] == 1 and second.compile_stats()["graphs"] == 1
    assert load_s < compile_s / 3, (load_s, compile_s)
    assert second.complete(prompt(9, 3), greedy(16)).token_ids == want


def test_the_package_key_follows_the_weights(tiny):
    model = tiny.model
    before = model_fingerprint(model)
    assert model_fingerprint(model) == before
    weight = model.layers[0].mlp.down_proj.weight
    original = weight[0, 0].item()
    with torch.no_grad():
        weight[0, 0] = original + 1.0  # changed in place: the next key must differ
        assert model_fingerprint(model) != before
        weight[0, 0] = original
    assert model_fingerprint(model) == before


@pytest.mark.parametrize("kv_mode", ["contiguous", "paged"])
def test_torch_compile_backend_compiles_once_for_every_width(tiny, kv_mode, monkeypatch):
    """CUDA's backend (torch.compile, attention as an op the compiler does not look into, widths rounded up to powers
    of two and marked dynamic, the batch dynamic above bucket 1) run on the CPU without CUDA graphs: ids equal eager
    while contexts grow through widths 2 to 16 blocks and batches shrink from 4 to 1, with two compiles in all (bucket
    1, and one for every bucket above it) and none again."""
    monkeypatch.setattr(compiled_module, "default_backend", lambda device: "torch.compile")
    monkeypatch.setattr(engine_module, "default_options", lambda device, model=None: {})  # as CUDA: no freezing
    compiled, _ = compiled_matches_eager(tiny, kv_mode=kv_mode, block_size=4, max_num_seqs=4,
                                         max_num_batched_tokens=64, max_seq_len=96)
    assert compiled.decoder.step.opaque_attention and compiled.decoder.width_buckets
    stats = compiled.compile_stats()
    assert stats["recompiles"] == 0 and stats["graphs"] <= 2 and stats["compiled_steps"] > 0
    # Its KV pool and its buckets' input buffers are static inputs (on CUDA read in place by the graphs); never
    # where inductor freezes, which would make them constants.
    decoder = compiled.decoder
    inputs = [compiled.kv_cache.k, compiled.kv_cache.v] + [
        buffer for buffers in decoder._buffers.values() for buffer in buffers.values()]
    assert decoder.static_inputs and {getattr(t, "_dynamo_static_input_type", None) for t in inputs} == {"unguarded"}
    frozen = compiled_module.CompiledDecoder(tiny.model, make_kv_cache(tiny, EngineConfig(kv_mode=kv_mode), 96),
                                             tiny.device, 1, 96, options={"freezing": True}, backend="torch.compile")
    assert not frozen.static_inputs and not hasattr(frozen.kv_cache.k, "_dynamo_static_input_type")


def test_torch_compile_backend_engines_keep_their_graphs_apart(tiny, monkeypatch):
    """With the guards on the step's modules skipped (they cost 100-170 us a call), each model's decoders compile a
    code object of their own, so that one model's engine never runs another's graph: a model and its int8 copy,
    whose steps take inputs of the same shapes, compiled in one process one after the other, each equal to its own
    eager engine; while a second engine of the first model shares its graphs (a race's two lanes compile once)."""
    from inference_core.quant.linear import QuantConfig
    from inference_core.quant.quantize import quantize

    monkeypatch.setattr(compiled_module, "default_backend", lambda device: "torch.compile")
    monkeypatch.setattr(engine_module, "default_options", lambda device, model=None: {})  # as CUDA: no freezing
    settings = dict(kv_mode="paged", block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_seq_len=96)
    first, _ = compiled_matches_eager(tiny, **settings)
    quantized = quantize(load_model(tiny.name, device="cpu", dtype="float32"), QuantConfig("int8"))
    second, _ = compiled_matches_eager(quantized, **settings)
    assert "module guards skipped" in second.compile_stats()["mode"]
    assert first.decoder.graph is not second.decoder.graph
    codes = {engine.decoder.graph.__wrapped__.__code__ for engine in (first, second)}
    assert len(codes) == 2 and compiled_module.DecodeGraph.forward.__code__ not in codes
    again = Engine(tiny, EngineConfig(**settings, compile=True))
    again.complete(prompt(12, seed=5), greedy(4))
    assert again.decoder.graph.__wrapped__.__code__ is first.decoder.graph.__wrapped__.__code__
    assert again.compile_stats()["graphs"] == 0 and again.compile_stats()["recompiles"] == 0
