"""Trained draft heads (Medusa heads, an EAGLE layer): lossless greedy speculation with the shipped heads on the
bundled model (contiguous and paged KV), as a chain and as a tree; on a tiny model with heads trained in the test,
that tree verification is lossless in every KV mode, that sampled speculation keeps the target's distribution, that
the EAGLE drafter's cached steps compute what training computed, and the train-draft command end to end; heads for
another model, a missing file, too long a Medusa draft and a tree where it cannot be lossless are refused."""

from __future__ import annotations

import csv
import json
import random

import pytest
import torch

from inference_core import ConfigError, Engine, EngineConfig, SamplingParams
from inference_core import load_model
from inference_core.engine.compiled import compile_unavailable
from inference_core.spec.draft_heads import (EagleDrafter, EagleDraftPool, MedusaDrafter, draft_together, find_heads,
                                             lm_head_rows, load_heads, medusa_together)
from inference_core.engine import engine as engine_module
from inference_core.model import w4a8_kernel
from inference_core.model.llama import Linear, packed_bf16_available
from inference_core.quant.linear import QuantConfig, QuantLinear
from inference_core.quant.quantize import quantize
from inference_core.sequence import Sequence
from inference_core.spec.decoding import DraftTree, SpecConfig
from inference_core.training.train_draft import model_targets, train_heads, validation_split
from conftest import assert_nothing_held
from test_speculative import sampled_speculation_distances
from tiny_models import build_tiny, run_to_end, TINY_VOCAB

KINDS = ("medusa", "eagle")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny-target"), seed=0, initializer_range=0.3)


@pytest.fixture(scope="module")
def tiny_answers(tiny):
    """The tiny model's own greedy continuations of random prompts: its self-distillation data."""
    engine = Engine(tiny, EngineConfig(kv_mode="paged", block_size=4))
    rng = random.Random(0)
    sequences = []
    for _ in range(40):
        prompt = [rng.randrange(3, TINY_VOCAB) for _ in range(4)]
        sequences.append(prompt + engine.complete(prompt, SamplingParams(max_new_tokens=28,
                                                                         ignore_eos=True)).token_ids)
    return sequences


@pytest.fixture(scope="module")
def tiny_heads(tiny, tiny_answers, tmp_path_factory):
    """Both kinds trained on the tiny model's answers, saved to files: kind -> (path, validation agreement)."""
    directory = tmp_path_factory.mktemp("heads")
    trained = {}
    for kind in KINDS:
        heads, curve = train_heads(tiny, kind, tiny_answers, steps=150, num_heads=3, draft_vocab=TINY_VOCAB - 2,
                                   lr=1e-2, batch_size=128, batch_tokens=512, progress=False)
        losses = [row["loss"] for row in curve]
        assert sum(losses[-3:]) / 3 < 0.9 * losses[0], kind  # it learned something (each row is one noisy batch)
        heads.save(directory / f"{kind}.safetensors")
        trained[kind] = (directory / f"{kind}.safetensors", heads.meta["validation_top1_agreement"])
    return trained


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_speculation_with_trained_heads_keeps_the_target_distribution(tiny, tiny_heads, kind,
                                                                              one_torch_thread):
    engine = Engine(tiny, EngineConfig(kv_mode="paged", block_size=2))
    engine.load_draft_heads(kind, tiny_heads[kind][0])
    distances, bound, drafted, accepted = sampled_speculation_distances(engine, tiny, SpecConfig(kind, k=2))
    assert 0 < accepted < drafted  # drafts were both accepted and rejected
    for position, distance in enumerate(distances):  # within the sampling error (see test_speculative)
        assert distance < bound, position


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("kv_mode", ["contiguous", "paged"])
def test_greedy_with_trained_heads_is_lossless_on_tiny(tiny, tiny_heads, tiny_answers, kind, kv_mode):
    engine = Engine(tiny, EngineConfig(kv_mode=kv_mode, block_size=4))
    engine.load_draft_heads(kind, tiny_heads[kind][0])
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    accepted = 0
    for prompt in ([1, 5, 9, 3], [7, 7, 4]):
        plain = engine.complete(prompt, params)
        for k in (1, 3):
            fast = engine.complete(prompt, params, spec=SpecConfig(kind, k=k, adaptive=k == 3))
            assert fast.token_ids == plain.token_ids, (prompt, k)
            accepted += fast.stats.spec["accepted"]
    assert accepted > 0
    assert_nothing_held(engine)


@pytest.mark.parametrize("weights", ["int8", "int4 by int8 activations"])
def test_heads_take_the_targets_quantized_weights(tiny, tiny_heads, weights, request):
    """Next to a quantized target the heads' projections and scorer are quantized the same way (the scorer's 13 rows
    padded to two tiles of 8 for the layout, the padding never scored), their drafts are accepted, and with int8
    weights greedy ids are plain greedy's. (With int8 activations a verification's attention over several queries
    rounds differently from a decode's over one, so ids may part at the tiny random model's near ties:
    tests/quant/test_int8_activations.py.)"""
    if weights != "int8":
        request.getfixturevalue("our_ops")
    quant = QuantConfig("int8") if weights == "int8" else QuantConfig("int4", activations="int8")
    engine = Engine(quantize(tiny, quant), EngineConfig(kv_mode="paged", block_size=4))
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for kind in KINDS:
        heads = engine.load_draft_heads(kind, tiny_heads[kind][0])
        assert not any(isinstance(module, Linear) for module in heads.network.modules())
        scorer = heads.scorer(engine.loaded.model)
        rows = len(heads.vocab_ids)
        assert isinstance(scorer, QuantLinear) and scorer.out_features == 16 > rows == 13
        hidden = torch.randn(3, engine.loaded.config.hidden_size, generator=torch.Generator().manual_seed(0))
        scores = MedusaDrafter(heads, engine.loaded.model).scores(hidden)
        # The op's own formula: int8 activations round the hidden states first (the plain fp32 product of unrounded
        # states fell outside the tolerance for some draws)
        expected = (hidden @ scorer.dequantized().t() if weights == "int8"
                    else w4a8_kernel.reference(hidden, *w4a8_kernel.unpack(scorer.nibbles, scorer.numbers)))
        torch.testing.assert_close(scores, expected[:, :rows], atol=0.05, rtol=0.05)
        accepted = 0
        for prompt in ([1, 5, 9, 3], [7, 7, 4]):
            plain = engine.complete(prompt, params)
            fast = engine.complete(prompt, params, spec=SpecConfig(kind, k=3))
            assert fast.token_ids == plain.token_ids or weights != "int8", (kind, prompt)
            assert len(fast.token_ids) == 40
            accepted += fast.stats.spec["accepted"]
        assert accepted > 0, kind
    assert_nothing_held(engine)


