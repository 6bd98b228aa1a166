"""The package installed into a venv that sees libggml-python only in the system site-packages (a venv made
with --system-site-packages after install.sh): the extension's and the tools' rpath miss libggml there, and
specee._ggml must find it (it used to fail with "libggml.so.0: cannot open shared object file")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_venv_with_system_site_packages(tmp_path: Path) -> None:
    if not (ROOT / "pyproject.toml").is_file():
        pytest.skip("not run from a checkout")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    build = subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-deps",
                            "--ignore-installed", str(ROOT)], capture_output=True, text=True, timeout=1200)
    assert build.returncode == 0, build.stderr[-3000:]
    site = subprocess.run([str(py), "-c", "import specee, libggml; print(specee.__file__); print(libggml.__file__)"],
                          capture_output=True, text=True, timeout=300)
    assert site.returncode == 0, site.stderr
    ours, ggml = (Path(line).parent.parent for line in site.stdout.split())
    assert ours != ggml  # the layout this is about: specee in the venv, libggml-python outside it
    run = subprocess.run([str(py), "-c", "import specee; m = specee.Model(); print(m.n_layer)"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "30", run.stderr
    cli = subprocess.run([str(venv / "bin" / "specee-cli"), "-p", "Hi", "-n", "2", "-no-cnv", "--temp", "0"],
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert cli.returncode == 0 and cli.stdout.startswith("Hi"), cli.stderr
