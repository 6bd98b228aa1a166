"""A grammar and JSON-schema fuzzer for the grammar front door (issue 46): the library and the server.

Cases, from a seeded random generator:
- real: schemas and grammars as users write them (a person, an order, pydantic-style $defs, tool calls, llama.cpp's
  arithmetic / list / JSON GBNF, Lark with %json, regular expressions);
- mutated: a real schema with one value set to an edge (huge or negative bounds, a wrong type, a $ref to itself,
  nesting added), or its text with bytes flipped, cut, spliced or repeated;
- hostile: the classes issue 46 found, at random scales around and far past the limits: $ref chains, anyOf + $ref
  nesting, self / mutually recursive $refs, recursive objects, GBNF chains of rules, one rule of many alternatives,
  huge repetition bounds ({0,1000000000}, minItems 10^9), deep groups and deep JSON, long texts;
- random: random JSON values and random grammar-looking text.

Library run: a worker process loads SmolLM2 and compiles each case through the bindings (`_core.grammar_check`:
the front door's limits, the compile on its worker within its budget, the first mask); the parent gives each case a
time limit; a worker killed by a signal is a crash, one past the limit a hang (both saved, the worker restarted);
every refusal must be a SpecEEError of one short line. Server run: specee-server on 127.0.0.1, each case as
/completion's `json_schema` or `grammar` with n_predict 1; every answer must be 200 or 400 within the time limit,
/health is asked every 0.2 s meanwhile (its slowest answer reported), and the server's RSS before and after (the
start: after a plain request and one small schema, which load the engine and build its tokenizer once, ~25 MB).

    python tests/fuzz_grammar.py --cases 10000 --seed 46 --out /tmp/fuzz-grammar            # the library
    python tests/fuzz_grammar.py --server --cases 2000 --seed 47 --out /tmp/fuzz-grammar-srv   # the server
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

TYPES = {"gbnf": 1, "json_schema": 2, "lark": 3, "regex": 4}  # enum specee_grammar_type

# ---- real cases ---------------------------------------------------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"]}
ORDER = {"type": "object", "properties": {"order": {"type": "object", "properties": {
    "id": {"type": "integer"}, "status": {"enum": ["paid", "open", "void"]},
    "items": {"type": "array", "maxItems": 4, "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "quantity": {"type": "integer"}},
        "required": ["sku", "quantity"]}}}, "required": ["id", "status", "items"]}}, "required": ["order"]}
PYDANTIC = {"$defs": {"Pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                                               "name": {"type": "string"}}},
                      "Owner": {"type": "object", "properties": {"pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}},
                                                                 "name": {"type": "string"}}}},
            "$ref": "#/$defs/Owner"}
TOOLS = {"anyOf": [{"type": "object", "required": ["tool_calls"], "additionalProperties": False, "properties": {
    "tool_calls": {"type": "array", "minItems": 1, "items": {"anyOf": [{"type": "object", "required": ["name", "arguments"],
    "properties": {"name": {"const": "get_weather"}, "arguments": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}]}}}},
    {"type": "object", "required": ["response"], "properties": {"response": {"type": "string"}}}]}
SCHEMAS = [PERSON, ORDER, PYDANTIC, TOOLS, {}, {"type": "array", "items": {"type": "number"}, "maxItems": 8},
           {"type": "string", "format": "date"}, {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}]
GBNF = [
    'root ::= expr\nexpr ::= term ([-+*/] term){0,3}\nterm ::= num | "(" expr ")"\nnum ::= [1-9] [0-9]{0,2}\n',
    'root ::= item{1,4}\nitem ::= "- " [a-z]{1,12} "\\n"\n',
    'root ::= object\nvalue ::= object | array | string | number | ("true" | "false" | "null")\n'
    'object ::= "{" ( string ":" value ("," string ":" value){0,3} )? "}"\narray ::= "[" (value ("," value){0,3})? "]"\n'
    'string ::= "\\"" [a-z]{0,16} "\\""\nnumber ::= "-"? [0-9]{1,6}\n',
    'root ::= ("yes" | "no") "."\n',
]
LARK = ['start: "a"+ "b"\n', 'start: item+\nitem: /[a-z]+/ " "\n',
        'start: "x" obj\nobj: %json {"type": "object", "properties": {"a": {"type": "integer"}}}\n']
REGEX = [r"[0-9]{3}-[0-9]{4}", r"(ab|cd)+", r"[a-z]{1,10}@[a-z]{2,8}\.com"]


def real(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["json_schema", "json_schema", "gbnf", "lark", "regex"])
    if kind == "json_schema":
        return kind, json.dumps(rng.choice(SCHEMAS))
    return kind, rng.choice({"gbnf": GBNF, "lark": LARK, "regex": REGEX}[kind])


# ---- mutations ----------------------------------------------------------------------------------------------

EDGE_VALUES: list[Any] = [0, -1, 1, 2**31, 2**63, 10**9, 1e308, -1e308, 0.5, "", "x" * 1000, None, True, [], {},
                          {"$ref": "#"}, {"$ref": "#/$defs/nope"}, {"type": "objekt"}, [1] * 50, {"not": {}}]
KEYS = ["minItems", "maxItems", "minLength", "maxLength", "minimum", "maximum", "multipleOf", "pattern", "type",
        "enum", "const", "anyOf", "items", "properties", "required", "additionalProperties", "$ref", "format",
        "minProperties", "maxProperties", "prefixItems", "uniqueItems"]


def nodes(v: Any) -> list[Any]:
    """Every dict in a JSON value, by a loop."""
    out, todo = [], [v]
    while todo:
        x = todo.pop()
        if isinstance(x, dict):
            out.append(x)
            todo.extend(x.values())
        elif isinstance(x, list):
            todo.extend(x)
    return out


def mutate_json(rng: random.Random) -> tuple[str, str]:
    schema = json.loads(json.dumps(rng.choice(SCHEMAS)))
    for _ in range(rng.randint(1, 4)):
        target = rng.choice(nodes(schema) or [schema]) if isinstance(schema, dict) else schema
        if isinstance(target, dict):
            target[rng.choice(KEYS)] = json.loads(json.dumps(rng.choice(EDGE_VALUES)))  # a copy: no cycles
    if rng.random() < 0.2:
        for _ in range(rng.randint(1, 40)):
            schema = {"type": "array", "items": schema} if rng.random() < 0.5 else {"anyOf": [schema, {"type": "null"}]}
    return "json_schema", json.dumps(schema)


def mutate_text(rng: random.Random) -> tuple[str, str]:
    kind, text = real(rng)
    b = bytearray(text.encode())
    for _ in range(rng.randint(1, 6)):
        op = rng.randrange(5)
        i = rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[min(i, len(b) - 1)] = rng.choice(b"{}[]()|\"'\\:*+?~,.0123456789$#/ \n")
        elif op == 1:
            del b[i:i + rng.randint(1, 20)]
        elif op == 2:
            b[i:i] = b[rng.randrange(len(b) + 1):][:rng.randint(1, 40)] * rng.randint(1, 50)
        elif op == 3:
            b[i:i] = rng.choice([b"{0,1000000000}", b"{99999}", b"(" * 100, b"|" * 200, b"\x00", b"\xff\xfe",
                                 b'"$ref": "#"', b"%json {", b"::= ::=", b"[^"])
        else:
            b = b[:i]
    return kind, b.decode("utf-8", "replace").replace("\x00", "")


# ---- the hostile classes, scaled ------------------------------------------------------------------------------

def scale(rng: random.Random) -> int:
    return rng.choice([1, 2, 10, 100, 500, 1000, 2000, 5000, 8000, rng.randint(1, 20000)])


def ref_chain(n: int) -> str:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return json.dumps({"$defs": defs, "$ref": "#/$defs/d0"})


def anyof_ref_chain(n: int) -> str:
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "null"}]} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return json.dumps({"$defs": defs, "$ref": "#/$defs/d0"})


def deep_json(n: int) -> str:
    return '{"type":"array","items":' * n + '{"type":"integer"}' + "}" * n


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "x"\n'


def gbnf_alternatives(n: int) -> str:
    return "root ::= " + " | ".join(f'"w{i}"' for i in range(n)) + "\n"


def hostile(rng: random.Random) -> tuple[str, str]:
    n = scale(rng)
    pick = rng.randrange(14)
    if pick == 0:
        return "json_schema", ref_chain(n)
    if pick == 1:
        return "json_schema", anyof_ref_chain(n)
    if pick == 2:
        return "json_schema", json.dumps({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})
    if pick == 3:
        return "json_schema", json.dumps({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}},
                                          "$ref": "#/$defs/a"})
    if pick == 4:
        return "json_schema", json.dumps({"$defs": {"node": {"type": "object", "properties": {
            "next": {"$ref": "#/$defs/node"}}, "required": ["next"]}}, "$ref": "#/$defs/node"})
    if pick == 5:
        return "json_schema", json.dumps({"type": "array", "items": {"type": "integer"},
                                          rng.choice(["minItems", "maxItems"]): rng.choice([n, 10**9, 10**6])})
    if pick == 6:
        return "json_schema", json.dumps({"type": "string", rng.choice(["minLength", "maxLength"]): rng.choice([n, 10**9])})
    if pick == 7:
        return "json_schema", deep_json(n)
    if pick == 8:
        return "gbnf", gbnf_chain(n)
    if pick == 9:
        return "gbnf", gbnf_alternatives(n * rng.choice([1, 10]))
    if pick == 10:
        return "gbnf", f'root ::= "a"{{0,{rng.choice([n, 10**9, 10**6])}}}\n'
    if pick == 11:
        return rng.choice(["gbnf", "lark"]), "root ::= " + "(" * n + '"x"' + ")" * n + "\n"
    if pick == 12:
        return "regex", "(" * min(n, 3000) + "a" + ")" * min(n, 3000) + f"{{0,{n}}}"
    return "json_schema", json.dumps({"enum": [f"v{i}" for i in range(n)]})


def random_case(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(list(TYPES))
    alphabet = '{}[]()|"\':,*+?~.$#/\\ \nab01rootx::=%json-_'
    return kind, "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200)))


def cases(n: int, seed: int) -> Iterator[tuple[str, str, str]]:
    """(class, type, text) for n cases from the seed."""
    rng = random.Random(seed)
    makers = [("real", real), ("mutated-json", mutate_json), ("mutated-text", mutate_text), ("hostile", hostile),
              ("hostile", hostile), ("random", random_case)]
    for _ in range(n):
        name, make = rng.choice(makers)
        kind, text = make(rng)
        yield name, kind, text


# ---- the library run: a worker process -------------------------------------------------------------------------

def worker() -> None:
    """Reads cases as JSON lines on stdin, answers one line each on the original stdout (ok / error MESSAGE / pyexc);
    whatever native code prints goes to stderr."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from specee import Model, _core
    from specee.grammar import use_library

    use_library()
    model = Model(n_ctx=64, n_threads=1)
    for line in sys.stdin:
        case = json.loads(line)
        try:
            _core.grammar_check(model._model, TYPES[case["type"]], case["text"])
            answer = "ok"
        except _core.SpecEEError as e:
            answer = "error " + json.dumps(str(e))
        except Exception as e:  # noqa: BLE001 - reported as a finding
            answer = f"pyexc {type(e).__name__}: {str(e)[:200]!r}"
        answers.write(answer + "\n")
        answers.flush()


