// specee-arch.h: GGUF key and tensor names of the llama architecture (mirrored in python/specee/constants.py)
#pragma once

#include <string>

enum specee_tensor {
    SPECEE_TENSOR_TOKEN_EMBD,
    SPECEE_TENSOR_OUTPUT_NORM,
    SPECEE_TENSOR_OUTPUT,
    SPECEE_TENSOR_ROPE_FREQS,
    SPECEE_TENSOR_ATTN_NORM,
    SPECEE_TENSOR_ATTN_Q,
    SPECEE_TENSOR_ATTN_K,
    SPECEE_TENSOR_ATTN_V,
    SPECEE_TENSOR_ATTN_OUT,
    SPECEE_TENSOR_FFN_NORM,
    SPECEE_TENSOR_FFN_GATE,
    SPECEE_TENSOR_FFN_UP,
    SPECEE_TENSOR_FFN_DOWN,
    // the EAGLE-1 draft head of a merged file (SpecEE's names), in python/specee/constants.py's order
    SPECEE_TENSOR_EAGLE_TOKEN_EMBD,
    SPECEE_TENSOR_EAGLE_FC,
    SPECEE_TENSOR_EAGLE_FC_BIAS,
    SPECEE_TENSOR_EAGLE_ATTN_Q,
    SPECEE_TENSOR_EAGLE_ATTN_K,
    SPECEE_TENSOR_EAGLE_ATTN_V,
    SPECEE_TENSOR_EAGLE_ATTN_OUT,
    SPECEE_TENSOR_EAGLE_FFN_NORM,
    SPECEE_TENSOR_EAGLE_FFN_GATE,
    SPECEE_TENSOR_EAGLE_FFN_UP,
    SPECEE_TENSOR_EAGLE_FFN_DOWN,
    SPECEE_TENSOR_EAGLE_OUTPUT,
    // SpecEE's per-layer exit predictors, in python/specee/constants.py's order
    SPECEE_TENSOR_PRED_UP,
    SPECEE_TENSOR_PRED_UP_BIAS,
    SPECEE_TENSOR_PRED_DOWN,
    SPECEE_TENSOR_PRED_DOWN_BIAS,
    SPECEE_TENSOR_COUNT,
};

#define SPECEE_TENSOR_EAGLE_FIRST SPECEE_TENSOR_EAGLE_TOKEN_EMBD
#define SPECEE_TENSOR_PRED_FIRST  SPECEE_TENSOR_PRED_UP

// format string of a tensor's name ("blk.%d.attn_q.weight")
const char * specee_tensor_format(specee_tensor t);
// the name itself, for layer il where the format has one
std::string specee_tensor_name(specee_tensor t, int il = -1);

// keys: "{arch}.xxx" is written as "%s.xxx"
#define SPECEE_KEY_ARCHITECTURE      "general.architecture"
#define SPECEE_KEY_NAME              "general.name"
#define SPECEE_KEY_FILE_TYPE         "general.file_type"
#define SPECEE_KEY_CONTEXT_LENGTH    "%s.context_length"
#define SPECEE_KEY_EMBEDDING_LENGTH  "%s.embedding_length"
#define SPECEE_KEY_BLOCK_COUNT       "%s.block_count"
#define SPECEE_KEY_FEED_FORWARD      "%s.feed_forward_length"
#define SPECEE_KEY_HEAD_COUNT        "%s.attention.head_count"
#define SPECEE_KEY_HEAD_COUNT_KV     "%s.attention.head_count_kv"
#define SPECEE_KEY_KEY_LENGTH        "%s.attention.key_length"
#define SPECEE_KEY_VALUE_LENGTH      "%s.attention.value_length"
#define SPECEE_KEY_RMS_EPS           "%s.attention.layer_norm_rms_epsilon"
#define SPECEE_KEY_ROPE_DIM          "%s.rope.dimension_count"
#define SPECEE_KEY_ROPE_FREQ_BASE    "%s.rope.freq_base"
#define SPECEE_KEY_ROPE_SCALE_TYPE   "%s.rope.scaling.type"
#define SPECEE_KEY_ROPE_SCALE_FACTOR "%s.rope.scaling.factor"
#define SPECEE_KEY_ROPE_SCALE_LINEAR "%s.rope.scale_linear"
#define SPECEE_KEY_ROPE_ORIG_CTX     "%s.rope.scaling.original_context_length"
#define SPECEE_KEY_VOCAB_SIZE        "%s.vocab_size"

// SpecEE's keys of a merged file
#define SPECEE_KEY_EAGLE_VERSION      "specee.eagle.version"
#define SPECEE_KEY_EAGLE_FEED_FORWARD "specee.eagle.feed_forward_length"
#define SPECEE_KEY_EAGLE_DRAFT_VOCAB  "specee.eagle.draft_vocab"
#define SPECEE_KEY_EXIT_LAYERS        "specee.exit.layers"
#define SPECEE_KEY_EXIT_THRESHOLD     "specee.exit.threshold"
#define SPECEE_KEY_EXIT_N_CANDIDATES  "specee.exit.n_candidates"
