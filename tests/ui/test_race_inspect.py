"""What the race shows of the model's distribution, without a browser: every token of a finished lane carries a
tooltip with the probability and the alternatives the engine measured for it (and a speculating lane's rejected drafts
the target's probability of each), the colour modes redraw the finished lanes from the visitor's `RaceMemory`, and the
logit lens returns a row per layer whose last row is the model's own distribution and whose early-exit layer's top
choice is the draft the engine's early exit proposed there."""

from __future__ import annotations

import html
import math
import re

import pytest

from inference_core import Engine, EngineConfig, SamplingParams, TokenEvent
from inference_core.spec.decoding import SpecConfig
from ui.race import run_race
from ui.race_inspect import lens_choices, lens_rows, lens_sentence, recolour, run_lens
from ui.race_panels import RaceMemory
from ui.token_view import TokenTrail

from conftest import by_lane, lane, race_outputs

PROMPT = "What is the capital of France?"
NEW_TOKENS = 12
EARLY_EXIT_LAYERS = 8
TOKEN = re.compile(r'<span class="tok tok-(\w+)(?: tok-end)?"(?: data-kind="\w+")? tabindex="0" data-i="(\d+)"'
                   r'(?: data-p="([^"]+)")?(?: style="([^"]*)")?>(.*?)<span class="tok-tip">(.*?)</span></span>',
                   re.DOTALL)
REJECTED = re.compile(r'<s class="tok tok-rejected" data-kind="rejected" tabindex="0"[^>]*>[^<]*'
                      r'<span class="tok-tip">(.*?)</span></s>', re.DOTALL)


def _tip_lines(tip: str) -> list[str]:
    return [html.unescape(re.sub(r"<[^>]+>", "", line)) for line in tip.split("<br>")]


def _tokens(lane_html: str) -> list[dict]:
    """Each token of a finished lane's text: its index, data-p, style, text and tooltip lines."""
    return [{"kind": kind, "index": int(index), "p": float(p) if p else None, "style": style or "",
             "text": html.unescape(text), "tip": _tip_lines(tip)}
            for kind, index, p, style, text, tip in TOKEN.findall(lane_html)]


def _alternatives(lines: list[str]) -> list[tuple[str, float]]:
    """A tooltip's top alternatives: "1. ' Paris'   0.951" -> (" Paris" quoted as shown, 0.951)."""
    found = [re.fullmatch(r"\d+\. ('.*?'|\".*?\")\s+(\S+)", line) for line in lines]
    return [(match[1], float(match[2])) for match in found if match]


def _reference_events(pool, prompt_ids: list[int], spec: SpecConfig) -> list[TokenEvent]:
    """The same request on a fresh engine: its token events with log-probabilities (greedy: the same tokens)."""
    engine = Engine(pool.loaded, EngineConfig(kv_mode="paged", max_seq_len=512))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, logprobs=5)
    return [event for event in engine.generate(prompt_ids, params, spec=engine.resolve_spec(spec))
            if isinstance(event, TokenEvent)]


@pytest.fixture(scope="module")
def finished_race(pool):
    """A short race, lane A drafting with early exit at layer 8 (most drafts rejected on this model), lane B plain."""
    memory = RaceMemory()
    updates = list(run_race(pool, None, PROMPT, "", NEW_TOKENS,
                            *lane("paged", spec_method="early-exit", spec_k=3, draft_layers=EARLY_EXIT_LAYERS),
                            *lane("paged"), memory=memory))
    return memory, race_outputs(updates[-1])


