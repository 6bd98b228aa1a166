"""One options schema and one stats schema: the runtime's tables (csrc/decode/specee-options.cpp) against the C header's
structs, Python's GenerateOptions / GenerationStats and the CLI's flags."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest

import specee
from specee import _core
from specee._tools import tool_path
from specee.generate import FRONTEND_OPTIONS, MODES, EagleParams, ExitParams, GenerateOptions, GenerationStats

HEADER = Path(__file__).resolve().parents[1] / "csrc" / "include" / "specee.h"
OPTIONS = {o["name"]: o for o in _core.generator_options()}


def struct_fields(name: str) -> list[tuple[str, str]]:
    """(type, field) of a struct in specee.h, in order."""
    body = re.search(r"struct %s \{(.*?)\n\};" % name, HEADER.read_text(), re.S)
    assert body, name
    fields = []
    for line in body.group(1).splitlines():
        m = re.match(r"\s*((?:struct )?\w+)\s+(\w+)(\[\w+\])?;", line.split("//")[0])
        if m:
            fields.append((m.group(1), m.group(2)))
    return fields


def header_option_names() -> set[str]:
    """Every setting of specee_generator_params as an option name: sampling's fields without a prefix, the nested
    structs' with theirs ("exit.kv"); a list's count (n_layers next to layers) is part of the list."""
    names = set()
    for ctype, f in struct_fields("specee_generator_params"):
        if ctype.startswith("struct "):
            sub = ctype.split()[1]
            prefix = "" if sub == "specee_sampler_params" else f + "."
            inner = [g for _, g in struct_fields(sub)]
            names |= {prefix + g for g in inner if not (g.startswith("n_") and g[2:] in inner)}
        else:
            names.add(f)
    return names


def python_option_names() -> set[str]:
    names = set()
    for f in dataclasses.fields(GenerateOptions):
        # a group of settings (EagleParams, ExitParams, NgramParams): the dataclass its default is made by
        sub = f.default_factory if dataclasses.is_dataclass(f.default_factory) else None  # type: ignore[misc]
        names |= {f"{f.name}.{g.name}" for g in dataclasses.fields(sub)} if sub else {f.name}
    return names - set(FRONTEND_OPTIONS)


def test_every_field_of_the_c_struct_has_an_option() -> None:
    assert header_option_names() == set(OPTIONS)


def test_python_options_are_the_runtime_options() -> None:
    """A field added to the C++ struct (and so to the table, above) without its Python twin fails here."""
    assert python_option_names() == set(OPTIONS)


def test_python_defaults_are_the_runtime_defaults() -> None:
    assert _core.generate_options_values(GenerateOptions()) == {n: o["default"] for n, o in OPTIONS.items()}


def test_names_are_defined_once_in_the_runtime() -> None:
    assert tuple(MODES) == ("auto", "plain", "eagle", "eagle2", "early-exit", "tree-exit", "ngram",
                           "ngram+eagle2", "draft") == \
        tuple(OPTIONS["mode"]["choices"])
    assert OPTIONS["exit.kv"]["choices"] == ["mask", "fill"]


@pytest.mark.parametrize("options,message", [
    (dict(mode="eagle3"), "mode must be one of auto, plain, eagle, eagle2, early-exit, tree-exit, ngram, ngram+eagle2, draft, not 'eagle3'"),
    (dict(top_p=0.0), "top_p must be a number in (0, 1], not '0.0'"),  # the table's open lower bound
    (dict(min_p=1.5), "min_p must be a number in [0, 1], not '1.5'"),
    (dict(top_k=2.5), "top_k must be an integer"),
    (dict(repeat_penalty=float("inf")), "repeat_penalty must be a finite number > 0, not 'inf'"),
    (dict(repeat_penalty=1e39), "repeat_penalty must be a finite number > 0, got inf"),  # finite, not as a float
    (dict(repeat_last_n=-2), "repeat_last_n must be >= -1, not '-2'"),
    (dict(seed=2**32), "seed must be -1 (random) or in 0..2**32-1"),
    (dict(eagle=dict(topk=0)), "eagle.topk must be >= 1"),
    (dict(eagle=dict(topk=257)), "eagle.topk must be at most 256"),  # the table's range, the generator's limit
    (dict(eagle=dict(depth=65)), "eagle.depth must be at most 64"),
    (dict(eagle=dict(choices="[[1]]")), "bad EAGLE choices"),
    (dict(exit=dict(kv="drop")), "exit.kv must be 'mask' or 'fill', not 'drop'"),
    (dict(exit=dict(threshold=1.5)), "exit.threshold must be a number in [0, 1]"),
    (dict(exit=dict(layers=[3, -1])), "exit.layers must be comma-separated layer numbers"),
    (dict(exit=dict(replay=[])), "exit.replay must be comma-separated layer numbers"),
])
def test_the_runtime_checks_each_value(options: dict, message: str) -> None:
    kw = dict(options)
    with pytest.raises(ValueError, match=re.escape(message)):
        for group, cls in (("eagle", EagleParams), ("exit", ExitParams)):
            if group in kw:
                kw[group] = cls(**kw[group])
        GenerateOptions(**kw)


@pytest.mark.parametrize("name,accepted,refused", [
    ("top_p", [1.0, 0.5, 1e-45], [0.0, -0.0, 1.5, -1.0, float("nan"), 1e-50]),  # (0, 1]: 1e-50 is 0 as a float
    ("min_p", [0.0, 1.0, 0.05], [-0.1, 1.5, float("nan")]),
    ("repeat_penalty", [1e-45, 1.0, 3.4028235e38], [0.0, -1.0, float("inf"), 1e39, float("nan")]),
    ("repeat_last_n", [-1, 0, 64, 2**31 - 1], [-2, 2**31]),  # 2**31 - 1: held as an integer, not rounded to a float
])
def test_the_sampler_s_ranges_are_the_table_s(name: str, accepted: list, refused: list) -> None:
    """The sampler's ranges are written once, in the option table's columns (an open bound included): the options
    and a sampler made alone (specee_sampler_init) accept and refuse the same values, with the row's message."""
    for v in accepted:
        GenerateOptions(**{name: v})
        _core.Sampler(**{name: v})
    for v in refused:
        with pytest.raises(ValueError, match=f"^{name} must be "):
            GenerateOptions(**{name: v})
        if isinstance(v, float) or -2**31 <= v < 2**31:  # the binding takes a float or an int32_t
            with pytest.raises(_core.SpecEEError, match=f"^{name} must be {re.escape(OPTIONS[name]['expect'])}, got"):
                _core.Sampler(**{name: v})


