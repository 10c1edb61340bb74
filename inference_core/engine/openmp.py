"""The engine loop's thread alone keeps OpenMP workers: the other threads free theirs when they hand it work.

PyTorch's CPU ops run their parallel parts in an OpenMP team of the calling thread. GNU OpenMP (libgomp, which the
PyPI builds of torch ship) keeps one team of worker threads per thread that ever ran a parallel part, and once more
worker threads exist than the machine has CPUs it stops letting its workers spin between parallel parts: each wakes
from sleep for every part. The app loads its model in the main thread and then runs every step in the engine loop's
thread, so two teams existed, and on a 2-core host the loop's steps ran at about 0.6x the same steps in the main
thread (bundled model, bf16, compiled decode: 50 against 87 tokens/s; one bf16 projection 153 against 86 us).
Freeing the idle team of a thread that is about to wait for the loop (`release_idle_workers`, libgomp's
`omp_pause_resource_all`, which frees the calling thread's pool) leaves the loop's team the only one.

Where torch runs on another OpenMP runtime (Intel's, LLVM's) or a libgomp without the call, nothing is done.
"""

from __future__ import annotations

import ctypes
import functools

OMP_PAUSE_SOFT = 1  # OpenMP 5.0: free the threads, keep the settings


@functools.cache
def _pause():
    """libgomp's `omp_pause_resource_all` as loaded into this process by torch, or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and line.rstrip().endswith(".so.1")}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            function = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
        return function
    return None


def release_idle_workers() -> bool:
    """Free the calling thread's idle OpenMP worker threads (it runs no parallel part meanwhile; its next one makes a
    new team). Returns whether the runtime could."""
    pause = _pause()
    if pause is None:
        return False
    return pause(OMP_PAUSE_SOFT) == 0
