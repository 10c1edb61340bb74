"""Paged attention through FlexAttention: attention reads the paged KV pool in place, through each sequence's block
table, with no gathered copy (the reference path, `PagedKVCache.load` / `load_decodes`, gathers a contiguous one).

One layer's pool, [pages, page_size, kv_heads, head_dim], is seen as a single long key sequence [1, kv_heads,
pages * page_size, head_dim] (a view). Each attention call (the step's single-token decodes together, then each
prefill chunk or verification alone) gets a `BlockMask` built here from the block tables, once per forward and shared
by every layer:

- kv_indices lists, per query block, the pool's sparse key blocks (`PoolLayout.group_pages` pages each) that hold a
  key some query of the block sees, so the kernel visits only those; a block whose every key every query of the query
  block sees is listed as full (no mask_mod call for it);
- mask_mod maps a pool slot back to the sequence's own position through a page-to-logical table [batch, pages]
  (-1: not this sequence's page) and applies causality and the sliding window, or for tree verification the tree's
  mask over the new tokens.
GQA runs through `enable_gqa`: the KV heads are never repeated.

Shapes are static and padded to buckets (decodes: a batch of 1, 2, 4, 8, ... rows; chunks: 64, 128, 256, ... queries),
so the compiled kernel is reused across steps: with dynamic shapes, inductor's C++ template for the CPU generated code
that did not compile for this mask_mod (torch 2.13: "'cur_qSplitSize3' was not declared"). Each bucket, dtype, model
shape and pool size is a graph of its own, about 5 s to compile on a 2-core CPU. The kernel is made once per process
(`kernel()`, on first use: `torch.compile` imports torch._dynamo, about 5 s, which a gather-only process never pays).

Measured slower than the gather path in the eager engine, on a 2-core CPU (fp32 1.04-1.10x the step time, bf16
1.27-1.33x) and on an H100 at Qwen3-0.6B's shape (bf16, 1.31-1.46x, also at 2048-token contexts): each compiled call
adds about 45 us of guards and wrappers, 30 times a step, to an attention that costs the same (docs/benchmarks.md,
"Paged attention: gather or FlexAttention"). So gather is the default and flex a switch to race.

Two details come from inductor's CPU kernel for one-token queries, which handles rows whose block counts differ by
scanning the whole pool for each row (measured: batch 8 at 300-token contexts, 1.04 ms against 0.55 ms with equal
counts): for single-token calls on the CPU every row lists the same number of full and of partial blocks, extra full
blocks listed as partial and the partial lists padded with a null block that no sequence owns (the pool holds one
spare group of pages for it), and padding rows repeat the first row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

RECOMPILE_LIMIT = 256  # graphs one process may hold (buckets x models x pools); dynamo's default stops at 8
NO_WINDOW = 1 << 40  # the window of full attention, as a number the mask can compare with
MIN_CHUNK_BUCKET = 64  # the smallest padded query length of a prefill chunk or verification

_kernel = None


def kernel():
    """`flex_attention` compiled once per process (made on first use)."""
    global _kernel
    if _kernel is None:
        # (torch._dynamo is read as an attribute: torch loads it on first use.)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        _kernel = torch.compile(flex_attention, dynamic=False)
    return _kernel


@dataclass(frozen=True)
class PoolLayout:
    """How one paged pool is seen by FlexAttention: `group_pages` pages make a sparse key block (the kernel's tile
    must span 16 keys on CUDA, so 4- and 8-token pages are grouped there), and the last group is the null block."""

    num_pages: int  # pages the manager hands out
    page_size: int
    group_pages: int
    query_block: int  # queries per sparse query block
    uniform: bool  # single-token calls list the same block counts in every row (the CPU kernel)

    @classmethod
    def for_pool(cls, num_pages: int, page_size: int, device: torch.device) -> "PoolLayout":
        if device.type == "cuda":  # Triton's tiles: 16 keys at least, query blocks of 128
            return cls(num_pages, page_size, -(-16 // page_size), 128, False)
        return cls(num_pages, page_size, 1, MIN_CHUNK_BUCKET, True)

    @property
    def num_groups(self) -> int:
        """Sparse key blocks in the pool, the null one (the last) included."""
        return -(-self.num_pages // self.group_pages) + 1

    @property
    def total_pages(self) -> int:
        """Pages the pool must hold: the manager's, then spares up to whole groups and the null group."""
        return self.num_groups * self.group_pages

    @property
    def null_group(self) -> int:
        return self.num_groups - 1

    def kernel_options(self, num_queries: int) -> dict | None:
        """Triton's tiles must divide the sparse blocks: key tiles of one sparse key block, and for several queries
        the main kernel (torch picks its decoding kernel below 128 queries, whose query tile can outgrow the
        sparse query block) with 64-query tiles. The CPU's kernel takes the blocks as they are."""
        if not self.uniform and num_queries > 1:
            return {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 64, "BLOCK_N": self.page_size * self.group_pages}
        return None


