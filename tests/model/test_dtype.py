"""`--dtype auto` (`inference_core.model.dtype_choice`): bf16 on a CPU only with native bf16 math and a measured win,
float32 otherwise, always with the reason in words; the page header shows it. The measurement is robust to a noisy
host (warmed up, interleaved, the best of many timings, a margin) and cached per host and model shape, so
the same command picks the same dtype every time. In bf16 on such a CPU, a step's batched decodes attend through
bf16 matmuls (`model.decode_attention_kernel`)."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch

from inference_core.model import dtype_choice
from inference_core.model.dtype_choice import MARGIN, choose_dtype, measured_speedup
from inference_core.model.llama import attend_decodes_matmul, attention_backends, decode_attention_kernel
from inference_core.model.loader import load_model

CPU = torch.device("cpu")


@pytest.fixture
def host(monkeypatch, tmp_path):
    """A pretend CPU: which native bf16 features it has and the bf16 speed-up its probe measures (counted in
    `host.measured`), with the dtype cache in a temporary directory."""
    def set_host(bf16: bool, amx: bool = False, speedup: float = 1.0):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(dtype_choice, "decode_speedup", lambda config, clock: set_host.measured.append(config)
                            or speedup)
    set_host.measured = []
    monkeypatch.setattr(dtype_choice, "cache_file", lambda: tmp_path / "dtype-choice.json")
    return set_host


def test_no_native_bf16_keeps_float32(bundled, host):
    host(bf16=False, speedup=10.0)  # not even measured: emulated bf16 is never chosen
    dtype, reason = choose_dtype(CPU, bundled.config)
    assert dtype == torch.float32 and "has no native bf16 math" in reason and host.measured == []


def test_native_bf16_that_measures_faster_is_chosen(bundled, host):
    host(bf16=True, speedup=2.0)
    dtype, reason = choose_dtype(CPU, bundled.config)
    assert dtype == torch.bfloat16
    assert reason == ("this CPU has native bf16 math (AVX-512 BF16) and this model's decode step ran 2.0x faster "
                      "in bf16 than in float32 here")
    host(bf16=False, amx=True, speedup=2.0)
    assert choose_dtype(CPU, bundled.config)[1].count("AMX") == 1


def test_native_bf16_that_is_not_faster_keeps_float32(bundled, host):
    host(bf16=True, speedup=1.05)  # under the 10% margin
    dtype, reason = choose_dtype(CPU, bundled.config)
    assert dtype == torch.float32 and "ran only 1.05x as fast in bf16" in reason and f"from {MARGIN}x" in reason


def test_the_choice_is_measured_once_per_host_and_model_shape(bundled, host, tmp_path):
    host(bf16=True, speedup=1.6)
    first = choose_dtype(CPU, bundled.config)
    host(bf16=True, speedup=0.5)  # a later start on a busy host would measure this: the cached answer stands
    assert choose_dtype(CPU, bundled.config) == first and len(host.measured) == 1
    wider = replace(bundled.config, hidden_size=2 * bundled.config.hidden_size)
    assert choose_dtype(CPU, wider)[0] == torch.float32 and len(host.measured) == 2  # another shape: measured
    cached = json.loads((tmp_path / "dtype-choice.json").read_text())
    assert sorted(entry["speedup"] for entry in cached.values()) == [0.5, 1.6]
    assert all(torch.__version__ in key and "hidden" in key for key in cached)


class NoisyHost:
    """Probe passes on a pretend host: fp32 takes `ratio` times as long as bf16, under a load that drifts, jumps
    several-fold for a while, and spikes single passes; `clock` reads its time."""

    def __init__(self, ratio: float, seed: int):
        self.ratio, self.now, self.load, self.jump = ratio, 0.0, 1.0, 0
        self.random = random.Random(seed)

    def clock(self) -> float:
        return self.now

    def run(self, cost: float) -> None:
        chance = self.random.random
        self.load = min(3.0, max(1.0, self.load * (1 + 0.1 * (chance() - 0.5))))
        if self.jump == 0 and chance() < 0.05:
            self.jump = 4  # another process takes the cores for a few passes
        self.jump = max(0, self.jump - 1)
        spike = 20.0 * chance() if chance() < 0.3 else 0.0
        self.now += cost * self.load * (4.0 if self.jump else 1.0) * (1 + 0.1 * chance()) + spike

    def passes(self):
        return lambda: self.run(self.ratio), lambda: self.run(1.0)


@pytest.mark.parametrize("ratio", [0.8, 1.7])
def test_a_noisy_timer_gives_the_same_choice_every_time(ratio):
    decisions = set()
    for seed in range(40):
        noisy = NoisyHost(ratio, seed)
        speedup = measured_speedup(*noisy.passes(), clock=noisy.clock)
        decisions.add(speedup >= MARGIN)
        if ratio > 1:
            assert 1.35 < speedup < 2.1
    assert decisions == {ratio >= MARGIN}


def test_load_model_auto_records_the_choice_and_an_explicit_dtype_is_kept(bundled, host):
    host(bf16=True, speedup=3.0)
    loaded = load_model("bundled", device="cpu", dtype="auto")
    assert loaded.dtype == torch.bfloat16 and loaded.dtype_name == "bfloat16"
    assert loaded.dtype_reason.startswith("this CPU has native bf16 math")
    assert (bundled.dtype, bundled.dtype_reason) == (torch.float32, "as asked")


def test_the_probe_measures_real_matmuls(bundled):
    assert 0.2 < dtype_choice.decode_speedup(bundled.config) < 20


def test_batched_decodes_attend_through_bf16_matmuls_only_with_native_bf16(host):
    host(bf16=True)
    assert decode_attention_kernel(CPU, torch.bfloat16) == "matmul"
    assert decode_attention_kernel(CPU, torch.float32) == decode_attention_kernel(torch.device("cuda"),
                                                                                   torch.bfloat16) == "sdpa"
    host(bf16=False)
    assert decode_attention_kernel(CPU, torch.bfloat16) == "sdpa"


def test_the_bf16_matmul_decode_attention_agrees_with_fp32_sdpa_and_ignores_masked_keys():
    generator = torch.Generator().manual_seed(0)
    decodes, heads, kv_heads, keys, head_dim = 5, 6, 2, 37, 16
    q = torch.randn(decodes, heads, 1, head_dim, generator=generator).bfloat16()
    # k and v as the paged gather gives them: [decodes, keys, kv_heads, head_dim] seen as [.., kv_heads, keys, ..]
    gathered_k, gathered_v = (torch.randn(decodes, keys, kv_heads, head_dim, generator=generator).bfloat16()
                              for _ in range(2))
    k, v = gathered_k.transpose(1, 2), gathered_v.transpose(1, 2)
    lengths = torch.tensor([37, 1, 20, 5, 33])
    mask = (torch.arange(keys) < lengths[:, None])[:, None, None, :]
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                                scale=0.25, enable_gqa=True)
    out = attend_decodes_matmul(q, k, v, mask, 0.25)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert (out.float() - expected).abs().max() < 0.03
    past = ~mask[:, 0, 0, :]  # [decodes, keys]: past each sequence's length (padding in the gathered buffer)
    gathered_k[past], gathered_v[past] = 1e4, -1e4  # finite, as the zeroed pool guarantees
    assert torch.equal(attend_decodes_matmul(q, k, v, mask, 0.25), out)


def test_cpu_details_read_the_family_and_the_caches_where_linux_shows_them(tmp_path, monkeypatch):
    """A VM that names its CPU only 'AMD EPYC' still tells Zen 4 (family 25) from Zen 5 (26) apart, and its caches."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n\n"
                       "processor\t: 1\ncpu family\t: 99\nmodel\t\t: 9\n")
    cache = tmp_path / "cache"
    levels = [(1, "Data", "48K"), (1, "Instruction", "32K"), (3, "Unified", "32768K")]
    for index, (level, kind, size) in enumerate(levels):
        (cache / f"index{index}").mkdir(parents=True)
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (cache / f"index{index}" / name).write_text(f"{value}\n")
    real_path = dtype_choice.Path
    paths = {"/proc/cpuinfo": cpuinfo, "/sys/devices/system/cpu/cpu0/cache": cache}
    monkeypatch.setattr(dtype_choice, "Path", lambda name: paths.get(name) or real_path(name))
    assert dtype_choice.cpu_details() == {"family_model": "26/2", "L1": "48K", "L3": "32768K"}
    paths["/proc/cpuinfo"] = tmp_path / "absent"
    paths["/sys/devices/system/cpu/cpu0/cache"] = tmp_path / "absent"
    assert dtype_choice.cpu_details() == {}


def test_cuda_attention_leaves_cudnn_out_and_other_devices_keep_sdpa_s_choice():
    """On CUDA the eager forward's SDPA runs without cuDNN (a graph built for every new shape: see
    `llama.CUDA_SDPA_BACKENDS`); on the CPU nothing changes."""
    backends = torch.backends.cuda
    before = backends.cudnn_sdp_enabled()
    with attention_backends(torch.device("cpu")):
        assert backends.cudnn_sdp_enabled() == before
    with attention_backends(torch.device("cuda")):
        assert not backends.cudnn_sdp_enabled()
        assert backends.flash_sdp_enabled() and backends.mem_efficient_sdp_enabled() and backends.math_sdp_enabled()
    assert backends.cudnn_sdp_enabled() == before
