"""Build the tokenizer fixtures in tests/loading/fixtures and record transformers' behaviour on them.

Run once, when the fixtures need to change (needs transformers, not torch):

    .venv/bin/python -m tests.support.record_tokenizers

Three tokenizer.json vocabularies trained here with Hugging Face's `tokenizers`, each beside a
tokenizer_config.json with a chat template:
- qwen_byte_level: byte-level BPE split as Qwen2's tokenizer splits (NFC, its regex), ChatML template
  with tools, eos <|im_end|>, no BOS;
- smollm_byte_level: GPT-2-style byte-level BPE with single digits, SmolLM2's template, read verbatim
  (PreTrainedTokenizerFast);
- llama_metaspace: Llama-2-style metaspace BPE with byte fallback, BOS by post-processor, Llama-2's
  template (which raises on bad role order);
and the sentencepiece-only directory tests/fixtures/llama_gqa. For each, expected.json holds
transformers' encodings, decodes (with and without special tokens, over random ids too) and rendered
chat templates, so the suite compares against transformers without importing it.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(HERE, "loading", "fixtures")
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
SMOLLM_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\n<tools>" }}{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    "{{- \"\\n</tools><|im_end|>\\n\" }}{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- set ns = namespace(count=0) %}"
    "{%- for message in messages %}{%- if message.role == 'system' and loop.first %}{%- continue %}{%- endif %}"
    "{%- set ns.count = ns.count + 1 %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    "{%- if ns.count > 99 %}{{ strftime_now('%Y') }}{%- endif %}"
)
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)

TEXTS = [
    "Hello world",
    " Hello  world ",
    "def forward(self, x):\n    return x * 2\n",
    "héllo wörld — ünïcode ✓",
    "日本語のテキスト",
    "emoji 🙂🎉 and 👩‍👩‍👧",
    "numbers 12345 and 3.14159",
    "tabs\tand\n\nnewlines\r\n",
    "<|im_start|>user\nhi<|im_end|>",
    "<s>[INST] hi [/INST]</s>",
    "don't stop , they 're here .",
    "   ",
    "a",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there "},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Count: 1 2 3 — ✓"},
    ],
    [
        {"role": "user", "content": "日本語で?"},
        {"role": "assistant", "content": " 🙂 "},
        {"role": "user", "content": "<|im_end|> </s> text"},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city, °C",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def corpus() -> list[str]:
    import collections  # noqa: E401
    import functools
    import inspect
    import itertools
    import re
    import string

    lines = []
    for module in (collections, functools, itertools, re, string, inspect, os, json):
        for _, member in inspect.getmembers(module):
            doc = inspect.getdoc(member)
            if doc:
                lines.extend(line for line in doc.splitlines() if line.strip())
    return lines + TEXTS * 3 + ["日本語 テキスト ünïcode — ✓ 🙂"] * 5


CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BUILT = ("qwen_byte_level", "smollm_byte_level", "llama_metaspace")


def byte_level(
    name: str,
    split: pre_tokenizers.PreTokenizer,
    normalizer,
    config: dict,
    model_config: dict,
    generation_config: dict | None = None,
) -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = split
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=CHATML_SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    write(name, tokenizer, config, model_config, generation_config)


def llama_metaspace() -> None:
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    trained.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=600, show_progress=False))
    state = json.loads(trained.to_str())["model"]
    vocab = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    vocab += [token for token, _ in sorted(state["vocab"].items(), key=lambda kv: kv[1]) if token not in vocab]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tokenizer = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(vocab)},
            merges=merges,
            unk_token="<unk>",
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in vocab[:3]])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    config = dict(
        tokenizer_class="LlamaTokenizer",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        add_bos_token=True,
        add_eos_token=False,
        legacy=False,
        chat_template=LLAMA2_TEMPLATE,
    )
    write("llama_metaspace", tokenizer, config, dict(bos_token_id=1, eos_token_id=2))


def write(name: str, tokenizer: Tokenizer, config: dict, model_config: dict, generation_config=None) -> None:
    directory = os.path.join(FIXTURES, name)
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    for file_name, content in (
        ("tokenizer_config.json", config),
        ("config.json", model_config),
        ("generation_config.json", generation_config),
    ):
        if content is not None:
            with open(os.path.join(directory, file_name), "w") as f:
                json.dump(content, f, indent=1, ensure_ascii=False)


def build() -> None:
    specials = CHATML_SPECIALS
    byte_level(
        "qwen_byte_level",
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ),
        normalizers.NFC(),
        dict(
            tokenizer_class="Qwen2Tokenizer",
            bos_token=None,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            unk_token=None,
            chat_template=QWEN_TEMPLATE,
            clean_up_tokenization_spaces=False,
            added_tokens_decoder={
                str(i): dict(content=t, lstrip=False, normalized=False, rstrip=False, single_word=False, special=True)
                for i, t in enumerate(specials)
            },
        ),
        dict(eos_token_id=0),
        dict(eos_token_id=[2, 0]),
    )
    byte_level(
        "smollm_byte_level",
        pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        ),
        None,
        dict(
            tokenizer_class="PreTrainedTokenizerFast",
            bos_token="<|im_start|>",
            eos_token="<|im_end|>",
            unk_token="<|endoftext|>",
            pad_token="<|im_end|>",
            add_bos_token=True,
            additional_special_tokens=["<|im_start|>", "<|im_end|>"],
            clean_up_tokenization_spaces=True,
        ),
        dict(bos_token_id=1, eos_token_id=2),
    )
    with open(os.path.join(FIXTURES, "smollm_byte_level", "chat_template.jinja"), "w") as f:
        f.write(SMOLLM_TEMPLATE)
    llama_metaspace()


# The embedded vocabularies transformers' GGUF loader rebuilds. gguf_llama's encodings of text that starts with
# spaces or follows a special token were then set to sentencepiece's (and llama.cpp's: a dummy-prefix "\u2581" before
# every piece of text), which transformers' GGUF converter drops there (Metaspace prepend_scheme "first"); the file's
# "note" says so. Re-recording restores transformers' ids for those cases.
GGUF_TOKENIZERS = ("gguf_llama", "gguf_qwen2")


def write_tokenizer_gguf(name: str, directory: str) -> str:
    """A GGUF holding only a vocabulary (no tensors), as llama.cpp would embed the named tokenizer."""
    from tests.support.gguf_files import write_gguf

    config = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=96, num_attention_heads=4)
    if name == "gguf_llama":
        tokenizer, template = ("llama", os.path.join(HERE, "fixtures", "llama_gqa", "tokenizer.model")), LLAMA2_TEMPLATE
    else:
        tokenizer, template = ("gpt2:qwen2", os.path.join(FIXTURES, "qwen_byte_level", "tokenizer.json")), QWEN_TEMPLATE
    path = os.path.join(directory, f"{name}.gguf")
    write_gguf(
        path,
        config,
        {},
        {},
        architecture="llama" if name == "gguf_llama" else "qwen2",
        tokenizer=tokenizer,
        chat_template=template,
    )
    return path


def random_id_sequences(vocab_size: int, rng: np.random.Generator, count: int = 300) -> list[list[int]]:
    return [rng.integers(0, vocab_size, size=int(rng.integers(1, 16))).tolist() for _ in range(count)]


def record(directory: str, hf) -> None:
    rng = np.random.default_rng(0)
    encodings = [
        dict(text=t, add_special_tokens=a, ids=hf.encode(t, add_special_tokens=a)) for t in TEXTS for a in (True, False)
    ]
    sequences = [e["ids"] for e in encodings] + random_id_sequences(len(hf), rng)
    decodes = [
        dict(ids=ids, skip_special_tokens=s, text=hf.decode(ids, skip_special_tokens=s))
        for ids in sequences
        for s in (False, True)
    ]
    chats = []
    for conversation in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            kwargs = dict(add_generation_prompt=add_generation_prompt)
            chats.append(dict(messages=conversation, **kwargs, text=render(hf, conversation, **kwargs)))
    chats.append(
        dict(
            messages=CONVERSATIONS[0],
            tools=TOOLS,
            add_generation_prompt=True,
            text=render(hf, CONVERSATIONS[0], tools=TOOLS, add_generation_prompt=True),
        )
    )
    chats.append(
        dict(
            messages=CONVERSATIONS[1][1:3],
            continue_final_message=True,
            add_generation_prompt=False,
            text=render(hf, CONVERSATIONS[1][1:3], continue_final_message=True),
        )
    )
    chats.append(
        dict(
            messages=[{"role": "assistant", "content": "first"}],
            add_generation_prompt=True,
            text=render(hf, [{"role": "assistant", "content": "first"}], add_generation_prompt=True),
        )
    )
    with open(os.path.join(directory, "expected.json"), "w") as f:
        json.dump(
            dict(
                bos_token_id=hf.bos_token_id,
                eos_token_id=hf.eos_token_id,
                vocab_size=len(hf),
                special_tokens={k: str(v) for k, v in hf.special_tokens_map.items() if isinstance(v, str)},
                all_special_ids=sorted(hf.all_special_ids),
                encodings=encodings,
                decodes=decodes,
                chats=chats,
            ),
            f,
            indent=0,
            ensure_ascii=False,
        )


def render(hf, messages, **kwargs) -> str | None:
    """The rendered template, or None where transformers raises (then jaxserve must raise ValueError)."""
    try:
        return hf.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception:  # noqa: BLE001  (any failure is recorded the same way)
        return None


def main() -> None:
    import transformers

    build()
    for name in BUILT:
        record(os.path.join(FIXTURES, name), transformers.AutoTokenizer.from_pretrained(os.path.join(FIXTURES, name)))
    sentencepiece_dir = os.path.join(HERE, "fixtures", "llama_gqa")
    os.makedirs(os.path.join(FIXTURES, "sentencepiece"), exist_ok=True)
    record(os.path.join(FIXTURES, "sentencepiece"), transformers.AutoTokenizer.from_pretrained(sentencepiece_dir))
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        for name in GGUF_TOKENIZERS:
            path = write_tokenizer_gguf(name, directory)
            os.makedirs(os.path.join(FIXTURES, name), exist_ok=True)
            record(
                os.path.join(FIXTURES, name),
                transformers.AutoTokenizer.from_pretrained(directory, gguf_file=os.path.basename(path)),
            )
    print("recorded", *BUILT, "sentencepiece", *GGUF_TOKENIZERS)


if __name__ == "__main__":
    main()
