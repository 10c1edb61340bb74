"""Shared fixtures: the bundled model loaded once per test session (fp32, CPU), and the benchmark prompts."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

if not torch.cuda.is_available():
    # Our Triton kernels' tests run them under Triton's interpreter without a GPU. The mode is read when Triton is
    # imported, and any test may import it first (inductor does), so it is set before every test module.
    os.environ.setdefault("TRITON_INTERPRET", "1")

XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # this process's name where it is one of the suite's workers
if XDIST_WORKER:
    # The suite's two workers share the machine's cores: one torch thread each, in the processes tests start too
    # (two OpenMP teams on two cores wait on each other at every op; see `one_torch_thread`).
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"

from browser_setup import CHROMIUM_ARGS, ensure_chromium
from inference_core import Engine, EngineConfig, load_model
from inference_core.model.checkpoint import resolve_model_dir
from inference_core.sequence import Sequence
from inference_core.bench.prompts import load_prompts


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The whole suite (`python -m pytest`, no paths named) runs in two worker processes, a test file each at a time:
    on the 2-core machine much of a test's time is one core's (g++ on a compiled step, Python, one-thread forwards),
    and two workers took the suite from 55 to 35 minutes. Named files or `-n` run as asked; the GPU report's
    `pytest -m cuda` over its files runs in one process."""
    if (config.pluginmanager.hasplugin("xdist") and not XDIST_WORKER and config.option.numprocesses is None
            and config.args_source == pytest.Config.ArgsSource.TESTPATHS
            and not (config.option.collectonly or config.option.usepdb)):
        config.option.numprocesses, config.option.dist, config.option.tx = 2, "loadfile", ["popen"] * 2


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory):
    """Compiled decode steps go to a directory of this run's (no package from an earlier run is reused), one for both
    of the suite's workers: a step one worker compiled (the same model, shapes and options: the tiny model is the
    same in every file that builds it) the other loads from disk. A package is written whole and then renamed
    (`CompiledDecoder._build_package`), so two workers compiling the same one at once each read a whole one."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent / "compiled" if XDIST_WORKER else base / "compiled"  # the workers' base: this run's
    shared.mkdir(exist_ok=True)
    os.environ["INFERENCE_CORE_COMPILE_CACHE"] = str(shared)


@pytest.fixture(scope="session", autouse=True)
def awq_cache(tmp_path_factory):
    """AWQ files (`--quant awq`) go to a directory of this session's: each session calibrates afresh."""
    os.environ["INFERENCE_CORE_AWQ_CACHE"] = str(tmp_path_factory.mktemp("awq"))


@pytest.fixture(scope="session")
def our_ops_reason() -> str | None:
    """Why our C++ ops (`model.row_kernel`'s extension: projections, attention, the greedy step) cannot run here
    (built on first use: about 35 s once per machine), None where they can."""
    from inference_core.engine.compiled import compile_unavailable
    from inference_core.model import row_kernel

    return row_kernel.unavailable() if compile_unavailable(torch.device("cpu")) is None else "no C++ compiler"


@pytest.fixture
def our_ops(our_ops_reason):
    """Skips a test of our C++ ops where they cannot run (`our_ops_reason`): no compiler, a CPU without AVX2. A build
    that fails where a compiler and the instruction set are there is a bug in the source, and fails the test (the app
    runs on without the ops, so nothing else would show it)."""
    from inference_core.engine.compiled import compile_unavailable
    from inference_core.model import row_kernel

    capability = torch.backends.cpu.get_cpu_capability()
    buildable = compile_unavailable(torch.device("cpu")) is None and capability in row_kernel.FLAGS
    if our_ops_reason is not None and buildable:
        pytest.fail(f"our ops' build failed on this {capability} CPU: {our_ops_reason}")
    if our_ops_reason is not None:
        pytest.skip(f"the op cannot run here: {our_ops_reason}")


