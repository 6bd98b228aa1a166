"""A protocol fuzzer for specee-rpc-server (issue 25), beside tests/fuzz_gguf.py.

A server is started on 127.0.0.1 (one thread, a 1 s receive timeout, a 256 MiB budget, a time limit of its own). In
sessions of a few dozen messages (a handshake, then buffers allocated), the fuzzer sends:
- structured messages: every command with well-formed payloads, and graphs of the ops the server runs (ADD, MUL,
  RMS_NORM, SCALE, UNARY, MUL_MAT, GET_ROWS, SET_ROWS, SOFT_MAX, ROPE, CPY, CONT, CONCAT, GLU, FLASH_ATTN_EXT) with
  consistent small shapes, one op each or a chain of them with views (a layer's start), most of them then mutated: one field of one tensor (type, shape, strides, op, op
  parameters, sources, buffer, address, flags) or of the message (offsets, sizes, ids, node ids) set to an
  interesting value (0, +-1, 2^31, 2^32-1, 2^63, 2^64-1, a neighbour of the right value, a random one);
- typed graphs (issue 36): the ops with per-type kernels (MUL_MAT, GET_ROWS, SET_ROWS, FLASH_ATTN_EXT) with a
  random ggml type in one role (rows of 256 elements, whole blocks of every type);
- views: a VIEW of a tensor at a random offset with dense, padded, zero or short strides, then an op reading it
  (ADD, SCALE, GET_ROWS, CPY, MUL_MAT);
- recomputes: the index tensors of the session's last graph rewritten with values in and out of their rows
  (SET_TENSOR), then GRAPH_RECOMPUTE, which runs the last graph again;
- random messages: a random command byte, declared size and payload bytes (then the fuzzer closes its side, so a
  server waiting for the rest is not a hang).
After each message the fuzzer waits for the reply (or, for commands without one, for the reply to a DEVICE_COUNT
sent behind it) or for the server to close the connection. A server process that dies is a crash; no answer and no
close within 10 s is a hang; either saves the session's messages under --out and restarts the server.

    python tests/fuzz_rpc.py --messages 10000 --out /tmp/fuzz_rpc          # the documented long run
    python tests/fuzz_rpc.py --messages 300 --seed 1                       # the short CI run (scripts/sanitize.sh)
    python tests/fuzz_rpc.py --messages 100000 --seed 36 --server build/rpc-sanitize/specee-rpc-server
                                              # a sanitized build of the server alone (docs/hardening.md, issue 36)
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from rpc_wire import (CMD, F16, F32, GGML_TYPE_COUNT, I32, I64, NO_REPLY, OP, TENSOR, dense_nb, free_port, graph,
                      tensor, type_size)
from specee._tools import tool_path

INTERESTING = [0, 1, 2, 3, 4, 7, 8, 16, 31, 32, 33, 64, 255, 256, 4096, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
               2**63 - 1, 2**63, 2**64 - 1]
FIELD_BITS = {"id": 64, "type": 32, "buffer": 64, "ne": 32, "nb": 32, "op": 32, "op_params": 32, "flags": 32,
              "src": 64, "view_src": 64, "view_offs": 64, "data": 64}
BUF_SIZE = 1 << 16


# ---- the server


class Server:
    def __init__(self, log: Path, binary: Path | None = None) -> None:
        self.log = log
        self.binary = binary or tool_path("specee-rpc-server")
        self.start()

    def start(self) -> None:
        self.port = free_port()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([str(self.binary), "-p", str(self.port), "-t", "1",
                                          "--recv-timeout", "1", "--max-memory", "256", "--timeout", "3600"],
                                         stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while time.time() < deadline and self.proc.poll() is None:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise SystemExit(f"fuzz_rpc: the server did not start; see {self.log}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
        self.proc.wait(timeout=30)


# ---- a session


class Closed(Exception):
    pass


class Hang(Exception):
    pass


class Session:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sent: list[bytes] = []
        self.send_msg(CMD["HELLO"], bytes(24))
        self.expect_reply()
        self.buffers: list[tuple[int, int]] = []
        self.indices: list[tuple[bytes, int]] = []  # the last graph's index tensors (wire bytes, element size)
        self.pending: list[tuple[bytes, int]] = []  # those of the graph being sent
        self.has_graph = False
        self.follow = False  # a GRAPH_RECOMPUTE to send behind the next message
        for size in (BUF_SIZE, BUF_SIZE):
            self.send_msg(CMD["ALLOC_BUFFER"], struct.pack("<IQ", 0, size))
            buf, _ = struct.unpack("<QQ", self.expect_reply())
            self.send_msg(CMD["BUFFER_GET_BASE"], struct.pack("<Q", buf))
            (base,) = struct.unpack("<Q", self.expect_reply())
            self.buffers.append((buf, base))

    def send_msg(self, cmd: int, payload: bytes, size: int | None = None) -> None:
        raw = bytes([cmd]) + struct.pack("<Q", len(payload) if size is None else size) + payload
        self.sent.append(raw)
        try:
            self.sock.sendall(raw)
        except OSError as e:
            raise Closed() from e

    def recv_exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            try:
                chunk = self.sock.recv(min(n - len(out), 1 << 20))
            except socket.timeout as e:
                raise Hang() from e
            except OSError as e:
                raise Closed() from e
            if not chunk:
                raise Closed()
            out += chunk
        return out

    def expect_reply(self) -> bytes:
        (n,) = struct.unpack("<Q", self.recv_exact(8))
        if n > 1 << 24:
            raise AssertionError(f"a reply of {n} bytes")
        return self.recv_exact(n)

    def wait_closed(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)
            while self.recv_exact(1):
                pass
        except (Closed, OSError):
            return

    def close(self) -> None:
        self.sock.close()


# ---- structured messages


def region(rng: random.Random, s: Session, nbytes: int) -> tuple[int, int]:
    """(buffer, address) of nbytes somewhere inside one of the session's buffers."""
    buf, base = rng.choice(s.buffers)
    return buf, base + rng.randrange(0, (BUF_SIZE - nbytes) // 64 + 1) * 64


class GraphBuilder:
    def __init__(self, rng: random.Random, s: Session) -> None:
        self.rng, self.s, self.tensors, self.next_id = rng, s, [], 1
        self.where: dict[int, tuple[int, int]] = {}
        s.pending = []

    def add(self, ne: tuple[int, ...], type: int = F32, op: str = "NONE", src: tuple[int, ...] = (),
            view_of: int = 0, **kw) -> int:
        """A tensor in a fresh region, or (view_of) over the bytes of an earlier one, as views and reshapes are."""
        ne = tuple(ne) + (1,) * (4 - len(ne))
        nb = kw.pop("nb", None) or (dense_nb(type, ne) if type_size(type) else None)
        n = min(nb[3] * ne[3] if nb else ne[0] * ne[1] * ne[2] * ne[3] * 4, BUF_SIZE // 2)
        buf, data = self.where[view_of] if view_of else region(self.rng, self.s, n)
        data += kw.pop("offset", 0)
        tid = self.next_id
        self.next_id += 1
        self.where[tid] = (buf, data)
        if view_of:
            kw["view_src"] = view_of
        raw = tensor(id=tid, type=type, buffer=buf, ne=ne, nb=nb, op=OP[op], src=src, data=data, **kw)
        self.tensors.append(raw)
        if type in (I32, I64) and op == "NONE":
            self.s.pending.append((raw, 4 if type == I32 else 8))
        return tid


def op_graph(rng: random.Random, s: Session) -> bytes:
    """A small graph of one op with consistent shapes (the row indices zero, as fresh buffers hold)."""
    g = GraphBuilder(rng, s)
    n0, n1, n2 = rng.choice([4, 8, 16]), rng.randint(1, 4), rng.randint(1, 2)
    kind = rng.choice(["ADD", "MUL", "RMS_NORM", "SCALE", "UNARY", "MUL_MAT", "GET_ROWS", "SET_ROWS", "SOFT_MAX",
                       "ROPE", "CPY", "CONT", "CONCAT", "GLU", "FLASH_ATTN_EXT"])
    a = g.add((n0, n1, n2))
    if kind in ("ADD", "MUL"):
        out = g.add((n0, n1, n2), op=kind, src=(a, g.add((n0, 1, 1))))
    elif kind in ("RMS_NORM", "SCALE"):
        out = g.add((n0, n1, n2), op=kind, src=(a,), op_params=(struct.unpack("<i", struct.pack("<f", 1e-5))[0],))
    elif kind == "UNARY":
        out = g.add((n0, n1, n2), op=kind, src=(a,), op_params=(rng.randrange(0, 12),))
    elif kind == "MUL_MAT":
        w = g.add((n0, 5, n2), type=rng.choice([F32, F16]))
        out = g.add((5, n1, n2), op=kind, src=(w, a))
    elif kind == "GET_ROWS":
        idx = g.add((3, n2), type=I32)
        out = g.add((n0, 3, n2), op=kind, src=(a, idx))
    elif kind == "SET_ROWS":
        dst = g.add((n0, 6, n2))
        idx = g.add((n1, 1), type=rng.choice([I32, I64]))
        out = g.add((n0, 6, n2), op=kind, src=(a, idx), view_src=dst)
    elif kind == "SOFT_MAX":
        out = g.add((n0, n1, n2), op=kind, src=(a, g.add((n0, n1), type=F16)), op_params=(0x3F800000,))
    elif kind == "ROPE":
        pos = g.add((n2,), type=I32)
        out = g.add((n0, n1, n2), op=kind, src=(a, pos), op_params=(0, n0, rng.choice([0, 2]), 0, 0, 0x461C4000,
                                                                       0x3F800000, 0, 0x3F800000, 0x42000000, 0x3F800000))
    elif kind in ("CPY", "CONT"):
        dst = g.add((n0 * n1 * n2,), type=rng.choice([F32, F16]))
        out = g.add((n0 * n1 * n2,), type=F32, op=kind, src=(a, dst) if kind == "CPY" else (a,))
    elif kind == "CONCAT":
        out = g.add((n0, n1 * 2, n2), op=kind, src=(a, g.add((n0, n1, n2))), op_params=(1,))
    elif kind == "GLU":
        out = g.add((n0, n1, n2), op=kind, src=(a, g.add((n0, n1, n2))), op_params=(2, 0))
    else:  # FLASH_ATTN_EXT: q (D, n_q, heads), k and v (D, n_kv, heads), mask (n_kv, n_q)
        k, v = g.add((n0, 8, n2), type=F16), g.add((n0, 8, n2), type=F16)
        mask = g.add((8, n1), type=F16)
        out = g.add((n0, n2, n1), op=kind, src=(a, k, v, mask), op_params=(0x3F800000, 0, 0))
    return graph([out], g.tensors)


TYPED = [("MUL_MAT", "a"), ("MUL_MAT", "b"), ("GET_ROWS", "a"), ("SET_ROWS", "dst"), ("FLASH_ATTN_EXT", "k"),
         ("FLASH_ATTN_EXT", "v")]


def typed_graph(rng: random.Random, s: Session) -> bytes:
    """One op with a per-type kernel, a random ggml type in one of its typed roles (issue 36's class)."""
    g = GraphBuilder(rng, s)
    op, role = rng.choice(TYPED)
    t = rng.randrange(GGML_TYPE_COUNT)
    ty = lambda r, default: t if r == role else default
    if op == "MUL_MAT":
        a, b = g.add((256, 4), type=ty("a", F16)), g.add((256, 2), type=ty("b", F32))
        out = g.add((4, 2), op=op, src=(a, b))
    elif op == "GET_ROWS":
        a, idx = g.add((256, 4), type=ty("a", F32)), g.add((2,), type=I32)
        out = g.add((256, 2), op=op, src=(a, idx))
    elif op == "SET_ROWS":
        a, idx = g.add((256, 2)), g.add((2,), type=rng.choice([I32, I64]))
        out = g.add((256, 4), type=ty("dst", F16), op=op, src=(a, idx))
    else:
        q, k, v = g.add((256, 1, 1)), g.add((256, 8, 1), type=ty("k", F16)), g.add((256, 8, 1), type=ty("v", F16))
        out = g.add((256, 1, 1), op=op, src=(q, k, v, g.add((8, 1), type=F16)), op_params=(0x3F800000, 0, 0))
    return graph([out], g.tensors)


def view_graph(rng: random.Random, s: Session) -> bytes:
    """A VIEW of a tensor at a random offset with dense, padded, zero or short strides, and an op that reads it."""
    g = GraphBuilder(rng, s)
    n0, n1 = rng.choice([4, 8, 16]), rng.randint(1, 4)
    base = g.add((n0 * 4, n1 * 4))
    row = rng.choice([4 * n0, 8 * n0, 16 * n0, 0, 4, 2 * n0])
    nb = (rng.choice([4, 4, 4, 0, 2, 8]), row, row * n1, row * n1 * rng.choice([1, 2]))
    view = g.add((n0, n1), op="VIEW", src=(base,), view_of=base, nb=nb, offset=rng.choice([0, 4, 64, 4 * n0 * n1]),
                 view_offs=rng.choice([0, 4, 64]))
    kind = rng.choice(["ADD", "SCALE", "GET_ROWS", "CPY", "MUL_MAT"])
    if kind == "ADD":
        out = g.add((n0, n1), op=kind, src=(view, g.add((n0,))))
    elif kind == "SCALE":
        out = g.add((n0, n1), op=kind, src=(view,), op_params=(0x3F000000, 0))
    elif kind == "GET_ROWS":
        out = g.add((n0, 2), op=kind, src=(view, g.add((2,), type=I32)))
    elif kind == "CPY":
        out = g.add((n0, n1), type=F16, op=kind, src=(view, g.add((n0, n1), type=F16)))
    else:
        out = g.add((n1, 3), op=kind, src=(view, g.add((n0, 3))))
    return graph([view, out], g.tensors)


def index_rewrite(rng: random.Random, s: Session) -> bytes:
    """SET_TENSOR of one of the last graph's index tensors: values in and out of its rows."""
    raw, size = rng.choice(s.indices)
    ne = struct.unpack_from("<4I", raw, 20)
    n = ne[0] * ne[1] * ne[2] * ne[3]
    values = [rng.choice([0, 0, 1, 2, 3, -1, 4, 5, 6, 8, 2**31 - 1, -2**31]) for _ in range(min(n, 64))]
    return raw + struct.pack("<Q", 0) + struct.pack(f"<{len(values)}{'i' if size == 4 else 'q'}", *values)


def layer_graph(rng: random.Random, s: Session) -> bytes:
    """A chain as a Llama layer's start has it: RMS_NORM, MUL by a weight, MUL_MAT, RESHAPE to heads, ROPE, then a
    PERMUTE view, CONT, SCALE and GLU."""
    g = GraphBuilder(rng, s)
    hd, n_head, n_tok = rng.choice([4, 8]), rng.randint(1, 3), rng.randint(1, 4)
    d = hd * n_head
    x = g.add((d, n_tok))
    norm = g.add((d, n_tok), op="RMS_NORM", src=(x,), op_params=(0x3727C5AC,))
    mul = g.add((d, n_tok), op="MUL", src=(norm, g.add((d,))))
    q = g.add((d, n_tok), op="MUL_MAT", src=(g.add((d, d), type=rng.choice([F32, F16])), mul))
    q3 = g.add((hd, n_head, n_tok), op="RESHAPE", src=(q,), view_of=q)
    pos = g.add((n_tok,), type=I32)
    qr = g.add((hd, n_head, n_tok), op="ROPE", src=(q3, pos), op_params=(0, hd, 2, 0, 0, 0x461C4000, 0x3F800000, 0,
                                                                         0x3F800000, 0x42000000, 0x3F800000))
    perm = g.add((hd, n_tok, n_head), op="PERMUTE", src=(qr,), view_of=qr,
                 nb=(4, 4 * hd * n_head, 4 * hd, 4 * hd * n_head * n_tok), op_params=(0, 2, 1, 3))
    cont = g.add((hd, n_tok, n_head), op="CONT", src=(perm,))
    scaled = g.add((hd, n_tok, n_head), op="SCALE", src=(cont,), op_params=(0x3F000000, 0))
    out = g.add((hd, n_tok, n_head), op="GLU", src=(scaled, cont), op_params=(2, 0))
    return graph([norm, mul, q, q3, qr, perm, cont, scaled, out], g.tensors)


def mutate_tensor(rng: random.Random, raw: bytes) -> bytes:
    fields = list(TENSOR.unpack(raw))
    # flat layout: id, type, buffer, ne x4, nb x4, op, op_params x16, flags, src x10, view_src, view_offs, data
    spans = {"id": [0], "type": [1], "buffer": [2], "ne": range(3, 7), "nb": range(7, 11), "op": [11],
             "op_params": range(12, 28), "flags": [28], "src": range(29, 39), "view_src": [39], "view_offs": [40],
             "data": [41]}
    name = rng.choice(list(spans))
    i = rng.choice(list(spans[name]))
    bits = FIELD_BITS[name]
    v = rng.choice([rng.choice(INTERESTING), fields[i] + rng.choice([-1, 1, -64, 64, 4096]), rng.getrandbits(bits)])
    v %= 2**bits
    if name in ("op_params", "flags"):
        v = struct.unpack("<i", struct.pack("<I", v))[0]
    fields[i] = v
    return TENSOR.pack(*fields)


def mutate_graph(rng: random.Random, msg: bytes) -> bytes:
    n_nodes = struct.unpack_from("<I", msg, 4)[0]
    head = 8 + 8 * n_nodes + 4
    n = (len(msg) - head) // TENSOR.size
    r = rng.random()
    if r < 0.7 and n:
        k = rng.randrange(n)
        at = head + k * TENSOR.size
        return msg[:at] + mutate_tensor(rng, msg[at:at + TENSOR.size]) + msg[at + TENSOR.size:]
    if r < 0.85:  # a node id, the device or a count
        at = rng.choice([0, 4, 8, head - 4])
        width = 8 if at == 8 else 4
        v = rng.choice(INTERESTING) % 2 ** (8 * width)
        return msg[:at] + v.to_bytes(width, "little") + msg[at + width:]
    return msg[: rng.randrange(len(msg))]  # cut short (the size declared is the bytes sent)


def structured(rng: random.Random, s: Session) -> tuple[int, bytes, int | None]:
    """(command, payload, declared size or None) of one structured message, mutated most of the time."""
    buf, data = region(rng, s, 256)
    t = tensor(buffer=buf, ne=(rng.choice([1, 4, 16, 64]),), data=data)
    if rng.random() < 0.5:
        t = mutate_tensor(rng, t)
    off, size = rng.choice([0, 4, 60, 64, 2**63, 2**64 - 8]), rng.choice([0, 4, 64, 256, 2**32, 2**64 - 1])
    if rng.random() < 0.7:
        off, size = rng.choice([0, 4, 8]), rng.choice([0, 4, 8, 16])
    cmd = rng.choice(["SET_TENSOR", "GET_TENSOR", "COPY_TENSOR", "MEMSET_TENSOR", "GRAPH_COMPUTE", "GRAPH_COMPUTE",
                      "GRAPH_COMPUTE", "GRAPH_COMPUTE", "GRAPH_RECOMPUTE", "GRAPH_RECOMPUTE", "SET_INDICES",
                      "SET_INDICES", "ALLOC_BUFFER", "FREE_BUFFER", "BUFFER_CLEAR",
                      "BUFFER_GET_BASE", "INIT_TENSOR", "GET_ALLOC_SIZE", "GET_ALIGNMENT", "GET_MAX_SIZE",
                      "GET_DEVICE_MEMORY", "DEVICE_COUNT", "SET_TENSOR_HASH", "HELLO"])
    q = struct.pack
    if s.indices and rng.random() < 0.4:
        cmd = "SET_INDICES"
    if cmd == "SET_INDICES" and s.indices:
        s.follow = rng.random() < 0.8  # and then, most of the time, GRAPH_RECOMPUTE behind it
        return CMD["SET_TENSOR"], index_rewrite(rng, s), None
    if cmd in ("SET_INDICES", "GRAPH_RECOMPUTE") and not s.has_graph and rng.random() < 0.9:
        cmd = "GRAPH_COMPUTE"  # a recompute without a graph is refused at once: rarely worth a message
    elif cmd == "SET_INDICES":
        cmd = "GRAPH_RECOMPUTE"
    pick = rng.random()
    make = op_graph if pick < 0.45 else typed_graph if pick < 0.65 else view_graph if pick < 0.85 else layer_graph
    payload = {
        "SET_TENSOR": lambda: t + q("<Q", off) + bytes(rng.choice([0, 4, 16, 64])),
        "GET_TENSOR": lambda: t + q("<QQ", off, size),
        "COPY_TENSOR": lambda: t + mutate_tensor(rng, tensor(buffer=buf, ne=(16,), data=data)),
        "MEMSET_TENSOR": lambda: t + q("<QQB", off, size, 7),
        "GRAPH_COMPUTE": lambda: (mutate_graph if rng.random() < 0.6 else lambda _, m: m)(rng, make(rng, s)),
        "GRAPH_RECOMPUTE": lambda: q("<I", rng.choice([0, 0, 1])),
        "ALLOC_BUFFER": lambda: q("<IQ", rng.choice([0, 0, 1]), rng.choice([0, 64, 4096, 2**28, 2**40, 2**64 - 1])),
        "FREE_BUFFER": lambda: q("<Q", rng.choice([buf, buf + 1, 0, 2**64 - 1])),
        "BUFFER_CLEAR": lambda: q("<QB", rng.choice([buf, buf + 7, 0]), 0),
        "BUFFER_GET_BASE": lambda: q("<Q", rng.choice([buf, 3, 0])),
        "INIT_TENSOR": lambda: t,
        "GET_ALLOC_SIZE": lambda: q("<I", rng.choice([0, 0, 2])) + t + b"".join(tensor() for _ in range(10)),
        "SET_TENSOR_HASH": lambda: t + q("<QQ", off, rng.getrandbits(64)),
        "HELLO": lambda: bytes(24),
    }.get(cmd, lambda: q("<I", rng.choice([0, 0, 5])) if cmd != "DEVICE_COUNT" else b"")()
    return CMD[cmd], payload, None


def random_message(rng: random.Random) -> tuple[int, bytes, int | None]:
    cmd = rng.choice([rng.randrange(256), rng.randrange(18), rng.randrange(18)])
    payload = rng.randbytes(rng.choice([0, 1, 8, 24, 296, 304, 600, rng.randrange(4096)]))
    size = rng.choice([None, None, rng.choice(INTERESTING), len(payload) + rng.randint(-8, 8)])
    return cmd, payload, size if size is None or size >= 0 else 0


# ---- the loop


def run_one(s: Session, cmd: int, payload: bytes, size: int | None) -> str:
    """Sends one message; 'answered' or 'refused' (the server closed the connection); raises Hang."""
    try:
        s.send_msg(cmd, payload, size)
        if s.follow:
            s.follow = False
            s.send_msg(CMD["GRAPH_RECOMPUTE"], struct.pack("<I", 0))
        if size is not None and size != len(payload):
            s.wait_closed()  # the server may wait for the rest: our side ends the message
            return "refused"
        if cmd in NO_REPLY:
            s.send_msg(CMD["DEVICE_COUNT"], b"")
        s.expect_reply()
        if cmd == CMD["GRAPH_COMPUTE"]:
            s.indices, s.has_graph = s.pending, True  # the graph was taken: a recompute runs it again
        return "answered"
    except Closed:
        return "refused"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=1000, help="messages to send (default: 1000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("build/fuzz_rpc"), help="saved crashes and hangs, the log")
    ap.add_argument("--per-session", type=int, default=40, help="messages per connection at most (default: 40)")
    ap.add_argument("--server", type=Path, default=None,
                    help="the specee-rpc-server binary to fuzz (default: the installed one), e.g. a sanitized build")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    server = Server(args.out / "server.log", args.server)
    counts = {"answered": 0, "refused": 0, "crashes": 0, "hangs": 0}
    t0, sent = time.time(), 0
    last_sent: list[bytes] = []
    try:
        while sent < args.messages:
            try:
                s = Session(server.port)
            except (Closed, Hang, OSError):
                # the server may still be writing its sanitizer report: give it time to end
                for _ in range(100):
                    if not server.alive():
                        break
                    time.sleep(0.05)
                if server.alive():
                    raise
                counts["crashes"] += 1
                name = args.out / f"crashes-{sent}.bin"
                name.write_bytes(b"".join(last_sent))
                print(f"fuzz_rpc: the server died after message {sent}; the last session saved to {name}",
                      file=sys.stderr)
                server.stop()
                server.start()
                continue
            outcome = "answered"
            for _ in range(rng.randint(1, args.per_session)):
                if sent >= args.messages or outcome != "answered":
                    break
                msg = structured(rng, s) if rng.random() < 0.8 else random_message(rng)
                sent += 1
                try:
                    outcome = run_one(s, *msg)
                except Hang:
                    outcome = "hangs"
                if outcome == "refused" and not server.alive():
                    outcome = "crashes"
                counts[outcome] += 1
            s.close()
            last_sent = s.sent
            if outcome in ("crashes", "hangs") or not server.alive():
                name = args.out / f"{outcome}-{sent}.bin"
                name.write_bytes(b"".join(s.sent))
                print(f"fuzz_rpc: {outcome} after message {sent}; the session saved to {name}", file=sys.stderr)
                server.stop()
                server.start()
    finally:
        server.stop()
    summary = {"messages": sent, "seconds": round(time.time() - t0, 1), **counts, "seed": args.seed}
    print(json.dumps(summary))
    if counts["crashes"] or counts["hangs"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
