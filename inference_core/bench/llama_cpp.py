"""llama.cpp as a peer of `bench` (`--peer llama-cpp`): the same GGUF file, prompts, greedy decoding and token counts
through `llama-cpp-python`, an optional install (`INSTALL_COMMAND`) that this module imports only when asked.

What it owns: finding the GGUF that llama.cpp can run for a `--model` (the bundled file or a `.gguf` path), one
`llama_cpp.Llama` on it, a timed greedy loop, and the row the bench prints. What it does to be a fair peer:
- Identical prompt tokens. The bench renders each prompt through OUR tokenizer's chat template into ids, and llama.cpp
  is fed those ids (`Llama.eval`), never text, so both engines compute on the same tokens. As a check, each prompt's
  ids are rendered to text by llama.cpp (special tokens included) and tokenized back by llama.cpp (special tokens
  parsed, no BOS added): `prompt_tokens_match` in the row says whether every prompt came back as the same ids, i.e.
  whether llama.cpp would have tokenized the chat text exactly as we do (tests/bench/test_peer_llama_cpp.py checks
  the same on the chat text our template renders).
- The same definitions as bench.py: the KV cache is emptied before each run (`Llama.reset()` rewinds to position 0,
  and the next `eval` removes every cached position), so TTFT is a cold prompt: prompt eval plus the first argmax.
  Decode tokens/s counts the tokens after the first over the time from the first token to the last; each token is one
  `eval` of the previous token and an argmax of its logits, with the clock read after the argmax. End-of-sequence is
  never checked, so every run produces exactly `max_new_tokens` tokens.
- llama.cpp's own settings where ours have no say: its default f16 KV cache; flash attention on (what llama.cpp's
  own `auto` resolves to on a CPU backend; the Python binding only offers on or off); the whole prompt in one batch
  (as our engine prefills it); as many threads as torch uses for our rows (torch's default: the physical cores).
"""

from __future__ import annotations

import functools
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from inference_core.config import ConfigError
from inference_core.model.bundled import BUNDLED_NAMES, bundled_gguf_path

PEERS = ("llama-cpp", "llama-bench", "ik-llama-bench")  # the benches: `inference_core.bench.llama_bench`
INSTALL_COMMAND = 'CMAKE_ARGS="-DGGML_NATIVE=ON" python -m pip install llama-cpp-python==0.3.36'
# The same, less llama.cpp's AMX code, for hosts where it crashes (`crash`): GCC keeps an ISA that -mno-... turns off
# whatever -march=native says.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
NO_AMX_INSTALL_COMMAND = (f"CMAKE_ARGS=\"-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='{NO_AMX}' -DCMAKE_CXX_FLAGS='{NO_AMX}'\" "
                          "python -m pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python==0.3.36")
# A 16-token prompt and one more token through llama-cpp-python, in a child process (`crash`).
_CHECK = """import sys, llama_cpp
threads = int(sys.argv[2])
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_batch=64, n_ubatch=64, n_threads=threads,
                      n_threads_batch=threads, flash_attn=True, verbose=False)
llm.eval(list(range(1, 17)))
llm.eval([1])
"""


class PeerUnavailable(Exception):
    """The peer cannot run here; the message says why and what would change that. The bench reports it, not fails."""


def cpu_has_amx() -> bool:
    """Whether the CPU reports AMX (Linux's `amx_tile` flag)."""
    try:
        return " amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# Why a crash on a CPU with AMX is llama.cpp's AMX code, as both peers' messages say.
AMX_CRASHES = "this CPU has AMX, whose llama.cpp path crashes on some hosts (llama.cpp issue 20824)"