@pytest.mark.parametrize("tree_width", [1, 3])
@pytest.mark.skipif(compile_unavailable(torch.device("cpu")) is not None, reason="no C++ compiler")
def test_greedy_with_trained_heads_compiled_is_lossless_and_never_eager(tiny, tiny_heads, tree_width):
    """A compiled engine runs the heads' verifications (the last token and 3 drafts, or a tree of at most 2 levels 3
    wide pruned by the drafter's confidence: up to 7 tokens under the tree's mask) and their plain steps (one token,
    its hidden state read) through the query step, whose packages it builds before the first request (a pruned
    tree's: 2, 3, 4, 5 and 7 tokens, each tree verified in the least that holds it); the 4-token prompts fit them too,
    so no forward runs eager, and greedy ids are plain greedy's."""
    eager = Engine(tiny, EngineConfig(kv_mode="paged", block_size=4))
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for kind in KINDS:
        engine = Engine(tiny, EngineConfig(kv_mode="paged", block_size=4, compile=True,
                                             speculate_when_it_pays=False))  # every step drafts, as measured
        engine.load_draft_heads(kind, tiny_heads[kind][0])
        spec = SpecConfig(kind, k=3 if tree_width == 1 else 2, tree_width=tree_width)
        engine.warm_up_compiled((1,), spec)
        accepted = 0
        for prompt in ([1, 5, 9, 3], [7, 7, 4, 2]):
            fast = engine.complete(prompt, params, spec=spec)
            assert fast.token_ids == eager.complete(prompt, params).token_ids, (kind, prompt)
            assert fast.stats.compile["compile_s"] == 0
            accepted += fast.stats.spec["accepted"]
        stats = engine.compile_stats()
        assert accepted > 0 and stats["fallbacks"] == {}, kind
        queries = {bucket: count for bucket, count in stats["steps_by_bucket"].items() if bucket.endswith("query")}
        if tree_width == 1:
            assert queries["1x4 query"] > 0
        else:  # pruned trees of several sizes, each in the least package that holds it
            assert set(queries) <= {f"1x{tokens} query" for tokens in (2, 3, 4, 5, 7)} and len(queries) >= 2
        assert (stats["draft_steps"].get("1-token", 0) > 0) == (kind == "eagle")  # its draft layer's package
        assert_nothing_held(engine)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_tree_and_a_chain_of_two_requests_verify_in_one_forward(tiny, tiny_heads, compiled):
    """Two EAGLE requests at once, one drafting a tree (2 wide, one level, every node) and one a chain of 2, draft
    together and verify in one forward a step on a compiled engine (the draft step's packages of 2 sequences; the
    query step: 2 sequences of 3 tokens, the tree under its mask, its KV committed only for the path kept); eager,
    each drafts alone and the tree takes a forward of its own beside one for the chain. Each
    answer is its solo plain greedy one; the same prompts again, served from the prefix cache, still are (a tree's
    nodes committed in slot order would have cached blocks whose keys are not their tokens'); the pool ends empty."""
    if compiled and compile_unavailable(torch.device("cpu")) is not None:
        pytest.skip("no C++ compiler")
    engine = Engine(tiny, EngineConfig(kv_mode="paged", block_size=4, max_num_seqs=2, compile=compiled,
                                       speculate_when_it_pays=False))
    engine.load_draft_heads("eagle", tiny_heads["eagle"][0])
    tree, chain = SpecConfig("eagle", k=1, tree_width=2, tree_prune=False), SpecConfig("eagle", k=2)
    if compiled:
        engine.warm_up_compiled((1, 2), tree)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompts, specs = ([1, 5, 9, 3], [7, 7, 4, 2]), (tree, chain)
    want = [Engine(tiny, EngineConfig(kv_mode="paged", block_size=4)).complete(ids, params).token_ids
            for ids in prompts]
    forwards = []
    verify, run_tree = engine.runner.verify, engine.runner.run_tree
    engine.runner.verify = lambda seqs, *args, **kwargs: forwards.append(len(seqs)) or verify(seqs, *args, **kwargs)
    engine.runner.run_tree = lambda *args: forwards.append("tree") or run_tree(*args)
    requests = [engine.submit(ids, params, spec=spec) for ids, spec in zip(prompts, specs)]
    run_to_end(engine)
    assert [request.events[-1].token_ids for request in requests] == want
    assert all(request.events[-1].stats.spec["accepted"] > 0 for request in requests)
    assert 2 in forwards and ("tree" in forwards) != compiled  # eager: the tree's own forward; compiled: none
    if compiled:
        stats = engine.compile_stats()
        assert stats["fallbacks"] == {} and stats["steps_by_bucket"]["2x3 query"] > 0
        assert stats["draft_steps"]["2x1-token"] > 0 and stats["draft_steps"]["2x2-token"] > 0, stats["draft_steps"]
        assert sorted(engine._draft_pool.free) == [0, 1, 2]  # every finished request's slot back in the pool
    assert [engine.complete(ids + answer[:12], params).token_ids for ids, answer in zip(prompts, want)] == \
        [Engine(tiny, EngineConfig(kv_mode="paged", block_size=4)).complete(ids + answer[:12], params).token_ids
         for ids, answer in zip(prompts, want)]
    assert_nothing_held(engine)


def _triton_installed() -> bool:
    from inference_core.engine import triton_attention

    return triton_attention._triton() is not None


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.is_available() or not _triton_installed(),
                    reason="Triton's interpreter on a CPU where Triton is installed (it is not in the suite's torch)")
