"""Our projection kernel for compiled decode on AVX-512 and AVX2 CPUs (`inference_core.model.row_kernel`): the ops
(bf16 and int8 weights) against fp32 matmuls of the same values, which projections they take, and where they stay
off. The compiled step that calls them is checked on the bundled model against eager (tests/engine/test_compiled.py)."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch
import torch.nn.functional as F
from tiny_models import build_tiny_model

import inference_core
from inference_core import Engine, EngineConfig
from inference_core.engine.compiled import compile_unavailable
from inference_core.model import attention_kernel, row_kernel
from inference_core.model.llama import Linear
from inference_core.quant import kernels
from inference_core.quant.linear import QuantLinear, round_int4

needs_int4_form = pytest.mark.skipif(not row_kernel.int4_capable(), reason="the int4 form needs AVX-512 with BF16")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("out_features, in_features", [(48, 64), (50, 40), (577, 576), (7, 1536)])
def test_the_op_equals_an_fp32_matmul_rounded_to_bf16(our_ops, rows, out_features, in_features):
    """Every row count it takes, output features that fill no whole block of 48, any input width: the fp32 sums of
    the bf16 products, rounded once to bf16 (within the rounding of two orders of summation)."""
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    got = torch.ops.inference_core.linear_rows(x, row_kernel.pack(weight), out_features)
    want = x.float() @ weight.float().t()
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    # one bf16 rounding (half an ulp: 2^-8 relative) plus the fp32 order of summation
    assert torch.allclose(got.float(), want, rtol=2 ** -8, atol=1e-4 * in_features ** 0.5)
    assert torch.allclose(got.float(), F.linear(x, weight).float(), rtol=2 ** -7, atol=1e-4 * in_features ** 0.5)


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 7, 8])
@pytest.mark.parametrize("out_features, in_features", [(48, 64), (577, 576), (7, 1536)])
def test_the_int8_op_equals_an_fp32_matmul_of_the_dequantized_weight(our_ops, rows, out_features, in_features):
    """int8 weights, a scale per output feature (QuantLinear's int8 scheme, its bf16 scales): the fp32 sums of x q
    times the scale, rounded once to bf16, as ATen's `_weight_int8pack_mm` computes them (in another order)."""
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    q = torch.randint(-127, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
    scales = (torch.rand(out_features, generator=generator) / 64).to(torch.bfloat16)
    got = row_kernel.linear_int8(x, q, scales)
    want = x.float() @ (q.float() * scales.float()[:, None]).t()
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want, rtol=2 ** -8, atol=1e-5 * in_features ** 0.5)
    aten = torch._weight_int8pack_mm(x, q, scales)
    assert torch.allclose(got.float(), aten.float(), rtol=2 ** -7, atol=1e-5 * in_features ** 0.5)


@pytest.mark.parametrize("capability, tuned, ours", [("AVX2", (2, 0), True), ("AVX512", (2, 0), False),
                                                     ("AVX512", (4, 1024), True), ("AVX512", (2, 1024), True)])
def test_a_quantized_int8_projection_calls_it_while_tracing_where_measured_faster(our_ops, capability, tuned, ours,
                                                                                  monkeypatch):
    """`QuantLinear`'s int8 scheme in an exported decode step: our op on AVX2, and on AVX-512 where the host's tuning
    took more streams or a prefetch (`int8_form`; inductor's int8 template elsewhere), with the same outputs as the
    eager layer's ATen kernel to one bf16 rounding."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(row_kernel, "tuning", lambda: {"streams": tuned[0], "prefetch": tuned[1]})
    assert row_kernel.int8_form() == ours
    layer = Linear(64, 96, bias=False)
    layer.weight.data = torch.randn(96, 64).bfloat16()
    quantized = QuantLinear(layer, "int8", group_size=32, compute=torch.bfloat16)
    x = torch.randn(3, 64).bfloat16()
    with row_kernel.tracing(True):
        traced = torch.export.export(quantized, (x,))
    ops = {str(node.target) for node in traced.graph.nodes if node.op == "call_function"}
    assert ("inference_core.linear_rows_int8.default" in ops) == ours
    assert torch.allclose(traced.module()(x).float(), quantized(x).float(), rtol=2 ** -7, atol=1e-3)


@needs_int4_form
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("out_features, in_features, group", [(48, 64, 32), (50, 128, 64), (577, 576, 32),
                                                              (64, 1536, 128)])
def test_the_int4_op_equals_an_fp32_matmul_of_the_dequantized_weight(our_ops, rows, out_features, in_features, group):
    """int4 weights in tinygemm's numbers (QuantLinear's int4 scheme: bf16 scale and zero per group): the fp32 sums
    of x w, w = (q - 8) scale + zero, rounded once to bf16, as tinygemm computes them (in another order), for
    output features that fill no whole block and every group size."""
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    rounded = round_int4(torch.randn(out_features, in_features, generator=generator) / 8, group)
    scales = kernels.scales_and_zeros(rounded.scale, rounded.zero, torch.bfloat16)
    got = row_kernel.linear_int4(x, rounded.q, scales)
    want = x.float() @ rounded.dequantized(torch.bfloat16).t()
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want, rtol=2 ** -8, atol=1e-4 * in_features ** 0.5)
    if out_features % 16 == 0:  # tinygemm's CPU packing takes these
        aten = torch._weight_int4pack_mm_for_cpu(x, kernels.pack_int4(rounded.q), group, scales)
        assert torch.allclose(got.float(), aten.float(), rtol=2 ** -7, atol=1e-4 * in_features ** 0.5)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="the AVX-512 build's layout")
@pytest.mark.parametrize("out_features, in_features", [(64, 32), (576, 576), (192, 1536)])
def test_the_int4_weights_come_back_out_of_tinygemms_cpu_layout(out_features, in_features):
    q = torch.randint(0, 16, (out_features, in_features), generator=torch.Generator().manual_seed(in_features),
                      dtype=torch.int32)
    assert torch.equal(kernels.unpack_int4_cpu(kernels.pack_int4(q)), q.to(torch.uint8))


@pytest.mark.parametrize("form", [True, False])
def test_a_quantized_int4_projection_calls_it_while_tracing_where_the_cpu_has_bf16_dot_products(our_ops, form,
                                                                                                 monkeypatch):
    """`QuantLinear`'s int4 scheme in an exported decode step: our op where `int4_form` says so, for output features
    a multiple of 64 (the layout read back), with the eager layer's outputs to one bf16 rounding; tinygemm's kernel
    otherwise."""
    if form and not row_kernel.int4_capable():
        pytest.skip("the int4 form needs AVX-512 with BF16")
    monkeypatch.setattr(row_kernel, "int4_form", lambda: form)
    x = torch.randn(3, 64).bfloat16()
    for out_features, ours in ((128, form), (48, False)):
        layer = Linear(64, out_features, bias=False)
        layer.weight.data = torch.randn(out_features, 64).bfloat16()
        quantized = QuantLinear(layer, "int4", group_size=32, compute=torch.bfloat16)
        with row_kernel.tracing(True):
            traced = torch.export.export(quantized, (x,))
        ops = {str(node.target) for node in traced.graph.nodes if node.op == "call_function"}
        assert ("inference_core.linear_rows_int4.default" in ops) == ours
        assert torch.allclose(traced.module()(x).float(), quantized(x).float(), rtol=2 ** -7, atol=1e-2)


def test_the_op_refuses_a_weight_that_is_not_packed(our_ops):
    x = torch.randn(1, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="row_kernel.pack"):
        torch.ops.inference_core.linear_rows(x, torch.randn(48, 64).to(torch.bfloat16), 48)
    with pytest.raises(RuntimeError, match="row_kernel.pack_int4"):
        torch.ops.inference_core.linear_rows_int4(x, torch.zeros(1, 2, 100, dtype=torch.uint8), 32, 48)


needs_pairs_form = pytest.mark.skipif(not row_kernel.pairs_form(), reason="the pairs form needs AVX-512 with BF16")


@needs_pairs_form
@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17])
@pytest.mark.parametrize("out_features, in_features", [(48, 64), (577, 576), (50, 40), (7, 1536)])
def test_pair_packed_weights_equal_an_fp32_matmul_rounded_to_bf16(our_ops, amx, rows, out_features, in_features):
    """bf16 weights in pairs (`pack_pairs`), through the AVX-512 BF16 loop (two blocks a pass up to 4 rows, one
    block 8 rows a pass beyond, several passes past 8) or (whole tiles of 32 input features, where the CPU has it)
    AMX, every row count either takes: the fp32 sums rounded once to bf16."""
    if amx and not row_kernel.amx_capable():
        pytest.skip("no AMX here")
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    try:
        torch.ops.inference_core.set_amx_from(1 if amx else 0)
        got = torch.ops.inference_core.linear_rows(x, row_kernel.pack_pairs(weight), out_features)
    finally:
        row_kernel.apply_tuning()
    want = x.float() @ weight.float().t()
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want, rtol=2 ** -8, atol=1e-4 * in_features ** 0.5)


def test_pack_pairs_lays_out_each_output_features_pairs_of_input_features():
    weight = torch.arange(50 * 4, dtype=torch.float32).view(50, 4)
    packed = row_kernel.pack_pairs(weight)
    assert packed.shape == (2, 2, 96)
    assert torch.equal(packed[0, 1, 10:12], weight[5, 2:4]) and torch.equal(packed[1, 0, 2:4], weight[49, 0:2])
    assert not packed[1, :, 4:].any()  # padding


@pytest.mark.parametrize("amx_rows", ["2", "0"])
def test_weights_in_pairs_take_up_to_16_rows(our_ops, monkeypatch, amx_rows):
    """With the AMX form or without it: where the bf16 weights are packed in pairs (even input features, on AVX-512
    with BF16) up to PAIRS_MAX_ROWS rows, else up to MAX_ROWS."""
    monkeypatch.setenv("INFERENCE_CORE_AMX_ROWS", amx_rows)
    even, odd = torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(8, 41, dtype=torch.bfloat16)
    with row_kernel.tracing(True):
        most = row_kernel.PAIRS_MAX_ROWS if row_kernel.pairs_form() else row_kernel.MAX_ROWS
        assert row_kernel.takes(torch.zeros(most, 64, dtype=torch.bfloat16), even)
        assert not row_kernel.takes(torch.zeros(most + 1, 64, dtype=torch.bfloat16), even)
        assert row_kernel.takes(torch.zeros(row_kernel.MAX_ROWS, 41, dtype=torch.bfloat16), odd)
        assert not row_kernel.takes(torch.zeros(row_kernel.MAX_ROWS + 1, 41, dtype=torch.bfloat16), odd)


def test_pack_lays_out_blocks_of_48_output_features():
    weight = torch.arange(50 * 3, dtype=torch.float32).view(50, 3)
    packed = row_kernel.pack(weight)
    assert packed.shape == (2, 3, 48)
    assert torch.equal(packed[0, :, 5], weight[5]) and torch.equal(packed[1, :, 1], weight[49])
    assert not packed[1, :, 2:].any()  # padding


def test_it_takes_few_bf16_rows_and_only_while_tracing():
    weight = torch.zeros(8, 4, dtype=torch.bfloat16)
    most = row_kernel.max_rows(4)
    rows = [torch.zeros(n, 4, dtype=torch.bfloat16) for n in (1, most, most + 1)]
    assert not row_kernel.takes(rows[0], weight)  # not tracing
    with row_kernel.tracing(True):
        assert [row_kernel.takes(x, weight) for x in rows] == [True, True, False]
        assert not row_kernel.takes(rows[0].float(), weight.float())
        assert not row_kernel.takes(rows[0][None], weight)  # 3-D
    with row_kernel.tracing(False):
        assert not row_kernel.takes(rows[0], weight)


def test_it_is_refused_without_avx2(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert "AVX-512 or AVX2" in row_kernel._build.__wrapped__()


@pytest.mark.skipif(compile_unavailable(torch.device("cpu")) is not None, reason="no C++ compiler")
def test_compiled_decode_uses_it_for_bf16_unless_switched_off(tiny_bf16, our_ops_reason):
    """The default options ask for it and for our attention kernel (`model.attention_kernel`) with a bf16 model
    (where they cannot run, the decoder says why and leaves them out); EngineConfig(row_kernel=False) keeps
    inductor's matmuls, attention_kernel=False inductor's attention, each under a package key of its own."""
    settings = dict(kv_mode="paged", compile=True, max_num_seqs=1)
    on = Engine(tiny_bf16, EngineConfig(**settings)).decoder
    no_mm = Engine(tiny_bf16, EngineConfig(**settings, row_kernel=False)).decoder
    off = Engine(tiny_bf16, EngineConfig(**settings, row_kernel=False, attention_kernel=False)).decoder
    for word in ("row-kernel", "attention-kernel"):
        assert (word in on.stats.mode) == (our_ops_reason is None) and on.row_kernel_off == our_ops_reason
    assert "row-kernel" not in no_mm.stats.mode and ("attention-kernel" in no_mm.stats.mode) == (our_ops_reason is None)
    assert "kernel" not in off.stats.mode and off.row_kernel_off == "not asked for"
    assert on.step.our_attention == no_mm.step.our_attention == (our_ops_reason is None) and not off.step.our_attention
    args = (torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    keys = {on._package_key(args), no_mm._package_key(args), off._package_key(args)}
    assert len(keys) == (3 if our_ops_reason is None else 1)


@needs_int4_form
@pytest.mark.skipif(compile_unavailable(torch.device("cpu")) is not None, reason="no C++ compiler")
def test_a_compiled_int4_step_calls_it_and_answers_as_eager(tiny_bf16, our_ops):
    """The tiny bf16 model with int4 weights, compiled: its projections of 64 output features or more run through the
    int4 op (k and v, 32 features, through tinygemm's), and every answer equals the eager int4 engine's (or parts at
    a near-tie)."""
    from conftest import compiled_matches_eager
    from tiny_models import greedy, prompt

    from inference_core.quant.linear import QuantConfig
    from inference_core.quant.quantize import quantize

    if not row_kernel.int4_form():
        pytest.skip(f"this machine measured our int4 loop slower than ATen's ({row_kernel.tuning().get('int4')})")
    quantized = quantize(tiny_bf16, QuantConfig("int4", 32))
    compiled, _ = compiled_matches_eager(quantized, kv_mode="paged", block_size=4, max_num_seqs=1,
                                         max_num_batched_tokens=64, max_seq_len=96)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        compiled.complete(prompt(8, seed=3), greedy(3))
    assert "inference_core::linear_rows_int4" in {event.name for event in profiler.events()}


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-bf16")
    build_tiny_model(directory)
    return inference_core.load_model(str(directory), device="cpu", dtype="bfloat16")


class OurOps(torch.nn.Module):
    """Each of our ops once, as a compiled step calls them: a bf16 projection, paged attention, an int8 projection
    and, where the int4 form runs, an int4 one."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)

        def weight(*shape):
            return torch.nn.Parameter(torch.randn(shape, generator=generator).bfloat16() / 8, requires_grad=False)

        def int8(*shape):
            return torch.nn.Parameter(torch.randint(-127, 128, shape, generator=generator, dtype=torch.int8),
                                      requires_grad=False)

        self.qkv, self.out_int8 = weight(192, 64), int8(40, 192)
        self.scales = torch.nn.Parameter(torch.rand(40, generator=generator) / 100, requires_grad=False)
        rounded = round_int4(torch.randn(64, 64, generator=generator) / 8, 32)
        self.q4 = torch.nn.Parameter(rounded.q.to(torch.uint8), requires_grad=False)
        self.scales4 = torch.nn.Parameter(kernels.scales_and_zeros(rounded.scale, rounded.zero, torch.bfloat16),
                                          requires_grad=False)

    def forward(self, x, k_pool, v_pool, table, mask):
        qkv = row_kernel.linear(x, self.qkv, None)  # [1, 192]: q of 1 head, k and v of 1 KV head, head_dim 64
        q, k, v = qkv[:, :64], qkv[:, 64:128].view(1, 1, 64), qkv[:, 128:].view(1, 1, 64)
        attended = attention_kernel.attend(q, k, v, k_pool, v_pool, table, mask, 0.125).reshape(1, 64).to(x.dtype)
        out = row_kernel.linear_int8(attended.repeat(1, 3), self.out_int8, self.scales)
        if row_kernel.int4_capable():
            out = torch.cat([out, row_kernel.linear_int4(attended, self.q4, self.scales4)], 1)
        return out


PROJECTION_OPS = ("linear_rows", "linear_rows_int8") + (("linear_rows_int4",) if row_kernel.int4_capable() else ())


def test_a_compiled_package_calls_the_ops_as_c_functions(our_ops, tmp_path):
    """AOTInductor calls our ops through their C entry points (`row_kernel.c_shims`), not its proxy executor, with
    the same results as the ops called from Python; each call records itself under the op's name for the profiler
    (`bench.profile` attributes the step's time by it)."""
    generator = torch.Generator().manual_seed(1)
    pool = torch.randn(4, 16, 1, 64, generator=generator).bfloat16()
    args = (torch.randn(1, 64, generator=generator).bfloat16(), pool, pool.flip(0).contiguous(),
            torch.tensor([[2, 0]], dtype=torch.int32), torch.arange(32)[None, :] < 20)
    module = OurOps()
    with torch.no_grad():
        program = torch.export.export(module, args)
        path = torch._inductor.aoti_compile_and_package(
            program, package_path=str(tmp_path / "ops.pt2"),
            inductor_configs={"freezing": True, "aot_inductor.custom_ops_to_c_shims": row_kernel.c_shims()})
        package, want = torch._inductor.aoti_load_package(path), module(*args)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            got = package(*args)
    assert torch.equal(got, want)
    recorded = {event.name for event in profiler.events()}
    assert {f"inference_core::{name}" for name in PROJECTION_OPS + ("attend_paged",)} <= recorded
    with zipfile.ZipFile(path) as package:
        (wrapper,) = [package.read(name).decode() for name in package.namelist() if name.endswith("wrapper.cpp")]
    for name in PROJECTION_OPS + ("attend_paged",):  # declared, then called
        assert wrapper.count(f"aoti_torch_cpu_{name}(") == 2
    assert "proxy_executor_call_function" not in wrapper


def packed_weights(out_features: int, in_features: int, generator: torch.Generator):
    """A random bf16 weight, a random int8 one with its scales and (where the int4 form runs) an int4 one in groups of
    32, each packed for the ops, and (where the pairs form runs) the bf16 one in pairs."""
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    packed = row_kernel.pack(weight)
    packed_int8 = row_kernel.pack(torch.randint(-127, 128, (out_features, in_features), generator=generator,
                                                dtype=torch.int8))
    rounded = round_int4(torch.randn(out_features, in_features, generator=generator), 32)
    packed_int4 = row_kernel.pack_int4(rounded.q, kernels.scales_and_zeros(rounded.scale, rounded.zero,
                                                                            torch.bfloat16))
    return packed, packed_int8, torch.rand(out_features, generator=generator), packed_int4, (
        row_kernel.pack_pairs(weight) if row_kernel.pairs_form() else None)


def every_op(x: torch.Tensor, weights: tuple, out_features: int) -> list:
    """Each projection op of x by `packed_weights`' weights: bf16, int8 and, where they run, int4 and the bf16 pairs
    (through the loop, and through AMX where the CPU has it)."""
    packed, packed_int8, scales, packed_int4, packed_pairs = weights
    ops = torch.ops.inference_core
    results = [ops.linear_rows(x, packed, out_features), ops.linear_rows_int8(x, packed_int8, scales, out_features)]
    if row_kernel.int4_capable():
        results.append(ops.linear_rows_int4(x, packed_int4, 32, out_features))
    if packed_pairs is not None:
        for amx_from in (0, 1) if row_kernel.amx_capable() else (0,):
            ops.set_amx_from(amx_from)
            results.append(ops.linear_rows(x, packed_pairs, out_features))
        row_kernel.apply_tuning()
    return results


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("rows, out_features, in_features", [(1, 577, 64), (1, 48, 64), (1, 1000, 32), (2, 150, 32),
                                                              (6, 577, 64), (12, 150, 32)])
def test_the_threads_share_of_the_blocks_changes_no_bit(our_ops, threads, rows, out_features, in_features):
    """The threads take the blocks as they come free (two a range, one from each end): the result is that of one
    thread, bit for bit, for each projection op, with an odd thread count and odd block counts."""
    generator = torch.Generator().manual_seed(threads)
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    weights = packed_weights(out_features, in_features, generator)
    previous = torch.get_num_threads()
    results = []
    try:
        for count in (1, threads):
            torch.set_num_threads(count)
            results.append(every_op(x, weights, out_features))
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(one, many) for one, many in zip(*results))


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_every_tuning_of_the_loop_changes_no_bit(our_ops, rows):
    """Streams per thread and the prefetch distance (`row_kernel.tuning`, measured per machine and form) reorder the
    work, not a sum: every candidate of this CPU gives the default's result (each projection op), with blocks enough
    for four streams (71) and few (3), on two threads; a tuning outside the candidates, or of no form, is refused."""
    candidates = row_kernel.TUNING_CANDIDATES[torch.backends.cpu.get_cpu_capability()]
    generator = torch.Generator().manual_seed(rows)
    ops = torch.ops.inference_core
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for out_features in (48 * 70 + 5, 130):
            x = torch.randn(rows, 96, generator=generator).bfloat16()
            weights = packed_weights(out_features, 96, generator)
            results = []
            for streams, prefetch in candidates:
                for form in row_kernel.FORMS.values():
                    ops.set_row_tuning(streams, prefetch, form)
                results.append(every_op(x, weights, out_features))
            assert all(torch.equal(a, b) for result in results[1:] for a, b in zip(results[0], result))
        with pytest.raises(RuntimeError, match="streams must be 2"):
            ops.set_row_tuning(3, 0)
        with pytest.raises(RuntimeError, match="form 0"):
            ops.set_row_tuning(2, 0, 2)
    finally:
        row_kernel.apply_tuning()
        torch.set_num_threads(previous)


