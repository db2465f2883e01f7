"""Worked solutions to chapter 16's exercises (chapters/16_async_scheduling.md).

Installed the way a reader's exported cells would be: new functions in
minillm.kernels.penalties, changed methods set on GPUModelRunner. The checks are
exercises/test_16_async_scheduling.py.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl
from torch import Tensor

import minillm.gpu_model_runner as gpu_model_runner
from minillm.gpu_model_runner import GPUModelRunner
from minillm.input_batch import upload
from minillm.kernels import penalties
from minillm.sampler import Sampler, gather_logprobs
from minillm.sampling_params import SAMPLING_EPS


# 15.1
def draws_ahead(self, params) -> bool:
    """As chapter 16's, with processed logprobs allowed: _draw_all computes them."""
    if not self.fused_sampling:
        return gpu_model_runner.is_plain_greedy(params, batch_processors=True)
    if params.logit_bias or params.bad_words_token_ids:  # chapter 7's sampler
        return False
    processors = params.logits_processors
    return all(hasattr(type(p), "apply_batch") for p in processors)


def _processed(self, logits: Tensor, md) -> Tensor:
    """The logits a random row draws from: chapter 7's apply_filters (temperature,
    min-p, top-k, top-p) on the device; greedy rows' stay theirs."""
    names = ("temperature", "top_k", "top_p", "min_p")
    on_device = {n: upload(getattr(md, n), self.device) for n in names
                 if getattr(md, n) is not None}  # fmt: skip
    filtered = Sampler.apply_filters(logits.float().clone(), replace(md, **on_device))
    return filtered


def _draw_ahead(self, logits: Tensor, chosen, previous, masks) -> Tensor:
    """Chapter 15's _draw_ahead; it also keeps the logits it drew from in
    self.drawn_from, for processed logprobs."""
    ruled = [j for j, r in enumerate(chosen) if self.token_rules.get(r.request_id)]
    greedy = all(r.sampling_params.temperature < SAMPLING_EPS for r in chosen)
    md = None
    if ruled or not greedy:
        md = self.metadata_ahead(chosen, logits.shape[-1])
    if masks and md is not None and not md.no_penalties:
        logits = logits.float()
    for mask in masks:
        mask(logits)
    if ruled:
        logits = self._rules_ahead(logits, ruled, chosen, md, previous)
    self.drawn_from = logits if greedy else _processed(self, logits, md)  # 12.1
    if greedy:
        return logits.argmax(dim=-1)
    return self.sample_on_device(logits, md)


def _draw_all(self, logits: Tensor, chosen, previous, masks):
    """Chapter 16's _draw_all; the one change is where the logprobs come from."""
    if masks is None:
        masks = self._prepare_masks(chosen, previous)
    asked = [r.sampling_params.logprobs for r in chosen]
    wanted = any(n is not None for n in asked)
    raw = None
    if wanted and self.sampler.logprobs_mode == "raw_logprobs":
        raw = logits.to(torch.float32).log_softmax(dim=-1)  # before any mask
    tokens = self._draw_ahead(logits, chosen, previous, masks)
    if not wanted:
        return tokens, None
    if raw is None:  # 16.1: processed logprobs from the logits the tokens came from
        raw = self.drawn_from.to(torch.float32).log_softmax(dim=-1)
    top = max(n for n in asked if n is not None)
    return tokens, self._to_host(gather_logprobs(raw, top, tokens))


# 15.2
def pack_prompt_mask(prompt_seen: Tensor) -> Tensor:
    """(rows, vocab) bool -> (rows, ceil(vocab / 32)) int32: token t at bit t % 32 of
    word t // 32."""
    rows, vocab = prompt_seen.shape
    words = -(-vocab // 32)
    bits = torch.zeros(rows, words * 32, dtype=torch.int64, device=prompt_seen.device)
    bits[:, :vocab] = prompt_seen.long()
    shifts = torch.arange(32, device=prompt_seen.device)
    packed = (bits.view(rows, words, 32) << shifts).sum(-1)  # in [0, 2**32)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # as int32 bits
    return packed.to(torch.int32)


@triton.jit
def _penalties_packed_kernel(
    logits_ptr, out_ptr, state_rows_ptr, counts_ptr, packed_ptr, penalties_ptr,
    num_rows, V, logits_stride, out_stride, state_stride, packed_stride,
    IN_PLACE: tl.constexpr, BLOCK: tl.constexpr, PRECISE: tl.constexpr,
):  # fmt: skip
    """Chapter 15's penalties kernel reading the prompt mask a bit per token."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    state = tl.load(state_rows_ptr + row).to(tl.int64)
    if IN_PLACE:
        if state < 0:
            return
    x = tl.load(logits_ptr + row * logits_stride + offs, mask=offs < V)
    x = x.to(tl.float32)
    if state >= 0:
        pres = tl.load(penalties_ptr + row)
        freq = tl.load(penalties_ptr + num_rows + row)
        rep = tl.load(penalties_ptr + 2 * num_rows + row)
        at = state * state_stride + offs
        counts = tl.load(counts_ptr + at, mask=offs < V, other=0).to(tl.float32)
        # the change: word offs // 32, bit offs % 32 (32 neighbours share a word, so
        # the loads of a program hit the same few cache lines)
        word = tl.load(packed_ptr + state * packed_stride + offs // 32,
                       mask=offs < V, other=0)  # fmt: skip
        seen = ((word >> (offs % 32)) & 1) != 0
        output_seen = counts > 0
        scale = tl.where(seen | output_seen, rep, 1.0)
        if PRECISE:
            divided = tl.math.div_rn(x, scale)
        else:
            divided = x / scale
        x = tl.where(x > 0, divided, x * scale)
        x = x - freq * counts
        x = x - pres * output_seen.to(tl.float32)
    tl.store(out_ptr + row * out_stride + offs, x, mask=offs < V)


def apply_penalties_packed(
    logits: Tensor,
    state_rows: Tensor,
    output_counts: Tensor,
    packed: Tensor,
    penalties_: Tensor,
) -> Tensor:
    """penalties.apply_penalties with the prompt mask from pack_prompt_mask."""
    num_rows, vocab = logits.shape
    if packed.shape != (output_counts.shape[0], -(-vocab // 32)):
        raise ValueError("packed: (state rows, ceil(vocab / 32)) int32 words")
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    in_place = logits.dtype == torch.float32
    out = logits if in_place else torch.empty_like(logits, dtype=torch.float32)
    grid = (num_rows, triton.cdiv(vocab, penalties.BLOCK))
    _penalties_packed_kernel[grid](
        logits, out, state_rows, output_counts, packed.contiguous(),
        penalties_.contiguous(), num_rows, vocab, logits.stride(0), out.stride(0),
        output_counts.stride(0), packed.contiguous().stride(0), IN_PLACE=in_place,
        BLOCK=penalties.BLOCK, PRECISE=penalties.PRECISE, enable_fp_fusion=False,
    )  # fmt: skip
    return out


GPUModelRunner.draws_ahead = draws_ahead
GPUModelRunner._draw_ahead = _draw_ahead
GPUModelRunner._draw_all = _draw_all
penalties.pack_prompt_mask = pack_prompt_mask
penalties.apply_penalties_packed = apply_penalties_packed

SOLUTIONS = {
    "processed_logprobs": (draws_ahead, _draw_ahead, _processed, _draw_all),
    "packed": (pack_prompt_mask, _penalties_packed_kernel, apply_penalties_packed),
}
