"""The compiled step's weights in a buffer of our own (`engine.package_weights`): the buffer's placement and advice,
and the placing of a package's constants, on packages written here as AOTInductor writes them. A compiled step that
runs on them is checked on the bundled model (tests/engine/test_compiled.py)."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pytest
import torch

from inference_core.engine.package_weights import HUGE_PAGE, huge_page_buffer, load


def test_huge_page_buffer_is_aligned_zeroed_and_writable():
    buffer = huge_page_buffer(3 * HUGE_PAGE + 100)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 3 * HUGE_PAGE + 100
    assert buffer.data_ptr() % HUGE_PAGE == 0
    assert int(buffer.sum()) == 0
    buffer[-100:] = 7
    assert int(buffer.sum()) == 700


def test_huge_page_buffer_is_advised_as_huge_pages_where_linux_offers_them():
    """The mapping carries the MADV_HUGEPAGE advice (`hg` in its VmFlags) where THP is not off. Whether the kernel
    then backs it with huge pages depends on the host's free memory, so that is not asserted."""
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not setting.exists() or "[never]" in setting.read_text() or not Path("/proc/self/smaps").exists():
        pytest.skip("no transparent huge pages here")
    buffer = huge_page_buffer(2 * HUGE_PAGE)
    address, flags, inside = buffer.data_ptr(), None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "VmFlags:":
            flags = fields[1:]
            break
    assert flags is not None and "hg" in flags


class FakePackage:
    """What `load` uses of a loaded AOTInductor package: its constants' names, and where it is given them."""

    def __init__(self, names):
        self.names = names
        self.loader = self
        self.given = None

    def get_constant_fqns(self):
        return self.names

    def load_constants(self, constants, use_inactive, check_full_update, user_managed):
        self.given = (constants, use_inactive, check_full_update, user_managed)


def write_package(path, tensors: dict[str, tuple[torch.Tensor, list, list, int]]) -> None:
    """A package's constants as AOTInductor writes them beside its library: one pickled tensor a file, and the map."""
    config = {}
    with zipfile.ZipFile(path, "w") as package:
        for index, (name, (tensor, shape, stride, offset)) in enumerate(tensors.items()):
            data = io.BytesIO()
            torch.save(tensor, data)
            package.writestr(f"decode/data/weights/weight_{index}", data.getvalue())
            config[name] = [f"weight_{index}", shape, stride, offset]
        package.writestr("decode/data/aotinductor/model/weights_config.json", json.dumps(config))


def test_load_places_each_constant_in_the_buffer_with_its_view(tmp_path):
    packed = torch.randn(3, 5, 48).to(torch.bfloat16)
    scales = torch.randn(10)
    table = torch.arange(12, dtype=torch.int64)
    tensors = {"_frozen_param0": (packed, [3, 5, 48], [240, 48, 1], 0),
               "scales": (scales, [4], [2], 3),  # a strided view at an offset into its file's tensor
               "table": (table, [3, 4], [4, 1], 0)}
    write_package(tmp_path / "p.pt2", tensors)
    program = FakePackage(list(tensors))
    buffer = load(program, tmp_path / "p.pt2")
    constants, use_inactive, check_full_update, user_managed = program.given
    assert (use_inactive, check_full_update, user_managed) == (False, True, True)
    assert torch.equal(constants["_frozen_param0"], packed)
    assert torch.equal(constants["scales"], scales[3::2][:4])
    assert torch.equal(constants["table"], table.view(3, 4))
    assert buffer.data_ptr() % HUGE_PAGE == 0 and buffer.numel() % 64 == 0
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    for constant in constants.values():  # in the buffer, each on a cache line of its own
        assert start <= constant.data_ptr() < end and (constant.data_ptr() - constant.storage_offset() *
                                                       constant.element_size()) % 64 == 0


def test_load_refuses_constants_the_files_do_not_hold(tmp_path):
    write_package(tmp_path / "p.pt2", {"a": (torch.ones(4), [4], [1], 0)})
    with pytest.raises(RuntimeError, match="one file for each of its constants"):
        load(FakePackage(["a", "a"]), tmp_path / "p.pt2")  # two constants of one name: one file for both
    with pytest.raises(RuntimeError, match="one file for each of its constants"):
        load(FakePackage(["a", "b"]), tmp_path / "p.pt2")


def test_a_package_with_its_constants_in_its_library_is_left_as_it_is(tmp_path):
    with zipfile.ZipFile(tmp_path / "p.pt2", "w") as package:
        package.writestr("decode/data/aotinductor/model/model.wrapper.so", b"")
    program = FakePackage(["a"])
    assert load(program, tmp_path / "p.pt2") is None and program.given is None
