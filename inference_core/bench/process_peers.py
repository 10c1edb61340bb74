"""Engines a CPU user would pick instead of ours, as peers of `bench` (`--peer openvino`, `--peer onnxruntime-genai`,
`--peer ctranslate2`), each in a virtual environment and a process of its own.

What it owns: the table of these peers (`PEERS`: the pinned packages, the precisions, where the model comes from),
their environments (made under the local cache from the package registry the first time a peer is asked for, never
part of the app's or the suite's requirements), their models (read from the GGUF file where the engine reads GGUF,
else converted once from our converted directory by the engine's own tool, the command and its time kept beside the
result), and `ProcessPeer`, the bench's runner for one row: a child process (`peer_workers/`) that loads the model once
and answers timed greedy runs on the token ids the bench sends. Every row gets the same prompt ids as ours, greedy,
the same number of new tokens (end-of-sequence ignored), as many threads as our rows and no cache shared between runs,
and is timed by the same definitions (`peer_workers/protocol.py`). A peer that cannot be installed, converted or
started becomes a row that says why instead of failing the bench; the bench checks each peer's greedy tokens against
a reference row (`token_check`) and reports where they part.

`--peer NAME` runs every precision the peer has on a CPU; `--peer NAME:P1+P2` runs those only.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import selectors
import shlex
import shutil
import site
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from inference_core.bench.llama_cpp import PeerUnavailable, empty_row, gguf_quant, peer_gguf_path
from inference_core.config import ConfigError
from inference_core.model.dtype_choice import cpu_details, cpu_name
from inference_core.model.paths import cache_root

WORKERS = Path(__file__).with_name("peer_workers")
START_TIMEOUT_S = 600  # loading a model (OpenVINO builds its graph from the GGUF file: about 5-15 s here)
RUN_TIMEOUT_S = 600  # one timed run


@dataclass(frozen=True)
class PeerSpec:
    """One engine: its packages (pinned; none: the worker runs with this Python, as the tests' fake peer does), its
    worker script (`peer_workers/`, or a path), the precisions it runs on a CPU, and where its model comes from:
    `gguf` (the GGUF file itself), `directory` (our converted model directory as is) or a `convert` command."""
    name: str
    packages: tuple[str, ...]
    worker: str
    precisions: tuple[str, ...]
    source: str  # "gguf", "directory" or "convert"
    model_format: str  # how the row names what the engine ran: "GGUF", "ONNX", ...
    convert: Callable[[str, Path, Path, str], list[str]] | None = None  # (python, model dir, out dir, precision)
    kv_bytes_per_value: dict[str, int] | None = None  # the KV cache's bytes a value, by precision (for the roofline)
    # The environment also sees the packages of the environment the bench runs in (a converter's torch and
    # transformers, which ours has), after its own, so that only the engine's own packages are installed; the peers
    # below install everything they import.
    shares_our_packages: bool = False


def _onnxruntime_builder(python: str, model_dir: Path, out: Path, precision: str) -> list[str]:
    """ONNX Runtime GenAI's model builder for the CPU at `precision`; the LM head left out of the prompt's rows
    (`prune_lm_head`: only the last position's logits), the embedding table shared with the LM head as ours is."""
    return [python, "-m", "onnxruntime_genai.models.builder", "-i", str(model_dir), "-o", str(out), "-p", precision,
            "-e", "cpu", "-c", str(out.parent / (out.name + "-work")), "--extra_options", "prune_lm_head=true",
            "shared_embeddings=true"]


def _ctranslate2_converter(python: str, model_dir: Path, out: Path, precision: str) -> list[str]:
    """CTranslate2's converter for transformers checkpoints, its weights stored at `precision` (int8 for the int8
    compute types)."""
    script = "from ctranslate2.converters.transformers import main; main()"
    return [python, "-c", script, "--model", str(model_dir), "--output_dir", str(out), "--quantization",
            "int8" if precision.startswith("int8") else precision]


PEERS: dict[str, PeerSpec] = {
    # OpenVINO GenAI reads llama-family Q4_0, Q4_1 and Q8_0 GGUF files into its own graph; f32 and bf16 are its
    # inference precision hint on the CPU (the weights stay as the file has them).
    "openvino": PeerSpec("openvino", ("openvino-genai==2026.4.1.0",), "openvino_peer.py", ("f32", "bf16"), "gguf",
                         "GGUF", kv_bytes_per_value={"f32": 1, "bf16": 1}),  # its CPU KV cache: u8 by default
    # ONNX Runtime GenAI runs what its model builder makes from our converted model (torch and transformers are the
    # builder's); its KV cache on a CPU is fp32 at every weight precision.
    "onnxruntime-genai": PeerSpec(
        "onnxruntime-genai", ("onnxruntime-genai==0.18.0", "onnx==1.23.2", "onnx-ir==1.1.0", "torch==2.13.0",
                              "transformers==5.23.0"),
        "onnxruntime_genai_peer.py", ("int4", "int8", "fp32"), "convert", "ONNX", convert=_onnxruntime_builder,
        kv_bytes_per_value={"int4": 4, "int8": 4, "fp32": 4}),
    # CTranslate2 runs what its converter makes from our converted model; its compute types on a CPU (bfloat16 where
    # the CPU has AVX-512 BF16, which the worker's engine refuses elsewhere).
    "ctranslate2": PeerSpec(
        "ctranslate2", ("ctranslate2==4.8.5", "torch==2.13.0", "transformers==5.23.0"), "ctranslate2_peer.py",
        ("int8", "int8_float32", "float32", "bfloat16"), "convert", "CTranslate2", convert=_ctranslate2_converter,
        kv_bytes_per_value={"int8": 4, "int8_float32": 4, "float32": 4, "bfloat16": 2}),
}


def parse_peer(value: str, known: tuple[str, ...]) -> tuple[str, tuple[str, ...] | None]:
    """'onnxruntime-genai:int4+fp32' -> ('onnxruntime-genai', ('int4', 'fp32')); a bare name -> (name, None)."""
    name, _, precisions = value.partition(":")
    if name not in known:
        raise ValueError(f"unknown peer {name or repr(value)}; choose from: {', '.join(known)}")
    if not precisions:
        return name, None
    if name not in PEERS:
        raise ValueError(f"{name} takes no precisions (only {', '.join(PEERS)} do)")
    chosen = tuple(part for part in precisions.split("+") if part)
    unknown = [part for part in chosen if part not in PEERS[name].precisions]
    if unknown or not chosen:
        raise ValueError(f"{name} runs {', '.join(PEERS[name].precisions)} on a CPU, not {precisions!r}")
    return name, chosen


def row_name(spec: PeerSpec, precision: str, gguf: Path | None = None) -> str:
    """'openvino (GGUF Q4_1, f32)', 'onnxruntime-genai (ONNX, int4)'."""
    kind = spec.model_format + (f" {gguf_quant(gguf)}" if spec.source == "gguf" and gguf_quant(gguf) else "")
    return f"{spec.name} ({kind}, {precision})"


def peer_dir(spec: PeerSpec) -> Path:
    return cache_root() / "peers" / spec.name


def environment(spec: PeerSpec) -> str:
    """The Python of the peer's own virtual environment, made and filled from the package registry the first time
    (and again when the pins change); this Python where the peer has no packages."""
    if not spec.packages:
        return sys.executable
    venv = peer_dir(spec) / "venv"
    python = venv / "bin" / "python"
    marker = venv / "installed.json"
    wanted = {"packages": list(spec.packages), "shares_our_packages": spec.shares_our_packages}
    if python.is_file() and marker.is_file() and {key: json.loads(marker.read_text()).get(key, False)
                                                  for key in wanted} == wanted:
        return str(python)
    print(f"bench: installing {' '.join(spec.packages)} into {venv} (once)", flush=True)
    started = time.perf_counter()
    _run([sys.executable, "-m", "venv", "--clear", str(venv)], f"making {spec.name}'s virtual environment", 300)
    if spec.shares_our_packages:  # a .pth file puts our site-packages after the environment's own
        own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
        Path(own, "_bench_shares.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([str(python), "-m", "pip", "install", "--quiet", *spec.packages], f"installing {' '.join(spec.packages)}",
         3600)
    marker.write_text(json.dumps({**wanted, "install_s": round(time.perf_counter() - started), "installed": _now()},
                                 indent=2))
    return str(python)


def peer_model(spec: PeerSpec, python: str, model_spec: str, model_dir: Path | None, precision: str) -> tuple[Path,
                                                                                                           dict | None]:
    """The model the peer runs at `precision`, and how it was made (None: read as it is): the GGUF file, our model
    directory, or the conversion kept under the cache (made here the first time, its command and time recorded)."""
    if spec.source == "gguf":
        return peer_gguf_path(model_spec), None
    if model_dir is None:
        raise PeerUnavailable(f"{spec.name} runs a converted model directory; --model {model_spec} has none")
    if spec.source == "directory":
        return model_dir, None
    out = peer_dir(spec) / "models" / f"{model_dir.name}-{_fingerprint(model_dir)}-{precision}"
    record_path = out / "conversion.json"
    if record_path.is_file():
        return out, json.loads(record_path.read_text())
    shutil.rmtree(out, ignore_errors=True)  # what a conversion that did not finish left
    command = spec.convert(python, model_dir, out, precision)
    print(f"bench: converting for {spec.name} at {precision} (once): {shlex.join(command)}", flush=True)
    started = time.perf_counter()
    _run(command, f"converting the model for {spec.name} at {precision}", 3600)
    record = {"command": shlex.join(command), "seconds": round(time.perf_counter() - started, 1), "made": _now()}
    record_path.write_text(json.dumps(record, indent=2))
    return out, record


def _fingerprint(model_dir: Path) -> str:
    """Which weights a conversion was made from: the directory's files by name, size and modification time."""
    files = sorted((path.name, path.stat().st_size, int(path.stat().st_mtime)) for path in model_dir.iterdir()
                   if path.is_file())
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()[:12]


def host_features(threads: int) -> dict:
    """The host a row ran on, recorded in every peer row: the CPU's model, its vector and matrix extensions, the
    threads the engine was given."""
    try:
        flags = next(line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = []
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
              "amx_tile", "amx_bf16", "amx_int8")
    return {"cpu": cpu_name(), **cpu_details(), "flags": [flag for flag in wanted if flag in flags],
            "threads": threads}


class ProcessPeer:
    """One peer row: the worker process on its model, kept for the whole bench (`run` is the bench's runner)."""

    def __init__(self, name: str, command: list[str], threads: int, fields: dict, weight_bytes: int,
                 kv_bytes_per_token: float):
        self.name = name
        self.command = command
        self.threads = threads
        self.fields = fields
        self.weight_bytes = weight_bytes
        self.kv_bytes_per_token = kv_bytes_per_token
        self.log = Path(fields.get("log") or os.devnull)
        env = {**os.environ, "PYTHONPATH": str(WORKERS), "OMP_NUM_THREADS": str(threads)}
        with open(self.log, "ab") as stderr:
            self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                            env=env, text=True, bufsize=1)
        ready = self._reply(START_TIMEOUT_S, "to load its model")
        if not ready.get("ready"):
            self.close()
            raise PeerUnavailable(f"{name} did not start: {ready.get('error', ready)}")
        self.fields.update(version=ready.get("version"), load_s=ready.get("load_s"))
        self.run(list(range(1, 17)), 2)  # a short run before any clock: a crash here is an absent row, not a failure

    def _reply(self, timeout: float, what: str) -> dict:
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                self.close()
                raise PeerUnavailable(f"{self.name} gave no answer within {timeout:.0f} s {what}")
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise PeerUnavailable(f"{self.name} exited ({code}) {what}; its output is in {self.log}")
        return json.loads(line)

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> dict:
        self.process.stdin.write(json.dumps({"prompt_ids": list(prompt_ids), "max_new_tokens": max_new_tokens}) + "\n")
        self.process.stdin.flush()
        reply = self._reply(RUN_TIMEOUT_S, "for a run")
        if "error" in reply:
            raise PeerUnavailable(f"{self.name} failed a run: {reply['error']}")
        return reply

    def describe(self) -> dict:
        """The row's fields that say what ran (the bench adds the measured ones)."""
        return {"name": self.name, "compile": None, "compile_warmup_s": None, "compile_rss_mib": None,
                "weights_mib": round(self.weight_bytes / 2**20, 1), "threads": self.threads, **self.fields,
                "host": host_features(self.threads)}

    def decode_bytes_per_step(self, context_len: float) -> float:
        """Bytes one decode step reads: the model's files (every weight once) plus the context's KV at the engine's
        cache precision."""
        return self.weight_bytes + context_len * self.kv_bytes_per_token

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def open_process_peers(requests: list[tuple[str, tuple[str, ...] | None]], model_spec: str, model_dir: Path | None,
                       threads: int, kv_values_per_token: int) -> tuple[dict, list]:
    """The bench's rows for `requests` ((peer, precisions or None: all)): runners by row name, and absent rows (each
    with why) for what could not be installed, converted or started. `kv_values_per_token`: K and V values a token
    (layers x 2 x kv heads x head dim), for each row's roofline."""
    runners, absent = {}, []
    for name, precisions in requests:
        spec = PEERS[name]
        try:
            python = environment(spec)
        except (PeerUnavailable, ConfigError) as error:
            absent += [_absent(spec, precision, model_spec, str(error)) for precision in precisions or spec.precisions]
            continue
        for precision in precisions or spec.precisions:
            try:
                path, conversion = peer_model(spec, python, model_spec, model_dir, precision)
                runner = _start(spec, python, path, precision, conversion, threads, kv_values_per_token)
                runners[runner.name] = runner
            except (PeerUnavailable, ConfigError) as error:
                absent.append(_absent(spec, precision, model_spec, str(error)))
    return runners, absent


def _start(spec: PeerSpec, python: str, path: Path, precision: str, conversion: dict | None, threads: int,
           kv_values_per_token: int) -> ProcessPeer:
    name = row_name(spec, precision, path if spec.source == "gguf" else None)
    log = peer_dir(spec) / f"{precision}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [python, str(WORKERS / spec.worker), str(path), precision, str(threads)]
    files = [path] if path.is_file() else [file for file in path.rglob("*") if file.is_file()]
    weights = sum(file.stat().st_size for file in files if file.suffix in (".gguf", ".data", ".onnx", ".bin",
                                                                           ".safetensors"))
    kv_bytes = kv_values_per_token * (spec.kv_bytes_per_value or {}).get(precision, 2)
    fields = {"kv": f"{spec.name}'s own", "quant": f"{precision} ({spec.model_format})", "peer": spec.name,
              "packages": list(spec.packages), "conversion": conversion, "worker_command": shlex.join(command),
              "log": str(log)}
    print(f"bench: starting {name}", flush=True)
    return ProcessPeer(name, command, threads, fields, weights, kv_bytes)


def _absent(spec: PeerSpec, precision: str, model_spec: str, reason: str) -> dict:
    print(f"bench: {spec.name} at {precision} absent: {reason}", flush=True)
    try:
        gguf = peer_gguf_path(model_spec) if spec.source == "gguf" else None
    except (PeerUnavailable, ConfigError):
        gguf = None
    return empty_row(row_name(spec, precision, gguf), reason)


def token_check(peer_tokens: dict[str, list[int]], reference: dict[str, list[int]], reference_name: str,
                eos_ids: set[int]) -> dict:
    """Where a peer's greedy tokens part from the reference row's, prompt by prompt: each prompt's first differing
    position (None: equal), compared up to and including the reference's first end-of-sequence token (after it the
    engines differ in how they ignore it)."""
    prompts = {}
    for prompt_id, want in reference.items():
        got = peer_tokens.get(prompt_id, [])
        end = next((i + 1 for i, token in enumerate(want) if token in eos_ids), len(want))
        prompts[prompt_id] = next((i for i, (a, b) in enumerate(zip(got[:end], want[:end])) if a != b),
                                  None if len(got) >= end else len(got))
    return {"against": reference_name, "first_difference": prompts,
            "equal": all(position is None for position in prompts.values())}


def _run(command: list[str], what: str, timeout: float) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PeerUnavailable(f"{what} took over {timeout:.0f} s") from None
    except OSError as error:
        raise PeerUnavailable(f"{what} failed: {error}") from None
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
        raise PeerUnavailable(f"{what} failed (exit {done.returncode}):\n{tail}")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
