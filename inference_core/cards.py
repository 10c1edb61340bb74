"""GPUs by name, as their makers' datasheets give them: memory and memory bandwidth. The roofline measures a device's
ceilings itself (`roofline.measure_ceilings`) and shows the datasheet's bandwidth beside them where the card is known;
the ZeroGPU path (`serving.zero_gpu`) sizes a Space's GPU calls from the memory of cards it cannot see yet (a ZeroGPU
Space's main process has no GPU until a call is scheduled).

ZeroGPU's cards are NVIDIA RTX PRO 6000 Blackwell Server Edition, lent whole (`size="xlarge"`) or as half a card
(`size="large"`, the default); the half's figures are half the card's (one of two MIG instances), not a datasheet's.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 10 ** 9


@dataclass(frozen=True)
class Card:
    name: str  # as `torch.cuda.get_device_name` reports it
    memory_bytes: int
    bandwidth_bytes_per_s: float


CARDS = (
    Card("NVIDIA H100 80GB HBM3", 80 * GB, 3.35e12),
    Card("NVIDIA H100 PCIe", 80 * GB, 2.0e12),
    Card("NVIDIA H200", 141 * GB, 4.8e12),
    Card("NVIDIA H200 MIG 3g.71gb", 71 * GB, 2.4e12),  # ZeroGPU's earlier slice: 4 of the H200's 8 memory slices
    Card("NVIDIA RTX PRO 6000 Blackwell Server Edition", 96 * GB, 1.792e12),
)
RTX_PRO_6000 = CARDS[-1]
# ZeroGPU's sizes (`spaces.GPU(size=...)`): a whole RTX PRO 6000, or half of one.
ZERO_GPU_SIZES = {
    "large": Card(f"half an {RTX_PRO_6000.name}", RTX_PRO_6000.memory_bytes // 2,
                  RTX_PRO_6000.bandwidth_bytes_per_s / 2),
    "xlarge": RTX_PRO_6000,
}


def card(device_name: str) -> Card | None:
    """The known card `device_name` names (the longest known name it starts with: a MIG slice's name extends its
    card's), or None."""
    known = [entry for entry in CARDS if device_name.startswith(entry.name)]
    return max(known, key=lambda entry: len(entry.name), default=None)
