"""`python -m inference_core quality` (`inference_core.bench.quality`): perplexity held to transformers on the same
weights (one chunk, several chunks, the bundled model on the start of the eval text), int8 weights and an int8 KV
cache moving it a little, greedy agreement's arithmetic and the reference agreeing with itself, and the CLI's rows,
JSON and bad flags."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
import torch.nn.functional as F

import inference_core
from inference_core import EngineConfig
from inference_core.cli import main
from inference_core.bench.quality import (COLUMNS, EVAL_TEXT, eval_token_ids, greedy_agreement, greedy_generations,
                                    perplexity)
from inference_core.quant.linear import QuantConfig, compute_dtype
from inference_core.quant.quantize import quantize

from tiny_models import TINY, write_word_level_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 2-layer Llama (context 512, vocabulary 256): transformers' model and our fp32 load of it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("tiny-quality")
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=False)).eval()
    hf_model.save_pretrained(str(directory))
    write_word_level_tokenizer(directory)
    return hf_model, inference_core.load_model(str(directory), device="cpu", dtype="float32")


def random_text(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(length)]


@torch.no_grad()
def transformers_nll_sum(hf_model, ids: list[int]) -> float:
    """transformers' summed NLL (nats) of ids[1:], each given the ids before it: one plain forward, scored in fp64."""
    logits = hf_model(torch.tensor([ids])).logits[0, :-1].double()  # [len - 1, vocab]
    return F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item()


@pytest.mark.parametrize("kv_mode", ["paged", "contiguous"])
def test_perplexity_of_one_chunk_equals_transformers(tiny, kv_mode):
    hf_model, loaded = tiny
    ids = random_text(300)
    # Slices of 64 tokens: every slice after the first attends to K/V that earlier slices left in the cache.
    result = perplexity(loaded, EngineConfig(kv_mode=kv_mode), ids, slice_tokens=64)
    assert (result.window, result.num_chunks, result.num_predicted) == (512, 1, 299)
    assert result.perplexity == pytest.approx(math.exp(transformers_nll_sum(hf_model, ids) / 299), rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(result.mean_nll), rel=1e-12)


def test_chunks_are_scored_each_from_their_own_start(tiny):
    hf_model, loaded = tiny
    ids = random_text(257, seed=1)
    result = perplexity(loaded, EngineConfig(), ids, window=128, slice_tokens=50)
    # Chunks of 128, 128 and 1 tokens: 127 + 127 predictions; the last chunk has nothing to predict.
    assert (result.num_chunks, result.num_predicted) == (2, 254)
    want = (transformers_nll_sum(hf_model, ids[:128]) + transformers_nll_sum(hf_model, ids[128:256])) / 254
    assert result.perplexity == pytest.approx(math.exp(want), rel=1e-5)
    # The second chunk really starts afresh: with its context carried over, the number is another one.
    unchunked = transformers_nll_sum(hf_model, ids[:256]) / 255
    assert abs(math.exp(unchunked) / result.perplexity - 1) > 1e-3


def test_int8_weights_and_int8_kv_cache_move_perplexity_a_little(tiny):
    _, loaded = tiny
    ids = random_text(200, seed=2)
    reference = perplexity(loaded, EngineConfig(), ids)
    int8_weights = perplexity(quantize(loaded, QuantConfig("int8")), EngineConfig(), ids)
    int8_kv = perplexity(loaded, EngineConfig(kv_dtype="int8"), ids)
    for other in (int8_weights, int8_kv):
        assert other.perplexity != reference.perplexity
        assert other.perplexity == pytest.approx(reference.perplexity, rel=0.01)
    # 2 layers x K and V x 2 KV heads x 16 dims: 4 bytes each in fp32; int8 adds one fp32 scale per head.
    assert (reference.kv_bytes_per_token, int8_kv.kv_bytes_per_token) == (2 * 2 * 2 * 16 * 4, 2 * 2 * 2 * (16 + 4))


def test_greedy_agreement_counts_reference_ids_before_the_first_difference():
    reference = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    agreement = greedy_agreement(reference, [[5, 6, 0, 8], [9, 10], [11, 12]])  # differs at 2, same, ends at 2
    assert agreement.first_divergence == [2, None, 2]
    assert agreement.greedy_agreement == pytest.approx((2 + 2 + 2) / (4 + 2 + 3))
    nothing = greedy_agreement(reference, [[0], [0, 10], [0, 12, 13]])
    assert (nothing.first_divergence, nothing.greedy_agreement) == ([0, 0, 0], 0.0)
    with pytest.raises(ValueError, match="3 reference outputs but 1 candidate"):
        greedy_agreement(reference, [[5]])


def test_the_reference_agrees_with_itself(tiny):
    _, loaded = tiny
    prompts = [random_text(10, seed) for seed in range(3)]
    first = greedy_generations(loaded, EngineConfig(), prompts, max_new_tokens=12)
    second = greedy_generations(loaded, EngineConfig(kv_mode="contiguous"), prompts, max_new_tokens=12)
    assert all(1 <= len(ids) <= 12 for ids in first)
    agreement = greedy_agreement(first, second)
    assert (agreement.greedy_agreement, agreement.first_divergence) == (1.0, [None, None, None])