def test_trees_verify_in_cudas_flat_step_as_plain_greedy_decodes(tiny, tiny_heads, monkeypatch):
    """CUDA's compiled engine (torch.compile, our Triton attention; here on the CPU under Triton's interpreter)
    verifies two requests' EAGLE draft trees in one flat step, the nodes at their depths' positions under their
    tree's mask: each tree's logits and hidden states are the eager forward's (run after it on the same tree), greedy
    ids are plain greedy's, and no forward runs eager."""
    from conftest import compile_as_on_cuda

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read where Triton's kernels are first defined
    compile_as_on_cuda(monkeypatch)
    eager = Engine(tiny, EngineConfig(kv_mode="paged", block_size=4))
    engine = Engine(tiny, EngineConfig(kv_mode="paged", block_size=4, compile=True, speculate_when_it_pays=False))
    engine.load_draft_heads("eagle", tiny_heads["eagle"][0])
    assert engine.decoder.flat_trees
    runner, trees = engine.runner, []
    verify, run_tree = runner.verify, runner.run_tree

    def and_eager(seqs, needed, drafted=None, return_hidden=True):
        rows, hidden = verify(seqs, needed, drafted, return_hidden)
        runner.decoder = None  # the same trees through the eager forward (their KV written to the same slots)
        try:
            for seq, tree, logits, states in zip(seqs, drafted or [None] * len(seqs), rows, hidden):
                if tree is not None:
                    eager_logits, eager_hidden = run_tree(seq, *tree)
                    torch.testing.assert_close(logits, eager_logits, rtol=1e-4, atol=1e-4)
                    torch.testing.assert_close(states[-len(tree[0]):], eager_hidden, rtol=1e-4, atol=1e-4)
                    trees.append((len(seqs), len(tree[0])))
        finally:
            runner.decoder = engine.decoder
        return rows, hidden

    monkeypatch.setattr(runner, "verify", and_eager)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    spec = SpecConfig("eagle", k=2, tree_width=2, tree_prune=False)
    prompts = ([1, 5, 9, 3], [7, 7, 4, 2])
    requests = [engine.submit(ids, params, spec=spec) for ids in prompts]
    run_to_end(engine)
    assert max(nodes for _, nodes in trees) == 5  # the last token and 2 levels of 2 (fewer near the end)
    assert any(count == 2 for count, _ in trees)  # both requests' trees in one step
    assert [request.events[-1].token_ids for request in requests] == [eager.complete(ids, params).token_ids
                                                                       for ids in prompts]
    assert all(request.events[-1].stats.spec["accepted"] > 0 for request in requests)
    stats = engine.compile_stats()
    assert stats["fallbacks"] == {} and stats["steps_by_bucket"]["flat"] > 0
    assert_nothing_held(engine)


@pytest.mark.skipif(compile_unavailable(torch.device("cpu")) is not None, reason="no C++ compiler")
def test_a_compiled_engines_eagle_drafts_step_through_its_packages_as_eager_ones_do(tiny, tiny_heads, tiny_answers):
    """A compiled engine's EAGLE drafter steps its layer through the draft step's packages (`EagleDraftStep`, one a
    bucket of sequences and of tokens, built by the warm-up), its keys and values a slot of the engine's pool: a
    catch-up of 1, 2 or 3 positions (padded to 4) and each draft after it give the eager drafter's distributions and
    drafts, and so does a catch-up past the largest bucket (after a prompt), in parts (8 positions, then 4). Its slot
    goes back to the pool."""
    engine = Engine(tiny, EngineConfig(kv_mode="paged", block_size=4, compile=True))
    engine.load_draft_heads("eagle", tiny_heads["eagle"][0])
    spec = engine.resolve_spec(SpecConfig("eagle", k=3))
    engine.warm_up_compiled((1,), spec)
    compiled, eager = engine._drafter(spec), engine._drafter(spec)
    assert compiled.pool is engine._draft_pool
    eager.pool = None
    ids = tiny_answers[0][:24]
    features = model_targets(tiny, [ids], progress=False)[0][0]
    observed = 0
    for last in (12, 13, 15, 18):  # catch up over 12 positions (8 + 4), then 1, 2 and 3; each time draft three
        proposals = []
        for drafter in (compiled, eager):
            drafter.observe(observed, features[observed:last])
            proposals.append(drafter.propose(Sequence(ids[:last + 1]), 3, SamplingParams(temperature=1.0),
                                             torch.Generator().manual_seed(last)))
        observed = last
        assert proposals[0][0] == proposals[1][0], last
        torch.testing.assert_close(proposals[0][1], proposals[1][1], atol=1e-5, rtol=0, msg=str(last))
    assert engine.compile_stats()["draft_steps"] == {"1-token": 9, "2-token": 1, "4-token": 2, "8-token": 1}
    free = len(engine._draft_pool.free)
    compiled.close()
    assert len(engine._draft_pool.free) == free + 1
    # The packages are keyed by the heads' weights (an engine may load other heads): the same file, the same key.
    first, second = (load_heads(tiny_heads["eagle"][0], tiny.config) for _ in range(2))
    assert first.identity() == second.identity()
    second.network.fc.bias.data.add_(1.0)
    assert first.identity() != second.identity()


