"""The API as a scoring client reads it (lm-evaluation-harness's `local-completions`: prompts as token ids, `echo`,
`logprobs`, `max_tokens` 1): the prompt's log-probabilities whatever the model says next, the end of sequence
included with an empty text; lists of prompts and `n` > 1, each choice with its index; `max_tokens` 0 with `echo`; a
prompt that fills the context but one; top alternatives whose best entry is the chosen token's log-probability bit
for bit. And vLLM's tokenizer endpoints (`/tokenize`, `/detokenize`, `/tokenizer_info`) against the engine's own
tokenizer, with a 400 naming the field for bad input and public mode's requests-per-minute limit."""

from __future__ import annotations

import gradio as gr
import httpx
import pytest

from server.app import create_app, serve_in_thread
from serving.policy import ServePolicy
from serving.pool import EnginePool

from conftest import wait_until_free

MAX_SEQ_LEN = 512
QUESTION = "Question: Which season comes after winter?\nAnswer: spring"


def _serve(loaded, policy: ServePolicy):
    pool = EnginePool(loaded, max_seq_len=MAX_SEQ_LEN, policy=policy)
    with gr.Blocks() as demo:  # the API needs no page
        gr.Markdown("API tests")
    return pool, serve_in_thread(create_app(demo, pool))


@pytest.fixture(scope="module")
def served(bundled):
    pool, server = _serve(bundled, ServePolicy(max_new_tokens=64, max_prompt_tokens=MAX_SEQ_LEN))
    yield pool, server
    server.stop()


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served[1].url, timeout=120) as client:
        yield client


def _score(http, prompt, **fields) -> dict:
    body = {"model": "bundled", "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0,
            **fields}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_prompts_log_probabilities_come_back_when_the_next_token_ends_the_text(served, http):
    loaded = served[0].loaded
    ids = loaded.tokenizer.encode(QUESTION)
    eos = min(loaded.eos_token_ids)
    ended = _score(http, ids, logit_bias={str(eos): 100})["choices"][0]  # the next token is the end, for certain
    assert ended["finish_reason"] == "stop" and ended["text"] == loaded.tokenizer.decode(ids)
    logprobs = ended["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 1  # every prompt token, then the end of sequence
    assert logprobs["tokens"][-1] == "" and logprobs["token_logprobs"][-1] <= 0
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert "".join(logprobs["tokens"]) == ended["text"]
    # The prompt's entries are the model's own (logit bias shapes the next token only): the same as where the next
    # token is not the end, bit for bit.
    plain = _score(http, ids)["choices"][0]["logprobs"]
    assert plain["token_logprobs"][:len(ids)] == logprobs["token_logprobs"][:len(ids)]
    # lm-eval's greedy check: a token the model ranks first has its own log-probability as the best alternative.
    for token, logprob, top in zip(logprobs["tokens"][1:], logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:]):
        best, value = next(iter(top.items()))
        assert value >= logprob and (best != token or value == logprob)
    wait_until_free(served[0])


