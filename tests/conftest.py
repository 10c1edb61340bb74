"""Shared fixtures: the bundled model loaded once per test session (fp32, CPU), and the benchmark prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from inference_core import Engine, EngineConfig, load_model

PROMPTS_FILE = Path(__file__).resolve().parents[2] / "shared" / "prompts" / "bench.jsonl"


@pytest.fixture(scope="session")
def bundled():
    """SmolLM2-135M-Instruct from the bundled GGUF, fp32 on the CPU (converted once into the local cache)."""
    torch.manual_seed(0)
    return load_model("bundled", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def bench_prompts() -> dict[str, dict]:
    """The project's benchmark prompts by id (see shared/prompts/README.md)."""
    rows = [json.loads(line) for line in PROMPTS_FILE.read_text().splitlines() if line.strip()]
    return {row["id"]: row for row in rows}


def make_engine(loaded, kv_mode: str = "paged", **settings) -> Engine:
    return Engine(loaded, EngineConfig(kv_mode=kv_mode, **settings))
