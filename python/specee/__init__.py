"""SpecEE: Llama inference on ggml with speculative early exit and EAGLE speculative decoding."""

from specee._ggml import preload_ggml

preload_ggml()  # before the extension: it links libggml

from specee._core import SpecEEError  # noqa: E402
from specee.generate import (MODES, DraftParams, EagleParams, ExitParams, GenerateOptions,  # noqa: E402
                             GenerationStats, Mode, NgramParams, chat_apply_template)
from specee.model import Model, devices  # noqa: E402
from specee.paths import default_model_path  # noqa: E402
from specee.slots import SlotOutput, Slots  # noqa: E402

__all__ = ["MODES", "DraftParams", "EagleParams", "ExitParams", "GenerateOptions", "GenerationStats", "Mode", "Model", "NgramParams",
           "SlotOutput", "Slots", "SpecEEError", "chat_apply_template", "default_model_path", "devices"]
