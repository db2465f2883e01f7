"""vLLM's `LLM` entry points beyond generate (chapter 10): chat with the tokenizer's
chat template (or a given one), get_tokenizer, llm_engine, and the pooling methods
that a generative engine refuses.
"""

import json

import pytest

from minillm.llm import LLM, PoolingNotSupportedError, render_chat
from minillm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TEMPLATE = (
    "{{ bos_token }}{% if tools %}[tools]{{ tools | tojson }}\n{% endif %}"
    "{% if documents %}[docs]{{ documents | map(attribute='title') | join(',') }}\n"
    "{% endif %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city, ünïcödé kept",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
            },
        },
    }
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Write a loop."},
]
BEGUN = CHAT + [{"role": "assistant", "content": "for i in"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", chat_template=TEMPLATE)


def test_chat_renders_then_encodes_without_special_tokens(llm):
    out = llm.chat(CHAT, GREEDY, use_tqdm=False)
    (one,) = out
    tok = llm.get_tokenizer()
    text = f"{tok.bos_token}<system>Be brief.</s>\n<user>Write a loop.</s>\n<assistant>"
    assert one.prompt == text
    # the template writes BOS itself: encoding must not add a second one
    assert one.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    assert one.prompt_token_ids.count(tok.bos_token_id) == 1
    alone = llm.generate({"prompt_token_ids": one.prompt_token_ids}, GREEDY)
    assert one.outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_chat_batch_keeps_order_and_matches_single(llm):
    chats = [CHAT, [{"role": "user", "content": "Hi"}], CHAT]
    outs = llm.chat(chats, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == [
        render_chat(llm.tokenizer, c, TEMPLATE) for c in chats
    ]
    single = llm.chat(chats[1], GREEDY, use_tqdm=False)[0]
    assert outs[1].outputs[0].token_ids == single.outputs[0].token_ids
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_template_options(llm):
    tok = llm.tokenizer
    plain = render_chat(tok, CHAT, TEMPLATE, add_generation_prompt=False)
    assert plain.endswith("<user>Write a loop.</s>\n")
    kept_open = render_chat(
        tok, BEGUN, TEMPLATE, add_generation_prompt=False, continue_final_message=True
    )
    assert kept_open == plain + "<assistant>for i in"
    out = llm.chat(
        BEGUN,
        GREEDY,
        use_tqdm=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )[0]
    assert out.prompt == kept_open
    with_tools = llm.chat(CHAT, GREEDY, use_tqdm=False, tools=TOOLS)[0].prompt
    assert f"[tools]{json.dumps(TOOLS, ensure_ascii=False)}\n" in with_tools
    docs = [{"title": "a", "text": "x"}, {"title": "b", "text": "y"}]
    with_docs = llm.chat(
        CHAT, GREEDY, use_tqdm=False, chat_template_kwargs={"documents": docs}
    )[0].prompt
    assert "[docs]a,b\n" in with_docs
    other = llm.chat(CHAT, GREEDY, use_tqdm=False, chat_template="{{ 'x' }}")[0]
    assert other.prompt == "x"
    parts = [{"type": "text", "text": "Write"}, {"type": "text", "text": "a loop."}]
    joined = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)
    assert "<user>Write\na loop.</s>" in joined[0].prompt


def test_render_chat_equals_transformers():
    """The same template, conversations and options through transformers' renderer,
    which vLLM's chat uses."""
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    llm_tok = LLM(device="cpu").tokenizer
    special = {"bos_token": llm_tok.bos_token, "eos_token": llm_tok.eos_token}
    docs = [{"title": "a", "text": "x"}]
    cases = [
        (CHAT, {"add_generation_prompt": True}),
        (CHAT, {"add_generation_prompt": False, "tools": TOOLS}),
        (BEGUN, {"continue_final_message": True, "documents": docs}),
    ]
    for conversation, options in cases:
        (expected,), _ = chat_template_utils.render_jinja_template(
            [conversation], chat_template=TEMPLATE, **options, **special
        )
        options = {"add_generation_prompt": False, **options}
        assert render_chat(llm_tok, conversation, TEMPLATE, **options) == expected


def test_smollm2_template_equals_transformers():
    convert = pytest.importorskip("minillm.convert")
    pytest.importorskip("gguf")
    try:
        folder = convert.resolve_model("smollm2")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    from transformers import AutoTokenizer

    from minillm.tokenizer import Tokenizer

    ours, theirs = (
        Tokenizer.from_pretrained(folder),
        AutoTokenizer.from_pretrained(folder),
    )
    for conversation, options in [
        (CHAT, {"add_generation_prompt": True}),
        ([{"role": "user", "content": "Hi 🙂"}], {"add_generation_prompt": True}),
        (BEGUN, {"add_generation_prompt": False, "continue_final_message": True}),
        (CHAT, {"add_generation_prompt": True, "tools": TOOLS}),
    ]:
        text = theirs.apply_chat_template(conversation, tokenize=False, **options)
        assert render_chat(ours, conversation, **options) == text
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs(text, add_special_tokens=False)["input_ids"]


def test_chat_errors_change_nothing(llm):
    engine = llm.llm_engine
    no_template = LLM(device="cpu")
    assert no_template.get_tokenizer().chat_template is None
    with pytest.raises(ValueError, match="chat template"):
        no_template.chat(CHAT, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(BEGUN, GREEDY, use_tqdm=False, continue_final_message=True)
    with pytest.raises(ValueError, match="template"):
        llm.chat(CHAT, GREEDY, chat_template="{{ raise_exception('no system') }}")
    with pytest.raises(ValueError, match="tools"):
        llm.chat(CHAT, GREEDY, tools=[print])
    with pytest.raises(ValueError, match="lora_request"):
        llm.chat(CHAT, GREEDY, lora_request=object())
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.chat(CHAT, GREEDY, chat_template_content_format="html")
    with pytest.raises(ValueError, match="images"):
        llm.chat([{"role": "user", "content": [{"type": "image_url"}]}], GREEDY)
    # a bad conversation in a batch submits none of them
    with pytest.raises(ValueError):
        llm.chat([CHAT, BEGUN], GREEDY, continue_final_message=True)
    assert not engine.has_unfinished_requests() and not engine.output_processor.parents


def test_chat_template_from_a_file(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}|{% endfor %}")
    llm = LLM(device="cpu", chat_template=path)
    assert (
        llm.chat(CHAT, GREEDY, use_tqdm=False)[0].prompt == "Be brief.|Write a loop.|"
    )
    with pytest.raises(ValueError, match="no such file"):
        LLM(device="cpu", chat_template=tmp_path / "missing.jinja")


def test_get_tokenizer_and_llm_engine(llm):
    assert llm.get_tokenizer() is llm.tokenizer
    assert llm.llm_engine is llm.engine
    ids = llm.get_tokenizer().encode("The")
    assert llm.llm_engine.tokenizer.decode(ids) == "The"


@pytest.mark.parametrize("name", ["encode", "embed", "classify", "score"])
def test_pooling_methods_say_what_vllm_does(llm, name):
    with pytest.raises(NotImplementedError, match="pooling") as info:
        getattr(llm, name)("The")
    # vLLM raises ValueError for these on a generative model: both catch it
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, PoolingNotSupportedError)
    assert f"LLM.{name}()" in str(info.value)


def test_generate_takes_vllm_keywords(llm):
    with pytest.raises(ValueError, match="lora_request"):
        llm.generate("The", GREEDY, lora_request=object())
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["a", "b", "c"], GREEDY, priority=[0, 1])
    assert not llm.engine.output_processor.parents
    text = llm.generate({"prompt": "The"}, GREEDY, use_tqdm=False)[0]
    ids = llm.generate({"prompt_token_ids": text.prompt_token_ids}, GREEDY)[0]
    assert text.prompt == "The" and ids.prompt is None
    assert text.outputs[0].token_ids == ids.outputs[0].token_ids
