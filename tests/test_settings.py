"""The lane settings' table (`inference_core.settings`) and what each surface derives from it: `generate`'s flags, the
command that reproduces a lane, the API's fields and the words each surface's refusals use."""

from __future__ import annotations

import argparse

import pytest

from inference_core.config import ConfigError
from inference_core.settings import (DEFAULTS, SETTINGS, LaneSettings, add_setting_arguments, applies, command_flags,
                                     kinds, words)
from server.api_body import API_WORDS, PLAYGROUND_FIELDS
from ui.words import PAGE_WORDS

WIDGETS = {"radio", "dropdown", "checkbox", "slider", "number", "text"}
LANES = [
    LaneSettings(),
    LaneSettings(kv_mode="none"),
    LaneSettings(kv_mode="contiguous", compile=True, weights="int8"),
    LaneSettings(kv_mode="paged", block_size=4, prefix_cache=False, kv_dtype="int8", sliding_window=64),
    LaneSettings(temperature=0.7, top_p=0.9, seed=3, spec_method="ngram", spec_k=5, spec_adaptive=True),
    LaneSettings(spec_method="eagle", spec_k=2, spec_tree_width=3, weights="awq", quant_group=64),
    LaneSettings(spec_method="early-exit", draft_layers=10),
    LaneSettings(weights="int4", quant_activations="int8", compile=True),
]


def _parse(flags: list[str]) -> LaneSettings:
    parser = argparse.ArgumentParser()
    add_setting_arguments(parser)
    return LaneSettings.from_args(parser.parse_args(flags))


def _engine_view(settings: LaneSettings) -> tuple:
    """What the engine receives from a lane."""
    sampling = settings.sampling(8)
    return (settings.engine_config(256), settings.quant(), settings.spec(), sampling.temperature, sampling.top_p,
            sampling.seed if sampling.temperature else None)


def test_every_row_is_complete():
    for name, setting in SETTINGS.items():
        assert setting.label and setting.widget in WIDGETS, name
        assert setting.applies is None or setting.applies[0] in SETTINGS, name
        default = getattr(DEFAULTS, name)
        assert isinstance(default, kinds(name)), name
        assert not setting.choices or default in setting.choices, name
    flags = [setting.flag for setting in SETTINGS.values() if setting.flag]
    assert len(flags) == len(set(flags))


@pytest.mark.parametrize("settings", LANES, ids=lambda s: s.describe())
def test_the_reproducing_command_gives_the_engine_the_same_lane(settings):
    assert _engine_view(_parse(command_flags(settings))) == _engine_view(settings)


def test_generate_flags_default_to_the_engine_defaults_and_name_each_setting():
    parsed = _parse([])
    assert _engine_view(parsed)[:3] == _engine_view(DEFAULTS)[:3]
    assert parsed.seed is None  # the command line draws a fresh seed; the page shows 0
    assert _parse(["--kv", "none", "--no-prefix-cache", "--quant", "int4", "--spec", "ngram"]) == LaneSettings(
        kv_mode="none", prefix_cache=False, weights="int4", spec_method="ngram", seed=None, draft_layers=None,
        sliding_window=None, spec_k=None, spec_tree_width=None)
    assert command_flags(LaneSettings(spec_method="ngram", spec_k=5, weights="int4"), always=("kv_mode",)) == [
        "--kv", "paged", "--spec", "ngram", "--spec-k", "5", "--quant", "int4", "--quant-group", "32"]


def test_a_setting_applies_only_where_its_row_says():
    assert not applies(LaneSettings(kv_mode="none"), "block_size") and applies(DEFAULTS, "block_size")
    assert not applies(DEFAULTS, "top_p") and applies(LaneSettings(temperature=0.5), "top_p")
    assert applies(LaneSettings(spec_method="medusa"), "spec_tree_width")
    assert not applies(LaneSettings(spec_method="ngram"), "spec_tree_width")


def test_the_api_fields_are_the_rows_marked_for_it():
    assert set(PLAYGROUND_FIELDS) == {name for name, setting in SETTINGS.items() if setting.api == "extra"}
    assert {"temperature", "top_p", "seed", "endpoint", "endpoint_model"}.isdisjoint(PLAYGROUND_FIELDS)


def test_each_surface_names_a_setting_in_its_own_words():
    error = ConfigError("draft length k must be from 1 to 16 ({spec_k}); the tree ({spec_tree_width}) too.")
    assert str(error) == "draft length k must be from 1 to 16 (--spec-k); the tree (--spec-tree-width) too."
    assert error.in_words(PAGE_WORDS) == ("draft length k must be from 1 to 16 ('draft length k'); the tree "
                                          "('tree width') too.")
    assert error.in_words(API_WORDS) == ("draft length k must be from 1 to 16 ('spec_k'); the tree "
                                         "('spec_tree_width') too.")
    assert words("cli")["kv_mode"] == "--kv" and words("page")["kv_mode"] == "'KV cache'"
