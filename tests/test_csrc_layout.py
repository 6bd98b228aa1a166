"""The shape of csrc/: no function over MAX_LINES lines (declaration tables aside), no file over MAX_FILE_LINES lines
(the declaration tables aside) and no continuation file, the whole public C API in specee.h, and its files in floors
(FLOORS), each floor a folder of csrc/ saying in its README.md what it owns, with no arrow running back up: a file
includes, or calls a function defined in, files of its own floor or below, and within a floor no circle. The checkers
are tested on small made-up sources too, so each check is known to fail when it should."""

from __future__ import annotations

import ast
import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "csrc"
MAX_LINES = 100

# Functions allowed to be longer: declaration tables, where each line declares one thing
ALLOWED = {
    # every binding of the Python module, one .def per line
    ("bindings/specee-bindings.cpp", "PYBIND11_MODULE"),
    # the CLI's flag table, one flag per line
    ("tools/specee-cli-args.cpp", "make_options"),
}

MAX_FILE_LINES = 800

# Files allowed to be longer: declaration tables, one declaration per concept, whose length is the API's and not a file's
# concepts grown together (split, they would be one table read in pieces):
ALLOWED_FILES = {
    # the Python module's table, one binding per line
    "bindings/specee-bindings.cpp",
    # the one public header (as llama.cpp's llama.h): the whole C API, one section per concept, one declaration each
    "include/specee.h",
}

# The public header: every extern "C" declaration is here, none in another header
PUBLIC_HEADER = "specee.h"

# what names a continuation file: a concept's file cut at a line count, not where its concepts part
_CONTINUATION = re.compile(r"-(?:ext|more|cont|part\d*|\d+)$")

# What C++ text is not code: comments, string and character literals (raw strings included) and preprocessor
# lines (with their continuations); each is blanked out, newlines kept, so braces inside them are not counted
_NOT_CODE = re.compile(
    r"//[^\n]*"
    r"|/\*.*?\*/"
    r'|\bR"(?P<delim>[^()\\\s]{0,16})\(.*?\)(?P=delim)"'
    r'|"(?:\\.|[^"\\\n])*"'
    r"|(?<![\w'])'(?:\\.|[^'\\\n])+'"
    r"|^[ \t]*#(?:\\\n|[^\n])*",
    re.S | re.M,
)
# a block opened after one of these (and no parenthesis) holds declarations, functions among them
_SCOPE = re.compile(r"^(?:template\s*<.*>\s*)?(?:namespace|struct|class|union)\b|^extern\s*\"\"$", re.S)
# what may follow a function's parameter list: qualifiers, attributes, a trailing return type
_AFTER_PARAMS = re.compile(r"\)(?:\s*(?:const|noexcept|override|final|&&?))*\s*(?:->\s*[\w:<>,\s*&]+)?$")


def blank_non_code(text: str) -> str:
    def blank(m: re.Match[str]) -> str:
        s = m.group(0)
        keep = '""' if s[0] == '"' or s[:2] == 'R"' else ""  # extern "C" stays recognisable as extern ""
        return keep + re.sub(r"[^\n]", " ", s[len(keep):])

    return _NOT_CODE.sub(blank, text)


def _function_name(header: str) -> str | None:
    """The name of the function whose signature `header` is (text before its opening brace), or None."""
    h = header.strip()
    if "(" not in h or not _AFTER_PARAMS.search(h) or re.search(r"=\s*$", h):
        return None
    before = h[: h.index("(")]
    names = re.findall(r"operator\s*\S+|[\w:~]+", before)
    return names[-1] if names else None


