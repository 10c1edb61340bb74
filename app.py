"""Start the playground: parse flags, load the model once, build the Gradio app, queue it and serve it with the
OpenAI-compatible API, /health and /metrics on the same port (`server.app`).

    python app.py [--model bundled] [--draft-model none] [--device auto] [--dtype auto] [--serving fastest]
                  [--host 127.0.0.1] [--port 7860] [--max-seq-len 2048] [--max-queue 32] [--max-run-seconds 180]
                  [--public | --no-public] [--allow-model ID ...] [--allow-endpoint URL ...]
                  [--max-prompt-tokens N] [--max-new-tokens N] [--requests-per-minute N] [--tokens-per-hour N]

Public mode (on by default on a Space) serves only allowlisted models and none from a local path, caps every
request, limits each caller's requests per minute and tokens per hour, and lets a lane target only the external
engines allowed here (docs/api.md). The caps apply to the page and the API alike (`serving.policy.ServePolicy`).

Each flag can also come from the environment (PLAYGROUND_MODEL, PLAYGROUND_DRAFT_MODEL, PLAYGROUND_DEVICE,
PLAYGROUND_DTYPE, PLAYGROUND_HOST, PLAYGROUND_PORT, PLAYGROUND_MAX_SEQ_LEN, PLAYGROUND_MAX_RUN_SECONDS); Gradio's
own GRADIO_SERVER_NAME and GRADIO_SERVER_PORT are honoured too. `--draft-model` (same forms as `--model`; default
'none') loads a second, smaller model on the same device and dtype as the draft source for speculative decoding: the
lanes and the chat then offer "draft model" as a draft source. It must share the target's tokenizer; the engine
checks that at start-up and a mismatch exits with status 2 and a message, like any other bad setting.
dtype 'auto' picks the fastest dtype for the device (`inference_core.model.dtype_choice`: bfloat16 on CUDA, and on a
CPU bfloat16 only where it has native bf16 math and measures faster, measured once per host and model shape and
cached, so every start picks the same; the page header says which and why). On a
Hugging Face Space (SPACE_ID is set), where the bundled model's package is not installed, the default model is the
same SmolLM2-135M-Instruct from the Hub.

`--serving` (PLAYGROUND_SERVING) is the engine the chat starts with and an API request that names none of the
playground's settings runs on (`serving.build`): `fastest` (the default), the fastest configuration inside the
quality table's limits on this device (on a CPU: int4 weights by int8 activations, or int4 where the CPU has BF16 dot
products and that measured at least as fast, compiled; its compiled steps are built in a background process on a
first start, minutes on a CPU, and served eager meanwhile); `reference`, the model's own weights, eager (the outputs
transformers gives: what a scoring client such as lm-evaluation-harness should read).
"""

from __future__ import annotations

try:  # on a ZeroGPU Space, `spaces` must come before anything that initializes CUDA (`serving.zero_gpu`)
    import spaces  # noqa: F401  (optional dependency: installed on a Space)
except ImportError:
    pass

import argparse
import os
import sys
from dataclasses import replace

import uvicorn

import ui
from inference_core import ConfigError, load_model
from inference_core.config import parse_device
from server.app import create_app
from serving.build import SERVING_MODES, serving_settings
from serving.policy import ServePolicy
from serving.pool import DEFAULT_MAX_RUN_S, EnginePool

