"""Engines for tests/test_engine_core.py, built in the engine's own process: a spawned
child imports this module by name (its folder is on the parent's sys.path), so they
live outside the test module."""

from minillm.server import build_engine

FAILING_MAX_TOKENS = 13  # a request with this max_tokens makes the next step raise


def build_failing(args):
    """chapter 25's engine whose next step raises once a request with
    max_tokens == FAILING_MAX_TOKENS arrives (and then works again)."""
    engine, name = build_engine(args)
    add, step, armed = engine.add_request, engine.step, []

    def add_request(request_id, prompt, params, *rest, **kwargs):
        result = add(request_id, prompt, params, *rest, **kwargs)
        if params.max_tokens == FAILING_MAX_TOKENS:
            armed.append(request_id)
        return result

    def failing_step():
        if armed:
            armed.clear()
            raise RuntimeError("simulated failure")
        return step()

    engine.add_request, engine.step = add_request, failing_step
    return engine, name


def build_broken(args):
    """An engine that cannot be built (a missing checkpoint, say)."""
    raise FileNotFoundError("no checkpoint at /nonexistent")