def functions(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, last line) of every function defined in C++ `text`; the first line is the one with
    the function's name, the last the one with its closing brace. Lambdas and blocks count to their function;
    struct, class, namespace and extern "C" bodies are searched for functions."""
    code = blank_non_code(text)
    line_starts = [0] + [m.end() for m in re.finditer(r"\n", code)]

    def line_of(pos: int) -> int:
        lo, hi = 0, len(line_starts) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if line_starts[mid] <= pos:
                lo = mid
            else:
                hi = mid - 1
        return lo + 1

    found = []
    stack: list[tuple[str, int, str]] = []  # (kind: scope, function or block, first line, name)
    start = 0  # where the declaration being read began, in a scope
    for m in re.finditer(r"[{};]", code):
        c = m.group(0)
        in_scope = not stack or stack[-1][0] == "scope"
        if c == "{":
            if not in_scope:
                stack.append(("block", 0, ""))
                continue
            header = code[start : m.start()]
            name = _function_name(header)
            if name:
                name_at = start + header.index("(")
                stack.append(("function", line_of(name_at), name))
            elif _SCOPE.search(header.strip()):
                stack.append(("scope", 0, ""))
                start = m.end()
            else:
                stack.append(("block", 0, ""))  # an initializer, an enum
        elif c == "}":
            if not stack:
                continue  # unbalanced (a macro's half): ignored
            kind, first, name = stack.pop()
            if kind == "function":
                found.append((name, first, line_of(m.start())))
            if not stack or stack[-1][0] == "scope":
                start = m.end()
        elif in_scope:
            start = m.end()
    return found


def long_functions(root: Path, max_lines: int = MAX_LINES) -> list[str]:
    out = []
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".cpp", ".h"):
            continue
        rel = path.relative_to(root).as_posix()
        for name, first, last in functions(path.read_text()):
            n = last - first + 1
            if n > max_lines and (rel, name) not in ALLOWED:
                out.append(f"{rel}:{first}: {name} is {n} lines (at most {max_lines})")
    return out


def long_files(root: Path, max_lines: int = MAX_FILE_LINES) -> list[str]:
    """Every file under root (in every folder) longer than max_lines lines, the allowed ones aside."""
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if not path.is_file() or rel in ALLOWED_FILES:
            continue
        n = len(path.read_text(errors="replace").splitlines())
        if n > max_lines:
            out.append(f"{rel}: {n} lines (at most {max_lines})")
    return out


def continuation_files(root: Path) -> list[str]:
    """Every file whose name says it continues another (specee-slots-ext.h, specee-options-2.cpp)."""
    return [f"{p.relative_to(root).as_posix()}: a continuation file (split where the concepts part, under their names)"
            for p in sorted(root.rglob("*")) if p.suffix in (".cpp", ".h") and _CONTINUATION.search(p.stem)]


def public_outside_header(root: Path) -> list[str]:
    """Public C API outside PUBLIC_HEADER: an extern "C" in another header, or a function a .cpp defines extern "C"
    that the public header does not declare."""
    header = next(iter(sorted(root.rglob(PUBLIC_HEADER))), None)
    declared = set(_CALL.findall(blank_non_code(header.read_text()))) if header else set()
    out = []
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".cpp", ".h") or path.name == PUBLIC_HEADER:
            continue
        rel = path.relative_to(root).as_posix()
        code = blank_non_code(path.read_text())
        if path.suffix == ".h" and re.search(r'\bextern\s*""', code):
            out.append(f'{rel}: extern "C" outside {PUBLIC_HEADER}')
        for name in re.findall(r'\bextern\s*""\s*[^;{}()]*?\b(specee_\w+)\s*\(', code):
            if name not in declared:
                out.append(f'{rel}: {name} is defined extern "C" but {PUBLIC_HEADER} does not declare it')
    return out


def sources(root: Path) -> list[Path]:
    return [p for p in sorted(root.rglob("*")) if p.suffix in (".cpp", ".h")]


def unit_of(root: Path, path: Path) -> str:
    """A file's unit: its path under root without the suffix ("model/specee-vocab"), so X.h and X.cpp of one folder are
    one unit, and two files of one name in two folders (tools/ and rpc/ specee-rpc-server.cpp) are two."""
    return path.relative_to(root).with_suffix("").as_posix()


def header_units(root: Path) -> dict[str, str]:
    """The unit an `#include "specee-Y.h"` names, by Y's stem: the one whose folder holds specee-Y.h, else the one unit
    of that stem (includes name headers without their folder: the build puts each floor's folder on the path)."""
    by_stem: dict[str, set[str]] = {}
    for path in sources(root):
        by_stem.setdefault(path.stem, set()).add(unit_of(root, path))
    out = {stem: sorted(units)[0] for stem, units in by_stem.items() if len(units) == 1}
    out.update({p.stem: unit_of(root, p) for p in sources(root) if p.suffix == ".h"})
    return out


def duplicate_headers(root: Path) -> list[str]:
    """Headers of one name in two folders (an include names a header without its folder, so it would be ambiguous)."""
    seen: dict[str, list[str]] = {}
    for p in sources(root):
        if p.suffix == ".h":
            seen.setdefault(p.name, []).append(p.relative_to(root).as_posix())
    return [" and ".join(paths) for name, paths in sorted(seen.items()) if len(paths) > 1]


def include_graph(root: Path) -> dict[str, set[str]]:
    """unit -> the units whose specee-Y.h it includes, a file's .h and .cpp taken as one (so that X.cpp including Y.h
    while Y.cpp includes X.h is a circle: each needs the other)."""
    graph: dict[str, set[str]] = {}
    header = header_units(root)
    for path in sources(root):
        text = re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S)
        me = unit_of(root, path)
        deps = graph.setdefault(me, set())
        for m in re.finditer(r'^[ \t]*#[ \t]*include[ \t]*"(?:[\w./-]*/)?(specee-[\w.-]+)\.h"', text, re.M):
            dep = header.get(m.group(1), m.group(1))
            if dep != me:
                deps.add(dep)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of the graph as [a, b, ..., a], or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


