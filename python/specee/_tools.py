"""Console-script shims for the native tools installed in specee/bin."""

import os
import sys
from pathlib import Path

BIN_DIR = Path(__file__).resolve().parent / "bin"


def tool_path(name: str) -> Path:
    path = BIN_DIR / name
    if not path.exists():
        raise SystemExit(f"specee: the native tool {name} is not installed at {path}; reinstall the package")
    return path


def _exec(name: str) -> None:
    path = tool_path(name)
    os.execv(path, [name, *sys.argv[1:]])


def bench() -> None:
    _exec("specee-bench")
