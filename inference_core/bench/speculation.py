"""`python -m inference_core spec-bench`: speculative against plain decoding on the same engine, prompts and device,
by prompt kind (chat, code, grounded), reporting the tokens/s ratio, acceptance rate and mean accepted length even
where speculation loses.

Draft sources (--source, comma-separated for several in one run): `ngram` (prompt lookup), `early-exit`
(--draft-layers may list several depths), `draft` (--draft-model; by default the target itself, which accepts every
draft and so shows the cost of drafting with no gain), `medusa` and `eagle` (trained draft heads; --draft-heads for a
file of your own; --tree-width lists tree widths to verify, 1 being the chain; a tree is pruned by the drafter's
confidence, as a request's is by default, and --every-node adds each tree unpruned beside it). The JSON also keeps
acceptance by draft position (for a tree: a position counts as accepted when any of its candidates is).

`--keep` keeps each source's best k (the highest geometric mean of its ratios over the kinds) as this host's default
for the setup (`spec.defaults`): a request that leaves k open (`--spec` without `--spec-k`, the page's "best
measured", an API request without `spec_k`) gets it. Where a ranking source ran at two tree widths or more, its
fastest pair of k and width is kept too, and a greedy request that leaves the width open gets that width.

Speculative runs draft at every step (`EngineConfig(speculate_when_it_pays=False)`): the bench measures what
speculation itself costs and gains, which is what the engine's own choice (`spec.pays`) weighs at run time.

With --compile both are compiled: plain decoding through the compiled decode step, each verification through the
compiled query step (`engine.query_graph`), every package built before the first timed run; the JSON keeps the
compile stats (steps by bucket, and the forwards that ran eager and why).

Method: greedy decoding (so both runs produce the same tokens, which the bench checks in float32; in 16-bit weights
a verification's several-row matmuls round differently from a one-row decode, and with int8 activations its
attention over several queries does and a projection's rounded input may move a whole int8 step, so a near-tie may
go the other way: such runs are counted in the table and the JSON, not hidden), up to --max-new-tokens, a
warm-up request first (never timed); for each repeat every prompt runs plain and then under each speculative setting
(interleaved, so a shared machine's drift hits all alike), the paged prefix cache emptied before each run. Tokens/s
is the request's generated tokens over its own busy time from the first token to the last (decode); a kind's figure
is the median over its prompts and repeats, and its acceptance numbers add up drafted and accepted tokens over runs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from inference_core.bench.prompts import load_prompts
from inference_core.bench.speed import machine_info
from inference_core.config import KV_MODES, ConfigError, EngineConfig
from inference_core.engine.engine import Engine
from inference_core.model.loader import add_model_arguments, load_model
from inference_core.quant.linear import ACTIVATIONS, SCHEMES, QuantConfig
from inference_core.quant.quantize import quantize
from inference_core.sampling import SamplingParams
from inference_core.sequence import Sequence
from inference_core.spec.defaults import best_k, keep, setting_key, setup_key
from inference_core.spec.decoding import HIDDEN_READERS, SPEC_METHODS, SpecConfig, common_prefix_length


def forward_cost(engine: Engine, counts: list[int], context: int = 300, repeats: int = 20) -> dict[int, float]:
    """Median milliseconds of one forward of n new tokens (logits for all n, as a verification asks) after a
    `context`-token prefix, for each n in `counts`: what a verification step of k drafts (n = k + 1) costs against a
    plain decode step (n = 1) on this host, dtype and KV mode. The counts take turns, `repeats` rounds in a rotated
    order, so that a host whose read rate moves (by half within minutes on a 2-vCPU Zen 4 host) moves every count's
    timings alike: there, one count after another read a 2-token forward at 1.20x a decode step, taking turns 1.10x."""
    runner, kv_cache = engine.runner, engine.kv_cache
    seq = Sequence(list(range(100, 100 + context)), num_prompt_tokens=context)
    kv_cache.allocate(seq)
    try:
        runner.run([seq])
        times: dict[int, list[float]] = {count: [] for count in counts}
        for round_ in range(repeats):
            for count in counts[round_ % len(counts):] + counts[:round_ % len(counts)]:
                seq.token_ids.extend(range(500, 500 + count))
                started = time.perf_counter()
                runner.run([seq], num_logits=count)
                times[count].append(time.perf_counter() - started)
                del seq.token_ids[context:]
                kv_cache.rollback(seq, context)
        return {count: statistics.median(values) * 1e3 for count, values in times.items()}
    finally:
        kv_cache.free(seq)


def _run(engine: Engine, prompt_ids: list[int], params: SamplingParams, spec: SpecConfig | None):
    engine.reset_prefix_cache()
    return engine.complete(prompt_ids, params, spec=spec)


def add_spec_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """`python -m inference_core spec-bench`'s flags."""
    parser.add_argument("--source", default="ngram",
                        help="draft sources, comma-separated, each timed against the same plain runs: "
                             f"{', '.join(m for m in SPEC_METHODS if m != 'none')}")
    parser.add_argument("--spec-k", default="3,5", help="draft lengths to try, comma-separated")
    parser.add_argument("--tree-width", default="1",
                        help="medusa, eagle: tree widths to try (candidates per draft position; 1: a chain), "
                             "comma-separated")
    parser.add_argument("--every-node", action="store_true",
                        help="each tree also unpruned (every level and candidate, `--no-spec-tree-prune`), beside "
                             "the pruned one; --keep chooses among the pruned ones only")
    parser.add_argument("--draft-layers", default="",
                        help="early-exit: layer counts to try, comma-separated (default: half the model's)")
    parser.add_argument("--draft-model", help="draft: the draft model (default: the target model itself)")
    parser.add_argument("--draft-heads", help="medusa, eagle: a heads file (default: the model's own)")
    parser.add_argument("--kinds", default="chat,code,grounded", help="benchmark prompt kinds, comma-separated")
    add_model_arguments(parser)
    parser.add_argument("--kv", choices=KV_MODES, default="paged")
    parser.add_argument("--compile", action="store_true",
                        help="plain and speculative runs both compiled (decode steps, verifications), each package "
                             "built before any timed run")
    parser.add_argument("--quant", choices=SCHEMES, default="none",
                        help="the target's weights, as `generate --quant` (trained draft heads' projections take the "
                             "same)")
    parser.add_argument("--quant-group", type=int, default=32, help="int4: input features per scale and zero")
    parser.add_argument("--quant-activations", choices=ACTIVATIONS, default="model",
                        help="int4 weights by the activations in the model dtype (model) or rounded to int8 (int8: "
                             "our CPU kernel)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", dest="json_path", help="write the results here")
    parser.add_argument("--keep", action="store_true",
                        help="keep each source's best k (the highest geometric mean of its ratios over the kinds) as "
                             "this host's default for the setup: a request that leaves k open gets it; with two "
                             "--tree-width values or more, Medusa's and EAGLE's best tree width likewise")


