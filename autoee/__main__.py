"""python -m specee.autoee {regenerate,train-eagle,collect,train,select-layers,export} ... (see --help of each)."""

from __future__ import annotations

from specee._optional import missing_package_exits, run_subcommands

with missing_package_exits("python -m specee.autoee"):
    from specee.autoee import collect, export, regenerate, select_layers, train, train_eagle

COMMANDS = {"regenerate": regenerate, "train-eagle": train_eagle, "collect": collect, "train": train,
            "select-layers": select_layers, "export": export}


def main() -> None:
    run_subcommands("python -m specee.autoee",
                    "Training for SpecEE: the EAGLE draft head (regenerate, train-eagle) and the exit predictors "
                    "(collect, train, select-layers, export)",
                    COMMANDS, "interrupted: run again with the same arguments (and --resume) to continue")


if __name__ == "__main__":
    main()