def test_cli_prints_the_table_and_writes_rows_and_host(tiny, tmp_path, capsys):
    _, loaded = tiny
    prompts, path = tmp_path / "prompts.jsonl", tmp_path / "quality.json"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "kind": "completion", "prompt": f"t5 t{9 + i} t33 t7"})
                               + "\n" for i in range(2)))
    assert main(["quality", "--model", loaded.name, "--device", "cpu", "--quant", "none,int8", "--kv-dtype",
                 "auto,int8", "--window", "64", "--eval-tokens", "150", "--max-new-tokens", "6", "--prompts",
                 str(prompts), "--json", str(path)]) == 0
    assert "greedy_agreement" in capsys.readouterr().out
    report = json.loads(path.read_text())
    assert report["dtype"] == "float32" and report["torch"] == torch.__version__
    assert report["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert (report["eval_tokens"], report["window"], report["prompts"]) == (150, 64, ["p0", "p1"])
    rows = report["rows"]
    assert [row["name"] for row in rows] == ["reference", "kv int8", "int8", "int8 + kv int8"]
    assert all(list(row) == list(COLUMNS) for row in rows)
    reference = rows[0]
    assert (reference["delta_pct"], reference["greedy_agreement"], reference["diverged"]) == (0.0, 1.0, 0)
    assert reference["first_divergence"] is None
    assert [row["kv_bytes_per_token"] for row in rows] == [512, 160, 512, 160]
    activations = str(compute_dtype("cpu", torch.float32)).removeprefix("torch.")  # measured once per process
    assert [row["activations"] for row in rows] == ["float32", "float32", activations, activations]
    assert rows[2]["weights_mib"] < rows[0]["weights_mib"] == rows[1]["weights_mib"]
    assert report["first_divergence_by_prompt"]["reference"] == {"p0": None, "p1": None}
    assert main(["quality", "--model", loaded.name, "--device", "cpu", "--quant", "int4", "--no-quant-lm-head",
                 "--window", "64", "--eval-tokens", "150", "--no-agreement", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [row["name"] for row in rows] == ["reference", "int4 g32 (LM head in the model dtype)"]


def test_cli_reads_any_text_and_measures_an_int4_cache_and_sinks(tiny, tmp_path, capsys):
    """`--eval-text` scores any file; an int4 KV row carries its KL divergence from the model-dtype cache (a
    reference row has none); `--sliding-window` and `--attention-sinks` apply to every row and are recorded."""
    _, loaded = tiny
    text, path = tmp_path / "text.txt", tmp_path / "quality.json"
    text.write_text(" ".join(f"t{(7 * i) % 40}" for i in range(300)))
    argv = ["quality", "--model", loaded.name, "--device", "cpu", "--quant", "none", "--kv-dtype", "auto,int4",
            "--window", "128", "--slice-tokens", "16", "--eval-text", str(text), "--no-agreement", "--json", str(path)]
    assert main(argv) == 0
    report = json.loads(path.read_text())
    assert (report["eval_text"], report["slice_tokens"]) == ("text.txt", 16)
    reference, int4_kv = report["rows"]
    assert int4_kv["name"] == "kv int4" and reference["kv_kl"] is None and int4_kv["kv_kl"] > 0
    assert int4_kv["perplexity"] != reference["perplexity"] and abs(int4_kv["delta_pct"]) < 10
    assert int4_kv["kv_bytes_per_token"] == 2 * 2 * (16 + 4 + 4)  # 16-token blocks, one value group a head
    assert main(argv[:-2] + ["--sliding-window", "32", "--attention-sinks", "4", "--json", str(path)]) == 0
    windowed = json.loads(path.read_text())
    assert (windowed["sliding_window"], windowed["attention_sinks"]) == (32, 4)
    assert windowed["rows"][0]["perplexity"] != reference["perplexity"]
    capsys.readouterr()
    assert main(argv[:-2] + ["--eval-text", str(tmp_path / "missing.txt")]) == 2
    assert "--eval-text: no file at" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--quant", "int3"], "--quant: unknown value 'int3'"),
    (["--kv-dtype", "auto,fp8"], "--kv-dtype: unknown value 'fp8'"),
    (["--window", "1"], "--window must be at least 2"),
    (["--slice-tokens", "0"], "--slice-tokens must be at least 1"),
    (["--prompt-ids", "chat-short-1,nope"], "--prompt-ids: unknown value 'nope'"),
])
def test_cli_bad_values_name_their_flag(argv, message, capsys):
    assert main(["quality", *argv]) == 2  # refused before any model loads
    assert message in capsys.readouterr().err


def test_bundled_perplexity_equals_transformers_on_the_eval_text(bundled, one_torch_thread):
    from inference_core.bench.speed import load_hf_model
    from inference_core.model.checkpoint import resolve_model_dir

    ids = eval_token_ids(bundled.tokenizer)
    assert len(ids) == 12065 > bundled.config.max_position_embeddings  # one chunk fills the whole context
    assert EVAL_TEXT.read_text().startswith("First Citizen:\nBefore we proceed any further, hear me speak.")
    ids = ids[:256]
    ours = perplexity(bundled, EngineConfig(), ids, slice_tokens=100)
    want = math.exp(transformers_nll_sum(load_hf_model(bundled, resolve_model_dir("bundled")), ids) / 255)
    assert ours.perplexity == pytest.approx(want, rel=1e-4)
    int8_kv = perplexity(bundled, EngineConfig(kv_dtype="int8"), ids, slice_tokens=100)
    assert int8_kv.perplexity != ours.perplexity and int8_kv.perplexity == pytest.approx(ours.perplexity, rel=0.01)
