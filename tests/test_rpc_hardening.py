"""specee-rpc-server and the RPC clients against hostile peers (issue 25): one test per defect class found. Each
server case ends with the connection closed, one log line, and the server answering a new client. Servers bind
127.0.0.1, end by themselves after a few minutes, and are stopped by the test that started them."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from rpc_wire import CMD, F32, I32, OP, Conn, graph, rpc_server, tensor
from specee._tools import tool_path

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int, Path]]:
    log = tmp_path_factory.mktemp("rpc_hard") / "server.log"
    with rpc_server(log, "--recv-timeout", "2", "--max-memory", "512") as (port, pid):
        yield port, pid, log


def refused(c: Conn) -> bool:
    return c.closed_by_peer(timeout=10)


def alive(port: int) -> bool:
    """The server answers a new client: handshake and GET_DEVICE_MEMORY."""
    with Conn(port) as c:
        free, total = struct.unpack("<QQ", c.call(CMD["GET_DEVICE_MEMORY"], struct.pack("<I", 0)))
        return 0 < total and free <= total


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


# ---- sizes


@pytest.mark.parametrize("cmd,size", [("SET_TENSOR", 2**64 - 1), ("GRAPH_COMPUTE", 2**64 - 1),
                                      ("GRAPH_COMPUTE", 2**40), ("GET_ALIGNMENT", 2**63), ("HELLO", 2**64 - 1)])
def test_a_huge_declared_size_closes_the_connection(server, cmd: str, size: int) -> None:
    port, _, _ = server
    with Conn(port, hello=cmd != "HELLO") as c:
        c.send(CMD[cmd], b"", size=size)
        assert refused(c)
    assert alive(port)


def test_an_allocation_over_the_budget_fails_cleanly(server) -> None:
    port, _, _ = server
    with Conn(port) as c:
        assert c.alloc(2**64 - 1) == (0, 0)
        assert c.alloc(1 << 30) == (0, 0)  # over --max-memory 512
        buf, base = c.alloc(4096)
        assert buf != 0 and base != 0
    assert alive(port)


# ---- tensors outside their buffers


def _tensor_cases(buf: int, base: int) -> list[tuple[int, bytes]]:
    inside = tensor(buffer=buf, ne=(16,), data=base)
    beyond = tensor(buffer=buf, ne=(16,), data=base + 4096 - 32)  # 64 bytes from 32 before the end
    before = tensor(buffer=buf, ne=(16,), data=base - 64)
    wraps = tensor(buffer=buf, ne=(16,), data=2**64 - 16)
    huge_nb = tensor(buffer=buf, ne=(16, 2), nb=(4, 2**32 - 1, 0, 0), data=base)
    foreign = tensor(buffer=buf + 12345, ne=(16,), data=base)
    q = struct.pack
    return [
        (CMD["SET_TENSOR"], beyond + q("<Q", 0) + bytes(64)),
        (CMD["SET_TENSOR"], before + q("<Q", 0) + bytes(64)),
        (CMD["SET_TENSOR"], wraps + q("<Q", 0) + bytes(16)),
        (CMD["SET_TENSOR"], inside + q("<Q", 2**64 - 8) + bytes(16)),  # offset wrapping 2^64
        (CMD["SET_TENSOR"], inside + q("<Q", 60) + bytes(16)),
        (CMD["SET_TENSOR"], foreign + q("<Q", 0) + bytes(16)),
        (CMD["SET_TENSOR"], huge_nb + q("<Q", 0) + bytes(16)),
        (CMD["GET_TENSOR"], beyond + q("<QQ", 0, 64)),
        (CMD["GET_TENSOR"], inside + q("<QQ", 2**64 - 8, 16)),
        (CMD["GET_TENSOR"], inside + q("<QQ", 0, 2**63)),
        (CMD["COPY_TENSOR"], tensor(buffer=buf, ne=(1024,), data=base) + beyond),
        (CMD["COPY_TENSOR"], inside + wraps),
        (CMD["MEMSET_TENSOR"], inside + q("<QQB", 8, 2**64 - 4, 0)),
        (CMD["BUFFER_CLEAR"], q("<QB", buf + 1, 0)),
        (CMD["FREE_BUFFER"], q("<Q", 0)),
        (CMD["SET_TENSOR"], tensor(type=200, buffer=buf, data=base) + q("<Q", 0) + bytes(4)),
        (CMD["SET_TENSOR"], tensor(type=2, buffer=buf, ne=(31,), data=base) + q("<Q", 0) + bytes(4)),  # Q4_0, 31
    ]


@pytest.mark.parametrize("case", range(17))
def test_a_tensor_outside_its_buffer_closes_the_connection(server, case: int) -> None:
    port, _, log = server
    with Conn(port) as c:
        buf, base = c.alloc(4096)
        cmd, payload = _tensor_cases(buf, base)[case]
        c.send(cmd, payload)
        assert refused(c)
    assert alive(port)
    assert "refused:" in log.read_text()


def test_set_get_copy_inside_the_buffer_work(server) -> None:
    port, _, _ = server
    with Conn(port) as c:
        buf, base = c.alloc(4096)
        a, b = tensor(buffer=buf, ne=(16,), data=base), tensor(buffer=buf, ne=(16,), data=base + 64)
        data = bytes(range(64))
        c.send(CMD["SET_TENSOR"], a + struct.pack("<Q", 0) + data)
        assert c.call(CMD["COPY_TENSOR"], a + b) == b"\x01"
        assert c.call(CMD["GET_TENSOR"], b + struct.pack("<QQ", 0, 64)) == data
        assert c.call(CMD["GET_TENSOR"], b + struct.pack("<QQ", 60, 4)) == data[60:]


def test_a_new_buffer_holds_nothing_of_another_clients(server) -> None:
    port, _, _ = server
    secret = bytes(range(1, 65)) * 64
    with Conn(port) as a:
        buf, base = a.alloc(4096)
        a.send(CMD["SET_TENSOR"], tensor(buffer=buf, ne=(1024,), data=base) + struct.pack("<Q", 0) + secret)
        assert a.call(CMD["FREE_BUFFER"], struct.pack("<Q", buf)) == b""
    with Conn(port) as b:
        for _ in range(4):
            buf, base = b.alloc(4096)
            assert b.call(CMD["GET_TENSOR"], tensor(buffer=buf, ne=(1024,), data=base) + struct.pack("<QQ", 0, 4096)) \
                == bytes(4096)


# ---- graphs


def _add_graph(buf: int, base: int, n: int = 16) -> tuple[list[bytes], int]:
    """x (leaf) + x -> y: two F32 tensors of n elements in the buffer; returns the tensors and y's id."""
    x = tensor(id=1, buffer=buf, ne=(n,), data=base)
    y = tensor(id=2, buffer=buf, ne=(n,), data=base + 4 * n, op=OP["ADD"], src=(1, 1))
    return [x, y], 2