def test_eagle_drafters_of_one_pool_draft_together_as_each_alone(tiny, tiny_heads, tiny_answers, our_ops):
    """Three EAGLE drafters with slots in one pool (`EagleDraftPool`, its draft step run eagerly here: the packages'
    graph) draft together (`draft_together`: each layer step one call, padded to 4 sequences, one of them empty, and
    to a bucket of tokens) exactly what each drafts alone with a cache of its own, in two rounds: a sampled chain, a
    pruned tree and a greedy chain; the first round's catch-up of 12 positions steps its first 8 alone. A fourth
    drafter finds no slot; closed drafters give their slots back."""
    heads = load_heads(tiny_heads["eagle"][0], tiny.config)
    calls = []

    def run(graph, sequences, tokens, inputs):
        calls.append((sequences, tokens))
        assert inputs[0].shape[0] == tokens and inputs[2].shape[0] == tokens + 4 * sequences + 1
        return graph(*inputs)

    pool = EagleDraftPool(heads, tiny.model, 64, 3, [1, 2, 4, 8], run)
    together = [EagleDrafter(heads, tiny.model, 64, pool) for _ in range(3)]
    alone = [EagleDrafter(heads, tiny.model, 64) for _ in range(3)]
    extra = EagleDrafter(heads, tiny.model, 64, pool)
    assert [drafter.slot for drafter in together] == [0, 1, 2] and all(d.pool is None for d in alone + [extra])
    texts = [tiny_answers[index][:24] for index in (1, 2, 3)]
    hidden = [model_targets(tiny, [text], progress=False)[0][0] for text in texts]
    seen = [0, 0, 0]
    for lasts in ((12, 6, 4), (13, 8, 7)):  # catch-ups of 12 (8 alone, then 4), 6 and 4; then of 1, 2 and 3
        proposals, calls[:] = [], []
        for drafters in (together, alone):
            for drafter, first, last, states in zip(drafters, seen, lasts, hidden):
                drafter.observe(first, states[first:last])
            jobs = [drafters[0].chain_job(Sequence(texts[0][:lasts[0] + 1]), 3, SamplingParams(temperature=1.0),
                                          torch.Generator().manual_seed(lasts[0])),
                    drafters[1].tree_job(Sequence(texts[1][:lasts[1] + 1]), 3, 2, prune=True),
                    drafters[2].chain_job(Sequence(texts[2][:lasts[2] + 1]), 2, SamplingParams(), None)]
            proposals.append(draft_together(jobs))
        seen = list(lasts)
        (chain, probs), tree, (greedy, _) = proposals[0]
        assert chain == proposals[1][0][0] and len(chain) == 3, lasts
        torch.testing.assert_close(probs, proposals[1][0][1], atol=1e-5, rtol=0, msg=str(lasts))
        assert tree == proposals[1][1] and tree, lasts
        assert greedy == proposals[1][2][0] and len(greedy) == 2, lasts
        # The catch-ups (8 positions alone, then 4 + 6 + 4: 4 sequences of up to 4; then 1 + 2 + 3: 4 of up to
        # 2), then the drafts.
        catch_ups = [(1, 8), (4, 16)] if lasts[0] == 12 else [(4, 8)]
        assert calls[:len(catch_ups) + 1] == catch_ups + [(4, 4)], calls
    for drafter in together + alone + [extra]:
        drafter.close()
    assert sorted(pool.free) == [0, 1, 2]


def test_medusa_drafters_draft_together_as_each_alone(tiny, tiny_heads, tiny_answers, monkeypatch):
    """Medusa drafters of the same heads draft together (`medusa_together`: the heads and the scoring rows in one
    pass over every ready drafter's hidden state) what each drafts alone: a sampled chain, a pruned tree, a greedy
    chain, and nothing for a drafter without the hidden state it needs. In an engine, two Medusa requests at once
    draft so, and each answer is its plain greedy one."""
    heads = load_heads(tiny_heads["medusa"][0], tiny.config)
    texts = [tiny_answers[index][:20] for index in (1, 2, 3, 4)]
    features = [model_targets(tiny, [text], progress=False)[0][0] for text in texts]
    proposals = []
    for together in (True, False):
        drafters = [MedusaDrafter(heads, tiny.model) for _ in texts]
        for drafter, states, last in zip(drafters, features, (12, 9, 15, 10)):
            drafter.observe(0, states[:last])  # the hidden state that predicted token `last`
        seqs = [Sequence(text[:last + 1]) for text, last in zip(texts, (12, 9, 15, 11))]  # the last one: a gap
        jobs = [drafters[0].chain_job(seqs[0], 3, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0)),
                drafters[1].tree_job(seqs[1], 3, 2, prune=True),
                drafters[2].chain_job(seqs[2], 2, SamplingParams(), None),
                drafters[3].chain_job(seqs[3], 2, SamplingParams(), None)]
        proposals.append(medusa_together(jobs) if together else [medusa_together([job])[0] for job in jobs])
    (chain, probs), tree, (greedy, _), nothing = proposals[0]
    assert chain == proposals[1][0][0] and len(chain) == 3
    torch.testing.assert_close(probs, proposals[1][0][1], atol=1e-5, rtol=0)
    assert tree == proposals[1][1] and tree and greedy == proposals[1][2][0] and len(greedy) == 2
    assert nothing == ([], None)

    calls = []
    together = engine_module.medusa_together
    monkeypatch.setattr(engine_module, "medusa_together", lambda jobs: calls.append(len(jobs)) or together(jobs))
    engine = Engine(tiny, EngineConfig(kv_mode="paged", block_size=4, max_num_seqs=2, speculate_when_it_pays=False))
    engine.load_draft_heads("medusa", tiny_heads["medusa"][0])
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompts, specs = ([1, 5, 9, 3], [7, 7, 4, 2]), (SpecConfig("medusa", k=2, tree_width=2), SpecConfig("medusa", k=2))
    want = [Engine(tiny, EngineConfig(kv_mode="paged", block_size=4)).complete(ids, params).token_ids
            for ids in prompts]
    requests = [engine.submit(ids, params, spec=spec) for ids, spec in zip(prompts, specs)]
    run_to_end(engine)
    assert [request.events[-1].token_ids for request in requests] == want
    assert 2 in calls
    assert_nothing_held(engine)


@pytest.mark.skipif(not packed_bf16_available(), reason="bf16 heads run packed only on a CPU with native bf16 math")
def test_heads_run_in_bf16_packed_next_to_a_bf16_model(tiny, tiny_heads, tiny_answers):
    """Next to a bf16 model the heads compute in bf16 through the packed layout (EAGLE's drafts on the bundled model
    take 1.8-2.1 ms a step against 2.9-3.0): they score what the fp32 heads score, to bf16's precision, and greedy
    stays lossless."""
    tiny_bf16 = load_model(tiny.name, device="cpu", dtype="bfloat16")
    engine = Engine(tiny_bf16, EngineConfig(kv_mode="paged", block_size=4))
    features = model_targets(tiny, [tiny_answers[0][:20]], progress=False)[0][0]
    ids = tiny_answers[0][:20]
    params = SamplingParams(temperature=1.0)
    for kind in KINDS:
        heads = engine.load_draft_heads(kind, tiny_heads[kind][0])
        assert heads.dtype == torch.bfloat16
        assert {m.layout for m in heads.network.modules() if isinstance(m, Linear)} <= {"packed"}
        reference = load_heads(tiny_heads[kind][0], tiny.config)
        assert reference.dtype == torch.float32
        drafters = [(EagleDrafter(h, model.model, 64) if kind == "eagle" else MedusaDrafter(h, model.model))
                    for h, model in ((heads, tiny_bf16), (reference, tiny))]
        probs = []
        for drafter in drafters:
            drafter.observe(0, features[:19])
            probs.append(drafter.propose(Sequence(ids), 2, params, torch.Generator().manual_seed(0))[1])
        assert drafters[0].scorer.layout == "packed"
        torch.testing.assert_close(probs[0], probs[1], atol=0.01, rtol=0)
        plain = engine.complete([1, 5, 9, 3], SamplingParams(max_new_tokens=40, ignore_eos=True))
        for spec in (SpecConfig(kind, k=2), SpecConfig(kind, k=2, tree_width=3)):
            fast = engine.complete([1, 5, 9, 3], SamplingParams(max_new_tokens=40, ignore_eos=True), spec=spec)
            assert fast.token_ids == plain.token_ids and fast.stats.spec["accepted"] > 0, (kind, spec)
    assert_nothing_held(engine)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("kv_mode,window", [("contiguous", None), ("paged", None), ("none", None), ("paged", 6)])
