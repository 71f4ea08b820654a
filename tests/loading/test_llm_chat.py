"""LLM.chat on a fixture model: the rendered template is the prompt, tokenized without an extra BOS;
template errors leave the engine untouched. (The default model's test covers a model's own template.)"""

import pytest

from jaxserve import SamplingParams

TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}bot:{% endif %}"
)


def test_chat_renders_then_generates(llama_llm):
    tokenizer = llama_llm.get_tokenizer()
    conversations = [
        [{"role": "user", "content": "def forward(self, x):"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Return a new dict"}],
    ]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    outputs = llama_llm.chat(conversations, params, chat_template=TEMPLATE)
    assert [o.prompt for o in outputs] == [
        "user: def forward(self, x):\nbot:",
        "system: Be brief.\nuser: Return a new dict\nbot:",
    ]
    for output in outputs:
        token_ids = tokenizer.encode(output.prompt, add_special_tokens=False)
        assert output.prompt_token_ids == token_ids and token_ids[0] != tokenizer.bos_token_id
        assert output.outputs[0].token_ids == llama_llm.generate([token_ids], params)[0].outputs[0].token_ids
    single = llama_llm.chat(conversations[0], params, chat_template=TEMPLATE, add_generation_prompt=False)
    assert single[0].prompt == "user: def forward(self, x):\n"


def test_chat_errors_leave_the_engine_idle(llama_llm):
    with pytest.raises(ValueError, match="no chat template"):
        llama_llm.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="refused"):
        llama_llm.chat(
            [[{"role": "user", "content": "fine"}], [{"role": "user", "content": "bad"}]],
            chat_template="{% if messages[0].content == 'bad' %}{{ raise_exception('refused') }}{% endif %}",
        )
    assert not llama_llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "name", ["messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template", "tokenizer"]
)
def test_template_kwargs_may_not_set_the_chats_own_arguments(llama_llm, name):
    with pytest.raises(ValueError, match=f"chat_template_kwargs may not set '{name}'"):
        llama_llm.chat([{"role": "user", "content": "hi"}], chat_template=TEMPLATE, chat_template_kwargs={name: None})
    rendered = llama_llm.chat(
        [{"role": "user", "content": "hi"}],
        SamplingParams(max_tokens=1),
        chat_template=TEMPLATE + "{{ mode }}",
        chat_template_kwargs={"mode": "!"},
    )
    assert rendered[0].prompt == "user: hi\nbot:!"


def test_a_lone_surrogate_is_a_value_error_naming_it(llama_llm):
    """Valid JSON ("\\ud800") but no Unicode: the tokenizer refuses it by name, not with its native error."""
    with pytest.raises(ValueError, match="lone UTF-16 surrogate"):
        llama_llm.generate(["fine", "bad \ud800"], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="lone UTF-16 surrogate"):
        llama_llm.chat([{"role": "user", "content": "\udc00"}], chat_template=TEMPLATE)
    assert not llama_llm.engine.has_unfinished_requests()


def test_past_tool_calls_reach_the_template_with_their_arguments_as_objects(llama_llm):
    """As the servers pass them (tool_choice.template_messages, vLLM and transformers alike): a template writing
    `arguments | tojson` got a JSON string of the JSON text from LLM.chat."""
    template = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}"
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    output = llama_llm.chat(conversation, SamplingParams(max_tokens=1), chat_template=template)[0]
    assert output.prompt == '{"city": "Paris"}'