@pytest.mark.parametrize("int4", [False, True])
def test_the_tuning_is_measured_once_and_kept(our_ops, tmp_path, monkeypatch, int4):
    """Measured where nothing is kept (a candidate of this CPU, the ratios that chose it), for each form the CPU runs,
    with int8 activations against the int4 form where that runs, then read back; a tuning kept before the int4 form
    (or its comparison with int8 activations) existed gains it; a busy moment's measurement is not kept; the
    environment's setting overrides all of them."""
    capability = torch.backends.cpu.get_cpu_capability()
    measured = {"streams": 2, "prefetch": 0, "busy": False, "ratios": {"2,0": 1.0}}
    calls = []
    a8 = {"a8_versus_int4": 0.9}

    def measure(candidates, form="bf16"):
        calls.append(form)
        return {**measured, "versus_aten": 0.7} if form == "int4" else dict(measured)

    def measure_a8():
        calls.append("a8")
        return dict(a8)

    monkeypatch.setattr(row_kernel, "measure_tuning", measure)
    monkeypatch.setattr(row_kernel, "measure_a8", measure_a8)
    monkeypatch.setattr(row_kernel, "int4_capable", lambda: int4)
    monkeypatch.setattr(row_kernel, "amx_capable", lambda: False)  # its measurement: the next test
    monkeypatch.delenv("INFERENCE_CORE_ROW_TUNING", raising=False)
    path = tmp_path / "tuning.json"
    want = {**measured, "int4": {**measured, "versus_aten": 0.7, **a8}} if int4 else measured
    assert row_kernel._tuned(path, capability) == want and path.is_file()
    assert row_kernel._tuned(path, capability) == want and calls == ["bf16", "int4", "a8"][:1 + 2 * int4]
    if int4:  # kept by a build without the int4 form, or without its measurements: only they are measured
        for kept, measures in ((measured, ["int4", "a8"]), ({**measured, "int4": measured}, ["int4", "a8"]),
                               ({**measured, "int4": {**measured, "versus_aten": 0.7}}, ["a8"])):
            path.write_text(json.dumps(kept))
            calls.clear()
            assert row_kernel._tuned(path, capability) == want and calls == measures
            assert json.loads(path.read_text()) == want
        path.unlink()
        a8["a8_versus_int4"] = None  # a busy moment: int4 stays, measured again next time
        assert row_kernel._tuned(path, capability)["int4"]["a8_versus_int4"] is None and not path.exists()
    path.unlink(missing_ok=True)
    measured["busy"] = True
    assert row_kernel._tuned(path, capability)["busy"] and not path.exists()
    monkeypatch.setenv("INFERENCE_CORE_ROW_TUNING", "2,1024")
    forced = {"streams": 2, "prefetch": 1024, "forced": True}
    assert row_kernel._tuned(path, capability) == ({**forced, "int4": {**forced, "versus_aten": None}} if int4
                                                   else forced)
    for bad in ("3,0", "2;1024", "fast"):
        monkeypatch.setenv("INFERENCE_CORE_ROW_TUNING", bad)
        with pytest.raises(ValueError, match=f"INFERENCE_CORE_ROW_TUNING='{bad}': on this CPU .* takes one of 2,0, "):
            row_kernel._tuned(path, capability)
    monkeypatch.undo()
    forms = ["bf16", "int4"] if row_kernel.int4_capable() else ["bf16"]
    for form in forms:
        real = row_kernel.measure_tuning(row_kernel.TUNING_CANDIDATES[capability], megabytes=8, rounds=2, form=form)
        assert (real["streams"], real["prefetch"]) in row_kernel.TUNING_CANDIDATES[capability]
        assert set(real["ratios"]) == {f"{s},{p}" for s, p in row_kernel.TUNING_CANDIDATES[capability]}
        assert ("versus_aten" in real) == (form == "int4")
        if form == "int4":  # a busy moment decides nothing about the form
            assert real["versus_aten"] is None if real["busy"] else real["versus_aten"] > 0
    if row_kernel.int4_capable():
        ratio = row_kernel.measure_a8(megabytes=4, rounds=2)["a8_versus_int4"]
        assert ratio is None or ratio > 0
    row_kernel.apply_tuning()


