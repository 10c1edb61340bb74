"""The draft length a request gets when it leaves k open (`spec.defaults`): the choice from spec-bench's rows, what is
kept per setup, and the engine and the lane settings leaving k to it."""

from __future__ import annotations

import json

import pytest

from inference_core import Engine, EngineConfig, SamplingParams
from inference_core.settings import AUTO_K, LaneSettings, command_flags
from inference_core.spec import defaults
from inference_core.spec.decoding import SpecConfig

from tiny_models import build_tiny


def _row(kind, k, ratio, setting="eagle"):
    return {"kind": kind, "setting_key": setting, "k": k, "ratio": ratio}


def test_the_best_k_has_the_highest_geometric_mean_over_the_kinds_measured_for_it():
    rows = [_row("chat", 1, 1.10), _row("code", 1, 1.00), _row("chat", 2, 1.40), _row("code", 2, 0.80),
            _row("chat", 3, 2.00),  # k=3 was not measured on code: it does not compete
            _row("chat", 4, 1.2, "ngram"), _row("chat", 2, 1.2, "ngram")]  # a tie: the shorter draft
    best = defaults.best_k(rows)
    # k=1: sqrt(1.10 * 1.00) = 1.049; k=2: sqrt(1.40 * 0.80) = 1.058 (an arithmetic mean would say 1.05 and 1.10)
    assert best["eagle"]["k"] == 2 and best["eagle"]["geomean_ratio"] == pytest.approx(1.058, abs=1e-3)
    assert best["eagle"]["others"] == {"1": pytest.approx(1.049, abs=1e-3), "2": pytest.approx(1.058, abs=1e-3)}
    assert best["ngram"]["k"] == 2


def test_kept_choices_are_read_back_for_their_setup_and_setting_only(tmp_path, monkeypatch):
    monkeypatch.setattr(defaults, "_path", lambda: tmp_path / defaults.FILE_NAME)
    k, where = defaults.default_k("setup A", "eagle")
    assert k == defaults.BUILT_IN_K["eagle"] and "nothing measured" in where
    defaults.keep("setup A", {"eagle": {"k": 3, "geomean_ratio": 1.2}, "eagle w=3": {"k": 2}}, "spec-bench ...")
    defaults.keep("setup A", {"ngram": {"k": 5}}, "spec-bench ...")  # adds to the setup's earlier choices
    assert defaults.default_k("setup A", "eagle")[0] == 3
    assert defaults.default_k("setup A", "eagle", tree_width=3)[0] == 2
    assert defaults.default_k("setup A", "ngram")[0] == 5
    assert defaults.default_k("setup B", "eagle")[0] == defaults.BUILT_IN_K["eagle"]
    kept = json.loads((tmp_path / defaults.FILE_NAME).read_text())
    assert kept["setup A"]["eagle"]["command"] == "spec-bench ..." and "measured" in kept["setup A"]["eagle"]
    (tmp_path / defaults.FILE_NAME).write_text("{not json")  # a damaged file: the project's defaults, no crash
    assert defaults.default_k("setup A", "eagle")[0] == defaults.BUILT_IN_K["eagle"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("target"), seed=0, initializer_range=0.3)


def test_an_engine_settles_an_open_k_from_its_setup_and_keeps_a_named_one(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(defaults, "_path", lambda: tmp_path / defaults.FILE_NAME)
    engine = Engine(tiny, EngineConfig(kv_mode="paged", block_size=2))
    assert engine.resolve_spec(SpecConfig("ngram")).k == defaults.BUILT_IN_K["ngram"]
    setup = defaults.setup_key(tiny, "paged", compiled=False)
    assert "float32" in setup and "paged KV" in setup and "eager" in setup
    defaults.keep(setup, {"ngram": {"k": 6}, "early-exit L=1": {"k": 2}}, "spec-bench ...")
    assert engine.resolve_spec(SpecConfig("ngram")).k == 6
    assert engine.resolve_spec(SpecConfig("ngram", k=2)).k == 2
    assert engine.resolve_spec(SpecConfig("early-exit")) == SpecConfig("early-exit", k=2, draft_layers=1)
    assert engine.resolve_spec(SpecConfig()) == SpecConfig()  # no speculation: nothing to settle
    request = engine.make_request([5, 6, 7], SamplingParams(max_new_tokens=8), spec=SpecConfig("ngram"))
    assert request.draft_k == 6 and request.spec.k == 6
    with pytest.raises(ValueError, match="resolve_spec"):
        SpecConfig("ngram").max_k  # an open k is settled by the engine before anything reads it


def test_a_lane_leaves_k_open_by_default_and_says_so():
    lane = LaneSettings(spec_method="eagle")
    assert lane.spec_k == AUTO_K and lane.spec() == SpecConfig("eagle")
    assert lane.describe().endswith("EAGLE layer (trained) k best measured")
    assert "--spec-k" not in command_flags(lane)  # the CLI leaves it open too
    assert LaneSettings(spec_method="eagle", spec_k=2).spec().k == 2
