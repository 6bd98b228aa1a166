"""Writers never lose data: an output that is an input is refused (every subcommand of specee.convert, retype and
the autoee exports), an input named like a temporary file is left intact, SIGINT and SIGTERM during a write
remove the temporary file, and the final name only ever holds a complete file."""

from __future__ import annotations

import hashlib
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from specee.autoee.export import export_predictors
from specee.autoee.exit_features import ExitPredictor
from specee.convert.output import OutTensor, copy_tensor, read_fields, string_field, temp_output, write_gguf
from specee.convert.retype import retype_gguf
from test_convert_cli import cli

OLD = b"an older file"

# writes a GGUF whose second tensor loads slowly: the test signals the writer while it waits
SLOW_WRITER = r'''
import signal, sys, time
signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as in a user's shell, also when the tests run under nohup
signal.signal(signal.SIGINT, signal.default_int_handler)  # and from a background job (SIGINT ignored there)
from pathlib import Path
import gguf, numpy as np
from specee.convert.output import OutTensor, string_field, write_gguf

out, ready = Path(sys.argv[1]), Path(sys.argv[2])
F32 = gguf.GGMLQuantizationType.F32
data = np.ones((4, 32), np.float32)

def slow():
    ready.write_text("writing")
    time.sleep(120)
    return data

tensors = [OutTensor("a.weight", (4, 32), F32, lambda: data), OutTensor("b.weight", (4, 32), F32, slow)]
write_gguf(out, "llama", {"general.architecture": string_field("llama")}, tensors, progress=False)
'''


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def temp_files(folder: Path) -> list[Path]:
    return sorted(folder.glob(".*.tmp"))


@pytest.fixture()
def base(tiny_gguf: Path, tmp_path: Path) -> Path:
    return Path(shutil.copy(tiny_gguf, tmp_path / "base.gguf"))


@pytest.fixture()
def predictors(tmp_path: Path) -> Path:
    """SpecEE-layout exit predictors for layers 1..3 of the 4-layer tiny model."""
    g = torch.Generator().manual_seed(0)
    state = {f"model.layers.{i}.pred.{part}": 0.1 * torch.randn(*shape, generator=g)
             for i in (1, 2, 3)
             for part, shape in (("up.weight", (512, 12)), ("up.bias", (512,)), ("down.weight", (1, 512)),
                                 ("down.bias", (1,)))}
    path = tmp_path / "preds.safetensors"
    save_file(state, path)
    return path


def make_eauto(src: Path, out: Path) -> Path:
    """SpecEE's layout of a llama GGUF: architecture eauto, llama.* keys renamed eauto.*."""
    reader = gguf.GGUFReader(src)
    fields = {("eauto." + k.removeprefix("llama.") if k.startswith("llama.") else k): f
              for k, f in read_fields(reader).items()}
    fields["general.architecture"] = string_field("eauto")
    write_gguf(out, "eauto", fields, [copy_tensor(t) for t in reader.tensors], progress=False)
    return out


# ---- an output that is an input is refused


def refused(msg: int | str, victim: Path, before: str) -> None:
    assert isinstance(msg, str) and msg.startswith("error: the output") and "is the input" in msg, msg
    assert "\n" not in msg
    assert digest(victim) == before and not temp_files(victim.parent)


@pytest.mark.parametrize("case", ["quantize", "quantize-link", "quantize-hardlink", "quantize-relative",
                                  "merge-base", "merge-predictors", "import-specee"])
def test_output_that_is_an_input_is_refused(case: str, base: Path, predictors: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    victim = base
    if case == "quantize":
        args = ["quantize", base, base, "f16"]
    elif case == "quantize-link":
        (tmp_path / "link.gguf").symlink_to(base)
        args = ["quantize", base, tmp_path / "link.gguf", "f16"]
    elif case == "quantize-hardlink":
        (tmp_path / "hard.gguf").hardlink_to(base)
        args = ["quantize", base, tmp_path / "hard.gguf", "f16"]
    elif case == "quantize-relative":
        monkeypatch.chdir(tmp_path)
        args = ["quantize", "base.gguf", f"../{tmp_path.name}/base.gguf", "f16"]
    elif case == "merge-base":
        args = ["merge", base, "-o", base, "--predictors", predictors]
    elif case == "merge-predictors":
        victim = predictors
        args = ["merge", base, "-o", predictors, "--predictors", predictors]
    else:
        victim = make_eauto(base, tmp_path / "eauto.gguf")
        args = ["import-specee", victim, "-o", victim]
    before = digest(victim)
    refused(cli(*args), victim, before)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "generation_config.json"])