def test_values_read_back_as_given() -> None:
    o = GenerateOptions(mode="eagle", temp=0.0, seed=7, ignore_eos=True, eagle=EagleParams(choices=[[0], [1]]),
                        exit=ExitParams(threshold=0.25, layers=[2, 4], dynamic=False, kv="fill", replay=[1]))
    v = _core.generate_options_values(o)
    assert (v["mode"], v["temp"], v["seed"], v["ignore_eos"], v["eagle.choices"]) == ("eagle", "0", "7", "true",
                                                                                      "[[0], [1]]")
    assert (v["exit.threshold"], v["exit.layers"], v["exit.dynamic"], v["exit.kv"], v["exit.replay"]) == (
        "0.25", "2,4", "false", "fill", "1")
    assert _core.generate_options_values(GenerateOptions(seed=-1))["seed"] == "-1"  # random, as None


def test_python_stats_are_the_runtime_stats() -> None:
    python = [f.name for f in dataclasses.fields(GenerationStats)]
    assert python[: len(_core.generator_stat_names())] == _core.generator_stat_names()
    header = [f for _, f in struct_fields("specee_generator_stats")]
    assert header == _core.generator_stat_names()


def cli_flag(name: str) -> str:
    return "--" + name.replace(".", "-").replace("_", "-")


def test_every_option_spells_its_flags_on_its_row() -> None:
    """Both tables spell every option's flags (llama.cpp's and EAGLE's where they have one, this project's for its
    own: "--exit-kv") and a value's placeholder (none for a switch) on its row; the frontends read them, none makes
    them from the name. Each option keeps this project's spelling (--NAME, '-' for '.' and '_') among its flags."""
    rows = list(OPTIONS.values()) + list(_core.context_options())
    flags = [f for o in rows for f in o["flags"]]
    assert len(flags) == len(set(flags)), sorted(f for f in flags if flags.count(f) > 1)
    for o in rows:
        assert o["flags"] and all(re.fullmatch(r"--?[a-z][\w-]*", f) for f in o["flags"]), o["name"]
        assert (o["hint"] is None) == (o["type"] == 2), o["name"]  # SPECEE_OPTION_BOOL: a switch
    for name, o in OPTIONS.items():
        assert cli_flag(name) in o["flags"], name


def test_every_option_is_a_cli_flag() -> None:
    """The CLI's generation flags are the table's rows' spellings (a bool on by default: its first as --no-NAME),
    with the row's placeholder."""
    out = subprocess.run([str(tool_path("llama-cli")), "--help"], capture_output=True, text=True).stdout
    for name, o in OPTIONS.items():
        flags = list(o["flags"])
        if o["type"] == 2 and o["default"] == "true":
            flags[0] = "--no-" + flags[0][2:]
        head = ", ".join(flags) + (" " + o["hint"] if o["hint"] else "")
        assert re.search(r"^\s+%s(\s|$)" % re.escape(head), out, re.M), head
        assert o["help"].split()[0] in out


@pytest.mark.slow
def test_derived_stats_come_from_the_runtime(smollm2_path: Path) -> None:
    m = specee.Model(smollm2_path, n_ctx=512, n_threads=1, draft_head="default")
    m.generate_tokens(m.tokenize("The capital of France is"), 24, temp=0, mode="eagle2")
    st = m.last_stats
    assert st.n_steps == len(st.step_tokens) > 0
    assert st.mean_accepted_tokens == pytest.approx(sum(st.step_tokens) / st.n_steps)
    m.generate_tokens(m.tokenize("The capital of France is"), 24, temp=0, mode="early-exit",
                      exit=ExitParams(replay=[9, 29, 19]))
    st = m.last_stats
    assert st.n_steps == len(st.layers_run) == 23 and st.n_exits == sum(r < 30 for r in st.layers_run)
    assert st.exit_ratio == pytest.approx(st.n_exits / st.n_steps)
    assert st.mean_layers_run == pytest.approx(sum(st.layers_run) / len(st.layers_run))
