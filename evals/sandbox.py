"""Running generated code (HumanEval) in an OS-level sandbox, never in the evaluator's own process.

Each program runs under bubblewrap (`bwrap`, Debian/Ubuntu package `bubblewrap`):
- its own PID, network, IPC, UTS and cgroup namespaces: it sees only its own processes (not the evaluator,
  not its /proc/PID/environ), has no network but its own loopback, and every process it starts dies with the
  namespace at the timeout, including one that left the process group or the session;
- a filesystem of read-only binds of the system folders (/usr, /bin, /lib*) and the Python installation, nothing
  else of the host (no /home, /root, /tmp, working tree, nor /etc but the loader's ld.so.cache), a fresh /proc
  and /dev, and a private 64 MiB tmpfs /tmp as its working folder; everything but /tmp is read-only;
- an empty environment and stdin /dev/null;
- never root: started by root, the program runs as a uid of its own (no capabilities, no_new_privs), so
  that root-only files (/etc/shadow) stay closed; started by a user, as that user in a user namespace;
- limits set inside the sandbox (prlimit), so that they count its own processes only: CPU seconds, address
  space, file size (also of its output), open files, processes, no core dumps.
The wall-clock timeout kills bwrap, and the PID namespace with it (--die-with-parent).

Where this sandbox cannot be made (bwrap missing, user namespaces disabled), `run_python` refuses to run
generated code unless called with unsafe_exec=True: the program then runs as a plain child process in its own
process group, with limits on CPU seconds, address space, file size and open files, and a guard that turns
careless file writes and process creation into errors. That contains mistakes, not code written to escape
(it runs as the evaluator's user, with its files, processes and network).
Any failure, time-out or kill scores as failed.
"""

from __future__ import annotations

import functools
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

MEMORY_BYTES = 2 << 30  # address space of each process
MAX_OPEN_FILES = 64
MAX_PROCESSES = 32  # processes and threads of the sandbox
MAX_FILE_BYTES = 16 << 20  # any file written, the program's output included
TMP_BYTES = 64 << 20  # the private /tmp
OUTPUT_CHARS = 2000  # the tail of the output kept in RunResult
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
PROGRAM = "/tmp/program.py"
INSTALL_HINT = "apt-get install bubblewrap"

# run before the program in the unsafe mode only: everything that changes files or processes raises
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


class SandboxUnavailable(RuntimeError):
    pass


@dataclass
class RunResult:
    passed: bool  # exit status 0 within the time limit
    status: str  # "passed", "failed" (non-zero exit or killed by a signal), "timeout"
    returncode: int | None
    output: str  # the tail of stdout + stderr
    seconds: float


def no_sandbox_message(reason: str) -> str:
    return (f"no OS sandbox for generated code here ({reason}): install bubblewrap ({INSTALL_HINT}), or pass "
            "--unsafe-exec to run it unsandboxed as your own user")


# ---- the bubblewrap sandbox


def inside(path: str, folders: list[str]) -> bool:
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


def python_binds() -> list[str]:
    """bwrap arguments that bind the interpreter's installation (and venv) read-only where the system folders
    do not hold them, at the paths Python knows them by, with their parent folders traversable."""
    system = [os.path.realpath(d) for d in SYSTEM_DIRS if os.path.isdir(d)]
    bound: list[str] = []
    args: list[str] = []
    for folder in (sys.base_prefix, sys.prefix, os.path.dirname(os.path.realpath(sys.executable))):
        if inside(os.path.realpath(folder), system) or inside(folder, system + bound):
            continue
        parents = []
        parent = os.path.dirname(folder)
        while parent != "/":
            parents.insert(0, parent)
            parent = os.path.dirname(parent)
        for p in parents:
            args += ["--perms", "0755", "--dir", p]
        args += ["--ro-bind", folder, folder]
        bound.append(folder)
    return args


def tool(name: str) -> str:
    return shutil.which(name, path=SANDBOX_PATH) or name


def limits_argv(cpu_seconds: int, memory: int) -> list[str]:
    return [tool("prlimit"), f"--cpu={cpu_seconds}", f"--as={memory}", f"--fsize={MAX_FILE_BYTES}",
            f"--nofile={MAX_OPEN_FILES}", f"--nproc={MAX_PROCESSES}", "--core=0", "--"]


