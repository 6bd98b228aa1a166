"""Where the ggml libraries are, for the extension and the native tools.

Both find libggml through their rpath: the libggml-python package in the same site-packages as specee
(`$ORIGIN/../libggml/lib`). When that package is installed elsewhere on sys.path (a venv made with
--system-site-packages whose system site-packages already hold libggml-python), the rpath misses it:
`preload_ggml` then loads those libraries first (the dynamic linker reuses a loaded library with the same
soname), and `ggml_lib_dir` gives the folder for LD_LIBRARY_PATH of the tools.

`preload_ggml` also sets how long ggml's OpenMP threads spin at a barrier before they sleep (GOMP_SPINCOUNT, read
once when libgomp is loaded, so before the extension; the tools do it in csrc/tools/specee-openmp.cpp, which says
why), and takes it out of the environment again, so that processes started later (upstream llama.cpp in the
benchmarks) run with their own defaults. A value the user set is kept.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

LIBS = ("libggml-base.so.0", "libggml-cpu.so.0", "libggml.so.0")  # dependencies first
SPIN_COUNT = "1000"  # libgomp's own figure for more threads than CPUs (its default: 300000)


def beside() -> bool:
    """Whether libggml-python sits where the rpath looks (next to this package)."""
    return (Path(__file__).resolve().parent.parent / "libggml").is_dir()


def ggml_lib_dir() -> Path | None:
    """The lib folder of the libggml package found on sys.path, or None."""
    spec = importlib.util.find_spec("libggml")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("lib", "lib64"):
            if (Path(folder) / sub / "libggml.so.0").is_file():
                return Path(folder) / sub
    return None


def preload_ggml() -> None:
    if "GOMP_SPINCOUNT" in os.environ:
        load_ggml()
        return
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    try:
        ctypes.CDLL("libgomp.so.1", mode=ctypes.RTLD_GLOBAL)  # loaded now, with the setting
    except OSError:
        pass  # no libgomp here: a ggml built without OpenMP does not need it
    finally:
        del os.environ["GOMP_SPINCOUNT"]
    load_ggml()


def load_ggml() -> None:
    if beside():
        return
    lib_dir = ggml_lib_dir()
    if lib_dir is None:
        return  # another ggml install (CMAKE_PREFIX_PATH builds): the rpath or the system linker finds it
    for name in LIBS:
        if (lib_dir / name).is_file():
            ctypes.CDLL(str(lib_dir / name), mode=ctypes.RTLD_GLOBAL)
