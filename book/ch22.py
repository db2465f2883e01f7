"""Chapter 22's harness: what chapters 22-24 and their lab notes share that is not
the lesson (issue 44).

    from book.ch22 import SCHEMAS, chat_prompts, validates

The six schemas of the chapter's opening, their prompt and their validity check
(`jsonschema`, formats included). Chapter 23's coverage tables are in book/ch23.py;
chapter 24's random model, engine tables and timing loops in book/ch24.py.
"""

from __future__ import annotations

import json

import jsonschema

from benchmarks.structured_output import SCHEMAS  # the six the GPU run constrains

__all__ = ["SCHEMAS", "chat_prompts", "validates"]

# formats checked as draft 2020-12 defines them (RFC 3339 times need an offset)
FORMAT_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


def validates(text: str, schema: dict) -> bool:
    """Does text parse as JSON and validate against schema, formats included?"""
    try:
        value = json.loads(text)
        jsonschema.validate(value, schema, format_checker=FORMAT_CHECKER)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def chat_prompts(tokenizer, schemas=SCHEMAS) -> list[str]:
    """One chat turn per schema, asking for nothing but a matching object."""
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": (
            "Reply with only a JSON object that matches this JSON Schema:\n"
            + json.dumps(s))}])
        for s in schemas
    ]  # fmt: skip
