"""Chat templates render as transformers' apply_chat_template(..., tokenize=False) does (recorded by
tests/support/record_tokenizers.py), sandboxed, with clear errors."""

import copy
import os
from datetime import datetime

import pytest

from jaxserve.loading.chat_template import (
    chat_template_argument,
    loops_over_content,
    read_chat_template,
    render_chat,
    text_content,
)
from tests.loading.test_tokenizer import FAST_TOKENIZERS, load, recorded


@pytest.mark.parametrize("name", FAST_TOKENIZERS)
def test_render_matches_transformers(name):
    tokenizer = load(name)
    for case in recorded(name)["chats"]:
        options = {k: case[k] for k in ("add_generation_prompt", "tools", "continue_final_message") if k in case}
        if case["text"] is None:
            with pytest.raises(ValueError, match="raise|failed"):
                render_chat(tokenizer, case["messages"], **options)
        else:
            assert render_chat(tokenizer, case["messages"], **options) == case["text"], case


def test_the_template_comes_from_the_model_or_the_caller():
    tokenizer = load("llama_metaspace")
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(tokenizer, messages) == "<s>[INST] hi [/INST]"
    assert render_chat(tokenizer, messages, chat_template="{{ bos_token }}|{{ messages[0].content }}") == "<s>|hi"
    with pytest.raises(ValueError, match="no chat template"):
        render_chat(load("sentencepiece"), messages)
    assert render_chat(load("sentencepiece"), messages, chat_template="{{ eos_token }}") == "</s>"


def test_a_template_option_is_a_template_a_file_or_a_clear_error(tmp_path):
    """server.chat_template / LLM.chat(chat_template=...): a path that does not open was used as the template
    itself, so every chat prompt became the path's text; as vLLM's --chat-template, a value with no '{', '}' or
    newline is a file name, and one that does not open is refused naming the option and the path."""
    from jaxserve.server.chat_prompt import load_chat_template

    template = "{{ bos_token }}|{{ messages[0].content }}"
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    assert load_chat_template(str(path)) == template and load_chat_template(template) == template
    assert load_chat_template("{% for m in messages %}x{% endfor %}") and load_chat_template(None) is None
    for missing in ("/etc/jaxserve/chat_tmpl.jinja", "chat.jinja", str(tmp_path)):
        with pytest.raises(ValueError, match=f"server.chat_template '{missing}' is not a template.*cannot be opened"):
            load_chat_template(missing)
    assert read_chat_template(path, "chat_template") == template  # a pathlib.Path too
    tokenizer = load("llama_metaspace")
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(tokenizer, messages, chat_template=chat_template_argument(tokenizer, str(path))) == "<s>|hi"
    with pytest.raises(ValueError, match="chat_template 'no/such.jinja' is not a template"):
        chat_template_argument(tokenizer, "no/such.jinja")


def test_a_template_option_may_name_one_of_the_models_templates():
    tokenizer = copy.copy(load("llama_metaspace"))  # load() is cached: the copy's template is this test's
    tokenizer.chat_template = {"default": "D{{ messages[0].content }}", "tool_use": "T{{ messages[0].content }}"}
    messages = [{"role": "user", "content": "hi"}]
    assert chat_template_argument(tokenizer, "tool_use") == "tool_use"
    assert render_chat(tokenizer, messages, chat_template=chat_template_argument(tokenizer, "tool_use")) == "Thi"
    with pytest.raises(
        ValueError, match=r"'tool_usee' is not a template .*nor one of the model's templates \['default'"
    ):
        chat_template_argument(tokenizer, "tool_usee")


def test_template_failures_name_the_template_and_the_problem():
    tokenizer = load("llama_metaspace")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json.*Conversation roles must alternate"):
        render_chat(tokenizer, [{"role": "assistant", "content": "first"}])
    with pytest.raises(ValueError, match="chat_template argument.*TemplateSyntaxError"):
        render_chat(tokenizer, [{"role": "user", "content": "x"}], chat_template="{% for %}")
    with pytest.raises(ValueError, match="empty conversation"):
        render_chat(tokenizer, [])
    with pytest.raises(ValueError, match="exclusive"):
        render_chat(tokenizer, [{"role": "user", "content": "x"}], continue_final_message=True)


def test_templates_are_sandboxed():
    tokenizer = load("qwen_byte_level")
    messages = [{"role": "user", "content": "x"}]
    for escape in (
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
        "{{ messages.append(1) }}",
    ):
        with pytest.raises(ValueError, match="SecurityError"):
            render_chat(tokenizer, messages, chat_template=escape)

    class Secret:
        def dangerous(self):
            raise AssertionError("a template reached a caller's object")

    rendered = render_chat(
        tokenizer, [{"role": "user", "content": "x", "extra": Secret()}], chat_template="{{ messages[0].extra }}"
    )
    assert rendered == "<Secret>"


