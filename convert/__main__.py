"""python -m specee.convert {hf,lora,merge,import-specee,inspect,quantize,synth} ... (see --help of each)."""

from __future__ import annotations

from specee._optional import missing_package_exits, run_subcommands

with missing_package_exits("python -m specee.convert"):
    from specee.convert import hf, import_specee, inspect, lora, merge, quantize, synth

COMMANDS = {"hf": hf, "lora": lora, "merge": merge, "import-specee": import_specee, "inspect": inspect,
            "quantize": quantize, "synth": synth}


def main() -> None:
    run_subcommands("python -m specee.convert",
                    "GGUF conversion for SpecEE: Hugging Face -> GGUF, merging draft heads and exit predictors, "
                    "importing SpecEE's eauto files, inspecting and retyping GGUF files, synthetic files for cost "
                    "benchmarks",
                    COMMANDS, "interrupted: no output written")


if __name__ == "__main__":
    main()
