"""What the model weighs, through the API and the official `openai` client: log-probabilities in chat's and
completions' shapes (streamed equal to whole, equal to the engine's, `echo` with the prompt's), `response_format`
and vLLM's guided fields giving outputs that validate, penalties and logit bias with OpenAI's meaning, the vLLM
extensions that benchmark clients send (`ignore_eos` giving exactly the asked length, `min_tokens`,
`stream_options.continuous_usage_stats`, `stop_token_ids`, ...), and a 400 naming the field for every bad value."""

from __future__ import annotations

import json

import gradio as gr
import httpx
import jsonschema
import pytest
from openai import OpenAI

from inference_core import SamplingParams
from inference_core.engine.request import TokenEvent
from server.app import create_app, serve_in_thread
from serving.policy import ServePolicy
from serving.pool import EnginePool

from conftest import make_engine, wait_until_free

HELLO = [{"role": "user", "content": "Say hello."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def served(bundled):
    pool = EnginePool(bundled, max_seq_len=512, policy=ServePolicy(max_new_tokens=96))
    with gr.Blocks() as demo:  # the API needs no page
        gr.Markdown("API tests")
    server = serve_in_thread(create_app(demo, pool))
    yield pool, server
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=served[1].url + "/v1", api_key="test-key", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine(served):
    return make_engine(served[0].loaded, max_seq_len=512)  # its own: the served ones belong to the loop thread


def test_chat_logprobs_whole_and_streamed_equal_the_engine(client, engine):
    whole = client.chat.completions.create(model="bundled", messages=HELLO, max_tokens=10, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    events = [e for e in engine.generate(HELLO, SamplingParams(max_new_tokens=10, logprobs=3))
              if isinstance(e, TokenEvent)]
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in events], abs=1e-5)
    assert "".join(c.token for c in content) == whole.choices[0].message.content
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token for c in content)
    assert bytes(content[0].bytes).decode() == content[0].token
    stream = client.chat.completions.create(model="bundled", messages=HELLO, max_tokens=10, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True)
    streamed = [entry for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    # the second run takes its prompt from the prefix cache: the same numbers up to fp32 rounding
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)
    plain = client.chat.completions.create(model="bundled", messages=HELLO, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_with_echo_cover_the_prompt(client):
    prompt = "The capital of France is"
    out = client.completions.create(model="bundled", prompt=prompt, max_tokens=5, temperature=0, logprobs=2,
                                    echo=True)
    choice = out.choices[0]
    logprobs = choice.logprobs
    assert choice.text.startswith(prompt) and out.usage.prompt_tokens == 5
    assert len(logprobs.tokens) == 5 + 5 and "".join(logprobs.tokens) == choice.text
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(len(top) == 2 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(10)]
    streamed = client.completions.create(model="bundled", prompt=prompt, max_tokens=5, temperature=0, logprobs=2,
                                         echo=True, stream=True)
    tokens = [t for chunk in streamed for t in (chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs
                                                else [])]
    assert tokens == logprobs.tokens


def test_response_format_and_guided_fields_give_outputs_that_validate(client):
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for temperature in (0, 0.7):
        out = client.chat.completions.create(model="bundled", max_tokens=60, temperature=temperature, seed=1,
                                             messages=[{"role": "user", "content": "Describe a person as JSON."}],
                                             response_format=schema_format)
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    asking = [{"role": "user", "content": "Give the name and age of a person as JSON."}]
    anything = client.chat.completions.create(model="bundled", max_tokens=80, temperature=0, messages=asking,
                                              response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    choice = client.completions.create(model="bundled", prompt="Is the sky blue? Answer:", max_tokens=5,
                                       temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    date = client.completions.create(model="bundled", prompt="Today's date:", max_tokens=12, temperature=0,
                                     extra_body={"guided_regex": r"\d{4}-\d{2}-\d{2}"})
    assert len(date.choices[0].text) == 10 and date.choices[0].text[4] == "-"


def test_ignore_eos_min_tokens_and_continuous_usage(client, served):
    """GuideLLM's streamed request: ignore_eos and continuous usage stats; the output is exactly max_tokens long."""
    stream = client.chat.completions.create(
        model="bundled", messages=[{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}],
        max_completion_tokens=40, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = list(stream)
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert counts == sorted(counts) and chunks[-1].usage.completion_tokens == 40
    short = client.chat.completions.create(model="bundled", messages=HELLO, max_tokens=40, temperature=0)
    assert short.usage.completion_tokens < 40  # without ignore_eos the answer ends by itself
    longer = client.chat.completions.create(model="bundled", messages=HELLO, max_tokens=40, temperature=0,
                                            extra_body={"min_tokens": short.usage.completion_tokens + 5})
    assert longer.usage.completion_tokens >= short.usage.completion_tokens + 5
    wait_until_free(served[0])


def test_penalties_logit_bias_and_stop_token_ids(client, served):
    tokenizer = served[0].loaded.tokenizer
    base = client.completions.create(model="bundled", prompt="1, 2, 3, 4,", max_tokens=16, temperature=0)
    penalised = client.completions.create(model="bundled", prompt="1, 2, 3, 4,", max_tokens=16, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=2.0,
                                          extra_body={"repetition_penalty": 1.5})
    assert penalised.choices[0].text != base.choices[0].text
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    biased = client.completions.create(model="bundled", prompt="1, 2, 3, 4,", max_tokens=3, temperature=0,
                                       logit_bias={str(forced): 100})
    assert biased.choices[0].text == tokenizer.decode([forced] * 3)
    first = tokenizer.encode(base.choices[0].text, add_special_tokens=False)[2]
    stopped = client.completions.create(model="bundled", prompt="1, 2, 3, 4,", max_tokens=16, temperature=0,
                                        extra_body={"stop_token_ids": [first]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 3
    kept = client.completions.create(model="bundled", prompt="1, 2, 3, 4,", max_tokens=16, temperature=0,
                                     stop=[" 7"], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text.endswith(" 7")


CHAT = {"model": "bundled", "messages": HELLO}


@pytest.mark.parametrize("kind, extra, param", [
    ("chat", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": 3}, "logprobs"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {"frequency_penalty": "high"}, "frequency_penalty"),
    ("chat", {"repetition_penalty": 0}, "repetition_penalty"),
    ("chat", {"min_p": 2}, "min_p"),
    ("chat", {"logit_bias": {"word": 3}}, "logit_bias"),
    ("chat", {"logit_bias": {"5": 300}}, "logit_bias"),
    ("chat", {"logit_bias": {"999999": 1}}, "logit_bias"),
    ("chat", {"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    ("chat", {"stop_token_ids": ["a"]}, "stop_token_ids"),
    ("chat", {"ignore_eos": "yes"}, "ignore_eos"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"uniqueItems": 2}}}},
     "response_format"),
    ("chat", {"guided_regex": "(", "guided_choice": ["a"]}, "guided_choice"),
    ("chat", {"guided_regex": "("}, "guided_regex"),
    ("chat", {"stream_options": {"continuous_usage_stats": "x"}, "stream": True}, "stream_options"),
    ("completions", {"best_of": 2}, "best_of"),
])
def test_bad_sampling_values_get_400_naming_the_field(served, kind, extra, param):
    body = {**CHAT, **extra} if kind == "chat" else {"model": "bundled", "prompt": "hi", **extra}
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    response = httpx.post(served[1].url + path, json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert "Traceback" not in response.text
