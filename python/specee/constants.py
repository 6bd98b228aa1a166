"""GGUF names the runtime reads: the tensor-name table, the model families' table and the metadata keys ("{arch}" is
the architecture name: "llama", "qwen2", ...); all mirror csrc/base/specee-arch, kept equal by
tests/test_constants.py."""

from __future__ import annotations

from dataclasses import dataclass

ARCH = "llama"  # the architecture of the files SpecEE's own tools write (synth, import-specee)

# ---- tensor names ("%d": block index), in the order of the C++ table

TOKEN_EMBD = "token_embd.weight"
OUTPUT_NORM = "output_norm.weight"
OUTPUT = "output.weight"
ROPE_FREQS = "rope_freqs.weight"
ATTN_NORM = "blk.%d.attn_norm.weight"
ATTN_Q = "blk.%d.attn_q.weight"
ATTN_K = "blk.%d.attn_k.weight"
ATTN_V = "blk.%d.attn_v.weight"
ATTN_OUTPUT = "blk.%d.attn_output.weight"
FFN_NORM = "blk.%d.ffn_norm.weight"
FFN_GATE = "blk.%d.ffn_gate.weight"
FFN_UP = "blk.%d.ffn_up.weight"
FFN_DOWN = "blk.%d.ffn_down.weight"
ATTN_Q_BIAS = "blk.%d.attn_q.bias"  # qwen2
ATTN_K_BIAS = "blk.%d.attn_k.bias"
ATTN_V_BIAS = "blk.%d.attn_v.bias"
ATTN_Q_NORM = "blk.%d.attn_q_norm.weight"  # qwen3: per-head RMS norms of Q and K, before RoPE
ATTN_K_NORM = "blk.%d.attn_k_norm.weight"
ATTN_QKV = "blk.%d.attn_qkv.weight"  # phi3: the Q, K and V rows in one matrix
# phi3 LongRoPE [n_rot / 2]: RoPE frequency factors for a context past the original one, and within it
ROPE_FACTORS_LONG = "rope_factors_long.weight"
ROPE_FACTORS_SHORT = "rope_factors_short.weight"
ATTN_POST_NORM = "blk.%d.post_attention_norm.weight"  # gemma2/3: RMS norms of the attention's and FFN's outputs
FFN_POST_NORM = "blk.%d.post_ffw_norm.weight"
# a reranker's classifier head (llama.cpp's names), read by rank pooling: tanh(cls h + b) [n_embd], then cls.output
# [n_labels] (either may be absent)
CLS = "cls.weight"
CLS_BIAS = "cls.bias"
CLS_OUT = "cls.output.weight"
CLS_OUT_BIAS = "cls.output.bias"

TENSOR_NAMES = (
    TOKEN_EMBD, OUTPUT_NORM, OUTPUT, ROPE_FREQS,
    ATTN_NORM, ATTN_Q, ATTN_K, ATTN_V, ATTN_OUTPUT,
    FFN_NORM, FFN_GATE, FFN_UP, FFN_DOWN,
    ATTN_Q_BIAS, ATTN_K_BIAS, ATTN_V_BIAS, ATTN_Q_NORM, ATTN_K_NORM, ATTN_QKV,
    ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT, ATTN_POST_NORM, FFN_POST_NORM, CLS, CLS_BIAS, CLS_OUT,
    CLS_OUT_BIAS,
)

# ---- model families: general.architecture (also the key prefix), RoPE type, the FFN's activation, embedding scale,
# sliding-window layers, the tensors every layer has


@dataclass(frozen=True)
class Family:
    name: str
    rope: str  # "normal" (GGML's interleaved pairs: the converter permutes Q/K rows) or "neox" (HF's rotate-half)
    layer_tensors: tuple[str, ...]  # all required; without FFN_GATE, FFN_UP is [2 n_ff, n_embd]: gate rows, then up
    ffn_act: str = "silu"  # "silu" (SwiGLU) or "gelu" (GeGLU with tanh's GELU: gemma)
    embd_scale: bool = False  # token embeddings times sqrt(n_embd) (gemma)
    # sliding-window layers as llama.cpp runs the family: 0, none (a window in the file is ignored, as upstream does
    # for Mistral and Phi-3); n, layer il slides unless il % n == n - 1 (KEY_SLIDING_WINDOW_PATTERN overrides)
    swa_pattern: int = 0
    swa_default: int = 0  # the window without KEY_SLIDING_WINDOW
    # the RoPE base of sliding layers without KEY_ROPE_FREQ_BASE_SWA, then unscaled (gemma3); 0: the global base and
    # scale
    swa_rope_base: int = 0
    # the layer count of the model whose queries llama.cpp scales by 1/sqrt(n_embd / n_head) (Gemma 27B's
    # query_pre_attn_scalar) when the file has no KEY_ATTENTION_SCALE; 0: none
    n_layer_embd_query_scale: int = 0
    # the vocabulary's special tokens but <s>, <unk> and <|endoftext|> take the whitespace after them in text (phi3)
    special_rstrip: bool = False

    def row(self) -> str:
        """The family as the C++ table lists it (specee._core.arch_families())."""
        return (f"{self.name} {self.rope} {self.ffn_act} {int(self.embd_scale)} {self.swa_pattern} "
                f"{self.swa_default} {self.swa_rope_base} {self.n_layer_embd_query_scale} {int(self.special_rstrip)} "
                f"{','.join(self.layer_tensors)}")