def test_greedy_tree_verification_is_lossless_on_tiny(tiny, tiny_heads, kind, kv_mode, window, monkeypatch):
    """A tree 3 wide keeps plain greedy's ids in every KV mode and under a sliding window; paths that end in a leaf
    occur (their KV is moved next to the parent: were it not, the tokens after them would differ)."""
    engine = Engine(tiny, EngineConfig(kv_mode=kv_mode, block_size=4, sliding_window=window))
    engine.load_draft_heads(kind, tiny_heads[kind][0])
    moves = []
    copy_token = engine.kv_cache.copy_token
    monkeypatch.setattr(engine.kv_cache, "copy_token", lambda *args: (moves.append(args[1:]), copy_token(*args)))
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    chain_first = tree_first = 0
    for prompt in ([1, 5, 9, 3], [7, 7, 4], [2, 11, 6, 6, 8]):
        plain = engine.complete(prompt, params)
        chain = engine.complete(prompt, params, spec=SpecConfig(kind, k=3))
        tree = engine.complete(prompt, params, spec=SpecConfig(kind, k=3, tree_width=3))
        assert tree.token_ids == plain.token_ids == chain.token_ids, prompt
        assert tree.stats.spec["tree_width"] == 3
        chain_first += chain.stats.spec["accepted_by_position"][0] / chain.stats.spec["drafted_by_position"][0]
        tree_first += tree.stats.spec["accepted_by_position"][0] / tree.stats.spec["drafted_by_position"][0]
    assert moves and tree_first > chain_first  # leaves were taken, and they raise the first position's acceptance
    assert_nothing_held(engine)
    request = engine.generate([1, 5, 9, 3], params, spec=SpecConfig(kind, k=3, tree_width=3))
    for index, _ in enumerate(request):  # cancelled mid-stream: every block or slot comes back
        if index == 6:
            break
    request.close()
    assert_nothing_held(engine)


@pytest.mark.parametrize("kind", KINDS)
def test_a_pruned_tree_follows_the_drafters_confidence(tiny, tiny_heads, kind, monkeypatch):
    """A pruned tree (`SpecConfig.tree_prune`, the default) is the full tree with the levels past where the chain's
    draft probabilities fall below TREE_GO_ON and the candidates below TREE_KEEP left out: with both thresholds at 0
    it is the full tree, proposal by proposal; with TREE_KEEP out of reach a chain; with TREE_GO_ON out of reach one
    level. At the real thresholds it verifies fewer nodes than the full tree, and every setting keeps plain greedy's
    ids."""
    from inference_core.spec import draft_heads

    engine = Engine(tiny, EngineConfig(kv_mode="paged", block_size=4))
    engine.load_draft_heads(kind, tiny_heads[kind][0])
    drafter_class = MedusaDrafter if kind == "medusa" else EagleDrafter
    proposed = []
    propose_tree = drafter_class.propose_tree
    monkeypatch.setattr(drafter_class, "propose_tree",
                        lambda self, *args: proposed.append(propose_tree(self, *args)) or proposed[-1])
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    full, pruned = SpecConfig(kind, k=3, tree_width=3, tree_prune=False), SpecConfig(kind, k=3, tree_width=3)

    def run(spec, go_on=None, keep=None):
        if go_on is not None:
            monkeypatch.setattr(draft_heads, "TREE_GO_ON", go_on)
            monkeypatch.setattr(draft_heads, "TREE_KEEP", keep)
        proposed.clear()
        ids = [engine.complete(prompt, params, spec=spec).token_ids for prompt in ([1, 5, 9, 3], [7, 7, 4])]
        return ids, list(proposed)

    plain = [engine.complete(prompt, params).token_ids for prompt in ([1, 5, 9, 3], [7, 7, 4])]
    full_ids, full_trees = run(full)
    assert full_ids == plain and all(len(level) == 3 for tree in full_trees for level in tree)
    assert max(map(len, full_trees)) == 3  # (shorter near the end: the drafts the answer still has room for)
    default_ids, default_trees = run(pruned)
    assert default_ids == plain
    assert sum(map(len, sum(default_trees, []))) < sum(map(len, sum(full_trees, [])))
    assert run(pruned, 0.0, 0.0) == (full_ids, full_trees)
    chain_ids, chains = run(pruned, 0.5, 1.01)
    assert chain_ids == plain and all(len(level) == 1 for tree in chains for level in tree)
    shallow_ids, shallow = run(pruned, 1.01, 0.05)
    assert shallow_ids == plain and all(len(tree) == 1 for tree in shallow)
    assert any(len(tree[0]) < 3 for tree in shallow) and any(len(tree[0]) > 1 for tree in shallow)
    assert_nothing_held(engine)