def test_a_valid_graph_computes(server) -> None:
    port, _, _ = server
    with Conn(port) as c:
        buf, base = c.alloc(4096)
        ts, y = _add_graph(buf, base)
        c.send(CMD["SET_TENSOR"], ts[0] + struct.pack("<Q", 0) + struct.pack("<16f", *range(16)))
        c.send(CMD["GRAPH_COMPUTE"], graph([y], ts))
        out = struct.unpack("<16f", c.call(CMD["GET_TENSOR"], ts[1] + struct.pack("<QQ", 0, 64)))
        assert out == tuple(2.0 * i for i in range(16))
        c.send(CMD["GRAPH_RECOMPUTE"], struct.pack("<I", 0))
        assert c.call(CMD["GET_TENSOR"], ts[1] + struct.pack("<QQ", 0, 64)) == struct.pack("<16f", *out)


def _bad_graphs(buf: int, base: int) -> list[bytes]:
    x = tensor(id=1, buffer=buf, ne=(16,), data=base)
    add = lambda **kw: tensor(**{**dict(id=2, buffer=buf, ne=(16,), data=base + 64, op=OP["ADD"], src=(1, 1)), **kw})
    idx = tensor(id=3, type=I32, buffer=buf, ne=(4,), data=base + 128)  # zeros: rows 0
    return [
        graph([0], [x, add()]),                                   # node id 0
        graph([2, 99], [x, add()]),                               # a node naming no tensor
        graph([2], [x, add(src=(1, 77))]),                        # a source naming no tensor
        graph([2], [x, add(src=(1,))]),                           # ADD without its second input
        graph([2], [x, add(op=250)]),                             # an op past GGML_OP_COUNT
        graph([2], [x, add(op=OP["POOL_2D"])]),                   # an op this server does not run
        graph([2], [x, add(src=(2, 2))]),                         # a cycle
        graph([2], [x, add(ne=(17,))]),                           # shapes that do not match
        graph([2], [x, add(type=I32)]),                           # a type the op does not take
        graph([2], [x, add(), add()]),                            # a repeated id
        graph([2], [x, add()], device=3),                         # no such device
        graph([2], [x, add(data=base + 4096 - 16)]),              # a node outside its buffer
        graph([2], [x, add()])[:-10],                             # sizes that do not add up
        graph([2], [x, add(op=OP["MUL_MAT"], ne=(16, 16))]),      # MUL_MAT with a shape it cannot have
        graph([4], [x, idx, tensor(id=4, buffer=buf, ne=(16, 5), data=base + 256, op=OP["GET_ROWS"], src=(1, 3))]),
    ]