def test_lists_of_prompts_and_n_give_every_choice_its_index_and_its_prompt(served, http):
    tokenizer = served[0].loaded.tokenizer
    prompts = [tokenizer.encode("The sky is"), tokenizer.encode("Two plus two equals")]
    choices = _score(http, prompts, n=2)["choices"]
    assert [choice["index"] for choice in choices] == [0, 1, 2, 3]
    for choice in choices:
        prompt = prompts[choice["index"] // 2]
        assert len(choice["logprobs"]["tokens"]) == len(prompt) + 1
        assert choice["text"].startswith(tokenizer.decode(prompt))
    assert choices[0]["logprobs"]["token_logprobs"] == choices[1]["logprobs"]["token_logprobs"]  # greedy copies


def test_max_tokens_0_with_echo_gives_the_prompt_alone(served, http):
    tokenizer = served[0].loaded.tokenizer
    ids = tokenizer.encode(QUESTION)
    out = _score(http, ids, max_tokens=0)
    choice = out["choices"][0]
    assert choice["text"] == tokenizer.decode(ids) and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == len(ids)
    with http.stream("POST", "/v1/completions", json={"model": "bundled", "prompt": ids, "echo": True, "logprobs": 1,
                                                      "max_tokens": 0, "stream": True}) as streamed:
        lines = [line for line in streamed.iter_lines() if line.startswith("data: {")]
    assert len(lines) == 2  # the echoed prompt, then the end
    refused = http.post("/v1/completions", json={"model": "bundled", "prompt": ids, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    assert "needs 'echo': true" in refused.json()["error"]["message"]


def test_a_prompt_that_fills_the_context_but_one(served, http):
    ids = (served[0].loaded.tokenizer.encode(QUESTION) * 60)[:MAX_SEQ_LEN - 1]
    choice = _score(http, ids, logprobs=0)["choices"][0]
    assert len(choice["logprobs"]["tokens"]) in (MAX_SEQ_LEN - 1, MAX_SEQ_LEN)  # the prompt, and its token unless
    assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"][1:])  # that token ended the text
    too_long = http.post("/v1/completions", json={"model": "bundled", "prompt": ids + ids[:1], "max_tokens": 1})
    assert too_long.status_code == 400


# --- vLLM's tokenizer endpoints -------------------------------------------------------------------------------------

def test_tokenize_and_detokenize_use_the_engines_tokenizer(served, http):
    tokenizer = served[0].loaded.tokenizer
    text = "Hello there, tokenizer!"
    out = http.post("/tokenize", json={"model": "bundled", "prompt": text}).json()
    assert out == {"count": len(tokenizer.encode(text)), "max_model_len": MAX_SEQ_LEN,
                   "tokens": tokenizer.encode(text), "token_strs": None}
    bare = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    assert bare.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert bare.json()["token_strs"] == [tokenizer.token_string(i) for i in bare.json()["tokens"]]
    messages = [{"role": "user", "content": text}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tokenizer.encode_chat(messages)
    without = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert without["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=False),
                                                 add_special_tokens=False)
    assert len(without["tokens"]) < len(chat["tokens"])
    assert http.post("/detokenize", json={"tokens": chat["tokens"]}).json() == {
        "prompt": tokenizer.decode(chat["tokens"])}
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == MAX_SEQ_LEN and "bos_token" in info and "pad_token" in info


@pytest.mark.parametrize("path, body, param, words", [
    ("/tokenize", {}, "prompt", "give 'prompt' (a string) or 'messages'"),
    ("/tokenize", {"prompt": 5}, "prompt", "'prompt' must be a string"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "messages", "one of them"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "b"}]}, "messages[0].role", "must be system"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens", "must be true or false"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt", "goes with 'messages'"),
    ("/tokenize", {"prompt": "a", "truncate": 3}, "truncate", "unrecognized request argument supplied: truncate"),
    ("/detokenize", {"tokens": "abc"}, "tokens", "must be a list of token ids"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens", "holds -1, outside this tokenizer's ids"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens", "outside this tokenizer's ids"),
])
def test_bad_input_to_the_tokenizer_endpoints_names_the_field(http, path, body, param, words):
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_an_unknown_model_is_a_404_and_a_bad_body_a_400(http):
    assert http.post("/tokenize", json={"model": "gpt-9", "prompt": "a"}).status_code == 404
    assert http.post("/detokenize", content=b"[1, 2").status_code == 400


def test_public_mode_counts_tokenizer_calls_against_the_callers_requests_per_minute(bundled):
    pool, server = _serve(bundled, ServePolicy.public_defaults(requests_per_minute=2))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            codes = [client.post("/tokenize", json={"prompt": "hi"}).status_code for _ in range(3)]
            assert codes == [200, 200, 429]
            limited = client.post("/detokenize", json={"tokens": [1]})
            assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
            assert client.get("/tokenizer_info").status_code == 200  # no body, nothing to count
    finally:
        server.stop()