def test_where_amx_runs_it_is_measured_once_and_kept(our_ops, tmp_path, monkeypatch):
    """Where the CPU has AMX the row count from which the AMX form runs is measured (a kept tuning without it gains
    it), kept, and applied; a busy moment's measurement is not kept; the real measurement gives a count it timed."""
    capability = torch.backends.cpu.get_cpu_capability()
    measured = {"streams": 2, "prefetch": 0, "busy": False, "ratios": {"2,0": 1.0}}
    amx = {"amx_from": 3, "amx_busy": False, "amx_ratios": {"2": 1.1, "3": 0.9}}
    calls = []
    monkeypatch.setattr(row_kernel, "measure_tuning", lambda candidates, form="bf16": dict(measured))
    monkeypatch.setattr(row_kernel, "int4_capable", lambda: False)
    monkeypatch.setattr(row_kernel, "amx_capable", lambda: True)
    monkeypatch.setattr(row_kernel, "measure_amx", lambda: calls.append("amx") or dict(amx))
    monkeypatch.delenv("INFERENCE_CORE_ROW_TUNING", raising=False)
    monkeypatch.delenv("INFERENCE_CORE_AMX_ROWS", raising=False)
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(measured))  # kept by a build without the AMX form
    assert row_kernel._tuned(path, capability) == {**measured, **amx} and calls == ["amx"]
    assert row_kernel._tuned(path, capability) == {**measured, **amx} and calls == ["amx"]  # kept
    path.unlink()
    amx["amx_busy"] = True
    assert row_kernel._tuned(path, capability)["amx_busy"] and not path.exists()
    monkeypatch.undo()
    if row_kernel.amx_capable():
        real = row_kernel.measure_amx(megabytes=8, rounds=1)
        assert real["amx_from"] in (0, *row_kernel.AMX_CANDIDATE_ROWS)
        assert set(real["amx_ratios"]) == {str(rows) for rows in row_kernel.AMX_CANDIDATE_ROWS}
    row_kernel.apply_tuning()