@pytest.mark.parametrize("case", range(15))
def test_a_malformed_graph_closes_the_connection(server, case: int) -> None:
    port, _, _ = server
    with Conn(port) as c:
        buf, base = c.alloc(4096)
        c.send(CMD["GRAPH_COMPUTE"], _bad_graphs(buf, base)[case])
        assert refused(c)
    assert alive(port)


def test_get_rows_with_an_index_outside_the_rows_is_refused(server) -> None:
    port, _, log = server
    with Conn(port) as c:
        buf, base = c.alloc(4096)
        x = tensor(id=1, buffer=buf, ne=(4, 4), data=base)
        idx = tensor(id=3, type=I32, buffer=buf, ne=(2,), data=base + 64)
        rows = tensor(id=4, buffer=buf, ne=(4, 2), data=base + 128, op=OP["GET_ROWS"], src=(1, 3))
        c.send(CMD["SET_TENSOR"], idx + struct.pack("<Q", 0) + struct.pack("<2i", 1, 4))
        c.send(CMD["GRAPH_COMPUTE"], graph([4], [x, idx, rows]))
        assert refused(c)
    assert "row index outside the rows" in log.read_text()
    assert alive(port)


def test_row_indices_written_over_by_an_earlier_node_are_refused(server) -> None:
    """(Row indices are set first: a fresh buffer holds whatever its memory held.)"""
    port, _, log = server
    with Conn(port) as c:
        buf, base = c.alloc(4096)
        x = tensor(id=1, buffer=buf, ne=(4, 4), data=base)
        idx = tensor(id=3, type=I32, buffer=buf, ne=(2,), data=base + 64)
        over = tensor(id=5, buffer=buf, ne=(4,), data=base + 64, op=OP["ADD"], src=(6, 6))  # writes idx's bytes
        y = tensor(id=6, buffer=buf, ne=(4,), data=base + 256)
        rows = tensor(id=4, buffer=buf, ne=(4, 2), data=base + 128, op=OP["GET_ROWS"], src=(1, 3))
        c.send(CMD["SET_TENSOR"], idx + struct.pack("<Q2i", 0, 0, 3))
        c.send(CMD["GRAPH_COMPUTE"], graph([5, 4], [x, idx, over, y, rows]))
        assert refused(c)
        with Conn(port) as d:  # the same graph, the writer after the reader: fine (ggml's allocator reuses memory so)
            buf, base = d.alloc(4096)
            x, idx, over, y, rows = (tensor(id=1, buffer=buf, ne=(4, 4), data=base),
                                     tensor(id=3, type=I32, buffer=buf, ne=(2,), data=base + 64),
                                     tensor(id=5, buffer=buf, ne=(4,), data=base + 64, op=OP["ADD"], src=(6, 6)),
                                     tensor(id=6, buffer=buf, ne=(4,), data=base + 256),
                                     tensor(id=4, buffer=buf, ne=(4, 2), data=base + 128, op=OP["GET_ROWS"],
                                            src=(1, 3)))
            d.send(CMD["SET_TENSOR"], idx + struct.pack("<Q2i", 0, 0, 3))
            d.send(CMD["GRAPH_COMPUTE"], graph([4, 5], [x, idx, over, y, rows]))
            assert d.call(CMD["DEVICE_COUNT"]) == struct.pack("<I", 1)
    assert "writes over the row indices" in log.read_text()


