"""Export a trained head in this project's EAGLE layout (read by `python -m specee.convert merge --eagle`):
NAME.safetensors with the tensors under their GGUF names (q/k rows in Hugging Face's order; merge permutes
them) and NAME.json {"format": "specee-eagle", "eagle_version": 1, "draft_vocab": [...] when the head has
an own lm_head, plus a record of how it was trained}. An EAGLE-3 head (Eagle3Head): "eagle_version": 3, its
"draft_vocab" and "feature_layers" (the target layers' outputs it takes, 0-based)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import save_file

from specee import constants as C
from specee.autoee.eagle_head import Eagle3Head, EagleHead
from specee.convert.output import PathLike, check_not_input, temp_output


def head_tensors(head: EagleHead | Eagle3Head, with_output: bool = True,
                 dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """The head's parameters under their GGUF names (module names are the GGUF names without `eagle.`),
    matrices as `dtype` (the runtime's F16 by default), vectors float32; with_output=False leaves out the
    draft-vocabulary lm_head (the runtime then uses the base lm_head)."""
    out = {f"eagle.{name}": p.detach().to(dtype if p.ndim > 1 else torch.float32).contiguous()
           for name, p in head.named_parameters() if with_output or not name.startswith("output.")}
    if unknown := sorted(set(out) - set(C.EAGLE_TENSOR_NAMES)):
        raise ValueError(f"parameters without a GGUF name: {unknown}")
    return out


def output_pair(out: str | Path, inputs: Sequence[PathLike] = ()) -> tuple[Path, Path]:
    """OUT.safetensors and OUT.json (OUT with or without the .safetensors suffix), checked not to be one of `inputs`,
    their folder made."""
    out = Path(out)
    weights = out if out.suffix == ".safetensors" else out.with_name(out.name + ".safetensors")
    meta = weights.with_suffix(".json")
    for path in (weights, meta):
        check_not_input(path, inputs)
    weights.parent.mkdir(parents=True, exist_ok=True)
    return weights, meta


def export_head(head: EagleHead | Eagle3Head, out: str | Path, info: dict | None = None, with_output: bool = True,
                dtype: torch.dtype = torch.float16, inputs: Sequence[PathLike] = ()) -> tuple[Path, Path]:
    """Write OUT.safetensors and OUT.json (OUT with or without the .safetensors suffix), neither of them one of
    `inputs`."""
    weights, meta = output_pair(out, inputs)
    tensors = head_tensors(head, with_output, dtype)
    with temp_output(weights, sum(t.nbytes for t in tensors.values()), inputs) as tmp:
        save_file(tensors, tmp)
    v3 = isinstance(head, Eagle3Head)
    if v3 and not with_output:
        raise ValueError("an EAGLE-3 head is exported with its own lm_head (eagle.output)")
    settings: dict = {"format": "specee-eagle", "eagle_version": 3 if v3 else 1}
    if head.draft_vocab is not None and with_output:
        settings["draft_vocab"] = [int(i) for i in head.draft_vocab]
    if v3:
        settings["feature_layers"] = [int(i) for i in head.feature_layers]
    settings.update(info or {})
    with temp_output(meta, 0, inputs) as tmp:
        tmp.write_text(json.dumps(settings, indent=1) + "\n", encoding="utf-8")
    return weights, meta
