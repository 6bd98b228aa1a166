"""python/specee/_core.pyi, the native module's stub, names what the module has; mypy passes on python/specee."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specee import _core

PYTHON = Path(__file__).resolve().parents[1] / "python"
STUB = PYTHON / "specee" / "_core.pyi"


def stub_names() -> dict[str, set[str]]:
    """{top-level name: its members (classes) or set()} of the stub."""
    names: dict[str, set[str]] = {}
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
        elif isinstance(node, ast.FunctionDef):
            names[node.name] = set()
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id != "__all__":
            names[node.target.id] = set()
    return names


def module_names() -> dict[str, set[str]]:
    names: dict[str, set[str]] = {}
    for name, value in vars(_core).items():
        if name.startswith("_"):
            continue
        if inspect.isclass(value):
            members = {m for m in vars(value) if not m.startswith("_") or m == "__init__"}
            names[name] = members if value is not _core.SpecEEError else set()
        else:
            names[name] = set()
    return names


def test_the_stub_names_what_the_module_has() -> None:
    stub = stub_names()
    stub["SpecEEError"] = set()
    assert stub == module_names(), "regenerate it: pybind11-stubgen specee._core -o OUT (see the stub's docstring)"


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed (tests/requirements.txt)")
def test_mypy_passes_on_the_package() -> None:
    env = {**os.environ, "MYPY_CACHE_DIR": os.devnull}
    res = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "specee"], cwd=PYTHON, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:]
