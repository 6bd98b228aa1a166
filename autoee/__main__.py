"""python -m specee.autoee {regenerate,train-eagle,collect,train,select-layers,export} ... (see --help of each)."""

from __future__ import annotations

import argparse

from specee._optional import missing_package_exits

with missing_package_exits("python -m specee.autoee"):
    from specee.autoee import collect, export, regenerate, select_layers, train, train_eagle

COMMANDS = {"regenerate": regenerate, "train-eagle": train_eagle, "collect": collect, "train": train,
            "select-layers": select_layers, "export": export}


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m specee.autoee",
        description="Training for SpecEE: the EAGLE draft head (regenerate, train-eagle) and the exit predictors "
                    "(collect, train, select-layers, export)",
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, module in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.DESCRIPTION, description=module.DESCRIPTION))
    args = ap.parse_args()
    try:
        with missing_package_exits(f"python -m specee.autoee {args.command}"):
            COMMANDS[args.command].run(args)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}")
    except KeyboardInterrupt:
        raise SystemExit("interrupted: run again with the same arguments (and --resume) to continue")


if __name__ == "__main__":
    main()