def test_every_token_of_a_finished_lane_has_its_probability_and_alternatives(pool, finished_race):
    memory, last = finished_race
    assert [trace.name for trace in memory.traces] == ["A", "B"]  # the Run handler kept the finished traces
    decode = pool.loaded.tokenizer.decode
    rejected_tips = 0
    for trace, spec in zip(memory.traces, (SpecConfig("early-exit", k=3, draft_layers=EARLY_EXIT_LAYERS),
                                           SpecConfig())):
        events = _reference_events(pool, trace.request.seq.token_ids[:trace.prompt_tokens], spec)
        tokens = _tokens(last[f"lane_{trace.name.lower()}"])
        assert [token["index"] for token in tokens] == list(range(len(events))) and len(events) >= 6
        for token, event in zip(tokens, events):
            assert token["p"] == pytest.approx(math.exp(event.logprob), abs=1e-5)
            assert token["tip"][0].startswith(f"{decode([event.token_id], skip_special_tokens=False)!r}  p ")
            shown = _alternatives(token["tip"])
            assert [name for name, _ in shown] == [repr(decode([i], skip_special_tokens=False))
                                                   for i, _ in event.top_logprobs]
            assert [p for _, p in shown] == pytest.approx([math.exp(v) for _, v in event.top_logprobs], abs=1e-3)
        # A rejected draft's tooltip gives the target's probability of each draft it verified.
        replaced = [event for event in events if event.rejected_ids]
        tips = [_tip_lines(tip)[1:] for tip in REJECTED.findall(last[f"lane_{trace.name.lower()}"])]
        assert len(tips) == len(replaced)
        for lines, event in zip(tips, replaced):
            assert len(lines) == len(event.rejected_ids)
            for index, line in enumerate(lines):
                if index < len(event.rejected_logprobs):
                    assert float(line.split()[-1]) == pytest.approx(math.exp(event.rejected_logprobs[index]),
                                                                    abs=1e-3, rel=0.05)
                else:
                    assert line.endswith("not verified by the target")
            rejected_tips += 1
    assert rejected_tips >= 1  # early exit at layer 8 gets drafts rejected on this prompt


def test_colour_modes_redraw_the_finished_lanes(finished_race):
    memory, last = finished_race
    tokens = {mode: _tokens(recolour(memory, mode)[1]) for mode in ("probability", "entropy", "draft")}
    assert memory.mode == "draft" and recolour(memory, "draft")[1] == last["lane_b"]  # the race drew it so
    for token in tokens["probability"]:  # red as unlikely, in 20 steps of 0.04 alpha
        alpha = round((1 - token["p"]) * 20) / 20 * 0.8
        assert token["style"] == (f"background:rgba(239,68,68,{alpha:.2f})" if alpha else "")
    assert any(token["style"] for token in tokens["probability"]) and any(token["style"] for token in tokens["entropy"])
    assert all(token["style"] == "" for token in tokens["draft"])  # a plain lane has no draft kinds
    assert [t["text"] for t in tokens["probability"]] == [t["text"] for t in tokens["draft"]]  # the same text


def test_logit_lens_rows_end_at_the_models_own_distribution(pool, finished_race):
    memory, _ = finished_race
    layers = pool.loaded.config.num_layers
    choices = lens_choices(memory, "B")
    assert [index for _, index in choices["choices"]] == list(range(len(memory.traces[1].token_ids)))
    assert choices["value"] == 0
    events = {trace.name: trace.tokens.marks for trace in memory.traces}
    for lane_name, index in (("B", 1), ("A", 5)):
        sentence, figure, table = run_lens(memory, lane_name, index)
        assert list(table["layer"]) == list(range(1, layers + 1))
        assert table["token p"].iloc[-1] == pytest.approx(math.exp(events[lane_name][index].logprob), abs=1e-3)
        assert list(figure.data[0].y) == pytest.approx(list(table["token p"]), abs=1e-4)
        marked = EARLY_EXIT_LAYERS if lane_name == "A" else layers // 2
        early = table.iloc[marked - 1]
        assert f"at layer {marked} gives it probability {early['token p']:.3f}" in sentence
        assert ("this lane's early-exit draft" in sentence) == (lane_name == "A")
    # The lens agrees with the engine's own early exit: at layer 8 every draft lane A's target rejected was the
    # layer's top choice, and the token that replaced it was not.
    early_exit = memory.traces[0]
    replaced = [(index, mark) for index, mark in enumerate(early_exit.tokens.marks) if mark.kind == "replaced"]
    assert replaced
    for index, mark in replaced:
        row = lens_rows(early_exit, index)[EARLY_EXIT_LAYERS - 1]
        assert row["top"][0][0] == mark.rejected_ids[0] and row["token_rank"] > 0
    assert pool.active_requests() == 0 and pool.blocks_in_use() == 0


def test_logit_lens_says_what_to_do_without_a_race():
    sentence, _, _ = run_lens(RaceMemory(), "A", 0)
    assert sentence.startswith("Run a race first")
    assert lens_choices(RaceMemory(), "A")["label"] == "token (run a race first)"


def _rows(ranks: list[int]) -> list[dict]:
    return [{"layer": layer, "token_prob": 0.9 if rank == 0 else 0.05, "token_rank": rank}
            for layer, rank in enumerate(ranks, 1)]