@pytest.mark.parametrize("capable, measured, ours", [(True, {"versus_aten": 0.7}, True),
                                                     (True, {"versus_aten": 1.2}, False),
                                                     (True, {"versus_aten": None}, True), (True, None, False),
                                                     (False, {"versus_aten": 0.7}, False)])
def test_the_int4_form_runs_where_the_cpu_can_and_it_measured_no_slower_than_atens(capable, measured, ours,
                                                                                    monkeypatch):
    """Our int4 loop where the CPU has BF16 dot products and this machine's int4 tuning timed it at most as slow as
    ATen's int4 kernel (None: a tuning set by the environment, not measured); not before the op is built."""
    monkeypatch.setattr(row_kernel, "int4_capable", lambda: capable)
    monkeypatch.setattr(row_kernel, "tuning", lambda: {"streams": 2, "prefetch": 0,
                                                       **({"int4": measured} if measured else {})})
    assert row_kernel.int4_form() == ours


def test_an_eager_projection_with_our_layout_calls_the_op_for_few_bf16_rows(our_ops, monkeypatch):
    """`Linear.use_row_kernel` (a compiled engine's draft heads): eager inputs of up to `max_rows` bf16 rows go through
    the op, equal to F.linear within bf16 rounding; more rows keep the layer's own path."""
    from inference_core.model.llama import Linear
    generator = torch.Generator().manual_seed(7)
    layer = Linear(64, 50, bias=True)
    layer.weight.data = torch.randn(50, 64, generator=generator).bfloat16()
    layer.bias.data = torch.randn(50, generator=generator).bfloat16()
    layer.use_row_kernel()
    calls = []
    op = torch.ops.inference_core.linear_rows
    monkeypatch.setattr(torch.ops.inference_core, "linear_rows", lambda *args: calls.append(1) or op(*args))
    for rows in (1, row_kernel.max_rows(64), row_kernel.max_rows(64) + 1):
        x = torch.randn(rows, 64, generator=generator).bfloat16()
        want = F.linear(x.float(), layer.weight.float(), layer.bias.float())
        assert torch.allclose(layer(x).float(), want, rtol=2 ** -7, atol=1e-2)
    assert len(calls) == 2
