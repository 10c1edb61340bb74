"""Shaping logits (`inference_core.logits`) and the sampling fields people expect, with OpenAI's and vLLM's meanings:
exact values on crafted rows for logit bias, min_tokens, the repetition, presence and frequency penalties, a grammar's
mask and min-p; then, on a tiny random model, stop token ids, min_tokens, include_stop_str_in_output and ignore_eos
in the engine, greedy ids under penalties equal with and without speculation, and every bad value's message."""

from __future__ import annotations

import pytest
import torch

from inference_core import SamplingParams
from inference_core.config import ConfigError
from inference_core.engine.request import TokenEvent
from inference_core.logits import RowContext, shape_logits
from inference_core.sampling import make_generator, probabilities, sample
from inference_core.spec.decoding import SpecConfig

from conftest import make_engine
from tiny_models import build_tiny_model

ROW = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])


def shaped(params: SamplingParams, token_ids=(), num_prompt: int = 0, stop_ids=frozenset(), allowed=None):
    row = RowContext(params, list(token_ids), num_prompt, frozenset(stop_ids), allowed)
    return shape_logits(ROW[None].clone(), [row])[0]


def test_nothing_to_shape_returns_the_same_tensor():
    logits = ROW[None]
    assert shape_logits(logits, [RowContext(SamplingParams(logprobs=3), [1, 2], 1), None]) is logits


def test_logit_bias_adds_to_the_named_tokens():
    out = shaped(SamplingParams(logit_bias={"1": 5.0, 4: -100}))
    assert out.tolist() == [2.0, 4.0, 0.5, 3.0, -102.0, 1.0]


def test_min_tokens_masks_the_stop_ids_until_enough_are_generated():
    params = SamplingParams(min_tokens=2, stop_token_ids=(5,))
    # the request's ending ids: end-of-sequence 3 and the stop token id 5 (Request.ending_ids)
    early = shaped(params, token_ids=[0, 0, 1], num_prompt=2, stop_ids={3, 5})  # one generated
    assert early.isneginf().tolist() == [False, False, False, True, False, True]
    late = shaped(params, token_ids=[0, 0, 1, 1], num_prompt=2, stop_ids={3, 5})  # two generated
    assert torch.equal(late, ROW)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output():
    out = shaped(SamplingParams(repetition_penalty=2.0), token_ids=[0, 1, 3], num_prompt=2)
    assert out.tolist() == [1.0, -2.0, 0.5, 1.5, -2.0, 1.0]


def test_presence_and_frequency_penalties_count_only_generated_tokens():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = shaped(params, token_ids=[2, 3, 3, 3, 5], num_prompt=1)  # prompt [2]; generated 3 three times, 5 once
    assert out.tolist() == pytest.approx([2.0, -1.0, 0.5, 3.0 - 0.5 - 0.75, -2.0, 1.0 - 0.5 - 0.25])


def test_a_grammar_mask_leaves_only_allowed_tokens():
    allowed = torch.tensor([False, True, False, False, True, False])
    out = shaped(SamplingParams(), allowed=allowed)
    assert out.isneginf().tolist() == (~allowed).tolist()
    assert int(out.argmax()) == 1


def test_the_grammar_wins_when_min_tokens_masks_its_only_token():
    allowed = torch.tensor([False, False, False, True, False, False])  # the grammar can only end (token 3: eos)
    out = shaped(SamplingParams(min_tokens=5), token_ids=[1], num_prompt=1, stop_ids={3}, allowed=allowed)
    assert int(out.argmax()) == 3 and out.isneginf().sum() == 5


def test_min_p_drops_tokens_below_its_share_of_the_top_probability():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.12, 0.08]))
    kept = probabilities(logits, SamplingParams(temperature=1.0, min_p=0.2)) > 0  # cut-off 0.1
    assert kept.tolist() == [True, True, True, False]
    generator = make_generator(SamplingParams(temperature=1.0, seed=0), torch.device("cpu"))
    draws = {sample(logits, SamplingParams(temperature=1.0, min_p=0.5, seed=0), generator) for _ in range(200)}
    assert draws == {0, 1}  # cut-off 0.25


