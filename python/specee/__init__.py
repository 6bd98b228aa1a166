"""SpecEE: Llama inference on ggml with speculative early exit and EAGLE speculative decoding."""

from specee._core import SpecEEError
from specee.model import Model
from specee.paths import default_model_path

__all__ = ["Model", "SpecEEError", "default_model_path"]
