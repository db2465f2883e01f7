"""Worked solutions to chapter 5's exercises (chapters/05_paged_attention.md).

Each answer is installed into minillm.attention the way a reader's exported cell would
put it there; the checks are exercises/test_05_paged_attention.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

import minillm.attention as attention
from minillm.attention import paged_attention_ref, query_layout
from minillm.model import AttentionMetadata, build_attention_metadata


# 4.1
def paged_attention_split(
    q: Tensor, key_cache: Tensor, value_cache: Tensor, attn_metadata: AttentionMetadata
) -> Tensor:
    """The reference twice: on the decodes (query_len 1), then on the rest, so that a
    long prefill no longer pads every decode to its length."""
    md = attn_metadata
    starts = md.query_start_loc.long()
    query_lens = (starts[1:] - starts[:-1]).tolist()
    seq_lens, tables = md.seq_lens.tolist(), md.block_tables.tolist()
    seq_idx, _ = query_layout(md)
    is_decode = torch.tensor([n == 1 for n in query_lens])
    out = torch.empty_like(q)
    for half in (is_decode, ~is_decode):
        seqs = half.nonzero().flatten().tolist()
        if not seqs:
            continue  # either half may be empty
        _, half_md = build_attention_metadata(
            [query_lens[i] for i in seqs],
            [seq_lens[i] for i in seqs],
            [tables[i] for i in seqs],
            key_cache.shape[1],
            q.device,
        )
        tokens = half[seq_idx]  # where this half's tokens sit in the flat batch
        out[tokens] = paged_attention_ref(q[tokens], key_cache, value_cache, half_md)
    return out


# 4.2
def paged_attention_online(
    q: Tensor, key_cache: Tensor, value_cache: Tensor, attn_metadata: AttentionMetadata
) -> Tensor:
    """The reference's result, one block-table column of keys at a time: a running
    maximum m, sum l and weighted sum a per query row (online softmax)."""
    md = attn_metadata
    S, max_q = md.num_seqs, md.max_query_len
    n_heads, D = q.shape[1], q.shape[2]
    block_size, n_kv = key_cache.shape[1], key_cache.shape[2]
    seq_idx, row = query_layout(md)
    q_pad = q.new_zeros(S, max_q, n_heads, D)
    q_pad[seq_idx, row] = q
    # (S, n_kv, group, max_q, D), scaled once
    q_pad = q_pad.float().view(S, max_q, n_kv, -1, D).permute(0, 2, 3, 1, 4) * D**-0.5
    starts, seq_lens = md.query_start_loc.long(), md.seq_lens.long()
    q_pos = (seq_lens - (starts[1:] - starts[:-1]))[:, None] + torch.arange(max_q)
    m = torch.full(q_pad.shape[:-1], float("-inf"))  # (S, n_kv, group, max_q)
    ell = torch.zeros_like(m)
    acc = torch.zeros_like(q_pad)
    for j in range(-(-md.max_seq_len // block_size)):
        blocks = md.block_tables[:, j].long()
        k = key_cache[blocks].float()  # (S, block_size, n_kv, D)
        v = value_cache[blocks].float()
        k_pos = j * block_size + torch.arange(block_size)  # (block_size,)
        in_seq = k_pos < seq_lens[:, None]  # (S, block_size): never trust the rest
        v = v.masked_fill(~in_seq[:, :, None, None], 0.0)
        visible = (k_pos <= q_pos[:, :, None]) & in_seq[:, None]  # (S, max_q, bs)
        s = torch.einsum("skgqd,slkd->skgql", q_pad, k)
        s = s.masked_fill(~visible[:, None, None], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))  # finite from block 0: key 0 is visible
        p = torch.exp(s - m_new[..., None])  # (S, n_kv, group, max_q, bs)
        scale = torch.exp(m - m_new)  # rescales what was summed under the old max
        ell = ell * scale + p.sum(-1)
        acc = acc * scale[..., None] + torch.einsum("skgql,slkd->skgqd", p, v)
        m = m_new
    out = (acc / ell[..., None]).permute(0, 3, 1, 2, 4).reshape(S, max_q, n_heads, D)
    return out[seq_idx, row].to(q.dtype)


# 4.3
def visibility_mask(
    attn_metadata: AttentionMetadata, sliding_window: int | None = None
) -> Tensor:
    """Chapter 5's mask; with a window W a query at position p sees p - W < l <= p."""
    starts = attn_metadata.query_start_loc.long()
    seq_lens = attn_metadata.seq_lens.long()  # (num_seqs,)
    context_lens = seq_lens - (starts[1:] - starts[:-1])
    device = seq_lens.device
    # (num_seqs, max_q, 1)
    q_pos = (
        context_lens[:, None] + torch.arange(attn_metadata.max_query_len, device=device)
    )[:, :, None]
    k_pos = torch.arange(attn_metadata.max_seq_len, device=device)
    mask = (k_pos <= q_pos) & (k_pos < seq_lens[:, None, None])
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window  # the one more comparison
    return mask


attention.paged_attention_split = paged_attention_split
attention.paged_attention_online = paged_attention_online
attention.visibility_mask = visibility_mask

SOLUTIONS = {
    "split": paged_attention_split,
    "online": paged_attention_online,
    "sliding_window": visibility_mask,
}