@dataclasses.dataclass
class Report:
    cases: int = 0
    ok: int = 0
    errors: int = 0
    crashes: list = dataclasses.field(default_factory=list)
    hangs: list = dataclasses.field(default_factory=list)
    findings: list = dataclasses.field(default_factory=list)  # Python exceptions, long or multi-line messages, 5xx
    statuses: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    rss_plain_mb: float = 0.0  # the server after a plain request, before its first grammar
    rss_start_mb: float = 0.0  # after its first grammar too (structured output's one-time setup)
    rss_end_mb: float = 0.0
    health_max_s: float = 0.0

    def summary(self) -> dict:
        return {k: (len(v) if isinstance(v, list) else v) for k, v in dataclasses.asdict(self).items()}


def save(out: Path, what: str, i: int, case: tuple[str, str, str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{what}-{i}.json").write_text(json.dumps({"class": case[0], "type": case[1], "text": case[2]}))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def short_message(message: str) -> bool:
    return "\n" not in message and len(message) <= 400


def fuzz_library(items: Iterator[tuple[str, str, str]], out: Path, timeout: float, progress: bool = False) -> Report:
    rep, t0 = Report(), time.monotonic()
    proc: subprocess.Popen | None = None

    def start() -> subprocess.Popen:
        out.mkdir(parents=True, exist_ok=True)
        return subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=open(out / "worker-stderr.txt", "ab"), text=True, bufsize=1)

    for i, case in enumerate(items):
        if progress and i and i % 500 == 0:
            print(f"{i} cases, {time.monotonic() - t0:.0f} s: {rep.summary()}", file=sys.stderr, flush=True)
        fresh = not (proc and proc.poll() is None)
        proc = start() if fresh else proc
        rep.cases += 1
        proc.stdin.write(json.dumps({"type": case[1], "text": case[2]}) + "\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], timeout + (120 if fresh else 0))  # a new worker loads the model
        line = proc.stdout.readline() if ready else ""
        if not line:
            dead = proc.poll() is not None or (proc.wait(5) if ready else None) is not None
            (rep.crashes if ready or dead else rep.hangs).append(i)
            save(out, "crash" if ready or dead else "hang", i, case)
            proc.kill()
            proc.wait()
            proc = None
            continue
        rep.peak_rss_mb = max(rep.peak_rss_mb, rss_mb(proc.pid))
        if line.startswith("ok"):
            rep.ok += 1
        elif line.startswith("error ") and short_message(json.loads(line[6:])):
            rep.errors += 1
        else:
            rep.findings.append((i, line.strip()[:300]))
            save(out, "finding", i, case)
    if proc:
        proc.stdin.close()
        proc.wait(timeout=30)
    rep.seconds = time.monotonic() - t0
    return rep


# ---- the server run ---------------------------------------------------------------------------------------------

def post(port: int, path: str, body: dict | bytes, timeout: float) -> tuple[int, str]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body)
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read().decode("utf-8", "replace")
    finally:
        conn.close()


def health(port: int, timeout: float) -> bool:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    finally:
        conn.close()


def server_body(case: tuple[str, str, str]) -> bytes | None:
    """The case as /completion's body: json_schema (its text as the field's JSON, as it is: a text that is not JSON
    makes the body malformed, a 400 too) or grammar (GBNF); other types are the library's."""
    if case[1] == "json_schema" and case[2].strip():
        field, text = "json_schema", case[2]
    elif case[1] == "gbnf" and case[2].strip():
        field, text = "grammar", json.dumps(case[2])
    else:
        return None
    return f'{{"prompt": "Answer:", "n_predict": 1, "temperature": 0, "{field}": {text}}}'.encode()


class Server:
    def __init__(self, model: str | None, out: Path, *args: str) -> None:
        from specee._tools import free_port

        self.port = free_port()
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "specee.server", "--host", "127.0.0.1", "--port", str(self.port), "-t", "1",
               "-c", "512", *(["-m", model] if model else []), *args]
        self.proc = subprocess.Popen(cmd, stdout=open(out / "server-log.txt", "ab"), stderr=subprocess.STDOUT)
        for _ in range(300):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({out / 'server-log.txt'})")
            try:
                if health(self.port, 1.0):
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("the server did not answer /health in 60 s")

    def stop(self) -> None:
        from specee._tools import stop_process

        stop_process(self.proc, 15)


