"""The workloads of chapter 21's measurements: prompts from the held-out topics of the
course corpus (chapter 1's split), shared by benchmarks/speculative.py, the chapter's
lab notes and tests/test_speculative_bf16.py.

- "repetitive": a passage, a blank line, then its first 12 tokens again (as an edit
  quotes what it changes): the n-gram lookup finds the continuation in the prompt;
- "open": a passage's first 24 tokens, nothing to look up.
"""

from __future__ import annotations

from minillm.tokenizer import read_corpus, split_corpus


def held_out_prompts(
    tokenizer, kind: str, num: int, passage_tokens: int = 160
) -> list[list[int]]:
    """num prompts of one kind, cycling over the held-out topics."""
    if kind not in ("repetitive", "open"):
        raise ValueError(f"kind must be 'repetitive' or 'open', got {kind!r}")
    _, held_out = split_corpus(read_corpus())
    passages = [tokenizer.encode(doc)[:passage_tokens] for doc in held_out]
    prompts = []
    for i in range(num):
        passage = passages[i % len(passages)]
        if kind == "open":
            prompts.append(passage[:24])
        else:
            prompts.append(passage + tokenizer.encode("\n\n") + passage[:12])
    return prompts
