"""OpenVINO GenAI as a peer of `bench` (`--peer openvino`), run with the peer environment's Python:
`openvino_peer.py GGUF_FILE PRECISION THREADS`. OpenVINO GenAI reads a llama-family GGUF file (Q4_0, Q4_1, Q8_0)
directly into its own graph; PRECISION is its inference precision hint on the CPU (f32 or bf16). A stateful pipeline
with SDPA attention (no paged KV cache, so no prefix cache between runs); the prompt goes in as token ids, greedy,
end-of-sequence ignored. Protocol and timing: `protocol.py`."""

import sys

import numpy as np
import openvino as ov
import openvino_genai as genai
from protocol import serve


def open_engine(gguf: str, precision: str, threads: int):
    capabilities = ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    if precision == "bf16" and "BF16" not in capabilities:  # OpenVINO would run f32 under the bf16 row's name
        raise RuntimeError(f"this CPU has no native bf16 math for OpenVINO (its capabilities: {', '.join(capabilities)})")
    pipe = genai.LLMPipeline(gguf, "CPU", INFERENCE_NUM_THREADS=threads, ATTENTION_BACKEND="SDPA",
                             INFERENCE_PRECISION_HINT=precision)
    config = genai.GenerationConfig()
    config.do_sample = False
    config.ignore_eos = True

    class Streamer(genai.StreamerBase):
        def __init__(self, on_token):
            super().__init__()
            self.on_token = on_token

        def write(self, token):
            for token_id in token if isinstance(token, list) else [token]:
                self.on_token(token_id)
            return genai.StreamingStatus.RUNNING

        def end(self):
            pass

    def generate(prompt_ids, max_new_tokens, on_token):
        config.max_new_tokens = max_new_tokens
        ids = np.array([prompt_ids], dtype=np.int64)
        inputs = genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        pipe.generate(inputs, config, Streamer(on_token))

    return generate


if __name__ == "__main__":
    model, precision, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    serve(lambda: open_engine(model, precision, threads), f"openvino-genai {genai.__version__}")
