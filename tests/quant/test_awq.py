"""AWQ int4 weights (`inference_core.quant.awq`, `calibrated_file`) on a tiny random Llama: a layer against its
dequantized float reference, alpha 0 as plain round to nearest bit for bit, folding that keeps the float function,
the searched error never above RTN's on the calibration inputs (and the reported error being the built layer's), save
and load giving the same logits, a file for other weights refused, and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from inference_core import ConfigError, Engine, EngineConfig
from inference_core.quant import awq, calibrated_file
from inference_core.cli import main
from inference_core.kv.cache import RecomputeKVCache
from inference_core.model.llama import Linear
from inference_core.quant.linear import QuantConfig, QuantLinear, compute_dtype, round_int4
from inference_core.quant.quantize import quantize
from inference_core.engine.runner import ModelRunner
from inference_core.sequence import Sequence

from tiny_models import TinyFamily
from tiny_models import build_tiny_model, greedy, prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # many small ops: see conftest
GROUP = 32
PROJECTIONS = [f"layers.{i}.{path}" for i in range(2) for path, _ in awq.LAYER_PROJECTIONS] + ["lm_head"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-awq"))


@pytest.fixture(scope="module")
def sequences():
    """Four calibration sequences of 64 random token ids."""
    return [prompt(64, seed) for seed in range(4)]


@pytest.fixture(scope="module")
def calibrated(tiny, sequences, tmp_path_factory):
    """(AWQ LoadedModel, Calibration, file path) at group 32."""
    path = tmp_path_factory.mktemp("awq") / "tiny-g32.safetensors"
    quantized, calibration, _ = calibrated_file.calibrate_and_save(tiny, GROUP, path, sequences=sequences)
    return quantized, calibration, path


def all_logits(loaded, ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(ids), vocab] of one full forward."""
    return ModelRunner(loaded.model, RecomputeKVCache(), loaded.device).run([Sequence(list(ids))], num_logits=len(ids))


def test_awq_layer_matches_its_dequantized_float_reference(tiny, calibrated):
    """down_proj of layer 0 (its inputs arrive divided by s, folded into the up rows): the int4 kernel on x / s
    equals x times the reference weight Q(W s) / s, rebuilt from the original float weight."""
    quantized, calibration, _ = calibrated
    choice = calibration.choices["layers.0.mlp.down_proj"]
    weight = awq.out_in(tiny.model.layers[0].mlp.down_proj)  # [64, 128]
    compute = compute_dtype("cpu", torch.float32)
    reference = round_int4(weight * choice.scale, GROUP, choice.clip).dequantized(compute) / choice.scale
    layer = quantized.model.layers[0].mlp.down_proj
    assert isinstance(layer, QuantLinear) and layer.group_size == GROUP
    torch.manual_seed(3)
    x = torch.randn(7, 128)
    got = layer.forward(x / choice.scale)
    want = x.to(compute).float() @ reference.t()
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.02 * want.abs().max().item())
    assert (reference - weight).abs().max() > 0  # it is int4: not the float weight


def test_alpha_zero_is_round_to_nearest_bit_for_bit(tiny, sequences, tmp_path):
    """With the grid cut to alpha 0 and no clipping, every layer and logit equals `--quant int4`'s."""
    awq_zero, calibration, _ = calibrated_file.calibrate_and_save(tiny, GROUP, tmp_path / "zero.safetensors",
                                                           sequences=sequences, alphas=(0.0,), clip_ratios=(1.0,))
    assert all(choice.alpha == 0 and choice.clip is None for choice in calibration.choices.values())
    assert all(torch.equal(choice.scale, torch.ones_like(choice.scale)) for choice in calibration.choices.values())
    rtn = quantize(tiny, QuantConfig("int4", GROUP))
    for name in PROJECTIONS:
        ours, theirs = awq_zero.model.get_submodule(name), rtn.model.get_submodule(name)
        assert torch.equal(ours.qweight, theirs.qweight) and torch.equal(ours.scales, theirs.scales), name
    ids = prompt(30, 7)
    assert torch.equal(all_logits(awq_zero, ids), all_logits(rtn, ids))


