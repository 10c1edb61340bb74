"""`python -m inference_core generate`: the engine from the command line.

With `--batching none` (the default) it runs its prompts one after another on one engine (so a later prompt can hit
the prefix cache) and streams text to stdout. With `--batching static|dynamic|continuous` it submits every prompt at
once (`--priority` per prompt, lower first), steps the engine until all are done, then prints each prompt's text in
prompt order. Either way `--json` prints one JSON list with an object per prompt, in prompt order: `prompt`,
`token_ids`, `text`, `stats` (`GenerationStats.as_dict()`, with `preemptions`, `queue_ms`, `batch_size_mean`). Flags
that would do nothing together are refused with a message that says what to change.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace

from inference_core.config import BATCHING_MODES, ConfigError, EngineConfig
from inference_core.engine.engine import Engine
from inference_core.engine.request import FinishEvent, GenerationStats, TokenEvent
from inference_core.model.loader import add_model_arguments, load_model
from inference_core.quant.linear import weight_bytes
from inference_core.quant.quantize import quantize
from inference_core.sampling import SamplingParams
from inference_core.settings import LaneSettings, add_setting_arguments


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """`python -m inference_core generate`'s flags."""
    parser.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    parser.add_argument("--system", help="system message for the chat template")
    parser.add_argument("--no-chat", action="store_true", help="plain completion: no chat template")
    add_model_arguments(parser)
    add_setting_arguments(parser)  # the lane settings: KV cache, sampling, speculation, weights (their table)
    parser.add_argument("--quant-lm-head", action=argparse.BooleanOptionalAction, default=True,
                        help="quantize the LM head too (default: yes)")
    parser.add_argument("--max-seq-len", type=int, help="context length (default: the model's, at most 8192)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=0, help="0 is off")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    parser.add_argument("--min-tokens", type=int, default=0,
                        help="mask end-of-sequence and --stop-token-id until this many tokens are generated")
    parser.add_argument("--stop-token-id", type=int, action="append", default=[],
                        help="a token id that ends the output (repeatable)")
    parser.add_argument("--n", type=int, default=1,
                        help="completions of each prompt, sampling with --seed + i (needs --batching; with "
                             "continuous batching and the paged prefix cache the copies share the prompt's KV blocks)")
    parser.add_argument("--logprobs", type=int, metavar="N",
                        help="report each token's log-probability and its N likeliest alternatives (0-20; with "
                             "--json, a 'logprobs' list per prompt)")
    parser.add_argument("--draft-model", help="--spec draft: a smaller model with the same tokenizer "
                                              "(same forms as --model)")
    parser.add_argument("--draft-heads", help="--spec medusa|eagle: a heads file from train-draft (default: the "
                                              "model's own, found automatically)")
    parser.add_argument("--batching", choices=BATCHING_MODES, default="none",
                        help="none: prompts in turn, streamed; otherwise all submitted at once and batched "
                             "(static, dynamic or continuous)")
    parser.add_argument("--max-num-seqs", type=int, help="sequences in one step (default 8; not with --batching "
                                                         "none)")
    parser.add_argument("--max-batched-tokens", type=int, default=2048,
                        help="tokens one step forwards, prefill chunks and decodes together")
    parser.add_argument("--no-chunked-prefill", action="store_true",
                        help="never split a prompt across steps")
    parser.add_argument("--kv-cache-tokens", type=int,
                        help="--kv paged: pool size in tokens (default: one --max-seq-len); small forces preemption")
    parser.add_argument("--priority", type=int, action="append",
                        help="one per --prompt, lower runs first (default 0 each; not with --batching none)")
    parser.add_argument("--json", action="store_true", help="print one JSON list instead of streaming text")


