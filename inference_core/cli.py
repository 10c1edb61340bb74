"""The command line, a stable contract other tools rely on:

    python -m inference_core generate --prompt TEXT [--prompt TEXT ...] [--batching MODE] [--json] ...
    python -m inference_core bench [--prompts FILE] [--max-new-tokens N] [--repeats R] [--peer llama-cpp]
        [--json PATH] ...
    python -m inference_core batch-bench [--requests N] [--arrival burst|poisson:RATE] [--modes ...] [--json PATH] ...
    python -m inference_core spec-bench [--source ngram,early-exit,draft,medusa,eagle] [--spec-k 3,5]
        [--kinds chat,code] ...
    python -m inference_core race [--lanes paged,none] [--prompt-id ID] [--repeats R] [--json PATH] ...
    python -m inference_core awq [--model M] [--quant-group 32] [--out PATH]
    python -m inference_core quality [--quant none,int8,int4] [--kv-dtype auto,int8] [--window N] [--no-agreement]
        [--json PATH] ...
    python -m inference_core verify-cache [--model bundled|FILE.gguf]
    python -m inference_core train-draft --kind medusa|eagle [--model M] [--data FILE] [--steps N] [--out PATH] ...

`generate` with `--batching none` (the default) runs its prompts one after another on one engine (so a later prompt
can hit the prefix cache) and streams text to stdout. With `--batching static|dynamic|continuous` it submits every
prompt at once (`--priority` per prompt, lower first), steps the engine until all are done, then prints each prompt's
text in prompt order. Either way `--json` prints one JSON list with an object per prompt, in prompt order: `prompt`,
`token_ids`, `text`, `stats` (`GenerationStats.as_dict()`, with `preemptions`, `queue_ms`, `batch_size_mean`).
Bad settings, and settings that do nothing together, exit with status 2 and a one-line message that says what to
change. `verify-cache` re-hashes every file of a GGUF's converted cache (start-up checks only sizes and modification
times) and converts again if one differs.
"""

from __future__ import annotations

import argparse
import json
import sys

from inference_core.config import BATCHING_MODES, KV_DTYPES, KV_MODES, ConfigError, EngineConfig
from inference_core.engine import Engine, FinishEvent, GenerationStats, load_model
from inference_core.quant import SCHEMES, QuantConfig, quantize, weight_bytes
from inference_core.sampling import SamplingParams
from inference_core.speculative import SPEC_METHODS, SpecConfig