@pytest.mark.parametrize("kv_mode", ["contiguous", "paged"])
def test_tree_verification_with_an_int4_kv_cache(tiny, tiny_heads, kv_mode, monkeypatch):
    """With an int4 KV cache an accepted leaf's K and V move within the full-precision tail (`Int4Blocks.copy_token`):
    the tree's ids follow plain int4 decoding (up to near-ties: a verification that fills a block reads it unquantized
    where a decode reads it quantized) and nothing is left held."""
    engine = Engine(tiny, EngineConfig(kv_mode=kv_mode, block_size=4, kv_dtype="int4"))
    engine.load_draft_heads("eagle", tiny_heads["eagle"][0])
    moves = []
    copy_token = engine.kv_cache.copy_token
    monkeypatch.setattr(engine.kv_cache, "copy_token", lambda *args: (moves.append(args[1:]), copy_token(*args)))
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for prompt in ([1, 5, 9, 3], [7, 7, 4], [2, 11, 6, 6, 8]):
        plain = engine.complete(prompt, params)
        tree = engine.complete(prompt, params, spec=SpecConfig("eagle", k=3, tree_width=3))
        assert len(tree.token_ids) == 40 and tree.token_ids[:12] == plain.token_ids[:12], prompt
    assert moves
    assert_nothing_held(engine)


def test_a_draft_tree_is_laid_out_masked_and_walked_as_greedy_decoding_would():
    tree = DraftTree.from_candidates([[10, 11, 12], [20, 21, 22], [30, 31, 32]], eos_ids={99})
    assert tree.tokens == [10, 20, 30, 11, 12, 21, 22, 31, 32]
    assert tree.depths == [0, 1, 2, 3, 1, 1, 2, 2, 3, 3]
    assert tree.parents == [-1, 0, 1, 2, 0, 0, 1, 1, 2, 2]
    mask = tree.mask()
    assert mask[3].nonzero().flatten().tolist() == [0, 1, 2, 3]  # the chain's last node: the chain
    assert mask[6].nonzero().flatten().tolist() == [0, 1, 6]  # a leaf at depth 2: node 0, the chain's first, itself
    # target_ids: the target's argmax after each node (its logits row). Node 0 -> 10 (chain), node 1 -> 21 (leaf 6).
    target = [10, 21, 0, 0, 0, 0, 7, 0, 0, 0]
    assert tree.accept_greedy(target) == [1, 6]
    assert tree.accept_greedy([12] + [0] * 9) == [5]  # a leaf at the first position
    assert tree.accept_greedy([13] + [0] * 9) == []  # nothing matches
    assert tree.accept_greedy([10, 20, 30] + [0] * 7) == [1, 2, 3]  # the whole chain
    # Nothing after an end-of-sequence token in the chain: the tree stops at its depth.
    short = DraftTree.from_candidates([[10, 11], [99, 21], [30, 31]], eos_ids={99})
    assert short.chain == [10, 99] and short.tokens == [10, 99, 11, 21]


def test_tree_verification_is_refused_where_it_cannot_keep_its_promise(tiny, tiny_heads):
    engine = Engine(tiny, EngineConfig(kv_mode="paged", block_size=4))
    engine.load_draft_heads("eagle", tiny_heads["eagle"][0])
    with pytest.raises(ConfigError, match="greedy"):
        engine.make_request([1, 2, 3], SamplingParams(temperature=0.7), spec=SpecConfig("eagle", k=2, tree_width=2))
    with pytest.raises(ConfigError, match="medusa or eagle"):
        SpecConfig("ngram", k=2, tree_width=2)
    with pytest.raises(ConfigError, match="adaptive"):
        SpecConfig("eagle", k=2, tree_width=2, adaptive=True)
    with pytest.raises(ConfigError, match="from 1 to"):
        SpecConfig("eagle", k=2, tree_width=0)


def test_a_width_left_open_is_the_measured_tree_for_greedy_and_a_chain_otherwise(tiny, tiny_heads, tmp_path,
                                                                               monkeypatch):
    """A request that leaves the tree width open (the lanes' default) verifies the width kept for the setup when it
    is greedy, the project's where nothing was kept, and a chain when it samples or adapts k: never the refusal an
    explicit tree with a temperature gets."""
    from inference_core.spec import defaults
    monkeypatch.setattr(defaults, "_path", lambda: tmp_path / defaults.FILE_NAME)
    engine = Engine(tiny, EngineConfig(kv_mode="paged", block_size=4))
    engine.load_draft_heads("eagle", tiny_heads["eagle"][0])
    open_width = SpecConfig("eagle", tree_width=None)
    assert engine.make_request([1, 2, 3], SamplingParams(max_new_tokens=6), spec=open_width).spec.tree_width == \
        defaults.BUILT_IN_TREE_WIDTH["eagle"]["eager"]
    assert engine.make_request([1, 2, 3], SamplingParams(max_new_tokens=6, temperature=0.7),
                               spec=open_width).spec.tree_width == 1
    assert engine.resolve_spec(SpecConfig("eagle", adaptive=True, tree_width=None)).tree_width == 1
    assert engine.resolve_spec(SpecConfig("ngram", tree_width=None)).tree_width == 1
    setup = defaults.setup_key(tiny, "paged", compiled=False)
    defaults.keep(setup, {"eagle w=auto": {"k": 2, "tree_width": 4, "width_by_k": {"1": 2, "2": 4}},
                          "eagle w=4": {"k": 2}}, "spec-bench ...")
    request = engine.make_request([1, 2, 3], SamplingParams(max_new_tokens=6), spec=open_width)
    assert (request.spec.k, request.spec.tree_width) == (2, 4)  # the fastest pair measured
    assert engine.resolve_spec(SpecConfig("eagle", k=1, tree_width=None)).tree_width == 2  # the fastest at k=1
    assert engine.resolve_spec(SpecConfig("eagle", k=3, tree_width=None)).tree_width == 4  # k=3 not measured
    assert engine.default_tree_width(open_width)[1].startswith("measured on this host")
    plain = engine.complete([1, 2, 3], SamplingParams(max_new_tokens=12, ignore_eos=True))
    tree = engine.complete([1, 2, 3], SamplingParams(max_new_tokens=12, ignore_eos=True), spec=open_width)
    assert tree.token_ids == plain.token_ids and tree.stats.spec["tree_width"] == 4
    assert_nothing_held(engine)


