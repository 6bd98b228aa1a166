"""What `merge` adds to a base GGUF or writes as a draft head file: an EAGLE-1 or EAGLE-3 draft head and per-layer
exit predictors, read from their published layouts and from this project's own, and checked against the base model.

EAGLE-1 head, published layout (`yuhuili/EAGLE-*`): a folder with config.json and pytorch_model.bin or
model.safetensors holding fc.weight [H, 2H], fc.bias [H], layers.0.self_attn.{q,k,v,o}_proj.weight,
layers.0.mlp.{gate,up,down}_proj.weight, layers.0.post_attention_layernorm.weight and optionally
embed_tokens.weight [V, H].

EAGLE-3 head, published layout (`yuhuili/EAGLE3-*`): a folder with config.json and pytorch_model.bin or
model.safetensors holding fc.weight [H, 3H] (no bias), midlayer.{input_layernorm,hidden_norm,
post_attention_layernorm}.weight, midlayer.self_attn.{q,k,v}_proj.weight [.., 2H], o_proj, midlayer.mlp.*,
norm.weight, lm_head.weight [V_draft, H], d2t [V_draft] (draft id -> target id offset) and t2d [V] (target id in
the draft vocabulary); no embed_tokens (the target's is used). d2t becomes the draft vocabulary of absolute target
ids. The feature layers: config.json's eagle_aux_hidden_state_layer_ids when present (EAGLE's convention: the
*inputs* of those layers), else EAGLE's default for the target, the inputs of layers 2, L//2 and L-3; stored as
the outputs of the layers before them (specee.eagle.feature_layers: 1, L//2 - 1, L - 4), or merge's
--eagle-feature-layers (outputs, 0-based).

EAGLE-1 head, own layout: NAME.safetensors with the tensors under their GGUF names (eagle.fc.weight,
eagle.attn_q.weight, ...; see specee.constants), q and k rows in Hugging Face's order (merge permutes
them), plus NAME.json: {"format": "specee-eagle", "eagle_version": 1} and, with a reduced draft
vocabulary (eagle.output.weight [V_draft, H]), "draft_vocab": [target token id of each row]. An EAGLE-3 head in
this layout: "eagle_version": 3, eagle.output.weight and "draft_vocab" required, "feature_layers": [3 layers].

Exit predictors, SpecEE's layout: one safetensors file with model.layers.{i}.pred.up.weight [512, 12],
.pred.up.bias [512], .pred.down.weight [1, 512], .pred.down.bias [1] for some layers i.

Exit predictors, own layout: NAME.safetensors with blk.{i}.pred.{up,down}.{weight,bias}, plus an
optional NAME.json: {"format": "specee-predictors", "exit_layers": [...], "threshold": 0.5,
"n_candidates": 4}.

EAGLE-1 head, GGUF layout: a draft head file NAME.gguf (what `merge --draft-head-only` or
`train-eagle --head-gguf` write): eagle.* tensors already in GGML's order, specee.eagle.* keys (the draft
vocabulary among them). Its exit predictors, if any, are not read from it (give them with --predictors).

Exit predictors saved by SpecEE's training as model{i}.pth (`torch.save` of a whole module, a pickle) are
refused: see PTH_TO_SAFETENSORS for what to give instead.

EAGLE's q/k rows are permuted exactly as the base model's attn_q/attn_k (llama.cpp's converter, and
SpecEE's for its eauto files, do the same), because the head uses the base model's RoPE (GGML's
NORM mode, adjacent pairs) in this runtime.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from specee import constants as C
from specee.convert.checkpoint import RefusedPickleError, SourceTensor, open_checkpoint
from specee.convert.hf import permute
from specee.convert.output import field_value, read_fields
from specee.convert.retype import Field

# SpecEE's static exit layer set, hard-coded in its llama.cpp fork for Llama-2-7B (32 layers)
SPECEE_LLAMA2_7B_EXIT_LAYERS = (15, 16, 17, 19, 21, 24, 26, 28)
DEFAULT_THRESHOLD = 0.5
DEFAULT_N_CANDIDATES = 4

EAGLE_PUBLISHED = {
    "embed_tokens.weight": C.EAGLE_TOKEN_EMBD,
    "fc.weight": C.EAGLE_FC,
    "fc.bias": C.EAGLE_FC_BIAS,
    "layers.0.self_attn.q_proj.weight": C.EAGLE_ATTN_Q,
    "layers.0.self_attn.k_proj.weight": C.EAGLE_ATTN_K,
    "layers.0.self_attn.v_proj.weight": C.EAGLE_ATTN_V,
    "layers.0.self_attn.o_proj.weight": C.EAGLE_ATTN_OUTPUT,
    "layers.0.post_attention_layernorm.weight": C.EAGLE_FFN_NORM,
    "layers.0.mlp.gate_proj.weight": C.EAGLE_FFN_GATE,
    "layers.0.mlp.up_proj.weight": C.EAGLE_FFN_UP,
    "layers.0.mlp.down_proj.weight": C.EAGLE_FFN_DOWN,
}
EAGLE3_PUBLISHED = {
    "embed_tokens.weight": C.EAGLE_TOKEN_EMBD,
    "fc.weight": C.EAGLE_FC,
    "midlayer.input_layernorm.weight": C.EAGLE_ATTN_NORM,  # the token embedding's norm
    "midlayer.hidden_norm.weight": C.EAGLE_HIDDEN_NORM,
    "midlayer.self_attn.q_proj.weight": C.EAGLE_ATTN_Q,
    "midlayer.self_attn.k_proj.weight": C.EAGLE_ATTN_K,
    "midlayer.self_attn.v_proj.weight": C.EAGLE_ATTN_V,
    "midlayer.self_attn.o_proj.weight": C.EAGLE_ATTN_OUTPUT,
    "midlayer.post_attention_layernorm.weight": C.EAGLE_FFN_NORM,
    "midlayer.mlp.gate_proj.weight": C.EAGLE_FFN_GATE,
    "midlayer.mlp.up_proj.weight": C.EAGLE_FFN_UP,
    "midlayer.mlp.down_proj.weight": C.EAGLE_FFN_DOWN,
    "norm.weight": C.EAGLE_OUTPUT_NORM,
    "lm_head.weight": C.EAGLE_OUTPUT,
}
EAGLE3_VOCAB_MAPS = ("d2t", "t2d")
EAGLE_IGNORED = ("rotary_emb.inv_freq",)
PRED_PARTS = {"up.weight": C.PRED_UP, "up.bias": C.PRED_UP_BIAS, "down.weight": C.PRED_DOWN,
              "down.bias": C.PRED_DOWN_BIAS}
PRED_SPECEE_RE = re.compile(r"model\.layers\.(\d+)\.pred\.(up|down)\.(weight|bias)$")
PRED_OWN_RE = re.compile(r"blk\.(\d+)\.pred\.(up|down)\.(weight|bias)$")
# SpecEE's training saves each layer's predictor as model{i}.pth: `torch.save` of the whole module, a pickle of
# its script's class __main__.MLP (fc1, relu, fc2, sigmoid), refused as any pickle is. The refusal says what to
# give instead; the command converts them for a user who trusts the files (a stand-in class MLP lets them unpickle;
# the layer number is the last number of each file name).
PTH_TO_SAFETENSORS = (
    r"""python -c 'import re, sys, torch, safetensors.torch as st; MLP = type("MLP", (torch.nn.Module,), {}); """
    r"""st.save_file({"model.layers.%s.pred.%s" % (re.findall(r"\d+", p)[-1], k.replace("fc1", "up")"""
    r""".replace("fc2", "down")): t.float().contiguous() for p in sys.argv[2:] for k, t in torch.load(p, """
    r"""map_location="cpu", weights_only=False).state_dict().items()}, sys.argv[1])' preds.safetensors model*.pth"""
)
PTH_REFUSED = (
    "SpecEE's model{i}.pth predictor files are pickled modules, which are not loaded here. Give --predictors a "
    "safetensors file instead: SpecEE's published one (model.layers.N.pred.{up,down}.{weight,bias}), or convert "
    "the .pth files yourself if you trust them (unpickling them can run any code they hold):\n  " + PTH_TO_SAFETENSORS
)