def test_lens_sentence_names_where_the_token_forms_and_what_early_exit_gives_it():
    assert lens_sentence(_rows([5, 0, 2, 0, 0, 0]), "' Paris'", 3, False) == (
        "' Paris' becomes the top choice at layer 2 of 6 and stays there from layer 4; an early-exit draft (the "
        "engine's default depth) at layer 3 gives it probability 0.050 (rank 3).")
    assert lens_sentence(_rows([3, 0, 0, 1]), "'x'", 2, True) == (
        "'x' is not the model's top choice even after the last layer (probability 0.050, rank 2): the lane sampled "
        "it; this lane's early-exit draft at layer 2 gives it probability 0.900 (rank 1, its top choice).")


def test_tooltips_escape_text_and_say_when_the_target_did_not_verify_a_draft():
    trail = TokenTrail(lambda ids: "".join({1: "<a>", 2: "&", 3: "x", 4: "y"}[i] for i in ids), speculates=True)
    trail.add(TokenEvent(1, "<a>", 0, 0.0, 0.0, logprob=math.log(0.5), top_logprobs=((1, math.log(0.5)),),
                         entropy=1.0))
    trail.add(TokenEvent(2, "&", 1, 0.0, 0.0, "replaced", (3, 4), logprob=math.log(0.25),
                         top_logprobs=((2, math.log(0.25)),), entropy=2.0, rejected_logprobs=(math.log(0.125),)))
    assert trail.html("probability", tips=True) == (
        '<span class="tok tok-plain" data-kind="plain" tabindex="0" data-i="0" data-p="0.5" '
        'style="background:rgba(239,68,68,0.40)">&lt;a&gt;<span class="tok-tip"><b>&#x27;&lt;a&gt;&#x27;</b>  p 0.500'
        '  entropy 1.00 nats<br>plain decode step (nothing drafted)<br>1. &#x27;&lt;a&gt;&#x27;          0.500</span>'
        '</span>'
        '<s class="tok tok-rejected" data-kind="rejected" tabindex="0" style="background:#fee2e2;color:#b91c1c">xy'
        '<span class="tok-tip">rejected draft tokens (proposed here): the target&#x27;s probability of each<br>'
        '&#x27;x&#x27;            0.125<br>&#x27;y&#x27;            not verified by the target</span></s>'
        '<span class="tok tok-replaced" data-kind="replaced" tabindex="0" data-i="1" data-p="0.25" '
        'style="background:rgba(239,68,68,0.60)">&amp;<span class="tok-tip"><b>&#x27;&amp;&#x27;</b>  p 0.250  '
        "entropy 2.00 nats<br>target&#x27;s token where it rejected a draft<br>1. &#x27;&amp;&#x27;            "
        "0.250</span></span>")
    # While streaming: one span per run of one shade, no tooltips; the entropy mode shades amber.
    assert trail.html("entropy", tips=False) == (
        '<span class="tok" style="background:rgba(245,158,11,0.28)">&lt;a&gt;</span>'
        '<s class="tok tok-rejected" data-kind="rejected" title="rejected draft tokens (proposed here)" '
        'style="background:#fee2e2;color:#b91c1c;border-radius:2px;text-decoration:line-through;opacity:.8">xy</s>'
        '<span class="tok" style="background:rgba(245,158,11,0.52)">&amp;</span>')


def test_a_constrained_lane_reports_what_its_grammar_cost(pool):
    """Constrained against unconstrained: the constrained lane's text is one of its choices, and the summary gets a
    row with its grammar's time per token, from the engine's own count (GenerationStats.grammar_ms)."""
    memory = RaceMemory()
    updates = list(run_race(pool, None, "Is Paris in France? Answer yes or no.", "", 6,
                            *lane("paged", constraint="choice", constraint_spec="yes|no"), *lane("paged"),
                            memory=memory))
    last = race_outputs(updates[-1])
    cells = by_lane(last["summary"])["constraint mask"].tolist()
    assert re.fullmatch(r"\d+\.\d{3} ms per token \(\d+\.\d% of device time\)", cells[0]), cells
    assert cells[1] == "not constrained"
    assert memory.traces[0].text in ("yes", "no") and memory.traces[1].text not in ("yes", "no")
    # different texts by design, not a lossless failure
    assert 'data-verdict="not-checked"' in last["identical"] and "a constraint" in last["identical"]
