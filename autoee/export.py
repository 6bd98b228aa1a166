"""python -m specee.autoee export: the trained exit predictors in this project's layout, for
`python -m specee.convert merge BASE.gguf --predictors OUT.safetensors`.

OUT.safetensors holds blk.N.pred.{up,down}.{weight,bias} (float32; up [512, 3k], down [1, 512]) for every
trained layer (0 .. L-2: the run-time schedule may check layers around earlier exits, outside the static set);
OUT.json = {"format": "specee-predictors", "exit_layers": the selected static set, "threshold",
"n_candidates", plus how the predictors were made: data, training settings, per-layer validation numbers,
the selection rule and its simulated outcome}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from safetensors.torch import save_file

from specee.autoee.collect import add_common, work_dir
from specee.autoee.eagle_export import output_pair
from specee.autoee.exit_features import ExitPredictor, predictor_tensors
from specee.autoee.select_layers import SELECTION
from specee.autoee.train import CHECKPOINT, load_checkpoint, predictors_of
from specee.convert.output import PathLike, temp_output

DESCRIPTION = "Export the trained exit predictors (OUT.safetensors + OUT.json) for `specee.convert merge`"


def export_predictors(predictors: dict[int, ExitPredictor], out: str | Path, exit_layers: list[int],
                      threshold: float, n_candidates: int, info: dict | None = None,
                      inputs: Sequence[PathLike] = ()) -> tuple[Path, Path]:
    """Write OUT.safetensors and OUT.json (OUT with or without the .safetensors suffix), neither of them one of
    `inputs`."""
    weights, meta = output_pair(out, inputs)
    if missing := sorted(set(exit_layers) - set(predictors)):
        raise ValueError(f"exit layers {missing} have no trained predictor")
    tensors = predictor_tensors(predictors)
    with temp_output(weights, sum(t.nbytes for t in tensors.values()), inputs) as tmp:
        save_file(tensors, tmp)
    settings = {"format": "specee-predictors", "exit_layers": sorted(exit_layers), "threshold": threshold,
                "n_candidates": n_candidates, **(info or {})}
    with temp_output(meta, 0, inputs) as tmp:
        tmp.write_text(json.dumps(settings, indent=1) + "\n", encoding="utf-8")
    return weights, meta


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_common(ap)
    ap.add_argument("-o", "--out", required=True, help="OUT.safetensors + OUT.json")
    ap.add_argument("--exit-layers", help="comma-separated static set (default: select-layers' choice)")


def run(args: argparse.Namespace) -> None:
    work = work_dir(args)
    ckpt = load_checkpoint(work / CHECKPOINT)
    sel_path = work / SELECTION
    selection = json.loads(sel_path.read_text()) if sel_path.is_file() else None
    if args.exit_layers:
        layers = sorted(int(x) for x in args.exit_layers.split(","))
    elif selection is not None:
        layers = selection["exit_layers"]
    else:
        raise ValueError(f"{sel_path} is missing: run select-layers first, or give --exit-layers")
    threshold = selection["threshold"] if selection is not None else ckpt["threshold"]
    data = ckpt["data"]
    info = {
        "base_model": data["model"], "base_model_sha256": data["model_sha256"],
        "eagle_head": data["head"], "eagle_head_sha256": data["head_sha256"],
        "data": {k: data[k] for k in ("n_tokens", "n_prompts", "n_done", "skip", "max_new", "max_prompt",
                                      "chat_template", "excluded_prompts")} | {"tree_depth": data.get("tree_depth", 0)},
        "training": ckpt["config"],
        "selection": {k: selection[k] for k in ("rule", "costs", "validation")} if selection else None,
        "per_layer_validation": {layer: s["val"] for layer, s in sorted(ckpt["stats"].items(), key=lambda x: int(x[0]))},
    }
    weights, meta = export_predictors(predictors_of(ckpt), args.out, layers, threshold, data["n_candidates"], info,
                                      inputs=[work / CHECKPOINT, sel_path])
    print(f"wrote {weights} and {meta} (exit layers {layers}, threshold {threshold})")
