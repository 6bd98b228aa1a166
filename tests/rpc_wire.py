"""A small client of ggml's RPC protocol (version 5, as csrc/rpc/specee-rpc-proto.h describes it) for the RPC tests and
tests/fuzz_rpc.py: messages built field by field, so a test can break any of them, and a server started on
127.0.0.1 with a time limit of its own."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import socket
import struct
import subprocess
import time
from pathlib import Path
from typing import Iterator, Sequence

import libggml

from specee._tools import free_port, tool_path

# id, type, buffer, ne[4], nb[4], op, op_params[16], flags, src[10], view_src, view_offs, data, name[64], padding[4]
TENSOR = struct.Struct("<QIQ4I4II16ii10QQQQ64s4s")
assert TENSOR.size == 296

CMD = dict(ALLOC_BUFFER=0, GET_ALIGNMENT=1, GET_MAX_SIZE=2, BUFFER_GET_BASE=3, FREE_BUFFER=4, BUFFER_CLEAR=5,
           SET_TENSOR=6, SET_TENSOR_HASH=7, GET_TENSOR=8, COPY_TENSOR=9, GRAPH_COMPUTE=10, GET_DEVICE_MEMORY=11,
           INIT_TENSOR=12, GET_ALLOC_SIZE=13, HELLO=14, DEVICE_COUNT=15, GRAPH_RECOMPUTE=16, MEMSET_TENSOR=17,
           AUTH=0xA0)
NO_REPLY = {CMD["SET_TENSOR"], CMD["GRAPH_COMPUTE"], CMD["GRAPH_RECOMPUTE"]}
F32, F16, Q4_0, Q8_0, Q8_1, Q8_K, IQ2_XXS, I8, I32, I64, F64, BF16 = 0, 1, 2, 8, 9, 15, 16, 24, 26, 27, 28, 30


def _ggml_ops() -> dict[str, int]:
    """GGML_OP_* values of the installed ggml, read from its header."""
    header = Path(list(libggml.__path__)[0]) / "include" / "ggml.h"
    body = re.search(r"enum ggml_op \{(.*?)\};", header.read_text(), re.S).group(1)
    names = re.findall(r"^\s*GGML_OP_(\w+)", body, re.M)
    return {name: i for i, name in enumerate(names)}


OP = _ggml_ops()


def _ggml_base() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(Path(list(libggml.__path__)[0]) / "lib" / "libggml-base.so"))
    lib.ggml_type_size.restype, lib.ggml_type_size.argtypes = ctypes.c_size_t, [ctypes.c_int]
    lib.ggml_blck_size.restype, lib.ggml_blck_size.argtypes = ctypes.c_int64, [ctypes.c_int]
    return lib


_BASE = _ggml_base()
GGML_TYPE_COUNT = int(re.search(r"GGML_TYPE_COUNT\s*=\s*(\d+)", (Path(list(libggml.__path__)[0]) / "include" /
                                                                "ggml.h").read_text()).group(1))


def type_size(t: int) -> int:
    """Bytes of one block of ggml type t (0 for removed types), from the installed ggml."""
    return _BASE.ggml_type_size(t)


def blck_size(t: int) -> int:
    return _BASE.ggml_blck_size(t)


def row_size(t: int, n: int) -> int:
    return type_size(t) * n // blck_size(t)


def dense_nb(t: int, ne: Sequence[int]) -> list[int]:
    """The strides ggml gives a new tensor of type t and shape ne."""
    ne = list(ne) + [1] * (4 - len(ne))
    nb = [type_size(t), row_size(t, ne[0])]
    nb += [nb[1] * ne[1], nb[1] * ne[1] * ne[2]]
    return nb


def tensor(id: int = 1, type: int = F32, buffer: int = 0, ne: Sequence[int] = (1, 1, 1, 1),
           nb: Sequence[int] | None = None, op: int = 0, op_params: Sequence[int] = (), flags: int | None = None,
           src: Sequence[int] = (), view_src: int = 0, view_offs: int = 0, data: int = 0, name: bytes = b"") -> bytes:
    """One wire tensor; nb defaults to the contiguous strides of a 4-byte (or 2-byte for F16) element (8 for I64), flags to
    GGML_TENSOR_FLAG_COMPUTE (16) for a tensor with an op (ggml's CPU backend skips nodes without it)."""
    if flags is None:
        flags = 16 if op else 0
    ne = list(ne) + [1] * (4 - len(ne))
    if nb is None:
        nb = [{F16: 2, I64: 8}.get(type, 4)]
        for i in range(3):
            nb.append(nb[-1] * ne[i])
    params = list(op_params) + [0] * (16 - len(op_params))
    srcs = list(src) + [0] * (10 - len(src))
    return TENSOR.pack(id, type, buffer, *ne, *nb, op, *params, flags, *srcs, view_src, view_offs, data, name, b"")


def graph(nodes: Sequence[int], tensors: Sequence[bytes], device: int = 0) -> bytes:
    return (struct.pack("<II", device, len(nodes)) + b"".join(struct.pack("<Q", n) for n in nodes) +
            struct.pack("<I", len(tensors)) + b"".join(tensors))


class Conn:
    """One connection; `hello` does the handshake (after AUTH when a token is given)."""

    def __init__(self, port: int, hello: bool = True, token: bytes | None = None, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        if token is not None:
            assert self.call(CMD["AUTH"], token) == b"\x01"
        if hello:
            rsp = self.call(CMD["HELLO"], bytes(24))
            assert len(rsp) == 28 and rsp[0] == 5, rsp

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "Conn":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, cmd: int, payload: bytes, size: int | None = None) -> None:
        """A request; `size` declares another payload size than the bytes sent."""
        self.sock.sendall(bytes([cmd]) + struct.pack("<Q", len(payload) if size is None else size) + payload)

    def recv_exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("closed")
            out += chunk
        return out

    def call(self, cmd: int, payload: bytes = b"") -> bytes:
        self.send(cmd, payload)
        (n,) = struct.unpack("<Q", self.recv_exact(8))
        return self.recv_exact(n)

    def alloc(self, size: int) -> tuple[int, int]:
        buf, got = struct.unpack("<QQ", self.call(CMD["ALLOC_BUFFER"], struct.pack("<IQ", 0, size)))
        if buf == 0:
            return 0, 0
        (base,) = struct.unpack("<Q", self.call(CMD["BUFFER_GET_BASE"], struct.pack("<Q", buf)))
        return buf, base

    def closed_by_peer(self, timeout: float = 10.0) -> bool:
        """The server closed this connection (within `timeout`), with nothing more to say."""
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False


@contextlib.contextmanager
def rpc_server(log: Path, *args: str, token: str | None = None, limit_s: int = 600) -> Iterator[tuple[int, int]]:
    """A specee-rpc-server on 127.0.0.1 and a free port, one thread, ending by itself after `limit_s`; yields (port,
    pid) and stops it on the way out."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "SPECEE_RPC_TOKEN"}
    if token is not None:
        env["SPECEE_RPC_TOKEN"] = token
    with open(log, "ab") as out:
        proc = subprocess.Popen([str(tool_path("specee-rpc-server")), "-p", str(port), "-t", "1", "--timeout",
                                 str(limit_s), *args], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + 60
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None and time.time() < deadline, log.read_text()
            time.sleep(0.05)
        yield port, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)
