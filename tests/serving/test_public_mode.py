"""Public mode on the page (the API's side is in tests/server/test_openai_api.py): a model outside the allowlist or from a
local path refused at launch, an external engine not allowed at launch refused, and a visitor over its caps refused
with a message saying when to try again, while another visitor still runs. Plus the external-engine lane through the
page's handlers against this app's own API."""

from __future__ import annotations

import gradio as gr
import pytest

from conftest import by_lane, lane, race_outputs
from inference_core import ConfigError
from server.app import create_app, serve_in_thread
from serving.policy import ServePolicy
from ui.chat import CHAT_OUTPUTS, chat_turn
from ui.control import RunControl
from ui.race import run_race
from serving.pool import EnginePool


def _last(generator) -> tuple:
    *_, last = generator
    return last


def _control(caller: str) -> RunControl:
    control = RunControl()
    control.arm(caller)
    return control


def test_launch_refuses_local_paths_and_models_outside_the_allowlist(tmp_path):
    from app import main

    assert main(["--public", "--model", str(tmp_path)]) == 2
    assert main(["--public", "--model", "meta-llama/Llama-3.1-8B", "--allow-model", "bundled"]) == 2
    policy = ServePolicy.public_defaults()
    with pytest.raises(ConfigError, match="local paths"):
        policy.check_model_spec(str(tmp_path / "model.gguf"), "x")
    policy.check_model_spec("bundled", "bundled")  # the served model itself is allowed


def test_page_refuses_a_visitor_over_its_caps_and_an_endpoint_not_allowed(bundled):
    pool = EnginePool(bundled, max_seq_len=512, policy=ServePolicy.public_defaults(
        requests_per_minute=1, allowed_endpoints=("http://127.0.0.1:1/v1",)))
    first = race_outputs(_last(run_race(pool, _control("203.0.113.7"), "Hi", "", 4, *lane("paged"), *lane("paged"))))
    assert first["status"].startswith("Finished")
    again = race_outputs(_last(run_race(pool, _control("203.0.113.7"), "Hi", "", 4, *lane("paged"), *lane("paged"))))
    assert "1 a minute" in again["status"] and "Try again in" in again["status"]
    other = race_outputs(_last(run_race(pool, _control("198.51.100.9"), "Hi", "", 4, *lane("paged"),
                                        *lane("paged", endpoint="http://169.254.169.254/latest"))))
    assert "not an allowed external engine" in other["status"]  # no fetching arbitrary addresses
    chat = dict(zip(CHAT_OUTPUTS, _last(chat_turn(pool, _control("203.0.113.7"), "Hi", [], [], "", 4,
                                                  *lane("paged")))))
    assert "Cannot send" in chat["status"] and "1 a minute" in chat["status"]
    big = dict(zip(CHAT_OUTPUTS, _last(chat_turn(pool, _control("192.0.2.1"), "Hi", [], [], "", 300,
                                                 *lane("paged")))))
    assert "allows up to 256" in big["status"] and "max new tokens" in big["status"]


def test_external_lane_races_this_apps_own_api(bundled):
    served_pool = EnginePool(bundled, max_seq_len=512, policy=ServePolicy(max_new_tokens=64))
    with gr.Blocks() as demo:
        gr.Markdown("the other machine")
    server = serve_in_thread(create_app(demo, served_pool))
    try:
        pool = EnginePool(bundled, max_seq_len=512)
        outputs = race_outputs(_last(run_race(pool, RunControl(), "Name three colours.", "", 12, *lane("paged"),
                                              *lane("paged", endpoint=server.url))))
        assert outputs["status"].startswith("Finished"), outputs["status"]
        assert 'data-verdict="identical"' in outputs["identical"]  # same model, same arithmetic: the same text
        assert "external engine" in by_lane(outputs["summary"])["settings"]["Lane B"]
        assert served_pool.loop.call(served_pool.blocks_in_use) == 0
    finally:
        server.stop()