def fuzz_server(items: Iterator[tuple[str, str, str]], out: Path, timeout: float, model: str | None = None,
                server_args: tuple[str, ...] = (), progress: bool = False) -> Report:
    rep = Report()
    srv = Server(model, out, *server_args)
    stop = threading.Event()

    def watch() -> None:  # /health every 0.2 s; its slowest answer (a failure counts as the time limit)
        while not stop.is_set():
            t = time.monotonic()
            try:
                ok = health(srv.port, timeout)
            except OSError:
                ok = False
            rep.health_max_s = max(rep.health_max_s, time.monotonic() - t if ok else timeout)
            stop.wait(0.2)

    try:
        post(srv.port, "/completion", {"prompt": "Answer:", "n_predict": 1}, timeout)  # warm: the model's first pass
        rep.rss_plain_mb = rss_mb(srv.proc.pid)
        # and structured output's one-time setup: the engine's library and its tokenizer for the model's vocabulary
        post(srv.port, "/completion", {"prompt": "Answer:", "n_predict": 1, "json_schema": {"type": "integer"}}, timeout)
        rep.rss_start_mb = rss_mb(srv.proc.pid)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        t0 = time.monotonic()
        for i, case in enumerate(items):
            if progress and i and i % 250 == 0:
                print(f"{i} cases, {time.monotonic() - t0:.0f} s: {rep.summary()}", file=sys.stderr, flush=True)
            body = server_body(case)
            if body is None:
                continue
            rep.cases += 1
            try:
                status, text = post(srv.port, "/completion", body, timeout)
            except OSError:
                dead = srv.proc.poll() is not None
                (rep.crashes if dead else rep.hangs).append(i)
                save(out, "crash" if dead else "hang", i, case)
                if dead:
                    break
                continue
            rep.statuses[status] = rep.statuses.get(status, 0) + 1
            rep.peak_rss_mb = max(rep.peak_rss_mb, rss_mb(srv.proc.pid))
            if status == 200:
                rep.ok += 1
            elif status == 400 and short_message(json.loads(text).get("error", {}).get("message", "")):
                rep.errors += 1
            else:
                rep.findings.append((i, status, text[:300]))
                save(out, "finding", i, case)
        rep.seconds = time.monotonic() - t0
        stop.set()
        watcher.join(timeout + 1)
        time.sleep(1.0)
        rep.rss_end_mb = rss_mb(srv.proc.pid)
        status, _ = post(srv.port, "/completion", {"prompt": "Answer:", "n_predict": 1}, timeout)  # still serving
        if status != 200:
            rep.findings.append(("after", status, "the server did not serve a plain request after the run"))
    finally:
        stop.set()
        srv.stop()
    return rep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=46)
    ap.add_argument("--out", type=Path, default=Path("fuzz-grammar-out"))
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds a case may take before it counts as a hang")
    ap.add_argument("--server", action="store_true", help="fuzz specee-server instead of the library")
    ap.add_argument("--model", help="the GGUF file (default: the package's default model)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker()
    items = cases(args.cases, args.seed)
    rep = (fuzz_server(items, args.out, args.timeout, args.model, progress=True) if args.server
           else fuzz_library(items, args.out, args.timeout, progress=True))
    print(json.dumps(rep.summary(), indent=1))
    for f in rep.findings[:20]:
        print("finding:", f)
    sys.exit(1 if rep.crashes or rep.hangs or rep.findings else 0)


if __name__ == "__main__":
    main()
