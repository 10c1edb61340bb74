"""`python app.py`'s serving engine (`serving.build`): the chat's and the API's default settings, their compiled steps
built by `precompile` in a process of their own while the pool serves the same settings eager, and the switch once
they are built."""

from __future__ import annotations

import sys
import threading
from dataclasses import replace

import pytest

from inference_core import cli
from inference_core.config import ConfigError
from inference_core.engine import compiled as compiled_module
from inference_core.engine.compiled import compile_unavailable
from inference_core.engine.precompile import build_all, engine_for
from inference_core.quant.linear import QuantConfig
from inference_core.settings import LaneSettings
from server.api_body import read_request
from serving.admission import Job
from serving.build import ServingBuild, child_command, precompile_arguments, serving_settings
from serving.pool import EnginePool
from serving.policy import ServePolicy
from tiny_models import build_tiny_model, greedy, prompt

COMPILED = LaneSettings(kv_mode="paged", compile=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-serving"))


def test_fastest_is_the_fastest_quantization_compiled_and_reference_the_models_own_weights(tiny, monkeypatch):
    assert serving_settings(tiny, "reference") == LaneSettings(kv_mode="paged")
    monkeypatch.setattr("serving.build.fastest_quant", lambda device: QuantConfig("int4", activations="int8"))
    monkeypatch.setattr("serving.build.compile_unavailable", lambda device: None)
    fastest = serving_settings(tiny, "fastest")
    assert (fastest.kv_mode, fastest.weights, fastest.quant_activations, fastest.compile) == \
        ("paged", "int4", "int8", True)
    monkeypatch.setattr("serving.build.compile_unavailable", lambda device: "no C++ compiler")
    assert serving_settings(tiny, "fastest").compile is False  # the same weights, eager
    with pytest.raises(ConfigError, match="fastest, reference"):
        serving_settings(tiny, "quickest")


def test_the_build_command_names_the_engine_the_pool_makes(tiny):
    """`precompile_arguments` parse back (through the command line's own parser) to the engine configuration and
    weights the pool keys the serving engine by: the packages it writes are the ones the pool's engine looks for."""
    settings = LaneSettings(kv_mode="paged", block_size=8, weights="int4", quant_group=64, quant_activations="int8",
                            compile=True)
    pool = EnginePool(tiny, max_seq_len=128, serving=settings)
    args = cli.parser().parse_args(precompile_arguments(tiny, settings, pool.max_seq_len))
    assert args.command == "precompile"
    parsed = replace(LaneSettings.from_args(args), compile=True)
    assert parsed.engine_config(args.max_seq_len, max_num_seqs=args.max_num_seqs) == \
        settings.engine_config(pool.max_seq_len)
    assert parsed.quant(args.quant_lm_head) == settings.quant()
    assert (args.model, args.device, args.dtype) == (tiny.name, "cpu", "float32")


def run_job(pool: EnginePool, settings: LaneSettings):
    """A 4-token request on the chat's slot, run to its end; returns its run (its engine, its lane's settings)."""
    run = pool.submit(Job("request", {"api": ("chat", settings)}, (prompt(6, 1),), max_new_tokens=4,
                          ignore_eos=True))
    try:
        run.start()
        for _ in run.events():
            pass
    finally:
        run.close()
    return run


def test_the_serving_settings_run_eager_until_their_built_steps_are_loaded(tiny, monkeypatch):
    """While the build runs, a request with the serving settings runs on their eager twin (its lane says so, and
    the note says why), other compiled settings are left as asked; once the child has exited and the pool has loaded
    the steps (through the engine loop, into the chat slot's compiled engine), the same request runs compiled."""
    loaded_into = []
    release = threading.Event()

    def load(engine, call):  # stands in for building (and loading) every bucket: that is precompile's own test
        release.wait(180)
        loaded_into.append((engine.config.compile, call == pool.loop.call))

    monkeypatch.setattr("serving.pool.build_all", load)
    monkeypatch.setattr("serving.pool.precompile_arguments", lambda *args: ["precompile", "--help"])  # exits 0
    pool = EnginePool(tiny, max_seq_len=128, serving=COMPILED)
    assert pool.runnable(COMPILED) == COMPILED  # no build started: as asked
    pool.build_serving()
    eager = replace(COMPILED, compile=False)
    other = replace(COMPILED, block_size=8)
    assert pool.runnable(COMPILED) == eager and pool.runnable(other) == other
    assert "being built in the background" in pool.serving_note(eager) and pool.serving_note(other) == ""
    run = run_job(pool, COMPILED)
    assert run.job.lanes["api"][1] == eager and run.engines["api"].decoder is None
    release.set()
    assert pool.build.wait(180) and pool.build.state == "ready"  # the child imports torch: slow on a busy host
    assert loaded_into == [(True, True)]
    assert pool.runnable(COMPILED) == COMPILED and pool.serving_note(eager) == ""


def test_a_failed_build_keeps_serving_eager_and_says_why(tiny):
    pool = EnginePool(tiny, max_seq_len=128, serving=COMPILED)
    pool.build = ServingBuild([sys.executable, "-c", "import sys; print('g++ not found'); sys.exit(3)"],
                              lambda: pytest.fail("loaded after a failed build"))
    assert pool.build.wait(30) and pool.build.state == "failed"
    assert "status 3" in pool.build.reason and "g++ not found" in pool.build.reason
    assert pool.runnable(COMPILED) == replace(COMPILED, compile=False)
    assert "failed (precompile exited with status 3" in pool.serving_note(replace(COMPILED, compile=False))
    sleeper = ServingBuild([sys.executable, "-c", "import time; time.sleep(60)"], lambda: None)
    sleeper.stop()  # the app stopping: the child goes with it
    assert sleeper.wait(10) and sleeper.state == "failed"


def test_an_api_request_naming_no_playground_setting_runs_on_the_serving_engine():
    serving = LaneSettings(kv_mode="paged", weights="int8", compile=True)
    body = {"model": "m", "prompt": "hi", "max_tokens": 4}
    asked = read_request(body, "completions", ServePolicy(), serving)
    assert (asked.settings.weights, asked.settings.compile) == ("int8", True)
    named = read_request({**body, "kv_mode": "contiguous"}, "completions", ServePolicy(), serving)
    assert (named.settings.kv_mode, named.settings.weights, named.settings.compile) == ("contiguous", "none", False)


def test_precompiled_steps_load_from_disk_in_a_new_engine(tiny, capsys):
    """`precompile` builds the flat step and every batch bucket's graph (one bucket here: the shapes of
    test_compiled's one-sequence engine, so the suite compiles them once); an engine made later as the pool makes it
    (here with nothing loaded in this process, as in the app's process) loads each from disk, compiling nothing, and
    decodes what the eager engine decodes."""
    if compile_unavailable(tiny.device) is not None:
        pytest.skip(compile_unavailable(tiny.device))
    assert cli.main(["precompile", "--model", tiny.name, "--device", "cpu", "--dtype", "float32",
                     "--max-num-seqs", "1"]) == 0
    assert "batch 1 and the flat step: " in capsys.readouterr().out
    compiled_module._LOADED_PACKAGES.clear()
    engine = engine_for(tiny, COMPILED, None, max_num_seqs=1)
    build_all(engine)
    stats = engine.compile_stats()
    assert (stats["graphs"], stats["from_disk"]) == (2, 2)
    want = engine_for(tiny, replace(COMPILED, compile=False), None, 1).complete(prompt(9, 3), greedy(12)).token_ids
    assert engine.complete(prompt(9, 3), greedy(12)).token_ids == want