def test_the_eagle_drafter_computes_what_training_computed(tiny, tiny_heads, tiny_answers):
    """Drafting catches up through the layer's own KV cache, token by token after a prefix, and drafts from its own
    estimates; training runs whole sequences at once (`EagleLayer.unrolled` for the drafts after the first). Both
    must give the same outputs, or trained weights would draft worse than they measured."""
    heads = load_heads(tiny_heads["eagle"][0], tiny.config)
    ids = tiny_answers[0][:24]
    features = model_targets(tiny, [ids], progress=False)[0][0]
    drafter = EagleDrafter(heads, tiny.model, 64)
    rows = lm_head_rows(tiny.model, heads.vocab_ids).float()

    def unrolled(token_ids, steps):
        """The last position's draft distribution of each step, over the draft vocabulary."""
        count = len(token_ids) - 1
        cos, sin = (table[:count].float().unsqueeze(1) for table in tiny.model.rope_tables(torch.float32))
        embeddings = tiny.model.embed_tokens.weight[torch.tensor(token_ids[1:])][None]
        with torch.no_grad():
            outputs = heads.network.unrolled(features[None, :count], embeddings, cos, sin, steps)
            whole = heads.network(features[None, :count], embeddings, cos, sin)
        torch.testing.assert_close(outputs[0], whole)  # the first step is the plain forward
        return torch.softmax(outputs[-1][0, -1] @ rows.t(), -1)

    observed, generator = 0, torch.Generator().manual_seed(0)
    for last in (12, 13, 16, 19):  # hand over the hidden states up to `last`, then draft three tokens
        drafter.observe(observed, features[observed:last])
        observed = last
        drafts, probs = drafter.propose(Sequence(ids[:last + 1]), 3, SamplingParams(temperature=1.0), generator)
        assert len(drafts) == 3 and probs.shape == (3, tiny.config.vocab_size)
        # Draft s is step s at the position it reads, after the drafts before it (the drafts' own keys and values
        # are overwritten next time, so the next proposal again reads true hidden states only).
        for steps in (1, 2, 3):
            torch.testing.assert_close(probs[steps - 1, heads.vocab_ids],
                                       unrolled(ids[:last + 1] + drafts[:steps - 1], steps), msg=str((last, steps)))


def test_the_eagle_drafter_attends_through_our_op_as_sdpa_does(tiny, tiny_heads, tiny_answers, our_ops):
    """Where the heads' projections run through our op (bf16), the drafter's layer attends through our attention op,
    its KV cache read in place as one block (`attention_kernel.attend_flat`): the catch-up over several positions and
    each draft after it give SDPA's distributions to bf16's precision, and the same drafts."""
    tiny_bf16 = load_model(tiny.name, device="cpu", dtype="bfloat16")
    heads = load_heads(tiny_heads["eagle"][0], tiny.config, model_dtype=torch.bfloat16)
    assert heads.dtype == torch.bfloat16
    heads.use_row_kernel()
    ids = tiny_answers[0][:24]
    features = model_targets(tiny, [ids], progress=False)[0][0]
    ours, sdpa = (EagleDrafter(heads, tiny_bf16.model, 64) for _ in range(2))
    assert ours.our_attention
    sdpa.our_attention = False
    observed = 0
    for last in (9, 10, 15, 19):  # catch up over several positions (9, 15, 19) or one (10), then draft three tokens
        proposals = []
        for drafter in (ours, sdpa):
            drafter.observe(observed, features[observed:last].to(torch.bfloat16))
            proposals.append(drafter.propose(Sequence(ids[:last + 1]), 3, SamplingParams(temperature=1.0),
                                             torch.Generator().manual_seed(last)))
        observed = last
        assert proposals[0][0] == proposals[1][0], last
        torch.testing.assert_close(proposals[0][1], proposals[1][1], atol=0.01, rtol=0, msg=str(last))


def test_eagle_trains_its_later_drafts_on_its_own_estimates(tiny, tiny_answers):
    """--unroll 2 (training-time test): the second draft step learns from the layer's own estimates; the curve and
    the report give each step's agreement."""
    heads, curve = train_heads(tiny, "eagle", tiny_answers, steps=60, draft_vocab=TINY_VOCAB - 2, lr=1e-2,
                               batch_tokens=512, unroll=2, progress=False)
    assert set(curve[0]) == {"step", "loss", "regression", "classification", "agreement", "agreement2"}
    assert sum(row["loss"] for row in curve[-3:]) / 3 < 0.9 * curve[0]["loss"]
    first, second = heads.meta["validation_top1_agreement"]
    assert heads.meta["unroll"] == 2 and first > 0.1 and second > 0.1  # chance: 1 in 16


def test_heads_are_checked_against_the_model(tiny, tiny_heads, bundled, tmp_path):
    engine = Engine(bundled, EngineConfig(kv_mode="paged"))
    with pytest.raises(ConfigError, match="were trained for another model"):
        engine.load_draft_heads("medusa", tiny_heads["medusa"][0])
    with pytest.raises(ConfigError, match="no draft heads at"):
        engine.load_draft_heads("eagle", tmp_path / "missing.safetensors")
    tiny_engine = Engine(tiny, EngineConfig(kv_mode="paged"))
    with pytest.raises(ConfigError, match="no trained eagle heads for .*train-draft --kind eagle"):
        tiny_engine.generate([1, 2, 3], spec=SpecConfig("eagle"))
    tiny_engine.load_draft_heads("medusa", tiny_heads["medusa"][0])
    with pytest.raises(ConfigError, match=r"at most 3 tokens ahead: draft length k \(--spec-k\) must be 1 to 3"):
        tiny_engine.generate([1, 2, 3], spec=SpecConfig("medusa", k=5))


