"""What `python app.py` serves the chat and the API with, and its compiled steps built while the app already serves.

`serving_settings`: the chat's and the API's default engine. `fastest` (the app's default) is paged KV with the
fastest weights inside the quality table's limits on this device (`quant.linear.fastest_quant`: int4 by int8
activations, +5.4% perplexity on the bundled model, or int4 alone where the CPU has BF16 dot products and our int4
loop measured at least as fast) and, on a CPU with a C++ compiler, compiled steps;
`reference` is paged KV in the model's own weights, eager: the outputs transformers gives on the same weights (what a
scoring client such as lm-evaluation-harness should read). A visitor's own chat settings, and every API request's
playground fields, still choose any other engine.

Compiled steps take minutes each on a CPU the first time (the flat step and one decode graph per batch bucket), then
load from the disk cache in seconds. So that the first start does not wait for them, `ServingBuild` runs `python -m
inference_core precompile` for the serving settings in a process of its own, at a lower CPU priority, while the pool
serves the same settings eager (`EnginePool.runnable`); once every step is on disk the pool loads them between the
engine loop's steps and the chat and the API switch to the compiled engine. A second start finds them on disk (the
child loads them, then the pool) and switches within about a minute. The child process ends with the app.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from inference_core.config import ConfigError
from inference_core.engine.compiled import compile_unavailable
from inference_core.quant.linear import fastest_quant
from inference_core.settings import LaneSettings, command_flags

SERVING_MODES = ("fastest", "reference")
BUILD_NICENESS = 10  # the build yields the CPU to the serving engine's steps
ROOT = Path(__file__).resolve().parents[1]  # where the child imports inference_core from


def serving_settings(loaded, mode: str) -> LaneSettings:
    """The chat's and the API's default settings under `mode` (see the module docstring)."""
    if mode not in SERVING_MODES:  # PLAYGROUND_SERVING is not checked by the flag's choices
        raise ConfigError(f"unknown serving engine {mode!r} (--serving, PLAYGROUND_SERVING): one of "
                          f"{', '.join(SERVING_MODES)}.")
    if mode == "reference":
        return LaneSettings(kv_mode="paged")
    quant = fastest_quant(loaded.device)
    compiled = loaded.device.type == "cpu" and compile_unavailable(loaded.device) is None
    return LaneSettings(kv_mode="paged", weights=quant.scheme, quant_activations=quant.activations,
                        compile=compiled)


def precompile_arguments(loaded, settings: LaneSettings, max_seq_len: int) -> list[str]:
    """`python -m inference_core`'s arguments that build `settings`' steps for an engine of the pool's on `loaded`."""
    return ["precompile", "--model", loaded.name, "--device", str(loaded.device), "--dtype", loaded.dtype_name,
            "--max-seq-len", str(max_seq_len), *command_flags(settings, always=("kv_mode", "compile"))]


# The child's first lines, before the command line runs: on Linux, a SIGTERM when the app's process ends
# (PR_SET_PDEATHSIG, set in the child itself rather than between fork and exec, where other threads' locks could
# deadlock it), so a stopped or killed app leaves no compile running; then a lower priority than the app's.
CHILD = """import ctypes, os, signal, sys
if sys.platform.startswith("linux"):
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)
    if os.getppid() != int(sys.argv[1]):
        sys.exit("the app ended before its build started")
os.nice(%d)
from inference_core.cli import main
sys.exit(main(sys.argv[2:]))
""" % BUILD_NICENESS


def child_command(arguments: list[str]) -> list[str]:
    """`python -m inference_core ARGUMENTS` as the app's child (`CHILD`)."""
    return [sys.executable, "-c", CHILD, str(os.getpid()), *arguments]


class ServingBuild:
    """`command` (a `precompile` run: `child_command`) in a child process; `on_built` is called in a thread of this
    one once it has exited with success, and the build is `ready` when that returns. `state`: building, ready or
    failed (`reason` then says why, from the child's last lines)."""

    def __init__(self, command: list[str], on_built: Callable[[], None]):
        self.command = command
        self.on_built = on_built
        self.state, self.reason = "building", ""
        self.started = time.monotonic()
        self.finished: float | None = None
        self.output: collections.deque[str] = collections.deque(maxlen=20)
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        self._thread = threading.Thread(target=self._watch, name="serving-build", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        for line in self.process.stdout:
            self.output.append(line.rstrip())
        code = self.process.wait()
        try:
            if code != 0:
                raise RuntimeError(f"precompile exited with status {code}: " + " / ".join(list(self.output)[-3:]))
            self.on_built()
            self.state = "ready"
        except Exception as error:  # the app serves on, eager; the note says why
            self.state, self.reason = "failed", str(error)
        self.finished = time.monotonic()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the build has ended (ready or failed) within `timeout` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """End the child process (the app is stopping)."""
        if self.process.poll() is None:
            self.process.terminate()

    def note(self) -> str:
        """The build's state in a sentence, for the page."""
        if self.state == "building":
            minutes = (time.monotonic() - self.started) / 60
            return (f"the default settings' compiled steps are being built in the background ({minutes:.0f} min so "
                    "far; about 5 min in all on an idle 2-core CPU, then kept on disk), and until then they run eager")
        if self.state == "failed":
            return f"building the default settings' compiled steps failed ({self.reason}), so they run eager"
        return ""
