"""llama.cpp's host-memory prompt cache (--cache-ram N MiB): a slot's cache about to be dropped is kept here as bytes
(its tokens and K/V cells, `Slots.save_mem`), the oldest dropped first beyond N MiB; a prompt that shares a longer
prefix with a kept entry than with its slot's cache gets the entry restored into the slot (`Slots.restore_mem`),
which then evaluates only the rest. Engine (server/engine.py) decides when; this module keeps the entries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

MIB = 1024 * 1024
DEFAULT_MIB = 8192  # llama-server's default --cache-ram


@dataclass
class Entry:
    tokens: list[int]  # what the cells hold, in position order
    data: bytes  # Slots.save_mem's bytes


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PromptCache:
    """Entries oldest first, at most limit_mib MiB of them (-1: no limit); `log` gets a line per decision."""

    def __init__(self, limit_mib: int, log: Callable[[str], None]) -> None:
        self.limit = -1 if limit_mib < 0 else limit_mib * MIB
        self.log = log
        self.entries: list[Entry] = []

    def clear(self) -> None:
        """Every entry dropped (their cells belong to a model unloaded, or to LoRA scales no longer applied)."""
        self.entries.clear()

    def size(self) -> int:
        return sum(len(e.data) for e in self.entries)

    def holds(self, tokens: Sequence[int]) -> bool:
        """Whether an entry holds these tokens (or more after them): saving them again would add nothing."""
        return any(common_prefix(e.tokens, tokens) == len(tokens) for e in self.entries)

    def fits(self, n_bytes: int) -> bool:
        return self.limit < 0 or n_bytes <= self.limit

    def put(self, tokens: list[int], data: bytes) -> None:
        """Keep an entry: the entries it contains go, then the oldest while the cache would be over its limit."""
        self.entries = [e for e in self.entries if common_prefix(e.tokens, tokens) < len(e.tokens)]
        while self.entries and self.limit >= 0 and self.size() + len(data) > self.limit:
            old = self.entries.pop(0)
            self.log(f" - making room for prompt cache entry, removing oldest entry ({len(old.data) / MIB:.3f} MiB)")
        self.entries.append(Entry(tokens, data))
        self.log(f" - cache state: {len(self.entries)} prompts, {self.size() / MIB:.3f} MiB "
                 f"(limit: {'none' if self.limit < 0 else f'{self.limit / MIB:.3f} MiB'})")

    def take(self, prompt: Sequence[int], cached: int, held: int) -> Entry | None:
        """The entry to restore for `prompt` into a slot holding `held` tokens of which `cached` are its prefix, taken
        out of the cache; None when none does better. As llama.cpp: an entry must keep at least a quarter of itself,
        and beat the slot both in the share of the entry kept and in the share of the prompt found."""
        keep_best = cached / held if held > 0 else -1.0  # an empty slot: any entry wins
        sim_best = cached / max(len(prompt), 1)
        best = None
        for e in self.entries:
            n = common_prefix(e.tokens, prompt)
            keep, sim = n / max(len(e.tokens), 1), n / max(len(prompt), 1)
            if keep >= 0.25 and keep > keep_best and sim > sim_best:
                keep_best, sim_best, best = keep, sim, e
        if best is not None:
            self.entries.remove(best)
            self.log(f" - found better prompt with f_keep = {keep_best:.3f}, f_sim = {sim_best:.3f}")
        return best
