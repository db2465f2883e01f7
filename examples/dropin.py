"""One script, two engines: code written for vLLM's offline API runs unchanged on
minillm (chapter 29). Only the import depends on --engine.

    .venv-vllm/bin/python examples/dropin.py --engine vllm --model FOLDER
    .venv/bin/python examples/dropin.py --engine minillm --model FOLDER

FOLDER is a Hugging Face folder (Llama architecture, a head_dim vLLM's CPU attention
takes: 64 for the course's tiny model). Prints one JSON line per output, and with
--out writes them to a file.
"""

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["vllm", "minillm"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.engine == "vllm":
        from vllm import LLM, SamplingParams
    else:
        from minillm import LLM, SamplingParams

    # --- from here on, the code is the same for both engines --------------------
    llm = LLM(
        args.model,
        dtype="float32",
        max_model_len=512,
        gpu_memory_utilization=0.3,
        seed=0,
    )
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    prompts = ['The "for" statement', "A class", "Exceptions"]
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    # a prompt given as token ids (vLLM's TokensPrompt), and one params per prompt
    ids = outputs[0].prompt_token_ids
    outputs += llm.generate(
        [{"prompt_token_ids": ids}, "The"],
        [
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=16, stop=["\n"]),
        ],
        use_tqdm=False,
    )
    # sampled, seeded: reproducible within an engine, not across engines
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=1, max_tokens=8)
    outputs += llm.generate(["The"], sampled, use_tqdm=False)
    rows = []
    for o in outputs:
        c = o.outputs[0]
        rows.append(
            {
                "prompt": o.prompt,
                "prompt_token_ids": list(o.prompt_token_ids),
                "text": c.text,
                "token_ids": list(c.token_ids),
                "finish_reason": c.finish_reason,
            }
        )
        print(json.dumps(rows[-1]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"engine": args.engine, "outputs": rows}, f, indent=1)


if __name__ == "__main__":  # vLLM starts its engine in a process of its own (spawn)
    main()
