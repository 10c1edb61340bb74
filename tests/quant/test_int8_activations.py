"""int4 weights by int8 activations (`model.w4a8_kernel`, `QuantConfig(activations="int8")`): the op against its
formula in torch ops for every shape, dtype and row count it takes, the layout packed and read back, the same bits on
one thread and two, each row of a batched run's every call as it is alone, a compiled step giving the eager ids, and
the settings, CLI and bench spelling it or refusing it in words."""

from __future__ import annotations

import json

import pytest
import torch

from inference_core import ConfigError, Engine, EngineConfig, SamplingParams
from inference_core.bench.speed import default_configs, parse_config
from inference_core.cli import main
from inference_core.model import row_kernel, w4a8_kernel
from inference_core.quant.linear import QuantConfig, QuantLinear, check_int8_activations, round_int4
from inference_core.quant.quantize import quantize
from inference_core.settings import LaneSettings
from inference_core.spec.decoding import SpecConfig

from tiny_models import build_tiny_model, prompt, run_to_end


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-a8"))


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)


def random_int4(out_features: int, in_features: int, group: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    rounded = round_int4(torch.randn(out_features, in_features, generator=generator) * 0.05, group)
    # the scales and zeros the op reads are bf16: the reference takes the same values
    return rounded.q, rounded.scale.bfloat16().float(), rounded.zero.bfloat16().float()


def test_the_layout_reads_back_to_the_same_weight():
    q, scale, zero = random_int4(24, 128, 64, seed=3)
    nibbles, numbers = w4a8_kernel.pack(q, scale, zero)
    assert nibbles.shape == (3, 4, 128) and numbers.shape == (3, 2, 2, 8) and numbers.dtype == torch.bfloat16
    back = w4a8_kernel.unpack(nibbles, numbers)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, scale, zero)))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 37])
