"""Conversations as prompt token ids, for both APIs (gRPC Chat, OpenAI /v1/chat/completions).

The same steps as LLM.chat: loading/chat_template.py renders the messages (OpenAI text parts
joined), and the text is tokenized without adding special tokens, since the template writes its own
BOS. The messages' text is held to server.max_prompt_bytes before the template, an untrusted
program, runs over it.
"""

from __future__ import annotations

from jaxserve.loading.chat_template import read_chat_template, render_chat, template_variables, text_content
from jaxserve.loading.tokenizer import check_unicode
from jaxserve.server import limits as request_limits
from jaxserve.server.limits import RequestLimits


def load_chat_template(value: str | None) -> str | None:
    """server.chat_template: a file holding a jinja template, or the template itself (as vLLM's
    --chat-template); None: the model's own. A value with no '{', '}' or newline that does not open as a
    file is a ValueError naming the option and the path (not a template that renders the path)."""
    return None if value is None else read_chat_template(value, "server.chat_template")


def message_text(messages: list) -> str:
    """All the text a conversation carries (string contents and text parts), for the size check;
    ValueError naming a message without a string role (as vLLM's message types: any role name, but one), or whose
    role or content is not valid Unicode."""
    texts = []
    for position, message in enumerate(text_content(messages)):
        if not isinstance(message, dict):
            raise ValueError("chat messages must be objects like {'role': 'user', 'content': '...'}")
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise ValueError(
                f"messages[{position}].role must be a role name such as 'user', got {message.get('role')!r}"
            )
        for field in ("role", "content"):
            texts.append(str(message.get(field) or ""))
            check_unicode(texts[-1], f"messages[{position}].{field}")
    return "".join(texts)


def chat_prompt_token_ids(
    tokenizer,
    limits: RequestLimits,
    messages: list,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """The prompt's token ids; ValueError for messages over the limits, a model without a tokenizer or
    a template, or a template that fails."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so it cannot render chats")
    request_limits.check_text(limits, message_text(messages), "the messages")
    text = render_chat(
        tokenizer,
        messages,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=tools,
        **template_variables(template_kwargs),
    )
    request_limits.check_text(limits, text, "the rendered chat")  # tools and template variables are in it
    return tokenizer.encode(text, add_special_tokens=False)
