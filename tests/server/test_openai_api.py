"""The OpenAI-compatible API through the official `openai` client on loopback: models, completions, chat, streaming,
the playground's own fields, errors (400 naming the field, 404, 429 with Retry-After), a disconnect mid-stream freeing
the request's blocks, public mode's refusals, and /metrics parsed as Prometheus text moving with the requests."""

from __future__ import annotations

import time

import gradio as gr
import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI, RateLimitError
from prometheus_client.parser import text_string_to_metric_families

from inference_core import SamplingParams
from conftest import make_engine
from server.app import create_app, serve_in_thread
from serving.policy import ServePolicy
from serving.pool import EnginePool
from conftest import wait_until_free


def _serve(bundled, policy: ServePolicy):
    pool = EnginePool(bundled, max_seq_len=512, policy=policy)
    with gr.Blocks() as demo:  # the API needs no page; the page's own tests serve the full app
        gr.Markdown("API tests")
    return pool, serve_in_thread(create_app(demo, pool))


@pytest.fixture(scope="module")
def served(bundled):
    pool, server = _serve(bundled, ServePolicy(max_new_tokens=64))
    yield pool, server
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=served[1].url + "/v1", api_key="test-key", max_retries=0, timeout=60)


def metrics(url: str) -> dict[tuple, float]:
    """/metrics parsed with prometheus-client's own parser: (sample name, sorted labels) -> value."""
    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_models_completions_and_chat_match_the_engine(served, client):
    pool, _ = served
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    chat = client.chat.completions.create(model=models[0].id, messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=12, temperature=0)
    engine = make_engine(pool.loaded, max_seq_len=512)  # its own engine: the served ones belong to the loop thread
    expected = engine.complete([{"role": "user", "content": "Say hello."}], SamplingParams(max_new_tokens=12))
    assert chat.choices[0].message.content == expected.text and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 12 and chat.choices[0].finish_reason == "length"
    timings = chat.model_extra["playground"]["timings"][0]
    assert timings["ttft_ms"] > 0 and timings["generated_tokens"] == 12
    text = client.completions.create(model="bundled", prompt="The capital of France is", max_tokens=6,
                                     temperature=0)
    assert text.choices[0].text == engine.complete("The capital of France is", SamplingParams(max_new_tokens=6),
                                                   chat=False).text
    assert text.object == "text_completion" and text.usage.prompt_tokens == 5


def test_streaming_usage_cache_hits_and_playground_fields(served, client):
    messages = [{"role": "system", "content": "You are terse. " * 8}, {"role": "user", "content": "Name a colour."}]
    stream = client.chat.completions.create(model="bundled", messages=messages, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices == [] and 1 <= chunks[-1].usage.completion_tokens <= 8
    again = client.chat.completions.create(model="bundled", messages=messages, max_tokens=8, temperature=0)
    assert again.choices[0].message.content == text  # streamed and whole answers agree
    assert again.usage.completion_tokens == chunks[-1].usage.completion_tokens
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # the same prompt again: the prefix cache hits
    other = client.chat.completions.create(model="bundled", messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"kv_mode": "contiguous", "spec_method": "ngram", "top_k": 5})
    extra = other.model_extra["playground"]
    assert extra["settings"]["kv_mode"] == "contiguous" and "prompt lookup" in extra["description"]
    assert "acceptance" in extra["timings"][0]
    assert other.choices[0].message.content == text  # greedy: the same ids through another configuration


