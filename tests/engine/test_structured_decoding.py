"""Structured outputs in the engine, on the bundled model: every output of 24 JSON schemas (closed as OpenAI's strict
mode closes them) parses and validates (jsonschema), greedy and sampled, decoded in one continuously batched engine
beside unconstrained requests, which come out exactly as they do alone; constrained greedy with speculation (early exit,
and a Medusa tree) equals constrained greedy without it; a regex and a list of choices hold; a bad schema is refused
when the request is made."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from inference_core import SamplingParams
from inference_core.config import ConfigError
from inference_core.spec.decoding import SpecConfig
from inference_core.structured import Constraint, strict_schema

from conftest import assert_nothing_held, make_engine
from test_structured import SCHEMAS

NEW_TOKENS = 120


def ask(schema) -> str:
    return f"Reply with JSON that follows this JSON schema:\n{json.dumps(schema)}"


def test_every_output_validates_greedy_and_sampled_beside_unconstrained_requests(bundled):
    engine = make_engine(bundled, "paged", batching="continuous", max_num_seqs=16, max_seq_len=1024)
    constrained = []
    for index, (schema, _) in enumerate(SCHEMAS):
        # sampled as people sample; a small model at temperature 1 and no min-p can write digits forever
        sampled = dict(temperature=0.7, min_p=0.1, seed=index) if index % 2 else {}
        constraint = Constraint("json_schema", json.dumps(strict_schema(schema)))
        params = SamplingParams(max_new_tokens=NEW_TOKENS, constraint=constraint, **sampled)
        constrained.append((schema, engine.submit(ask(schema), params)))
    free_params = SamplingParams(max_new_tokens=24)
    free = [engine.submit(prompt, free_params) for prompt in ("Name three rivers.", "What is 2 + 2?")]
    while engine.has_work():
        engine.step()
    assert_nothing_held(engine)
    for schema, request in constrained:
        final = request.events[-1]
        assert final.stats.finish_reason == "eos", (schema, final.text)
        jsonschema.validate(json.loads(final.text), schema)
    assert max(r.batch_size_sum / r.steps for _, r in constrained) > 4  # they really ran batched
    alone = make_engine(bundled, "paged")
    for prompt, request in zip(("Name three rivers.", "What is 2 + 2?"), free):
        assert request.events[-1].token_ids == alone.complete(prompt, free_params).token_ids


@pytest.mark.parametrize("spec", [SpecConfig("early-exit", k=3), SpecConfig("medusa", k=3, tree_width=3)],
                         ids=["early-exit", "medusa-tree"])
def test_constrained_greedy_is_the_same_with_speculation(bundled, spec):
    """Early exit drafts freely (its first layers know nothing of the grammar), so some drafts are cut by it; a
    Medusa tree loses the candidates the grammar forbids before the target sees them and shapes every node."""
    engine = make_engine(bundled, "paged")
    for schema, _ in SCHEMAS[1:2]:  # nested objects: 40 tokens
        params = SamplingParams(max_new_tokens=NEW_TOKENS, constraint=Constraint("json_schema", json.dumps(schema)))
        plain = engine.complete(ask(schema), params)
        speculative = engine.complete(ask(schema), params, spec=spec)
        assert speculative.token_ids == plain.token_ids
        assert speculative.stats.spec["drafted"] > 0
        jsonschema.validate(json.loads(speculative.text), schema)
    assert_nothing_held(engine)


def test_regex_and_choices_hold(bundled):
    engine = make_engine(bundled, "paged")
    date = engine.complete("When did the Apollo 11 landing happen?",
                           SamplingParams(max_new_tokens=20, constraint=Constraint("regex", r"\d{4}-\d{2}-\d{2}")))
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date.text) and date.stats.finish_reason == "eos"
    moods = ("positive", "negative", "neutral")
    for seed in range(3):
        mood = engine.complete("Is 'I love this film' positive or negative?",
                               SamplingParams(max_new_tokens=8, temperature=1.0, seed=seed,
                                              constraint=Constraint("choice", moods)))
        assert mood.text in moods


def test_a_bad_schema_is_refused_when_the_request_is_made(bundled):
    engine = make_engine(bundled, "paged")
    with pytest.raises(ConfigError, match="cannot be used"):
        engine.make_request("hi", SamplingParams(constraint=Constraint("json_schema",
                                                                       '{"type": "object", "uniqueItems": 3}')))
    assert_nothing_held(engine)