def test_hf_into_its_own_weights_or_settings_is_refused(name: str, tiny_hf_dir: Path, tmp_path: Path) -> None:
    model = Path(shutil.copytree(tiny_hf_dir, tmp_path / "model"))
    victim = model / name
    before = digest(victim)
    refused(cli("hf", model, "-o", victim), victim, before)
    assert cli("hf", model, "-o", model / "tiny.gguf") == 0  # a new file in the model folder is fine


def test_retype_and_exports_refuse_their_inputs(base: Path, tmp_path: Path) -> None:
    before = digest(base)
    with pytest.raises(ValueError, match="is the input"):
        retype_gguf(base, base)
    assert digest(base) == before
    selection = tmp_path / "selection.json"
    selection.write_text('{"exit_layers": [1]}')
    with pytest.raises(ValueError, match="is the input"):  # OUT.json would replace the input
        export_predictors({1: ExitPredictor()}, tmp_path / "selection", [1], 0.5, 4, inputs=[selection])
    assert selection.read_text() == '{"exit_layers": [1]}'
    assert not (tmp_path / "selection.safetensors").exists() and not temp_files(tmp_path)


def test_input_named_like_a_temporary_file(tiny_gguf: Path, tmp_path: Path) -> None:
    """The issue's case: IN = OUT.tmp. In a child process: a writer that maps its input and truncates it dies
    of SIGBUS."""
    src = Path(shutil.copy(tiny_gguf, tmp_path / "x.gguf.tmp"))
    before = digest(src)
    run = subprocess.run([sys.executable, "-m", "specee.convert", "quantize", src, tmp_path / "x.gguf", "f16"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert digest(src) == before
    reference = tmp_path / "ref" / "x.gguf"
    reference.parent.mkdir()
    assert cli("quantize", tiny_gguf, reference, "f16") == 0
    assert digest(tmp_path / "x.gguf") == digest(reference)
    assert not temp_files(tmp_path)


def test_temporary_names_are_new_files(tmp_path: Path) -> None:
    out = tmp_path / "out.gguf"
    with temp_output(out, 0) as a, temp_output(out, 0) as b:
        assert a != b and a.parent == tmp_path and a.name.startswith(".out.gguf.") and a.suffix == ".tmp"
        assert a.exists() and b.exists() and not out.exists()
        a.write_bytes(b"complete")
    assert out.read_bytes() == b"complete" and not temp_files(tmp_path)


# ---- stop signals during a write


def start_slow_writer(tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    """A writer waiting inside its second tensor, with `out` holding an older file; returns (process, out, tmp)."""
    out, ready = tmp_path / "out.gguf", tmp_path / "ready"
    out.write_bytes(OLD)
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, out, ready], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the writer did not start"
        time.sleep(0.05)
    (tmp,) = temp_files(tmp_path)
    assert tmp.stat().st_size > 0  # header and first tensor written
    assert out.read_bytes() == OLD  # the final name holds the older file while the new one is written
    return proc, out, tmp


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_stop_signal_removes_the_temporary_file(signum: int, tmp_path: Path) -> None:
    proc, out, tmp = start_slow_writer(tmp_path)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    # after the clean-up the signal acts as before: SIGINT raises KeyboardInterrupt (and Python, exiting with it
    # uncaught, ends killed by SIGINT), SIGTERM and SIGHUP end the process
    assert proc.returncode == -signum
    assert ("KeyboardInterrupt" in err) == (signum == signal.SIGINT)
    assert not tmp.exists() and not temp_files(tmp_path)
    assert out.read_bytes() == OLD


def test_sigkill_leaves_only_a_file_of_its_own(tmp_path: Path) -> None:
    """SIGKILL cannot be caught: the temporary file stays, under a name nothing else uses, and the next write is
    not disturbed by it."""
    proc, out, tmp = start_slow_writer(tmp_path)
    proc.kill()
    proc.communicate(timeout=60)
    assert tmp.exists() and out.read_bytes() == OLD
    data = np.arange(128, dtype=np.float32).reshape(4, 32)
    tensors = [OutTensor("a.weight", data.shape, gguf.GGMLQuantizationType.F32, lambda: data)]
    write_gguf(out, "llama", {"general.architecture": string_field("llama")}, tensors, progress=False)
    assert np.array_equal(gguf.GGUFReader(out).tensors[0].data, data)
    assert temp_files(tmp_path) == [tmp]