# The floors of csrc/, bottom first, each in a folder of csrc/ (the frontends in two) whose README.md says what it owns
# and what it may include; a unit is a file in its folder without the suffix (X.h and X.cpp are one). Each may include,
# and call the functions of, units of its own floor or a lower one; never a higher one, and within a floor never in a
# circle. The table lists each floor's units by name, and a file must be in its floor's folder.
FLOORS = [
    # what every floor stands on: errors and logging, the name tables, GGUF files, text's code points, the kernels,
    # llguidance's loader, the n-gram cache's store, the state a step advances, quantizing
    ("base", ("base",), {"specee-impl", "specee-hparams", "specee-arch", "specee-gguf", "specee-tiles",
                         "specee-tiles-q8_0", "specee-tiles-q4_0", "specee-tiles-q4_1", "specee-tiles-q4_k",
                         "specee-tiles-q5_k", "specee-tiles-q6_k", "specee-tiles-k",
                         "specee-kernels",
                         "specee-unicode", "specee-unicode-data", "specee-llg", "specee-ngram-cache", "specee-step",
                         "specee-quantize"}),
    # ggml's RPC protocol: its messages, the checks of a received graph, the client (a device for the placement), the
    # server (the specee-rpc-server tool's engine)
    ("rpc", ("rpc",), {"specee-rpc-proto", "specee-rpc-graph", "specee-rpc-client", "specee-rpc-server"}),
    # a model's weights and text: loading, placement, graphs, the KV cache, the vocabulary, chat templates, pooling
    ("model", ("model",), {"specee-model", "specee-kv-cache", "specee-graph", "specee-placement",
                           "specee-head-weights", "specee-vocab", "specee-chat", "specee-pooling", "specee-loader"}),
    # a model run: the context and its parameters, batches, what a pass costs, LoRA, embeddings, captures
    ("context", ("context",), {"specee-context-params", "specee-context", "specee-batch", "specee-pass-cost",
                               "specee-lora", "specee-embed", "specee-capture"}),
    # decoding: grammars, sampling, the draft head, exits, trees, the generation options and modes, drafters, the
    # generator
    ("decode", ("decode",), {"specee-options", "specee-option-values", "specee-grammar-limits",
                             "specee-grammar-compile", "specee-gbnf", "specee-grammar", "specee-sampling",
                             "specee-draft-head", "specee-exit-check", "specee-exit", "specee-early-exit",
                             "specee-tree-choices", "specee-speculative", "specee-tree-exit", "specee-drafter",
                             "specee-lookup", "specee-hybrid", "specee-draft-model", "specee-stats",
                             "specee-generate"}),
    # serving: parallel slots, their step, context shift and caches
    ("serve", ("serve",), {"specee-slots", "specee-context-shift", "specee-slot-step", "specee-slot-cache"}),
    # the public API (as llama.cpp's include/llama.h)
    ("api", ("include",), {"specee"}),
    # the frontends: the CLI, the bench, the RPC server's command line, the Python module
    ("frontends", ("tools", "bindings"), {"specee-cli", "specee-cli-args", "specee-bench", "specee-openmp",
                                          "specee-rpc-server", "specee-bindings"}),
]