def _add_model_args(parser: argparse.ArgumentParser, dtype: str = "auto") -> None:
    parser.add_argument("--model", default="bundled",
                        help="'bundled' (SmolLM2-135M-Instruct), a local directory, a .gguf file or a Hub id")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default=dtype,
                        help="auto (the fastest here: bfloat16 on CUDA, and on a CPU with native bf16 math where it "
                             f"measures faster; float32 otherwise), float32, bfloat16 or float16 (default: {dtype})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m inference_core", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate text for one or more prompts")
    generate.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    generate.add_argument("--system", help="system message for the chat template")
    generate.add_argument("--no-chat", action="store_true", help="plain completion: no chat template")
    _add_model_args(generate)
    generate.add_argument("--kv", choices=KV_MODES, default="paged", help="KV cache mode (default: paged)")
    generate.add_argument("--quant", choices=SCHEMES, default="none",
                          help="weight-only quantization of the projections: int8 per output channel, int4 per group, "
                               "awq: int4 per group after activation-aware scaling (calibrated once and cached)")
    generate.add_argument("--quant-group", type=int, default=32, help="int4: input features per scale and zero")
    generate.add_argument("--quant-lm-head", action=argparse.BooleanOptionalAction, default=True,
                          help="quantize the LM head too (default: yes)")
    generate.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto",
                          help="KV cache storage: auto (the model dtype) or int8 (per token and head scales)")
    generate.add_argument("--sliding-window", type=int,
                          help="attend to the last N tokens only (default: the checkpoint's own window, if any); "
                               "paged KV gives back the blocks that fall out of it")
    generate.add_argument("--block-size", type=int, default=16, help="paged KV block size in tokens")
    generate.add_argument("--no-prefix-cache", action="store_true", help="paged: do not reuse cached prefixes")
    generate.add_argument("--compile", action="store_true",
                          help="decode steps through torch.compile (contiguous or paged KV; the first decode step at "
                               "each batch size compiles first, 1-2 minutes on a CPU)")
    generate.add_argument("--max-seq-len", type=int, help="context length (default: the model's, at most 8192)")
    generate.add_argument("--max-new-tokens", type=int, default=256)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    generate.add_argument("--top-k", type=int, default=0, help="0 is off")
    generate.add_argument("--top-p", type=float, default=1.0, help="1 is off")
    generate.add_argument("--seed", type=int)
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    generate.add_argument("--spec", choices=SPEC_METHODS, default="none",
                          help="speculative decoding draft source: ngram = prompt lookup, early-exit = the model's "
                               "first --draft-layers layers, draft = --draft-model, medusa / eagle = trained draft "
                               "heads (shipped for the bundled model; others: train-draft, or --draft-heads)")
    generate.add_argument("--spec-k", type=int, default=4, help="draft length k (where adaptive k starts)")
    generate.add_argument("--spec-adaptive", action="store_true",
                          help="adapt k: longer after a fully accepted draft, shorter after an early rejection")
    generate.add_argument("--spec-tree-width", type=int, default=1,
                          help="medusa, eagle, greedy: verify a tree with this many candidates per draft position "
                               "(the best ones chained, the others as leaves beside them; 1: a chain)")
    generate.add_argument("--draft-layers", type=int, help="early-exit: layers the draft runs (default: half)")
    generate.add_argument("--draft-model", help="--spec draft: a smaller model with the same tokenizer "
                                                "(same forms as --model)")
    generate.add_argument("--draft-heads", help="--spec medusa|eagle: a heads file from train-draft (default: the "
                                                "model's own, found automatically)")
    generate.add_argument("--batching", choices=BATCHING_MODES, default="none",
                          help="none: prompts in turn, streamed; otherwise all submitted at once and batched "
                               "(static, dynamic or continuous)")
    generate.add_argument("--max-num-seqs", type=int, help="sequences in one step (default 8; not with --batching "
                                                           "none)")
    generate.add_argument("--max-batched-tokens", type=int, default=2048,
                          help="tokens one step forwards, prefill chunks and decodes together")
    generate.add_argument("--no-chunked-prefill", action="store_true",
                          help="never split a prompt across steps")
    generate.add_argument("--kv-cache-tokens", type=int,
                          help="--kv paged: pool size in tokens (default: one --max-seq-len); small forces preemption")
    generate.add_argument("--priority", type=int, action="append",
                          help="one per --prompt, lower runs first (default 0 each; not with --batching none)")
    generate.add_argument("--json", action="store_true", help="print one JSON list instead of streaming text")

    bench = commands.add_parser("bench", help="our KV modes vs Hugging Face transformers on the same prompts")
    bench.add_argument("--prompts", help="JSONL prompt file (default: the packaged benchmark prompts)")
    bench.add_argument("--prompt-ids", help="comma-separated prompt ids to run (default: one per kind)")
    _add_model_args(bench)
    bench.add_argument("--configs", default="contiguous,paged,contiguous+compile,paged+compile",
                       help="our configurations to run, comma-separated: a KV mode (none, contiguous, paged), "
                            "with '+compile' for compiled decode and '+int8' or '+int4' for quantized weights")
    bench.add_argument("--quant-group", type=int, default=32, help="int4 rows: input features per scale and zero")
    bench.add_argument("--no-hf", action="store_true", help="skip the transformers row")
    bench.add_argument("--peer", type=_peer_list, action="extend",
                       help="other engines on the same model, repeatable or comma-separated: llama-cpp (llama.cpp on "
                            "the same GGUF file, where llama-cpp-python is installed; reported as absent otherwise)")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--json", dest="json_path", help="write the results here")

    batch_bench = commands.add_parser("batch-bench",
                                      help="batching modes vs transformers on one request set with arrival times")
    batch_bench.add_argument("--prompts", help="JSONL prompt file (default: the packaged benchmark prompts)")
    batch_bench.add_argument("--requests", type=int, default=32, help="requests, cycling through the prompts")
    _add_model_args(batch_bench)
    batch_bench.add_argument("--max-new-tokens", type=int, default=64)
    batch_bench.add_argument("--arrival", default="burst",
                             help="burst (all at t=0) or poisson:RATE (RATE requests/s, seeded)")
    batch_bench.add_argument("--modes", default="none,static,dynamic,continuous",
                             help="our batching modes, comma-separated")
    batch_bench.add_argument("--peers", default="hf-sequential,hf-static",
                             help="transformers rows, comma-separated, from: hf-sequential, hf-static ('' for none)")
    batch_bench.add_argument("--max-num-seqs", type=int, default=8, help="batch size limit (ours and hf-static)")
    batch_bench.add_argument("--kv-cache-tokens", type=int,
                             help="paged pool size (default: max-num-seqs requests of the longest prompt)")
    batch_bench.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrival times")
    batch_bench.add_argument("--json", dest="json_path", help="write the results here")

    spec_bench = commands.add_parser("spec-bench", help="speculative vs plain decoding by prompt kind")
    spec_bench.add_argument("--source", default="ngram",
                            help="draft sources, comma-separated, each timed against the same plain runs: "
                                 f"{', '.join(m for m in SPEC_METHODS if m != 'none')}")
    spec_bench.add_argument("--spec-k", default="3,5", help="draft lengths to try, comma-separated")
    spec_bench.add_argument("--tree-width", default="1",
                            help="medusa, eagle: tree widths to try (candidates per draft position; 1: a chain), "
                                 "comma-separated")
    spec_bench.add_argument("--draft-layers", default="",
                            help="early-exit: layer counts to try, comma-separated (default: half the model's)")
    spec_bench.add_argument("--draft-model", help="draft: the draft model (default: the target model itself)")
    spec_bench.add_argument("--draft-heads", help="medusa, eagle: a heads file (default: the model's own)")
    spec_bench.add_argument("--kinds", default="chat,code,grounded", help="benchmark prompt kinds, comma-separated")
    _add_model_args(spec_bench)
    spec_bench.add_argument("--kv", choices=KV_MODES, default="paged")
    spec_bench.add_argument("--max-new-tokens", type=int, default=128)
    spec_bench.add_argument("--repeats", type=int, default=2)
    spec_bench.add_argument("--json", dest="json_path", help="write the results here")

    train = commands.add_parser("train-draft", help="train Medusa heads or an EAGLE draft layer on the model's own "
                                                    "answers (inference_core.train_draft)")
    train.add_argument("--kind", choices=("medusa", "eagle"), required=True)
    _add_model_args(train, dtype="float32")
    train.add_argument("--data", help="answers as JSON lines (draft_data.save); generated and saved there if missing "
                                      "(default: the user cache)")
    train.add_argument("--prompts", type=int, default=800, help="prompts to answer when generating the data")
    train.add_argument("--max-new-tokens", type=int, default=160, help="answer length when generating the data")
    train.add_argument("--temperatures", default="0,0.7",
                       help="when generating the data: one answer per prompt at each of these temperatures, "
                            "comma-separated (0: greedy; a sampled answer adds what the model says less often)")
    train.add_argument("--data-batch", type=int, default=128, help="requests per engine step when generating the data")
    train.add_argument("--data-dtype", default="auto",
                       help="dtype of the model that writes the answers and computes the hidden states the heads "
                            "learn from (auto: as --dtype auto chooses; bf16 is about twice as fast as fp32 on a CPU "
                            "with native bf16 math); the heads train in --dtype")
    train.add_argument("--no-text", dest="text", action="store_false",
                       help="leave out the shipped public-domain text")
    train.add_argument("--heads", type=int, default=4, help="medusa: heads (the longest draft)")
    train.add_argument("--draft-vocab", type=int, default=8192, help="tokens the heads score (the most predicted)")
    train.add_argument("--steps", type=int, default=1000)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--batch-size", type=int, default=512, help="medusa: positions per step")
    train.add_argument("--batch-tokens", type=int, default=4096, help="eagle: padded tokens per step")
    train.add_argument("--noise", type=float, default=0.1, help="eagle: uniform noise on the input hidden states")
    train.add_argument("--cls-weight", type=float, default=1.0,
                       help="eagle: weight of the token loss (EAGLE used 0.1; on the bundled model 1.0 agreed "
                            "more often: 0.324 against 0.295 held out after 100 steps)")
    train.add_argument("--unroll", type=int, default=1,
                       help="eagle: draft steps trained at each position (training-time test, as EAGLE-3): step s "
                            "reads the layer's own estimates, as the drafts after the first do; 1 trains on the "
                            "model's hidden states only")
    train.add_argument("--validation", type=float, default=0.05, help="share of sequences held out")
    train.add_argument("--log-every", type=int, default=10, help="steps between loss-curve rows")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--out", help="the weights file (default: the user cache, where engines find it)")

    race = commands.add_parser("race", help="fairness of a race: each KV mode alone vs all of them interleaved")
    race.add_argument("--lanes", default="paged,contiguous", help="KV modes to race, comma-separated")
    race.add_argument("--prompt-id", default="chat-short-1", help="a benchmark prompt id")
    _add_model_args(race)
    race.add_argument("--max-new-tokens", type=int, default=128)
    race.add_argument("--repeats", type=int, default=3)
    race.add_argument("--json", dest="json_path", help="write the results here")

    quality = commands.add_parser("quality", help="perplexity and greedy agreement of quantized weights and KV cache "
                                                  "against the unquantized reference")
    _add_model_args(quality, dtype="float32")  # the reference is full precision unless asked otherwise
    quality.add_argument("--quant", default="none,int8,int4",
                         help=f"weight quantizations, comma-separated, from: {', '.join(SCHEMES)}")
    quality.add_argument("--quant-group", type=int, default=32, help="int4: input features per scale and zero")
    quality.add_argument("--kv-dtype", default="auto", help="KV cache dtypes, comma-separated, from: auto, int8")
    quality.add_argument("--window", type=int, help="perplexity chunk length (default: the model's context, at most "
                                                    "8192; smaller is faster)")
    quality.add_argument("--eval-tokens", type=int, help="use only the eval text's first N tokens")
    quality.add_argument("--max-new-tokens", type=int, default=64, help="greedy tokens per prompt for the agreement")
    quality.add_argument("--prompts", help="JSONL prompt file (default: the packaged benchmark prompts)")
    quality.add_argument("--prompt-ids", help="comma-separated prompt ids (default: every prompt of the file)")
    quality.add_argument("--no-agreement", action="store_true", help="perplexity only: no greedy generations")
    quality.add_argument("--json", dest="json_path", help="write the rows and the host here")

    awq = commands.add_parser("awq", help="calibrate AWQ int4 weights on the shipped text and save them (used by "
                                          "--quant awq)")
    _add_model_args(awq, dtype="float32")
    awq.add_argument("--quant-group", type=int, default=32, help="input features per int4 scale and zero")
    awq.add_argument("--out", help="the file to write (default: the AWQ cache, where --quant awq looks)")

    verify = commands.add_parser("verify-cache", help="re-hash a GGUF's converted cache against its manifest and "
                                                      "convert again if a file differs")
    verify.add_argument("--model", default="bundled", help="'bundled' (the default) or a .gguf file")
    return parser


