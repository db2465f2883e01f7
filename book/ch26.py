"""Chapter 26's helpers that are not the lesson: the tool-call checkpoint's two tools
and its random walk through a grammar, and the timing and bar plot of what a stream's
text chunk costs.

The chapter (chapters/26_openai_api.md) imports them; the endpoints themselves are in
minillm/serving*.py.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

# two tools for the chapter's tool-call checkpoint, in OpenAI's shape
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"},
        "b": {"type": "integer"}}, "required": ["a", "b"],
        "additionalProperties": False}}},
]  # fmt: skip
LABELS = {
    "through_models": "pydantic models (the reference)",
    "through_text_event": "text_event (the streams' path)",
    "framing_only": "framing alone (the limit)",
}


def plot_chunk_costs(chunk_us: dict[str, float], title: str) -> None:
    """Microseconds per chunk of each way of writing it, as bars."""
    fig, ax = plt.subplots(figsize=(9, 2.2))
    names = [LABELS.get(k, k) for k in chunk_us]
    bars = ax.barh(names, list(chunk_us.values()), color=["gray", "C0", "C1"])
    ax.bar_label(bars, fmt="%.2f µs", padding=3)
    top = 1.25 * max(chunk_us.values())
    ax.set(xlabel="µs per chunk", title=title, xlim=(0, top))
    ax.invert_yaxis()
    plt.tight_layout()
    plt.show()


def walk(schema: dict, rng, compiler, tokenizer, max_tokens: int = 120) -> str:
    """A random walk through a JSON Schema's grammar (chapter 24's checkpoint): a
    uniform choice among the tokens the constraint allows, until it allows the end."""
    import torch

    from minillm.sampling_params import StructuredOutputsParams
    from minillm.structured.processor import logits_processor

    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    proc, out = logits_processor(so, compiler, max_tokens), []
    eos = set(compiler.index.eos_token_ids)
    while True:
        logits = proc(out, torch.zeros(compiler.index.vocab_size))
        token = rng.choice(torch.nonzero(logits > float("-inf")).flatten().tolist())
        if token in eos:
            return tokenizer.decode(out)
        out.append(token)


def chunk_costs(number: int = 2000, repeat: int = 3) -> dict[str, float]:
    """µs per text chunk of a completions stream, written three ways: through the
    protocol's models, through `text_event`, and the framing alone of JSON already
    written. Checks first that the three write the same bytes."""
    import timeit

    from minillm.protocol import CompletionResponse, CompletionResponseChoice
    from minillm.serving import StreamPiece, sse
    from minillm.serving_completion import text_event

    def pydantic_chunk(choices: list) -> str:
        response = CompletionResponse(
            id="cmpl-1", created=1, model="m", choices=choices
        )
        return sse(response)

    envelope = tuple(pydantic_chunk([]).split('"choices":[]'))
    piece = StreamPiece(0, " the", None, None, None, 0)
    written = pydantic_chunk([CompletionResponseChoice(index=0, text=" the")])[6:-2]

    def through_models() -> str:
        return pydantic_chunk([CompletionResponseChoice(index=0, text=" the")])

    def through_text_event() -> str:
        return text_event(envelope, piece)

    def framing_only() -> str:
        return sse(written)

    assert through_models() == through_text_event() == framing_only()  # byte for byte
    return {
        f.__name__: 1e6 * min(timeit.repeat(f, number=number, repeat=repeat)) / number
        for f in (through_models, through_text_event, framing_only)
    }
