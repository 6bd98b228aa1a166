"""The package installed into a virtual environment that sees libggml-python only in another site folder (a venv
made with --system-site-packages after install.sh): the extension's and the tools' rpath miss libggml there, and
specee._ggml must find it (it used to fail with "libggml.so.0: cannot open shared object file"). The layout is
made explicitly (a .pth file naming the site folder that holds libggml), so the test means the same wherever the
suite runs: in a venv, in the system interpreter or in CI's fresh venv."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import libggml
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_venv_with_system_site_packages(tmp_path: Path) -> None:
    if not (ROOT / "pyproject.toml").is_file():
        pytest.skip("not run from a checkout")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    site_dir = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    # this environment's site folder (libggml-python, the build tools) behind the venv's own, as a system one is
    (Path(site_dir) / "outer.pth").write_text(str(Path(libggml.__file__).resolve().parent.parent) + "\n")
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
