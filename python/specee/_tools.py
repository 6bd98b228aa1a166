"""Console-script shims for the native tools installed in specee/bin, and what starting one as a server needs (a free
port) and stopping it."""

import importlib.util
import os
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

from specee._ggml import beside, ggml_lib_dir
from specee.paths import default_draft_head_path, default_model_path

BIN_DIR = Path(os.path.abspath(__file__)).parent / "bin"
DEFAULT_MODEL_ENV = "SPECEE_DEFAULT_MODEL"
DEFAULT_DRAFT_HEAD_ENV = "SPECEE_DEFAULT_DRAFT_HEAD"  # what `--draft-head default` loads


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the system's pick), for a server started next (specee-server's
    router children, the bench's servers)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """A server started as a subprocess stopped: SIGTERM, then SIGKILL when it has not exited within `timeout` s."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def tool_path(name: str) -> Path:
    path = BIN_DIR / name
    if not path.exists():
        raise SystemExit(f"specee: the native tool {name} is not installed at {path}; reinstall the package")
    return path


def _exec(name: str) -> None:
    path = tool_path(name)
    args = sys.argv[1:]
    if "-m" not in args and "--model" not in args and not os.environ.get(DEFAULT_MODEL_ENV):
        # without -m the tools read the model from the environment: the embedded SmolLM2 when installed
        try:
            os.environ[DEFAULT_MODEL_ENV] = default_model_path()
        except FileNotFoundError:
            pass  # the tool itself reports that no model was given
    if not os.environ.get(DEFAULT_DRAFT_HEAD_ENV):
        try:
            os.environ[DEFAULT_DRAFT_HEAD_ENV] = default_draft_head_path()
        except FileNotFoundError:
            pass  # --draft-head default then reports that it is not set
    _grammar_env()
    if not beside() and (lib_dir := ggml_lib_dir()) is not None:  # see specee._ggml
        paths = [str(lib_dir), os.environ.get("LD_LIBRARY_PATH")]
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in paths if p)
    os.execv(path, [name, *args])


def _grammar_env() -> None:
    """Where the installed llguidance's library and this Python's libpython are, for the tools' grammars
    (csrc/decode/specee-grammar.cpp; the build's paths otherwise)."""
    spec = importlib.util.find_spec("llguidance")
    if spec is not None and spec.submodule_search_locations and not os.environ.get("SPECEE_LLGUIDANCE"):
        for folder in spec.submodule_search_locations:
            for lib in sorted(Path(folder).glob("_lib*.so")):
                os.environ["SPECEE_LLGUIDANCE"] = str(lib)
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if libdir and soname and not os.environ.get("SPECEE_LIBPYTHON") and (Path(libdir) / soname).is_file():
        os.environ["SPECEE_LIBPYTHON"] = str(Path(libdir) / soname)


def bench() -> None:
    _exec("specee-bench")


def cli() -> None:
    _exec("llama-cli")


def rpc_server() -> None:
    _exec("specee-rpc-server")
