"""The mode table (csrc/include/specee.h `specee_mode_info`, Python `specee.MODES`): every frontend asks it, none names
a group of modes by hand. The checkers are tested on made-up sources too, so each is known to fail when it should."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

import specee
from specee import _core
from specee._tools import tool_path
from test_early_exit import predictors, with_head  # noqa: F401 (fixtures: the tiny model with a head and predictors)

ROOT = Path(__file__).resolve().parents[1]
# where modes may be named: the table itself, and the decoder (its dispatch on the mode and auto's choice)
TABLE = "csrc/decode/specee-options.cpp"
DECODER = "csrc/decode/specee-generate.cpp"
# the Python frontends and tools
PY_DIRS = ("python/specee", "evals", "bench", "autoee", "convert")
MODE_NAMES = set(specee.MODES)


def cpp_hand_groups(text: str, decoder: bool = False) -> list[str]:
    """Lines of C++ `text` that decide on a mode by its enum value: a comparison with SPECEE_MODE_* (auto aside:
    whether a mode is still to be resolved), or, outside the decoder, a `case SPECEE_MODE_*`."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        code = line.split("//", 1)[0]
        if re.search(r"[!=]=\s*SPECEE_MODE_(?!AUTO\b)\w+|SPECEE_MODE_(?!AUTO\b)\w+\s*[!=]=", code):
            found.append(f"{n}: {line.strip()}")
        elif not decoder and re.search(r"\bcase\s+SPECEE_MODE_", code):
            found.append(f"{n}: {line.strip()}")
    return found


def py_hand_groups(source: str) -> list[str]:
    """Places in Python `source` that test a mode against a hand-written group: `x in (NAME, NAME, ...)` with two or
    more mode names, or `x.startswith(NAME)` with a mode's name (or the start of one)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators):
                if isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
                    names = [e.value for e in right.elts if isinstance(e, ast.Constant) and e.value in MODE_NAMES]
                    if len(names) >= 2:
                        found.append(f"{node.lineno}: in {names}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith"
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                and any(m.startswith(node.args[0].value) for m in MODE_NAMES - {"auto", "plain"})):
            found.append(f"{node.lineno}: startswith({node.args[0].value!r})")
    return found


def test_no_frontend_names_a_mode_group() -> None:
    bad = []
    for path in sorted((ROOT / "csrc").rglob("*.[ch]*")):
        rel = path.relative_to(ROOT).as_posix()
        if rel != TABLE:
            bad += [f"{rel}:{x}" for x in cpp_hand_groups(path.read_text(), decoder=rel == DECODER)]
    for d in PY_DIRS:
        for path in sorted((ROOT / d).rglob("*.py")):
            bad += [f"{path.relative_to(ROOT)}:{x}" for x in py_hand_groups(path.read_text())]
    assert not bad, "modes named by hand (ask the mode table: specee_mode_row / specee.MODES):\n" + "\n".join(bad)


def test_the_checkers_find_hand_groups() -> None:
    assert cpp_hand_groups("if (mode == SPECEE_MODE_EAGLE || tree_exit) {") != []
    assert cpp_hand_groups("const bool t = SPECEE_MODE_TREE_EXIT != g.mode;") != []
    assert cpp_hand_groups("    case SPECEE_MODE_PLAIN: {") != []
    assert cpp_hand_groups("    case SPECEE_MODE_PLAIN: {", decoder=True) == []
    assert cpp_hand_groups("return p.mode == SPECEE_MODE_AUTO ? a : b; // mode == SPECEE_MODE_PLAIN") == []
    assert cpp_hand_groups("p.mode = SPECEE_MODE_PLAIN;") == []
    assert py_hand_groups("if mode in ('eagle', 'eagle2', 'tree-exit'):\n    pass\n") != []
    assert py_hand_groups("ok = opts.mode not in ['plain', 'auto']\n") != []
    assert py_hand_groups("h = any(m.startswith('eagle') for m in modes)\n") != []
    assert py_hand_groups("if mode == 'plain' or name in ('a', 'b'):\n    pass\n") == []
    assert py_hand_groups("x = s.startswith('--')\n") == []


def test_python_table_is_the_runtimes() -> None:
    """specee.MODES is the runtime's table, in the enum's order, and the names option "mode" takes."""
    rows = _core.modes()
    assert [m["name"] for m in rows] == list(specee.MODES)
    mode_option = next(o for o in _core.generator_options() if o["name"] == "mode")
    assert mode_option["choices"] == list(specee.MODES)
    for row in rows:
        info = specee.MODES[row["name"]]
        assert info.help and row["help"] == info.help and row["help"] in mode_option["help"]
        assert set(info.reads) <= {"eagle1_tree", "eagle2_tree", "exit", "ngram", "draft"}
        # a mode that decodes greedily only cannot be lossless; exits need the head's candidates
        assert not (info.greedy_only and info.lossless)
        assert not info.exits or info.needs_head


def test_cli_help_lists_every_mode() -> None:
    out = subprocess.run([str(tool_path("llama-cli")), "--help"], capture_output=True, text=True).stdout
    flat = " ".join(out.split())
    for info in specee.MODES.values():
        assert f"{info.name}" in flat and " ".join(info.help.split()[:4]) in flat


@pytest.mark.parametrize("name", [m for m, i in specee.MODES.items() if i.greedy_only])
def test_greedy_only_modes_refuse_sampling(with_head: Path, name: str) -> None:
    """The generator refuses temp > 0 for the modes the table marks greedy-only, with the table's reason."""
    with specee.Model(str(with_head), n_ctx=64) as m:
        with pytest.raises(specee.SpecEEError, match=re.escape(specee.MODES[name].greedy_only)):
            m.generate_tokens([1, 2, 3], 2, mode=name, temp=0.7, exit=specee.ExitParams(replay=[0]))


def test_head_modes_refuse_a_model_without_head(tiny_gguf: Path) -> None:
    with specee.Model(str(tiny_gguf), n_ctx=64) as m:
        for name, info in specee.MODES.items():
            if info.needs_head:
                with pytest.raises(specee.SpecEEError, match="needs an EAGLE draft head"):
                    m.generate_tokens([1, 2, 3], 2, mode=name, temp=0)