def random_scales(loaded, seed: int) -> dict[str, torch.Tensor]:
    """A scale per input feature of every projection, spread over two decades; o_proj's tied per KV head."""
    generator = torch.Generator().manual_seed(seed)
    scales = {}
    for name in PROJECTIONS:
        size = awq.out_in(loaded.model.get_submodule(name)).shape[1]
        scale = torch.exp(torch.randn(size, generator=generator) * 1.2)
        scales[name] = awq.tie_heads(scale, loaded.config) if name.endswith("o_proj") else scale
    return scales


def test_folding_the_scales_keeps_the_float_function(tiny, calibrated):
    """Scales folded, nothing rounded: the same logits as the original (random scales and the calibrated ones), and
    the original model's tensors untouched."""
    before = {name: tensor.clone() for name, tensor in tiny.model.state_dict().items()}
    ids = prompt(40, 11)
    want = all_logits(tiny, ids)
    for scales in (random_scales(tiny, 5), {name: choice.scale for name, choice in calibrated[1].choices.items()}):
        folded = awq.fold_scales(tiny, scales)
        norm, original_norm = folded.model.layers[0].input_layernorm, tiny.model.layers[0].input_layernorm
        assert not torch.equal(norm.weight, original_norm.weight)
        torch.testing.assert_close(all_logits(folded, ids), want, rtol=1e-4, atol=1e-4)
    assert all(torch.equal(tensor, before[name]) for name, tensor in tiny.model.state_dict().items())
    assert isinstance(tiny.model.layers[0].mlp.down_proj, Linear)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama-tied"])
def test_other_families_fold_and_load_back(family, sequences, tmp_path):
    """Qwen2's q/k/v biases (the v bias divided with its rows), Qwen3's per-head q/k norms and an LM head tied to the
    embedding: folding keeps the logits, and the saved file loads back to the calibrated model's logits."""
    loaded = TinyFamily(family, tmp_path / family).loaded
    ids = prompt(30, 2)
    torch.testing.assert_close(all_logits(awq.fold_scales(loaded, random_scales(loaded, 6)), ids),
                               all_logits(loaded, ids), rtol=1e-4, atol=1e-4)
    path = tmp_path / "awq.safetensors"
    quantized, _, _ = calibrated_file.calibrate_and_save(loaded, GROUP, path, sequences=sequences)
    assert torch.equal(all_logits(calibrated_file.load(loaded, path), ids), all_logits(quantized, ids))
    if family == "qwen2":
        assert quantized.model.layers[0].self_attn.qkv_proj.bias is not None


def test_awq_output_error_is_at_most_rtns_on_the_calibration_inputs(tiny, sequences, calibrated):
    """Every projection's error on the calibration inputs is at most round to nearest's, lower in total; and the
    reported errors are those of the layers built (down_proj, whose rows are not rescaled, recomputed from the
    kernels' own dequantized weights)."""
    quantized, calibration, _ = calibrated
    choices = calibration.choices
    assert sorted(choices) == sorted(PROJECTIONS)
    assert all(choice.awq_error <= choice.rtn_error for choice in choices.values())
    assert sum(c.awq_error for c in choices.values()) < 0.9 * sum(c.rtn_error for c in choices.values())
    rtn = quantize(tiny, QuantConfig("int4", GROUP))
    for name, _, stats in awq.walk_inputs(tiny, sequences):
        if not name.endswith("down_proj") and name != "lm_head":
            continue
        gram = (stats.gram / stats.count).float()
        weight = awq.out_in(tiny.model.get_submodule(name))
        awq_weight = quantized.model.get_submodule(name).dequantized() / choices[name].scale
        assert awq.output_error(weight, awq_weight, gram) == pytest.approx(choices[name].awq_error, rel=0.05)
        rtn_weight = rtn.model.get_submodule(name).dequantized()
        assert awq.output_error(weight, rtn_weight, gram) == pytest.approx(choices[name].rtn_error, rel=0.05)


def test_alpha_scored_on_sampled_rows_is_still_checked_against_rtn(tiny, sequences, monkeypatch):
    """A tall weight (the LM head) picks alpha on a sample of its rows; the choice is then held to round to nearest
    on every row: with a one-row sample, whatever alpha it finds, the whole matrix's error stays at most RTN's."""
    monkeypatch.setattr(awq, "SEARCH_ROWS", 1)
    *_, (name, linear, stats) = awq.walk_inputs(tiny, sequences)
    weight = awq.out_in(linear)
    choice = awq.search_projection(weight, stats, GROUP, torch.float32, clip_ratios=(1.0,))
    assert name == "lm_head" and choice.clip is None and choice.awq_error <= choice.rtn_error
    rebuilt = round_int4(weight * choice.scale, GROUP).dequantized() / choice.scale
    assert awq.output_error(weight, rebuilt, (stats.gram / stats.count).float()) == pytest.approx(choice.awq_error)


