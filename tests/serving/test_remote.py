"""The external-engine client (`serving.remote`) against this app's own API served on loopback: it streams the same
text the engine gives, with its own TTFT and tokens/s; Stop ends it with a final event; a dead or wrong server is a
message, not a traceback."""

from __future__ import annotations

import queue

import gradio as gr
import pytest

from conftest import make_engine
from inference_core import ConfigError, FinishEvent, SamplingParams, TokenEvent
from server.app import create_app, serve_in_thread
from serving.policy import ServePolicy
from serving.remote import list_models, submit_remote
from serving.pool import EnginePool

HI = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def remote(bundled):
    pool = EnginePool(bundled, max_seq_len=512, policy=ServePolicy(max_new_tokens=64))
    with gr.Blocks() as demo:
        gr.Markdown("remote")
    server = serve_in_thread(create_app(demo, pool))
    yield pool, server.url
    server.stop()


def test_streams_the_engines_text_with_its_own_timings(remote, bundled):
    pool, url = remote
    assert list_models(url) == ["SmolLM2-135M-Instruct"]
    events = list(submit_remote(url, "SmolLM2-135M-Instruct", HI, max_tokens=12, temperature=0))
    tokens, final = events[:-1], events[-1]
    assert all(isinstance(e, TokenEvent) for e in tokens) and isinstance(final, FinishEvent)
    expected = make_engine(bundled, max_seq_len=512).complete(HI, SamplingParams(max_new_tokens=12))
    assert final.text == "".join(e.text for e in tokens) == expected.text
    stats = final.stats
    assert stats.kv_mode == "external" and stats.generated_tokens == expected.stats.generated_tokens
    assert stats.prompt_tokens == expected.stats.prompt_tokens and stats.ttft_ms > 0
    assert stats.decode_tokens_per_s > 0 and [e.index for e in tokens] == list(range(len(tokens)))


def test_stop_ends_with_a_final_event_and_frees_the_remote_request(remote):
    pool, url = remote
    handle = submit_remote(url, "bundled", [{"role": "user", "content": "Count to one hundred."}], max_tokens=64,
                           temperature=0, sink=queue.Queue())
    first = handle.next_event(timeout=30)
    assert isinstance(first, TokenEvent)
    handle.stop()
    while not handle.done:
        event = handle.next_event(timeout=30)
    assert event.stats.finish_reason == "stopped" and event.stats.generated_tokens < 64
    from conftest import wait_until_free

    wait_until_free(pool)  # the closed stream cancelled the request on the serving side


def test_unreachable_and_refusing_servers_are_messages(remote):
    _, url = remote
    with pytest.raises(ConfigError, match="could not list the models"):
        list_models("http://127.0.0.1:9")
    with pytest.raises(ConfigError, match="failed: .*Connect"):
        list(submit_remote("http://127.0.0.1:9", "m", HI, max_tokens=4))
    with pytest.raises(ConfigError, match="HTTP 404: the model 'gpt-4o' is not served here"):
        list(submit_remote(url, "gpt-4o", HI, max_tokens=4))
