"""Checks for chapter 21's exercises (chapters/21_speculative.md, "Exercises")."""

import pytest
import torch
from _check import answer

from minillm.speculative import ngram, rejection
from minillm.speculative.runner import SpecDecodingStats


def _latest_ref(token_ids, k, min_n, max_n):
    L = len(token_ids)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        for start in range(L - n - 1, -1, -1):
            if token_ids[start : start + n] == token_ids[L - n :]:
                return token_ids[start + n : start + n + k]
    return []


def test_latest():
    """15.1: the most recent earlier occurrence of the longest matching n-gram."""
    propose_latest = answer(ngram, "propose_latest", "21.1")
    assert propose_latest([1, 2, 9, 1, 2, 8, 1, 2], 2, 2, 3) == [8, 1]
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        n = int(torch.randint(1, 25, (1,), generator=g))
        ids = torch.randint(0, 3, (n,), generator=g).tolist()
        assert propose_latest(ids, 3, 1, 3) == _latest_ref(ids, 3, 1, 3), ids


def test_expected():
    """15.2: tau for independent acceptances with probability alpha."""
    expected = answer(rejection, "expected_acceptance_length", "21.2")
    assert expected(0.0, 4) == pytest.approx(1.0)
    assert expected(1.0, 4) == pytest.approx(5.0)
    g = torch.Generator().manual_seed(0)
    for alpha, k in [(0.3, 3), (0.7, 5), (0.9, 2)]:
        stats = SpecDecodingStats(k)
        for _ in range(20000):
            accepted = (torch.rand(k, generator=g) < alpha).int().cumprod(0).sum()
            stats.observe_draft(k, int(accepted))
        assert stats.mean_acceptance_length == pytest.approx(
            expected(alpha, k), rel=0.02
        )


def test_residual():
    """15.3: the normalised residual max(0, p - q), and the identity it completes."""
    residual = answer(rejection, "residual", "21.3")
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        p = torch.rand(8, generator=g).pow(3).softmax(-1)
        q = torch.rand(8, generator=g).pow(3).softmax(-1)
        r = residual(p, q)
        assert r.sum() == pytest.approx(1.0) and (r >= 0).all()
        overlap = torch.minimum(p, q)
        assert torch.allclose(overlap + (1 - overlap.sum()) * r, p, atol=1e-6)
    assert torch.allclose(residual(p, p), p)


def test_chain():
    """15.4: how often the first j chained EAGLE guesses all equal the target's."""
    from minillm.model import CausalLM
    from minillm.speculative import eagle
    from minillm.tiny import TINY_CONFIG

    chain_acceptance = answer(eagle, "chain_acceptance", "21.4")
    torch.manual_seed(0)
    target = CausalLM(TINY_CONFIG).eval()
    draft = eagle.EagleDraft(target).eval()
    N, W, depth, vocab = 8, 8, 3, TINY_CONFIG.vocab_size
    tokens = torch.randint(0, vocab, (N, W + 1 + depth))
    features = torch.randn(N, W + depth, TINY_CONFIG.hidden_size)
    for i in range(N):  # sequence i: its first i % 4 guesses are the target's tokens
        seq = tokens[i].tolist()
        guesses = eagle.eagle_propose_ref(draft, features[i, :W], seq[: W + 1], depth)
        m = i % (depth + 1)
        tokens[i, W + 1 : W + 1 + m] = torch.tensor(guesses[:m], dtype=torch.long)
        if m < depth:
            tokens[i, W + 1 + m] = (guesses[m] + 1) % vocab
    want = [sum(i % (depth + 1) > j for i in range(N)) / N for j in range(depth)]
    got = chain_acceptance(draft, tokens, features, W, depth)
    assert got == pytest.approx(want)
