"""Shared fixtures: the bundled model loaded once per test session (fp32, CPU), and the benchmark prompts."""

from __future__ import annotations

import os

import pytest
import torch

from inference_core import Engine, EngineConfig, load_model
from inference_core.bench.prompts import load_prompts


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory):
    """Compiled decode steps go to a directory of this session's (no package from an earlier run is reused)."""
    os.environ["INFERENCE_CORE_COMPILE_CACHE"] = str(tmp_path_factory.mktemp("compiled"))


@pytest.fixture(scope="session", autouse=True)
def awq_cache(tmp_path_factory):
    """AWQ files (`--quant awq`) go to a directory of this session's: each session calibrates afresh."""
    os.environ["INFERENCE_CORE_AWQ_CACHE"] = str(tmp_path_factory.mktemp("awq"))


@pytest.fixture(scope="session")
def bundled():
    """SmolLM2-135M-Instruct from the bundled GGUF, fp32 on the CPU (converted once into the local cache)."""
    torch.manual_seed(0)
    return load_model("bundled", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def bench_prompts() -> dict[str, dict]:
    """The project's benchmark prompts by id (see shared/prompts/README.md)."""
    return {row["id"]: row for row in load_prompts()}


def make_engine(loaded, kv_mode: str = "paged", **settings) -> Engine:
    return Engine(loaded, EngineConfig(kv_mode=kv_mode, **settings))


def assert_nothing_held(engine) -> None:
    """No request queued or running and every KV block or slot back (prefix-cached blocks count as free)."""
    assert engine.num_requests() == 0
    assert engine.blocks_in_use() == 0


def lane(kv_mode: str, **overrides) -> list:
    """One race lane's (or the chat's) widget values, greedy unless overridden, in the order the handlers take them."""
    from ui.race import LANE_SETTING_FIELDS
    from inference_core.settings import LaneSettings

    values = {**{name: getattr(LaneSettings(), name) for name in LANE_SETTING_FIELDS}, "kv_mode": kv_mode,
              **overrides}
    return [values[name] for name in LANE_SETTING_FIELDS]


def race_outputs(values: tuple) -> dict:
    """One update of the race handler, by output name."""
    from ui.race import RACE_OUTPUTS

    return dict(zip(RACE_OUTPUTS, values))


@pytest.fixture(scope="module")
def pool(bundled):
    """The playground's engines over the bundled model, with a 512-token context (small caches), one per module."""
    from serving.pool import EnginePool

    return EnginePool(bundled, max_seq_len=512)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module's forwards on one torch thread, then restore the setting. On a busy 2-core machine two OpenMP
    threads wait on each other for a scheduler slice at every op (measured: 4 tokens/s instead of 22 for the bundled
    model, 16 ms instead of 0.02 ms for a tiny matmul); one thread gives the same numbers and stable run times."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium driven by Playwright, for the browser tests (set-up in tests/test_browser.py)."""
    from playwright.sync_api import sync_playwright

    from test_browser import CHROMIUM_ARGS, _ensure_chromium

    executable = _ensure_chromium()
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()