_LLAMA_ATTN = (ATTN_NORM, ATTN_Q, ATTN_K, ATTN_V, ATTN_OUTPUT)
_LLAMA_FFN = (FFN_NORM, FFN_GATE, FFN_UP, FFN_DOWN)
FAMILIES = {
    f.name: f
    for f in (
        Family("llama", "normal", _LLAMA_ATTN + _LLAMA_FFN),  # also Mistral
        Family("qwen2", "neox", _LLAMA_ATTN + (ATTN_Q_BIAS, ATTN_K_BIAS, ATTN_V_BIAS) + _LLAMA_FFN),
        Family("qwen3", "neox", _LLAMA_ATTN + (ATTN_Q_NORM, ATTN_K_NORM) + _LLAMA_FFN),
        Family("phi3", "neox", (ATTN_NORM, ATTN_QKV, ATTN_OUTPUT, FFN_NORM, FFN_UP, FFN_DOWN), special_rstrip=True),
        Family("gemma2", "neox", _LLAMA_ATTN + (ATTN_POST_NORM, FFN_POST_NORM) + _LLAMA_FFN,
               "gelu", True, 2, 4096, 0, 46),
        Family("gemma3", "neox", _LLAMA_ATTN + (ATTN_Q_NORM, ATTN_K_NORM, ATTN_POST_NORM, FFN_POST_NORM) + _LLAMA_FFN,
               "gelu", True, 6, 0, 10000, 62),
    )
}

# ---- metadata keys

KEY_ARCHITECTURE = "general.architecture"
KEY_NAME = "general.name"
KEY_FILE_TYPE = "general.file_type"
KEY_CONTEXT_LENGTH = "{arch}.context_length"
KEY_EMBEDDING_LENGTH = "{arch}.embedding_length"
KEY_FEED_FORWARD_LENGTH = "{arch}.feed_forward_length"
KEY_BLOCK_COUNT = "{arch}.block_count"
KEY_VOCAB_SIZE = "{arch}.vocab_size"
KEY_HEAD_COUNT = "{arch}.attention.head_count"
KEY_HEAD_COUNT_KV = "{arch}.attention.head_count_kv"
KEY_KEY_LENGTH = "{arch}.attention.key_length"
KEY_VALUE_LENGTH = "{arch}.attention.value_length"
KEY_LAYER_NORM_RMS_EPS = "{arch}.attention.layer_norm_rms_epsilon"
KEY_ROPE_DIMENSION_COUNT = "{arch}.rope.dimension_count"
KEY_ROPE_FREQ_BASE = "{arch}.rope.freq_base"
KEY_ROPE_SCALING_TYPE = "{arch}.rope.scaling.type"
KEY_ROPE_SCALING_FACTOR = "{arch}.rope.scaling.factor"
KEY_ROPE_SCALE_LINEAR = "{arch}.rope.scale_linear"  # older files: the linear factor
KEY_ROPE_SCALING_ORIG_CTX_LEN = "{arch}.rope.scaling.original_context_length"
KEY_ROPE_SCALING_ATTN_FACTOR = "{arch}.rope.scaling.attn_factor"  # float32: RoPE's cos/sin scale (phi3 LongRoPE)
KEY_ROPE_FREQ_BASE_SWA = "{arch}.rope.freq_base_swa"  # float32: the RoPE base of sliding-window layers (gemma3)
KEY_ATTENTION_SCALE = "{arch}.attention.scale"  # float32: Q.K's scale (default 1/sqrt(head size))
KEY_SLIDING_WINDOW = "{arch}.attention.sliding_window"  # uint32: a sliding layer's token sees the last n positions
KEY_SLIDING_WINDOW_PATTERN = "{arch}.attention.sliding_window_pattern"  # uint32 n, or bool per layer: which slide
KEY_ATTN_LOGIT_SOFTCAPPING = "{arch}.attn_logit_softcapping"  # float32: attention logits cap * tanh(x / cap)
KEY_FINAL_LOGIT_SOFTCAPPING = "{arch}.final_logit_softcapping"  # float32: the output logits the same
KEY_POOLING_TYPE = "{arch}.pooling_type"  # uint32: the embeddings' pooling, llama.cpp's numbers (specee.h)

# ---- the draft head (EAGLE-1 or EAGLE-3) and the per-layer exit predictors, merged into a model file or alone in a draft
# head file (SpecEE's published GGUF names, so its `eauto` files load too). Not part of TENSOR_NAMES above, which
# mirrors the base-model table.