def test_transformers_extras():
    tokenizer = load("qwen_byte_level")
    messages = [{"role": "user", "content": "é<b>"}]
    assert (
        render_chat(tokenizer, messages, chat_template="{{ messages[0] | tojson }}")
        == '{"role": "user", "content": "é<b>"}'
    )
    assert render_chat(tokenizer, messages, chat_template="{{ strftime_now('%Y') }}") == str(datetime.now().year)
    loop = "{% for m in [1, 2, 3] %}{% if m == 2 %}{% break %}{% endif %}{{ m }}{% endfor %}"
    assert render_chat(tokenizer, messages, chat_template=loop) == "1"
    blocks = "{% if true %}\n  {{ eos_token }}\n{% endif %}\n"
    assert render_chat(tokenizer, messages, chat_template=blocks) == "  <|im_end|>\n"  # trim and lstrip blocks
    assert render_chat(tokenizer, messages, chat_template="{{ mode }}", mode="fast") == "fast"
    generation = "{% generation %}{{ messages[0].content }}{% endgeneration %}"
    assert render_chat(tokenizer, messages, chat_template=generation) == "é<b>"


def test_text_parts_are_joined_for_text_templates():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert text_content(messages) == [{"role": "user", "content": "a\nb"}]


def test_templates_that_loop_over_content_get_the_parts():
    """Gemma 3's template (as its tokenizer_config.json ships it) loops over a message's parts: it gets them as a
    list, as transformers passes them and vLLM's "openai" content format does (joined, the parts rendered
    "Hello \n world" and a system message's parts both, where the template takes the first part only); a template
    that reads content as text gets the parts joined. Expected: transformers 5.25's apply_chat_template."""
    tokenizer = load("llama_metaspace")
    with open(os.path.join(os.path.dirname(__file__), "fixtures", "gemma3_chat_template.jinja")) as f:
        gemma3 = f.read()
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": " world"}]
    system = [{"type": "text", "text": "Sys A"}, {"type": "text", "text": "Sys B"}]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": parts}]
    rendered = render_chat(tokenizer, messages, chat_template=gemma3, bos_token="<s>")
    assert rendered == "<s><start_of_turn>user\nSys A\n\nHelloworld<end_of_turn>\n<start_of_turn>model\n"
    assert loops_over_content(gemma3)
    text_only = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert not loops_over_content(text_only)
    assert render_chat(tokenizer, messages, chat_template=text_only) == "[Sys A\nSys B][Hello \n world]"
    # continuing a final message given as parts continues its last text part (transformers')
    started = [
        {"role": "user", "content": parts},
        {"role": "assistant", "content": [{"type": "text", "text": "Sure, "}]},
    ]
    continued = render_chat(
        tokenizer, started, chat_template=gemma3, add_generation_prompt=False, continue_final_message=True
    )
    assert continued.endswith("<start_of_turn>model\nSure,")
    through_a_variable = (
        "{% for m in messages %}{% set c = m.content %}{% for p in c %}{{ p.text }}|{% endfor %}{% endfor %}"
    )
    assert render_chat(tokenizer, messages[1:], chat_template=through_a_variable) == "Hello | world|"


def test_deeply_nested_chat_data_is_a_value_error():
    """A message nested 500 deep reached Python's recursion limit (an HTTP 500): now refused as bad input."""
    deep: list = []
    for _ in range(500):
        deep = [deep]
    with pytest.raises(ValueError, match="nested deeper than"):
        render_chat(load("qwen_byte_level"), [{"role": "user", "content": "hi", "x": deep}])
    shallow: list = []
    for _ in range(40):
        shallow = [shallow]
    assert render_chat(load("qwen_byte_level"), [{"role": "user", "content": "hi", "x": shallow}])


def test_a_none_content_renders_as_empty_text():
    """The OpenAI SDK sends an assistant turn of tool calls back with content None: a template that reads every
    message's content (SmolLM2's) gets "", as vLLM gives it, where the dropped key made it fail."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "4", "tool_call_id": "c1", "name": None},
    ]
    template = "{% for m in messages %}{{ m['role'] }}={{ m['content'] }};{{ m.name is defined }};{% endfor %}"
    rendered = render_chat(load("qwen_byte_level"), messages, chat_template=template, add_generation_prompt=False)
    assert rendered == "user=hi;False;assistant=;False;tool=4;False;"
