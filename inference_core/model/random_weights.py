"""Random-weight checkpoints at real models' shapes, for speed benchmarks on machines that cannot reach the Hub.

Decode speed depends on a model's shapes and dtype, not on what its weights say, so a GPU machine without network
can still measure our engine and transformers at Qwen3-0.6B's or Llama-3-8B's size. `write_random_checkpoint` writes
a Hugging Face directory that both load: `config.json` with the published shape, `model.safetensors` with seeded
normal(0, 0.02) matrices and unit norms (transformers' own initialization), and a tokenizer: the bundled model's
(SmolLM2's byte-level BPE and ChatML template), its vocabulary padded with plain tokens `<r{id}>` up to the
preset's size so that every id the model can emit decodes. Where the bundled model is not installed (a bare GPU
machine with only this repository), a word-level tokenizer stands in: the words of the packaged benchmark prompts,
ChatML's special tokens and a ChatML template, so prompts come to about as many tokens as with a real tokenizer. The
text such a model generates is meaningless.

    python -m inference_core random-weights --preset qwen3-0.6b --out DIR [--dtype bfloat16] [--tokenizer DIR]

Where the tokenizer files are already in DIR (carried to a machine without the bundled model), they are kept.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from inference_core.config import ConfigError
from inference_core.model.checkpoint import resolve_model_dir
from inference_core.model.paths import DATA_DIR

# Published configurations (the models' config.json), the fields our loader and transformers read.
PRESETS = {
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       max_position_embeddings=40960, tie_word_embeddings=True, attention_bias=False),
    "qwen3-1.7b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=2048,
                       intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       max_position_embeddings=40960, tie_word_embeddings=True, attention_bias=False),
    "llama-3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
                       max_position_embeddings=8192, tie_word_embeddings=False, attention_bias=False),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def layer_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes of one decoder layer (prefix `model.layers.{i}.`)."""
    hidden, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
              "self_attn.q_proj.weight": (q, hidden), "self_attn.k_proj.weight": (kv, hidden),
              "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, q),
              "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
              "mlp.down_proj.weight": (hidden, inter)}
    if config["model_type"] == "qwen3":
        shapes |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
    return shapes


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if len(shape) == 1:  # norms start at one
        return torch.ones(shape, dtype=dtype)
    drawn = torch.empty(shape, device=generator.device).normal_(0.0, 0.02, generator=generator)
    return drawn.to(dtype).cpu()


def pad_tokenizer(source: Path, out_dir: Path, vocab_size: int) -> None:
    """Copy the tokenizer files, adding plain vocabulary entries `<r{id}>` up to `vocab_size` ids."""
    data = json.loads((source / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    taken = set(vocab.values()) | {token["id"] for token in data["added_tokens"]}
    if max(taken) >= vocab_size:
        raise ConfigError(f"the tokenizer in {source} has ids up to {max(taken)}, more than a vocabulary of "
                          f"{vocab_size}.")
    vocab.update({f"<r{i}>": i for i in range(vocab_size) if i not in taken})
    (out_dir / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    for name in TOKENIZER_FILES[1:]:
        if (source / name).is_file():
            shutil.copy(source / name, out_dir / name)


STAND_IN = "stand-in"  # `tokenizer=`: the word-level stand-in, whether or not the bundled model is installed
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                   "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_word_level_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A stand-in tokenizer: ChatML's special tokens, every word and punctuation mark of the packaged benchmark
    prompts, then `<r{id}>` up to `vocab_size`; an unknown word becomes `<|endoftext|>`'s neighbour `<unk>`."""
    splitter = pre_tokenizers.Whitespace()
    rows = [json.loads(line) for line in (DATA_DIR / "bench_prompts.jsonl").read_text().splitlines() if line.strip()]
    words = sorted({word for row in rows for text in (row["prompt"], row.get("system") or "")
                    for word, _ in splitter.pre_tokenize_str(text)})
    names = [*SPECIAL_TOKENS, "<unk>", *words]
    names += [f"<r{i}>" for i in range(len(names), vocab_size)]
    if len(names) > vocab_size:
        raise ConfigError(f"a vocabulary of {vocab_size} is too small for the stand-in tokenizer's {len(names)} words.")
    tokenizer = Tokenizer(models.WordLevel({name: i for i, name in enumerate(names)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = splitter
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|im_end|>",
                                                               "pad_token": "<|endoftext|>"}))
    (out_dir / "chat_template.jinja").write_text(CHATML_TEMPLATE)


def write_random_checkpoint(preset: str, out_dir: str | Path, dtype: str = "bfloat16", seed: int = 0,
                            tokenizer: str | Path | None = None, device: str | torch.device = "cpu",
                            **overrides) -> Path:
    """Write a random-weight checkpoint of `preset` (a PRESETS key; `overrides` change config fields, e.g. fewer
    layers for a test) to `out_dir`; returns the directory. The weights are drawn on `device` (a GPU draws an 8B
    model's in a second; the CPU takes a minute)."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}.")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ConfigError(f"unknown dtype {dtype!r}; use bfloat16, float16 or float32.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = (PRESETS[preset] | overrides)["vocab_size"]
    if not (out / "tokenizer.json").is_file():
        if tokenizer is None:
            try:
                tokenizer = resolve_model_dir("bundled")
            except ConfigError:  # not installed here
                tokenizer = STAND_IN
        if tokenizer == STAND_IN:
            write_word_level_tokenizer(out, vocab_size)
        else:
            pad_tokenizer(Path(tokenizer), out, vocab_size)
    with open(out / "tokenizer_config.json") as handle:
        special = json.load(handle)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    config = PRESETS[preset] | overrides | {
        "bos_token_id": vocab.get(special.get("bos_token")), "eos_token_id": vocab.get(special.get("eos_token")),
        "torch_dtype": dtype, "hidden_act": "silu", "initializer_range": 0.02, "use_cache": True}
    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator(device).manual_seed(seed)
    tensors = {"model.embed_tokens.weight": _tensor((config["vocab_size"], config["hidden_size"]), torch_dtype,
                                                    generator),
               "model.norm.weight": torch.ones(config["hidden_size"], dtype=torch_dtype)}
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = _tensor((config["vocab_size"], config["hidden_size"]), torch_dtype, generator)
    for index in range(config["num_hidden_layers"]):
        for name, shape in layer_shapes(config).items():
            tensors[f"model.layers.{index}.{name}"] = _tensor(shape, torch_dtype, generator)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def add_random_weights_arguments(parser: argparse.ArgumentParser) -> None:
    """`python -m inference_core random-weights`'s flags."""
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--out", required=True, help="directory to write (its tokenizer files are kept if present)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", help="directory with the tokenizer to pad, or 'stand-in' for the word-level "
                        "one (default: the bundled model's, else the stand-in)")


def run_random_weights(args: argparse.Namespace) -> int:
    out = write_random_checkpoint(args.preset, args.out, args.dtype, args.seed, args.tokenizer)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"{args.preset} with random weights in {args.dtype}: {out} ({size / 2**30:.2f} GiB)")
    return 0
