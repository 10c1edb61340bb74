"""Our projection kernel for compiled decode on AVX-512 and AVX2 CPUs (`inference_core.model.row_kernel`): the ops
(bf16 and int8 weights) against fp32 matmuls of the same values, which projections they take, and where they stay
off. The compiled step that calls them is checked on the bundled model against eager (tests/engine/test_compiled.py)."""

from __future__ import annotations

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
from inference_core.quant.linear import QuantLinear


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
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


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
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


def test_the_op_refuses_a_weight_that_is_not_packed(our_ops):
    x = torch.randn(1, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="row_kernel.pack"):
        torch.ops.inference_core.linear_rows(x, torch.randn(48, 64).to(torch.bfloat16), 48)


def test_pack_lays_out_blocks_of_48_output_features():
    weight = torch.arange(50 * 3, dtype=torch.float32).view(50, 3)
    packed = row_kernel.pack(weight)
    assert packed.shape == (2, 3, 48)
    assert torch.equal(packed[0, :, 5], weight[5]) and torch.equal(packed[1, :, 1], weight[49])
    assert not packed[1, :, 2:].any()  # padding


def test_it_takes_few_bf16_rows_and_only_while_tracing():
    weight = torch.zeros(8, 4, dtype=torch.bfloat16)
    rows = [torch.zeros(n, 4, dtype=torch.bfloat16) for n in (1, row_kernel.MAX_ROWS, row_kernel.MAX_ROWS + 1)]
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


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-bf16")
    build_tiny_model(directory)
    return inference_core.load_model(str(directory), device="cpu", dtype="bfloat16")


class OurOps(torch.nn.Module):
    """Each of our ops once, as a compiled step calls them: a bf16 projection, paged attention, an int8 projection."""

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

    def forward(self, x, k_pool, v_pool, table, mask):
        qkv = row_kernel.linear(x, self.qkv, None)  # [1, 192]: q of 1 head, k and v of 1 KV head, head_dim 64
        q, k, v = qkv[:, :64], qkv[:, 64:128].view(1, 1, 64), qkv[:, 128:].view(1, 1, 64)
        attended = attention_kernel.attend(q, k, v, k_pool, v_pool, table, mask, 0.125).reshape(1, 64).to(x.dtype)
        return row_kernel.linear_int8(attended.repeat(1, 3), self.out_int8, self.scales)


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
    assert {f"inference_core::{name}" for name in ("linear_rows", "linear_rows_int8", "attend_paged")} <= recorded
    with zipfile.ZipFile(path) as package:
        (wrapper,) = [package.read(name).decode() for name in package.namelist() if name.endswith("wrapper.cpp")]
    for name in ("linear_rows", "linear_rows_int8", "attend_paged"):  # declared, then called
        assert wrapper.count(f"aoti_torch_cpu_{name}(") == 2
    assert "proxy_executor_call_function" not in wrapper


def packed_weights(out_features: int, in_features: int, generator: torch.Generator):
    """A random bf16 weight and a random int8 one with its scales, both packed for the ops."""
    packed = row_kernel.pack(torch.randn(out_features, in_features, generator=generator).bfloat16())
    packed_int8 = row_kernel.pack(torch.randint(-127, 128, (out_features, in_features), generator=generator,
                                                dtype=torch.int8))
    return packed, packed_int8, torch.rand(out_features, generator=generator)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("rows, out_features, in_features", [(1, 577, 64), (1, 48, 40), (1, 1000, 16), (2, 150, 8)])
def test_the_threads_share_of_the_blocks_changes_no_bit(our_ops, threads, rows, out_features, in_features):
    """The threads take the blocks as they come free (two a range, one from each end): the result is that of one
    thread, bit for bit, for the bf16 and the int8 op, with an odd thread count and odd block counts."""
    generator = torch.Generator().manual_seed(threads)
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    packed, packed_int8, scales = packed_weights(out_features, in_features, generator)
    ops = torch.ops.inference_core
    previous = torch.get_num_threads()
    results = []
    try:
        for count in (1, threads):
            torch.set_num_threads(count)
            results.append((ops.linear_rows(x, packed, out_features),
                            ops.linear_rows_int8(x, packed_int8, scales, out_features)))
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(one, many) for one, many in zip(*results))


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_every_tuning_of_the_loop_changes_no_bit(our_ops, rows):
    """Streams per thread and the prefetch distance (`row_kernel.tuning`, measured per machine) reorder the work, not
    a sum: every candidate of this CPU gives the default's result, with blocks enough for four streams (71) and few
    (3), on two threads; a tuning outside the candidates is refused."""
    candidates = row_kernel.TUNING_CANDIDATES[torch.backends.cpu.get_cpu_capability()]
    generator = torch.Generator().manual_seed(rows)
    ops = torch.ops.inference_core
    kept, previous = row_kernel.tuning(), torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for out_features in (48 * 70 + 5, 130):
            x = torch.randn(rows, 96, generator=generator).bfloat16()
            packed, packed_int8, scales = packed_weights(out_features, 96, generator)
            results = []
            for streams, prefetch in candidates:
                ops.set_row_tuning(streams, prefetch)
                results.append((ops.linear_rows(x, packed, out_features),
                                ops.linear_rows_int8(x, packed_int8, scales, out_features)))
            assert all(torch.equal(a, b) for result in results[1:] for a, b in zip(results[0], result))
        with pytest.raises(RuntimeError, match="streams must be 2"):
            ops.set_row_tuning(3, 0)
    finally:
        ops.set_row_tuning(kept["streams"], kept["prefetch"])
        torch.set_num_threads(previous)


def test_the_tuning_is_measured_once_and_kept(our_ops, tmp_path, monkeypatch):
    """Measured where nothing is kept (a candidate of this CPU, the ratios that chose it), then read back; a busy
    moment's measurement is not kept; the environment's setting overrides both."""
    capability = torch.backends.cpu.get_cpu_capability()
    measured = {"streams": 2, "prefetch": 0, "busy": False, "ratios": {"2,0": 1.0}}
    calls = []
    monkeypatch.setattr(row_kernel, "measure_tuning", lambda candidates: calls.append(candidates) or dict(measured))
    monkeypatch.delenv("INFERENCE_CORE_ROW_TUNING", raising=False)
    path = tmp_path / "tuning.json"
    assert row_kernel._tuned(path, capability) == measured and path.is_file()
    assert row_kernel._tuned(path, capability) == measured and len(calls) == 1
    path.unlink()
    measured["busy"] = True
    assert row_kernel._tuned(path, capability)["busy"] and not path.exists()
    monkeypatch.setenv("INFERENCE_CORE_ROW_TUNING", "2,1024")
    assert row_kernel._tuned(path, capability) == {"streams": 2, "prefetch": 1024, "forced": True}
    for bad in ("3,0", "2;1024", "fast"):
        monkeypatch.setenv("INFERENCE_CORE_ROW_TUNING", bad)
        with pytest.raises(ValueError, match=f"INFERENCE_CORE_ROW_TUNING='{bad}': on this CPU .* takes one of 2,0, "):
            row_kernel._tuned(path, capability)
    monkeypatch.undo()
    real = row_kernel.measure_tuning(row_kernel.TUNING_CANDIDATES[capability], megabytes=8, rounds=2)
    assert (real["streams"], real["prefetch"]) in row_kernel.TUNING_CANDIDATES[capability]
    assert set(real["ratios"]) == {f"{s},{p}" for s, p in row_kernel.TUNING_CANDIDATES[capability]}
    ops = torch.ops.inference_core
    ops.set_row_tuning(row_kernel.tuning()["streams"], row_kernel.tuning()["prefetch"])
