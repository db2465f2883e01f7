"""Worked solutions to chapter 3's exercises (chapters/03_paged_kv.md).

Each answer is installed into minillm.kv_cache the way a reader's exported cell would
put it there; the checks are exercises/test_03_paged_kv.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

import minillm.kv_cache as kv_cache


# 2.1
def token_positions(query_start_loc: Tensor, seq_lens: Tensor) -> tuple[Tensor, Tensor]:
    """(req_indices, positions) of every token of the flat batch, with no Python loop.

    Sequence i owns tokens query_start_loc[i] : query_start_loc[i + 1], which are its
    last query_len positions: they start at seq_len - query_len.
    """
    query_start_loc, seq_lens = query_start_loc.long(), seq_lens.long()
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    num_seqs = seq_lens.shape[0]
    req_indices = torch.repeat_interleave(torch.arange(num_seqs), query_lens)
    # a token's offset inside its sequence's query, plus where that query starts
    offsets = torch.arange(int(query_start_loc[-1])) - query_start_loc[req_indices]
    first_position = (seq_lens - query_lens)[req_indices]
    return req_indices, first_position + offsets


# 2.3
PAD_SLOT_ID = -1


# 2.2 and 2.3
def reshape_and_cache(
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slot_mapping: Tensor,
) -> None:
    """Chapter 3's reshape_and_cache, with two changes: a token whose slot is
    PAD_SLOT_ID is skipped (2.3), and an fp8 cache is written as bytes (2.2).
    """
    real = slot_mapping != PAD_SLOT_ID  # a mask, not a loop: padding goes nowhere
    slot_mapping, key, value = slot_mapping[real], key[real], value[real]
    n_kv, head_dim = key_cache.shape[-2:]
    for new, cache in ((key, key_cache), (value, value_cache)):
        flat = cache.view(-1, n_kv, head_dim)  # (slots, n_kv, D)
        new = new.to(cache.dtype)  # the rounding to fp8 happens here, once
        if cache.element_size() == 1 and cache.is_floating_point():
            # no index_copy_ kernel for fp8 on the CPU: copy the bytes instead
            flat, new = flat.view(torch.uint8), new.view(torch.uint8)
        flat.index_copy_(0, slot_mapping, new)


kv_cache.token_positions = token_positions
kv_cache.PAD_SLOT_ID = PAD_SLOT_ID
kv_cache.reshape_and_cache = reshape_and_cache

SOLUTIONS = {
    "token_positions": token_positions,
    "fp8": reshape_and_cache,
    "pad_slot": reshape_and_cache,
}