_CALL = re.compile(r"\b(specee_\w+)\s*\(")


def unit_graph(root: Path) -> dict[str, dict[str, list[str]]]:
    """unit -> unit it depends on -> why: "#include" and/or the names of the other's functions it uses (calls them,
    or declares them: a declaration belongs with its definition). A unit is as unit_of says; a function is its unit's
    that defines it (in a .cpp, or inline in a .h), and a name the using unit defines itself is its own."""
    defs: dict[str, set[str]] = {}
    code: dict[str, str] = {}
    for path in sources(root):
        text = path.read_text()
        unit = unit_of(root, path)
        code[unit] = code.get(unit, "") + blank_non_code(text) + "\n"
        for name, _, _ in functions(text):
            name = name.split("::")[-1]
            if name.startswith("specee_"):
                defs.setdefault(name, set()).add(unit)
    graph: dict[str, dict[str, list[str]]] = {u: {} for u in code}
    for unit, deps in include_graph(root).items():
        for d in deps:
            graph.setdefault(unit, {}).setdefault(d, []).append("#include")
    for unit, text in code.items():
        for name in sorted(set(_CALL.findall(text))):
            owners = defs.get(name, set())
            if unit in owners:
                continue
            for d in sorted(owners):
                graph[unit].setdefault(d, []).append(name)
    return graph


Floors = list[tuple[str, tuple[str, ...], set[str]]]


def floor_levels(units: list[str], floors: Floors) -> tuple[dict[str, int], list[str]]:
    """unit -> its floor's index, by the folder it is in; and, as messages, every unit in no floor's folder or in a
    floor that does not list it."""
    by_folder = {folder: i for i, (_, folders, _) in enumerate(floors) for folder in folders}
    listed = {name: i for i, (_, _, names) in enumerate(floors) for name in names}
    level, bad = {}, []
    for u in sorted(units):
        folder, _, name = u.rpartition("/")
        if folder not in by_folder:
            where = f" (FLOORS: {floors[listed[name]][1][0]}/)" if name in listed else " (add it to FLOORS)"
            bad.append(f"{u}: in no floor's folder{where}")
            continue
        level[u] = i = by_folder[folder]
        if name not in floors[i][2]:
            where = f"FLOORS puts it on floor {floors[listed[name]][0]}, folder {floors[listed[name]][1][0]}/" \
                if name in listed else "FLOORS does not list it (add it)"
            bad.append(f"{u}: in {folder}/, floor {floors[i][0]}, but {where}")
    return level, bad


def back_edges(graph: dict[str, dict[str, list[str]]], floors: Floors) -> list[str]:
    """Every unit outside its floor's folder, every arrow that runs up a floor, and a circle within a floor, as
    messages."""
    level, out = floor_levels(list(graph), floors)
    for u in sorted(graph):
        for d, why in sorted(graph[u].items()):
            if u in level and d in level and level[d] > level[u]:
                out.append(f"{u} ({floors[level[u]][0]}) -> {d} ({floors[level[d]][0]}), a floor up: "
                           + ", ".join(why))
    for i, (name, _, _) in enumerate(floors):
        units = {u for u in graph if level.get(u) == i}
        cycle = find_cycle({u: {d for d in graph.get(u, {}) if d in units} for u in units})
        if cycle:
            steps = [f"{a} -> {b} ({', '.join(graph[a][b])})" for a, b in zip(cycle, cycle[1:])]
            out.append(f"circle in floor {name}: " + "; ".join(steps))
    return out


# ---- the tree


def test_no_function_is_too_long() -> None:
    long = long_functions(CSRC)
    assert not long, "split into named steps:\n" + "\n".join(long)


def test_allowed_long_functions_exist() -> None:
    """Each allow-list entry names a function that is there (a renamed one would leave a stale entry)."""
    for rel, name in ALLOWED:
        assert name in [f[0] for f in functions((CSRC / rel).read_text())], (rel, name)


