"""`python -m inference_core train-draft --kind medusa|eagle`: train draft heads for a model on its own answers.

1. Data (`inference_core.training.draft_data`): the model's answers to varied chat prompts, made with our engine in
   batches (`--data FILE` reuses a file; otherwise `--prompts N` answers are generated and saved there), plus passages
   of the shipped public-domain calibration text. The benchmark prompts and the quality evaluation's text stay out.
2. Targets: one forward of the frozen model over every sequence gives its final-normed hidden state f_t at every
   position and, through its LM head, the log-normalizer of its next-token distribution there (kept beside the data
   file, so training the other kind on the same data reuses them). The draft vocabulary is the `--draft-vocab` tokens
   the model most often predicts (its argmax over the training positions).
3. Training, the model frozen, on its distributions (soft labels, restricted to the draft vocabulary), from the
   answers' positions only: the chat template and the prompts are not what a draft guesses at, and the template's
   fixed system prompt would flatter the held-out numbers.
   - medusa: head i at position t learns the model's distribution at position t + i (the token i+1 places after the
     one predicted at t); the heads' losses are weighted 0.8^i as in the Medusa paper.
   - eagle: at position j the layer reads (f_j with a little noise, the embedding of token j+1) and learns both f_{j+1}
     (smooth L1) and the model's distribution at j+1 (weight `--cls-weight`); noise makes it robust to its own
     estimates, which it reads in place of f from the second draft on. `--unroll S` trains those drafts as they
     run (training-time test, as EAGLE-3): step s reads the layer's own outputs and attends to its own keys, as the
     drafter does s tokens ahead, and learns the same targets (weighted 0.8^(s-1)).
   AdamW with a linear warm-up and cosine decay; a held-out share of the sequences gives the validation top-1
   agreement (the share of answer positions where the head's first guess is the model's own greedy token) per head.
4. Output: the weights (`--out`, default the user cache where engines look for them: `draft_heads.find_heads`), a
   loss curve (CSV, one row per logged step) and a JSON report (data, steps, losses, agreement, times) beside them.

A tqdm progress bar shows each phase. On a GPU pass `--device cuda`; larger models train the same way.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from inference_core.config import ConfigError, EngineConfig, parse_dtype
from inference_core.engine.engine import make_kv_cache
from inference_core.engine.runner import ModelRunner
from inference_core.model.dtype_choice import choose_dtype
from inference_core.model.loader import add_model_arguments, load_model
from inference_core.model.paths import cache_root
from inference_core.sequence import Sequence
from inference_core.spec.draft_heads import (DRAFT_KINDS, DraftHeads, build_network, fingerprint, heads_file_name,
                                             lm_head_rows)
from inference_core.training import draft_data

MEDUSA_DECAY = 0.8


GROUPS_PER_FILE = 10 ** 7  # the answers of file n are grouped by prompt as n * GROUPS_PER_FILE + the prompt's index


def text_sequences(tokenizer, tokens_per_sequence: int = 256) -> list[list[int]]:
    """The shipped calibration text (public domain) as plain-text token windows."""
    ids = tokenizer.encode((draft_data.DATA / "calibration_text.txt").read_text())
    return [ids[start:start + tokens_per_sequence] for start in range(0, len(ids) - 32, tokens_per_sequence)]


@torch.inference_mode()
def model_targets(loaded, sequences: list[list[int]], batch_tokens: int = 4096, progress: bool = True):
    """Per sequence: the final-normed hidden states [T, hidden] (fp32, on the CPU), the log-normalizer of the
    next-token distribution at each position [T] and the model's greedy next token there [T]."""
    longest = max(len(ids) for ids in sequences)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    batches, current, tokens = [], [], 0
    for index in order:
        if current and tokens + len(sequences[index]) > batch_tokens:
            batches.append(current)
            current, tokens = [], 0
        current.append(index)
        tokens += len(sequences[index])
    batches.append(current)
    config = EngineConfig(kv_mode="contiguous", max_num_seqs=max(len(b) for b in batches), max_seq_len=longest)
    runner = ModelRunner(loaded.model, make_kv_cache(loaded, config, longest), loaded.device)
    head = lm_head_rows(loaded.model, torch.arange(loaded.config.vocab_size, device=loaded.device)).float()
    # Every sequence's results are views into three tensors over all positions: a million small tensors kept
    # between each batch's large passing ones fragment the heap (measured: 20 KB resident per position kept, for
    # 2.3 KB of hidden state; a million positions ran this 24 GiB machine out of memory).
    offsets = [0]
    for ids in sequences:
        offsets.append(offsets[-1] + len(ids))
    features = torch.empty(offsets[-1], loaded.config.hidden_size)
    log_normalizers, greedy = torch.empty(offsets[-1]), torch.empty(offsets[-1], dtype=torch.long)
    results: list = [None] * len(sequences)
    bar = tqdm(total=offsets[-1], desc="targets", unit="tok", disable=not progress)
    for batch in batches:
        seqs = [Sequence(list(sequences[i]), num_prompt_tokens=len(sequences[i])) for i in batch]
        for seq in seqs:
            runner.kv_cache.allocate(seq)
        try:
            _, hidden = runner.run(seqs, return_hidden=True)
        finally:
            for seq in seqs:
                runner.kv_cache.free(seq)
        for index, states in zip(batch, hidden):
            logits = states.float() @ head.t()
            span = slice(offsets[index], offsets[index + 1])
            features[span] = states
            log_normalizers[span] = torch.logsumexp(logits, -1)
            greedy[span] = logits.argmax(-1)
            results[index] = (features[span], log_normalizers[span], greedy[span])
            bar.update(len(states))
    bar.close()
    return results


