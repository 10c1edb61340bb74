"""`python -m inference_core spec-bench`: speculative against plain decoding on the same engine, prompts and device,
by prompt kind (chat, code, grounded), reporting the tokens/s ratio, acceptance rate and mean accepted length even
where speculation loses.

Draft sources: `ngram` (prompt lookup), `early-exit` (--draft-layers may list several depths), `draft` (--draft-model;
by default the target itself, which accepts every draft and so shows the cost of drafting with no gain).

Method: greedy decoding (so both runs produce the same tokens, which the bench checks), up to --max-new-tokens, a
warm-up request first (never timed); for each repeat every prompt runs plain and then under each speculative setting
(interleaved, so a shared machine's drift hits all alike), the paged prefix cache emptied before each run. Tokens/s
is the request's generated tokens over its own busy time from the first token to the last (decode); a kind's figure
is the median over its prompts and repeats, and its acceptance numbers add up drafted and accepted tokens over runs.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from inference_core.config import ConfigError, EngineConfig
from inference_core.engine import Engine, load_model
from inference_core.prompts import load_prompts
from inference_core.sampling import SamplingParams
from inference_core.speculative import SpecConfig


def _run(engine: Engine, prompt_ids: list[int], params: SamplingParams, spec: SpecConfig | None):
    engine.reset_prefix_cache()
    return engine.complete(prompt_ids, params, spec=spec)


def run_spec_bench(args) -> int:
    kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    ks = [int(k) for k in str(args.spec_k).split(",") if k.strip()]
    if args.repeats < 1 or args.max_new_tokens < 2 or not ks:
        raise ConfigError("spec-bench needs --repeats >= 1, --max-new-tokens >= 2 and at least one --spec-k.")
    rows = [row for row in load_prompts() if row["kind"] in kinds]
    if not rows:
        raise ConfigError(f"no benchmark prompts of kind {', '.join(kinds)}; use chat, code, grounded, long.")
    loaded = load_model(args.model, args.device, args.dtype)
    draft = None
    if args.source == "draft":  # default: the target drafting for itself (every draft accepted, at the full cost)
        draft = load_model(args.draft_model, args.device, loaded.dtype_name) if args.draft_model else loaded
    engine = Engine(loaded, EngineConfig(kv_mode=args.kv), draft_model=draft)
    layer_counts = [int(n) for n in str(args.draft_layers or "").split(",") if n.strip()] or [None]
    settings = {}
    for layers in layer_counts if args.source == "early-exit" else [None]:
        for k in ks:
            spec = engine.resolve_spec(SpecConfig(args.source, k=k, draft_layers=layers))
            name = f"{args.source} L={spec.draft_layers} k={k}" if spec.draft_layers else f"{args.source} k={k}"
            settings[name] = spec
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    prompts = [(row["kind"], row["id"], engine.prompt_ids(row["prompt"], row.get("system"))) for row in rows]
    print(f"spec-bench: {loaded.name} on {loaded.device} in {str(loaded.dtype).removeprefix('torch.')}, KV {args.kv}, "
          f"{len(prompts)} prompts x {args.repeats} repeats, up to {args.max_new_tokens} new tokens", flush=True)
    for spec in [None, *settings.values()]:  # warm-up, never timed
        _run(engine, prompts[0][2], SamplingParams(max_new_tokens=8), spec)
    speeds: dict[tuple[str, str], list[float]] = {}
    counts: dict[tuple[str, str], list[int]] = {}  # drafted, accepted, steps
    for _ in range(args.repeats):
        for kind, prompt_id, prompt_ids in prompts:
            plain = _run(engine, prompt_ids, params, None)
            speeds.setdefault((kind, "plain"), []).append(plain.stats.decode_tokens_per_s)
            for name, spec in settings.items():
                fast = _run(engine, prompt_ids, params, spec)
                if fast.token_ids != plain.token_ids:
                    raise RuntimeError(f"{name} changed the greedy output of {prompt_id}: speculation must be lossless")
                speeds.setdefault((kind, name), []).append(fast.stats.decode_tokens_per_s)
                total = counts.setdefault((kind, name), [0, 0, 0])
                for index, key in enumerate(("drafted", "accepted", "steps")):
                    total[index] += fast.stats.spec[key]
    table = []
    for kind in kinds:
        if (kind, "plain") not in speeds:
            continue
        plain_speed = statistics.median(speeds[(kind, "plain")])
        for name in settings:
            drafted, accepted, steps = counts[(kind, name)]
            speed = statistics.median(speeds[(kind, name)])
            table.append({"kind": kind, "setting": name, "plain_tokens_per_s": round(plain_speed, 2),
                          "spec_tokens_per_s": round(speed, 2), "ratio": round(speed / plain_speed, 3),
                          "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
                          "mean_accepted_length": round((accepted + steps) / steps, 2) if steps else 0.0,
                          "runs": len(speeds[(kind, name)])})
    print("| kind | setting | plain tok/s | speculative tok/s | ratio | acceptance | tokens per verification |")
    print("|---|---|---|---|---|---|---|")
    for row in table:
        print(f"| {row['kind']} | {row['setting']} | {row['plain_tokens_per_s']:.1f} | "
              f"{row['spec_tokens_per_s']:.1f} | {row['ratio']:.2f}x | {row['acceptance_rate']:.2f} | "
              f"{row['mean_accepted_length']:.2f} |")
    if args.json_path:
        report = {"model": loaded.name, "draft_model": draft.name if draft else None, "device": str(loaded.device),
                  "dtype": str(loaded.dtype).removeprefix("torch."), "kv": args.kv,
                  "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "rows": table}
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json_path}")
    return 0