def generate_config(args: argparse.Namespace, settings: LaneSettings) -> EngineConfig:
    """`generate`'s engine settings (the lane's, from `settings`, and the batching flags), refusing flags that would
    do nothing together."""
    batched = args.batching != "none"
    if args.kv_cache_tokens is not None and args.kv_mode != "paged":
        raise ConfigError("--kv-cache-tokens sizes the paged KV pool; use it with --kv paged (not --kv "
                          f"{args.kv_mode}).")
    if args.max_num_seqs is not None and not batched:
        raise ConfigError("--batching none runs one sequence at a time; --max-num-seqs needs --batching static, "
                          "dynamic or continuous.")
    if args.priority is not None:
        if not batched:
            raise ConfigError("--priority orders prompts that wait together, but --batching none runs them one after "
                              "another as given: reorder the --prompt flags, or choose a --batching mode.")
        if len(args.priority) != len(args.prompt):
            raise ConfigError(f"{len(args.priority)} --priority values for {len(args.prompt)} --prompt flags; give "
                              "one --priority per --prompt, in the same order (or none: 0 each).")
    return settings.engine_config(
        args.max_seq_len, kv_cache_tokens=args.kv_cache_tokens, batching=args.batching,
        max_num_seqs=args.max_num_seqs or (8 if batched else 1), max_num_batched_tokens=args.max_batched_tokens,
        chunked_prefill=not args.no_chunked_prefill)


def run_generate(args: argparse.Namespace) -> int:
    settings = LaneSettings.from_args(args)
    params = settings.sampling(args.max_new_tokens, top_k=args.top_k, stop=tuple(args.stop),
                               ignore_eos=args.ignore_eos, min_tokens=args.min_tokens,
                               stop_token_ids=tuple(args.stop_token_id), logprobs=args.logprobs)
    config = generate_config(args, settings)
    spec = settings.spec()
    if args.draft_model and args.spec_method != "draft":
        raise ConfigError("--draft-model is used only with --spec draft.")
    if args.draft_heads and not spec.reads_hidden:
        raise ConfigError("--draft-heads is used only with --spec medusa or --spec eagle.")
    if args.draft_layers is not None and args.spec_method != "early-exit":
        raise ConfigError("--draft-layers is used only with --spec early-exit.")
    if args.spec_tree_width not in (None, 1) and args.spec_method == "none":
        raise ConfigError("--spec-tree-width is used only with --spec medusa or --spec eagle.")
    if not 1 <= args.n <= 16:
        raise ConfigError(f"--n must be from 1 to 16, got {args.n}.")
    if args.n > 1 and args.batching == "none":
        raise ConfigError("--n runs the copies of a prompt together: choose a --batching mode (continuous shares "
                          "the prompt's KV blocks between them).")
    quant = settings.quant(args.quant_lm_head)  # checked before the model loads
    full = load_model(args.model, args.device, args.dtype)
    loaded = quantize(full, quant)
    if quant.scheme != "none":
        print(f"[weights {quant.name}: {weight_bytes(loaded.model) / 2**20:.0f} MiB, against "
              f"{weight_bytes(full.model) / 2**20:.0f} MiB in {full.dtype_name}]", file=sys.stderr)
    draft = load_model(args.draft_model, args.device, loaded.dtype_name) if args.draft_model else None
    engine = Engine(loaded, config, draft_model=draft)
    if args.draft_heads:
        engine.load_draft_heads(args.spec_method, args.draft_heads)
    options = {"system": args.system, "chat": not args.no_chat, "spec": spec}
    if args.batching == "none":
        results = [_stream_one(engine, prompt, params, options, args) for prompt in args.prompt]
    else:
        results = _run_batched(engine, params, options, args)
    if args.json:
        print(json.dumps(results))
    return 0


def _stream_one(engine: Engine, prompt: str, params: SamplingParams, options: dict, args) -> dict:
    """One prompt alone on the engine, its text streamed unless --json."""
    tokens = []
    for event in engine.generate(prompt, params, **options):
        if isinstance(event, FinishEvent):
            if not args.json:
                print(file=sys.stderr)  # end the streamed text's line before the stats
                _print_stats(event.stats, args.spec_method)
                _print_logprobs(engine, tokens)
            return _result(prompt, event, engine, tokens)
        tokens.append(event)
        if not args.json:
            print(event.text, end="", flush=True)
    raise AssertionError("a generation ended without its final event")


