"""The host's work between two compiled greedy steps as one op (`inference_core.model.step_kernel`), against the same
work done with torch ops, as `CompiledDecoder._step` and the argmax do it: the pools, the tokens, the next step's
inputs and key mask, bit for bit. The engine's greedy steps through the op are checked against one step at a time in
tests/engine/test_compiled.py and tests/kv/test_kv_memory.py (a sliding window)."""

from __future__ import annotations

import pytest
import torch

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCKS, SLOTS, MAX_LEN, VOCAB = 2, 2, 8, 4, 6, 3, 24, 50


@pytest.fixture
def greedy_advance(our_ops):
    return torch.ops.inference_core.greedy_advance


def step_inputs(paged: bool, dtype: torch.dtype, window: int | None, generator: torch.Generator):
    """A bucket of 3 rows of which 2 are real, as `CompiledDecoder._prepare` leaves the buffers before a step: rows at
    positions 9 and 2 (the block table's second column, and its first), a padding row at 0, key masks of 3 blocks."""
    bucket, count, width = 3, 2, 3
    shape = (LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM) if paged else (LAYERS, SLOTS, KV_HEADS, MAX_LEN, HEAD_DIM)
    pools = [torch.randn(shape, generator=generator).to(dtype) for _ in range(2)]
    new = [torch.randn(LAYERS, bucket, KV_HEADS, HEAD_DIM, generator=generator).to(dtype) for _ in range(2)]
    logits = torch.randn(bucket, VOCAB, generator=generator)
    logits[0, [7, 31]] = 5.0  # a tie: the first index wins, as in torch.argmax
    logits[1, 12] = float("nan")  # a NaN is the maximum, as in torch.argmax
    positions = torch.tensor([9, 2, 0])
    if paged:  # a wider buffer than the step reads, as the bucket's buffers are
        read_index = torch.tensor([[4, 1, 5, 0], [2, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.int32)[:, :width]
    else:
        read_index = torch.tensor([2, 0, 2])
    keys = torch.arange(width * BLOCK_SIZE if paged else MAX_LEN)
    mask = torch.zeros(bucket, 16, dtype=torch.bool)[:, :len(keys)] if paged else torch.zeros(bucket, len(keys),
                                                                                               dtype=torch.bool)
    mask[:count] = mask_at(keys, positions[:count], window)
    return dict(logits=logits, new=new, pools=pools, read_index=read_index, positions=positions, mask=mask,
                count=count, keys=keys)


def mask_at(keys: torch.Tensor, positions: torch.Tensor, window: int | tuple | None) -> torch.Tensor:
    """The keys a query at each position sees: those before it, within a window (size, or (size, sinks): the first
    `sinks` keys stay in view)."""
    mask = keys < positions[:, None]
    if window is None:
        return mask
    size, sinks = window if isinstance(window, tuple) else (window, 0)
    return mask & ((keys > positions[:, None] - size) | (keys < sinks))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("window", [None, 4, (4, 7)])  # (4, 7): the key that leaves row 0's window is a sink
def test_the_op_does_what_the_torch_ops_do(greedy_advance, paged, dtype, window):
    size, sinks = window if isinstance(window, tuple) else (window or 0, 0)
    s = step_inputs(paged, dtype, window, torch.Generator().manual_seed(3 * paged + 5 * size + sinks))
    count, (new_k, new_v), (k_pool, v_pool) = s["count"], s["new"], s["pools"]
    want_k, want_v = k_pool.clone(), v_pool.clone()
    for row, position in enumerate(s["positions"][:count].tolist()):
        if paged:
            block, offset = s["read_index"][row, position // BLOCK_SIZE], position % BLOCK_SIZE
            want_k[:, block, offset], want_v[:, block, offset] = new_k[:, row], new_v[:, row]
        else:
            want_k[:, s["read_index"][row], :, position], want_v[:, s["read_index"][row], :, position] = (
                new_k[:, row], new_v[:, row])
    want_tokens = s["logits"][:count].argmax(dim=-1)
    assert want_tokens.tolist() == [7, 12]
    want_mask = s["mask"].clone()
    want_mask[:count] = mask_at(s["keys"], s["positions"][:count] + 1, window)
    padding = (s["positions"][count:].clone(), s["mask"][count:].clone())

    input_ids = torch.tensor([1, 2, 0])
    tokens = torch.full((4, count), -1, dtype=torch.long)
    greedy_advance(s["logits"], new_k, new_v, k_pool, v_pool, s["read_index"], input_ids, s["positions"], s["mask"],
                   tokens, 2, count, BLOCK_SIZE if paged else 1, size, sinks, paged)

    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)
    assert tokens[2].tolist() == want_tokens.tolist() and (tokens[[0, 1, 3]] == -1).all()
    assert input_ids.tolist() == want_tokens.tolist() + [0]
    assert s["positions"].tolist() == [10, 3, 0]
    assert torch.equal(s["mask"], want_mask)
    assert torch.equal(s["positions"][count:], padding[0]) and torch.equal(s["mask"][count:], padding[1])


def test_the_op_refuses_what_it_cannot_take(greedy_advance):
    s = step_inputs(True, torch.bfloat16, None, torch.Generator().manual_seed(0))
    (new_k, new_v), (k_pool, v_pool) = s["new"], s["pools"]
    args = dict(logits=s["logits"], new_k=new_k, new_v=new_v, k_pool=k_pool, v_pool=v_pool,
                read_index=s["read_index"], input_ids=torch.zeros(3, dtype=torch.long), positions=s["positions"],
                key_mask=s["mask"], tokens=torch.zeros(1, 2, dtype=torch.long))

    def call(**changes):
        values = {**args, **changes}
        greedy_advance(*values.values(), 0, s["count"], BLOCK_SIZE, 0, 0, True)

    with pytest.raises(RuntimeError, match="pools' dtype"):
        call(new_k=new_k.float(), new_v=new_v.float())
    with pytest.raises(RuntimeError, match="fp32 logits"):
        call(logits=s["logits"].to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="past the block table"):
        call(positions=torch.tensor([40, 2, 0]))
    with pytest.raises(RuntimeError, match="int32 block table"):
        call(read_index=s["read_index"].long())
    with pytest.raises(RuntimeError, match="outside the pool"):
        call(read_index=torch.full((3, 3), BLOCKS, dtype=torch.int32))


def hard_rows(vocab: int) -> torch.Tensor:
    """8 rows of `vocab` fp32 logits whose argmax is easy to get wrong: ties (the first index wins), NaNs (the first
    one is the maximum), nothing but -inf, the maximum in the last lanes a vector does not fill or at index 0, all
    equal."""
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(vocab))
    logits[1, [vocab // 2, vocab - 1]] = 9.0  # a tie
    logits[2, vocab - 1] = float("nan")  # a NaN in the tail
    logits[3, [1, vocab - 2]] = float("nan")  # two NaNs
    logits[4] = float("-inf")  # nothing but -inf
    logits[5, vocab - 1] = 9.0  # the maximum in the tail
    logits[6, 0] = 9.0  # at the first index
    logits[7] = 1.0  # all equal
    return logits


@pytest.mark.parametrize("vocab", [5, 50, 49152])
def test_the_tokens_are_torch_argmax(greedy_advance, vocab):
    """Ties, NaNs, -inf and the maximum in the last lanes a vector does not fill, at a short and the bundled model's
    vocabulary: the op's token is torch.argmax's."""
    logits = hard_rows(vocab)
    rows = logits.shape[0]
    pool = torch.zeros(1, rows, BLOCK_SIZE, 1, HEAD_DIM)
    new = torch.zeros(1, rows, 1, HEAD_DIM)
    read_index = torch.arange(rows, dtype=torch.int32)[:, None]
    tokens = torch.zeros(1, rows, dtype=torch.long)
    greedy_advance(logits, new, new, pool, pool.clone(), read_index, torch.zeros(rows, dtype=torch.long),
                   torch.zeros(rows, dtype=torch.long), torch.zeros(rows, BLOCK_SIZE, dtype=torch.bool), tokens, 0,
                   rows, BLOCK_SIZE, 0, 0, True)
    assert tokens[0].tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("vocab", [5, 50, 49152])
def test_argmax_rows_is_torch_argmax(our_ops, vocab):
    """The sampler's greedy argmax through our op (`row_kernel.argmax_rows`) where the extension is loaded: ties,
    NaNs, -inf and the maximum in a vector's unfilled tail give torch.argmax's ids, for every row and for rows read
    with a stride (a slice of wider rows, as a verification's rows of the compiled step's logits are)."""
    from inference_core.model.row_kernel import argmax_rows, loaded

    assert loaded()
    logits = torch.cat([hard_rows(vocab), torch.randn(1, vocab)])
    logits = torch.cat([logits, torch.randn(len(logits), 3)], 1)  # rows read with a stride: the first vocab of each
    for rows in (logits[:, :vocab], logits[:, :vocab].contiguous(), logits[:1, :vocab], logits[:0, :vocab]):
        assert argmax_rows(rows).tolist() == rows.argmax(dim=-1).tolist()
    assert argmax_rows(logits[:, :vocab].double()).tolist() == logits[:, :vocab].argmax(dim=-1).tolist()  # torch's
