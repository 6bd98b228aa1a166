"""The context-option table (csrc/include/specee.h `specee_context_options`, specee-options.cpp CONTEXT_OPTIONS): the
CLI, specee-bench, specee-server and `Model(...)` take their model, context and placement settings from it, under its
names and llama.cpp's flags, and the runtime checks each value once."""

from __future__ import annotations

import inspect
import re
import subprocess

import pytest

import specee
from specee._tools import tool_path
from specee.context_options import CONTEXT_OPTIONS

# the options a frontend may leave out: the model file is Model's `path`; -fa only exists for llama.cpp's command lines
NOT_MODEL_KEYWORDS = {"model", "flash_attn"}


def flags_of(help_text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", help_text))


def test_the_table_names_and_flags() -> None:
    for name, o in CONTEXT_OPTIONS.items():
        assert re.fullmatch(r"[a-z_]+", name) and o["help"] and o["expect"], name
        assert o["flags"] and all(f.startswith("-") for f in o["flags"]), name
    flags = [f for o in CONTEXT_OPTIONS.values() for f in o["flags"]]
    assert len(flags) == len(set(flags))  # no flag twice
    # llama.cpp's spellings
    for name, flag in [("n_ctx", "-c"), ("n_batch", "-b"), ("n_ubatch", "-ub"), ("n_threads", "-t"),
                       ("type_v", "-ctv"), ("n_gpu_layers", "-ngl"), ("tensor_split", "-ts"), ("devices", "-dev"),
                       ("rpc_servers", "--rpc"), ("model", "-m")]:
        assert flag in CONTEXT_OPTIONS[name]["flags"]


def test_model_keywords_are_the_tables_names() -> None:
    params = inspect.signature(specee.Model.__init__).parameters
    keywords = {n for n, p in params.items() if p.kind == p.KEYWORD_ONLY}
    assert keywords == set(CONTEXT_OPTIONS) - NOT_MODEL_KEYWORDS
    assert all(params[k].default is None for k in keywords)  # the table's default


@pytest.mark.parametrize("kw,message", [
    (dict(type_v="bf16"), "type_v must be 'f16' or 'f32', not 'bf16'"),
    (dict(offload_order="middle"), "offload_order must be one of auto, first, last, not 'middle'"),
    (dict(n_ctx=-1), "n_ctx must be >= 0, not '-1'"),
    (dict(n_batch=0), "n_batch must be >= 1"),
    (dict(n_gpu_layers=-2), "n_gpu_layers must be >= -1"),
    (dict(tensor_split=[1, -1]), "tensor_split must be comma-separated numbers >= 0"),
])
def test_model_values_are_checked_by_the_table(kw: dict, message: str) -> None:
    """The runtime's checks, before any file is opened (the path need not exist)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        specee.Model("/nonexistent.gguf", **kw)


def test_cli_bench_and_server_take_the_tables_flags() -> None:
    cli = subprocess.run([str(tool_path("llama-cli")), "--help"], capture_output=True, text=True).stdout
    bench = subprocess.run([str(tool_path("specee-bench")), "--help"], capture_output=True, text=True).stdout
    from specee.server import parse_args

    for name, o in CONTEXT_OPTIONS.items():
        on_by_default = o["type"] == 2 and o["default"] == "true"  # a bool on by default: its --no- flags
        flags = {"--no-" + f.lstrip("-") for f in o["flags"]} if on_by_default else set(o["flags"])
        assert flags <= flags_of(cli), name
        if name != "flash_attn":  # specee-server: every one but -fa
            value = {0: "1", 1: "1", 2: None}.get(o["type"], "x")
            if o["choices"]:
                value = o["choices"][0]
            for flag in flags:
                args = parse_args([flag] if value is None else [flag, value])
                assert getattr(args, name) is not None, (flag, name)
    for name in ("model", "n_threads", "type_v", "n_gpu_layers", "offload_order", "n_batch", "n_ubatch",
                 "rpc_servers", "flash_attn"):
        assert set(CONTEXT_OPTIONS[name]["flags"]) <= flags_of(bench), name


def test_bench_refuses_what_the_table_refuses() -> None:
    bench = str(tool_path("specee-bench"))
    for args, what in [(["-ctv", "f32,bf16"], "-ctv"), (["-t", "2,x"], "-t"), (["--offload-order", "middle"],
                       "--offload-order"), (["-ngl", "-2"], "-ngl"), (["-ub", "0"], "-ub")]:
        res = subprocess.run([bench, *args], capture_output=True, text=True)
        assert res.returncode == 1 and f"invalid value for {what}" in res.stderr, (args, res.stderr)
