"""`--mode auto` weighs a speculative mode against plain decoding: early exit only where its predictors' file does not
say it loses (specee.exit.speedup), EAGLE-2 only where the head's acceptance (specee.eagle.acceptance) and the pass
cost timed on this context say it can win; the choice and its reason in one line (specee_generator_why)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import gguf
import pytest
from gguf import GGUFValueType as V

import specee
from specee import constants as C
from specee.convert.output import Field, copy_tensor, read_fields, write_gguf
from specee.paths import DEFAULT_EAGLE_HEAD_VOCAB8192, default_draft_head_path, weights_path
from conftest import CHEAP_PASSES, SERIAL_PASSES, force_pass_costs

SPEEDUP_RE = re.compile(r": ([0-9.]+)x plain, taken from [0-9.]+x\)?$", re.M)
TAKEN_FROM_RE = re.compile(r"x plain, taken from ([0-9.]+)x\)?$", re.M)
pytestmark = pytest.mark.slow  # SmolLM2 and its shipped draft heads


def with_keys(src: str | Path, out: Path, **floats: float) -> Path:
    """A copy of a draft head file with float32 keys set (C.KEY_* names as keywords) or removed (value None)."""
    reader = gguf.GGUFReader(src)
    fields = {k: f for k, f in read_fields(reader).items() if k != "general.architecture"}
    for name, value in floats.items():
        key = getattr(C, name)
        fields.pop(key, None)
        if value is not None:
            fields[key] = Field(float(value), V.FLOAT32)
    write_gguf(out, C.ARCH, fields, [copy_tensor(t) for t in reader.tensors], progress=False)
    return out


def auto_choice(model: Path, head: Path, passes: tuple[list[int], list[float]] | None = None,
                **options) -> tuple[str, str]:
    """auto's mode and its line; `passes`: the pass costs forced on the context (else this machine's, timed)."""
    with specee.Model(model, n_ctx=256, n_threads=1, draft_head=str(head)) as m:
        if passes:
            force_pass_costs(m, passes)
        m.generate("The capital of France is", max_tokens=4, temp=0, **options)
        return m.last_stats.mode, m.last_stats.mode_why


@pytest.fixture(scope="module")
def vocab_head() -> str:
    return weights_path(DEFAULT_EAGLE_HEAD_VOCAB8192)


def test_auto_follows_its_own_estimate(smollm2_path: Path, vocab_head: str, tmp_path: Path) -> None:
    """A head that never drafts right gives 1 token per step for more than a plain pass: not EAGLE-2 (lookup), whatever
    the machine; a perfect head: EAGLE-2 where passes are cheap (pass costs forced), not where every row costs a pass
    of its own, and with this machine's timed costs exactly when the line's estimate reaches the margin it names."""
    never = with_keys(vocab_head, tmp_path / "never.gguf", KEY_EAGLE_ACCEPTANCE=0.0)
    mode, why = auto_choice(smollm2_path, never)
    assert mode == "ngram", why
    assert why.startswith("auto: ngram: ") and "(not eagle2: the draft head's acceptance 0.00 (its file's)" in why
    assert float(SPEEDUP_RE.search(why).group(1)) < 1.0
    perfect = with_keys(vocab_head, tmp_path / "perfect.gguf", KEY_EAGLE_ACCEPTANCE=1.0)
    for passes, want in ((CHEAP_PASSES, "eagle2"), (SERIAL_PASSES, "ngram"), (None, None)):
        mode, why = auto_choice(smollm2_path, perfect, passes)
        assert "acceptance 1.00 (its file's)" in why and "2.00 tokens per step" in why
        speedup = float(SPEEDUP_RE.search(why).group(1))
        taken_from = float(TAKEN_FROM_RE.search(why).group(1))  # the margin the runtime asks of its estimate
        assert taken_from >= 1.0
        assert mode == (want or ("eagle2" if speedup >= taken_from else "ngram")), why
        if want:
            assert (speedup >= taken_from) == (want == "eagle2"), why
    unknown = with_keys(vocab_head, tmp_path / "unknown.gguf", KEY_EAGLE_ACCEPTANCE=None)
    assert "acceptance 0.70 (assumed: the file gives none)" in auto_choice(smollm2_path, unknown)[1]


def test_auto_skips_early_exit_that_its_predictors_say_loses(smollm2_path: Path, tmp_path: Path) -> None:
    """The shipped draft head file: its predictors simulated less than plain decoding (specee.exit.speedup), so auto
    weighs EAGLE-2 instead and says so; without the key (SpecEE's files) auto runs early exit as before; exit settings
    or --mode choose it anyway."""
    speedup = float(gguf.GGUFReader(default_draft_head_path()).fields[C.KEY_EXIT_SPEEDUP].contents())
    assert speedup < 1.0
    mode, why = auto_choice(smollm2_path, Path(default_draft_head_path()))
    assert mode in ("ngram", "eagle2") and f"not early exit: its predictors expect {speedup:.2f}x plain" in why, why
    silent = with_keys(default_draft_head_path(), tmp_path / "silent.gguf", KEY_EXIT_SPEEDUP=None)
    assert auto_choice(smollm2_path, silent) == ("early-exit", "")
    assert auto_choice(smollm2_path, Path(default_draft_head_path()), exit=specee.ExitParams(threshold=0.5))[0] == \
        "early-exit"
    assert auto_choice(smollm2_path, Path(default_draft_head_path()), mode="early-exit") == ("early-exit", "")


def test_auto_keeps_a_given_tree(smollm2_path: Path, vocab_head: str, tmp_path: Path) -> None:
    """Tree settings ask for EAGLE: auto keeps it however the head is rated (no pass is timed, no line)."""
    never = with_keys(vocab_head, tmp_path / "never.gguf", KEY_EAGLE_ACCEPTANCE=0.0)
    assert auto_choice(smollm2_path, never, eagle=specee.EagleParams(total_tokens=2, depth=2, topk=1)) == ("eagle2", "")


def test_the_cli_prints_the_reason(smollm2_path: Path, vocab_head: str, tmp_path: Path) -> None:
    from specee._tools import tool_path

    never = with_keys(vocab_head, tmp_path / "never.gguf", KEY_EAGLE_ACCEPTANCE=0.0)
    run = subprocess.run([str(tool_path("llama-cli")), "-m", str(smollm2_path), "--draft-head", str(never), "-p",
                          "Hello", "-n", "4", "--temp", "0", "-no-cnv", "-t", "1"], capture_output=True, text=True,
                         timeout=300, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("auto: ")]
    assert len(lines) == 1 and lines[0].startswith("auto: ngram: ") and "the draft head's acceptance 0.00" in lines[0]
    assert "ngram: a pass of 2, 3" in run.stderr  # what a draft costs here, from which lookup decides


def test_the_timing_passes_leave_the_cache_as_it_was(smollm2_path: Path, vocab_head: str, tmp_path: Path) -> None:
    """auto times its passes after the cache's last position and removes them: the prompt cached before is reused
    and the output equals plain decoding's."""
    never = with_keys(vocab_head, tmp_path / "never.gguf", KEY_EAGLE_ACCEPTANCE=0.0)
    with specee.Model(smollm2_path, n_ctx=256, n_threads=1, draft_head=str(never)) as m:
        plain = m.generate("The capital of France is", max_tokens=8, temp=0, mode="plain")
        auto = m.generate("The capital of France is", max_tokens=8, temp=0)
        assert m.last_stats.mode == "ngram" and "auto: ngram" in m.last_stats.mode_why
        assert auto == plain and m.last_stats.n_reused > 0
        assert m.kv_pos_max + 1 == m.kv_n_used  # no cell left behind past the generation