@pytest.fixture(scope="session")
def bundled():
    """SmolLM2-135M-Instruct from the bundled GGUF, fp32 on the CPU (converted once into the local cache)."""
    torch.manual_seed(0)
    return load_model("bundled", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def bench_prompts() -> dict[str, dict]:
    """The project's benchmark prompts by id (see shared/prompts/README.md)."""
    return {row["id"]: row for row in load_prompts()}


def bench_prompt_ids(loaded, bench_prompts: dict[str, dict], ids) -> list[list[int]]:
    """The token ids of benchmark prompts `ids`, as a request gets them (the chat template, except completion rows)."""
    rows = [bench_prompts[i] for i in ids]
    return [loaded.tokenizer.prompt_ids(row["prompt"], row.get("system"), row["kind"] != "completion") for row in rows]


def transformers_greedy_ids(prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy ids on the bundled model's weights (fp32), end-of-sequence ignored: the outside oracle."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir("bundled")), dtype=torch.float32)
    outputs = []
    for ids in prompts:
        x = torch.tensor([ids])
        # An explicit mask: otherwise transformers masks every prompt token equal to pad_token_id (<|im_end|> here).
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        outputs.append(out[0, len(ids):].tolist())
    return outputs


def make_engine(loaded, kv_mode: str = "paged", **settings) -> Engine:
    return Engine(loaded, EngineConfig(kv_mode=kv_mode, **settings))


def assert_nothing_held(engine) -> None:
    """No request queued or running and every KV block or slot back (prefix-cached blocks count as free)."""
    assert engine.num_requests() == 0
    assert engine.blocks_in_use() == 0


def wait_until_free(pool, timeout_s: float = 10.0) -> None:
    """Wait until the pool's engines hold no block and no request (a served request's end is seen a moment later)."""
    deadline = time.monotonic() + timeout_s
    while pool.loop.call(pool.blocks_in_use) or pool.loop.call(pool.active_requests):
        assert time.monotonic() < deadline, "blocks still held after the request ended"
        time.sleep(0.05)


NEAR_TIE = 0.01


def assert_same_or_near_tie(loaded, prompt_ids: list[int], eager: list[int], compiled: list[int]) -> None:
    """Equal ids, or a first divergence where the eager run's top two logits were within NEAR_TIE (fp32), or two
    steps of the model dtype's rounding at the top logit (bf16, fp16)."""
    assert len(eager) == len(compiled)
    diverged = next((i for i, (a, b) in enumerate(zip(eager, compiled)) if a != b), None)
    if diverged is None:
        return
    recompute = Engine(loaded, EngineConfig(kv_mode="none"))
    logits = recompute.runner.run([Sequence(prompt_ids + eager[:diverged])])[0]
    top = logits.topk(2).values.float()
    gap = float(top[0] - top[1])
    if loaded.dtype in (torch.bfloat16, torch.float16):  # logits in the model dtype: two of its steps at the top one
        tie = 2 * torch.finfo(loaded.dtype).eps * 2.0 ** math.floor(math.log2(abs(float(top[0])) or 1.0))
    else:
        tie = NEAR_TIE
    assert gap <= tie, (f"compiled decode chose {compiled[diverged]} instead of {eager[diverged]} at token "
                            f"{diverged}, where eager's top two logits were {gap:.4f} apart (not a near-tie)")


# (prompt tokens, new tokens) of six requests that finish at different steps: batched, they use every bucket
MIXED_LENGTHS = ((3, 20), (9, 24), (17, 28), (30, 12), (5, 16), (12, 40))


def mixed_requests() -> list[tuple[list[int], int]]:
    """The MIXED_LENGTHS requests on a tiny model: (prompt ids, new tokens)."""
    from tiny_models import prompt

    return [(prompt(length, seed), new_tokens) for seed, (length, new_tokens) in enumerate(MIXED_LENGTHS)]


def compile_as_on_cuda(monkeypatch, flat: bool = True):
    """A compiled engine built from here on compiles as on CUDA (torch.compile, no freezing) with our Triton
    attention in the decode step and (`flat`) in the flat step, here on the CPU under Triton's interpreter (its
    caller's module sets `TRITON_INTERPRET` before Triton is imported). Skips where inductor cannot compile for the
    CPU. Returns the `compiled` module."""
    from inference_core.engine import compiled as compiled_module
    from inference_core.engine import engine as engine_module
    from inference_core.engine import triton_attention

    if compiled_module.compile_unavailable(torch.device("cpu")) is not None:
        pytest.skip(compiled_module.compile_unavailable(torch.device("cpu")))
    monkeypatch.setattr(compiled_module, "default_backend", lambda device: "torch.compile")
    monkeypatch.setattr(engine_module, "default_options", lambda device, model=None: {})  # as CUDA: no freezing
    monkeypatch.setattr(triton_attention, "used",
                        lambda device, dtype, pool, paged: triton_attention.unsupported(dtype, pool, paged) is None)
    if flat:
        monkeypatch.setattr(triton_attention, "flat_unavailable",
                            lambda device, dtype, pool: triton_attention.unsupported(dtype, pool, True))
    return compiled_module


def compiled_matches_eager(loaded, **settings) -> tuple[Engine, list]:
    """The `mixed_requests` one at a time through an eager engine with `settings`, and all at once through a compiled
    one: each compiled answer equals eager's (or parts at a near-tie). Returns the compiled engine and the step
    reports of its run."""
    from tiny_models import greedy, run_to_end

    eager = Engine(loaded, EngineConfig(**settings))
    compiled = Engine(loaded, EngineConfig(**settings, compile=True))
    requests = mixed_requests()
    want = [eager.complete(ids, greedy(new_tokens)).token_ids for ids, new_tokens in requests]
    submitted = [compiled.submit(ids, greedy(new_tokens)) for ids, new_tokens in requests]
    reports = run_to_end(compiled)
    for (ids, _), expected, request in zip(requests, want, submitted):
        assert_same_or_near_tie(loaded, ids, expected, request.events[-1].token_ids)
    return compiled, reports


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


def by_lane(summary):
    """The race summary (a row per figure, a column per lane) turned to a row per lane, to read one figure across the
    lanes: `by_lane(summary)["TTFT (ms)"]` lists lane A's then lane B's."""
    return summary.set_index("figure").T


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
    """Debian's Chromium driven by Playwright, for the browser tests (set-up in tests/browser_setup.py)."""
    from playwright.sync_api import sync_playwright

    executable = ensure_chromium()
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()