def test_no_file_is_too_long() -> None:
    long = long_files(CSRC)
    assert not long, ("split where the file's concepts part, into files named for them (never a continuation file):\n"
                      + "\n".join(long))


def test_no_continuation_file() -> None:
    bad = continuation_files(CSRC)
    assert not bad, "\n".join(bad)


def test_the_public_api_is_one_header() -> None:
    bad = public_outside_header(CSRC)
    assert not bad, f"declare the public C API in {PUBLIC_HEADER}, the rest in internal headers:\n" + "\n".join(bad)


def test_allowed_long_files_exist() -> None:
    for rel in ALLOWED_FILES:
        assert (CSRC / rel).is_file(), rel


def test_no_include_circle() -> None:
    cycle = find_cycle(include_graph(CSRC))
    assert not cycle, "include circle: " + " -> ".join(cycle)


def test_no_arrow_runs_back_up() -> None:
    """Includes and calls between csrc/'s units run down the floors, never up, and make no circle within one."""
    bad = back_edges(unit_graph(CSRC), FLOORS)
    assert not bad, "move the function or declaration to where its concept lives:\n" + "\n".join(bad)


def test_floors_name_existing_units() -> None:
    names = {u.rpartition("/")[2] for u in unit_graph(CSRC)}
    for name, _, members in FLOORS:
        assert members <= names, (name, sorted(members - names))


def test_each_folder_says_what_it_owns() -> None:
    """Every folder of csrc/ is a floor's, and opens its README.md with what it owns and what it may include."""
    folders = {f for _, fs, _ in FLOORS for f in fs}
    assert {p.name for p in CSRC.iterdir() if p.is_dir()} == folders
    for folder in sorted(folders):
        readme = CSRC / folder / "README.md"
        assert readme.is_file() and "include" in readme.read_text(), readme


def test_header_names_are_unique() -> None:
    dup = duplicate_headers(CSRC)
    assert not dup, "includes name headers without their folder; rename one of:\n" + "\n".join(dup)


# ---- the checkers themselves


TRICKY = r'''
#include "specee-a.h"
#define OPEN {
struct s {
    int f() const { return 1; }   // a method
};
static const char * const TABLE[] = {"{", "}}"};
/* a comment with a brace { */
extern "C" int g(int x) {
    const char * raw = R"x(not a brace: { )x";
    char c = '{';
    auto lam = [&](int y) { return y + '}'; };
    if (x) {
        return lam(x) + c + raw[0];
    }
    return 0; // }
}
namespace n {
std::vector<int> h(const std::string & s, int k) // trailing
{
    return {};
}
}
'''


def test_functions_are_found_through_strings_comments_and_lambdas() -> None:
    assert functions(TRICKY) == [("f", 5, 5), ("g", 9, 17), ("h", 19, 22)]


def test_a_long_function_is_reported(tmp_path: Path) -> None:
    body = "".join(f"    x += {i};\n" for i in range(MAX_LINES - 2))
    (tmp_path / "specee-x.cpp").write_text(f"int ok(int x) {{\n{body}}}\n\nint too_long(int x) {{\n{body}    x++;\n}}\n")
    assert long_functions(tmp_path) == [f"specee-x.cpp:{MAX_LINES + 2}: too_long is {MAX_LINES + 1} lines "
                                        f"(at most {MAX_LINES})"]


def test_a_long_file_is_reported(tmp_path: Path) -> None:
    lines = "".join(f"int x{i};\n" for i in range(MAX_FILE_LINES))
    (tmp_path / "specee-ok.cpp").write_text(lines)  # at the limit
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "specee-long.h").write_text(lines + "int y;\n")
    (tmp_path / "bindings").mkdir()
    (tmp_path / "bindings" / "specee-bindings.cpp").write_text(lines * 2)  # the table: allowed
    assert long_files(tmp_path) == [f"tools/specee-long.h: {MAX_FILE_LINES + 1} lines (at most {MAX_FILE_LINES})"]


