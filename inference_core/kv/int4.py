"""The int4 KV cache (`kv_dtype="int4"`): KIVI-style 4-bit keys and values in blocks, the newest tokens kept in the
model dtype until their block fills.

KIVI (Liu et al., 2024) observed that keys have a few channels of large magnitude across tokens while values do not,
so it quantizes keys per channel and values per token. Here, for each block of `block_size` tokens and each KV head:
- keys: per channel, over the block's tokens: asymmetric 4 bits, q = round((x - min) / scale) in 0..15, with the
  channel's scale (max - min) / 15 and its minimum stored beside the block in fp16;
- values: per token, in groups of 32 channels (`config.int4_value_group`): the same asymmetric 4 bits with each
  group's scale and minimum in fp16.
Two 4-bit codes share a byte (channel j in the low nibble, j + head_dim / 2 in the high one). For SmolLM2 (head_dim
64, 16-token blocks) a token of one head and layer takes 48 bytes of keys (32 of codes, 16 of its block's channel
ranges) and 40 of values (32 of codes, 8 of group ranges): 88 bytes against 256 in bf16 and 512 in fp32.

A block's keys can only be quantized once the block is whole (its channel ranges span its tokens), so a block's
tokens live first in the *tail*: a small pool of full-precision blocks that every write goes to. A block stays there
while it is being written; at the start of the next forward (`sweep`) each tail block whose block is full (every one
of its tokens committed: a speculative rollback has already happened by then) is quantized into the int4 pool and its
tail block reused, and each whose block went back to the pool empty is dropped. A running sequence therefore holds
at most its last, partial block in full precision between steps; its earlier blocks are int4, read back
(dequantized) to the model dtype whenever attention gathers them. The tail grows (doubling) when a step writes into
more blocks than it has.

`Int4Blocks` owns the tensors and the map from a block to its tail block; the paged cache hands it physical block
ids, the contiguous cache the fixed blocks of its slots (slot * blocks_per_slot + position // block_size). Whether a
block is full, partly written or free comes from the cache through `sweep`'s `state` callback.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from inference_core.config import ModelConfig, int4_value_group

LEVELS = 15  # the largest 4-bit code
FULL, PARTIAL, FREE = "full", "partial", "free"  # what `sweep`'s state callback says of a block


def _codes(x: torch.Tensor, low: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x in fp32 -> its 4-bit codes [..., d] (uint8, one a byte)."""
    return torch.round((x - low) / scale).clamp_(0, LEVELS).to(torch.uint8)


def _pack(q: torch.Tensor) -> torch.Tensor:
    """Codes [..., d] -> [..., d / 2] bytes: channel j in the low nibble, channel j + d / 2 in the high one (so that
    unpacking is two halves side by side, not an interleave: 28 against 44 us for 20 blocks of the bundled model)."""
    half = q.shape[-1] // 2
    return q[..., :half] | (q[..., half:] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., d / 2] bytes -> [..., d] fp32 codes (a lookup table through `embedding` measured three times as slow on
    a CPU; uint8 codes handed to the multiply-add, which casts them as it reads, slower still)."""
    return torch.cat((packed & 15, packed >> 4), -1).float()


def _range(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(minimum, scale) over `dim`, both rounded to fp16 (what is stored) and back to fp32."""
    low, high = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = ((high - low) / LEVELS).clamp(min=1e-6).half().float()
    return low.half().float(), scale


def quantize_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole blocks of keys [n, block_size, heads, d] -> (codes [n, block_size, heads, d / 2] uint8, ranges
    [n, 2, heads, d] fp16: each channel's minimum and scale over the block's tokens)."""
    x = k.float()
    low, scale = _range(x, 1)  # [n, 1, heads, d]
    return _pack(_codes(x, low, scale)), torch.cat((low, scale), 1).half()


def dequantize_keys(codes: torch.Tensor, ranges: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _dequantize_keys(_unpack(codes), ranges, dtype)


def _dequantize_keys(codes: torch.Tensor, ranges: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Unpacked codes [n, block_size, heads, d] and their ranges [n, 2, heads, d] -> keys in `dtype`."""
    ranges = ranges.float()  # a no-op where the caller has cast them
    return torch.addcmul(ranges[:, 0:1], codes, ranges[:, 1:2]).to(dtype)