# ---- the base model


@dataclass
class BaseModel:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int

    def describe(self) -> str:
        return (f"{self.arch}: {self.n_layer} layers, n_embd {self.n_embd}, n_ff {self.n_ff}, "
                f"{self.n_head} heads / {self.n_head_kv} KV heads, vocab {self.n_vocab}")


def base_model(fields: dict[str, Field], reader: gguf.GGUFReader, path: str | os.PathLike) -> BaseModel:
    """The hyperparameters of a llama (or eauto) GGUF, for shape checks."""
    arch = str(field_value(fields[gguf.Keys.General.ARCHITECTURE]))

    def get(key: str, default: int | None = None) -> int:
        f = fields.get(key.format(arch=arch))
        if f is None and default is None:
            raise ValueError(f"{path}: metadata key {key.format(arch=arch)} is missing")
        return int(f.value) if f is not None else int(default)

    n_embd, n_head = get(C.KEY_EMBEDDING_LENGTH), get(C.KEY_HEAD_COUNT)
    embd = next((t for t in reader.tensors if t.name == C.TOKEN_EMBD), None)
    n_vocab = int(embd.shape[1]) if embd is not None else get(C.KEY_VOCAB_SIZE)
    return BaseModel(
        arch=arch,
        n_layer=get(C.KEY_BLOCK_COUNT),
        n_embd=n_embd,
        n_ff=get(C.KEY_FEED_FORWARD_LENGTH),
        n_head=n_head,
        n_head_kv=get(C.KEY_HEAD_COUNT_KV, n_head),
        head_dim=get(C.KEY_KEY_LENGTH, n_embd // n_head),
        n_vocab=n_vocab,
    )


# ---- EAGLE head


@dataclass
class EagleHead:
    tensors: dict[str, np.ndarray]  # GGUF name -> float32 data (numpy order), q/k rows permuted for GGML
    version: int = 1
    n_ff: int = 0
    draft_vocab: list[int] | None = None
    source: str = ""
    feature_layers: list[int] | None = None  # EAGLE-3: target layers whose outputs form the feature (0-based)
    names: dict[str, str] | None = None  # GGUF name -> the checkpoint's, for messages
    acceptance: float | None = None  # held-out acceptance of the first drafted token (specee.eagle.acceptance)


def training_acceptance(settings: dict) -> float | None:
    """The held-out acceptance recorded by train-eagle in NAME.json: teacher-forced top-1 on the target's own replies
    (`validation_assistant_tokens`), else on all held-out tokens (`validation`)."""
    for key in ("validation_assistant_tokens", "validation"):
        value = (settings.get(key) or {}).get("top1_accuracy")
        if isinstance(value, (int, float)) and 0.0 <= value <= 1.0:
            return float(value)
    return None


def eagle_layout(path: Path) -> str:
    """'published' (a folder or weight file with config.json), 'own' (NAME.safetensors + NAME.json) or 'gguf'
    (a draft head file)."""
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.is_dir() and (path / "config.json").is_file():
        return "published"
    if path.is_file() and path.suffix == ".safetensors" and path.with_suffix(".json").is_file():
        return "own"
    if path.is_file() and (path.parent / "config.json").is_file():
        return "published"
    raise FileNotFoundError(
        f"{path}: not an EAGLE head: expected a folder with config.json and pytorch_model.bin or "
        "model.safetensors (the published layout), NAME.safetensors with NAME.json (this project's layout) "
        "or a draft head file NAME.gguf"
    )


def published_weights(path: Path) -> Path:
    if path.is_file():
        return path
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).is_file():
            return path / name
    raise FileNotFoundError(f"{path}: no model.safetensors or pytorch_model.bin in the EAGLE head folder")