def test_a_continuation_file_is_found(tmp_path: Path) -> None:
    (tmp_path / "specee-slots.h").write_text("")
    (tmp_path / "specee-unicode-data.cpp").write_text("")
    assert continuation_files(tmp_path) == []
    (tmp_path / "specee-slots-ext.h").write_text("")
    (tmp_path / "specee-options-2.cpp").write_text("")
    assert continuation_files(tmp_path) == [
        "specee-options-2.cpp: a continuation file (split where the concepts part, under their names)",
        "specee-slots-ext.h: a continuation file (split where the concepts part, under their names)"]


def test_a_public_declaration_outside_the_header_is_found(tmp_path: Path) -> None:
    (tmp_path / "specee.h").write_text('#ifdef __cplusplus\nextern "C" {\n#endif\nint specee_a(void);\n'
                                       '#ifdef __cplusplus\n}\n#endif\n')
    (tmp_path / "specee-a.h").write_text('// not extern "C": a comment\nint specee_a_impl(int x);\n')
    (tmp_path / "specee-a.cpp").write_text('#include "specee.h"\nextern "C" int specee_a(void) { return 0; }\n'
                                           'int specee_a_impl(int x) { return x; }\n')
    assert public_outside_header(tmp_path) == []
    (tmp_path / "specee-b.h").write_text('extern "C" {\nint specee_b(void);\n}\n')
    (tmp_path / "specee-b.cpp").write_text('#include "specee-b.h"\nextern "C" const char * specee_b(void) { return ""; }\n')
    assert public_outside_header(tmp_path) == [
        'specee-b.cpp: specee_b is defined extern "C" but specee.h does not declare it',
        'specee-b.h: extern "C" outside specee.h']


def test_an_include_circle_is_found(tmp_path: Path) -> None:
    (tmp_path / "specee-a.h").write_text('#include "specee-b.h"\n')
    (tmp_path / "specee-b.cpp").write_text('#include "specee-b.h"\n#include "specee-c.h"\n')
    (tmp_path / "specee-c.h").write_text('// #include "specee-a.h" is a comment\n')
    assert find_cycle(include_graph(tmp_path)) == []
    (tmp_path / "specee-c.cpp").write_text('#include "specee-c.h"\n#include "specee-a.h"\n')
    assert find_cycle(include_graph(tmp_path)) == ["specee-a", "specee-b", "specee-c", "specee-a"]


def test_includes_find_headers_in_their_folders(tmp_path: Path) -> None:
    """An include names a header without its folder; a .cpp of the same name in another folder is another unit."""
    for folder, name, text in [("rpc", "specee-x.h", ""), ("rpc", "specee-x.cpp", '#include "specee-x.h"\n'),
                               ("tools", "specee-x.cpp", '#include "specee-x.h"\n#include "specee-y.h"\n'),
                               ("tools", "specee-y.h", "")]:
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / name).write_text(text)
    assert include_graph(tmp_path) == {"rpc/specee-x": set(), "tools/specee-x": {"rpc/specee-x", "tools/specee-y"},
                                       "tools/specee-y": set()}
    assert duplicate_headers(tmp_path) == []
    (tmp_path / "rpc" / "specee-y.h").write_text("")
    assert duplicate_headers(tmp_path) == ["rpc/specee-y.h and tools/specee-y.h"]


