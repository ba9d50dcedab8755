"""The DeepSeek-V2-Chat conversation template, as token ids with a loss mask.

The released ``tokenizer_config.json`` of deepseek-ai/DeepSeek-V2-Chat renders a
conversation as::

    {bos}{system}\\n\\n User: {user}\\n\\n Assistant: {reply}{eos} User: ...

(without the spaces shown between parts): a system message is its content plus
a blank line, a user turn is ``"User: " + content + "\\n\\n"``, an assistant turn
is ``"Assistant: " + content + eos``; the generation prompt is ``"Assistant:"``.

Tokenization follows what HuggingFace does with that template: the rendered text
between special tokens is tokenized as a whole (so the ids equal
``tokenizer(apply_chat_template(...))`` of the released tokenizer), and bos /
eos are inserted as ids. The loss mask comes from character offsets: a token is
a target when it starts inside an assistant reply. The reply's span starts at
the space after ``"Assistant:"`` (the generation prompt ends at the colon, so the
model learns to produce ``" reply<eos>"`` from exactly the prompt it is given at
inference), and the eos closing a reply is a target too. Everything else
(bos, system, user turns, the ``"Assistant:"`` tag) is ``IGNORE_INDEX``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ms_deepseek.data.tokenizer import Tokenizer

IGNORE_INDEX = -100


def _chunks(messages: Sequence[dict], add_generation_prompt: bool) -> List[Tuple[str, Optional[int], bool]]:
    """Split the rendered conversation at its eos tokens.

    Returns ``(text, target_start, ends_with_eos)`` per chunk, where
    ``target_start`` is the character index where the assistant reply starts
    (None when the chunk holds no reply).
    """
    chunks = []
    text = ""
    for m in messages:
        role, content = m["role"], m["content"]
        if role == "system":
            text += content + "\n\n"
        elif role == "user":
            text += "User: " + content + "\n\n"
        elif role == "assistant":
            text += "Assistant:"
            start = len(text)
            chunks.append((text + " " + content, start, True))
            text = ""
        else:
            raise ValueError(f"unknown role {role!r}")
    if add_generation_prompt:
        text += "Assistant:"
    if text:
        chunks.append((text, None, False))
    return chunks


def render_chat(messages: Sequence[dict], bos_token: str, eos_token: str, add_generation_prompt: bool = False) -> str:
    """The template as text (what the released chat_template renders)."""
    out = bos_token
    for text, _, ends in _chunks(messages, add_generation_prompt):
        out += text + (eos_token if ends else "")
    return out


def encode_chat(
    tokenizer: Tokenizer, messages: Sequence[dict], add_generation_prompt: bool = False
) -> Tuple[List[int], List[int]]:
    """Token ids and labels of a conversation in the DeepSeek-V2-Chat template.

    ``labels`` is aligned with ``ids`` (HuggingFace convention: the model shifts
    them by one inside its loss): ``labels[t] == ids[t]`` for assistant-reply
    tokens and their closing eos, ``IGNORE_INDEX`` elsewhere. For generation use
    ``add_generation_prompt=True`` and feed ``ids``.
    """
    ids: List[int] = []
    labels: List[int] = []
    if tokenizer.bos_id is not None:
        ids.append(tokenizer.bos_id)
        labels.append(IGNORE_INDEX)
    for text, target_start, ends in _chunks(messages, add_generation_prompt):
        tids, starts = tokenizer.encode_with_offsets(text)
        ids.extend(tids)
        if target_start is None:
            labels.extend([IGNORE_INDEX] * len(tids))
        else:
            labels.extend(t if s >= target_start else IGNORE_INDEX for t, s in zip(tids, starts))
        if ends:
            ids.append(tokenizer.eos_id)
            labels.append(tokenizer.eos_id)
    return ids, labels
