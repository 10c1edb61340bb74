"""Our ops' C++ compiles under every instruction set's flags (`row_kernel.FLAGS`), not only the one of the CPU the
suite runs on: the int8-activation op's 256-bit FMA code once broke the AVX-512 build while every test passed on an
AVX2 host, and each AVX-512 host then ran without any of our kernels. The host's own set is built by the other tests;
this compiles the others to an object file (-O0: the same target checks, in a fraction of the time)."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sysconfig

import pytest
import torch
from torch.utils import cpp_extension

from inference_core.model import row_kernel

OTHER_SETS = [name for name in row_kernel.FLAGS if name != torch.backends.cpu.get_cpu_capability()]


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the flags are x86's")
@pytest.mark.parametrize("instruction_set", OTHER_SETS)
def test_the_source_compiles_with_each_instruction_sets_flags(instruction_set, tmp_path):
    source = tmp_path / "main.cpp"
    source.write_text("#include <torch/extension.h>\n" + row_kernel.full_source())
    flags = [flag for flag in row_kernel.FLAGS[instruction_set] if not flag.startswith("-O")]
    includes = [f"-I{path}" for path in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]]
    build = subprocess.run(["c++", "-std=c++20", "-O0", "-fPIC", "-c", str(source), "-o", str(tmp_path / "main.o"),
                            *flags, *includes], capture_output=True, text=True)
    errors = [line for line in build.stderr.splitlines() if "error" in line]
    assert build.returncode == 0, f"{instruction_set}: " + "\n".join(errors[:5])
