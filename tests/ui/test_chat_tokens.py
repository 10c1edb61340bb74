"""The chat's answers beyond the chat log, through its handlers without a browser: the latest answer token by token
with a tooltip per token (probability, entropy, top alternatives), its colour modes, and `n` answers per turn (the
first kept, the others beside it, the prompt's KV blocks shared by all of them while they run, every block back at
the end; greedy decoding refused)."""

from __future__ import annotations

import html
import math
import re

from ui.chat import CHAT_OUTPUTS, chat_turn, clear_chat
from ui.chat_answers import TOKENS_EMPTY, ChatMemory, recolour_chat
from ui.control import RunControl

from conftest import lane

TIP = re.compile(r'<span class="tok tok-plain" tabindex="0" data-i="(\d+)" data-p="([^"]+)"[^>]*>(.*?)'
                 r'<span class="tok-tip">(.*?)</span></span>', re.S)


def _last(updates) -> dict:
    for values in updates:
        out = dict(zip(CHAT_OUTPUTS, values))
    return out


def _tips(page: str) -> list[tuple[int, float, list[str]]]:
    """Each token span of a panel: its index, its probability and its tooltip's lines."""
    return [(int(index), float(p), html.unescape(tip).split("<br>")) for index, p, _, tip in TIP.findall(page)]


def test_a_greedy_answer_shows_each_token_with_its_top_alternatives(pool):
    memory = ChatMemory()
    out = _last(chat_turn(pool, RunControl(), "Name a fruit.", [], [], "", 8, *lane("paged"), memory=memory))
    stats = out["turn_stats"][0]
    tips = _tips(out["tokens"])
    assert [index for index, _, _ in tips] == list(range(stats["generated_tokens"])) == list(range(8))
    for _, probability, lines in tips:
        head, *alternatives = lines
        assert re.fullmatch(rf"<b>.+</b>  p {probability:.3f}  entropy \d+\.\d\d nats", head), head
        ranks = [re.fullmatch(r"(\d)\. (.+?)\s+(\S+)", line) for line in alternatives]  # a name is its repr
        assert [match[1] for match in ranks] == ["1", "2", "3", "4", "5"], alternatives
        # Greedy: the token is the model's first choice, with the probability its head shows.
        assert ranks[0][2] == re.match(r"<b>(.+)</b>", head)[1]
        assert math.isclose(float(ranks[0][3]), probability, abs_tol=1e-3)
    assert out["other_answers"] == "" and out["history"][-1]["content"] == "".join(memory.answers[0].marks[i].text
                                                                                   for i in range(8))
    # Probability mode by default (the legend's scale); entropy redraws the same tokens and tooltips.
    assert "probability: unlikely" in out["tokens"]
    entropy, others = recolour_chat(memory, "entropy")
    assert "entropy: sure" in entropy and others == "" and len(_tips(entropy)) == 8
    assert clear_chat(memory)[5] == TOKENS_EMPTY and memory.answers is None
    assert pool.active_requests() == 0


def test_two_answers_share_the_prompt_blocks_then_return_every_block(pool):
    memory = ChatMemory()
    sampled = lane("paged", temperature=1.0, seed=3)
    out = _last(chat_turn(pool, RunControl(), "Tell me about the sea.", [], [], "", 12, *sampled, answers=2,
                          memory=memory))
    first, second = ("".join(mark.text for mark in trail.marks) for trail in memory.answers)
    assert first != second  # seeds 3 and 4
    assert [m["role"] for m in out["history"]] == ["user", "assistant"] and out["history"][1]["content"] == first
    # The second answer beside the first, each of its tokens with a tooltip.
    assert "Other answers (1)" in out["other_answers"] and 'data-answer="2"' in out["other_answers"]
    assert len(_tips(out["other_answers"])) == len(memory.answers[1].marks)
    # The KV view at the first finisher's last token: the prompt's full blocks held by both answers at once.
    prompt_blocks = out["turn_stats"][0]["prompt_tokens"] // 16
    assert prompt_blocks > 0
    assert out["kv_view"].count(">x2</div>") == prompt_blocks
    assert out["kv_view"].count("held by answer 1, answer 2; shared by 2 requests") == prompt_blocks
    assert f"Both answers held the prompt's {prompt_blocks} full KV blocks at once" in out["status"]
    assert "returned their blocks" in out["kv_view"]
    assert pool.active_requests() == 0 and pool.blocks_in_use() == 0


def test_several_greedy_answers_are_refused_before_anything_runs(pool):
    updates = list(chat_turn(pool, RunControl(), "Hi", [], [], "", 8, *lane("paged"), answers=2))
    assert len(updates) == 1
    status = dict(zip(CHAT_OUTPUTS, updates[0]))["status"]
    assert status.startswith("**Cannot send:** 'answers per turn (n)' is 2 but 'temperature (0 = greedy)' is 0 "
                             "(greedy decoding): all 2 answers would be the same tokens."), status
    too_many = dict(zip(CHAT_OUTPUTS, list(chat_turn(pool, None, "Hi", [], [], "", 8,
                                                     *lane("paged", temperature=0.7), answers=5))[0]))
    assert too_many["status"] == "**Cannot send:** 'answers per turn (n)' must be 1 to 4, got 5."
    assert pool.active_requests() == 0
