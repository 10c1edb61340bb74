"""The draft length a request gets when it leaves k open (`spec.defaults`): the choice from spec-bench's rows, what is
kept per setup, and the engine and the lane settings leaving k to it."""

from __future__ import annotations

import json

import pytest

from inference_core import Engine, EngineConfig, SamplingParams
from inference_core.settings import AUTO, LaneSettings, command_flags
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


def _ranked(kind, k, width, ratio):
    return {**_row(kind, k, ratio, "eagle" + (f" w={width}" if width > 1 else "")), "source_key": "eagle",
            "tree_width": width}


def test_a_ranking_sources_best_tree_width_is_its_fastest_pair_measured_on_every_kind():
    rows = [_ranked("chat", 1, 1, 1.20), _ranked("code", 1, 1, 1.30), _ranked("chat", 1, 3, 1.40),
            _ranked("code", 1, 3, 1.25), _ranked("chat", 2, 1, 1.10), _ranked("code", 2, 1, 1.00),
            _ranked("chat", 2, 3, 1.05), _ranked("code", 2, 3, 1.30),
            _ranked("chat", 1, 5, 3.00)]  # 5 wide was not measured on code: it does not compete
    best = defaults.best_k(rows)
    auto = best["eagle w=auto"]
    # k=1 w=3: sqrt(1.40 * 1.25) = 1.323 against the chain's sqrt(1.20 * 1.30) = 1.249
    assert (auto["k"], auto["tree_width"]) == (1, 3) and auto["geomean_ratio"] == pytest.approx(1.323, abs=1e-3)
    assert auto["width_by_k"] == {"1": 3, "2": 3}  # at k=2: sqrt(1.05 * 1.30) = 1.168 against 1.049
    assert best["eagle"]["k"] == 1 and best["eagle w=3"]["k"] == 1  # each width's own best k, as before
    one_width = defaults.best_k([row for row in rows if row["tree_width"] == 1])
    assert "eagle w=auto" not in one_width  # nothing to choose among: a width kept earlier stands
    tie = defaults.best_k([_ranked("chat", 1, 1, 1.2), _ranked("chat", 1, 2, 1.2)])
    assert tie["eagle w=auto"]["tree_width"] == 1  # a tie goes to the narrower tree


def test_an_open_tree_width_is_the_kept_one_else_the_projects(tmp_path, monkeypatch):
    monkeypatch.setattr(defaults, "_path", lambda: tmp_path / defaults.FILE_NAME)
    assert defaults.default_tree_width("setup A", "eagle", None, compiled=True) == \
        (defaults.BUILT_IN_TREE_WIDTH["eagle"]["compiled"], defaults.default_k("setup A", "eagle")[1])
    assert defaults.default_tree_width("setup A", "medusa", 1, compiled=False)[0] == \
        defaults.BUILT_IN_TREE_WIDTH["medusa"]["eager"]
    defaults.keep("setup A", {"eagle w=auto": {"k": 1, "tree_width": 2, "width_by_k": {"1": 2, "2": 3}}}, "...")
    assert defaults.default_tree_width("setup A", "eagle", None, compiled=True)[0] == 2
    assert defaults.default_tree_width("setup A", "eagle", 2, compiled=True)[0] == 3
    assert defaults.default_tree_width("setup A", "eagle", 4, compiled=True)[0] == 2
    defaults.keep("setup A", {"eagle w=auto": {"k": 1, "tree_width": 99}}, "...")  # damaged: the project's
    assert defaults.default_tree_width("setup A", "eagle", 1, compiled=True)[0] == \
        defaults.BUILT_IN_TREE_WIDTH["eagle"]["compiled"]


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


def test_a_lane_leaves_k_and_the_tree_width_open_by_default_and_says_so():
    lane = LaneSettings(spec_method="eagle")
    assert lane.spec_k == AUTO and lane.spec_tree_width == AUTO
    assert lane.spec() == SpecConfig("eagle", tree_width=None)
    assert lane.describe().endswith("EAGLE layer (trained) k best measured tree width best measured")
    assert LaneSettings(spec_method="eagle", temperature=0.7).describe().endswith("k best measured")  # a chain
    assert not {"--spec-k", "--spec-tree-width"} & set(command_flags(lane))  # the CLI leaves them open too
    assert LaneSettings(spec_method="eagle", spec_k=2).spec().k == 2
    assert LaneSettings(spec_method="eagle", spec_tree_width=3).spec().tree_width == 3
    assert LaneSettings(spec_method="ngram").describe().endswith("prompt lookup k best measured")
