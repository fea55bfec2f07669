"""The fake llama-server's model: a byte tokenizer, a chat template and greedy "generation".

Deterministic and pure, so a test can compute what the fake will answer:
- one token per UTF-8 byte (id = byte + 3, as the SPM vocabularies' byte-fallback tokens
  `<0x00>`..`<0xFF>` sit at 3..258), BOS 1 and EOS 2, which `parse_special` reads from the
  texts `<s>` and `</s>`; ids from 259 up to the vocabulary size are valid and render as
  `<tNNN>` (no text maps to them);
- generation picks, for each position, one of the letters a..z from the previous token and the
  position: what it generates re-tokenizes to the same ids (one byte each), so a conversation's
  next turn reuses its answer exactly, as a real model's does up to the last few tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

BOS = 1
EOS = 2
BYTE_OFFSET = 3  # id of byte 0x00
FIRST_PLAIN_ID = BYTE_OFFSET + 256
SPECIALS = {"<s>": BOS, "</s>": EOS}
LETTERS = "abcdefghijklmnopqrstuvwxyz"
# infill's FIM tokens (format_prompt_infill): ids of their own above the bytes
FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = FIRST_PLAIN_ID, FIRST_PLAIN_ID + 1, FIRST_PLAIN_ID + 2


def tokenize_text(text: str, parse_special: bool) -> list[int]:
    """A string's ids: its bytes, with `<s>`/`</s>` read as BOS/EOS when `parse_special`."""
    ids: list[int] = []
    at = 0
    while at < len(text):
        special = next(
            (name for name in SPECIALS if parse_special and text.startswith(name, at)), None
        )
        if special is not None:
            ids.append(SPECIALS[special])
            at += len(special)
            continue
        ids.extend(byte + BYTE_OFFSET for byte in text[at].encode())
        at += 1
    return ids


def tokenize_mixed(content: Any, add_special: bool, parse_special: bool) -> list[int]:
    """llama-server's tokenize_mixed: a string, or an array of strings and ids; BOS only when
    `add_special` and the content starts with a string."""
    parts = content if isinstance(content, list) else [content]
    ids: list[int] = []
    for index, part in enumerate(parts):
        if isinstance(part, str):
            if index == 0 and add_special:
                ids.append(BOS)
            ids.extend(tokenize_text(part, parse_special))
        else:
            ids.append(int(part))
    return ids


def piece(token: int) -> bytes:
    """What a token renders as (special tokens rendered, as /detokenize does)."""
    if token == BOS:
        return b"<s>"
    if token == EOS:
        return b"</s>"
    if BYTE_OFFSET <= token < FIRST_PLAIN_ID:
        return bytes([token - BYTE_OFFSET])
    return f"<t{token}>".encode()


def detokenize(tokens: Sequence[int]) -> str:
    return b"".join(piece(token) for token in tokens).decode(errors="replace")


def generated_text(tokens: Sequence[int]) -> str:
    """The content of generated tokens (EOS renders as nothing, as in a completion's text)."""
    return b"".join(piece(token) for token in tokens if token != EOS).decode(errors="replace")


def next_token(previous: int, position: int) -> int:
    """The greedy choice after `previous` at `position`: a letter, the same on every run."""
    letter = LETTERS[(previous * 31 + position * 7) % len(LETTERS)]
    return ord(letter) + BYTE_OFFSET


def generate(prompt: Sequence[int], count: int, end_with_eos: bool) -> list[int]:
    """`count` generated ids after `prompt`; the last one EOS when `end_with_eos`."""
    tokens: list[int] = []
    previous = prompt[-1] if prompt else BOS
    for step in range(count):
        if end_with_eos and step == count - 1:
            tokens.append(EOS)
            break
        previous = next_token(previous, len(prompt) + step)
        tokens.append(previous)
    return tokens


def top_candidates(token: int, count: int) -> list[int]:
    """The `n_probs` candidates of a step: the chosen id and its neighbours."""
    return [token, *(FIRST_PLAIN_ID + (token + k) % 1000 for k in range(1, count))]


def message_text(content: Any) -> str:
    """A chat message's content: a string, or the text parts of an array."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def apply_template(body: dict) -> str:
    """The chat template: ChatML-like turns, then the assistant's opening unless the body says
    `add_generation_prompt: false`."""
    text = ""
    for message in body.get("messages") or []:
        role = message.get("role", "user") if isinstance(message, dict) else "user"
        content = message_text(message.get("content")) if isinstance(message, dict) else ""
        text += f"<|im_start|>{role}\n{content}<|im_end|>\n"
    if body.get("add_generation_prompt", True):
        text += "<|im_start|>assistant\n"
    return text


def infill_tokens(body: dict) -> list[int]:
    """An infill prompt as format_prompt_infill lays it out (simplified: extra chunks, then
    FIM prefix, prefix, FIM suffix, suffix, FIM middle, prompt)."""
    extra = "".join(
        str(chunk.get("text", ""))
        for chunk in body.get("input_extra") or []
        if isinstance(chunk, dict)
    )
    return [
        BOS,
        *tokenize_text(extra, False),
        FIM_PREFIX,
        *tokenize_text(str(body.get("input_prefix", "")), False),
        FIM_SUFFIX,
        *tokenize_text(str(body.get("input_suffix", "")), False),
        FIM_MIDDLE,
        *tokenize_text(str(body.get("prompt", "")), False),
    ]
