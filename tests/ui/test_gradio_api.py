"""The app's API for programs (`ui.api`), called as a program calls it: `gradio_client` against the playground served
in this process over the session's bundled model. Only the named endpoints are listed; a race returns both lanes'
text and numbers; a chat's second turn, sent with the first's history, reuses it from the prefix cache; bad settings
come back as errors that name the problem."""

from __future__ import annotations

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

import ui
from browser_setup import free_port
from serving.pool import EnginePool

TOKENS = 8


@pytest.fixture(scope="module")
def served(bundled, one_torch_thread):
    pool = EnginePool(bundled, max_seq_len=512)
    demo = ui.build_demo(pool).queue(max_size=8, default_concurrency_limit=1)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    yield pool, Client(f"http://127.0.0.1:{port}/", verbose=False)
    demo.close()


def test_only_the_named_endpoints_are_listed(served):
    _, client = served
    api = client.view_api(return_format="dict", print_info=False)
    assert set(api["named_endpoints"]) == {"/race", "/chat"} and not api["unnamed_endpoints"]
    parameters = {name: [(p["parameter_name"], p["parameter_default"] if p["parameter_has_default"] else "required")
                         for p in endpoint["parameters"]] for name, endpoint in api["named_endpoints"].items()}
    assert parameters == {
        "/race": [("prompt", "required"), ("system", ""), ("max_new_tokens", 128), ("lane_a", None), ("lane_b", None)],
        "/chat": [("message", "required"), ("history", None), ("system", ""), ("max_new_tokens", 128),
                  ("settings", None)]}


def test_race_returns_both_lanes_text_and_numbers(served):
    pool, client = served
    result = client.predict(prompt="Why is the sky blue?", max_new_tokens=TOKENS, lane_b={"kv_mode": "contiguous"},
                            api_name="/race")
    assert result["status"].startswith("Finished. Lane A: 8 tokens at ")
    assert (result["identical"], result["check"]) == (True, "identical")  # both greedy: the same token ids
    a, b = result["lanes"]["A"], result["lanes"]["B"]
    assert a["settings"] == "paged KV cache, block 16, prefix cache, greedy"
    assert b["settings"] == "contiguous KV cache, greedy"
    assert a["text"] == b["text"] != "" and a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == TOKENS
    for lane in (a, b):
        assert (lane["generated_tokens"], lane["finish_reason"], lane["acceptance"]) == (TOKENS, "length", None)
        assert lane["ttft_ms"] > 0 and lane["decode_tokens_per_s"] > 0 and lane["device_s"] > 0
        assert lane["cached_prompt_tokens"] == 0 and lane["computed_prompt_tokens"] == lane["prompt_tokens"] > 0
        assert 0 < lane["kv_in_use_mib"] <= lane["kv_reserved_mib"] and lane["weights_dtype"] == "float32"
    # The paged lane reserves its blocks, the contiguous one a whole 512-token context of 45 KiB per token.
    assert a["kv_reserved_mib"] < b["kv_reserved_mib"] == round(512 * 45 / 1024, 2)
    assert pool.active_requests() == 0 and pool.blocks_in_use() == 0


def test_chat_second_turn_reuses_the_first_from_the_prefix_cache(served):
    pool, client = served
    first = client.predict(message="Hi", max_new_tokens=TOKENS, api_name="/chat")
    assert first["reply"] and [m["role"] for m in first["history"]] == ["user", "assistant"]
    assert first["history"][-1]["content"] == first["reply"]
    assert (first["stats"]["generated_tokens"], first["stats"]["cached_prompt_tokens"]) == (TOKENS, 0)
    second = client.predict(message="Tell me more.", history=first["history"], max_new_tokens=TOKENS,
                            api_name="/chat")
    assert [m["content"] for m in second["history"][:3]] == ["Hi", first["reply"], "Tell me more."]
    # Turn 2's prompt starts with turn 1's: every full block of turn 1's prompt comes from this client's cache.
    assert second["stats"]["cached_prompt_tokens"] >= first["stats"]["prompt_tokens"] // 16 * 16 > 0
    assert (first["stats"]["turn"], second["stats"]["turn"]) == (1, 2)
    assert pool.active_requests() == 0 and pool.blocks_in_use() == 0


@pytest.mark.parametrize("call, message", [
    (dict(prompt="Hi", lane_a={"kv_mode": "bogus"}, api_name="/race"),
     "Cannot start the race: unknown KV mode 'bogus'; use one of: none, contiguous, paged."),
    (dict(prompt="Hi", lane_b={"kv": "paged"}, api_name="/race"), "lane_b has unknown setting 'kv'; the settings are "),
    (dict(prompt="  ", api_name="/race"), "Cannot start the race: the prompt is empty"),
    (dict(message="Hi", settings={"temprature": 0.5}, api_name="/chat"), "settings has unknown setting 'temprature'"),
    (dict(message="Hi", history=[{"role": "robot", "content": "x"}], api_name="/chat"),
     "history[0] must be {'role': 'user' or 'assistant', 'content': text}"),
    (dict(message="Hi", max_new_tokens=0, api_name="/chat"),
     "Cannot send: max_new_tokens must be an integer of at least 1 ('max new tokens'), got 0."),
])
def test_bad_settings_raise_an_error_that_names_the_problem(served, call, message):
    pool, client = served
    with pytest.raises(AppError) as error:
        client.predict(**{"max_new_tokens": TOKENS, **call})
    assert message in str(error.value)
    assert pool.active_requests() == 0
