"""Chapter 18's helpers that are not the lesson: what the rotation's check prints
(groups' peaks, input channels' spread) and the held-out perplexity of "Measured"
(the quality tables' helpers are book/ch19.py's).

The chapter (chapters/18_quantization.md) imports them; the quantizers themselves
are in minillm/quantization/.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minillm.quantization.calibration import decoder_linears
from minillm.quantization.rotation import stream_projections


def peak_to_rms(w: Tensor, g: int = 128) -> float:
    """Each group of g weights' largest magnitude over its rms, averaged."""
    groups = w.detach().float().reshape(w.shape[0], -1, g)
    rms = groups.pow(2).mean(-1).sqrt().clamp(min=1e-12)
    return float((groups.abs().amax(-1) / rms).mean())


def channel_spread(hessian: Tensor) -> float:
    """Largest input channel's rms over the median channel's, from H = X^T X."""
    rms = torch.diagonal(hessian).clamp(min=0).sqrt()
    return float(rms.max() / rms.median().clamp(min=1e-12))


def readers_of(m) -> dict[str, nn.Linear]:
    """The projections that read the residual stream, by name."""
    names = {mod: n for n, mod in decoder_linears(m).items()}
    return {
        names[w]: w
        for layer in m.model.layers
        for _, ws in stream_projections(layer)[0]
        for w in ws
    }


@torch.no_grad()
def held_out_ppl(model: nn.Module, windows: Tensor, batch_size: int = 16) -> float:
    """exp of the mean next-token cross-entropy over every token of windows [W, T]."""
    total, count = 0.0, 0
    for batch in windows.split(batch_size):
        positions = torch.arange(batch.shape[1]).expand_as(batch)
        logits = model.compute_logits(model(batch, positions)[:, :-1])  # (B, T-1, V)
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"
        )
        total, count = total + float(loss), count + batch[:, 1:].numel()
    return float(torch.tensor(total / count).exp())
