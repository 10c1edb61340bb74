"""The weights of a compiled CPU decode step (an AOTInductor package) in memory of our own, in huge pages where the
host gives them.

By default a package holds its constants (the frozen weights, packed for our projection kernel) inside its shared
library: the loader extracts the library to a temporary directory and maps that file, so a decode step streams its
weights from 4 KiB pages of the page cache, about 66,000 pages a step for the bundled model in bf16 (269 MB), each a
page-table walk. Where every projection runs through our kernels (`can_keep_beside`), our packages are written with
their constants beside the library instead (`PACKAGE_OPTIONS`), and `load` copies them into one private anonymous
mapping advised as transparent huge pages (2 MiB each, where Linux's THP setting is "always" or "madvise"), then hands
the loaded package their addresses (`load_constants`, user-managed: the package keeps no copy of its own). The caller
keeps the returned buffer alive with the package.

Measured on the 2-core AVX2 Zen 3 host (bundled model, bf16, compiled, 8 steps a round trip, 30 alternating pairs of
48-token runs in one process, docs/benchmarks.md): 1.048x the decode rate of the same step reading its weights from
the library's mapping, faster in 22 of the 30 pairs.
"""

from __future__ import annotations

import io
import json
import mmap
import zipfile

import torch

# The inductor options that write a package's constants as files beside its library (one pickled tensor each, and a
# JSON map from each constant's name to its file, shape, strides and offset), for `load` to place. For graphs that
# `can_keep_beside` says take them.
PACKAGE_OPTIONS = {"aot_inductor.package_constants_in_so": False,
                   "aot_inductor.package_constants_on_disk_format": "pickle_weights"}

# ATen's matmuls. Where one is left in the graph inductor may run it through its C++ GEMM template, which packs the
# weight into constants of its own; AOTInductor (torch 2.13) gives several of those one name, and the files beside the
# library then hold only one of them (found with the tests' fp32 tiny model). Such a graph keeps its constants inside.
_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_weight_int8pack_mm", "_weight_int4pack_mm",
            "_weight_int4pack_mm_for_cpu"}

HUGE_PAGE = 2 << 20
ALIGN = 64  # each constant starts on a cache line
_CONFIG = "aotinductor/model/weights_config.json"  # the map's path in the package, after the package's folder
_WEIGHTS = "weights/"  # the constants' folder, beside aotinductor/


def _aligned(nbytes: int) -> int:
    """`nbytes` rounded up to whole cache lines (`ALIGN`)."""
    return -(-nbytes // ALIGN) * ALIGN


def can_keep_beside(exported: torch.export.ExportedProgram) -> bool:
    """Whether the package of `exported` can keep its constants beside its library: no ATen matmul left in its graph
    (its projections run through our kernels, `model.row_kernel`)."""
    return not any(node.op == "call_function" and getattr(node.target, "namespace", None) == "aten"
                   and node.target.__name__.split(".")[0] in _MATMULS for node in exported.graph.nodes)


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeroed memory as a uint8 tensor, starting on a 2 MiB boundary of a private anonymous mapping
    advised as huge pages (Linux: `madvise(MADV_HUGEPAGE)`; where the host offers none, plain pages). The tensor keeps
    the mapping alive."""
    if not hasattr(mmap, "MAP_PRIVATE"):  # not a POSIX host: plain memory
        return torch.zeros(nbytes, dtype=torch.uint8)
    # Private: a shared anonymous mapping is shared memory, whose huge pages follow another setting (usually off).
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP "never", or a kernel without it
            pass
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def load(program, path) -> torch.Tensor | None:
    """Place the constants of the package at `path` (written with `PACKAGE_OPTIONS`) in a `huge_page_buffer` and give
    them to `program`, the package as `torch._inductor.aoti_load_package` loaded it, which must not run before. Returns
    the buffer's part that holds them (keep it as long as `program`), or None for a package that holds its constants
    in its library."""
    with zipfile.ZipFile(path) as package:
        config_name = next((name for name in package.namelist() if name.endswith(_CONFIG)), None)
        if config_name is None:
            return None
        config = json.loads(package.read(config_name))
        folder = config_name[:-len(_CONFIG)] + _WEIGHTS
        files = sorted({entry[0] for entry in config.values()})
        # Each file is a pickled tensor, a little larger than its data: their sizes bound the buffer's.
        buffer = huge_page_buffer(sum(_aligned(package.getinfo(folder + file).file_size) for file in files))
        placed, used = {}, 0
        for file in files:  # one file in memory at a time besides the buffer
            tensor = torch.load(io.BytesIO(package.read(folder + file)), weights_only=True)
            storage = tensor.untyped_storage()
            size = storage.nbytes()
            buffer[used:used + size].copy_(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,)))
            placed[file] = buffer[used:used + size].view(tensor.dtype)
            used += _aligned(size)
    names = program.get_constant_fqns()  # one per constant the step reads
    if len(names) != len(set(names)) or set(names) != set(config):
        raise RuntimeError(f"the compiled package {path} does not hold one file for each of its constants; delete it "
                           "to compile the step again")
    constants = {}
    for name, (file, shape, stride, offset) in config.items():
        base = placed[file]  # as_strided's offset counts from the start of the whole buffer's storage
        constants[name] = base.as_strided(shape, stride, base.storage_offset() + offset)
    program.loader.load_constants(constants, False, True, True)  # active buffer, every constant, user-managed
    return buffer[:used]