def quantize_values(v: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Values [n, block_size, heads, d] -> (codes [..., d / 2] uint8, ranges [n, block_size, heads, d / group, 2]
    fp16: each token's minimum and scale per group of `group` channels)."""
    x = v.float().unflatten(-1, (-1, group))  # [n, block_size, heads, groups, group]
    low, scale = _range(x, -1)  # [n, block_size, heads, groups, 1]
    return _pack(_codes(x, low, scale).flatten(-2)), torch.cat((low, scale), -1).half()


def dequantize_values(codes: torch.Tensor, ranges: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _dequantize_values(_unpack(codes), ranges, dtype)


def _dequantize_values(codes: torch.Tensor, ranges: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Unpacked codes [n, block_size, heads, d] and their ranges [n, block_size, heads, groups, 2] -> values. Each
    group a row of a 3-d view, its range a row beside it: 34 against 45 us for 20 blocks than broadcasting 5-d."""
    n, group = codes.shape[0], codes.shape[-1] // ranges.shape[-2]
    ranges = ranges.float().reshape(n, -1, 2)
    x = codes.reshape(n, -1, group)  # a view where the blocks' rows are contiguous
    return torch.addcmul(ranges[..., 0:1], x, ranges[..., 1:2]).view(codes.shape).to(dtype)


class Int4Blocks:
    """`num_blocks` blocks of int4 keys and values per layer, and the full-precision tail blocks they are written
    through. Reads (`read`) return whole blocks in the model dtype, each block still in the tail read from there."""

    INITIAL_TAIL = 8

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        layers, heads, d = config.num_layers, config.num_kv_heads, config.head_dim
        if d % 2:
            raise ValueError(f"an int4 KV cache packs two channels to a byte; head_dim {d} is odd.")
        self.block_size, self.dtype, self.device, self.group = block_size, dtype, device, int4_value_group(d)
        # Zeroed: padding reads and never-written blocks dequantize to finite zeros.
        # codes[layer, block, 0] keys, [.., 1] values: a read gathers and unpacks both in one op each
        self.codes = torch.zeros(layers, num_blocks, 2, block_size, heads, d // 2, dtype=torch.uint8, device=device)
        # Each block's ranges, keys' [2, heads, d] then values' [block_size, heads, groups, 2], flat in one row: a
        # read gathers both in one op
        self.key_ranges = 2 * heads * d
        self.ranges = torch.zeros(layers, num_blocks, self.key_ranges + block_size * heads * (d // self.group) * 2,
                                  dtype=torch.float16, device=device)
        self.tail_k = torch.zeros(layers, self.INITIAL_TAIL, block_size, heads, d, dtype=dtype, device=device)
        self.tail_v = torch.zeros_like(self.tail_k)
        self.tail_of: dict[int, int] = {}  # block id -> its tail block, while the block is written in full precision
        self.free_tail = list(range(self.INITIAL_TAIL))
        # A read in one op (`model.kv_kernel.read`), where the engine found it built; else torch ops
        self.fused: Callable | None = None
        # Where a list of blocks finds its tail blocks, worked out once a forward (every layer reads the same lists)
        self._lookups: dict[tuple, tuple[torch.Tensor, torch.Tensor] | None] = {}

    def sweep(self, state: Callable[[int], str]) -> None:
        """Before a forward: each tail block whose block is now `FULL` is quantized into the int4 pool, each whose
        block is `FREE` is dropped; `PARTIAL` blocks stay in full precision."""
        full = []
        for block, tail in list(self.tail_of.items()):
            kind = state(block)
            if kind == PARTIAL:
                continue
            if kind == FULL:
                full.append((block, tail))
            del self.tail_of[block]
            self.free_tail.append(tail)
        if full:
            blocks = torch.tensor([block for block, _ in full], dtype=torch.long, device=self.device)
            tails = torch.tensor([tail for _, tail in full], dtype=torch.long, device=self.device)
            for layer in range(self.codes.shape[0]):
                k_codes, k_ranges = quantize_keys(self.tail_k[layer].index_select(0, tails))
                v_codes, v_ranges = quantize_values(self.tail_v[layer].index_select(0, tails), self.group)
                self.codes[layer].index_copy_(0, blocks, torch.stack((k_codes, v_codes), 1))
                self.ranges[layer].index_copy_(0, blocks, torch.cat((k_ranges.flatten(1), v_ranges.flatten(1)), 1))

    def tail_block(self, block: int) -> int:
        """The tail block `block` is written through, taken (the tail grown when none is free) on its first write."""
        tail = self.tail_of.get(block)
        if tail is None:
            if not self.free_tail:
                self._grow_tail()
            tail = self.tail_of[block] = self.free_tail.pop()
        return tail

    def _grow_tail(self) -> None:
        size = self.tail_k.shape[1]
        self.tail_k = torch.cat((self.tail_k, torch.zeros_like(self.tail_k)), 1)
        self.tail_v = torch.cat((self.tail_v, torch.zeros_like(self.tail_v)), 1)
        self.free_tail.extend(range(2 * size - 1, size - 1, -1))

    def write_slots(self, blocks_and_offsets) -> torch.Tensor:
        """(block, offset) of each new token -> their flat slots in the tail [tail blocks * block_size]; a forward's
        first call, after `sweep`."""
        self._lookups.clear()
        size = self.block_size
        return torch.tensor([self.tail_block(block) * size + offset for block, offset in blocks_and_offsets],
                            dtype=torch.long, device=self.device)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v [tokens, heads, d] into the tail at `slots` (from `write_slots`)."""
        self.tail_k[layer].flatten(0, 1).index_copy_(0, slots, k.to(self.dtype))
        self.tail_v[layer].flatten(0, 1).index_copy_(0, slots, v.to(self.dtype))

    def write_layers(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Every layer's k, v [layers, tokens, heads, d] into the tail at `slots` (from `write_slots`): a compiled
        step's new KV, which its graph returns."""
        layers = self.tail_k.shape[0]
        self.tail_k.view(layers, -1, *self.tail_k.shape[3:]).index_copy_(1, slots, k.to(self.dtype))
        self.tail_v.view(layers, -1, *self.tail_v.shape[3:]).index_copy_(1, slots, v.to(self.dtype))

    def read_plan(self, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a compiled step reads through `model.kv_kernel`'s op, a layer at a time: for block tables [rows,
        width] (int32), (the tables renumbered to index the blocks read, int32; the blocks read, each once, int64 [n];
        each one's tail block or -1, int64 [n]). n is at least 2 (a dynamic size of the step's package)."""
        blocks, renumbered = torch.unique(table, return_inverse=True)
        listed = blocks.tolist()
        if len(listed) < 2:
            listed.append(listed[0])
        as_tensor = functools.partial(torch.tensor, dtype=torch.long, device=self.device)
        return (renumbered.to(torch.int32), as_tensor(listed),
                as_tensor([self.tail_of.get(block, -1) for block in listed]))

    def read(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks [n] (int32 or int64) -> their keys and values [n, block_size, heads, d] in the model dtype."""
        if self.fused is not None:
            indices, tails = self._lookup(blocks)
            return self.fused(self.codes[layer], self.ranges[layer], indices, tails, self.tail_k[layer],
                              self.tail_v[layer], self.group)
        codes = _unpack(self.codes[layer].index_select(0, blocks))  # [n, 2, block_size, heads, d] fp32
        ranges = self.ranges[layer].index_select(0, blocks).float()
        n, heads, d = blocks.shape[0], codes.shape[-2], codes.shape[-1]
        k = _dequantize_keys(codes[:, 0], ranges[:, :self.key_ranges].view(n, 2, heads, d), self.dtype)
        v = _dequantize_values(codes[:, 1], ranges[:, self.key_ranges:].view(n, -1, heads, d // self.group, 2),
                               self.dtype)
        overlay = self._lookup(blocks) if self.tail_of else None
        if overlay is not None:
            rows, tails = overlay
            k.index_copy_(0, rows, self.tail_k[layer].index_select(0, tails))
            v.index_copy_(0, rows, self.tail_v[layer].index_select(0, tails))
        return k, v

    def _lookup(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where `blocks` find their tail blocks, for the read at hand: for the op, (the blocks as int64, each one's
        tail block or -1); for the torch ops, (the rows still in the tail, their tail blocks), or None where no row
        is. Worked out once a forward per list of blocks, forgotten when the next forward's writes are placed."""
        key = (self.fused is not None, tuple(blocks.tolist()))
        if key not in self._lookups:
            fused, listed = key
            as_tensor = functools.partial(torch.tensor, dtype=torch.long, device=self.device)
            if fused:
                self._lookups[key] = as_tensor(listed), as_tensor([self.tail_of.get(block, -1) for block in listed])
            else:
                rows = [i for i, block in enumerate(listed) if block in self.tail_of]
                self._lookups[key] = (as_tensor(rows), as_tensor([self.tail_of[listed[i]] for i in rows])) \
                    if rows else None
        return self._lookups[key]

    def copy_token(self, source: tuple[int, int], target: tuple[int, int]) -> None:
        """Every layer's K and V of the token at (block, offset) `source` written to `target` (both still in the
        tail: tokens past what their sequence has committed)."""
        for tail in (self.tail_k, self.tail_v):
            tail[:, self.tail_block(target[0]), target[1]] = tail[:, self.tail_of[source[0]], source[1]]

    def pool_tensors(self) -> list[torch.Tensor]:
        """The int4 pool's tensors: codes, then the ranges beside them."""
        return [self.codes, self.ranges]

    def tail_bytes(self) -> int:
        """Bytes of the full-precision tail as allocated now (it grows when a step writes into more blocks)."""
        return sum(tail.numel() * tail.element_size() for tail in (self.tail_k, self.tail_v))

    def storage(self, block: int) -> str:
        """How `block` is held now: "int4", or "tail" (full precision, being written)."""
        return "tail" if block in self.tail_of else "int4"
