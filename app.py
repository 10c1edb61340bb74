"""Start the playground: parse flags, load the model once, build the Gradio app, queue it and serve it.

    python app.py [--model bundled] [--draft-model none] [--device auto] [--dtype auto] [--host 127.0.0.1]
                  [--port 7860] [--max-seq-len 2048] [--max-queue 32] [--max-run-seconds 180]

Each flag can also come from the environment (PLAYGROUND_MODEL, PLAYGROUND_DRAFT_MODEL, PLAYGROUND_DEVICE,
PLAYGROUND_DTYPE, PLAYGROUND_HOST, PLAYGROUND_PORT, PLAYGROUND_MAX_SEQ_LEN, PLAYGROUND_MAX_RUN_SECONDS); Gradio's
own GRADIO_SERVER_NAME and GRADIO_SERVER_PORT are honoured too. `--draft-model` (same forms as `--model`; default
'none') loads a second, smaller model on the same device and dtype as the draft source for speculative decoding: the
lanes and the chat then offer "draft model" as a draft source. It must share the target's tokenizer; the engine
checks that at start-up and a mismatch exits with status 2 and a message, like any other bad setting.
dtype 'auto' picks the fastest dtype for the device (`inference_core.loader.choose_dtype`: bfloat16 on CUDA, and on a
CPU bfloat16 only where it has native bf16 math and measures faster; the page header says which and why). On a
Hugging Face Space (SPACE_ID is set), where the bundled model's package is not installed, the default model is the
same SmolLM2-135M-Instruct from the Hub.
"""

from __future__ import annotations

import argparse
import os
import sys

from inference_core import ConfigError, load_model
from inference_core.config import parse_device
from ui.settings import DEFAULT_MAX_RUN_S


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
    parser.add_argument("--host", default=env("PLAYGROUND_HOST", env("GRADIO_SERVER_NAME", "127.0.0.1")))
    parser.add_argument("--port", type=int, default=int(env("PLAYGROUND_PORT", env("GRADIO_SERVER_PORT", "7860"))))
    parser.add_argument("--max-seq-len", type=int, default=int(env("PLAYGROUND_MAX_SEQ_LEN", "2048")),
                        help="context length of every engine (prompt + new tokens)")
    parser.add_argument("--max-queue", type=int, default=32, help="requests that may wait; more are turned away")
    parser.add_argument("--max-run-seconds", type=float,
                        default=float(env("PLAYGROUND_MAX_RUN_SECONDS", DEFAULT_MAX_RUN_S)),
                        help="device time one race (both lanes) or one chat turn may take; longer ones are refused "
                             "before they start (from an estimate) and stopped if they run over")
    return parser.parse_args(argv)


def create_demo(args: argparse.Namespace):
    """Load the model and build the queued app (what `main` serves; tests serve it in-process)."""
    import ui
    from ui.settings import EnginePool

    if args.max_run_seconds <= 0:
        raise ConfigError(f"--max-run-seconds must be positive, got {args.max_run_seconds:g}.")
    device = parse_device(args.device)
    loaded = load_model(args.model, str(device), args.dtype)
    draft = None if args.draft_model.lower() in ("", "none") else \
        load_model(args.draft_model, str(device), loaded.dtype_name)  # the target's dtype
    pool = EnginePool(loaded, max_seq_len=args.max_seq_len, draft=draft, max_run_s=args.max_run_seconds)
    ui.warm_up(pool)  # also builds a draft engine, so a draft model the engine refuses (another tokenizer) fails here
    demo = ui.build_demo(pool).queue(max_size=args.max_queue, default_concurrency_limit=1)
    return demo, pool


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        demo, _ = create_demo(args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    demo.launch(server_name=args.host, server_port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
