"""The poolings of embeddings, how a text's final-norm rows become what Model.embed, Slots.embed and the server give:
the library's table (csrc/include/specee.h), read once here."""

from __future__ import annotations

from dataclasses import dataclass

from specee import _core


@dataclass(frozen=True)
class Pooling:
    name: str  # "mean": Model.embed(pooling=...), specee-server's --pooling
    help: str  # what a text gives
    normalized: bool  # unit length when normalizing is asked for (none and rank: never)


# by name, in the library's order (the index is the pooling's number, as llama.cpp's {arch}.pooling_type)
POOLINGS: dict[str, Pooling] = {p["name"]: Pooling(**p) for p in _core.poolings()}


def pooling_id(name: str | None) -> int:
    """The library's number of a pooling name; None: -1, the model's own ({arch}.pooling_type, else mean)."""
    if name is None:
        return -1
    if name not in POOLINGS:
        raise ValueError(f"unknown pooling {name!r}: expected one of {', '.join(POOLINGS)}")
    return list(POOLINGS).index(name)


def pooling_name(pooling: int) -> str:
    """The name of the library's pooling number."""
    return list(POOLINGS)[pooling]
