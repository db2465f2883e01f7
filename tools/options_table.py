"""Every option of `LLM(...)`, generated from the code: one table for the README and one
page of the book (book/options.md).

A row per option: its name, type, default, the chapter that declares it, what vLLM
calls it, and what it does (the comment the declaration carries). The options come
from three places, all read here: `LLM.__init__`'s own keywords, `EngineConfig`'s
fields (chapter 8), and the options later chapters declare (`minillm.registry.OPTIONS`:
a registry's option, or a field of an `@engine_options` dataclass).

    python tools/options_table.py          # rewrite the README's table and the page
    python tools/options_table.py --check  # fail if either is out of date (make check)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

README = ROOT / "README.md"
PAGE = ROOT / "book" / "options.md"
BEGIN, END = "<!-- options:begin -->", "<!-- options:end -->"

# minillm's name -> vLLM's (EngineArgs, vllm/engine/arg_utils.py), where they differ
# or where vLLM has no such option ("-": a course knob with no counterpart)
VLLM_NAMES = {
    "num_kv_blocks": "num_gpu_blocks_override",
    "cpu_kv_cache_bytes": "kv_cache_memory_bytes",
    "prefix_cache_impl": "enable_prefix_caching",
    "preemption_mode": "- (v1 recomputes)",
    "attention_backend": "attention_config.backend",
    "persistent_batch": "- (always on)",
    "sampler": "- (one sampler)",
    "num_cpu_blocks": "- (v0's swap_space)",
    "swap_space_bytes": "- (v0's swap_space, GiB)",
    "cuda_graphs": "enforce_eager (inverted)",
    "torch_compile": "compilation_config",
    "fused_sampling": "-",
    "overlap_masks": "-",
    "int4_group_size": "quantization config's group_size",
    "calibration_tokenizer": "- (offline, llm-compressor)",
    "calibration_samples": "- (offline, llm-compressor)",
    "calibration_seq_len": "- (offline, llm-compressor)",
    "quant_rotation": "- (offline, llm-compressor's SpinQuant)",
    "quant_rotation_seed": "- (offline)",
    "device": "- (the platform decides)",
}
GPTQ_LIKE = ("gptq_", "smoothquant_", "fp8_")  # offline tools' knobs in vLLM's world


def chapter_of(module_name: str) -> str:
    """The chapter that writes a module: its first `# %% chapters/...` marker."""
    source = Path(importlib.import_module(module_name).__file__).read_text()
    found = re.search(r"^# %% chapters/(\d\d)_", source, re.M)
    return found.group(1) if found else "?"


def field_comments(cls: type) -> dict[str, str]:
    """name -> the comment on a field's line, or the comment lines just above it."""
    comments, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if not line.startswith("    ") or line.startswith("     "):
            above = []  # the class's own level only: not a method's body
            continue
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# ").strip())
            continue
        field = re.match(r"(\w+)\s*:\s*[^=#]+(=[^#]*)?(#\s*(.*))?$", stripped)
        if field and not stripped.startswith(("def ", "class ", "@")):
            comments[field.group(1)] = " ".join([*above, field.group(4) or ""]).strip()
        above = []
    return comments


# LLM's own keywords that its docstring does not describe
LLM_DOCS = {
    "device": "where the model runs; None: CUDA if there is a GPU, else the CPU",
    "dtype": "the weights' dtype (a torch dtype or its name, or 'auto'); None: "
    "bfloat16 on a GPU, float32 on a CPU",
    "chat_template": "a Jinja chat template (text or a file) for LLM.chat, in place "
    "of the tokenizer's",
}


def docstring_items(doc: str) -> dict[str, str]:
    """`name: text` paragraphs of a docstring, joined into one line each."""
    items, name = {}, None
    for line in inspect.cleandoc(doc or "").splitlines():
        found = re.match(r"(\w+): (.*)", line)
        if found:
            name, items[found.group(1)] = found.group(1), found.group(2)
        elif name and line.strip():
            items[name] += " " + line.strip()
        else:
            name = None
    return items


def llm_rows() -> list[dict]:
    from minillm.llm import LLM

    docs = {**LLM_DOCS, **docstring_items(LLM.__doc__)}
    rows = []
    for p in inspect.signature(LLM.__init__).parameters.values():
        if p.name == "self" or p.kind is p.VAR_KEYWORD:
            continue
        rows.append(row(p.name, p.annotation, p.default, "08", docs.get(p.name, "")))
    return rows


