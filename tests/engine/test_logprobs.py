"""Log-probabilities against the outside oracle: for every generated token, its log-probability and the sorted top-5
values equal transformers' log-softmax on the same weights (the bundled SmolLM2-135M, fp32, CPU) within 0.02 nats,
on benchmark prompts, in plain, batched (continuous batching, three requests in one step) and speculative decoding
(early exit, prompt lookup, a tree); a rejected draft's reported log-probability is the target's at its position;
the prompt's log-probabilities (`prompt_logprobs`) equal transformers' too. Requests that do not ask get none."""

from __future__ import annotations

import pytest
import torch

from inference_core import SamplingParams
from inference_core.engine.request import FinishEvent, TokenEvent
from inference_core.model.checkpoint import resolve_model_dir
from inference_core.spec.decoding import SpecConfig

from conftest import bench_prompt_ids, make_engine

PROMPT_IDS = ("plain-1", "chat-short-3", "code-2", "grounded-1")  # the last one copies from its prompt
NEW_TOKENS = 12
TOP = 5
TOLERANCE = 0.02  # nats


@pytest.fixture(scope="module")
def prompts(bundled, bench_prompts) -> list[list[int]]:
    return bench_prompt_ids(bundled, bench_prompts, PROMPT_IDS)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(resolve_model_dir("bundled")), dtype=torch.float32).eval()


@torch.no_grad()
def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is log p(next | ids[:i + 1])."""
    return hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def tokens_of(events) -> list[TokenEvent]:
    return [e for e in events if isinstance(e, TokenEvent)]


def assert_match_oracle(hf_model, prompt_ids: list[int], events: list[TokenEvent]) -> None:
    generated = [e.token_id for e in events]
    expected = hf_logprobs(hf_model, prompt_ids + generated)[len(prompt_ids) - 1:-1]  # rows predicting each token
    for event, row in zip(events, expected):
        assert event.logprob == pytest.approx(float(row[event.token_id]), abs=TOLERANCE)
        ours = [lp for _, lp in event.top_logprobs]
        assert ours == pytest.approx(row.topk(TOP).values.tolist(), abs=TOLERANCE)
        assert ours == sorted(ours, reverse=True) and len(ours) == TOP
        assert event.entropy == pytest.approx(float(-(row.exp() * row).sum()), abs=TOLERANCE)
        # the chosen token is the argmax (greedy), so it leads the alternatives
        assert event.top_logprobs[0][0] == event.token_id


PARAMS = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
# Speculation needs a few more tokens for both an accepted and a rejected draft on one prompt.
SPEC_PARAMS = SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=TOP)


def test_plain_decoding_matches_transformers(bundled, prompts, hf_model):
    engine = make_engine(bundled, "paged")
    for ids in prompts[:1]:
        assert_match_oracle(hf_model, ids, tokens_of(engine.generate(ids, PARAMS)))


def test_batched_decoding_matches_transformers(bundled, prompts, hf_model):
    engine = make_engine(bundled, "paged", batching="continuous", max_num_seqs=4)
    requests = [engine.submit(ids, PARAMS) for ids in prompts[:3]]
    batch_sizes = set()
    while engine.has_work():
        engine.step()
    for ids, request in zip(prompts, requests):
        events = tokens_of(request.events)
        batch_sizes |= {e.batch_size for e in events}
        assert_match_oracle(hf_model, ids, events)
    assert 3 in batch_sizes  # the three decoded in one step


@pytest.mark.parametrize("spec, prompt", [(SpecConfig("early-exit", k=3), 0), (SpecConfig("ngram", k=4), 3),
                                          (SpecConfig("medusa", k=3, tree_width=2), 0)],
                         ids=["early-exit", "prompt-lookup", "tree"])
def test_speculative_decoding_matches_transformers(bundled, prompts, hf_model, spec, prompt):
    """Every emitted token matches the oracle and is its argmax: speculation kept greedy decoding's tokens."""
    engine = make_engine(bundled, "paged")
    ids = prompts[prompt]
    events = tokens_of(engine.generate(ids, SPEC_PARAMS, spec=spec))
    assert_match_oracle(hf_model, ids, events)
    kinds = {e.draft for e in events}
    assert {"accepted", "replaced"} <= kinds
    for event in events:
        if spec.tree_width == 1 and event.draft == "replaced":
            # the target's log-probability of each rejected draft it verified, at that draft's position
            before = ids + [e.token_id for e in events[:event.index]]
            rows = hf_logprobs(hf_model, before + list(event.rejected_ids))[len(before) - 1:]
            expected = [float(rows[i, token]) for i, token in enumerate(event.rejected_ids)]
            assert event.rejected_logprobs  # a chain verifies the first rejected draft at least
            assert list(event.rejected_logprobs) == pytest.approx(expected[:len(event.rejected_logprobs)],
                                                                  abs=TOLERANCE)


