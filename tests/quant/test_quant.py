"""Weight-only quantization (`inference_core.quant.linear`): the kernels against the dequantized weights they stand
for, the round-to-nearest error bound, the original model left alone, every KV mode and batching on a quantized
model, the CLI's flags and bench rows, and the bundled model still answering."""

from __future__ import annotations

import json

import pytest
import torch

from inference_core import ConfigError, Engine, EngineConfig, SamplingParams
from inference_core.cli import main
from inference_core.model.llama import Linear, packed_bf16_available
from inference_core.model.loader import load_model
from inference_core.quant.linear import QuantConfig, QuantLinear, weight_bytes
from inference_core.quant.quantize import quantize
from inference_core.spec.decoding import SpecConfig

from tiny_models import build_tiny_model, prompt, run_to_end


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-quant"))


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)


def random_linear(in_features: int, out_features: int, in_out: bool) -> Linear:
    torch.manual_seed(1)
    linear = Linear(in_features, out_features, bias=False)
    linear.weight.data = torch.randn(out_features, in_features) * 0.05
    if in_out:
        linear.use_in_out_layout()
    return linear


@pytest.mark.parametrize("scheme,group", [("int8", 32), ("int4", 32), ("int4", 64), ("int4", 128)])
@pytest.mark.parametrize("in_out", [False, True])
def test_kernel_matches_its_dequantized_weight_within_rounding(scheme, group, in_out):
    linear = random_linear(256, 96, in_out)
    weight = (linear.weight.t() if in_out else linear.weight).detach().clone()
    layer = QuantLinear(linear, scheme, group, torch.bfloat16)
    dequantized = layer.dequantized()
    # Round to nearest: each weight within half a step of its original (plus bf16's rounding of the scales).
    if scheme == "int8":
        step = weight.abs().amax(1, keepdim=True) / 127
    else:
        groups = weight.view(96, -1, group)
        step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(group, 1)
    assert ((dequantized - weight).abs() <= step / 2 + 0.01 * weight.abs().amax()).all()
    x = torch.randn(5, 256)
    want = x.bfloat16().float() @ dequantized.t()
    got = layer.forward(x)
    assert got.dtype == torch.float32 and got.shape == (5, 96)
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)


def test_quantize_keeps_the_original_and_shrinks_the_weights(tiny):
    ids = prompt(12, 0)
    before = Engine(tiny, EngineConfig(kv_mode="none")).complete(ids, greedy(8)).token_ids
    int8 = quantize(tiny, QuantConfig("int8"))
    int4 = quantize(tiny, QuantConfig("int4", 32, lm_head=False))
    assert Engine(tiny, EngineConfig(kv_mode="none")).complete(ids, greedy(8)).token_ids == before
    assert isinstance(tiny.model.lm_head, Linear) and isinstance(int8.model.lm_head, QuantLinear)
    assert isinstance(int4.model.lm_head, Linear) and isinstance(int4.model.layers[0].mlp.down_proj, QuantLinear)
    assert int4.model.embed_tokens.weight is tiny.model.embed_tokens.weight  # shared, not copied
    assert weight_bytes(int8.model) < 0.5 * weight_bytes(tiny.model)
    assert int8.quant.name == "int8" and int4.quant.name == "int4 g32 (LM head in the model dtype)"
    assert quantize(tiny, QuantConfig()) is tiny


