"""Worked solutions to chapter 9's exercises (chapters/09_engine.md).

Installed the way a reader's exported cells would be: methods set on LLMEngine and
the output processor, a SamplingParams with one more field, a part registered through
minillm.registry.
The checks are exercises/test_09_engine.py.
"""

from __future__ import annotations

import dataclasses
import itertools

import minillm.sampling_params as sampling_params
from minillm.engine import LLMEngine
from minillm.kv_cache_manager import KVCacheManager
from minillm.output_processor import OutputProcessor
from minillm.registry import KV_CACHE_MANAGERS
from minillm.sampling_params import SamplingParamsError

_ids = itertools.count()


# 8.1
def prompt_logprobs(self: LLMEngine, prompt_token_ids: list[int]) -> list[float]:
    """logprob of prompt token i given tokens 0..i-1, for i >= 1.

    A request of one token with prompt_logprobs=0 has the model score every prompt row
    through the paged cache (compute_logits, log_softmax, the next token's entry);
    each position's dict holds the prompt's own token.
    """
    params = sampling_params.SamplingParams(
        temperature=0, max_tokens=1, prompt_logprobs=0, output_kind="final_only"
    )
    request_id = f"prompt-logprobs-{next(_ids)}"
    self.add_request(request_id, list(prompt_token_ids), params)
    final = None
    while final is None:
        final = next((o for o in self.step() if o.request_id == request_id), None)
    scored = final.prompt_logprobs[1:]  # position 0 has nothing before it
    return [lp[t].logprob for lp, t in zip(scored, prompt_token_ids[1:])]


# 8.2
@dataclasses.dataclass
class SamplingParams(sampling_params.SamplingParams):
    best_of: int | None = None  # sample this many, return the n most likely

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.best_of is not None and (
            not isinstance(self.best_of, int) or self.best_of < self.n
        ):
            raise SamplingParamsError(
                "best_of", self.best_of, f"None or an integer >= n ({self.n})"
            )


_add_request = LLMEngine.add_request
_make_outputs = OutputProcessor.make_outputs


def add_request_best_of(self, request_id, prompt, params=None, *args, **kwargs):
    """best_of > n: run best_of children with their logprobs counted, and note on the
    parent how many of them to show."""
    best_of = getattr(params, "best_of", None)
    if best_of is None or best_of == params.n:
        return _add_request(self, request_id, prompt, params, *args, **kwargs)
    run = dataclasses.replace(
        params,
        n=best_of,
        best_of=None,
        logprobs=0 if params.logprobs is None else params.logprobs,  # counted
        output_kind="final_only",  # the best are known only when all have finished
    )
    _add_request(self, request_id, prompt, run, *args, **kwargs)
    parent = self.output_processor.parents[request_id]
    parent.best_of = (params.n, params.logprobs is not None)


def make_outputs_best_of(self, parent_ids):
    """The output processor's outputs, a best_of parent's cut to its n best once
    all have finished (the note is read first: a finished parent is forgotten)."""
    notes = {p: getattr(self.parents[p], "best_of", None) for p in parent_ids}
    outputs, forgotten = _make_outputs(self, parent_ids)
    for output in outputs:
        n, keep_logprobs = notes[output.request_id] or (None, True)
        if n is not None and output.finished:
            ranked = sorted(output.outputs, key=lambda c: -c.cumulative_logprob)
            output.outputs = ranked[:n]
            for completion in output.outputs if not keep_logprobs else []:
                completion.logprobs = None
    return outputs, forgotten


# 8.3
@KV_CACHE_MANAGERS.register("counting")
class CountingKVCacheManager(KVCacheManager):
    """Chapter 6's manager, counting every block it hands out."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.num_allocated_blocks = 0

    def allocate_slots(self, request, *args, **kwargs):
        before = len(self.req_to_blocks.get(request.request_id, ()))
        result = super().allocate_slots(request, *args, **kwargs)
        self.num_allocated_blocks += (
            len(self.req_to_blocks.get(request.request_id, ())) - before
        )
        return result


LLMEngine.prompt_logprobs = prompt_logprobs
# where the reader's field would live: pickled requests (chapter 28's engine process)
# name minillm.sampling_params.SamplingParams, which a fresh process can import
SamplingParams.__module__ = "minillm.sampling_params"
sampling_params.SamplingParams = SamplingParams
LLMEngine.add_request = add_request_best_of
OutputProcessor.make_outputs = make_outputs_best_of

SOLUTIONS = {
    "prompt_logprobs": prompt_logprobs,
    "best_of": (SamplingParams, add_request_best_of, make_outputs_best_of),
    "counting": CountingKVCacheManager,
}