SHUTDOWN_GRACE_S = 5  # seconds a stop waits for open requests (a page's stream stays open while the page does)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(description="Inference Playground: race two engine configurations and chat.")
    default_model = "HuggingFaceTB/SmolLM2-135M-Instruct" if env("SPACE_ID") else "bundled"
    parser.add_argument("--model", default=env("PLAYGROUND_MODEL", default_model),
                        help="'bundled', a local directory, a .gguf file or a Hub id")
    parser.add_argument("--draft-model", default=env("PLAYGROUND_DRAFT_MODEL", "none"),
                        help="draft model for speculative decoding (same forms as --model), or 'none'")
    parser.add_argument("--device", default=env("PLAYGROUND_DEVICE", "auto"), help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default=env("PLAYGROUND_DTYPE", "auto"), help="auto, float32, bfloat16, float16")
    parser.add_argument("--serving", default=env("PLAYGROUND_SERVING", "fastest"), choices=SERVING_MODES,
                        help="the chat's and the API's default engine: fastest (inside the quality limits, compiled "
                             "once built in the background) or reference (the model's weights, eager)")
    default_host = "0.0.0.0" if env("SPACE_ID") else "127.0.0.1"  # a Space reaches the app from outside the container
    parser.add_argument("--host", default=env("PLAYGROUND_HOST", env("GRADIO_SERVER_NAME", default_host)))
    parser.add_argument("--port", type=int, default=int(env("PLAYGROUND_PORT", env("GRADIO_SERVER_PORT", "7860"))))
    parser.add_argument("--max-seq-len", type=int, default=int(env("PLAYGROUND_MAX_SEQ_LEN", "2048")),
                        help="context length of every engine (prompt + new tokens)")
    parser.add_argument("--max-queue", type=int, default=int(env("PLAYGROUND_MAX_QUEUE", "32")),
                        help="requests that may wait or run; more are turned away (the API answers 429)")
    parser.add_argument("--public", action=argparse.BooleanOptionalAction,
                        default=env("PLAYGROUND_PUBLIC", "1" if env("SPACE_ID") else "0") not in ("0", "", "false"),
                        help="public mode (default on a Space): allowlisted models only, no local paths, per-caller "
                             "rate and token limits")
    parser.add_argument("--allow-model", action="append", default=_env_list("PLAYGROUND_ALLOW_MODELS"),
                        help="public mode: a model the app may serve (repeat; default: the --model given)")
    parser.add_argument("--allow-endpoint", action="append", default=_env_list("PLAYGROUND_ALLOW_ENDPOINTS"),
                        help="an OpenAI-compatible server a lane may race against (repeat); in public mode only "
                             "these, elsewhere any URL")
    parser.add_argument("--max-prompt-tokens", type=int, default=int(env("PLAYGROUND_MAX_PROMPT_TOKENS", "0")),
                        help="longest prompt accepted (0: the context; public mode: 2048)")
    parser.add_argument("--max-new-tokens", type=int, default=int(env("PLAYGROUND_MAX_NEW_TOKENS", "0")),
                        help="most new tokens per request (0: 512; public mode: 256)")
    parser.add_argument("--requests-per-minute", type=int, default=int(env("PLAYGROUND_REQUESTS_PER_MINUTE", "-1")),
                        help="per caller (0: unlimited; default: unlimited, public mode 20)")
    parser.add_argument("--tokens-per-hour", type=int, default=int(env("PLAYGROUND_TOKENS_PER_HOUR", "-1")),
                        help="prompt + new tokens per caller (0: unlimited; default: unlimited, public mode 20000)")
    parser.add_argument("--max-run-seconds", type=float,
                        default=float(env("PLAYGROUND_MAX_RUN_SECONDS", DEFAULT_MAX_RUN_S)),
                        help="device time one race (both lanes) or one chat turn may take; longer ones are refused "
                             "before they start (from an estimate) and stopped if they run over")
    args = parser.parse_args(argv)
    if args.serving not in SERVING_MODES:  # from the environment: argparse checks only what a flag gives
        parser.error(f"PLAYGROUND_SERVING must be one of {', '.join(SERVING_MODES)}, not {args.serving!r}")
    return args


def _env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


def serve_policy(args: argparse.Namespace) -> ServePolicy:
    """The deployment's caps from the flags: public mode's defaults where a flag was left at its default."""
    overrides = {"allowed_models": tuple(args.allow_model or ()), "allowed_endpoints": tuple(args.allow_endpoint or ()),
                 "max_queue": args.max_queue}
    for name, value in (("max_prompt_tokens", args.max_prompt_tokens), ("max_new_tokens", args.max_new_tokens)):
        if value < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be 0 or more, got {value}.")
        if value:
            overrides[name] = value
    for name in ("requests_per_minute", "tokens_per_hour"):
        value = getattr(args, name)
        if value < -1:
            raise ConfigError(f"--{name.replace('_', '-')} must be 0 (unlimited) or more, got {value}.")
        if value >= 0:
            overrides[name] = value
    if args.max_queue < 1:
        raise ConfigError(f"--max-queue must be at least 1, got {args.max_queue}.")
    if args.public:
        return ServePolicy.public_defaults(**overrides)
    return ServePolicy(**overrides)


def create_demo(args: argparse.Namespace):
    """Load the model and build the queued app (what `main` serves; tests serve it in-process)."""
    if args.max_run_seconds <= 0:
        raise ConfigError(f"--max-run-seconds must be positive, got {args.max_run_seconds:g}.")
    policy = serve_policy(args)
    policy.check_model_spec(args.model, args.model)
    if args.draft_model.lower() not in ("", "none"):
        policy.check_model_spec(args.draft_model, args.draft_model)
    device = parse_device(args.device)
    loaded = load_model(args.model, str(device), args.dtype)
    draft = None if args.draft_model.lower() in ("", "none") else \
        load_model(args.draft_model, str(device), loaded.dtype_name)  # the target's dtype
    policy = replace(policy, max_prompt_tokens=min(policy.max_prompt_tokens, args.max_seq_len))
    pool = EnginePool(loaded, max_seq_len=args.max_seq_len, draft=draft, max_run_s=args.max_run_seconds,
                      policy=policy, serving=serving_settings(loaded, args.serving))
    pool.build_serving()  # where the serving settings are compiled: their steps, in a process of their own
    ui.warm_up(pool)  # also builds a draft engine, so a draft model the engine refuses (another tokenizer) fails here
    demo = ui.build_demo(pool).queue(max_size=args.max_queue, default_concurrency_limit=1)
    return demo, pool


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        demo, pool = create_demo(args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    mode = "public mode" if pool.policy.public else "private mode"
    print(f"Serving the playground and its OpenAI-compatible API ({mode}) at http://{args.host}:{args.port} "
          f"(API base http://{args.host}:{args.port}/v1)", flush=True)
    building = pool.build is not None and pool.build.state == "building"
    print(f"The chat and the API serve: {pool.serving.describe()} (--serving {args.serving})"
          + ("; its compiled steps are being built in a background process, eager until then" if building else ""),
          flush=True)
    # A stop (Ctrl-C, or a host's SIGTERM) waits for open requests this long, then closes them: an open page holds a
    # streaming connection that would otherwise keep the server up until the host kills it.
    try:
        uvicorn.run(create_app(demo, pool), host=args.host, port=args.port, log_level="warning",
                    timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    finally:
        if pool.build is not None:
            pool.build.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