@dataclass
class FlexCall:
    """One FlexAttention call: `rows` sequences (padded to `padded_rows`), `queries` each (padded to
    `padded_queries`), and the block mask over the pool."""

    block_mask: BlockMask
    kernel_options: dict | None
    rows: int
    padded_rows: int
    queries: int
    padded_queries: int


@dataclass
class FlexBatch:
    """A forward's FlexAttention calls: the single-token decodes (the batch's first `num_decodes` sequences) in one
    call, then one call per later sequence, in the batch's order."""

    decodes: FlexCall | None
    chunks: list[FlexCall]


def row_bucket(rows: int) -> int:
    return 1 << (rows - 1).bit_length()


def query_bucket(queries: int) -> int:
    return max(MIN_CHUNK_BUCKET, 1 << (queries - 1).bit_length())


def attend(call: FlexCall, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float) -> torch.Tensor:
    """q [rows, heads, queries, head_dim] over the pool k, v [1, kv_heads, slots, head_dim] -> [rows, heads,
    queries, head_dim] (q padded to the call's bucket on the way in, the padding dropped on the way out)."""
    padded = F.pad(q, (0, 0, 0, call.padded_queries - call.queries, 0, 0, 0, call.padded_rows - call.rows))
    out = kernel()(padded, k_pool, v_pool, block_mask=call.block_mask, scale=scale,
                   enable_gqa=q.shape[1] != k_pool.shape[1], kernel_options=call.kernel_options)
    return out[:call.rows, :, :call.queries]