def draft_vocabulary(targets, size: int, eos_ids) -> tuple[torch.Tensor, float]:
    """The `size` tokens the model most often predicts (end-of-sequence ids always in), sorted; and the share of
    training positions whose greedy token it covers."""
    counts = torch.bincount(torch.cat([greedy for _, _, greedy in targets]))
    ranked = counts.argsort(descending=True)
    ids = torch.tensor(sorted(set(ranked[:size - len(eos_ids)].tolist()) | set(int(i) for i in eos_ids)))
    covered = counts[ids[ids < len(counts)]].sum() / counts.sum()
    return ids, float(covered)


def _soft_cross_entropy(scores, target_scores, target_lse, mask):
    """Mean over masked rows of -sum_v p(v) log q(v), p the model's probabilities on the draft vocabulary (the mass
    outside it is left out), q the heads' softmax over the draft vocabulary."""
    p = torch.exp(target_scores - target_lse[:, None])
    loss = -(p * F.log_softmax(scores, -1)).sum(-1)
    return (loss * mask).sum() / mask.sum().clamp(min=1)


def _schedule(step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


class _Flat:
    """Every training sequence's targets concatenated, with the index of the position `i` places later in the same
    sequence (-1 past its end) and the positions to learn from (`learn`: from each sequence's start on)."""

    def __init__(self, targets, starts: list[int], max_ahead: int):
        self.features = torch.cat([f for f, _, _ in targets])
        self.lse = torch.cat([lse for _, lse, _ in targets])
        self.greedy = torch.cat([g for _, _, g in targets])
        index, learn = 0, []
        ahead = [[] for _ in range(max_ahead + 1)]
        for (features, _, _), start in zip(targets, starts):
            length = len(features)
            positions = torch.arange(length)
            for i in range(max_ahead + 1):
                later = positions + i
                ahead[i].append(torch.where(later < length, later + index, -1))
            learn.append(positions >= start)
            index += length
        self.ahead = [torch.cat(parts) for parts in ahead]
        self.learn = torch.cat(learn).nonzero().squeeze(1)  # flat indices of the positions to learn from


def train_medusa(heads_net, rows, flat: _Flat, *, num_heads, steps, batch_size, lr, seed, bar, log):
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(heads_net.parameters(), lr=lr, weight_decay=0.0)
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * _schedule(step, steps, max(1, steps // 20))
        index = flat.learn[torch.randint(0, len(flat.learn), (batch_size,), generator=generator)]
        guesses = heads_net(flat.features[index])  # [batch, heads, hidden]
        loss, parts = 0.0, []
        for i in range(num_heads):
            later = flat.ahead[i + 1][index]
            mask = (later >= 0).float()
            later = later.clamp(min=0)
            with torch.no_grad():
                target_scores = flat.features[later] @ rows.t()
            part = _soft_cross_entropy(guesses[:, i] @ rows.t(), target_scores, flat.lse[later], mask)
            loss = loss + MEDUSA_DECAY ** i * part
            parts.append(part.item())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        log(step, loss.item(), parts)


def _eagle_batches(lengths: list[int], batch_tokens: int, seed: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, current = [], []
    for index in order:
        if current and (len(current) + 1) * lengths[index] > batch_tokens:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    random.Random(seed).shuffle(batches)
    return batches


def _eagle_batch(layer_inputs, indices):
    """Pad sequences `indices` of (features, lse, token ids, start) to one [batch, T, ...] block with a mask of the
    positions to learn (from each sequence's start to its end)."""
    longest = max(len(layer_inputs[i][0]) for i in indices)
    hidden = layer_inputs[indices[0]][0].shape[-1]
    features = torch.zeros(len(indices), longest, hidden)
    lse = torch.zeros(len(indices), longest)
    ids = torch.zeros(len(indices), longest, dtype=torch.long)
    mask = torch.zeros(len(indices), longest)
    for row, index in enumerate(indices):
        f, l, t, start = layer_inputs[index]
        features[row, :len(f)], lse[row, :len(f)], ids[row, :len(f)], mask[row, start:len(f)] = f, l, t, 1
    return features, lse, ids, mask


def eagle_loss(layer, model, rows, features, lse, ids, mask, noise: float, cls_weight: float, generator=None,
               unroll: int = 1):
    """The EAGLE objective on padded sequences: position j reads (f_j + noise, e(x_{j+1})) and learns f_{j+1} and the
    model's distribution there. With `unroll` > 1 (training-time test, `EagleLayer.unrolled`), step s learns the same
    targets from its own estimates as a draft s tokens ahead reads them, weighted 0.8^(s-1). Returns (loss, the first
    step's regression part, its classification part, each step's top-1 agreement)."""
    inputs = features[:, :-1]
    if noise:
        inputs = inputs + (torch.rand(inputs.shape, generator=generator) * 2 - 1) * noise
    embeddings = model.embed_tokens.weight[ids[:, 1:]].float()
    cos, sin = (table[:inputs.shape[1]].float().unsqueeze(1) for table in model.rope_tables(torch.float32))
    outputs = layer.unrolled(inputs, embeddings, cos, sin, unroll) if unroll > 1 else \
        [layer(inputs, embeddings, cos, sin)]  # [batch, T-1, hidden] each
    target = features[:, 1:]
    with torch.no_grad():
        target_scores = target.reshape(-1, target.shape[-1]) @ rows.t()
    total, agreements = 0.0, []
    for step, out in enumerate(outputs):
        valid = mask[:, 1:].clone()
        valid[:, :step] = 0  # step s starts from position s-1
        regression = (F.smooth_l1_loss(out, target, reduction="none").mean(-1) * valid).sum() / valid.sum()
        scores = out.reshape(-1, out.shape[-1]) @ rows.t()
        flat_valid = valid.reshape(-1)
        classification = _soft_cross_entropy(scores, target_scores, lse[:, 1:].reshape(-1), flat_valid)
        total = total + MEDUSA_DECAY ** step * (regression + cls_weight * classification)
        if step == 0:
            first_parts = regression.item(), classification.item()
        agreements.append((((scores.argmax(-1) == target_scores.argmax(-1)).float() * flat_valid).sum()
                           / flat_valid.sum()).item())
    return total, *first_parts, agreements


def train_eagle(layer, model, rows, layer_inputs, *, steps, batch_tokens, lr, seed, noise, cls_weight, unroll, bar,
                log):
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=lr, weight_decay=0.0)
    batches: list[list[int]] = []
    for step in range(steps):
        if not batches:
            batches = _eagle_batches([len(f) for f, _, _, _ in layer_inputs], batch_tokens, seed + step)
        for group in optimizer.param_groups:
            group["lr"] = lr * _schedule(step, steps, max(1, steps // 20))
        loss, regression, classification, agree = eagle_loss(layer, model, rows,
                                                             *_eagle_batch(layer_inputs, batches.pop()),
                                                             noise, cls_weight, generator, unroll)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(layer.parameters(), 1.0)
        optimizer.step()
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", agree="/".join(f"{a:.2f}" for a in agree))
        log(step, loss.item(), [regression, classification, *agree])


@torch.no_grad()
def medusa_agreement(heads_net, rows, vocab_ids, flat: _Flat, num_heads: int) -> list[float]:
    """Per head: the share of positions whose first guess is the model's greedy token that many places later."""
    agreement = []
    guesses = torch.cat([heads_net(chunk) for chunk in flat.features[flat.learn].split(4096)])
    for i in range(num_heads):
        later = flat.ahead[i + 1][flat.learn]
        valid = later >= 0
        top = vocab_ids[(guesses[valid, i] @ rows.t()).argmax(-1)]
        agreement.append(float((top == flat.greedy[later[valid]]).float().mean()))
    return agreement


@torch.no_grad()
def eagle_agreement(layer, model, rows, vocab_ids, targets, sequences, starts, steps: int = 2) -> list[float]:
    """Per draft step: the share of positions (from each sequence's start) where the layer's guess is the model's own
    greedy token. The first step reads the model's true hidden states; step s reads the layer's own estimates as a
    draft s tokens ahead does (`EagleLayer.unrolled`), after the data's tokens (the drafts before it accepted)."""
    agree, total = [0] * steps, [0] * steps
    for (features, _, greedy), ids, start in zip(targets, sequences, starts):
        if len(features) - 1 <= start:
            continue
        cos, sin = (table[:len(features) - 1].float().unsqueeze(1) for table in model.rope_tables(torch.float32))
        outputs = layer.unrolled(features[None, :-1], model.embed_tokens.weight[torch.tensor(ids[1:])][None].float(),
                                 cos, sin, steps)
        for step, out in enumerate(outputs):
            first = max(start, step)
            agree[step] += int((vocab_ids[(out[0] @ rows.t()).argmax(-1)] == greedy[1:])[first:].sum())
            total[step] += max(0, len(features) - 1 - first)
    return [a / max(t, 1) for a, t in zip(agree, total)]


def validation_split(groups, validation: float, seed: int) -> tuple[list[int], list[int]]:
    """Indices of the sequences to train on and to hold out, given each sequence's group: a `validation` share of the
    groups (at least one), chosen by `seed`, is held out whole."""
    groups = list(groups)
    names = sorted(set(groups))
    random.Random(seed).shuffle(names)
    held = set(names[:max(1, int(len(names) * validation))])
    train_ids = [i for i, group in enumerate(groups) if group not in held]
    return train_ids, [i for i, group in enumerate(groups) if group in held]


def train_heads(loaded, kind: str, sequences: list[list[int]], starts: list[int] | None = None, targets=None, *,
                steps: int, num_heads: int = 4, draft_vocab: int = 8192, lr: float = 1e-3, batch_size: int = 512,
                batch_tokens: int = 4096, noise: float = 0.1, cls_weight: float = 1.0, unroll: int = 1,
                validation: float = 0.05, groups: list[int] | None = None, log_every: int = 10, seed: int = 0,
                progress: bool = True) -> tuple[DraftHeads, list[dict]]:
    """Train `kind` heads for `loaded` (frozen) on token sequences, learning from position `starts[i]` of sequence i
    on (an answer's first prediction: the model's chat template and the prompt are not what it drafts; default 0);
    `targets` are `model_targets(loaded, sequences)` where already computed. A `validation` share of the sequences is
    held out, whole groups at a time where `groups` gives each sequence's (its prompt: its greedy and sampled answers
    are both trained on or both held out). Returns the heads (their `meta` the training report) and the loss curve
    rows."""
    torch.manual_seed(seed)
    starts = list(starts) if starts is not None else [0] * len(sequences)
    targets_started = time.perf_counter()
    targets = targets if targets is not None else model_targets(loaded, sequences, progress=progress)
    targets_s = time.perf_counter() - targets_started
    train_ids, held_ids = validation_split(groups if groups is not None else range(len(sequences)), validation, seed)
    order, num_val = held_ids + train_ids, len(held_ids)
    sequences, starts, targets = ([items[i] for i in order] for items in (sequences, starts, targets))
    train_targets, val_targets = targets[num_val:], targets[:num_val]
    model = loaded.model
    vocab_ids, coverage = draft_vocabulary(train_targets, draft_vocab, loaded.eos_token_ids)
    rows = lm_head_rows(model, vocab_ids).float()
    positions = sum(max(0, len(f) - start) for (f, _, _), start in zip(train_targets, starts[num_val:]))
    if progress:
        print(f"train-draft: {positions} positions to learn from in {len(train_targets)} sequences ({num_val} held "
              f"out); draft vocabulary {len(vocab_ids)} tokens covers {100 * coverage:.1f}% of the model's greedy "
              f"tokens", flush=True)
    network = build_network(kind, loaded.config, num_heads)
    network.requires_grad_(True)
    curve: list[dict] = []
    columns = [f"head{i + 1}" for i in range(num_heads)] if kind == "medusa" else \
        ["regression", "classification", "agreement", *(f"agreement{s}" for s in range(2, unroll + 1))]

    def log(step: int, loss: float, parts: list[float]) -> None:
        if step % log_every == 0 or step == steps - 1:
            curve.append({"step": step, "loss": round(loss, 5), **{c: round(v, 5) for c, v in zip(columns, parts)}})

    train_started = time.perf_counter()
    bar = tqdm(total=steps, desc=f"train {kind}", unit="step", disable=not progress)
    if kind == "medusa":
        train_medusa(network, rows, _Flat(train_targets, starts[num_val:], num_heads), num_heads=num_heads,
                     steps=steps, batch_size=batch_size, lr=lr, seed=seed, bar=bar, log=log)
        agreement = medusa_agreement(network, rows, vocab_ids, _Flat(val_targets, starts[:num_val], num_heads),
                                     num_heads)
    else:
        inputs = [(f, lse, torch.tensor(ids), start) for (f, lse, _), ids, start
                  in zip(train_targets, sequences[num_val:], starts[num_val:])]
        train_eagle(network, model, rows, inputs, steps=steps, batch_tokens=batch_tokens, lr=lr, seed=seed,
                    noise=noise, cls_weight=cls_weight, unroll=unroll, bar=bar, log=log)
        agreement = eagle_agreement(network, model, rows, vocab_ids, val_targets, sequences[:num_val],
                                    starts[:num_val], max(2, unroll))
    bar.close()
    network.requires_grad_(False)
    report = {
        "kind": kind, "model": loaded.name, "fingerprint": fingerprint(loaded.config),
        "heads": num_heads if kind == "medusa" else 1, "draft_vocab": len(vocab_ids),
        "draft_vocab_coverage": round(coverage, 4),
        "data": {"sequences": len(sequences), "held_out_sequences": num_val, "training_positions": positions,
                 "learned_from": "answers (and the plain text), not the chat template and prompts"},
        "steps": steps, "lr": lr, "seed": seed,
        "batch": f"{batch_size} positions" if kind == "medusa" else f"{batch_tokens} tokens",
        "final_loss": curve[-1]["loss"] if curve else None,
        "validation_top1_agreement": [round(a, 4) for a in agreement],
        "seconds": {"targets": round(targets_s), "train": round(time.perf_counter() - train_started)},
        "device": str(loaded.device), "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    if kind == "eagle":
        report.update(noise=noise, cls_weight=cls_weight, unroll=unroll)
    return DraftHeads(kind, network.eval(), vocab_ids.to(loaded.device), report), curve


def _cached_targets(loaded, sequences: list[list[int]], data_path: Path):
    """`model_targets`, kept beside the data file (a few hundred MB for the bundled model's) so that training the
    other kind on the same data does not compute them again; recomputed when the model or the sequences differ."""
    key = hashlib.sha256(json.dumps([fingerprint(loaded.config), loaded.name, loaded.dtype_name, sequences]).encode()
                         ).hexdigest()[:16]
    path = data_path.with_name(f"{data_path.stem}.{key}.targets.pt")
    if path.is_file():
        print(f"train-draft: the model's hidden states and distributions from {path}", flush=True)
        return torch.load(path)
    targets = model_targets(loaded, sequences)
    torch.save(targets, path)
    return targets


def _answer_files(args, worker, model_name: str, temperatures: list[float]) -> tuple[list, float]:
    """The answer files of --data as [(path, answers)], the last one written first where it is missing (the model's
    answers to --prompts prompts of --prompt-set at each temperature); and the seconds that writing took."""
    paths = [Path(name) for name in args.data.split(",") if name.strip()] if args.data else \
        [cache_root() / "draft_data" / f"{Path(model_name).name}.jsonl"]
    missing = [path for path in paths[:-1] if not path.is_file()]
    if missing:
        raise ConfigError(f"--data: {', '.join(map(str, missing))} not found (only the last file named is written "
                          f"when missing).")
    files, generate_s = [], 0.0
    for path in paths:
        if path.is_file():
            files.append((path, draft_data.load(path)))
            print(f"train-draft: {len(files[-1][1])} answers from {path}", flush=True)
            continue
        prompts = draft_data.chat_prompts(args.prompts, seed=args.seed, prompt_set=args.prompt_set)
        generate_started = time.perf_counter()
        answers = []
        for temperature in temperatures:
            bar = tqdm(total=len(prompts), desc=f"answers at temperature {temperature:g}", unit="prompt")
            answers += draft_data.generate(worker, prompts, max_new_tokens=args.max_new_tokens,
                                           temperature=temperature, seed=args.seed, batch_size=args.data_batch,
                                           progress=lambda done, total: bar.update(done - bar.n))
            bar.close()
        generate_s = time.perf_counter() - generate_started
        path.parent.mkdir(parents=True, exist_ok=True)
        draft_data.save(path, answers)
        files.append((path, answers))
        print(f"train-draft: wrote {len(answers)} answers to {path} in {generate_s:.0f} s", flush=True)
    return files, generate_s


def _training_sequences(files, worker, heads: int, text: bool) -> tuple[list, list, list, list]:
    """From the answer files: the sequences to learn from (the first file's followed by the shipped text where `text`),
    the position each starts learning at, their groups (a prompt's answers held out together, the files' prompts
    apart) and the model's targets, cached beside each file."""
    sequences, starts, groups, targets = [], [], [], []
    for number, (path, answers) in enumerate(files):
        kept = [sample for sample in answers if len(sample["ids"]) > sample["prompt_tokens"] + heads + 1]
        file_sequences = [sample["ids"] for sample in kept]
        file_starts = [sample["prompt_tokens"] - 1 for sample in kept]  # the position predicting the first token
        file_groups = [number * GROUPS_PER_FILE + sample["prompt"] for sample in kept]
        if text and number == 0:
            plain = text_sequences(worker.tokenizer)
            file_sequences, file_starts = file_sequences + plain, file_starts + [0] * len(plain)
            file_groups += [-1 - i for i in range(len(plain))]
        sequences += file_sequences
        starts += file_starts
        groups += file_groups
        targets += _cached_targets(worker, file_sequences, path)
    return sequences, starts, groups, targets


def add_train_draft_arguments(parser: argparse.ArgumentParser) -> None:
    """`python -m inference_core train-draft`'s flags."""
    parser.add_argument("--kind", choices=("medusa", "eagle"), required=True)
    add_model_arguments(parser, dtype="float32")
    parser.add_argument("--data", help="answers as JSON lines (draft_data.save), comma-separated to train on several "
                                       "files; the last one is generated and saved there if missing (default: the "
                                       "user cache)")
    parser.add_argument("--prompts", type=int, default=800, help="prompts to answer when generating the data")
    parser.add_argument("--prompt-set", choices=draft_data.PROMPT_SETS, default="all",
                        help="which prompts to answer when generating the data: the task templates, the varied "
                             "requests (inference_core/training/varied_prompts.py) or both")
    parser.add_argument("--max-new-tokens", type=int, default=160, help="answer length when generating the data")
    parser.add_argument("--temperatures", default="0,0.7",
                        help="when generating the data: one answer per prompt at each of these temperatures, "
                             "comma-separated (0: greedy; a sampled answer adds what the model says less often)")
    parser.add_argument("--data-batch", type=int, default=128, help="requests per engine step when generating the data")
    parser.add_argument("--data-dtype", default="auto",
                        help="dtype of the model that writes the answers and computes the hidden states the heads "
                             "learn from (auto: as --dtype auto chooses; bf16 is about twice as fast as fp32 on a CPU "
                             "with native bf16 math); the heads train in --dtype")
    parser.add_argument("--no-text", dest="text", action="store_false",
                        help="leave out the shipped public-domain text")
    parser.add_argument("--heads", type=int, default=4, help="medusa: heads (the longest draft)")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="tokens the heads score (the most predicted)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=512, help="medusa: positions per step")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="eagle: padded tokens per step")
    parser.add_argument("--noise", type=float, default=0.1, help="eagle: uniform noise on the input hidden states")
    parser.add_argument("--cls-weight", type=float, default=1.0,
                        help="eagle: weight of the token loss (EAGLE used 0.1; on the bundled model 1.0 agreed "
                             "more often: 0.324 against 0.295 held out after 100 steps)")
    parser.add_argument("--unroll", type=int, default=1,
                        help="eagle: draft steps trained at each position (training-time test, as EAGLE-3): step s "
                             "reads the layer's own estimates, as the drafts after the first do; 1 trains on the "
                             "model's hidden states only")
    parser.add_argument("--validation", type=float, default=0.05, help="share of sequences held out")
    parser.add_argument("--log-every", type=int, default=10, help="steps between loss-curve rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="the weights file (default: the user cache, where engines find it)")


def run_train_draft(args) -> int:
    if args.kind not in DRAFT_KINDS:
        raise ConfigError(f"--kind must be one of {', '.join(DRAFT_KINDS)}.")
    if args.steps < 1 or args.heads < 1 or args.draft_vocab < 16 or args.unroll < 1:
        raise ConfigError("train-draft needs --steps >= 1, --heads >= 1, --unroll >= 1 and --draft-vocab >= 16.")
    try:
        temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
    except ValueError:
        temperatures = []
    if not temperatures or any(t < 0 for t in temperatures):
        raise ConfigError(f"--temperatures takes comma-separated temperatures >= 0 (e.g. 0,0.7), got "
                          f"{args.temperatures!r}.")
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    loaded = load_model(args.model, args.device, args.dtype)
    # The answers and the model's hidden states come from a copy in --data-dtype (bf16 writes them about twice as
    # fast on a CPU with native bf16 math); the heads train in --dtype against the model in --dtype.
    data_dtype = choose_dtype(loaded.device, loaded.config)[0] if args.data_dtype == "auto" else \
        parse_dtype(args.data_dtype)
    worker = loaded if data_dtype == loaded.dtype else load_model(args.model, args.device, data_dtype)
    files, generate_s = _answer_files(args, worker, loaded.name, temperatures)
    targets_started = time.perf_counter()
    sequences, starts, groups, targets = _training_sequences(files, worker, args.heads, args.text)
    targets_s = time.perf_counter() - targets_started
    samples = [sample for _, answers in files for sample in answers]
    heads, curve = train_heads(loaded, args.kind, sequences, starts, targets, steps=args.steps, num_heads=args.heads,
                               draft_vocab=args.draft_vocab, lr=args.lr, batch_size=args.batch_size,
                               batch_tokens=args.batch_tokens, noise=args.noise, cls_weight=args.cls_weight,
                               unroll=args.unroll, validation=args.validation, groups=groups,
                               log_every=args.log_every, seed=args.seed)
    report = heads.meta
    report["data"].update(answers=len(samples), data_files=[path.name for path, _ in files],
                          calibration_text=bool(args.text), model_dtype=worker.dtype_name,
                          temperatures=sorted({sample.get("temperature", 0.0) for sample in samples}))
    report["seconds"].update(generate=round(generate_s), targets=round(targets_s),
                             total=round(time.perf_counter() - started))
    report["arguments"] = {key: value for key, value in vars(args).items() if key != "command"}
    out = Path(args.out) if args.out else cache_root() / "draft_heads" / heads_file_name(loaded.name, args.kind)
    heads.save(out)
    curve_path = out.with_suffix(".loss.csv")
    with curve_path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(curve[0]))
        writer.writeheader()
        writer.writerows(curve)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    agreement = report["validation_top1_agreement"]
    print(f"train-draft: {args.kind} heads -> {out} ({out.stat().st_size / 2 ** 20:.1f} MiB); validation top-1 "
          f"agreement {', '.join(f'{a:.3f}' for a in agreement)}; loss curve {curve_path}", flush=True)
    return 0
