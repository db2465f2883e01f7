"""Chapter 16's placeholder patch: `steady` (one plain copy of step N's tokens into
rows 0..n-1) holds exactly where the general patch's index arrays are row j <- token j
for every hole, over random mixes of decoding, prefilling, new and reordered rows."""

from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.async_scheduling import steady


def general_rows(output, before, holes):
    """(dst, src) as `_patch_for`'s general path computes them."""
    requests = output.scheduled_requests
    row_of = {r.request_id: j for j, r in enumerate(before)}
    lens = [output.num_scheduled_tokens[r.request_id] for r in requests]
    dst = (np.cumsum(lens) - 1)[holes]
    return dst.tolist(), [row_of[requests[i].request_id] for i in holes]


@st.composite
def steps(draw):
    pool = [SimpleNamespace(request_id=str(i)) for i in range(8)]
    before = draw(st.permutations(pool))[: draw(st.integers(1, 8))]
    kept = [r for r in before if draw(st.booleans()) or len(before) < 3]
    new = [r for r in pool if r not in before][: draw(st.integers(0, 2))]
    requests = kept + new
    if draw(st.booleans()):
        requests = draw(st.permutations(requests))
    counts = {r.request_id: draw(st.sampled_from([1, 1, 1, 3])) for r in requests}
    # a hole: a row of step N's sampled requests whose chunk ends here
    holes = [i for i, r in enumerate(requests) if r in before and draw(st.booleans())]
    output = SimpleNamespace(scheduled_requests=requests, num_scheduled_tokens=counts)
    return output, before, holes


@settings(max_examples=400, deadline=None)
@given(steps())
def test_steady_is_exactly_the_in_order_case_of_the_general_patch(step):
    output, before, holes = step
    if not holes:
        return
    dst, src = general_rows(output, before, holes)
    in_order = dst == src == list(range(len(holes)))
    assert steady(output, before, holes) == in_order