def check_config(config: dict, base: BaseModel, path: Path, version: int = 1) -> None:
    """A published head's config.json is its base model's config: it must describe this base model (an EAGLE-3
    head's feed-forward length is its own)."""
    pairs = [
        ("hidden_size", base.n_embd, "embedding_length"),
        ("target_hidden_size", base.n_embd, "embedding_length"),
        ("num_attention_heads", base.n_head, "attention.head_count"),
        ("num_key_value_heads", base.n_head_kv, "attention.head_count_kv"),
        ("intermediate_size", base.n_ff if version == 1 else None, "feed_forward_length"),
        ("vocab_size", base.n_vocab, "vocab_size"),
    ]
    for key, want, gguf_key in pairs:
        got = config.get(key)
        if got is not None and want is not None and int(got) != want:
            raise ValueError(
                f"the EAGLE head does not fit the base model: {key} is {got} in {path / 'config.json'} "
                f"but the base model's {base.arch}.{gguf_key} is {want} (a head trained for another model?)"
            )


def eagle3_default_layers(n_layer: int) -> list[int]:
    """EAGLE's own feature layers for a target of n_layer layers: the inputs of layers 2, L//2 and L-3, that is
    the outputs of layers 1, L//2 - 1 and L - 4."""
    inputs = [2, n_layer // 2, n_layer - 3]
    if not inputs[0] < inputs[1] < inputs[2]:
        raise ValueError(
            f"a {n_layer}-layer target has no EAGLE-3 default feature layers (EAGLE takes the inputs of layers 2, "
            f"L//2 and L-3: {inputs}, not three distinct layers): give them with --eagle-feature-layers"
        )
    return [i - 1 for i in inputs]


def config_feature_layers(config: dict, path: Path) -> list[int] | None:
    """eagle_aux_hidden_state_layer_ids of a published config (top level or in eagle_config), in EAGLE's
    convention (the inputs of those layers), as the outputs of the layers before them; None when not given."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return None
    if any(int(i) < 1 for i in ids):
        raise ValueError(f"{path / 'config.json'}: eagle_aux_hidden_state_layer_ids {list(ids)} takes the input of "
                         "layer 0 (the token embedding), which this runtime does not give a draft head")
    return [int(i) - 1 for i in ids]


def check_feature_layers(layers: list[int], base: BaseModel, path: Path) -> list[int]:
    if len(layers) != 3 or not all(0 <= int(i) < base.n_layer for i in layers):
        raise ValueError(f"{path}: EAGLE-3 feature layers {list(layers)}: expected 3 layers of the base model's "
                         f"0..{base.n_layer - 1} (the outputs of those layers)")
    return [int(i) for i in layers]


def eagle3_draft_vocab(tables: dict[str, torch.Tensor], base: BaseModel, path: Path) -> list[int] | None:
    """The draft vocabulary as absolute target ids from EAGLE-3's d2t (target = draft + d2t[draft]), checked
    against t2d when the checkpoint has it; None without d2t (the head's lm_head then covers the whole vocabulary)."""
    if "d2t" not in tables:
        if "t2d" in tables:
            raise ValueError(f"{path}: the EAGLE-3 head has t2d but no d2t (its draft tokens' target ids)")
        return None
    d2t = tables["d2t"].reshape(-1).to(torch.int64)
    ids = torch.arange(len(d2t), dtype=torch.int64) + d2t
    bad = ((ids < 0) | (ids >= base.n_vocab)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"{path}: d2t maps draft token {i} to target id {int(ids[i])}, outside the base "
                         f"vocabulary [0, {base.n_vocab})")
    if "t2d" in tables:
        t2d = tables["t2d"].reshape(-1).to(torch.bool)
        if len(t2d) != base.n_vocab:
            raise ValueError(f"{path}: t2d has {len(t2d)} entries but the base vocabulary has {base.n_vocab}")
        if int(t2d.sum()) != len(ids) or not bool(t2d[ids].all()):
            raise ValueError(f"{path}: t2d marks {int(t2d.sum())} target tokens, which are not the {len(ids)} that "
                             "d2t maps to")
    return ids.tolist()


def published_version(names: list[str]) -> int:
    return 3 if any(n.startswith("midlayer.") or n in EAGLE3_VOCAB_MAPS for n in names) else 1


def read_published(path: Path, base: BaseModel, stack: ExitStack, feature_layers: list[int] | None):
    """A published head's sources, their GGUF names, its settings (version, draft vocabulary, feature layers)."""
    folder = path if path.is_dir() else path.parent
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    sources = open_checkpoint(published_weights(path), stack)
    version = published_version([s.name for s in sources])
    check_config(config, base, folder, version)
    table = EAGLE3_PUBLISHED if version == 3 else EAGLE_PUBLISHED
    names, tables = {}, {}
    for src in sources:
        if src.name.endswith(EAGLE_IGNORED):
            continue
        if version == 3 and src.name in EAGLE3_VOCAB_MAPS:
            tables[src.name] = src.load()
            continue
        if src.name not in table:
            raise ValueError(f"{path}: unexpected tensor {src.name!r} for an EAGLE-{version} head")
        names[src.name] = table[src.name]
    settings: dict = {"eagle_version": version}
    if version == 3:
        settings["draft_vocab"] = eagle3_draft_vocab(tables, base, path)
        n_draft = config.get("draft_vocab_size")
        if n_draft is not None and settings["draft_vocab"] is not None and int(n_draft) != len(settings["draft_vocab"]):
            raise ValueError(f"{folder / 'config.json'}: draft_vocab_size is {n_draft} but d2t has "
                             f"{len(settings['draft_vocab'])} entries")
        settings["feature_layers"] = feature_layers or config_feature_layers(config, folder) or \
            eagle3_default_layers(base.n_layer)
    elif feature_layers:
        raise ValueError(f"{path}: feature layers are given but the head is EAGLE-1 (they are for EAGLE-3 heads)")
    return sources, names, settings


def load_eagle(path: str | os.PathLike, base: BaseModel, feature_layers: list[int] | None = None) -> EagleHead:
    """An EAGLE-1 or EAGLE-3 head in any layout, with its shapes checked against `base`; feature_layers (EAGLE-3,
    the outputs of those layers) replace the checkpoint's or the default."""
    path = Path(path)
    layout = eagle_layout(path)
    if layout == "gguf":
        return load_eagle_gguf(path, base, feature_layers)
    with ExitStack() as stack:
        if layout == "published":
            sources, names, settings = read_published(path, base, stack, feature_layers)
        else:
            settings = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
            if settings.get("format") != "specee-eagle":
                raise ValueError(f"{path.with_suffix('.json')}: \"format\" must be \"specee-eagle\"")
            sources = open_checkpoint(path, stack)
            names = {src.name: src.name for src in sources}
            if unknown := sorted(set(names) - set(C.EAGLE_TENSOR_NAMES)):
                raise ValueError(f"{path}: unexpected tensors {unknown} (expected {list(C.EAGLE_TENSOR_NAMES)})")
            if feature_layers:
                settings["feature_layers"] = feature_layers
        tensors = {names[s.name]: eagle_tensor(s, names[s.name], base) for s in sources if s.name in names}
    head = EagleHead(tensors, int(settings.get("eagle_version", 1)), source=f"{layout} layout: {path}",
                     names={gg: src for src, gg in names.items()})
    head.acceptance = training_acceptance(settings)
    return finish_head(head, settings.get("draft_vocab"), settings.get("feature_layers"), base, path)


def finish_head(head: EagleHead, draft_vocab: list[int] | None, feature_layers: list[int] | None, base: BaseModel,
                path: Path) -> EagleHead:
    """The version's settings checked, the shapes checked against the base model."""
    if head.version not in (1, 3):
        raise ValueError(f"{path}: EAGLE version {head.version} is not supported (this runtime reads EAGLE-1 and "
                         "EAGLE-3 heads)")
    head.draft_vocab = [int(i) for i in draft_vocab] if draft_vocab is not None else None
    if head.version == 3:
        if head.draft_vocab is None and C.EAGLE_OUTPUT in head.tensors:
            head.draft_vocab = list(range(base.n_vocab))  # an lm_head over the whole vocabulary
        if feature_layers is None:
            raise ValueError(f"{path}: the EAGLE-3 head has no feature layers")
        head.feature_layers = check_feature_layers(feature_layers, base, path)
    elif feature_layers:
        raise ValueError(f"{path}: feature layers are given but the head is EAGLE-1 (they are for EAGLE-3 heads)")
    head.n_ff = check_eagle_shapes(head, base, path)
    return head


def load_eagle_gguf(path: Path, base: BaseModel, feature_layers: list[int] | None = None) -> EagleHead:
    """A draft head file's eagle.* tensors (q/k rows already in GGML's order) and specee.eagle.* keys."""
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e
    fields = read_fields(reader)
    tensors = {}
    for t in reader.tensors:
        if not t.name.startswith("eagle."):
            continue
        if t.name not in C.EAGLE_TENSOR_NAMES:
            raise ValueError(f"{path}: unexpected tensor {t.name!r} (expected {list(C.EAGLE_TENSOR_NAMES)})")
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        tensors[t.name] = np.asarray(data, dtype=np.float32).reshape(tuple(int(n) for n in reversed(t.shape)))
    if not tensors:
        raise ValueError(f"{path}: no eagle.* tensors: not a draft head file")
    version = fields.get(C.KEY_EAGLE_VERSION)
    head = EagleHead(tensors, int(field_value(version)) if version else 1, source=f"gguf layout: {path}")
    vocab = fields.get(C.KEY_EAGLE_DRAFT_VOCAB)
    acceptance = fields.get(C.KEY_EAGLE_ACCEPTANCE)
    head.acceptance = float(field_value(acceptance)) if acceptance else None
    layers = fields.get(C.KEY_EAGLE_FEATURE_LAYERS)
    if feature_layers is None and layers is not None:
        feature_layers = [int(i) for i in field_value(layers)]
    return finish_head(head, [int(i) for i in field_value(vocab)] if vocab else None, feature_layers, base, path)


def eagle_tensor(src: SourceTensor, name: str, base: BaseModel) -> np.ndarray:
    t = src.load()
    if name == C.EAGLE_ATTN_Q:
        t = permute(t, base.n_head, base.n_head)
    elif name == C.EAGLE_ATTN_K:
        t = permute(t, base.n_head, base.n_head_kv)
    return t.to(torch.float32).numpy()


def shape_error(head: EagleHead, base: BaseModel, name: str, shape: tuple[int, ...]) -> ValueError:
    src = (head.names or {}).get(name)
    called = f"{name} ({src})" if src and src != name else name
    return ValueError(
        f"the EAGLE-{head.version} head does not fit the base model ({base.describe()}): {called} has shape "
        f"{list(head.tensors[name].shape)}, expected {list(shape)}"
    )


def check_eagle_shapes(head: EagleHead, base: BaseModel, path: Path) -> int:
    """Check every tensor's shape against the base model; return the head's FFN length."""
    t, v3 = head.tensors, head.version == 3
    optional = C.EAGLE3_OPTIONAL if v3 else C.EAGLE_OPTIONAL
    if missing := [n for n in C.EAGLE_TENSOR_NAMES if n not in t and n not in optional]:
        raise ValueError(f"{path}: the EAGLE-{head.version} head lacks {missing}")
    if v3 and C.EAGLE_FC_BIAS in t:
        raise ValueError(f"{path}: {C.EAGLE_FC_BIAS} is an EAGLE-1 tensor: an EAGLE-3 head's fc has no bias")
    if not v3 and (extra := [n for n in C.EAGLE3_ONLY if n in t]):
        raise ValueError(f"{path}: {extra} are EAGLE-3 tensors, but the head is EAGLE-1")
    h = base.n_embd
    if t[C.EAGLE_FC].shape[0] != h or t[C.EAGLE_FC].ndim != 2:
        raise ValueError(
            f"the EAGLE head does not fit the base model: its hidden size is {t[C.EAGLE_FC].shape[0]} "
            f"(fc.weight {list(t[C.EAGLE_FC].shape)}) but the base model's {base.arch}.embedding_length is {h} "
            f"(a head trained for another model?)"
        )
    n_ff = t[C.EAGLE_FFN_GATE].shape[0]
    n_in = 2 * h if v3 else h  # EAGLE-3's attention reads concat(embedding, feature)
    want = {
        C.EAGLE_FC: (h, 3 * h if v3 else 2 * h),
        C.EAGLE_FC_BIAS: (h,),
        C.EAGLE_ATTN_Q: (base.n_head * base.head_dim, n_in),
        C.EAGLE_ATTN_K: (base.n_head_kv * base.head_dim, n_in),
        C.EAGLE_ATTN_V: (base.n_head_kv * base.head_dim, n_in),
        C.EAGLE_ATTN_OUTPUT: (h, base.n_head * base.head_dim),
        C.EAGLE_FFN_NORM: (h,),
        C.EAGLE_FFN_GATE: (n_ff, h),
        C.EAGLE_FFN_UP: (n_ff, h),
        C.EAGLE_FFN_DOWN: (h, n_ff),
        C.EAGLE_TOKEN_EMBD: (base.n_vocab, h),
        C.EAGLE_ATTN_NORM: (h,),
        C.EAGLE_HIDDEN_NORM: (h,),
        C.EAGLE_OUTPUT_NORM: (h,),
    }
    if C.EAGLE_OUTPUT in t:
        if head.draft_vocab is None:
            raise ValueError(f"{path}: eagle.output.weight needs \"draft_vocab\" (its rows' target token ids)")
        want[C.EAGLE_OUTPUT] = (len(head.draft_vocab), h)
        if not all(0 <= int(i) < base.n_vocab for i in head.draft_vocab):
            raise ValueError(f"{path}: draft_vocab holds token ids outside the base vocabulary (0..{base.n_vocab - 1})")
        rows = t[C.EAGLE_OUTPUT].shape[0]
        if v3 and head.names and rows != len(head.draft_vocab):
            raise ValueError(f"{path}: lm_head.weight has {rows} rows but d2t maps {len(head.draft_vocab)} draft "
                             "tokens (one per row)")
    elif head.draft_vocab is not None:
        raise ValueError(f"{path}: \"draft_vocab\" is given but there is no eagle.output.weight")
    for name, shape in want.items():
        if name in t and tuple(t[name].shape) != shape:
            raise shape_error(head, base, name, shape)
    return int(n_ff)


# ---- exit predictors


@dataclass
class Predictors:
    tensors: dict[str, np.ndarray]  # blk.{i}.pred.* -> float32 data (numpy order)
    layers: list[int]
    n_candidates: int
    exit_layers: list[int] | None = None  # from the settings file, if any
    threshold: float | None = None
    source: str = ""
    speedup: float | None = None  # select-layers' simulated speedup with the draft head, for exit_layers/threshold


def load_predictors(path: str | os.PathLike, base: BaseModel) -> Predictors:
    """Exit predictors in SpecEE's layout or this project's, checked against `base`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such predictor file")
    settings_path = path.with_suffix(".json")
    settings = json.loads(settings_path.read_text(encoding="utf-8")) if settings_path.is_file() else {}
    if settings and settings.get("format") != "specee-predictors":
        raise ValueError(f"{settings_path}: \"format\" must be \"specee-predictors\"")
    tensors: dict[str, np.ndarray] = {}
    layout = "own"
    with ExitStack() as stack:
        try:
            sources = open_checkpoint(path, stack)
        except RefusedPickleError as e:
            raise RefusedPickleError(f"{e}\n{PTH_REFUSED}") from e
        for src in sources:
            if PRED_SPECEE_RE.match(src.name):
                layout = "SpecEE"
            m = PRED_SPECEE_RE.match(src.name) or PRED_OWN_RE.match(src.name)
            if not m:
                raise ValueError(f"{path}: unexpected tensor {src.name!r} in a predictor file")
            layer, part = int(m.group(1)), f"{m.group(2)}.{m.group(3)}"
            tensors[PRED_PARTS[part] % layer] = src.load().to(torch.float32).numpy()
    layers = sorted({int(n.split(".")[1]) for n in tensors})
    if not layers:
        raise ValueError(f"{path}: no predictor tensors")
    if bad := [i for i in layers if i >= base.n_layer]:
        raise ValueError(
            f"the predictors do not fit the base model: layers {bad} but the base model has {base.n_layer} layers"
        )
    first = tensors.get(C.PRED_UP % layers[0])
    if first is None or first.ndim != 2 or first.shape[1] % 3:
        raise ValueError(f"{path}: blk.{layers[0]}.pred.up.weight must be [hidden, 3 * n_candidates]")
    hidden, n_cand = first.shape[0], first.shape[1] // 3
    want = {C.PRED_UP: (hidden, 3 * n_cand), C.PRED_UP_BIAS: (hidden,), C.PRED_DOWN: (1, hidden),
            C.PRED_DOWN_BIAS: (1,)}
    for i in layers:
        for fmt, shape in want.items():
            name = fmt % i
            if name not in tensors:
                raise ValueError(f"{path}: layer {i} lacks its {name}")
            if tuple(tensors[name].shape) != shape:
                raise ValueError(f"{path}: {name} has shape {list(tensors[name].shape)}, expected {list(shape)}")
    if "n_candidates" in settings and int(settings["n_candidates"]) != n_cand:
        raise ValueError(f"{settings_path}: n_candidates {settings['n_candidates']} but the predictors take "
                         f"{3 * n_cand} features (n_candidates {n_cand})")
    return Predictors(
        tensors, layers, n_cand,
        exit_layers=[int(i) for i in settings["exit_layers"]] if "exit_layers" in settings else None,
        threshold=float(settings["threshold"]) if "threshold" in settings else None,
        source=f"{layout} layout: {path}",
        speedup=simulated_speedup(settings),
    )


def simulated_speedup(settings: dict) -> float | None:
    """Early exit's speedup over plain decoding, draft head included, that select-layers simulated for the settings'
    exit layers and threshold (`selection.validation.speedup_with_draft`)."""
    value = ((settings.get("selection") or {}).get("validation") or {}).get("speedup_with_draft")
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def default_exit_layers(pred_layers: list[int], n_layer: int) -> list[int]:
    """SpecEE's own set for a 32-layer model with predictors there (what its fork runs), else every
    predictor layer but the last layer (exiting there saves nothing)."""
    if n_layer == 32 and set(SPECEE_LLAMA2_7B_EXIT_LAYERS) <= set(pred_layers):
        return list(SPECEE_LLAMA2_7B_EXIT_LAYERS)
    return [i for i in pred_layers if i < n_layer - 1]


def check_exit_layers(exit_layers: list[int], pred_layers: list[int], n_layer: int) -> list[int]:
    layers = sorted(set(exit_layers))
    if bad := [i for i in layers if i not in pred_layers]:
        raise ValueError(f"exit layers {bad} have no predictor (predictors exist for layers {pred_layers})")
    if bad := [i for i in layers if i >= n_layer - 1]:
        raise ValueError(f"exit layers {bad}: the last layer is {n_layer - 1}, exiting there or later saves nothing")
    return layers