def _run_batched(engine: Engine, params: SamplingParams, options: dict, args) -> list[dict]:
    """Every prompt submitted at once, the engine stepped until all are done; results in prompt order."""
    priorities = args.priority or [0] * len(args.prompt)
    copies = [params if i == 0 or params.seed is None else replace(params, seed=params.seed + i)
              for i in range(args.n)]
    requests, prompts = [], []
    for prompt, priority in zip(args.prompt, priorities):
        for request in engine.make_copies(prompt, copies, priority=priority, **options):
            requests.append(engine.enqueue(request))
            prompts.append(prompt)
    engine.drain()  # nothing more is coming: a static batch may start with fewer than --max-num-seqs prompts
    while engine.has_work():
        engine.step()
    results = []
    for prompt, request in zip(prompts, requests):
        finish = request.events[-1]
        assert isinstance(finish, FinishEvent), f"request {request.request_id} ended without its final event"
        tokens = [event for event in request.events if isinstance(event, TokenEvent)]
        results.append(_result(prompt, finish, engine, tokens))
        if not args.json:
            print(finish.text, flush=True)
            _print_stats(finish.stats, args.spec_method)
            _print_logprobs(engine, tokens)
    return results


def _result(prompt: str, finish: FinishEvent, engine: Engine, tokens: list[TokenEvent]) -> dict:
    out = {"prompt": prompt, "token_ids": finish.token_ids, "text": finish.text, "stats": finish.stats.as_dict()}
    if tokens and tokens[0].logprob is not None:
        decode = engine.tokenizer.decode
        out["logprobs"] = [{"token_id": e.token_id, "token": decode([e.token_id]), "logprob": e.logprob,
                            "entropy": e.entropy, "top": [[i, decode([i]), lp] for i, lp in e.top_logprobs]}
                           for e in tokens]
    return out


def _print_logprobs(engine: Engine, tokens: list[TokenEvent]) -> None:
    """--logprobs without --json: a line per token with its probability and the alternatives'."""
    decode = engine.tokenizer.decode
    for e in tokens:
        if e.logprob is None:
            return
        alternatives = ", ".join(f"{decode([i])!r} {math.exp(lp):.3f}" for i, lp in e.top_logprobs)
        print(f"[{e.index:4d} {decode([e.token_id])!r} p={math.exp(e.logprob):.3f}"
              + (f"; {alternatives}" if alternatives else "") + "]", file=sys.stderr)


def _print_stats(s: GenerationStats, spec_method: str) -> None:
    print(f"[{s.generated_tokens} tokens, {s.finish_reason}; TTFT {s.ttft_ms:.0f} ms, "
          f"decode {s.decode_tokens_per_s:.1f} tok/s; prompt {s.prompt_tokens} tokens, "
          f"{s.cached_prompt_tokens} from the prefix cache; {s.preemptions} preemptions, "
          f"mean batch {s.batch_size_mean:.1f}]", file=sys.stderr)
    if s.kv_bytes_reserved:
        print(f"[KV cache: {s.kv_bytes_in_use / 2**20:.2f} MiB of this request's tokens at its end, "
              f"{s.kv_bytes_reserved / 2**20:.2f} MiB reserved]", file=sys.stderr)
    if s.compile:
        how = f"{s.compile['from_disk']} of them loaded from the disk cache, " if s.compile.get("from_disk") else ""
        print(f"[compiled decode, {s.compile['mode']}: {s.compile['graphs']} graphs ({how}compiled or loaded in "
              f"{s.compile['warmup_s']:.1f} s ({s.compile['compile_s']:.1f} s of it during this request, left out of "
              f"TTFT and decode tok/s), {s.compile['recompiles']} recompiles]", file=sys.stderr)
    if s.spec:
        tree = f", a tree {s.spec['tree_width']} wide" if s.spec["tree_width"] > 1 else ""
        print(f"[speculative {spec_method}, k={s.spec['k']}{tree}: {s.spec['accepted']} of "
              f"{s.spec['drafted']} drafts accepted ({100 * s.spec['acceptance_rate']:.0f}%), "
              f"{s.spec['mean_accepted_length']:.2f} tokens per verification]", file=sys.stderr)
