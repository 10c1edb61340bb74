"""`inference_core.structured` on the bundled model's tokenizer, without a forward pass: valid outputs of 24 JSON
schemas, a regex and a list of choices are accepted token by token (each token allowed by the mask first), end with
eos and terminate; a forbidden token is refused and leaves the state as it was; rollback restores the mask; a batch
mask leaves unconstrained rows alone and forbids padded ids; bad constraints fail with a message naming the
problem."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from inference_core.config import ConfigError
from inference_core.structured import CACHE_SIZE, Constraint, Grammars, mask_logits_

ISO_DATE = Constraint("regex", r"\d{4}-\d{2}-\d{2}")
MOODS = Constraint("choice", ["positive", "negative", "neutral", "mixed"])
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ADDRESS = {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
           "required": ["city"]}
# (schema, a valid instance): nesting, arrays, enums, const, ranges, unions, $ref, patterns, lengths, tuples, maps.
SCHEMAS = [
    (PERSON, {"name": "Ada", "age": 36}),
    ({"type": "object", "properties": {"person": PERSON, "address": ADDRESS}, "required": ["person", "address"]},
     {"person": {"name": "Grace Hopper", "age": 85}, "address": {"city": "Arlington", "zip": "22202"}}),
    ({"type": "array", "items": PERSON, "minItems": 1}, [{"name": "a", "age": 1}, {"name": "b", "age": 2}]),
    ({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
     {"color": "green"}),
    ({"type": "array", "items": {"enum": ["low", "mid", "high"]}, "maxItems": 4}, ["high", "low", "low"]),
    ({"type": "object", "properties": {"version": {"const": 2}, "ok": {"type": "boolean"}},
      "required": ["version", "ok"]}, {"version": 2, "ok": False}),
    ({"type": "integer", "minimum": 10, "maximum": 99}, 42),
    ({"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
      "required": ["score"]}, {"score": 0.25}),
    ({"type": "object", "properties": {"note": {"type": ["string", "null"]}}, "required": ["note"]}, {"note": None}),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "forty-two"),
    ({"oneOf": [{"type": "boolean"}, {"type": "array", "items": {"type": "integer"}}]}, [3, 1, 4, 1, 5]),
    ({"$defs": {"node": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
      "type": "object", "properties": {"root": {"$ref": "#/$defs/node"},
                                       "leaves": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 4}},
      "required": ["root", "leaves"]}, {"root": {"id": 1}, "leaves": [{"id": 2}, {"id": 3}]}),
    ({"type": "object", "properties": {"date": {"type": "string", "pattern": "^\\d{4}-\\d{2}-\\d{2}$"}},
      "required": ["date"]}, {"date": "2024-05-17"}),
    ({"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-\\d{4}$"}},
      "required": ["sku"]}, {"sku": "ABC-1234"}),
    ({"type": "string", "minLength": 3, "maxLength": 8}, "abcde"),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}, {"type": "boolean"}],
      "items": False}, [7, "seven", True]),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, {"apples": 3, "pears": 0}),
    ({"type": "object", "properties": {"id": {"type": "integer"}, "title": {"type": "string"},
                                       "done": {"type": "boolean"}}, "required": ["id"]}, {"id": 7}),
    ({"type": "object", "properties": {"matrix": {"type": "array", "items": {"type": "array",
                                                                                "items": {"type": "number"}}}},
      "required": ["matrix"]}, {"matrix": [[1, 0.5], [-2, 3e-3]]}),
    ({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
     {"text": "quote \" backslash \\ newline \n tab \t café 日本"}),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
      "required": ["tags"]}, {"tags": []}),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"a": {"minimum": 5}}}]}, {"a": 6}),
    ({"type": "string", "format": "date"}, "2024-02-29"),
    ({"type": "object", "properties": {"x-meta": {"type": "object", "properties": {"depth": {"type": "object",
      "properties": {"level": {"type": "integer"}}, "required": ["level"]}}, "required": ["depth"]}},
      "required": ["x-meta"]}, {"x-meta": {"depth": {"level": 3}}}),
]


@pytest.fixture(scope="module")
def grammars(bundled):
    return Grammars(bundled.tokenizer, bundled.config.vocab_size, bundled.eos_token_ids)


@pytest.fixture(scope="module")
def eos(bundled):
    return min(bundled.eos_token_ids)


def encode(bundled, text: str) -> list[int]:
    return bundled.tokenizer.encode(text, add_special_tokens=False)


def walk(state, ids: list[int]) -> None:
    """Accept `ids` one by one, each first checked to be allowed by the mask."""
    for position, token_id in enumerate(ids):
        assert state.allowed_ids()[token_id], f"token {position} ({token_id}) is not allowed by the mask"
        assert state.accept(token_id), f"token {position} ({token_id}) was refused"


def test_the_corpus_has_twenty_valid_schemas():
    assert len(SCHEMAS) >= 20


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
@pytest.mark.parametrize("separators", [(", ", ": "), (",", ":")], ids=["spaced", "compact"])
def test_a_valid_instance_walks_to_eos(bundled, grammars, eos, index, separators):
    schema, instance = SCHEMAS[index]
    state = grammars.matcher(Constraint("json_schema", json.dumps(schema)))
    ids = encode(bundled, json.dumps(instance, separators=separators, ensure_ascii=False))
    walk(state, ids[:-1])
    if json.dumps(instance)[-1] in "}]":  # an object or array cannot end before its closing bracket
        assert not state.allowed_ids()[eos]
        assert not state.accept(eos)
    walk(state, ids[-1:])
    assert not state.is_terminated()
    assert state.allowed_ids()[eos]
    assert state.accept(eos)
    assert state.is_terminated()
    assert not state.accept(ids[0])  # nothing after the end
    assert state.allowed_ids().nonzero().flatten().tolist() == [eos]


def test_an_indented_instance_is_accepted(bundled, grammars, eos):
    schema, instance = SCHEMAS[1]
    state = grammars.matcher(Constraint("json_schema", json.dumps(schema)))
    walk(state, encode(bundled, json.dumps(instance, indent=2)) + [eos])
    assert state.is_terminated()


def test_a_forbidden_token_is_refused_and_changes_nothing(bundled, grammars):
    state = grammars.matcher(Constraint("json_schema", json.dumps(PERSON)))
    walk(state, encode(bundled, '{"name": "Ada", "age": '))
    before = state.allowed_ids()
    for text in ('"', "true", "x"):  # age is an integer
        (token_id,) = encode(bundled, text)
        assert not before[token_id]
        assert not state.accept(token_id)
        assert torch.equal(state.allowed_ids(), before)
    assert not state.accept(bundled.config.vocab_size) and not state.accept(-1)  # not token ids at all
    assert torch.equal(state.allowed_ids(), before)
    walk(state, encode(bundled, "36}"))
    assert state.allowed_ids().sum() == 1  # only eos now


def test_special_tokens_are_never_allowed_inside_a_string(bundled, grammars):
    state = grammars.matcher(Constraint("json_schema", json.dumps(PERSON)))
    walk(state, encode(bundled, '{"name": "A'))
    allowed = state.allowed_ids()
    assert allowed.sum() > 40_000  # almost any text continues a string
    im_start = bundled.tokenizer.vocabulary()["<|im_start|>"]
    assert not allowed[:17].any() and not state.accept(im_start)  # ids 0-16: SmolLM2's special tokens


@pytest.mark.parametrize("num_tokens", [1, 5, 16, 20])
def test_rollback_restores_the_mask(bundled, grammars, eos, num_tokens):
    schema, instance = SCHEMAS[1]
    state = grammars.matcher(Constraint("json_schema", json.dumps(schema)))
    ids = encode(bundled, json.dumps(instance)) + [eos]
    assert len(ids) > num_tokens
    masks = []
    for token_id in ids:
        masks.append(state.allowed_ids())
        assert state.accept(token_id)
    assert state.is_terminated()
    state.rollback(num_tokens)  # over eos too
    assert not state.is_terminated()
    assert torch.equal(state.allowed_ids(), masks[len(ids) - num_tokens])
    walk(state, ids[len(ids) - num_tokens:])
    assert state.is_terminated()


def test_rollback_past_the_start_is_an_error_and_changes_nothing(bundled, grammars):
    state = grammars.matcher(ISO_DATE)
    ids = encode(bundled, "2024-05-17")
    assert len(ids) == 10  # a token a character
    walk(state, ids[:2])
    before = state.allowed_ids()
    with pytest.raises(ValueError, match="cannot roll back 3 tokens: 2 were accepted"):
        state.rollback(3)
    assert torch.equal(state.allowed_ids(), before)
    walk(state, ids[2:])


def test_states_of_one_constraint_are_independent(bundled, grammars):
    first, second = grammars.matcher(MOODS), grammars.matcher(MOODS)
    start = second.allowed_ids()
    walk(first, encode(bundled, "positive"))
    assert torch.equal(second.allowed_ids(), start)
    assert not torch.equal(first.allowed_ids(), start)


def test_mask_logits_masks_constrained_rows_and_leaves_none_rows(bundled, grammars):
    vocab = bundled.config.vocab_size
    states = [grammars.matcher(ISO_DATE), None, grammars.matcher(Constraint("json_object"))]
    walk(states[2], encode(bundled, '{"a": '))
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    original = logits.clone()
    mask_logits_(logits, states)
    assert torch.equal(logits[1], original[1])
    for row in (0, 2):
        allowed = states[row].allowed_ids()
        assert 0 < allowed.sum() < vocab
        assert torch.equal(torch.isfinite(logits[row]), allowed)
        assert torch.equal(logits[row][allowed], original[row][allowed])


@pytest.mark.parametrize("dtype, device", [
    (torch.bfloat16, "cpu"),
    pytest.param(torch.float32, "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
])
def test_the_torch_path_masks_like_the_numpy_path(bundled, grammars, dtype, device):
    states = [grammars.matcher(Constraint("json_object")), None, grammars.matcher(MOODS)]
    walk(states[0], encode(bundled, '{"key": '))
    logits = torch.randn(3, bundled.config.vocab_size, generator=torch.Generator().manual_seed(1))
    other = logits.to(device=device, dtype=dtype)
    mask_logits_(logits, states)  # fp32 on the CPU: the numpy path
    mask_logits_(other, states)
    assert torch.equal(torch.isfinite(other).cpu(), torch.isfinite(logits))
    assert torch.isinf(logits[0]).sum() > 40_000 and torch.isfinite(logits[1]).all()


def test_mask_logits_without_constrained_rows_changes_nothing(bundled):
    logits = torch.randn(2, bundled.config.vocab_size)
    original = logits.clone()
    mask_logits_(logits, [None, None])
    assert torch.equal(logits, original)


def test_padded_logits_ids_are_never_allowed(bundled, eos):
    real = bundled.config.vocab_size
    padded = Grammars(bundled.tokenizer, real + 64, bundled.eos_token_ids)
    state = padded.matcher(Constraint("json_schema", json.dumps(PERSON)))
    walk(state, encode(bundled, '{"name": "A'))
    allowed = state.allowed_ids()
    assert allowed.shape == (real + 64,)
    assert allowed[:real].sum() > 40_000 and not allowed[real:].any()
    assert not state.accept(real + 3)
    logits = torch.zeros(1, real + 64)
    mask_logits_(logits, [state])
    assert torch.isinf(logits[0, real:]).all() and torch.isfinite(logits[0, :real]).sum() == allowed.sum()


def test_logits_narrower_than_the_vocabulary_are_refused(bundled):
    with pytest.raises(ConfigError, match="cannot use this tokenizer: vocab size too small; 49000 vs 49152"):
        Grammars(bundled.tokenizer, 49_000, bundled.eos_token_ids)


def test_regex_accepts_a_match_and_ends_only_after_it(bundled, grammars, eos):
    state = grammars.matcher(ISO_DATE)
    assert not state.accept(encode(bundled, "x")[0])
    walk(state, encode(bundled, "2024-05"))
    assert not state.allowed_ids()[eos]
    walk(state, encode(bundled, "-17"))
    assert state.allowed_ids().nonzero().flatten().tolist() == [eos]
    assert state.accept(torch.tensor(eos)) and state.is_terminated()  # a sampled id may come as a 0-d tensor


def test_choice_allows_only_prefixes_of_the_choices(bundled, grammars, eos):
    state = grammars.matcher(MOODS)
    first = state.allowed_ids().nonzero().flatten().tolist()
    texts = [bundled.tokenizer.decode([token_id]) for token_id in first]
    assert eos not in first and texts
    assert all(any(choice.startswith(text) for choice in MOODS.spec) for text in texts), texts
    walk(state, encode(bundled, "neutral") + [eos])
    assert state.is_terminated()


def test_a_choice_that_prefixes_another_may_end_or_go_on(bundled, grammars, eos):
    state = grammars.matcher(Constraint("choice", ("New York", "New York City")))
    walk(state, encode(bundled, "New York"))
    allowed = state.allowed_ids()
    assert allowed[eos] and allowed[encode(bundled, " City")[0]]


def test_json_object_takes_any_object_but_not_an_array(bundled, grammars, eos):
    state = grammars.matcher(Constraint("json_object"))
    assert not state.accept(encode(bundled, "[")[0])
    walk(state, encode(bundled, json.dumps({"any": [1, {"x": None}], "b": "c"})) + [eos])
    assert state.is_terminated()


@pytest.mark.parametrize("constraint, problem", [
    (Constraint("regex", "[0-9"), "unclosed character class"),
    (Constraint("json_schema", '{"type": "colour"}'), "Invalid type: colour"),
    (Constraint("json_schema", '{"$ref": "#/$defs/missing"}'), "/$defs/missing"),
    (Constraint("json_schema", '{"type": "string", "pattern": "(ab"}'), "unclosed group"),
    (Constraint("json_schema", '{"type": "array", "uniqueItems": true}'), 'Unimplemented keys: ["uniqueItems"]'),
])
def test_a_bad_grammar_names_the_problem(grammars, constraint, problem):
    with pytest.raises(ConfigError, match="cannot be used") as error:
        grammars.matcher(constraint)
    assert problem in str(error.value)
    assert "change the" in str(error.value)


def test_braces_in_a_bad_regex_are_quoted_as_written(grammars):
    with pytest.raises(ConfigError) as error:
        grammars.matcher(Constraint("regex", r"\d{4}-[0-9"))
    assert str(error.value).startswith(r"the regex \d{4}-[0-9 cannot be used")
    assert error.value.in_words({"4": "a setting"}) == str(error.value)  # no {name} of a setting in there


def test_the_cache_keeps_the_most_recently_used_constraints(bundled):
    fresh = Grammars(bundled.tokenizer, bundled.config.vocab_size, bundled.eos_token_ids)
    first, second = Constraint("choice", ["c0"]), Constraint("choice", ["c1"])
    fresh.matcher(first)
    fresh.matcher(second)
    for number in range(2, CACHE_SIZE + 1):  # 63 more; `first` is used again halfway, so `second` is the oldest
        fresh.matcher(Constraint("choice", [f"c{number}"]))
        if number == CACHE_SIZE // 2:
            fresh.matcher(first)
    assert len(fresh) == CACHE_SIZE
    assert first in fresh and second not in fresh
    assert Constraint("choice", [f"c{CACHE_SIZE}"]) in fresh


@pytest.mark.parametrize("kind, spec, message", [
    ("yaml", None, "unknown constraint kind 'yaml'; use one of: json_object, json_schema, regex, choice."),
    ("json_object", "{}", "a json_object constraint takes no spec"),
    ("json_schema", {"type": "object"}, "needs the schema as JSON text, not dict; pass json.dumps(schema)."),
    ("json_schema", "{'type': 'object'}", "the JSON schema is not valid JSON"),
    ("json_schema", "[1, 2]", "a JSON schema must be a JSON object, not list"),
    ("regex", "", "a regex constraint needs the pattern as a non-empty string"),
    ("choice", "yes", "a choice constraint needs a list of strings, not str"),
    ("choice", [], "needs 1 to 64 choices, not 0"),
    ("choice", [str(n) for n in range(65)], "needs 1 to 64 choices, not 65"),
    ("choice", ["yes", ""], "every choice must be a non-empty string; change ''."),
    ("choice", ["yes", 1], "every choice must be a non-empty string; change 1."),
])
def test_constraint_validation_says_what_to_change(kind, spec, message):
    with pytest.raises(ConfigError) as error:
        Constraint(kind, spec)
    assert message in str(error.value)


def test_constraint_normalises_choices_and_labels_itself():
    assert MOODS.spec == ("positive", "negative", "neutral", "mixed")
    assert MOODS == Constraint("choice", ("positive", "negative", "neutral", "mixed"))
    assert hash(MOODS) == hash(Constraint("choice", ["positive", "negative", "neutral", "mixed"]))
    assert MOODS.label == "one of 4 choices"
    assert Constraint("choice", ["only"]).label == "one of 1 choice"
    assert Constraint("json_object").label == "JSON object"
    assert Constraint("json_schema", "{}").label == "JSON schema"
    assert ISO_DATE.label == r"regex \d{4}-\d{2}-\d{2}"
    assert Constraint("regex", r"^[a-z]+@[a-z]+\.(com|org|net)$").label == r"regex ^[a-z]+@[a-z]+\.(com|or…"


def test_a_missing_library_says_how_to_install_it(bundled, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance now raises ImportError
    with pytest.raises(ConfigError, match=r"structured outputs need llguidance: pip install llguidance==1\.9\.1"):
        Grammars(bundled.tokenizer, bundled.config.vocab_size, bundled.eos_token_ids)