def test_save_then_load_gives_the_same_logits(tiny, calibrated):
    quantized, _, path = calibrated
    metadata = calibrated_file.read_metadata(path)
    assert metadata["group_size"] == "32" and metadata["calibration_tokens"] == "256"
    assert set(json.loads(metadata["alphas"])) == set(PROJECTIONS)
    loaded = calibrated_file.load(tiny, path)
    assert loaded.quant.name == "awq int4 g32"
    ids = prompt(50, 3)
    assert torch.equal(all_logits(loaded, ids), all_logits(quantized, ids))
    without_head = calibrated_file.load(tiny, path, lm_head=False)
    # The LM head in the model dtype, and the final norm unfolded with it (both the original's tensors).
    assert isinstance(without_head.model.lm_head, Linear)
    assert without_head.model.lm_head.weight is tiny.model.lm_head.weight
    assert without_head.model.norm.weight is tiny.model.norm.weight
    assert isinstance(without_head.model.layers[1].mlp.down_proj, QuantLinear)


def test_a_file_for_other_weights_or_a_group_that_does_not_fit_is_refused(tiny, calibrated):
    _, calibration, path = calibrated
    other = awq.fold_scales(tiny, {name: choice.scale for name, choice in calibration.choices.items()})
    with pytest.raises(ConfigError, match="was calibrated for other weights"):
        calibrated_file.load(other, path)
    with pytest.raises(ConfigError, match="holds int4 groups of 32, not 64"):
        calibrated_file.load(tiny, path, group_size=64)
    with pytest.raises(ConfigError, match=r"groups of 128 do not divide .* \(64, 128\); pick another"):
        calibrated_file.calibrate_and_save(tiny, 128, path.with_name("never-written.safetensors"), sequences=[[5] * 8])
    assert not path.with_name("never-written.safetensors").exists()


def test_quantize_calibrates_once_then_loads(tiny, sequences, monkeypatch, capsys):
    """`quantize(..., QuantConfig('awq'))` calibrates into the cache (conftest points it at a temporary directory),
    then reads the file back; the two give the same greedy ids."""
    monkeypatch.setattr(calibrated_file, "calibration_sequences", lambda tokenizer: sequences)
    path = calibrated_file.default_path(tiny, 64)
    path.unlink(missing_ok=True)
    first = quantize(tiny, QuantConfig("awq", 64))
    assert path.exists() and "calibrated in" in capsys.readouterr().err
    second = quantize(tiny, QuantConfig("awq", 64))
    assert "calibrat" not in capsys.readouterr().err
    ids = prompt(12, 4)
    want = Engine(first, EngineConfig(kv_mode="none")).complete(ids, greedy(16)).token_ids
    assert Engine(second, EngineConfig(kv_mode="paged")).complete(ids, greedy(16)).token_ids == want


def test_cli_calibrates_and_generate_loads_it(tiny, capsys):
    """`awq` writes the file `generate --quant awq` then reads (calibrated on the shipped text: to the tiny model's
    word-level tokenizer every word is its unknown token, which is enough to run it)."""
    cpu = ["--model", tiny.name, "--device", "cpu", "--dtype", "float32"]
    assert main(["awq", *cpu, "--quant-group", "32"]) == 0
    printed = capsys.readouterr().out
    assert "layers.1.mlp.down_proj" in printed and "alpha" in printed
    assert f"wrote {calibrated_file.default_path(tiny, 32)}" in printed
    assert main(["generate", "--prompt", "t5 t9 t33", *cpu, "--no-chat", "--max-new-tokens", "4", "--ignore-eos",
                 "--quant", "awq"]) == 0
    err = capsys.readouterr().err
    assert "[weights awq int4 g32:" in err and "calibrat" not in err
    assert main(["awq", *cpu, "--quant-group", "48"]) == 2
    assert "group size must be one of" in capsys.readouterr().err
