"""The context options: what loading a model and making its context take (the runtime's table, csrc/include/specee.h
`specee_context_options`, named once in csrc/decode/specee-options.cpp): the files, the context (n_ctx, n_batch,
n_ubatch, n_threads, n_threads_batch, type_v) and where the layers go (n_gpu_layers, offload_order, devices,
rpc_servers, tensor_split). `Model(...)` takes them as keywords under these names; the Python frontends' command lines
(specee-server) take them under llama.cpp's flags, as the CLI and specee-bench do. The runtime checks every value
(ValueError with its message)."""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from specee import _core

# {name: the table's row (type, choices, expect, help, default as text, flags, hint)}
CONTEXT_OPTIONS: dict[str, dict[str, Any]] = {o["name"]: o for o in _core.context_options()}


def context_options(values: dict[str, Any]) -> dict[str, Any]:
    """The options given (None: the default left), checked by the runtime: ValueError naming a refused one."""
    given = {k: v for k, v in values.items() if v is not None}
    _core.context_options_values(given)
    return given


def add_context_flags(parser: argparse.ArgumentParser, names: Sequence[str], defaults: dict[str, str] | None = None
                      ) -> None:
    """The table's flags of `names` on an argparse command line, each setting args.<name> (an int or float for a
    number, else text; None: not given; `defaults` overrides the table's default for this frontend, shown in its
    help). The runtime checks the values when the model is made."""
    add_option_flags(parser, CONTEXT_OPTIONS, names, defaults)


def add_option_flags(parser: argparse.ArgumentParser, rows: dict[str, dict[str, Any]], names: Sequence[str],
                     defaults: dict[str, str] | None = None) -> None:
    """The flags of `names` as one of the runtime's option tables spells them (`rows`: {name: row}, the context's
    above or `{o["name"]: o for o in _core.generator_options()}`), each setting args.<name, a dot as an underscore>;
    the rest as `add_context_flags`."""
    defaults = defaults or {}
    for name in names:
        o = rows[name]
        dest = name.replace(".", "_")
        default = defaults.get(name)
        help_text = o["help"] + (f" (here: {default})" if default is not None else "")
        if o["type"] == 2:  # a bool on by default: llama.cpp's --no-NAME turns it off
            flags = ["--no-" + f.lstrip("-") for f in o["flags"]] if o["default"] == "true" else o["flags"]
            parser.add_argument(*flags, dest=dest, action="store_const", const=o["default"] != "true",
                                default=None, help=help_text)
            continue
        kind = {0: int, 1: float}.get(o["type"], str)  # INT, FLOAT; the rest as text
        parser.add_argument(*o["flags"], dest=dest, metavar=o["hint"], type=kind,
                            default=None if default is None else kind(default), help=help_text,
                            action="append" if o["repeatable"] else "store")  # a list: given again, it extends


def context_options_of(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """The options `add_context_flags` read, as Model's keywords (a repeated flag's values as one list)."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}