def row(name, kind, default, chapter, doc) -> dict:
    vllm = VLLM_NAMES.get(name)
    if vllm is None:
        vllm = "- (offline, llm-compressor)" if name.startswith(GPTQ_LIKE) else name
    kind = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    return dict(name=name, type=kind, default=repr(default), chapter=chapter,
                vllm=vllm, doc=doc)  # fmt: skip


def config_rows() -> list[dict]:
    from minillm.config import EngineConfig

    docs = field_comments(EngineConfig)
    return [
        row(f.name, f.type, f.default, "08", docs.get(f.name, ""))
        for f in dataclasses.fields(EngineConfig)
        if f.name != "options"
    ]


def declared_rows() -> list[dict]:
    """The options later chapters declare: registries' and @engine_options sets'."""
    from minillm.registry import OPTIONS, OWNERS, REGISTRIES, load_plugins

    load_plugins()
    rows = {}
    for reg in REGISTRIES:
        names = ", ".join(repr(n) for n in reg.parts)
        auto = "" if reg.auto is None or not isinstance(reg.auto, str) else "'auto', "
        doc = f"which {reg.kind}: {auto}{names}"
        kinds = {type(n).__name__ for n in [*reg.parts, OPTIONS[reg.option]]}
        kind = " | ".join(
            sorted(kinds - {"NoneType"}) + ["None"] * ("NoneType" in kinds)
        )
        rows[reg.option] = row(reg.option, kind, OPTIONS[reg.option], "08", doc)
    for module_name in sorted(set(OWNERS.values()) - {"minillm.registry"}):
        module = importlib.import_module(module_name)
        for cls in vars(module).values():
            if not (dataclasses.is_dataclass(cls) and isinstance(cls, type)):
                continue
            names = [f.name for f in dataclasses.fields(cls)]
            if cls.__module__ != module_name or not names:
                continue
            if not all(OWNERS.get(n) == module_name for n in names):
                continue
            docs, chapter = field_comments(cls), chapter_of(module_name)
            for f in dataclasses.fields(cls):
                rows[f.name] = row(f.name, f.type, OPTIONS[f.name], chapter,
                                   docs.get(f.name, ""))  # fmt: skip
    missing = sorted(set(OPTIONS) - set(rows))
    if missing:
        raise SystemExit(f"options_table: no declaration found for {missing}")
    return sorted(rows.values(), key=lambda r: (r["chapter"], r["name"]))


def table() -> str:
    rows = [*llm_rows(), *config_rows(), *declared_rows()]
    bare = [f"{r['name']} (chapter {r['chapter']})" for r in rows if not r["doc"]]
    if bare:  # a declaration says what its option does, on its line or just above
        raise SystemExit("options_table: undocumented option(s): " + ", ".join(bare))
    lines = [
        "| option | type | default | chapter | vLLM | what it does |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [f"`{r['name']}`", f"`{r['type']}`", f"`{r['default']}`",
                 r["chapter"], r["vllm"], r["doc"]]  # fmt: skip
        # a | inside a cell, code spans included, is written \| (GFM tables)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def page(text: str) -> str:
    return (
        "# Every option of `LLM(...)`\n\n"
        "Generated by `tools/options_table.py` from the code (`make tangle` rewrites "
        "it): `LLM`'s own keywords, `EngineConfig`'s fields, and the options each "
        "later chapter declares with `engine_options` or a registry. Pass any of them "
        "as a keyword: `LLM(model, max_num_seqs=64, cuda_graphs=False)`. A misspelt "
        "keyword is a `TypeError` that names the closest option.\n\n" + text
    )


def readme(current: str, text: str) -> str:
    if BEGIN not in current or END not in current:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} block")
    head, rest = current.split(BEGIN, 1)
    return head + BEGIN + "\n" + text + END + rest.split(END, 1)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    text = table()
    wanted = {README: readme(README.read_text(), text), PAGE: page(text)}
    stale = [p for p, t in wanted.items() if not p.exists() or p.read_text() != t]
    if args.check:
        if stale:
            names = ", ".join(str(p.relative_to(ROOT)) for p in stale)
            raise SystemExit(f"{names} out of date: run python tools/options_table.py")
        return
    for p in stale:
        p.write_text(wanted[p])
        print(f"wrote {p.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