def _peer_list(value: str) -> list[str]:
    """`--peer a,b` -> ['a', 'b'], each a known bench peer."""
    from inference_core.peer_llama_cpp import PEERS

    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in PEERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown peer {', '.join(unknown) or repr(value)}; choose from: "
                                         f"{', '.join(PEERS)}")
    return names


def generate_config(args: argparse.Namespace) -> EngineConfig:
    """`generate`'s engine settings, refusing flags that would do nothing together."""
    batched = args.batching != "none"
    if args.kv_cache_tokens is not None and args.kv != "paged":
        raise ConfigError(f"--kv-cache-tokens sizes the paged KV pool; use it with --kv paged (not --kv {args.kv}).")
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
    return EngineConfig(kv_mode=args.kv, block_size=args.block_size, prefix_cache=not args.no_prefix_cache,
                        max_seq_len=args.max_seq_len, kv_cache_tokens=args.kv_cache_tokens, batching=args.batching,
                        max_num_seqs=args.max_num_seqs or (8 if batched else 1),
                        max_num_batched_tokens=args.max_batched_tokens, chunked_prefill=not args.no_chunked_prefill,
                        compile=args.compile, kv_dtype=args.kv_dtype, sliding_window=args.sliding_window)


def run_generate(args: argparse.Namespace) -> int:
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    config = generate_config(args)
    spec = SpecConfig(method=args.spec, k=args.spec_k, adaptive=args.spec_adaptive, draft_layers=args.draft_layers,
                      tree_width=args.spec_tree_width)
    if args.draft_model and args.spec != "draft":
        raise ConfigError("--draft-model is used only with --spec draft.")
    if args.draft_heads and not spec.reads_hidden:
        raise ConfigError("--draft-heads is used only with --spec medusa or --spec eagle.")
    if args.draft_layers is not None and args.spec != "early-exit":
        raise ConfigError("--draft-layers is used only with --spec early-exit.")
    quant = QuantConfig(args.quant, args.quant_group, args.quant_lm_head)  # checked before the model loads
    full = load_model(args.model, args.device, args.dtype)
    loaded = quantize(full, quant)
    if quant.scheme != "none":
        print(f"[weights {quant.name}: {weight_bytes(loaded.model) / 2**20:.0f} MiB, against "
              f"{weight_bytes(full.model) / 2**20:.0f} MiB in {full.dtype_name}]", file=sys.stderr)
    draft = load_model(args.draft_model, args.device, loaded.dtype_name) if args.draft_model else None
    engine = Engine(loaded, config, draft_model=draft)
    if args.draft_heads:
        engine.load_draft_heads(args.spec, args.draft_heads)
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
    for event in engine.generate(prompt, params, **options):
        if isinstance(event, FinishEvent):
            if not args.json:
                print(file=sys.stderr)  # end the streamed text's line before the stats
                _print_stats(event.stats, args.spec)
            return _result(prompt, event)
        if not args.json:
            print(event.text, end="", flush=True)
    raise AssertionError("a generation ended without its final event")


