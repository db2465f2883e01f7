"""Worked solutions to chapter 8's exercises (chapters/08_engine_parts.md).

Installed the way a reader's exported cells would be: an option set declared with
engine_options and a request check in the seam's REQUEST_CHECKS (7.1), a method set
on Registry and its check wrapped (7.2). The checks are
exercises/test_08_engine_parts.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from difflib import get_close_matches
from typing import Any

from minillm.registry import REQUEST_CHECKS, Registry, engine_options


# 7.1
@engine_options
@dataclass(frozen=True)
class PromptLimit:
    """An EngineConfig option of one's own: the longest prompt a request may have."""

    max_prompt_tokens: int | None = None  # None: as long as the context allows

    @staticmethod
    def check(config) -> None:
        limit = config.max_prompt_tokens
        if limit is not None and (
            not isinstance(limit, int) or isinstance(limit, bool) or limit < 1
        ):
            raise ValueError(
                f"max_prompt_tokens must be None or a positive integer, got {limit!r}"
            )


def prompt_limit_check(engine, request) -> None:
    """REQUEST_CHECKS entry: refuse a prompt over max_prompt_tokens. The engine calls
    it before it queues the request, so refusing changes nothing."""
    limit = engine.config.max_prompt_tokens
    if limit is not None and request.num_prompt_tokens > limit:
        raise ValueError(
            f"the prompt has {request.num_prompt_tokens} tokens; this engine's "
            f"max_prompt_tokens is {limit}"
        )


REQUEST_CHECKS.append(prompt_limit_check)


# 7.2
def suggest(self: Registry, value: Any) -> str | None:
    """The registered name closest to a mistyped value, or None (difflib's measure,
    the one EngineConfig uses for a mistyped keyword)."""
    if not isinstance(value, str):
        return None
    names = [n for n in [*self.parts, self.auto] if isinstance(n, str)]
    near = get_close_matches(value, names, 1)
    return near[0] if near else None


_check = Registry.check


def check_suggesting(self: Registry, value: Any) -> None:
    """Registry.check, whose error ends with the closest name when there is one."""
    try:
        _check(self, value)
    except ValueError as e:
        near = self.suggest(value)
        if near is None:
            raise
        raise ValueError(f"{e} (did you mean {near!r}?)") from None


Registry.suggest = suggest
Registry.check = check_suggesting

SOLUTIONS = {
    "max_prompt_tokens": (PromptLimit, prompt_limit_check),
    "suggest": (suggest, check_suggesting),
}
