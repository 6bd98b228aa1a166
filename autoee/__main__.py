"""python -m specee.autoee {train-eagle} ... (see --help of each)."""

from __future__ import annotations

import argparse

from specee.autoee import train_eagle

COMMANDS = {"train-eagle": train_eagle}


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m specee.autoee",
        description="Training for SpecEE: the EAGLE draft head (exit predictors come later)",
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, module in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.DESCRIPTION, description=module.DESCRIPTION))
    args = ap.parse_args()
    try:
        COMMANDS[args.command].run(args)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}")
    except KeyboardInterrupt:
        raise SystemExit("interrupted: run again with the same arguments (and --resume) to continue")


if __name__ == "__main__":
    main()
