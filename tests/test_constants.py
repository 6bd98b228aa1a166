"""python/specee/constants.py mirrors the C++ tensor-name table."""

from specee import _core, constants


def test_tensor_names_mirror_the_core_table() -> None:
    assert list(constants.TENSOR_NAMES) == list(_core.arch_tensor_names())


def test_eagle_tensor_names_mirror_the_core_table() -> None:
    assert list(constants.EAGLE_TENSOR_NAMES) == list(_core.arch_eagle_tensor_names())


def test_family_table_mirrors_the_core_table() -> None:
    assert [f.row() for f in constants.FAMILIES.values()] == list(_core.arch_families())


def test_family_tensors_are_in_the_tensor_table() -> None:
    """Every family's layer tensors are names of the tensor table (the C++ rows are built from it)."""
    for f in constants.FAMILIES.values():
        assert set(f.layer_tensors) <= set(constants.TENSOR_NAMES), f.name
        assert f.rope in ("normal", "neox")


def test_key_names_are_the_llama_keys() -> None:
    assert constants.KEY_BLOCK_COUNT.format(arch=constants.ARCH) == "llama.block_count"
    assert constants.KEY_LAYER_NORM_RMS_EPS.format(arch="llama") == "llama.attention.layer_norm_rms_epsilon"


def test_key_table_mirrors_the_core_table() -> None:
    """Every GGUF key the runtime reads has the same name (KEY_<NAME>) and value in C++ and Python."""
    core = {name: value.replace("%s", "{arch}") for name, value in _core.arch_keys().items()}
    python = {name: getattr(constants, name) for name in dir(constants) if name.startswith("KEY_")}
    assert core == python


def test_pred_tensor_names_mirror_the_core_table() -> None:
    assert list(constants.PRED_TENSOR_NAMES) == list(_core.arch_pred_tensor_names())