EAGLE_TOKEN_EMBD = "eagle.token_embd.weight"  # optional: the base model's token_embd is used without it
EAGLE_FC = "eagle.fc.weight"  # EAGLE-1 [n_embd, 2 n_embd]: concat(embedding, feature); EAGLE-3 [n_embd, 3 n_embd]
EAGLE_FC_BIAS = "eagle.fc.bias"  # EAGLE-1 only
EAGLE_ATTN_Q = "eagle.attn_q.weight"  # q and k rows in GGML's RoPE order, as blk.N.attn_q/k (EAGLE-3: 2 n_embd inputs)
EAGLE_ATTN_K = "eagle.attn_k.weight"
EAGLE_ATTN_V = "eagle.attn_v.weight"
EAGLE_ATTN_OUTPUT = "eagle.attn_output.weight"
EAGLE_FFN_NORM = "eagle.ffn_norm.weight"
EAGLE_FFN_GATE = "eagle.ffn_gate.weight"
EAGLE_FFN_UP = "eagle.ffn_up.weight"
EAGLE_FFN_DOWN = "eagle.ffn_down.weight"
EAGLE_OUTPUT = "eagle.output.weight"  # lm_head over a reduced draft vocabulary (specee.eagle.draft_vocab); EAGLE-1: optional
EAGLE_ATTN_NORM = "eagle.attn_norm.weight"  # EAGLE-3: RMSNorm of the token embedding (input_layernorm)
EAGLE_HIDDEN_NORM = "eagle.hidden_norm.weight"  # EAGLE-3: RMSNorm of the fused feature (hidden_norm)
EAGLE_OUTPUT_NORM = "eagle.output_norm.weight"  # EAGLE-3: the head's final norm, before eagle.output

EAGLE_TENSOR_NAMES = (
    EAGLE_TOKEN_EMBD, EAGLE_FC, EAGLE_FC_BIAS, EAGLE_ATTN_Q, EAGLE_ATTN_K, EAGLE_ATTN_V, EAGLE_ATTN_OUTPUT,
    EAGLE_FFN_NORM, EAGLE_FFN_GATE, EAGLE_FFN_UP, EAGLE_FFN_DOWN, EAGLE_OUTPUT,
    EAGLE_ATTN_NORM, EAGLE_HIDDEN_NORM, EAGLE_OUTPUT_NORM,
)
EAGLE3_ONLY = (EAGLE_ATTN_NORM, EAGLE_HIDDEN_NORM, EAGLE_OUTPUT_NORM)
# what each version may leave out
EAGLE_OPTIONAL = (EAGLE_TOKEN_EMBD, EAGLE_OUTPUT) + EAGLE3_ONLY
EAGLE3_OPTIONAL = (EAGLE_TOKEN_EMBD, EAGLE_FC_BIAS)

PRED_UP = "blk.%d.pred.up.weight"  # [512, 3 n_candidates]: features [logits, softmax, softmax - previous]
PRED_UP_BIAS = "blk.%d.pred.up.bias"
PRED_DOWN = "blk.%d.pred.down.weight"  # [1, 512], then sigmoid
PRED_DOWN_BIAS = "blk.%d.pred.down.bias"

PRED_TENSOR_NAMES = (PRED_UP, PRED_UP_BIAS, PRED_DOWN, PRED_DOWN_BIAS)

# ---- SpecEE metadata keys (merged files and draft head files; see docs/gguf.md)

KEY_EAGLE_VERSION = "specee.eagle.version"  # 1: EAGLE-1 head (fc + one decoder layer without input norm); 3: EAGLE-3
KEY_EAGLE_FEED_FORWARD_LENGTH = "specee.eagle.feed_forward_length"
KEY_EAGLE_DRAFT_VOCAB = "specee.eagle.draft_vocab"  # int32 target ids of eagle.output's rows, when present
# float32, optional: the head's held-out acceptance of its first drafted token (teacher-forced top-1 on the target's
# own replies), which `--mode auto` weighs against the measured cost of a verification pass
KEY_EAGLE_ACCEPTANCE = "specee.eagle.acceptance"
# EAGLE-3: int32 [3], the target layers whose outputs (0-based; the output of layer i is the input of layer i + 1)
# are concatenated, low to high, into the head's feature [3 n_embd]
KEY_EAGLE_FEATURE_LAYERS = "specee.eagle.feature_layers"
KEY_EXIT_LAYERS = "specee.exit.layers"  # int32 array: the static set of layers whose predictor is checked
KEY_EXIT_THRESHOLD = "specee.exit.threshold"  # float32: a predictor fires above this (SpecEE: 0.5)
KEY_EXIT_N_CANDIDATES = "specee.exit.n_candidates"  # uint32: EAGLE top-k candidates per token (SpecEE: 4)
# float32, optional: early exit's speedup over plain decoding that select-layers simulated on held-out data (draft
# head included); `--mode auto` does not pick early exit below 1
KEY_EXIT_SPEEDUP = "specee.exit.speedup"

# SpecEE's own merged files: architecture "eauto", the llama keys under "eauto.*"
EAUTO_ARCH = "eauto"