def test_a_call_back_up_is_found(tmp_path: Path) -> None:
    floors = [("low", ("low",), {"specee-a", "specee-b"}), ("high", ("high", "top"), {"specee-c"})]
    low, high = tmp_path / "low", tmp_path / "high"
    low.mkdir()
    high.mkdir()
    (low / "specee-a.h").write_text("int specee_a_get(void);\n")
    (low / "specee-a.cpp").write_text('#include "specee-a.h"\nint specee_a_get(void) { return 1; }\n')
    (low / "specee-b.cpp").write_text('#include "specee-a.h"\nint specee_b_get(void) { return specee_a_get(); }\n')
    (high / "specee-c.cpp").write_text('#include "specee-a.h"\n// specee_c_helper() is a comment\n'
                                       'int specee_c_helper(void) { return specee_a_get() + 1; }\n')
    graph = unit_graph(tmp_path)
    assert graph["low/specee-b"] == {"low/specee-a": ["#include", "specee_a_get"]}
    assert back_edges(graph, floors) == []
    # a low unit calling a high one's function (no include: a declaration of its own) is an arrow up, named
    (low / "specee-b.cpp").write_text("int specee_c_helper(void);\n"
                                      "int specee_b_get(void) { return specee_c_helper(); }\n")
    assert back_edges(unit_graph(tmp_path), floors) == [
        "low/specee-b (low) -> high/specee-c (high), a floor up: specee_c_helper"]
    # a header declaring what another unit defines is that unit's, and closes a circle within the floor
    (low / "specee-b.cpp").write_text('#include "specee-a.h"\nint specee_b_get(void) { return 2; }\n')
    (low / "specee-a.h").write_text("int specee_a_get(void);\nint specee_b_get(void);\n")
    assert back_edges(unit_graph(tmp_path), floors) == [
        "circle in floor low: low/specee-a -> low/specee-b (specee_b_get); low/specee-b -> low/specee-a (#include)"]
    (low / "specee-a.h").write_text("int specee_a_get(void);\n")
    # a unit no floor lists, one in no floor's folder, and one in the folder of another floor than FLOORS gives it
    (high / "specee-d.h").write_text("")
    (tmp_path / "specee-a2.h").write_text("")
    (tmp_path / "lost").mkdir()
    (tmp_path / "lost" / "specee-c.h").write_text("")
    (high / "specee-b.h").write_text("")
    assert back_edges(unit_graph(tmp_path), floors) == [
        "high/specee-b: in high/, floor high, but FLOORS puts it on floor low, folder low/",
        "high/specee-d: in high/, floor high, but FLOORS does not list it (add it)",
        "lost/specee-c: in no floor's folder (FLOORS: high/)",
        "specee-a2: in no floor's folder (add it to FLOORS)"]


# ---- the Python package: no circle in the graph of imports between the modules of python/specee (those under
# `if TYPE_CHECKING:` and inside functions included: a circle broken at run time is still one)

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "specee"


def import_graph(root: Path, package: str = "specee") -> dict[str, set[str]]:
    """module -> the modules of the package it imports (`import specee.x`, `from specee.x import y`, `from specee
    import x`, relative imports), read with ast from every .py file under root (the package's folder). A name that is
    not a module (a .py, a .pyi stub of an extension, a folder) is an attribute of the package it is imported from:
    the edge goes to that package's __init__."""
    files = sorted(root.rglob("*.py"))
    modules = {}
    for path in files:
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        modules[path] = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    known = set(modules.values()) | {
        ".".join([package, *p.relative_to(root).with_suffix("").parts]) for p in root.rglob("*.pyi")}

    def resolve(name: str) -> str | None:
        """The longest prefix of a dotted name that is a module of the package."""
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for path, me in modules.items():
        deps = graph.setdefault(me, set())
        here = me if path.name == "__init__.py" else me.rpartition(".")[0]  # the package relative imports start in
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            else:
                continue
            for t in targets:
                if t == package or t.startswith(package + "."):
                    dep = resolve(t)
                    if dep and dep != me:
                        deps.add(dep)
    return graph


def test_no_python_import_circle() -> None:
    cycle = find_cycle(import_graph(PACKAGE))
    assert not cycle, "import circle: " + " -> ".join(cycle)


def test_a_python_import_circle_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "specee"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from specee._core import Error\nfrom specee.a import A\n")
    (pkg / "_core.pyi").write_text("class Error(Exception): ...\n")
    (pkg / "a.py").write_text("from specee import _core\nfrom specee.b import B\nimport os\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nimport specee.c\n")
    (pkg / "c.py").write_text("# from specee.a import A is a comment\nimport specee\n\n\ndef f():\n    return 1\n")
    graph = import_graph(pkg)
    assert graph == {"specee": {"specee._core", "specee.a"}, "specee.a": {"specee._core", "specee.b"},
                     "specee.b": {"specee.c"}, "specee.c": {"specee"}}
    assert find_cycle(graph) == ["specee", "specee.a", "specee.b", "specee.c", "specee"]
    (pkg / "c.py").write_text("def f():\n    pass\n")
    assert find_cycle(import_graph(pkg)) == []
    # under TYPE_CHECKING, and relative: still a circle
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n")
    assert find_cycle(import_graph(pkg)) == ["specee.a", "specee.b", "specee.c", "specee.a"]