@pytest.mark.parametrize("fields,message", [
    ({"min_p": 1.5}, "min_p must be in [0, 1]"),
    ({"presence_penalty": 3}, "presence_penalty must be between -2 and 2"),
    ({"frequency_penalty": -2.5}, "frequency_penalty must be between -2 and 2"),
    ({"repetition_penalty": 0}, "repetition_penalty must be above 0"),
    ({"logit_bias": {"x": 1}}, "logit_bias takes token ids"),
    ({"logit_bias": {3: 101}}, "logit_bias values must be between -100 and 100"),
    ({"min_tokens": 9, "max_new_tokens": 4}, "min_tokens must be an integer from 0 to max_new_tokens (4)"),
    ({"stop_token_ids": [-1]}, "stop_token_ids takes token ids"),
    ({"logprobs": 21}, "logprobs must be an integer from 0 to 20"),
    ({"prompt_logprobs": True}, "prompt_logprobs must be an integer from 0 to 20"),
    ({"logprobs_mode": "final"}, "logprobs_mode must be one of raw, processed"),
])
def test_bad_values_say_what_to_change(fields, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        SamplingParams(**fields)


# --- in the engine, on a tiny model ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-logits"))


def run(engine, prompt_ids, params, **kwargs):
    events = list(engine.generate(prompt_ids, params, **kwargs))
    return [e for e in events if isinstance(e, TokenEvent)], events[-1]


PROMPT = [5, 17, 42, 9, 100, 7, 33, 8]


def test_token_ids_out_of_the_vocabulary_are_refused(tiny):
    engine = make_engine(tiny)
    for fields, name in (({"logit_bias": {256: 1}}, "logit_bias"), ({"stop_token_ids": (300,)}, "stop_token_ids")):
        with pytest.raises(ConfigError, match=f"{name}: token id .* is outside the model's vocabulary"):
            engine.make_request(PROMPT, SamplingParams(**fields))


def test_a_stop_token_id_ends_the_output_with_reason_stop(tiny):
    engine = make_engine(tiny)
    tokens, _ = run(engine, PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True))
    stop_at = tokens[4].token_id
    first = next(i for i, e in enumerate(tokens) if e.token_id == stop_at)
    stopped, final = run(engine, PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True,
                                                        stop_token_ids=(stop_at,)))
    assert [e.token_id for e in stopped] == [e.token_id for e in tokens[:first + 1]]
    assert final.stats.finish_reason == "stop"
    # with min_tokens past it, the stop token is masked until then and the output is at least that long
    longer, _ = run(engine, PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop_at,),
                                                   min_tokens=first + 3))
    assert len(longer) >= first + 3 and stop_at not in [e.token_id for e in longer[:first + 2]]


def test_include_stop_str_in_output_keeps_the_stop_string(tiny):
    engine = make_engine(tiny)
    _, plain = run(engine, PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True))
    stop = plain.text.split()[3]
    _, without = run(engine, PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True, stop=(stop,)))
    _, kept = run(engine, PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True, stop=(stop,),
                                                 include_stop_str_in_output=True))
    assert kept.text == without.text + stop and plain.text.startswith(kept.text)


@pytest.mark.parametrize("spec", [SpecConfig("ngram", k=4, ngram_min=1), SpecConfig("early-exit", k=3)],
                         ids=["prompt-lookup", "early-exit"])
def test_penalised_greedy_ids_are_the_same_with_speculation(tiny, spec):
    """Each verified position is shaped as plain decoding would shape it after the drafts before it."""
    engine = make_engine(tiny)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.4,
                            presence_penalty=0.2, logit_bias={7: 2.0}, logprobs=2)
    prompt = PROMPT * 3  # repeats for prompt lookup to find
    plain, _ = run(engine, prompt, params)
    speculative, final = run(engine, prompt, params, spec=spec)
    assert [e.token_id for e in speculative] == [e.token_id for e in plain]
    assert [e.logprob for e in speculative] == pytest.approx([e.logprob for e in plain], abs=1e-4)
    assert final.stats.spec["drafted"] > 0
    unpenalised, _ = run(engine, prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
    assert [e.token_id for e in unpenalised] != [e.token_id for e in plain]  # the penalties changed the output