def run_spec_bench(args) -> int:
    kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    sources = [source.strip() for source in args.source.split(",") if source.strip()]
    if not sources or any(source not in SPEC_METHODS or source == "none" for source in sources):
        raise ConfigError(f"--source takes draft sources from: {', '.join(m for m in SPEC_METHODS if m != 'none')}.")
    if getattr(args, "draft_heads", None) and len([s for s in sources if s in ("medusa", "eagle")]) != 1:
        raise ConfigError("--draft-heads goes with exactly one of the sources medusa, eagle.")
    ks = [int(k) for k in str(args.spec_k).split(",") if k.strip()]
    if args.repeats < 1 or args.max_new_tokens < 2 or not ks:
        raise ConfigError("spec-bench needs --repeats >= 1, --max-new-tokens >= 2 and at least one --spec-k.")
    rows = [row for row in load_prompts() if row["kind"] in kinds]
    if not rows:
        raise ConfigError(f"no benchmark prompts of kind {', '.join(kinds)}; use chat, code, grounded, long.")
    quant = QuantConfig(getattr(args, "quant", "none"), getattr(args, "quant_group", 32),
                        activations=getattr(args, "quant_activations", "model"))
    loaded = quantize(load_model(args.model, args.device, args.dtype), quant)
    draft = None
    if "draft" in sources:  # default: the target drafting for itself (every draft accepted, at the full cost)
        draft = load_model(args.draft_model, args.device, loaded.dtype_name) if args.draft_model else loaded
    compiled = bool(getattr(args, "compile", False))
    # Every speculative run drafts at every step: the bench measures speculation itself, setting by setting (an
    # engine left to choose, `spec.pays`, would measure its rates across all of them).
    engine = Engine(loaded, EngineConfig(kv_mode=args.kv, compile=compiled, speculate_when_it_pays=False),
                    draft_model=draft)
    if getattr(args, "draft_heads", None):
        engine.load_draft_heads(next(s for s in sources if s in ("medusa", "eagle")), args.draft_heads)
    layer_counts = [int(n) for n in str(args.draft_layers or "").split(",") if n.strip()] or [None]
    widths = [int(w) for w in str(getattr(args, "tree_width", 1)).split(",") if w.strip()] or [1]
    settings = {}
    for source in sources:
        for layers in layer_counts if source == "early-exit" else [None]:
            for k in ks:
                for width in widths if source in HIDDEN_READERS else [1]:
                    spec = engine.resolve_spec(SpecConfig(source, k=k, draft_layers=layers, tree_width=width))
                    name = f"{source} L={spec.draft_layers} k={k}" if spec.draft_layers else f"{source} k={k}"
                    settings[name + (f" w={width}" if width > 1 else "")] = spec
                    if width > 1 and getattr(args, "every_node", False):
                        settings[f"{name} w={width} every node"] = replace(spec, tree_prune=False)
    keys = {name: setting_key(spec.method, spec.tree_width, spec.draft_layers) for name, spec in settings.items()}
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    prompts = [(row["kind"], row["id"], engine.prompt_ids(row["prompt"], row.get("system"))) for row in rows]
    print(f"spec-bench: {loaded.name} on {loaded.device} in {str(loaded.dtype).removeprefix('torch.')}"
          f"{', weights ' + quant.name if loaded.quant else ''}, KV {args.kv}, "
          f"{'compiled, ' if compiled else ''}{len(prompts)} prompts x {args.repeats} repeats, up to "
          f"{args.max_new_tokens} new tokens", flush=True)
    for spec in [None, *settings.values()]:  # warm-up, never timed: the compiled packages first
        warmup_s = engine.warm_up_compiled((1,), spec)
        if compiled:
            print(f"compiled for {'plain decoding' if spec is None else spec.method + f' k={spec.k}'} in "
                  f"{warmup_s:.1f} s", flush=True)
        _run(engine, prompts[0][2], SamplingParams(max_new_tokens=8), spec)
    costs = forward_cost(engine, sorted({1, *(spec.k * spec.tree_width + 1 for spec in settings.values())}))
    print("forward of n tokens against 1 (a verification of n - 1 drafts against a decode step): "
          + ", ".join(f"n={n} {ms:.1f} ms ({ms / costs[1]:.2f}x)" for n, ms in costs.items()), flush=True)
    speeds: dict[tuple[str, str], list[float]] = {}
    # Where a verification may round otherwise than a decode (16-bit weights, int8 activations): runs whose ids left
    # plain greedy's, and where. Elsewhere a run that leaves them is a bug.
    exact = loaded.dtype == torch.float32 and not (loaded.quant is not None and loaded.quant.activations == "int8")
    differ: dict[tuple[str, str], list[str]] = {}
    counts: dict[tuple[str, str], list[int]] = {}  # drafted, accepted, steps
    by_position: dict[tuple[str, str], list[list[int]]] = {}  # drafted, accepted at each draft position
    for _ in range(args.repeats):
        for kind, prompt_id, prompt_ids in prompts:
            plain = _run(engine, prompt_ids, params, None)
            speeds.setdefault((kind, "plain"), []).append(plain.stats.decode_tokens_per_s)
            for name, spec in settings.items():
                fast = _run(engine, prompt_ids, params, spec)
                if fast.token_ids != plain.token_ids:
                    if exact:
                        raise RuntimeError(f"{name} changed the greedy output of {prompt_id}: speculation must be "
                                           "lossless")
                    same = common_prefix_length(fast.token_ids, plain.token_ids)
                    differ.setdefault((kind, name), []).append(f"{prompt_id} from token {same}")
                speeds.setdefault((kind, name), []).append(fast.stats.decode_tokens_per_s)
                total = counts.setdefault((kind, name), [0, 0, 0])
                for index, key in enumerate(("drafted", "accepted", "steps")):
                    total[index] += fast.stats.spec[key]
                positions = by_position.setdefault((kind, name), [[], []])
                for index, key in enumerate(("drafted_by_position", "accepted_by_position")):
                    counts_here = fast.stats.spec[key]
                    positions[index] += [0] * (len(counts_here) - len(positions[index]))
                    for position, count in enumerate(counts_here):
                        positions[index][position] += count
    table = []
    for kind in kinds:
        if (kind, "plain") not in speeds:
            continue
        plain_speed = statistics.median(speeds[(kind, "plain")])
        for name in settings:
            drafted, accepted, steps = counts[(kind, name)]
            speed = statistics.median(speeds[(kind, name)])
            spec = settings[name]
            ranks = {"source_key": setting_key(spec.method, 1, spec.draft_layers), "tree_width": spec.tree_width} \
                if spec.method in HIDDEN_READERS else {}  # a width to choose among (`best_k`'s "w=auto" entry)
            table.append({"kind": kind, "setting": name, "setting_key": keys[name], "k": spec.k, **ranks,
                          "tree_prune": spec.tree_prune if spec.tree_width > 1 else None,
                          "plain_tokens_per_s": round(plain_speed, 2),
                          "spec_tokens_per_s": round(speed, 2), "ratio": round(speed / plain_speed, 3),
                          "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
                          "mean_accepted_length": round((accepted + steps) / steps, 2) if steps else 0.0,
                          "acceptance_by_position": [round(a / d, 3) if d else None
                                                     for d, a in zip(*by_position[(kind, name)])],
                          "runs": len(speeds[(kind, name)]),
                          "ids_differ_from_plain": differ.get((kind, name), [])})
    print("| kind | setting | plain tok/s | speculative tok/s | ratio | acceptance | tokens per verification | "
          "acceptance by position |")
    print("|---|---|---|---|---|---|---|---|")
    for row in table:
        positions = " / ".join("-" if a is None else f"{a:.2f}" for a in row["acceptance_by_position"])
        print(f"| {row['kind']} | {row['setting']} | {row['plain_tokens_per_s']:.1f} | "
              f"{row['spec_tokens_per_s']:.1f} | {row['ratio']:.2f}x | {row['acceptance_rate']:.2f} | "
              f"{row['mean_accepted_length']:.2f} | {positions} |")
    for (kind, name), runs in differ.items():
        print(f"{kind}, {name}: greedy ids left plain decoding's in {len(runs)} run(s) ({'; '.join(runs)}): in "
              f"{str(loaded.dtype).removeprefix('torch.')}"
              f"{' with int8 activations' if loaded.dtype == torch.float32 else ''} a verification rounds "
              "differently from a one-row decode")
    chosen = best_k([row for row in table if row["tree_prune"] is not False])  # what a request gets unless it asks
    for setting, entry in chosen.items():
        if "tree_width" in entry:  # a source's best pair of k and tree width
            others = ", ".join(f"{pair} {mean:.2f}x" for pair, mean in entry["others"].items())
            print(f"best k and tree width for {setting.removesuffix(' w=auto')}: k={entry['k']} "
                  f"w={entry['tree_width']} (geometric mean over {', '.join(entry['ratios'])}: {others})")
            continue
        others = ", ".join(f"k={k} {mean:.2f}x" for k, mean in entry["others"].items())
        print(f"best k for {setting}: {entry['k']} (geometric mean over {', '.join(entry['ratios'])}: {others})")
    if getattr(args, "keep", False):
        setup = setup_key(loaded, args.kv, engine.decoder is not None)
        path = keep(setup, chosen, "python -m inference_core spec-bench " + " ".join(map(shlex.quote, sys.argv[2:])))
        widths = " and tree width" if any("tree_width" in entry for entry in chosen.values()) else ""
        print(f"kept as the default k{widths} of {setup} in {path}")
    if args.json_path:
        report = {"model": loaded.name, "best_k": chosen, "sources": sources, "machine": machine_info(loaded.device),
                  "draft_model": draft.name if draft else None, "device": str(loaded.device),
                  "dtype": str(loaded.dtype).removeprefix("torch."), "kv": args.kv, "compiled": compiled,
                  "quant": quant.name,
                  "compile_stats": engine.compile_stats(),
                  "forward_ms_by_tokens": {n: round(ms, 2) for n, ms in costs.items()},
                  "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "rows": table}
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json_path}")
    return 0
