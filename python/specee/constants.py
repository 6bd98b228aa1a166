"""GGUF names the runtime reads: the llama tensor-name table (mirrors csrc/specee-arch, kept equal by
tests/test_constants.py) and the metadata keys ("{arch}" is the architecture name, "llama")."""

ARCH = "llama"

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

TENSOR_NAMES = (
    TOKEN_EMBD, OUTPUT_NORM, OUTPUT, ROPE_FREQS,
    ATTN_NORM, ATTN_Q, ATTN_K, ATTN_V, ATTN_OUTPUT,
    FFN_NORM, FFN_GATE, FFN_UP, FFN_DOWN,
)

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
