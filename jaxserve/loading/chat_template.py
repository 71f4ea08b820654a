"""Chat templates, rendered exactly as transformers' `apply_chat_template(..., tokenize=False)` renders them.

A template is the model's own jinja2 program (tokenizer_config.json's `chat_template`,
chat_template.jinja, or a GGUF's `tokenizer.chat_template`), so it is untrusted code: it runs in
jinja2's ImmutableSandboxedEnvironment, with transformers' settings (trim_blocks, lstrip_blocks, loop
controls) and extras (`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text and does
not escape HTML, a `namespace` that refuses underscore names). The variables are the conversation as
plain JSON data, `add_generation_prompt`, `tools`, `documents`, the tokenizer's special tokens
(`bos_token`, `eos_token`, ...) and any extra keyword arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# transformers marks the end of a message to continue with this, then cuts the render there.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# What render_chat's callers pass it themselves: a template variable of the same name would be passed twice.
OWN_ARGUMENTS = ("tokenizer", "messages", "chat_template", "add_generation_prompt", "continue_final_message", "tools")
# A template has one of these; a value with none of them is a file name (vLLM's rule for --chat-template).
JINJA_CHARACTERS = "{}\n"


def read_chat_template(value: str | os.PathLike, option: str, names: list[str] | tuple[str, ...] = ()) -> str:
    """A chat template given as a file holding one or as the template itself (vLLM's --chat-template): the
    file's text when `value` opens as a file, else `value` itself when it reads as a template. A value
    that is neither (a file name that does not open: a typo, a missing mount) is a ValueError naming
    `option` and the path, never a "template" that renders the path; `names`: the model's own named
    templates, for the message."""
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{option} must be a jinja template or a file holding one, got {value!r}")
    try:
        with open(value) as f:
            return f.read()
    except (OSError, ValueError) as error:  # ValueError: a template with a NUL character is no file name
        if isinstance(value, str) and any(character in value for character in JINJA_CHARACTERS):
            return value
        named = f", nor one of the model's templates {sorted(names)}" if names else ""
        raise ValueError(
            f"{option} {os.fspath(value)!r} is not a template (it has no '{{', '}}' or newline){named}, and "
            f"cannot be opened as a file: {error}"
        ) from None


def chat_template_argument(tokenizer, value: str | os.PathLike | None, option: str = "chat_template") -> str | None:
    """LLM.chat's chat_template=: None (the model's own), the name of one of the model's templates (kept:
    select_chat_template picks it), a template, or a file holding one (read here)."""
    own = getattr(tokenizer, "chat_template", None)
    names = tuple(own) if isinstance(own, dict) else ()
    if value is None or value in names:
        return value  # type: ignore[return-value]
    return read_chat_template(value, option, names)


def select_chat_template(tokenizer, chat_template: str | None, tools) -> tuple[str, str | None]:
    """(template text, where it came from): a named template of the model's, the model's default, or
    chat_template itself as a template. ValueError when the model has none and none is given."""
    own: str | dict[str, str] | None = getattr(tokenizer, "chat_template", None)
    source: str | None = getattr(tokenizer, "chat_template_source", None)
    if isinstance(own, dict):
        if chat_template is not None and chat_template in own:
            return own[chat_template], f"{source} (template {chat_template!r})"
        if chat_template is None:
            name = "tool_use" if tools is not None and "tool_use" in own else "default"
            if name not in own:
                raise ValueError(
                    f"{source} names chat templates {sorted(own)} but none is 'default'; "
                    f"pass chat_template=<name or template>"
                )
            return own[name], f"{source} (template {name!r})"
    if chat_template is not None:
        return chat_template, "the chat_template argument"
    if own is None:
        raise ValueError(
            "this model has no chat template (no chat_template in tokenizer_config.json, no "
            "chat_template.jinja, none in the GGUF); pass chat_template=<a jinja template>"
        )
    assert not isinstance(own, dict)  # named templates returned or raised above
    return own, source


def render_chat(
    tokenizer,
    messages: list,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list | None = None,
    documents: list | None = None,
    **template_kwargs,
) -> str:
    """One conversation (a list of {"role", "content", ...} messages) as the model's prompt text.

    Raises ValueError naming the template's source when the template fails (including its own
    raise_exception, e.g. on roles out of order)."""
    if not messages:
        raise ValueError("cannot render an empty conversation: give at least one message")
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message and add_generation_prompt are exclusive: one continues the last "
            "message, the other starts a new assistant message"
        )
    template, source = select_chat_template(tokenizer, chat_template, tools)
    # text parts stay a list for a template that loops over them (vLLM's "openai" content format), else joined
    messages = text_content(messages, join_parts=not loops_over_content(template))
    messages = _alias_reasoning_fields([_drop_none(m) for m in plain_data(messages)])
    if any(not isinstance(m, dict) for m in messages):
        raise ValueError("chat messages must be dicts like {'role': 'user', 'content': '...'}")
    final_message = None
    if continue_final_message:
        content = messages[-1].get("content")
        # a list of parts (a template that loops over them) continues its last text part, as transformers does
        parts = (
            [p for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
            if isinstance(content, list)
            else []
        )
        final_message = parts[-1]["text"] if parts else content
        if not isinstance(final_message, str):
            raise ValueError("continue_final_message needs a final message with text content")
        if parts:
            parts[-1]["text"] = final_message + CONTINUE_TAG
        else:
            messages[-1]["content"] = final_message + CONTINUE_TAG
    variables = (
        {**tokenizer.special_tokens, **plain_data(template_kwargs)}
        if tokenizer is not None
        else plain_data(template_kwargs)
    )
    try:
        rendered = _compile(template).render(
            messages=messages,
            tools=plain_data(tools),
            documents=plain_data(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except Exception as error:  # templates are untrusted programs: any failure is the template's, reported as such
        raise ValueError(f"chat template from {source} failed: {type(error).__name__}: {error}") from None
    if final_message is not None:
        rendered = _cut_at_continue_tag(rendered, final_message, source)
    return rendered


def template_variables(chat_template_kwargs) -> dict:
    """An API's chat_template_kwargs (extra template variables, as vLLM's), as keyword arguments of
    render_chat; ValueError for anything else, or a name render_chat is given by its own argument."""
    if chat_template_kwargs is None:
        return {}
    if not isinstance(chat_template_kwargs, dict) or not all(isinstance(k, str) for k in chat_template_kwargs):
        raise ValueError("chat_template_kwargs must be a mapping of variable names to values")
    for name in OWN_ARGUMENTS:
        if name in chat_template_kwargs:
            raise ValueError(
                f"chat_template_kwargs may not set {name!r}: the chat is rendered with its own "
                f"(set it as the request's field or LLM.chat's argument of that name)"
            )
    return dict(chat_template_kwargs)


def text_content(messages: list, join_parts: bool = True) -> list:
    """Messages whose content is OpenAI-style text parts ([{"type": "text", "text": ...}]) with the parts
    joined into one string, as vLLM gives templates that take content as a string (join_parts False: left as
    parts). ValueError for any other part (an image, audio): every model served is a text model (a multimodal
    checkpoint's vision tower is not loaded)."""
    flattened = []
    for position, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for index, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") != "text":
                raise ValueError(
                    f"messages[{position}].content[{index}] is a {part.get('type')!r} part: only text is "
                    f"accepted (this server serves text models; a multimodal checkpoint's vision tower is not loaded)"
                )
        if (
            join_parts
            and isinstance(content, list)
            and all(isinstance(p, dict) and p.get("type") == "text" for p in content)
        ):
            message = {**message, "content": "\n".join(str(p.get("text", "")) for p in content)}
        flattened.append(message)
    return flattened


# Nesting plain_data follows (a request's messages and tools are JSON): deeper data is refused with a ValueError
# rather than running into Python's recursion limit (an HTTP 500 before).
MAX_NESTING = 128


def plain_data(value, depth: int = 0) -> Any:
    """JSON-like data only: the sandbox cannot know which methods of a caller's objects are dangerous."""
    if depth > MAX_NESTING:
        raise ValueError(f"chat data (messages, tools, template variables) nested deeper than {MAX_NESTING} levels")
    if value is None or type(value) in (str, int, float, bool):
        return value
    # subclasses (enums, numpy floats) carry extra methods: back to the base type
    if isinstance(value, str):
        return str.__str__(value)
    for base in (int, float):
        if isinstance(value, base):
            return base(value)
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():  # numpy scalars, np.bool_ too
        return plain_data(value.item(), depth)
    if isinstance(value, dict):
        return {plain_data(k, depth + 1): plain_data(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain_data(v, depth + 1) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)}
    model_dump = getattr(value, "model_dump", None)
    if callable(model_dump):  # pydantic models, as the OpenAI SDK returns them
        return plain_data(model_dump(), depth)
    return f"<{type(value).__name__}>"


def _drop_none(message):
    """APIs send content=None or tool_calls=None; templates handle a missing key, not a None. A None content
    (an assistant turn of tool calls, as the OpenAI SDK sends it back) becomes "", as vLLM renders it: templates
    that read message['content'] unconditionally (SmolLM2's) raised on the missing key."""
    if not isinstance(message, dict):
        return message
    return {k: ("" if v is None else v) for k, v in message.items() if v is not None or k == "content"}


def _alias_reasoning_fields(messages: list) -> list:
    aliased = []
    for message in messages:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        aliased.append(
            {"thinking": reasoning, **message, "reasoning_content": reasoning} if reasoning is not None else message
        )
    return aliased


def _cut_at_continue_tag(rendered: str, final_message: str, source: str | None) -> str:
    if final_message.strip() not in rendered or CONTINUE_TAG.strip() not in rendered:
        raise ValueError(
            f"continue_final_message: the chat template from {source} does not render the final "
            f"message as given, so it cannot be continued"
        )
    at = rendered.rindex(CONTINUE_TAG.strip())
    if rendered[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore names that could reach Python internals."""

    def __init__(*args, **kwargs):  # noqa: N805  (jinja's own signature trick, so namespace(self=...) works)
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without the type's other attributes."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_string):
    return datetime.now().strftime(format_string)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


@functools.lru_cache(maxsize=16)
def loops_over_content(template: str) -> bool:
    """Whether the template iterates over a message's content (`{% for part in message['content'] %}`, also
    through a variable set from it or a filter on it): such templates (Gemma 3, Llama 4, Mistral 3, Qwen-VL) take
    OpenAI's list of parts, which vLLM (its "openai" content format) and transformers pass them unchanged."""
    try:
        tree = _environment().parse(template)
    except jinja2.TemplateError:
        return False  # rendering reports it

    def reads_content(node) -> bool:
        while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
            node = node.node
        if isinstance(node, jinja2.nodes.Getattr):
            return node.attr == "content"
        return (
            isinstance(node, jinja2.nodes.Getitem)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == "content"
        )

    content_names = {
        target.name
        for assign in tree.find_all(jinja2.nodes.Assign)
        if reads_content(assign.node)
        for target in ([assign.target] if isinstance(assign.target, jinja2.nodes.Name) else [])
    }
    return any(
        reads_content(loop.iter) or (isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name in content_names)
        for loop in tree.find_all(jinja2.nodes.For)
    )


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(), namespace=_TemplateNamespace
    )
    return environment


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    return _environment().from_string(template)


def template_messages(messages: list) -> list:
    """Messages as chat templates expect them: an assistant's tool_calls with their arguments as objects
    (OpenAI sends JSON text; templates write them with tojson), as vLLM and transformers pass them."""
    converted = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list):
            message = {**message, "tool_calls": [_call_for_template(call) for call in calls]}
        converted.append(message)
    return converted


def _call_for_template(call):
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except (json.JSONDecodeError, RecursionError):  # RecursionError: nested past Python's stack
        raise ValueError(
            f"a tool call's function.arguments is not JSON (or is nested too deeply): {function['arguments'][:80]!r}"
        ) from None
    return {**call, "function": {**function, "arguments": arguments}}
