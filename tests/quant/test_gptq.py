"""GPTQ int4 weights (`inference_core.quant.gptq`, saved by `calibrated_file`): the error compensation against round
to nearest on correlated inputs, no compensation at all where the inputs are uncorrelated, lazy blocks that change
nothing, the grid the kernels compute with, every projection of a tiny Llama no worse than RTN on its calibration
inputs, GPTQ on AWQ's folded weights, save and load giving the same logits, another method's file refused, and the
CLI."""

from __future__ import annotations

import json

import pytest
import torch

from inference_core import ConfigError, Engine, EngineConfig
from inference_core.cli import main
from inference_core.kv.cache import RecomputeKVCache
from inference_core.engine.runner import ModelRunner
from inference_core.quant import awq, calibrated_file, gptq
from inference_core.quant.linear import QuantConfig, QuantLinear, round_int4
from inference_core.quant.quantize import quantize
from inference_core.sequence import Sequence

from tiny_models import build_tiny_model, greedy, prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # many small ops: see conftest
GROUP = 32


def correlated_inputs(tokens: int, features: int, seed: int) -> torch.Tensor:
    """Inputs whose channels are correlated (a random mixing of a few strong directions), as a layer's are."""
    generator = torch.Generator().manual_seed(seed)
    basis = torch.randn(features // 4, features, generator=generator)
    return torch.randn(tokens, features // 4, generator=generator) @ basis + 0.1 * torch.randn(
        tokens, features, generator=generator)


def gram_of(x: torch.Tensor) -> torch.Tensor:
    return x.t() @ x / x.shape[0]


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_compensates_rounding_errors_where_the_inputs_are_correlated(act_order):
    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(0))
    gram = gram_of(correlated_inputs(2048, 256, seed=1))
    rounded = gptq.gptq_weight(weight, gram, GROUP, act_order=act_order)
    assert rounded.q.dtype == torch.int32 and 0 <= rounded.q.min() and rounded.q.max() <= 15
    assert rounded.scale.shape == (96, 256 // GROUP) and rounded.group_size == GROUP
    rtn = awq.output_error(weight, round_int4(weight, GROUP).dequantized(), gram)
    error = awq.output_error(weight, rounded.dequantized(), gram)
    assert error < 0.6 * rtn  # measured: about a third of RTN's output error on such inputs


def reference_gptq(weight, gram, group_size, act_order):
    """GPTQ as first written (Optimal Brain Quantization's update, one column at a time): the inverse Hessian kept
    explicitly and shrunk by one row and column after each rounded column, no Cholesky factor, no lazy blocks."""
    weight, in_features = weight.double().clone(), weight.shape[1]
    hessian = gram.double() + gptq.DAMP * gram.double().diagonal().mean() * torch.eye(in_features, dtype=torch.float64)
    inverse = torch.linalg.inv(hessian)
    order = torch.argsort(gram.diagonal(), descending=True).tolist() if act_order else list(range(in_features))
    scale, zero = (gptq._grid(weight.float(), group_size, torch.float32) if act_order else
                   (torch.empty(weight.shape[0], in_features // group_size),) * 2)
    scale, zero = scale.clone().double(), zero.clone().double()
    q = torch.empty_like(weight)
    remaining = list(order)
    for column in order:
        group = column // group_size
        if not act_order and column % group_size == 0:
            grid = gptq._grid(weight[:, column:column + group_size].float(), group_size, torch.float32)
            scale[:, group], zero[:, group] = grid[0][:, 0].double(), grid[1][:, 0].double()
        q[:, column] = torch.round((weight[:, column] - zero[:, group]) / scale[:, group] + 8).clamp(0, 15)
        error = (weight[:, column] - ((q[:, column] - 8) * scale[:, group] + zero[:, group])) / inverse[column, column]
        remaining.remove(column)
        weight[:, remaining] -= error[:, None] * inverse[column, remaining][None, :]
        inverse = inverse - inverse[:, column:column + 1] @ inverse[column:column + 1, :] / inverse[column, column]
    return q.to(torch.int32)


@pytest.mark.parametrize("act_order", [False, True])
def test_the_cholesky_form_in_lazy_blocks_equals_the_update_as_first_written(act_order):
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(10))
    gram = gram_of(correlated_inputs(512, 64, seed=11))
    ours = gptq.gptq_weight(weight, gram, GROUP, act_order=act_order, block=32)
    assert (ours.q != reference_gptq(weight, gram, GROUP, act_order)).float().mean() < 0.01  # ties in fp32 vs fp64


def test_uncorrelated_inputs_leave_nothing_to_compensate_and_lazy_blocks_change_nothing():
    """With a diagonal Hessian no column's error reaches another: GPTQ is round to nearest. Blocks of 32 columns and
    of 128 carry the same updates, in another order of the same sums."""
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(2))
    diagonal = torch.diag(torch.rand(128, generator=torch.Generator().manual_seed(3)) + 0.5)
    plain = gptq.gptq_weight(weight, diagonal, GROUP, act_order=False)
    assert torch.allclose(plain.dequantized(), round_int4(weight, GROUP).dequantized(), atol=1e-6)
    gram = gram_of(correlated_inputs(512, 128, seed=4))
    for act_order in (False, True):
        blocks = [gptq.gptq_weight(weight, gram, GROUP, act_order=act_order, block=block) for block in (32, 128)]
        assert (blocks[0].q != blocks[1].q).float().mean() < 0.002  # a rounding tie may fall the other way
        assert torch.equal(blocks[0].scale, blocks[1].scale) or not act_order


def test_the_grid_is_the_compute_dtypes_and_a_dead_input_or_a_bad_group_is_handled():
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(5))
    gram = gram_of(correlated_inputs(256, 64, seed=6))
    gram[7, :], gram[:, 7] = 0, 0  # a channel no calibration token used
    rounded = gptq.gptq_weight(weight, gram, GROUP, torch.bfloat16)
    assert torch.equal(rounded.scale, rounded.scale.to(torch.bfloat16).float())  # what the kernel keeps
    assert torch.isfinite(rounded.dequantized()).all()
    with pytest.raises(ConfigError, match="groups of 128 do not divide 64"):
        gptq.gptq_weight(weight, gram, 128)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-gptq"))


@pytest.fixture(scope="module")
def sequences():
    return [prompt(64, seed) for seed in range(4)]


@pytest.fixture(scope="module")
def calibrated(tiny, sequences, tmp_path_factory):
    path = tmp_path_factory.mktemp("gptq") / "tiny-gptq-g32.safetensors"
    quantized, calibration, _ = calibrated_file.calibrate_and_save(tiny, GROUP, path, sequences=sequences,
                                                                   method="gptq")
    return quantized, calibration, path


def all_logits(loaded, ids: list[int]) -> torch.Tensor:
    return ModelRunner(loaded.model, RecomputeKVCache(), loaded.device).run([Sequence(list(ids))], num_logits=len(ids))


def test_every_projection_is_no_worse_than_rtn_and_the_built_layer_is_the_result(tiny, calibrated):
    quantized, calibration, _ = calibrated
    assert len(calibration.results) == 2 * 4 + 1 and calibration.num_tokens == 256
    for name, result in calibration.results.items():
        assert result.gptq_error <= result.rtn_error * 1.001, name
    layer = quantized.model.layers[1].mlp.down_proj
    assert isinstance(layer, QuantLinear) and layer.scheme == "int4"
    reference = calibration.results["layers.1.mlp.down_proj"].weight.dequantized(layer.compute)
    assert torch.allclose(layer.dequantized(), reference, atol=2e-3)  # read back through the kernel, in bf16
    assert quantized.model.layers[0].input_layernorm.weight is tiny.model.layers[0].input_layernorm.weight


def test_save_then_load_gives_the_same_logits_and_an_awq_file_is_not_a_gptq_one(tiny, calibrated, tmp_path):
    quantized, _, path = calibrated
    metadata = calibrated_file.read_metadata(path)
    assert metadata["format"] == "gptq-int4-v1" and metadata["act_order"] == "True"
    assert set(json.loads(metadata["output_errors"])) == {
        *(f"layers.{i}.{path}" for i in range(2) for path, _ in awq.LAYER_PROJECTIONS), "lm_head"}
    loaded = calibrated_file.load(tiny, path, method="gptq")
    assert loaded.quant.name == "gptq int4 g32"
    ids = prompt(40, 7)
    assert torch.equal(all_logits(loaded, ids), all_logits(quantized, ids))
    with pytest.raises(ConfigError, match="is not an AWQ file of ours"):
        calibrated_file.load(tiny, path, method="awq")
    with pytest.raises(ConfigError, match="python -m inference_core gptq"):
        calibrated_file.load(tiny, tmp_path / "absent.safetensors", method="gptq")


def test_gptq_on_awq_scales_folds_the_norms_and_stays_no_worse_than_rtn(tiny, sequences, tmp_path):
    quantized, calibration, _ = calibrated_file.calibrate_and_save(
        tiny, GROUP, tmp_path / "on-awq.safetensors", sequences=sequences, method="gptq", on_awq=True)
    assert all(r.gptq_error <= r.rtn_error * 1.001 for r in calibration.results.values())
    norm = quantized.model.layers[0].input_layernorm.weight
    assert not torch.equal(norm, tiny.model.layers[0].input_layernorm.weight)  # AWQ's scales folded into it
    # The whole model on a calibration sequence: closer to the float model than round to nearest (a GPTQ that
    # rounded other weights than the folded ones would be far off).
    ids = sequences[0]
    float_logits = all_logits(tiny, ids)
    rtn = (all_logits(quantize(tiny, QuantConfig("int4", GROUP)), ids) - float_logits).abs().mean()
    assert (all_logits(quantized, ids) - float_logits).abs().mean() < rtn


def test_on_awq_scales_gptq_rounds_the_folded_weights(tiny, sequences):
    """With scales far from 1, each result stands for the folded layer's weight (columns times s, the v and up rows
    over the next projection's s), not for the original's."""
    generator = torch.Generator().manual_seed(9)
    names = [f"layers.{i}.{path}" for i in range(2) for path, _ in awq.LAYER_PROJECTIONS] + ["lm_head"]
    scales = {}
    for name in names:
        width = awq.out_in(tiny.model.get_submodule(name)).shape[1]
        scales[name] = 0.5 + 1.5 * torch.rand(width, generator=generator)
    scales = {name: (awq.tie_heads(scale, tiny.config) if name.endswith("o_proj") else scale)
              for name, scale in scales.items()}
    calibration = gptq.calibrate(tiny, GROUP, sequences, awq_scales=scales)
    folded = awq.fold_scales(tiny, scales)
    for name in names:
        want = awq.out_in(folded.model.get_submodule(name))
        got = calibration.results[name].weight.dequantized()
        assert (got - want).norm() < 0.2 * want.norm(), name


def test_quantize_and_the_cli_calibrate_once_then_load(tiny, sequences, monkeypatch, capsys):
    monkeypatch.setattr(calibrated_file, "calibration_sequences", lambda tokenizer: sequences)
    path = calibrated_file.default_path(tiny, 64, "gptq")
    path.unlink(missing_ok=True)
    first = quantize(tiny, QuantConfig("gptq", 64))
    assert path.exists() and "[gptq: calibrated in" in capsys.readouterr().err
    second = quantize(tiny, QuantConfig("gptq", 64))
    assert "calibrat" not in capsys.readouterr().err
    ids = prompt(12, 4)
    want = Engine(first, EngineConfig(kv_mode="none")).complete(ids, greedy(16)).token_ids
    assert Engine(second, EngineConfig(kv_mode="paged")).complete(ids, greedy(16)).token_ids == want
    cpu = ["--model", tiny.name, "--device", "cpu", "--dtype", "float32"]
    assert main(["gptq", *cpu, "--quant-group", "32", "--no-act-order"]) == 0
    printed = capsys.readouterr().out
    assert "layers.1.mlp.down_proj" in printed and "(RTN" in printed
    assert f"wrote {calibrated_file.default_path(tiny, 32, 'gptq')}" in printed
    assert calibrated_file.read_metadata(calibrated_file.default_path(tiny, 32, "gptq"))["act_order"] == "False"
    assert main(["generate", "--prompt", "t5 t9 t33", *cpu, "--no-chat", "--max-new-tokens", "4", "--ignore-eos",
                 "--quant", "gptq"]) == 0
    err = capsys.readouterr().err
    assert "[weights gptq int4 g32:" in err and "calibrat" not in err