def test_a_very_deep_chain_is_refused_without_recursion(server) -> None:
    """70,000 ADDs each on the previous one: deeper than the server's limit (65,536), checked with a loop."""
    port, _, _ = server
    n = 70_000
    with Conn(port) as c:
        buf, base = c.alloc(4096)
        ts = [tensor(id=1, buffer=buf, ne=(4,), data=base)]
        ts += [tensor(id=i, buffer=buf, ne=(4,), data=base + 16, op=OP["ADD"], src=(i - 1, 1)) for i in range(2, n)]
        c.send(CMD["GRAPH_COMPUTE"], graph([n - 1], ts))
        assert refused(c, )
    assert alive(port)


# ---- connections


def test_a_stalled_client_blocks_nobody(server) -> None:
    """One client sends half a header and stops; 50 others connect at once and are all served; the stalled one is
    closed after the receive timeout (2 s here)."""
    port, _, _ = server
    stalled = Conn(port)
    stalled.sock.sendall(bytes([CMD["GET_DEVICE_MEMORY"]]) + b"\x04\x00")
    results: list[bool] = []

    def one() -> None:
        try:
            results.append(alive(port))
        except OSError:
            results.append(False)

    threads = [threading.Thread(target=one) for _ in range(50)]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results.count(True) == 50 and time.time() - t0 < 20
    assert refused(stalled)
    stalled.close()


def test_a_declared_but_unsent_payload_costs_no_memory(server) -> None:
    """SET_TENSOR declaring 256 MiB into a buffer that big, and GRAPH_COMPUTE declaring 200 MiB, then nothing: the
    server's resident memory does not grow by those sizes (it receives into the buffer, and grows a graph message only
    as its bytes arrive)."""
    port, pid, _ = server
    before = rss_kb(pid)
    with Conn(port) as a, Conn(port) as b:
        buf, base = a.alloc(256 << 20)
        assert buf
        a.send(CMD["SET_TENSOR"], tensor(buffer=buf, ne=(64 << 20,), data=base) + struct.pack("<Q", 0),
               size=296 + 8 + (256 << 20))
        b.send(CMD["GRAPH_COMPUTE"], b"", size=200 << 20)
        time.sleep(0.5)
        assert rss_kb(pid) - before < 64 << 10, (before, rss_kb(pid))
        assert refused(a) and refused(b)  # the receive timeout
    assert alive(port)


def test_too_many_clients_are_turned_away_and_the_rest_served(tmp_path: Path) -> None:
    with rpc_server(tmp_path / "log", "--max-clients", "2") as (port, _):
        time.sleep(0.5)  # the fixture's own probe connection has gone
        a, b = Conn(port), Conn(port)
        c = Conn(port, hello=False)
        assert refused(c)
        a.close(), b.close(), c.close()
        time.sleep(0.2)
        assert alive(port)
    assert "2 clients already" in (tmp_path / "log").read_text()


def test_an_idle_client_is_closed_after_the_idle_timeout(tmp_path: Path) -> None:
    with rpc_server(tmp_path / "log", "--idle-timeout", "1") as (port, _):
        c = Conn(port)
        assert refused(c)
        assert alive(port)
    assert "idle longer than --idle-timeout" in (tmp_path / "log").read_text()


# ---- the token


def test_with_a_token_a_client_without_it_is_refused_before_any_command(tmp_path: Path) -> None:
    log = tmp_path / "log"
    with rpc_server(log, token=TOKEN) as (port, _):
        c = Conn(port, hello=False)
        c.send(CMD["HELLO"], bytes(24))
        assert refused(c)  # no HELLO reply: closed
        c = Conn(port, hello=False)
        assert c.call(CMD["AUTH"], b"wrong") == b"\x00"
        assert refused(c)
        with Conn(port, token=TOKEN.encode()) as ok:
            assert ok.call(CMD["DEVICE_COUNT"]) == struct.pack("<I", 1)
    text = log.read_text()
    assert "no token" in text and "wrong token" in text


def test_the_cli_sends_the_token_through_its_relay(tmp_path: Path) -> None:
    cli = str(tool_path("llama-cli"))
    with rpc_server(tmp_path / "log", token=TOKEN) as (port, _):
        env = {**os.environ, "SPECEE_RPC_TOKEN": TOKEN}
        ok = subprocess.run([cli, "--rpc", f"127.0.0.1:{port}", "--list-devices"], capture_output=True, text=True,
                            timeout=60, env=env)
        assert ok.returncode == 0 and "RPC" in ok.stdout, ok.stderr
        env.pop("SPECEE_RPC_TOKEN")
        bad = subprocess.run([cli, "--rpc", f"127.0.0.1:{port}", "--list-devices"], capture_output=True, text=True,
                             timeout=60, env=env)
        assert bad.returncode == 1 and "does not answer as a ggml RPC server" in bad.stderr, bad.stderr
        env["SPECEE_RPC_TOKEN"] = "not-the-token"
        wrong = subprocess.run([cli, "--rpc", f"127.0.0.1:{port}", "--list-devices"], capture_output=True, text=True,
                               timeout=60, env=env)
        assert wrong.returncode == 1 and "the token was refused" in wrong.stderr, wrong.stderr