def test_n_seed_and_stop(client):
    one = client.completions.create(model="bundled", prompt="Once upon a time", max_tokens=10, temperature=0.9,
                                    seed=7, n=2)
    assert [c.index for c in one.choices] == [0, 1]
    two = client.completions.create(model="bundled", prompt="Once upon a time", max_tokens=10, temperature=0.9,
                                    seed=7, n=2)
    assert [c.text for c in one.choices] == [c.text for c in two.choices]  # seeded: reproducible
    greedy = client.completions.create(model="bundled", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    cut = greedy.choices[0].text[3:6]
    stopped = client.completions.create(model="bundled", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                        stop=[cut])
    assert stopped.choices[0].text == greedy.choices[0].text.split(cut)[0]
    assert stopped.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ({"model": "bundled", "messages": []}, "messages"),
    ({"model": "bundled", "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"model": "bundled", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"model": "bundled", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "8"}, "max_tokens"),
    ({"model": "bundled", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ({"model": "bundled", "messages": [{"role": "user", "content": "hi"}], "stop": [""]}, "stop"),
    ({"model": "bundled", "messages": [{"role": "user", "content": "hi"}], "colour": "blue"}, "colour"),
    ({"model": "bundled", "messages": [{"role": "user", "content": "hi"}], "kv_mode": "bogus"}, "kv_mode"),
    ({"model": "bundled", "messages": [{"role": "user", "content": "hi"}], "spec_method": "draft"}, None),
    ({"model": "bundled", "messages": [{"role": "user", "content": "hi"}], "spec_method": "ngram",
      "spec_tree_width": 3}, "spec_tree_width"),
    ({"model": "bundled", "messages": [{"role": "user", "content": "hi"}], "spec_method": "eagle",
      "spec_tree_width": 3, "temperature": 0.7}, "spec_tree_width"),
    ({"model": "bundled", "messages": [{"role": "user", "content": "hi " * 600}]}, "prompt"),
])
def test_bad_bodies_get_400_naming_the_field(served, body, param):
    response = httpx.post(served[1].url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "Traceback" not in response.text
    if param is not None:
        assert error["param"] == param and param.split(".")[-1].split("[")[0] in error["message"]
    else:
        assert "draft model" in error["message"]


def test_unknown_model_is_404_and_bad_json_is_400(served, client):
    with pytest.raises(NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    response = httpx.post(served[1].url + "/v1/completions", content=b'{"model": ', timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_disconnect_mid_stream_cancels_and_frees_the_blocks(served):
    pool, server = served
    before = metrics(server.url).get(("playground_requests_total", (("outcome", "cancelled"), ("source", "api"))), 0)
    body = {"model": "bundled", "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 64, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        chunks = response.iter_lines()
        assert next(line for line in chunks if line.startswith("data:"))
        assert pool.loop.call(pool.blocks_in_use) > 0  # generating: its blocks are held
    wait_until_free(pool)  # the server noticed the disconnect and cancelled the request
    after = metrics(server.url)[("playground_requests_total", (("outcome", "cancelled"), ("source", "api")))]
    assert after == before + 1


def test_metrics_parse_and_move_with_requests(served, client):
    pool, server = served
    before = metrics(server.url)
    client.chat.completions.create(model="bundled", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                   temperature=0)
    long = [{"role": "user", "content": "Tell me about the sea. " * 6}]
    for _ in range(2):  # the second one's prompt comes from the prefix cache
        client.chat.completions.create(model="bundled", messages=long, max_tokens=1, temperature=0,
                                       extra_body={"spec_method": "ngram"})
    with pytest.raises(BadRequestError):
        client.chat.completions.create(model="bundled", messages=[{"role": "user", "content": "Hi"}], max_tokens=-1)
    after = metrics(server.url)
    finished = ("playground_requests_total", (("outcome", "finished"), ("source", "api")))
    assert after[finished] == before.get(finished, 0) + 3
    assert after[("playground_generation_tokens_total", ())] == before[("playground_generation_tokens_total", ())] + 7
    hit_tokens = ("playground_prefix_cache_hit_tokens_total", ())
    hits = after[hit_tokens] - before[hit_tokens]
    assert hits >= 16 and 0 < after[("playground_prefix_cache_hit_rate", ())] <= 1
    assert after[("playground_time_to_first_token_seconds_count", ())] > \
        before[("playground_time_to_first_token_seconds_count", ())]
    assert after[("playground_inter_token_latency_seconds_count", ())] >= \
        before[("playground_inter_token_latency_seconds_count", ())] + 4
    bad = ("playground_http_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "400")))
    assert after[bad] == before.get(bad, 0) + 1
    for gauge in ("playground_queue_length", "playground_kv_blocks_in_use", "playground_prefix_cache_hit_rate",
                  "playground_spec_acceptance_rate", "playground_running_requests"):
        assert (gauge, ()) in after
    assert ("playground_preemptions_total", ()) in after
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok"  # and the engine a request naming no playground setting runs on, no build here
    assert health["serving"] == {"engine": "paged KV cache, block 16, prefix cache, greedy", "build": None}


def test_public_mode_refuses_paths_unknown_models_and_callers_over_their_caps(bundled, tmp_path):
    pool, server = _serve(bundled, ServePolicy.public_defaults(requests_per_minute=2, tokens_per_hour=10_000))
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0, timeout=60)
        hi = [{"role": "user", "content": "Hi"}]
        with pytest.raises(BadRequestError, match="local paths"):
            client.chat.completions.create(model=str(tmp_path), messages=hi, max_tokens=2)
        with pytest.raises(NotFoundError, match="not served here"):
            client.chat.completions.create(model="meta-llama/Llama-3.1-8B", messages=hi, max_tokens=2)
        with pytest.raises(BadRequestError, match="between 1 and 256"):
            client.chat.completions.create(model="bundled", messages=hi, max_tokens=1000)
        for _ in range(2):
            client.chat.completions.create(model="bundled", messages=hi, max_tokens=2)
        response = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                              json={"model": "bundled", "messages": hi, "max_tokens": 2})
        assert response.status_code == 429 and int(response.headers["Retry-After"]) >= 1
        assert "2 a minute" in response.json()["error"]["message"]
        with pytest.raises(RateLimitError):
            client.chat.completions.create(model="bundled", messages=hi, max_tokens=2)
    finally:
        server.stop()


def test_a_full_queue_answers_429_with_retry_after(bundled):
    # The first request must still be running when the second arrives: greedy, this prompt counts on for all 300
    # tokens (seconds on any CPU), where "Count to one hundred:" alone ends after 24 and let a fast host finish it.
    pool, server = _serve(bundled, ServePolicy(max_queue=1, max_new_tokens=300))
    try:
        body = {"model": "bundled", "prompt": "Count to one hundred: 1, 2, 3,", "max_tokens": 300, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as first:
            # Hold the line iterator: httpcore closes the connection when one is dropped mid-stream, the server
            # then frees the first request as disconnected, and the second finds the queue empty. The pause shows
            # the first stays counted for as long as its client stays.
            lines = first.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            time.sleep(0.5)
            second = httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=30)
        assert second.status_code == 429 and int(second.headers["Retry-After"]) >= 1
        assert second.json()["error"]["code"] == "queue_full"
        wait_until_free(pool)
    finally:
        server.stop()
