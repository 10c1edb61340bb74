"""Draft-head training data: varied prompts that keep the benchmark set out, and the model's own answers generated
in batches equal to its answers one at a time."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import make_engine
from inference_core import SamplingParams
from inference_core.training import draft_data
from inference_core.training.draft_data import _four_grams, bench_four_grams, chat_prompts, generate, load, save


def test_prompts_are_many_distinct_seeded_and_held_out_from_the_benchmark():
    templates, varied, both = (chat_prompts(20000, prompt_set=name) for name in ("templates", "varied", "all"))
    assert len(templates) >= 1500 and len(varied) >= 6000 and set(both) == set(templates) | set(varied)
    assert len(set(both)) == len(both) and not set(templates) & set(varied)
    assert chat_prompts(50, seed=1) == chat_prompts(50, seed=1) != chat_prompts(50, seed=2)
    held_out = bench_four_grams()
    assert held_out and not any(_four_grams(prompt) & held_out for prompt in both)
    assert any(prompt.startswith("Summarize this passage") for prompt in templates)  # shipped public-domain text
    assert sum("Python" in prompt for prompt in templates) >= 100
    assert any(prompt.startswith("What does this Python code do?\n\ndef ") for prompt in templates)  # code to read
    # The varied set: each family of requests is there, and no opening is a large share of it.
    for opening in ("Explain ", "Why ", "How do I get started", "Compare ", "Write a short email", "Show me Rust",
                    "What is a closure in programming?", "A train travels"):
        assert any(prompt.startswith(opening) for prompt in varied), opening
    openings = Counter(" ".join(prompt.split()[:3]) for prompt in varied)
    assert openings.most_common(1)[0][1] < 0.06 * len(varied), openings.most_common(3)
    with pytest.raises(ValueError, match="prompt_set must be one of"):
        chat_prompts(5, prompt_set="some")


def test_batched_answers_equal_solo_answers(bundled, tmp_path, monkeypatch):
    # Short prompts, so that four requests of up to 64 tokens decode side by side (the engine's default KV pool, one
    # max_seq_len sequence, would hold two), in an order that is not the prompts' (generate queues the shortest first).
    lengths = {p: len(bundled.tokenizer.encode_chat([{"role": "user", "content": p}])) for p in chat_prompts(60, seed=3)}
    prompts = [p for p in lengths if lengths[p] <= 56][:6]
    assert [lengths[p] for p in prompts] != sorted(lengths[p] for p in prompts)
    running, step = [], draft_data.Engine.step
    monkeypatch.setattr(draft_data.Engine, "step", lambda engine: running.append(step(engine).num_running))
    seen = []
    samples = generate(bundled, prompts, max_new_tokens=8, batch_size=4, max_seq_len=128,
                       progress=lambda done, total: seen.append((done, total)))
    assert max(running) == 4
    assert [s["prompt"] for s in samples] == list(range(6)) and seen[-1] == (6, 6)
    assert {s["temperature"] for s in samples} == {0.0}
    engine = make_engine(bundled, max_seq_len=128)
    for sample, prompt in zip(samples, prompts):
        solo = engine.complete(prompt, SamplingParams(max_new_tokens=8))
        assert sample["ids"] == engine.prompt_ids(prompt) + solo.token_ids
        assert sample["prompt_tokens"] == len(engine.prompt_ids(prompt))
    save(tmp_path / "data.jsonl", samples)
    assert load(tmp_path / "data.jsonl") == samples


def test_sampled_answers_are_seeded(bundled):
    prompts = chat_prompts(2, seed=4)
    first = generate(bundled, prompts, max_new_tokens=12, temperature=0.7, seed=5, batch_size=2)
    assert first == generate(bundled, prompts, max_new_tokens=12, temperature=0.7, seed=5, batch_size=2)
    assert {s["temperature"] for s in first} == {0.7}
    assert first != generate(bundled, prompts, max_new_tokens=12, temperature=0.7, seed=6, batch_size=2)
