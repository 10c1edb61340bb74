"""Random bodies against POST /v1/completions and /v1/chat/completions (hypothesis, derandomized): JSON of any shape,
dicts of the endpoints' own field names with values of any type, valid bodies with a few fields changed or an extra
key, and valid bodies with sampling values at their edges. Whatever comes, the server answers without a 5xx and
without a traceback: JSON (or, for a valid streamed request, server-sent events that end in [DONE]), every 4xx with a
non-empty `error.message`; and after it all no request or KV block is held. The bodies the search found with a 5xx
are kept as fixed cases (FOUND).

Two fields only get listed values: `compile` only false ones (a true one compiles the decode step, a minute of
torch.compile on this CPU, which is the compiled path's test's business), and `block_size` only small or absurd
ones (an engine's KV pool holds at least one block, so a block of a million tokens would allocate tens of GB here)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.load_test import start_in_process
from server.api_body import FIELDS

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
MAX_TOKENS = 4  # the deployment's cap on new tokens, so that every valid request ends after a few steps

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10)
texts = st.text(max_size=24)
messages = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant", "developer", "tool", ""]),
    "content": texts | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                        "text": texts}), max_size=2)}), min_size=1, max_size=3)
valid_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                 "content": texts}), max_size=2).map(
    lambda history: history + [{"role": "user", "content": "Hello"}])
# Values a field plausibly takes, good and bad at its edges; every field also gets any JSON value.
PLAUSIBLE = {
    "model": st.sampled_from(["SmolLM2-135M-Instruct", "bundled", "gpt-4o", "", "/etc/passwd"]),
    "prompt": texts | st.lists(texts, min_size=1, max_size=3) | st.lists(st.integers(-1, 49_200), max_size=4)
    | st.lists(st.lists(st.integers(0, 49_151), min_size=1, max_size=3), max_size=2),
    "messages": messages,
    "max_tokens": st.integers(-1, MAX_TOKENS + 1), "max_completion_tokens": st.integers(-1, MAX_TOKENS + 1),
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-2, 60),
    "n": st.integers(0, 5), "seed": st.integers(-(2 ** 64), 2 ** 64), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(), "x": st.booleans()}),
    "stop": texts | st.lists(texts, max_size=5), "user": texts,
    "presence_penalty": st.sampled_from([0, 0.5]), "frequency_penalty": st.sampled_from([0, -3]),
    "logit_bias": st.sampled_from([{}, {"50": 1}]), "logprobs": st.sampled_from([False, 0, True, 2]),
    "echo": st.booleans(), "best_of": st.integers(0, 2), "suffix": texts,
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "tool_choice": st.sampled_from(["none", "auto", "required"]), "tools": st.sampled_from([[], [{"type": "x"}]]),
    "kv_mode": st.sampled_from(["paged", "contiguous", "none", "flash"]),
    "prefix_cache": st.booleans(),
    "spec_method": st.sampled_from(["none", "ngram", "early-exit", "draft", "magic"]),
    "spec_k": st.integers(-1, 18), "spec_adaptive": st.booleans(),
    "draft_layers": st.sampled_from(["default", 1, 15, 29, 30, 0, "x"]),
    "weights": st.sampled_from(["none", "int8", "int4", "int3"]), "quant_group": st.sampled_from([32, 128, 7]),
    "kv_dtype": st.sampled_from(["auto", "int8", "fp8"]), "sliding_window": st.integers(-1, 600),
}
# Fields that only get the values listed (see the module docstring).
ONLY = {"compile": st.sampled_from([False, None, 0]),
        "block_size": st.sampled_from([4, 8, 16, 32, 7, 0, -4, 16.0, 1e300, True, None, "16", [16], {"x": 1}])}


def value_of(name: str):
    if name in ONLY:
        return ONLY[name]
    return st.one_of(PLAUSIBLE.get(name, st.nothing()), json_values)


# Sampling values at the edges of what is allowed (and, with subnormal temperatures, of float arithmetic).
EDGES = {"temperature": [0, 5e-324, 1e-300, 1e-3, 2], "top_p": [5e-324, 1e-9, 1], "top_k": [-1, 0, 1, 1 << 20],
         "seed": [-(2 ** 63), -1, 2 ** 63 - 1], "n": [1, 2]}


def valid_body(draw, kind: str) -> dict:
    """The served model, a prompt (possibly empty), max_tokens within the cap, streamed or not."""
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": draw(st.integers(1, MAX_TOKENS)),
            "stream": draw(st.booleans())}
    body["messages" if kind == "chat" else "prompt"] = draw(valid_messages if kind == "chat" else texts)
    return body


@st.composite
def near_valid(draw, kind: str) -> dict:
    """A valid body with up to 3 fields set to other values, then sometimes one key removed or an unknown key
    added."""
    body = valid_body(draw, kind)
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS[kind])), max_size=3, unique=True)):
        body[name] = draw(value_of(name))
    change = draw(st.sampled_from(["none", "remove a key", "none", "add a key", "none"]))
    if change == "remove a key":
        del body[draw(st.sampled_from(sorted(body)))]
    elif change == "add a key":
        body[draw(st.text(min_size=1, max_size=10))] = draw(json_values)
    return body


@st.composite
def sampling_edges(draw, kind: str) -> dict:
    """A valid body with some of its sampling fields at EDGES values."""
    body = valid_body(draw, kind)
    for name, values in EDGES.items():
        if draw(st.booleans()):
            body[name] = draw(st.sampled_from(values))
    return body


def bodies(kind: str):
    """Raw bytes, JSON of any shape, the endpoint's field names with any values, near-valid bodies (half), and
    valid ones with sampling at its edges."""
    any_fields = st.fixed_dictionaries({}, optional={name: value_of(name) for name in sorted(FIELDS[kind])})
    shaped = json_values | any_fields | near_valid(kind) | near_valid(kind) | near_valid(kind) | sampling_edges(kind)
    return st.binary(max_size=40) | shaped.map(lambda body: json.dumps(body).encode())


def test_field_names_here_are_the_endpoints_own():
    assert set(PLAUSIBLE) | set(ONLY) <= FIELDS["completions"] | FIELDS["chat"]


@pytest.fixture(scope="module")
def api(bundled, one_torch_thread):
    server, pool = start_in_process(bundled, clients=4, max_tokens=MAX_TOKENS)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client, pool
    server.stop()


def check_answer(response: httpx.Response, content: bytes) -> None:
    text = response.text
    assert response.status_code < 500, text[:300]
    if response.status_code != 200:  # (a 200's text is the model's, which may say anything)
        assert "Traceback" not in text and 'File "' not in text, text[:300]
    if response.headers["content-type"].startswith("text/event-stream"):
        assert response.status_code == 200 and json.loads(content)["stream"] is True
        events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
        assert events[-1] == "[DONE]", text[-300:]
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
        return
    answer = response.json()
    if response.status_code >= 400:
        message = answer["error"]["message"]
        assert isinstance(message, str) and message.strip(), answer
    else:
        assert response.status_code == 200 and answer["choices"], answer


@settings(max_examples=75, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def fuzz(client: httpx.Client, kind: str, data) -> None:
    """One body to one endpoint; hypothesis calls it max_examples times per call from the test below."""
    content = data.draw(bodies(kind), label="body")
    response = client.post(ENDPOINTS[kind], content=content, headers={"Content-Type": "application/json"})
    check_answer(response, content)


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_random_bodies_get_no_5xx_and_no_traceback(api, kind):
    client, pool = api
    fuzz(client, kind)
    assert pool.loop.call(lambda: (pool.active_requests(), pool.blocks_in_use())) == (0, 0)


# Bodies the random search found answered with a 5xx (or an error inside the stream), kept as fixed cases: an empty
# prompt, a block size past int64, and a subnormal temperature or top_p (they underflow to 0 in float32).
FOUND = {"empty prompt": ("completions", {"prompt": ""}),
         "empty prompt in a list": ("completions", {"prompt": ["Hi", ""]}),
         "block size 1e300": ("completions", {"prompt": "Hi", "block_size": 1e300}),
         "temperature 5e-324": ("chat", {"messages": [{"role": "user", "content": "Hi"}], "temperature": 5e-324}),
         "temperature 1e-300, streamed": ("completions", {"prompt": "Hi", "temperature": 1e-300, "stream": True}),
         "top_p 5e-324": ("completions", {"prompt": "Hi", "temperature": 1, "top_p": 5e-324})}


@pytest.mark.parametrize("kind, fields", FOUND.values(), ids=FOUND.keys())
def test_bodies_found_by_the_search_get_no_5xx(api, kind, fields):
    client, pool = api
    content = json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 2, **fields}).encode()
    check_answer(client.post(ENDPOINTS[kind], content=content, headers={"Content-Type": "application/json"}),
                 content)
    assert pool.loop.call(lambda: (pool.active_requests(), pool.blocks_in_use())) == (0, 0)