def bwrap_argv(program_fd: int, cpu_seconds: int, memory: int) -> list[str]:
    """The command that runs the program read from `program_fd` in the sandbox described at the top."""
    argv = [tool("bwrap"), "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--clearenv",
            "--perms", "1777", "--size", str(TMP_BYTES), "--tmpfs", "/tmp"]
    for d in SYSTEM_DIRS:
        argv += ["--ro-bind-try", d, d]
    argv += python_binds()
    if os.path.isfile("/etc/ld.so.cache"):  # the dynamic loader's search list (Debian's multiarch folders)
        argv += ["--perms", "0755", "--dir", "/etc", "--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
             "--perms", "0444", "--ro-bind-data", str(program_fd), PROGRAM, "--remount-ro", "/", "--chdir", "/tmp"]
    if os.geteuid() == 0:
        # root runs bwrap without a user namespace (a uid mapped to root would own root's files and escape
        # the process limit); setpriv leaves root for a uid of this run only, so the limit counts its processes
        uid = random.randrange(1 << 20, 1 << 30)
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--", *limits_argv(cpu_seconds, memory),
                 tool("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                 "--no-new-privs", "--"]
    else:
        argv += ["--unshare-user", "--disable-userns", "--", *limits_argv(cpu_seconds, memory)]
    return argv + [sys.executable, "-I", "-B", PROGRAM]


def start_sandboxed(program: str, cpu_seconds: int, memory: int, out) -> subprocess.Popen:
    fd = os.memfd_create("program")
    try:
        os.write(fd, program.encode("utf-8"))
        os.lseek(fd, 0, os.SEEK_SET)
        return subprocess.Popen(bwrap_argv(fd, cpu_seconds, memory), env={},
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, pass_fds=(fd,),
                                start_new_session=True)
    finally:
        os.close(fd)


@functools.cache
def sandbox_error() -> str | None:
    """None when the sandbox works here (checked once by running a program in it), else why not."""
    tools = ["bwrap", "prlimit"] + (["setpriv"] if os.geteuid() == 0 else [])
    if missing := [t for t in tools if shutil.which(t, path=SANDBOX_PATH) is None]:
        return f"{', '.join(missing)} not found"
    r = run_sandboxed("print('ok')", 30.0, MEMORY_BYTES)
    if r.passed and r.output == "ok\n":
        return None
    lines = r.output.strip().splitlines() or [f"status {r.status}, exit code {r.returncode}"]
    return f"bwrap fails here: {lines[-1]}"


# ---- running


def _limits(cpu_seconds: int, memory: int) -> None:
    """In the unsafe mode's child, before exec: the resource limits."""
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))
    resource.setrlimit(resource.RLIMIT_NOFILE, (MAX_OPEN_FILES, MAX_OPEN_FILES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def finish(proc: subprocess.Popen, out, timeout: float, t0: float) -> RunResult:
    """Wait up to `timeout` seconds, then kill the process group (and with bwrap its PID namespace)."""
    try:
        proc.wait(timeout=timeout)
        status = "passed" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        status = "timeout"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    seconds = time.monotonic() - t0
    size = out.seek(0, os.SEEK_END)
    out.seek(max(0, size - 4 * OUTPUT_CHARS))
    text = out.read().decode("utf-8", errors="replace")[-OUTPUT_CHARS:]
    return RunResult(status == "passed", status, proc.returncode, text, seconds)


def run_sandboxed(program: str, timeout: float, memory: int) -> RunResult:
    with tempfile.TemporaryFile() as out:
        t0 = time.monotonic()
        return finish(start_sandboxed(program, int(timeout) + 1, memory, out), out, timeout, t0)


def run_unsandboxed(program: str, timeout: float, memory: int) -> RunResult:
    cpu = int(timeout) + 1
    with tempfile.TemporaryDirectory(prefix="specee-eval-") as work, tempfile.TemporaryFile() as out:
        source = os.path.join(work, "program.py")
        with open(source, "w", encoding="utf-8") as f:
            f.write(GUARD + "\n" + program)
        os.chmod(work, 0o500)  # the folder itself read-only too
        env = {"PATH": SANDBOX_PATH, "LANG": "C.UTF-8", "HOME": work, "TMPDIR": work}
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-I", "-B", source], cwd=work, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: _limits(cpu, memory))
        try:
            return finish(proc, out, timeout, t0)
        finally:
            os.chmod(work, 0o700)  # so that the folder can be removed


def run_python(program: str, timeout: float = 10.0, memory: int = MEMORY_BYTES,
               unsafe_exec: bool = False) -> RunResult:
    """Run a Python program in the sandbox; passed when it exits with status 0 within `timeout` seconds.
    Without a sandbox: SandboxUnavailable, or with unsafe_exec=True a plain child process (see the top)."""
    reason = sandbox_error()
    if reason is None:
        return run_sandboxed(program, timeout, memory)
    if not unsafe_exec:
        raise SandboxUnavailable(no_sandbox_message(reason))
    return run_unsandboxed(program, timeout, memory)