def test_penalised_greedy_is_the_same_with_a_tree(bundled, prompts):
    """A Medusa tree shapes every node as plain decoding would after the path down to it: penalised greedy ids and
    their processed log-probabilities equal plain decoding's."""
    engine = make_engine(bundled, "paged")
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.4,
                            presence_penalty=0.2, logit_bias={13: 1.5}, logprobs=2, logprobs_mode="processed")
    plain = tokens_of(engine.generate(prompts[0], params))
    tree = tokens_of(engine.generate(prompts[0], params, spec=SpecConfig("medusa", k=3, tree_width=2)))
    assert [e.token_id for e in tree] == [e.token_id for e in plain]
    assert [e.logprob for e in tree] == pytest.approx([e.logprob for e in plain], abs=1e-3)
    assert {"accepted", "replaced"} <= {e.draft for e in tree}


def test_prompt_logprobs_match_transformers(bundled, prompts, hf_model):
    ids = prompts[1]
    engine = make_engine(bundled, "paged")
    events = list(engine.generate(ids, SamplingParams(max_new_tokens=2, prompt_logprobs=3, logprobs=0)))
    first = events[0]
    assert len(first.prompt_logprobs) == len(ids) and first.prompt_logprobs[0] is None
    assert all(e.prompt_logprobs is None for e in events[1:] if isinstance(e, TokenEvent))
    expected = hf_logprobs(hf_model, ids)
    for position in range(1, len(ids)):
        entry = first.prompt_logprobs[position]
        assert entry.logprob == pytest.approx(float(expected[position - 1, ids[position]]), abs=TOLERANCE)
        assert [lp for _, lp in entry.top] == pytest.approx(expected[position - 1].topk(3).values.tolist(),
                                                            abs=TOLERANCE)
    assert first.top_logprobs == () and first.logprob is not None  # logprobs=0: the chosen token's only


def test_no_logprobs_unless_asked(bundled, prompts):
    engine = make_engine(bundled, "paged")
    events = list(engine.generate(prompts[0], SamplingParams(max_new_tokens=4)))
    assert all(e.logprob is None and e.top_logprobs == () and e.entropy is None and e.prompt_logprobs is None
               for e in tokens_of(events))
    assert isinstance(events[-1], FinishEvent)


def test_processed_logprobs_are_those_of_the_distribution_sampled(bundled, prompts):
    """With logprobs_mode="processed" a biased token's log-probability includes the bias; top-k 2 at temperature 1
    leaves exactly two tokens, whose probabilities sum to 1."""
    engine = make_engine(bundled, "paged")
    ids = prompts[0]
    raw = tokens_of(engine.generate(ids, SamplingParams(max_new_tokens=1, logprobs=2)))[0]
    runner_up = raw.top_logprobs[1][0]
    biased = tokens_of(engine.generate(ids, SamplingParams(max_new_tokens=1, logprobs=2, logprobs_mode="processed",
                                                           logit_bias={runner_up: 100})))[0]
    assert biased.token_id == runner_up and biased.logprob == pytest.approx(0.0, abs=1e-4)
    sampled = tokens_of(engine.generate(ids, SamplingParams(max_new_tokens=1, logprobs=3, logprobs_mode="processed",
                                                            temperature=1.0, top_k=2, seed=0)))[0]
    probs = [torch.tensor(lp).exp().item() for _, lp in sampled.top_logprobs[:2]]
    assert sum(probs) == pytest.approx(1.0, abs=1e-4)
    assert sampled.top_logprobs[2][1] == -9999.0  # masked out by top-k: reported at the floor, a JSON number
