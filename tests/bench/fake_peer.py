"""A peer of `bench` for the tests (`test_process_peers.py`): our own engine in a process of its own, behind the
process-peer protocol (`inference_core/bench/peer_workers/protocol.py`), so the bench's handling of peer rows is tested
without installing another engine. `fake_peer.py MODEL_DIR PRECISION THREADS`: precision `ours` decodes greedily as our
paged engine does (its tokens equal our rows'), `shifted` changes the fourth token, `broken` fails to open."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: our engine stands in for a peer's

from protocol import serve  # noqa: E402 (the peer's side of the protocol, on PYTHONPATH as for every worker)


def open_engine(model_dir: str, precision: str):
    if precision == "broken":
        raise RuntimeError("this fake engine does not open")
    from inference_core import Engine, EngineConfig, SamplingParams, load_model

    engine = Engine(load_model(model_dir, device="cpu", dtype="float32"), EngineConfig(kv_mode="paged"))

    def generate(prompt_ids, max_new_tokens, on_token):
        tokens = engine.complete(prompt_ids, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)).token_ids
        for position, token in enumerate(tokens):
            time.sleep(0.001)  # tokens a millisecond apart, so decode tokens/s is a number
            on_token(token + 1 if precision == "shifted" and position == 3 else token)

    return generate


if __name__ == "__main__":
    serve(lambda: open_engine(sys.argv[1], sys.argv[2]), "fake 1.0")
