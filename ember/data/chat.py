"""The chat format: one template, in one place.

    ids, train = render(tokenizer, [{"role": "user", "content": "What is 2 + 3?"},
                                    {"role": "assistant", "content": "5"}])
    prompt = render(tokenizer, messages[:-1], add_generation_prompt=True)[0]  # to generate from

Each message (OpenAI's format) becomes its role token, the content's ids, and ``<|end_turn|>``::

    <|system|>You are terse.<|end_turn|><|user|>What is 2 + 3?<|end_turn|><|assistant|>5<|end_turn|>

``train[i]`` marks the tokens the model learns to produce: the content and closing
``<|end_turn|>`` of assistant turns (TRL's and torchtune's completion-only loss). docs/sft.md
("The chat format") has the details, foreign tokenizers included.

Design choices:

- Role and end-of-turn tokens are special tokens reserved in every ember tokenizer (ids 4..7),
  so text that merely contains ``<|user|>`` never becomes one; a foreign tokenizer gets them
  appended by ``add_chat_tokens``.
- Content is encoded piece by piece as the tokenizer encodes text after a special token
  (``encode_after_special``: a Llama-style tokenizer adds no ``▁`` there, as transformers does
  not). No ``<|bos|>`` (the pretraining stream has none); generation ends at ``<|end_turn|>``.
- ``HF_CHAT_TEMPLATE`` is the same format in Jinja, written into exported tokenizers, so
  transformers' ``apply_chat_template`` gives the same ids (tests/test_sft.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from ember.errors import EmberError

ROLES = ("system", "user", "assistant")
END_TURN = "<|end_turn|>"
CHAT_TOKENS = (*(f"<|{r}|>" for r in ROLES), END_TURN)

HF_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end_turn|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

Message = dict[str, str]


def chat_ids(tokenizer) -> dict[str, int]:
    """{role: id of its token, "end": id of <|end_turn|>}; an EmberError if the tokenizer has
    none (an imported foreign tokenizer that was not fine-tuned)."""
    ids = {}
    for name, token in zip((*ROLES, "end"), CHAT_TOKENS, strict=True):
        i = tokenizer.hf.token_to_id(token)
        if i is None:
            raise EmberError(
                f"the tokenizer has no {token} token, so it cannot hold a chat; fine-tune the run "
                "first (`ember train CONFIG train.task=sft train.init_from=RUN` adds the chat tokens)"
            )
        ids[name] = i
    return ids


def add_chat_tokens(tokenizer) -> list[str]:
    """Append the chat tokens ``tokenizer`` lacks as special tokens (ids ``vocab_size``, ...,
    never split out of plain text, like ember's own); returns those added, in id order."""
    return tokenizer.add_special_tokens(CHAT_TOKENS)


def check_messages(messages: Sequence[Message], where: str = "conversation") -> None:
    """An EmberError naming ``where`` unless ``messages`` is a list of {role, content} strings."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise EmberError(f"{where}: messages must be a non-empty list of {{role, content}}")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"} or "role" not in m:
            raise EmberError(f"{where}: message {j} must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise EmberError(f"{where}: message {j} has role {m['role']!r}; roles are {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise EmberError(f"{where}: message {j} ({m['role']}) needs 'content' as a string")


def render(
    tokenizer, messages: Sequence[Message], add_generation_prompt: bool = False
) -> tuple[list[int], list[bool]]:
    """The ids of ``messages`` in the chat format and, per id, whether it is trained (assistant
    content and its end-of-turn). ``add_generation_prompt`` appends ``<|assistant|>``: the prompt
    to generate a reply from."""
    check_messages(messages)
    special = chat_ids(tokenizer)
    ids: list[int] = []
    train: list[bool] = []
    for m in messages:
        content = tokenizer.encode_after_special(m["content"])
        learned = m["role"] == "assistant"
        ids += [special[m["role"]], *content, special["end"]]
        train += [False] + [learned] * (len(content) + 1)
    if add_generation_prompt:
        ids.append(special["assistant"])
        train.append(False)
    return ids, train