@pytest.mark.parametrize("out_features, in_features, group", [(8, 32, 32), (40, 576, 32), (192, 576, 64),
                                                              (576, 1536, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_equals_its_formula(our_ops, rows, out_features, in_features, group, dtype):
    """Rows past the 4 a pass holds (37: x rounded on several threads, 16 rows a share), every group size, fp32 and
    bf16 activations (answered in their dtype): the torch formula within fp32's order of summation (and one bf16
    rounding for bf16). A block of zeros (scale 0) and a block with one large value are in every x."""
    q, scale, zero = random_int4(out_features, in_features, group, seed=rows + in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0
    x[-1, 32 % in_features] = 50.0
    x = x.to(dtype)
    got = w4a8_kernel.linear(x, *w4a8_kernel.pack(q, scale, zero), group)
    want = w4a8_kernel.reference(x, q, scale, zero)
    assert got.shape == (rows, out_features) and got.dtype == dtype
    tolerance = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())


def test_the_sums_do_not_depend_on_the_threads(our_ops):
    q, scale, zero = random_int4(576, 1536, 32, seed=7)
    packed = w4a8_kernel.pack(q, scale, zero)
    x = torch.randn(37, 1536)  # rounded on both threads, 16 rows a share
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = w4a8_kernel.linear(x, *packed, 32)
        torch.set_num_threads(2)
        two = w4a8_kernel.linear(x, *packed, 32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_a_layer_computes_its_weight_by_rounded_activations(our_ops, tiny):
    """A QuantLinear with int8 activations: its dequantized weight is the int4 weight's (the same rounding as
    model activations), and its output is the op's formula on its weight, close to the weight times x unrounded."""
    linear = tiny.model.layers[0].mlp.down_proj
    model_act = QuantLinear(linear, "int4", 32, torch.float32)
    int8_act = QuantLinear(linear, "int4", 32, torch.float32, activations="int8")
    assert not hasattr(int8_act, "qweight") and int8_act.nibbles.dtype == torch.uint8
    torch.testing.assert_close(int8_act.dequantized(), model_act.dequantized(), rtol=2 ** -7, atol=1e-3)
    x = torch.randn(3, 2, int8_act.in_features)
    got = int8_act(x)
    assert got.shape == (3, 2, int8_act.out_features) and got.dtype == torch.float32
    want = w4a8_kernel.reference(x.view(6, -1), *w4a8_kernel.unpack(int8_act.nibbles, int8_act.numbers))
    torch.testing.assert_close(got.view(6, -1), want, rtol=1e-5, atol=1e-5)
    unrounded = x.view(6, -1) @ int8_act.dequantized().t()
    assert (got.view(6, -1) - unrounded).abs().max() < 0.05 * unrounded.abs().max()


def test_each_row_is_rounded_on_its_own_in_every_call_of_a_batched_run(our_ops, tiny, monkeypatch):
    """The op rounds and sums each row of x alone, in the same order whatever the other rows: in a batched run with
    chunked prompts, speculation and both KV caches, every row of every projection's call gives the bits the op
    gives for that row alone. (Whole runs are not compared
    id for id: rounding activations makes ids sensitive to the last bit of what comes before a projection, a value
    on a rounding boundary moving a whole int8 step, and attention over a batch or several queries rounds
    differently from attention over one; on the tiny random model's near ties the ids can then part.)"""
    loaded = quantize(tiny, QuantConfig("int4", 32, activations="int8"))
    assert loaded.quant.name == "int4 g32 x int8 activations"
    calls = []
    forward = QuantLinear.forward

    def recording(layer, x):
        y = forward(layer, x)
        calls.append((layer, x.detach().reshape(-1, x.shape[-1]).clone(), y.detach().reshape(-1, y.shape[-1])))
        return y

    monkeypatch.setattr(QuantLinear, "forward", recording)
    prompts = [prompt(length, seed) for seed, length in enumerate([5, 17, 30])]
    for kv_mode in ("contiguous", "paged"):
        engine = Engine(loaded, EngineConfig(kv_mode=kv_mode, block_size=4, max_num_seqs=3,
                                             max_num_batched_tokens=16))
        requests = [engine.submit(p, greedy(12)) for p in prompts]
        run_to_end(engine)
        assert all(len(request.events[-1].token_ids) == 12 for request in requests)
        assert len(engine.complete(prompts[1], greedy(12), spec=SpecConfig("ngram", k=3)).token_ids) == 12
    monkeypatch.setattr(QuantLinear, "forward", forward)
    assert {x.shape[0] for _, x, _ in calls} >= {1, 3, 16}  # decode rows alone and batched, prompt chunks
    for layer, x, y in calls:
        assert all(torch.equal(layer(x[i:i + 1]), y[i:i + 1]) for i in range(x.shape[0]))


def test_a_compiled_step_gives_the_eager_ids(our_ops, tiny):
    """The op inside the exported, AOT-compiled steps (the prompt's flat step and the decode step), called as a C
    function: the eager forward's ids, since both run the same op."""
    loaded = quantize(tiny, QuantConfig("int4", 32, activations="int8"))
    ids = prompt(9, 2)
    want = Engine(loaded, EngineConfig(kv_mode="paged", block_size=4)).complete(ids, greedy(10)).token_ids
    compiled = Engine(loaded, EngineConfig(kv_mode="paged", block_size=4, compile=True))
    finish = compiled.complete(ids, greedy(10))
    assert finish.token_ids == want and finish.stats.compile["graphs"] == 2
    assert finish.stats.compile["fallbacks"] == {}


def test_settings_cli_and_bench_spell_it_or_refuse_it(our_ops, tiny, tmp_path, capsys):
    with pytest.raises(ConfigError, match="int8 activations go with quantized weights"):
        QuantConfig("none", activations="int8")
    with pytest.raises(ConfigError, match="unknown activations"):
        QuantConfig("int4", activations="int4")
    with pytest.raises(ConfigError, match="run on a CPU only"):
        check_int8_activations(torch.device("cuda"), "q_proj", 64, 64, 32)
    with pytest.raises(ConfigError, match="does not fit"):
        check_int8_activations(torch.device("cpu"), "q_proj", 60, 64, 32)
    lane = LaneSettings(weights="int4", quant_activations="int8")
    assert lane.quant().activations == "int8"
    assert LaneSettings(weights="int8", quant_activations="int8").quant().activations == "int8"
    assert LaneSettings(weights="none", quant_activations="int8").quant().activations == "model"  # does not apply
    config, scheme = parse_config("paged+compile+int4+a8", 64)
    assert config.compile and scheme == QuantConfig("int4", 64, True, "int8")
    assert parse_config("paged+int8+a8")[1] == QuantConfig("int8", 32, True, "int8")
    for bad in ("paged+a8", "paged+compile+a8"):
        with pytest.raises(ConfigError, match="'[+]a8' for int8 activations"):
            parse_config(bad)
    cpu = ["--model", tiny.name, "--device", "cpu", "--dtype", "float32"]
    assert main(["generate", "--prompt", "t5 t9 t33", *cpu, "--no-chat", "--max-new-tokens", "4", "--ignore-eos",
                 "--quant", "int4", "--quant-activations", "int8"]) == 0
    assert "[weights int4 g32 x int8 activations:" in capsys.readouterr().err
    path, prompts = tmp_path / "bench.json", tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "words", "kind": "completion", "prompt": "t5 t9 t33 t7 t81"}) + "\n")
    assert main(["bench", *cpu, "--prompts", str(prompts), "--configs", "paged+int4,paged+int4+a8", "--no-hf",
                 "--repeats", "1", "--max-new-tokens", "6", "--json", str(path)]) == 0
    rows = {row["name"]: row for row in json.loads(path.read_text())["rows"]}
    assert rows["paged+int4+a8"]["quant"] == "int4 g32 x int8 activations"
    assert rows["paged+int4+a8"]["decode_tokens_per_s"] > 0


def test_bench_defaults_end_with_the_fastest_quantized_row(monkeypatch):
    """`bench` with no --configs: eager and compiled paged, then int4 through our loop where the CPU has BF16 dot
    products and this machine measured it no slower than int4 by int8 activations, those where it measured them
    faster or where only our AVX2 ops build, int8 where our ops do not build (int4 where the CPU has the form); on a
    GPU no CPU row."""
    monkeypatch.setattr(row_kernel, "unavailable", lambda: None)
    monkeypatch.setattr(row_kernel, "int4_capable", lambda: True)
    for ratio, row in ((1.0, "paged+compile+int4+steps8"), (None, "paged+compile+int4+steps8"),
                       (0.9, "paged+compile+int4+a8+steps8")):
        monkeypatch.setattr(row_kernel, "tuning", lambda: {"int4": {"a8_versus_int4": ratio}})
        assert default_configs("cpu") == f"paged,paged+compile+steps8,{row}"
    monkeypatch.setattr(row_kernel, "int4_capable", lambda: False)
    assert default_configs("cpu") == "paged,paged+compile+steps8,paged+compile+int4+a8+steps8"
    monkeypatch.setattr(row_kernel, "unavailable", lambda: "no compiler")
    assert default_configs("cpu") == "paged,paged+compile+steps8,paged+compile+int8+steps8"
    monkeypatch.setattr(row_kernel, "int4_capable", lambda: True)
    assert default_configs("cpu") == "paged,paged+compile+steps8,paged+compile+int4+steps8"
    assert default_configs("cuda") == "paged,paged+compile+steps8"
