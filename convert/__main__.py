"""python -m specee.convert {hf,lora,merge,import-specee,inspect,quantize,synth} ... (see --help of each)."""

from __future__ import annotations

import argparse

from specee._optional import missing_package_exits

with missing_package_exits("python -m specee.convert"):
    from specee.convert import hf, import_specee, inspect, lora, merge, quantize, synth

COMMANDS = {"hf": hf, "lora": lora, "merge": merge, "import-specee": import_specee, "inspect": inspect,
            "quantize": quantize, "synth": synth}


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m specee.convert",
        description="GGUF conversion for SpecEE: Hugging Face -> GGUF, merging draft heads and exit predictors, "
        "importing SpecEE's eauto files, inspecting and retyping GGUF files, synthetic files for cost benchmarks",
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, module in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.DESCRIPTION, description=module.DESCRIPTION))
    args = ap.parse_args()
    try:
        with missing_package_exits(f"python -m specee.convert {args.command}"):
            COMMANDS[args.command].run(args)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}")
    except KeyboardInterrupt:
        raise SystemExit("interrupted: no output written")


if __name__ == "__main__":
    main()
