"""CTranslate2 as a peer of `bench` (`--peer ctranslate2`), run with the peer environment's Python:
`ctranslate2_peer.py MODEL_DIR PRECISION THREADS`. MODEL_DIR is what CTranslate2's converter made from our converted
model (`process_peers` runs it once and keeps the result); PRECISION is its compute type on the CPU (int8,
int8_float32, float32 or bfloat16). CTranslate2 takes tokens as strings: each id is its entry in the converted model's
vocabulary, so the engine computes on the same ids as ours. Greedy, the end-of-sequence token kept from stopping it
(`min_length`), a new generation per run (nothing cached between runs). Protocol and timing: `protocol.py`."""

import json
import sys
from pathlib import Path

import ctranslate2
from protocol import serve


def open_engine(model_dir: str, precision: str, threads: int):
    vocabulary = json.loads((Path(model_dir) / "vocabulary.json").read_text())
    generator = ctranslate2.Generator(model_dir, device="cpu", compute_type=precision, inter_threads=1,
                                      intra_threads=threads)

    def generate(prompt_ids, max_new_tokens, on_token):
        tokens = [vocabulary[token_id] for token_id in prompt_ids]
        steps = generator.generate_tokens(tokens, max_length=max_new_tokens, min_length=max_new_tokens,
                                          sampling_topk=1)
        for step in steps:
            on_token(step.token_id)

    return generate


if __name__ == "__main__":
    model_dir, precision, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    serve(lambda: open_engine(model_dir, precision, threads), f"ctranslate2 {ctranslate2.__version__}")