def test_python_sends_the_token_too(tiny_gguf: Path, tmp_path: Path) -> None:
    """In a process of its own: the RPC device it registers stays in ggml's registry after the server stops, and
    ggml's client aborts the process that later asks a stopped server for its memory."""
    import sys

    code = ("import sys, specee\n"
            "with specee.Model(sys.argv[1], n_ctx=64, n_threads=1, n_gpu_layers=2, rpc_servers=[sys.argv[2]]) as m:\n"
            "    assert 'RPC' in m.placement, m.placement\n"
            "    print(len(m.generate_tokens([1, 2, 3], max_tokens=4, mode='plain', ignore_eos=True)))\n")
    with rpc_server(tmp_path / "log", token=TOKEN) as (port, _):
        r = subprocess.run([sys.executable, "-c", code, str(tiny_gguf), f"127.0.0.1:{port}"], capture_output=True,
                           text=True, timeout=120, env={**os.environ, "SPECEE_RPC_TOKEN": TOKEN})
    assert r.returncode == 0 and r.stdout.strip() == "4", r.stderr[-2000:]


# ---- the client against junk and silence


class FakePeer:
    """A listener on 127.0.0.1 that answers every connection with `reply` (then keeps it open), or with nothing."""

    def __init__(self, reply: bytes | None) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.reply, self.conns, self.stop = reply, [], False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        self.sock.settimeout(0.2)
        for _ in range(600):  # at most 2 minutes
            if self.stop:
                return
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            self.conns.append(conn)
            if self.reply is not None:
                conn.recv(4096)
                conn.sendall(self.reply)

    def close(self) -> None:
        self.stop = True
        self.thread.join()
        for c in self.conns:
            c.close()
        self.sock.close()


@pytest.mark.parametrize("reply,what", [
    (b"\xff" * 64, "malformed reply"),                                       # junk
    (struct.pack("<Q", 2**63) + b"x" * 8, "malformed reply"),                # a HELLO reply with a huge size
    (struct.pack("<Q", 28) + bytes([4, 0, 0, 0]) + bytes(24), "protocol 4"),  # another protocol version
    (None, "no reply within 5 s"),                                           # silence
])
def test_the_cli_against_a_junk_or_silent_peer_exits_with_a_clear_error(reply: bytes | None, what: str) -> None:
    peer = FakePeer(reply)
    try:
        t0 = time.time()
        r = subprocess.run([str(tool_path("llama-cli")), "--rpc", f"127.0.0.1:{peer.port}", "--list-devices"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1, (r.returncode, r.stderr)  # an error, not a signal
        assert f"the RPC server at 127.0.0.1:{peer.port} does not answer" in r.stderr and what in r.stderr, r.stderr
        assert time.time() - t0 < 15
    finally:
        peer.close()


def test_python_against_a_silent_peer_raises_a_clear_error(tiny_gguf: Path) -> None:
    import specee

    peer = FakePeer(None)
    try:
        with pytest.raises(specee.SpecEEError, match="no reply within 5 s"):
            specee.Model(tiny_gguf, n_ctx=64, n_threads=1, n_gpu_layers=1, rpc_servers=[f"127.0.0.1:{peer.port}"])
    finally:
        peer.close()


# ---- the fuzzer, bounded


def test_the_protocol_fuzzer_finds_no_crash_or_hang(tmp_path: Path) -> None:
    """500 structured and random messages (tests/fuzz_rpc.py; scripts/sanitize.sh runs it under the sanitizers)."""
    import json
    import sys

    fuzzer = Path(__file__).with_name("fuzz_rpc.py")
    r = subprocess.run([sys.executable, str(fuzzer), "--messages", "500", "--seed", "7", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0 and summary["crashes"] == 0 and summary["hangs"] == 0, (summary, r.stderr[-2000:])
    assert summary["messages"] == 500 and summary["answered"] > 50 and summary["refused"] > 50
