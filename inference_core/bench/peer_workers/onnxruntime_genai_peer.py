"""ONNX Runtime GenAI as a peer of `bench` (`--peer onnxruntime-genai`), run with the peer environment's Python:
`onnxruntime_genai_peer.py MODEL_DIR PRECISION THREADS`. MODEL_DIR is what ONNX Runtime GenAI's model builder made
from our converted model for the CPU at PRECISION (int4, int8 or fp32; `process_peers` runs the builder once and keeps
the result). Its CPU execution provider with THREADS intra-op threads; a new generator per run (an empty KV cache);
the prompt goes in as token ids, greedy, exactly the tokens asked for. Protocol and timing: `protocol.py`."""

import json
import sys

import onnxruntime_genai as og
from protocol import serve


def open_engine(model_dir: str, threads: int):
    config = og.Config(model_dir)
    config.clear_providers()  # the CPU provider
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(config)

    def generate(prompt_ids, max_new_tokens, on_token):
        params = og.GeneratorParams(model)
        # min_length keeps it going past an end-of-sequence token, as our rows do.
        length = len(prompt_ids) + max_new_tokens
        params.set_search_options(do_sample=False, max_length=length, min_length=length)
        generator = og.Generator(model, params)
        generator.append_tokens(prompt_ids)
        for _ in range(max_new_tokens):
            generator.generate_next_token()
            on_token(int(generator.get_next_tokens()[0]))

    return generate


if __name__ == "__main__":
    model_dir, _precision, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    serve(lambda: open_engine(model_dir, threads), f"onnxruntime-genai {og.__version__}")
