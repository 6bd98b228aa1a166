"""The GGUF fuzzer (tests/fuzz_gguf.py), bounded: every boundary value of every field of the three seed files, then
random mutations; no input may crash or hang the loader, the tokenizer or the evaluation."""

from __future__ import annotations

from pathlib import Path

import pytest

from fuzz_gguf import boundary_inputs, fuzz, random_inputs, write_seeds


@pytest.mark.slow
def test_fuzz_boundary_and_random(tmp_path: Path) -> None:
    seeds = write_seeds(tmp_path / "seeds")
    inputs = [*boundary_inputs(seeds), *random_inputs(seeds, 3000, seed=18, tmp=tmp_path / "structured.gguf")]
    rep = fuzz(iter(inputs), tmp_path / "out", timeout=20.0, limit_mb=4096, progress=False)
    assert rep.total == len(inputs) > 10_000
    assert rep.ok > 0 and rep.errors > 0  # the seeds run, the mutations are caught
    assert not rep.crashes and not rep.hangs and not rep.pyexc, rep.crashes[:5] + rep.hangs[:5] + rep.pyexc[:5]