def check_run(command: list[str]) -> str | None:
    """How `command`, a short run of llama.cpp in a child process, fails (None: it runs): killed by a signal, a
    non-zero exit with the end of its stderr, or no answer within 300 s."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "no answer within 300 s"
    if done.returncode < 0:
        return f"killed by signal {-done.returncode} ({signal.Signals(-done.returncode).name})"
    return f"exit {done.returncode}: {done.stderr.strip()[-300:]}" if done.returncode else None


@functools.cache
def crash(gguf_path: Path, threads: int) -> str | None:
    """How llama-cpp-python fails a 16-token prompt on `gguf_path` in a child process (None: it runs). On a 2-vCPU
    Intel host with AMX (2026-11-29), a native build died in its first prompt (SIGSEGV in llama.cpp's
    `ggml_backend_amx_mul_mat`, llama.cpp issue 20824), which in the bench's own process would end the bench."""
    return check_run([sys.executable, "-c", _CHECK, str(gguf_path), str(threads)])


def peer_gguf_path(model_spec: str) -> Path:
    """The GGUF file llama.cpp can run for a bench `--model`: the bundled file or a `.gguf` path."""

    if model_spec in BUNDLED_NAMES:
        return bundled_gguf_path()
    path = Path(model_spec).expanduser()
    if path.suffix != ".gguf":
        raise PeerUnavailable(f"llama.cpp runs GGUF files only: --model {model_spec} is neither 'bundled' nor a "
                              ".gguf file (bench the .gguf file of the same weights to compare with llama.cpp).")
    return path.resolve()


def gguf_quant(gguf_path: Path | None) -> str | None:
    """'Q4_1' for SmolLM2-135M-Instruct.Q4_1.gguf: the file name's last dotted part, as GGUF files are named."""
    stem = gguf_path.stem if gguf_path else ""
    return stem.rsplit(".", 1)[-1] if "." in stem else None


def row_name(gguf_path: Path | None) -> str:
    quant = gguf_quant(gguf_path)
    return f"llama.cpp ({quant} GGUF)" if quant else "llama.cpp (GGUF)"


class LlamaCppRunner:
    """One `llama_cpp.Llama` on a GGUF file; `run(prompt_ids, max_new_tokens)` returns the bench's timing dict."""

    def __init__(self, gguf_path: Path, context_len: int, kv_bytes_per_token: int, threads: int):
        try:
            import llama_cpp  # optional dependency: llama-cpp-python (INSTALL_COMMAND)
        except ImportError:
            raise PeerUnavailable(f"llama-cpp-python is not installed; install it with: {INSTALL_COMMAND}") from None
        if (failed := crash(gguf_path, threads)) is not None:
            hint = (f"; {AMX_CRASHES}: reinstall llama-cpp-python without it: {NO_AMX_INSTALL_COMMAND}"
                    if cpu_has_amx() else "")
            raise PeerUnavailable(f"llama-cpp-python crashed on a 16-token prompt here ({failed}){hint}")
        self._llama_cpp = llama_cpp
        self.gguf_path = gguf_path
        self.name = row_name(gguf_path)
        self.threads = threads
        self.kv_bytes_per_token = kv_bytes_per_token  # at f16, llama.cpp's default KV type
        self.llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=context_len, n_batch=context_len,
                                   n_ubatch=context_len, n_threads=threads, n_threads_batch=threads,
                                   flash_attn=True, verbose=False)
        self.n_vocab = self.llm.n_vocab()
        self.prompt_tokens_match: dict[tuple[int, ...], bool] = {}
        self.last_token_ids: list[int] = []

    def _argmax_last_logits(self) -> int:
        # The logits of the batch's last token (the only row llama.cpp computed): [n_vocab].
        pointer = self._llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).argmax())

    def check_tokens(self, prompt_ids: list[int]) -> bool:
        """Does llama.cpp tokenize the text of `prompt_ids` (special tokens written out) back to the same ids?"""
        key = tuple(prompt_ids)
        if key not in self.prompt_tokens_match:
            text = self.llm.detokenize(list(prompt_ids), special=True)
            self.prompt_tokens_match[key] = self.llm.tokenize(text, add_bos=False, special=True) == list(prompt_ids)
        return self.prompt_tokens_match[key]

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> dict:
        self.check_tokens(prompt_ids)  # once per prompt, outside the clock
        # 1. A cold prompt: rewind to position 0 (the eval below drops every cached position).
        self.llm.reset()
        start = time.perf_counter()
        # 2. Prompt eval and the first token.
        self.llm.eval(list(prompt_ids))
        token_ids = [self._argmax_last_logits()]
        token_times = [time.perf_counter()]
        # 3. Decode: one eval of the previous token per new token, end-of-sequence ignored.
        while len(token_ids) < max_new_tokens:
            self.llm.eval(token_ids[-1:])
            token_ids.append(self._argmax_last_logits())
            token_times.append(time.perf_counter())
        self.last_token_ids = token_ids
        first, last = token_times[0], token_times[-1]
        return {"ttft_ms": (first - start) * 1e3, "prefill_tokens_per_s": len(prompt_ids) / (first - start),
                "decode_tokens_per_s": (len(token_times) - 1) / (last - first)}

    def describe(self) -> dict:
        """The row's fields that say what ran (the bench adds the measured ones)."""
        quant = gguf_quant(self.gguf_path) or "as stored"
        return {"name": self.name, "kv": "llama.cpp (f16)", "quant": f"{quant} (GGUF)",
                "weights_mib": round(self.gguf_path.stat().st_size / 2**20, 1), "compile": None,
                "compile_warmup_s": None, "compile_rss_mib": None, "threads": self.threads,
                "llama_cpp_version": self._llama_cpp.__version__,
                "prompt_tokens_match": all(self.prompt_tokens_match.values())}

    def decode_bytes_per_step(self, context_len: float) -> float:
        """Bytes one decode step reads: the whole GGUF file (every tensor once; a tied embedding table serves as the
        LM head) plus K and V of the context at f16."""
        return self.gguf_path.stat().st_size + context_len * self.kv_bytes_per_token


