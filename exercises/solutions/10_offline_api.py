"""Worked solutions to chapter 10's exercises (chapters/10_offline_api.md).

Installed the way a reader's exported cells would be: methods set on LLM. The checks
are exercises/test_10_offline_api.py.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import minillm.sampling_params as sampling_params
from minillm.beam_search import BeamSearchInstance, BeamSearchSequence
from minillm.beam_search import beam_score, extend_beams
from minillm.llm import LLM

_ids = itertools.count()


# 9.1
def stream(self: LLM, prompt, params=None) -> Iterator[str]:
    """Text deltas as the engine produces them: each cumulative output's text minus
    what was already shown (the detokenizer holds back a possible stop string)."""
    params = dataclasses.replace(
        params or sampling_params.SamplingParams(), output_kind="cumulative"
    )
    request_id = f"stream-{next(_ids)}"
    self.engine.add_request(request_id, prompt, params)
    shown, finished = "", False
    try:
        while not finished:
            for output in self.engine.step():
                if output.request_id != request_id:
                    continue
                text, finished = output.outputs[0].text, output.finished
                if len(text) > len(shown):
                    yield text[len(shown) :]
                    shown = text
    finally:  # a reader that stops early: the request stops too
        if not finished:
            self.engine.abort_request(request_id)


# 9.2
def diverse_beam_search(
    self: LLM, prompt, params, num_groups: int, diversity_penalty: float
) -> list[BeamSearchSequence]:
    """Each group's best beam_width // num_groups sequences, group by group. At every
    step the groups extend their beams in order, a candidate's logprob lowered by
    diversity_penalty for each earlier group whose beams took the same token."""
    if num_groups < 1 or params.beam_width % num_groups:
        raise ValueError(
            f"num_groups={num_groups} must divide beam_width={params.beam_width}"
        )
    group_params = dataclasses.replace(
        params, beam_width=params.beam_width // num_groups
    )
    (start,) = self._beam_prompts([prompt], params)
    step_params = sampling_params.SamplingParams(
        logprobs=2 * params.beam_width,
        max_tokens=1,
        temperature=params.temperature,
        detokenize=False,
    )
    eos = self.tokenizer.eos_token_id if self.tokenizer else None
    groups = [
        BeamSearchInstance(
            [BeamSearchSequence(start, list(start["prompt_token_ids"]), [])]
        )
        for _ in range(num_groups)
    ]
    for _ in range(params.max_tokens):
        beams = [b for group in groups for b in group.beams]
        if not beams:
            break
        requests = [{"prompt_token_ids": b.tokens} for b in beams]
        outputs = self._run(self._add(requests, step_params, None), False)
        candidates = iter(o.outputs[0].logprobs[0] for o in outputs)
        taken: dict[int, int] = {}  # token -> how many earlier groups' beams took it
        for group in groups:
            step = [next(candidates) for _ in group.beams]
            penalized = [
                {
                    t: dataclasses.replace(
                        lp, logprob=lp.logprob - diversity_penalty * taken.get(t, 0)
                    )
                    for t, lp in c.items()
                }
                for c in step
            ]
            extend_beams(group, penalized, group_params, eos)
            for beam in group.beams:
                taken[beam.tokens[-1]] = taken.get(beam.tokens[-1], 0) + 1
    best = []
    for group in groups:
        done = group.completed + group.beams
        done.sort(key=lambda s: beam_score(s, eos, params.length_penalty))
        best += done[::-1][: group_params.beam_width]  # as run_beam_search ranks
    for seq in best if self.tokenizer else ():
        skip = params.skip_special_tokens
        seq.text = self.tokenizer.decode(seq.tokens, skip_special_tokens=skip)
    return best


LLM.stream = stream
LLM.diverse_beam_search = diverse_beam_search

SOLUTIONS = {"stream": stream, "diverse_beam_search": diverse_beam_search}