def test_validation_holds_out_whole_prompts():
    groups = [i // 2 for i in range(200)]  # a greedy and a sampled answer to each of 100 prompts
    train, held = validation_split(groups, 0.1, seed=0)
    assert sorted(train + held) == list(range(200))
    assert len({groups[i] for i in held}) == 10 and not {groups[i] for i in train} & {groups[i] for i in held}
    assert validation_split(groups, 0.1, seed=0) == (train, held) != validation_split(groups, 0.1, seed=1)
    assert len(validation_split(range(5), 0.05, seed=0)[1]) == 1  # at least one


def test_train_draft_command_writes_weights_curve_and_report(tiny, tiny_answers, tmp_path, capsys, monkeypatch):
    from inference_core.cli import main

    # Two answer files, trained on together (each file's targets cached beside it).
    half = len(tiny_answers) // 2
    data, more = tmp_path / "answers.jsonl", tmp_path / "more.jsonl"
    for path, answers in ((data, tiny_answers[:half]), (more, tiny_answers[half:])):
        path.write_text("".join(json.dumps({"prompt": i, "prompt_tokens": 4, "ids": ids}) + "\n"
                                for i, ids in enumerate(answers)))
    out = tmp_path / "heads" / "tiny-medusa.safetensors"
    assert main(["train-draft", "--kind", "medusa", "--model", tiny.name, "--device", "cpu",
                 "--data", f"{data},{more}", "--no-text", "--heads", "2", "--draft-vocab", "16", "--steps", "30",
                 "--batch-size", "64", "--log-every", "5", "--data-dtype", "bfloat16", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["kind"] == "medusa" and report["steps"] == 30 and report["data"]["answers"] == len(tiny_answers)
    assert report["data"]["data_files"] == ["answers.jsonl", "more.jsonl"]
    assert len(list(tmp_path.glob("answers.*.targets.pt"))) == len(list(tmp_path.glob("more.*.targets.pt"))) == 1
    assert report["data"]["model_dtype"] == "bfloat16" and report["arguments"]["dtype"] == "float32"
    assert report["data"]["temperatures"] == [0.0]  # answers without a temperature are greedy ones
    assert len(report["validation_top1_agreement"]) == 2 and report["seconds"]["total"] >= 0
    rows = list(csv.DictReader(out.with_suffix(".loss.csv").open()))
    assert [int(row["step"]) for row in rows] == [0, 5, 10, 15, 20, 25, 29] and "head2" in rows[0]
    assert "train-draft: medusa heads ->" in capsys.readouterr().out
    # generate picks the file up with --draft-heads, and says when it is given without trained heads to use.
    assert main(["generate", "--model", tiny.name, "--device", "cpu", "--no-chat", "--prompt", "t5 t9 t3",
                 "--max-new-tokens", "8", "--ignore-eos", "--spec", "medusa", "--spec-k", "2",
                 "--draft-heads", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["stats"]["spec"]["steps"] > 0
    assert main(["generate", "--model", tiny.name, "--prompt", "t5", "--draft-heads", str(out)]) == 2
    assert "--draft-heads is used only with --spec medusa or --spec eagle" in capsys.readouterr().err
    assert main(["train-draft", "--kind", "eagle", "--model", tiny.name, "--temperatures", "0,hot"]) == 2
    assert "--temperatures takes comma-separated temperatures >= 0" in capsys.readouterr().err
    # A missing last file is written first: the model's answers to prompts of the chosen set (the tiny model has no
    # chat template, so each prompt stands as four token ids of its own).
    from inference_core.model.tokenizer import Tokenizer
    monkeypatch.setattr(Tokenizer, "encode_chat",
                        lambda self, messages: [1, 5, 9, 3 + sum(map(ord, messages[-1]["content"])) % 12])
    written = tmp_path / "varied.jsonl"
    assert main(["train-draft", "--kind", "eagle", "--model", tiny.name, "--device", "cpu", "--data",
                 f"{data},{written}", "--prompt-set", "varied", "--prompts", "3", "--temperatures", "0",
                 "--max-new-tokens", "8", "--no-text", "--draft-vocab", "16", "--steps", "2",
                 "--out", str(tmp_path / "tiny-eagle.safetensors")]) == 0
    answers = [json.loads(line) for line in written.read_text().splitlines()]
    assert len(answers) == 3 and all(len(answer["ids"]) > answer["prompt_tokens"] for answer in answers)
    assert json.loads((tmp_path / "tiny-eagle.json").read_text())["data"]["answers"] == half + 3
    assert main(["train-draft", "--kind", "eagle", "--model", tiny.name, "--data", f"{tmp_path / 'none'},{more}"]) == 2
    assert "only the last file named is written when missing" in capsys.readouterr().err
    assert main(["train-draft", "--kind", "eagle", "--model", tiny.name, "--unroll", "0"]) == 2
    assert "--unroll >= 1" in capsys.readouterr().err


# --- the shipped heads on the bundled model ------------------------------------------------------------------------

LOSSLESS_TOKENS = 40  # ten 4-token blocks, a chain or a tree each step


@pytest.mark.parametrize("kind", KINDS)
def test_shipped_heads_are_found_for_the_bundled_model(bundled, kind):
    path = find_heads(bundled.name, bundled.config, kind)
    assert path is not None and path.stat().st_size < 16 * 2 ** 20
    heads = load_heads(path, bundled.config)
    assert heads.meta["model"] and heads.meta["seconds"]["train"] > 0


@pytest.fixture(scope="module")
def plain_greedy_ids():
    """Plain greedy ids (LOSSLESS_TOKENS) by KV mode and prompt, from the first engine of that mode to ask: each
    kind of head is checked against the same run."""
    runs = {}

    def plain(engine: Engine, name: str, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        key = (engine.config.kv_mode, name)
        if key not in runs:
            runs[key] = engine.complete(prompt_ids, params).token_ids
        return runs[key]

    return plain


@pytest.mark.parametrize("kv_mode", ["contiguous", "paged"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_with_shipped_heads_is_lossless_on_the_bundled_model(bundled, bench_prompts, plain_greedy_ids, kind,
                                                                    kv_mode, one_torch_thread):
    engine = Engine(bundled, EngineConfig(kv_mode=kv_mode, block_size=4))
    params = SamplingParams(max_new_tokens=LOSSLESS_TOKENS, ignore_eos=True)
    for name in ("chat-short-1", "code-2"):
        row = bench_prompts[name]
        prompt_ids = engine.prompt_ids(row["prompt"], row.get("system"))
        plain = plain_greedy_ids(engine, name, prompt_ids, params)
        # The contiguous cache runs the tree only: its rollback of a chain is covered in test_speculative, while
        # moving a leaf's KV next to its parent (copy_token) is each cache's own code.
        chains = (SpecConfig(kind, k=3),) if kv_mode == "paged" else ()
        for spec in (*chains, SpecConfig(kind, k=3, tree_width=4)):
            fast = engine.complete(prompt_ids, params, spec=spec)
            assert fast.token_ids == plain, (name, spec)
            counts = fast.stats.spec
            assert counts["accepted_by_position"][0] > 0 and counts["accepted"] < counts["drafted"]  # both outcomes
    assert_nothing_held(engine)