def build_call(layout: PoolLayout, tables: list[list[int]], firsts: list[int], num_queries: int,
               window: int | None, device: torch.device, tree: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> FlexCall:
    """The call for sequences with block tables `tables` (-1: a page released from the window), each forwarding
    `num_queries` tokens at positions firsts[i] .. firsts[i] + num_queries - 1 against its context before them.
    `tree` (one sequence): (the queries' positions [queries], the mask of queries over the new tokens [queries,
    queries] bool) for tree verification; keys before firsts[0] are seen as the window allows."""
    rows = len(tables)
    padded_rows = row_bucket(rows) if num_queries == 1 else rows
    padded_queries = 1 if num_queries == 1 else query_bucket(num_queries)
    # Padding rows repeat the first row: finite outputs (dropped), and the same block counts.
    tables = tables + [tables[0]] * (padded_rows - rows)
    firsts = firsts + [firsts[0]] * (padded_rows - rows)
    size = layout.page_size
    spans = [-(-(first + num_queries) // size) for first in firsts]  # pages each row's context spans
    width = max(spans)
    # pages: [rows, width] the physical page of each logical page (-1: past the context, or released from the window)
    pages = torch.tensor([table[:span] + [-1] * (width - span) for table, span in zip(tables, spans)],
                         dtype=torch.long)
    window_size = window or NO_WINDOW
    any_seen, all_seen = _visible_pages(layout, pages, torch.tensor(firsts), num_queries, padded_queries,
                                        window_size, tree is not None)
    num_partial, partial, num_full, full = _block_lists(layout, pages, any_seen, all_seen, num_queries == 1)
    page_to_logical = torch.full((padded_rows, layout.total_pages), -1, dtype=torch.int32)
    row_index = torch.arange(padded_rows)[:, None].expand_as(pages)
    held = pages >= 0
    page_to_logical[row_index[held], pages[held]] = torch.arange(width).expand_as(pages)[held].to(torch.int32)
    page_to_logical = page_to_logical.to(device)
    first = torch.tensor(firsts, dtype=torch.long, device=device)
    window_tensor = torch.tensor(window_size, dtype=torch.long, device=device)
    if tree is None:
        mask_mod = _causal_mask(page_to_logical, first, window_tensor, size)
    else:
        mask_mod = _tree_mask(page_to_logical, first, window_tensor, size, *_padded_tree(tree, padded_queries,
                                                                                          device))
    block_mask = BlockMask.from_kv_blocks(
        num_partial.to(device), partial.to(device), num_full.to(device), full.to(device),
        BLOCK_SIZE=(layout.query_block, size * layout.group_pages), mask_mod=mask_mod,
        seq_lengths=(padded_queries, layout.total_pages * size), compute_q_blocks=False)
    return FlexCall(block_mask, layout.kernel_options(num_queries), rows, padded_rows, num_queries, padded_queries)


def _visible_pages(layout: PoolLayout, pages: torch.Tensor, firsts: torch.Tensor, num_queries: int,
                   padded_queries: int, window: int, tree: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, query block and logical page: whether some query of the block sees some key of the page, and
    whether every query sees every key ([rows, query blocks, width] bool each)."""
    size, block = layout.page_size, layout.query_block
    num_blocks = -(-padded_queries // block)
    starts = torch.arange(num_blocks) * block  # first query index of each query block
    real = starts < num_queries  # query blocks past the real queries see nothing
    low = firsts[:, None] + starts[None, :]  # [rows, query blocks]: first and last query position of the block
    high = firsts[:, None] + torch.clamp(starts + block, max=num_queries)[None, :] - 1
    page_first = torch.arange(pages.shape[1]) * size  # [width]: position of each logical page's first key
    page_last = page_first + size - 1
    held = (pages >= 0)[:, None, :] & real[None, :, None]
    if tree:  # node positions are not slot positions: visit every held page, none as full
        return held, torch.zeros_like(held)
    any_seen = held & (page_first[None, None, :] <= high[:, :, None]) & \
        (page_last[None, None, :] > low[:, :, None] - window)
    all_seen = held & (page_last[None, None, :] <= low[:, :, None]) & \
        (page_first[None, None, :] > high[:, :, None] - window)
    return any_seen, all_seen


def _block_lists(layout: PoolLayout, pages: torch.Tensor, any_seen: torch.Tensor, all_seen: torch.Tensor,
                 single_query: bool):
    """Pages -> the sparse key blocks each query block visits: (partial counts [rows, 1, query blocks], partial
    indices [rows, 1, query blocks, groups], full counts, full indices), as `BlockMask.from_kv_blocks` takes them."""
    rows, num_blocks, _ = any_seen.shape
    groups = torch.where(pages >= 0, pages // layout.group_pages, layout.null_group)[:, None, :]
    groups = groups.expand(rows, num_blocks, -1)
    shape = (rows, num_blocks, layout.num_groups)
    any_count = torch.zeros(shape, dtype=torch.int32).scatter_add_(2, groups, any_seen.to(torch.int32))
    all_count = torch.zeros(shape, dtype=torch.int32).scatter_add_(2, groups, all_seen.to(torch.int32))
    full = all_count == layout.group_pages  # every page of the group is this row's and wholly seen
    partial = (any_count > 0) & ~full
    if single_query and layout.uniform:
        # Equal counts in every row: full blocks past the fewest any row has become partial, and the partial lists
        # are padded with the null block (masked everywhere) to the longest.
        fewest = int(full.sum(-1).min())
        extra = full & (full.cumsum(-1) > fewest)
        full, partial = full & ~extra, partial | extra
    num_full, full_indices = _listed_first(full)
    num_partial, partial_indices = _listed_first(partial)
    if single_query and layout.uniform:
        longest = int(num_partial.max())
        position = torch.arange(layout.num_groups)
        partial_indices = torch.where(position < num_partial[..., None], partial_indices, layout.null_group)
        num_partial = torch.full_like(num_partial, longest)
    return (num_partial[:, None], partial_indices[:, None].contiguous(), num_full[:, None],
            full_indices[:, None].contiguous())


def _listed_first(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., groups] bool -> (how many are set [...] int32, the set groups' indices first [..., groups] int32)."""
    order = torch.argsort((~flags).to(torch.uint8), dim=-1, stable=True)
    return flags.sum(-1).to(torch.int32), order.to(torch.int32)


def _causal_mask(page_to_logical, first, window, page_size: int):
    """Query q of row b (position first[b] + q) sees the keys of its own pages at positions up to its own, within
    the window."""

    def mask_mod(b, h, q_idx, kv_idx):
        logical = page_to_logical[b, kv_idx // page_size]
        key = logical * page_size + kv_idx % page_size
        query = first[b] + q_idx
        return (logical >= 0) & (key <= query) & (key > query - window)

    return mask_mod


def _padded_tree(tree, padded_queries: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    positions, new_mask = tree
    pad = padded_queries - positions.shape[0]
    return (F.pad(positions.to(device, torch.long), (0, pad))[None],
            F.pad(new_mask.to(device, torch.bool), (0, pad, 0, pad))[None])


def _tree_mask(page_to_logical, first, window, page_size: int, positions, new_mask):
    """Tree verification: keys before the new tokens are seen within the window of the query's position
    (positions[b, q]); a new token's key is seen where new_mask[b, q, key - first] says."""
    last = new_mask.shape[-1] - 1

    def mask_mod(b, h, q_idx, kv_idx):
        logical = page_to_logical[b, kv_idx // page_size]
        key = logical * page_size + kv_idx % page_size
        new_index = torch.clamp(key - first[b], 0, last)
        new_seen = new_mask[b, q_idx, new_index] & (key - first[b] <= last)
        old_seen = key > positions[b, q_idx] - window
        return (logical >= 0) & torch.where(key < first[b], old_seen, new_seen)

    return mask_mod