def _run_batched(engine: Engine, params: SamplingParams, options: dict, args) -> list[dict]:
    """Every prompt submitted at once, the engine stepped until all are done; results in prompt order."""
    priorities = args.priority or [0] * len(args.prompt)
    requests = [engine.submit(prompt, params, priority=priority, **options)
                for prompt, priority in zip(args.prompt, priorities)]
    engine.drain()  # nothing more is coming: a static batch may start with fewer than --max-num-seqs prompts
    while engine.has_work():
        engine.step()
    results = []
    for prompt, request in zip(args.prompt, requests):
        finish = request.events[-1]
        assert isinstance(finish, FinishEvent), f"request {request.request_id} ended without its final event"
        results.append(_result(prompt, finish))
        if not args.json:
            print(finish.text, flush=True)
            _print_stats(finish.stats, args.spec)
    return results


def _result(prompt: str, finish: FinishEvent) -> dict:
    return {"prompt": prompt, "token_ids": finish.token_ids, "text": finish.text, "stats": finish.stats.as_dict()}


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
              f"decode tok/s), {s.compile['recompiles']} recompiles]", file=sys.stderr)
    if s.spec:
        tree = f", a tree {s.spec['tree_width']} wide" if s.spec["tree_width"] > 1 else ""
        print(f"[speculative {spec_method}, k={s.spec['k']}{tree}: {s.spec['accepted']} of "
              f"{s.spec['drafted']} drafts accepted ({100 * s.spec['acceptance_rate']:.0f}%), "
              f"{s.spec['mean_accepted_length']:.2f} tokens per verification]", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return run_generate(args)
        if args.command == "batch-bench":
            from inference_core.batch_bench import run_batch_bench

            return run_batch_bench(args)
        if args.command == "spec-bench":
            from inference_core.spec_bench import run_spec_bench

            return run_spec_bench(args)
        if args.command == "quality":
            from inference_core.quality import run_quality

            return run_quality(args)
        if args.command == "awq":
            from inference_core.awq_file import run_awq

            return run_awq(args)
        if args.command == "verify-cache":
            from inference_core.bundled import run_verify_cache

            return run_verify_cache(args)
        if args.command == "train-draft":
            from inference_core.train_draft import run_train_draft

            return run_train_draft(args)
        if args.command == "race":
            from inference_core.race import run_race_bench

            return run_race_bench(args)
        from inference_core.bench import run_bench

        return run_bench(args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