def open_llama_cpp(model_spec: str, context_len: int, kv_bytes_per_token: int, threads: int) -> LlamaCppRunner:
    """The llama.cpp peer for a bench `--model`; raises PeerUnavailable with the reason when it cannot run."""
    return LlamaCppRunner(peer_gguf_path(model_spec), context_len, kv_bytes_per_token, threads)


def open_peers(names: list[str], model_spec: str, context_len: int, kv_bytes_per_token: int) -> tuple[dict, list]:
    """The bench's `--peer` rows: runners by row name, and absent rows (printed) for peers that cannot run here.
    llama.cpp gets as many threads as torch uses for our rows."""
    runners, absent = {}, []
    for name in dict.fromkeys(names):  # each peer once, in the order asked
        assert name in PEERS, name  # the command line allows only these
        if name != "llama-cpp":
            continue
        try:
            runner = open_llama_cpp(model_spec, context_len, kv_bytes_per_token, torch.get_num_threads())
            runners[runner.name] = runner
        except PeerUnavailable as error:
            absent.append(absent_row(model_spec, str(error)))
            print(f"bench: {absent[-1]['name']} absent: {error}", flush=True)
    return runners, absent


def absent_row(model_spec: str, reason: str, peer: str = "llama.cpp") -> dict:
    """A peer that could not run, as a bench row: the same fields, no numbers, and why."""
    try:
        name = row_name(peer_gguf_path(model_spec))
    except (PeerUnavailable, ConfigError):  # not a GGUF model, or the bundled file missing: the reason says so
        name = row_name(None)
    return empty_row(name.replace("llama.cpp", peer, 1), reason)


def empty_row(name: str, reason: str) -> dict:
    """A bench row of a peer that could not run: the fields every row has, no numbers, and why (`absent`)."""
    return {"name": name, "kv": None, "quant": None, "weights_mib": None, "compile": None, "compile_warmup_s": None,
            "compile_rss_mib": None, "decode_tokens_per_s": None, "ttft_ms": None, "prefill_tokens_per_s": None,
            "prefill_long_tokens_per_s": None, "roofline_pct": None, "roofline_pct_paired": None,
            "roofline_pct_paired_range": None, "decode_tokens_per_s_runs": None,
            "read_probes_after_runs_gb_s": None, "runs": 0, "speedup_vs_hf": None, "absent": reason}