def test_quantize_shares_the_layout_tensors_a_linear_keeps_as_attributes(tmp_path):
    """A bf16 model in the packed layout (oneDNN's reordered weight, which cannot be copied) quantizes, and the lane
    that keeps those weights still has them; fp32's in_out layout shares its kept [out, in] rows."""
    fp32 = build_tiny_model(tmp_path / "fp32")
    fp32.model.lm_head.out_in_rows = fp32.model.lm_head.weight.detach().t()  # as a tied LM head keeps its rows
    copy = quantize(fp32, QuantConfig("int8", lm_head=False))
    assert copy.model.lm_head.out_in_rows is fp32.model.lm_head.out_in_rows
    if packed_bf16_available():
        bf16 = load_model(str(tmp_path / "fp32"), device="cpu", dtype="bfloat16")
        assert bf16.model.lm_head.layout == "packed"
        ids = prompt(12, 0)
        before = Engine(bf16, EngineConfig(kv_mode="paged")).complete(ids, greedy(8)).token_ids
        int8 = quantize(bf16, QuantConfig("int8", lm_head=False))
        assert int8.model.lm_head.packed is bf16.model.lm_head.packed
        assert len(Engine(int8, EngineConfig(kv_mode="paged")).complete(ids, greedy(8)).token_ids) == 8
        assert Engine(bf16, EngineConfig(kv_mode="paged")).complete(ids, greedy(8)).token_ids == before


def test_bad_settings_say_what_to_change(tiny):
    with pytest.raises(ConfigError, match="one of none, int8, int4"):
        QuantConfig("int3")
    with pytest.raises(ConfigError, match="group size must be one of 32, 64, 128"):
        QuantConfig("int4", 48)
    with pytest.raises(ConfigError, match="do not divide 64 input features"):  # the tiny model is 64 wide
        quantize(tiny, QuantConfig("int4", 128))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_every_kv_mode_and_batching_agree_on_a_quantized_model(tiny, scheme):
    """Quantization changes the weights, not the engine: each KV mode, one at a time, batched and speculating, gives
    the ids of the recompute reference on the same quantized model."""
    loaded = quantize(tiny, QuantConfig(scheme, 32))
    prompts = [prompt(length, seed) for seed, length in enumerate([5, 17, 30])]
    want = [Engine(loaded, EngineConfig(kv_mode="none")).complete(p, greedy(12)).token_ids for p in prompts]
    for kv_mode in ("contiguous", "paged"):
        engine = Engine(loaded, EngineConfig(kv_mode=kv_mode, block_size=4, max_num_seqs=3))
        assert [engine.complete(p, greedy(12)).token_ids for p in prompts] == want
        requests = [engine.submit(p, greedy(12)) for p in prompts]
        run_to_end(engine)
        assert [request.events[-1].token_ids for request in requests] == want
        for method in ("ngram", "early-exit"):  # speculation verifies k + 1 rows through the same kernels
            spec = SpecConfig(method, k=3)
            assert [engine.complete(p, greedy(12), spec=spec).token_ids for p in prompts] == want


def test_generate_and_bench_take_quantized_weights(tiny, tmp_path, capsys):
    cpu = ["--model", tiny.name, "--device", "cpu", "--dtype", "float32"]
    assert main(["generate", "--prompt", "t5 t9 t33", *cpu, "--no-chat", "--max-new-tokens", "4", "--ignore-eos",
                 "--quant", "int4", "--quant-group", "64"]) == 0
    assert "[weights int4 g64:" in capsys.readouterr().err
    assert main(["generate", "--prompt", "t5", *cpu, "--quant", "int4", "--quant-group", "48"]) == 2
    assert "group size must be one of" in capsys.readouterr().err
    path, prompts = tmp_path / "bench.json", tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "words", "kind": "completion", "prompt": "t5 t9 t33 t7 t81"}) + "\n")
    assert main(["bench", *cpu, "--prompts", str(prompts), "--configs",
                 "paged,paged+int8,paged+int4,paged+int4+float-lm-head", "--no-hf", "--repeats", "1",
                 "--max-new-tokens", "6", "--json", str(path)]) == 0
    rows = {row["name"]: row for row in json.loads(path.read_text())["rows"]}
    assert rows["paged"]["quant"] == "none" and rows["paged+int4"]["quant"] == "int4 g32"
    assert rows["paged+int4+float-lm-head"]["quant"] == "int4 g32 (LM head in the model dtype)"
    assert rows["paged+int4"]["weights_mib"] < rows["paged+int8"]["weights_mib"] < rows["paged"]["weights_mib"]
    assert rows["paged+int4"]["weights_mib"] < rows["paged+int4+float-lm-head"]["weights_mib"] < rows["paged"][
        "weights_mib"]
    assert all(row["decode_tokens_per_s"] > 0 and row["roofline_pct"] > 0 for row in rows.values())
    for bad in ("paged+int8+int4", "paged+float-lm-head"):
        assert main(["bench", *cpu, "--configs", bad, "--no-hf"]) == 2
        assert "'+float-lm-head' to keep the LM head" in capsys.readouterr().err


def test_bundled_quantized_still_answers(bundled):
    """The bundled model with int8 and with int4 (group 32) weights, greedy: the same factual answer as full
    precision. (How much quality each scheme costs is `python -m inference_core quality`'s to measure.)"""
    question = "What is the capital of France? Answer in one sentence."
    for scheme in ("int8", "int4"):
        engine = Engine(quantize(bundled, QuantConfig(scheme)), EngineConfig(kv_mode="paged"))
        finish = engine.complete(engine.prompt_ids(question), SamplingParams(max_new_tokens=24))
        assert "Paris" in engine.tokenizer.decode(finish.token_ids), scheme


def test_compiled_decode_runs_quantized_weights(tiny, scheme="int4"):
    """The int4 kernel inside the exported, AOT-compiled step (int8's goes the same way; a compile is 25-35 s)."""
    from inference_core.engine.compiled import compile_unavailable

    if compile_unavailable(torch.device("cpu")):
        pytest.skip(compile_unavailable(torch.device("cpu")))
    loaded = quantize(tiny, QuantConfig(scheme, 32))
    ids = prompt(9, 2)
    want = Engine(loaded, EngineConfig(kv_mode="paged", block_size=4)).complete(ids, greedy(10)).token_ids
    compiled = Engine(loaded, EngineConfig(kv_mode="paged", block_size=4, compile=True))
    finish = compiled.complete(ids, greedy(10))
    assert finish.token_ids == want and finish.stats.compile["graphs"] == 2  # the prompt's flat step, the decode step


def test_int8_weights_compile_with_the_gemm_template_alone(tiny, monkeypatch, tmp_path):
    """On the CPU a model with int8 weights compiles its decode step with inductor's C++ GEMM template alone (not a
    per-compile timing against ATen's kernel); where that compile fails, the step compiles again with every backend
    and still decodes as eager does."""
    from inference_core.engine import compiled as compiled_module

    if compiled_module.compile_unavailable(torch.device("cpu")):
        pytest.skip(compiled_module.compile_unavailable(torch.device("cpu")))
    cpu = torch.device("cpu")
    loaded = quantize(tiny, QuantConfig("int8"))
    assert compiled_module.default_options(cpu, loaded.model)["max_autotune_gemm_backends"] == "CPP"
    assert "max_autotune_gemm_backends" not in compiled_module.default_options(cpu, tiny.model)
    assert "max_autotune_gemm_backends" not in compiled_module.default_options(
        cpu, quantize(tiny, QuantConfig("int4", 32)).model)
    compile_package, tried = torch._inductor.aoti_compile_and_package, []

    def template_fails(program, package_path, inductor_configs):
        tried.append(inductor_configs.get("max_autotune_gemm_backends"))
        if tried[-1] == "CPP":
            raise RuntimeError("NoValidChoicesError: no choices exist for backend")
        return compile_package(program, package_path=package_path, inductor_configs=inductor_configs)

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", template_fails)
    monkeypatch.setenv("INFERENCE_CORE_COMPILE_CACHE", str(tmp_path))  # nothing compiled there yet
    ids = prompt(9, 2)
    want = Engine(loaded, EngineConfig(kv_mode="paged", block_size=4)).complete(ids, greedy(10)).token_ids
    finish = Engine(loaded, EngineConfig(kv_mode="paged", block_size=4, compile=True)).complete(ids, greedy(10))
    assert tried == [None, "CPP", None]  # the flat step (the prompt) compiles without max-autotune's choices
    assert finish.token_ids == want and finish.stats.compile["graphs"] == 2
