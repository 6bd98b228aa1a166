// specee-arch.h: GGUF key and tensor names, and the model families (general.architecture) as rows of one table
// (all mirrored in python/specee/constants.py)
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
    SPECEE_TENSOR_ATTN_OUTPUT,
    SPECEE_TENSOR_FFN_NORM,
    SPECEE_TENSOR_FFN_GATE,
    SPECEE_TENSOR_FFN_UP,
    SPECEE_TENSOR_FFN_DOWN,
    SPECEE_TENSOR_ATTN_Q_BIAS,  // qwen2
    SPECEE_TENSOR_ATTN_K_BIAS,
    SPECEE_TENSOR_ATTN_V_BIAS,
    SPECEE_TENSOR_ATTN_Q_NORM,  // qwen3: per-head RMS norms of Q and K, before RoPE
    SPECEE_TENSOR_ATTN_K_NORM,
    SPECEE_TENSOR_ATTN_QKV,     // phi3: Q, K and V rows in one matrix
    SPECEE_TENSOR_ROPE_FACTORS_LONG,  // phi3 LongRoPE: frequency factors past the original context, and within it
    SPECEE_TENSOR_ROPE_FACTORS_SHORT,
    SPECEE_TENSOR_ATTN_POST_NORM, // gemma2/3: RMS norms of the attention's and the FFN's outputs, before the residual
    SPECEE_TENSOR_FFN_POST_NORM,
    SPECEE_TENSOR_CLS,          // a reranker's classifier head (llama.cpp's names), read by rank pooling
    SPECEE_TENSOR_CLS_BIAS,
    SPECEE_TENSOR_CLS_OUT,
    SPECEE_TENSOR_CLS_OUT_BIAS,
    // the EAGLE draft head of a merged file (SpecEE's names; the last three: EAGLE-3 only), in
    // python/specee/constants.py's order
    SPECEE_TENSOR_EAGLE_TOKEN_EMBD,
    SPECEE_TENSOR_EAGLE_FC,
    SPECEE_TENSOR_EAGLE_FC_BIAS,
    SPECEE_TENSOR_EAGLE_ATTN_Q,
    SPECEE_TENSOR_EAGLE_ATTN_K,
    SPECEE_TENSOR_EAGLE_ATTN_V,
    SPECEE_TENSOR_EAGLE_ATTN_OUTPUT,
    SPECEE_TENSOR_EAGLE_FFN_NORM,
    SPECEE_TENSOR_EAGLE_FFN_GATE,
    SPECEE_TENSOR_EAGLE_FFN_UP,
    SPECEE_TENSOR_EAGLE_FFN_DOWN,
    SPECEE_TENSOR_EAGLE_OUTPUT,
    SPECEE_TENSOR_EAGLE_ATTN_NORM,
    SPECEE_TENSOR_EAGLE_HIDDEN_NORM,
    SPECEE_TENSOR_EAGLE_OUTPUT_NORM,
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

// ---- model families

// A family is a row: its general.architecture name (also its key prefix, "qwen2.block_count"), its RoPE type, its
// FFN's activation, whether its token embeddings are scaled, its sliding-window layers, and the tensors each of its
// layers has, all required. What a family's layers have, the plain layer loop applies (specee-graph.cpp): biases
// after the Q/K/V projections, Q/K norms before RoPE, a fused QKV matrix split into views, norms of the attention's
// and the FFN's outputs; a family without ffn_gate has ffn_up [n_embd, 2 n_ff] holding the gate rows first, then the
// up rows.
static constexpr int SPECEE_MAX_LAYER_TENSORS = 16;

enum specee_ffn_act {
    SPECEE_FFN_SILU, // SwiGLU: silu(gate) * up
    SPECEE_FFN_GELU, // GeGLU: gelu_tanh(gate) * up (gemma)
};

struct specee_arch_family {
    const char *   name;
    int            rope_type;  // GGML_ROPE_TYPE_NORMAL (0, llama: the converter permutes Q/K rows) or NEOX (2)
    specee_ffn_act ffn_act;
    bool           embd_scale; // token embeddings times sqrt(n_embd) (gemma)
    // Sliding-window attention as llama.cpp runs the family: 0, none (the file's window, if any, is ignored, as
    // upstream ignores Mistral's and Phi-3's); n, layer il slides unless il % n == n - 1, when the file does not give
    // {arch}.attention.sliding_window_pattern
    uint32_t       swa_pattern;
    uint32_t       swa_default; // the window when the file has no {arch}.attention.sliding_window (0: no sliding)
    // the RoPE base of sliding layers when the file has no {arch}.rope.freq_base_swa, and then unscaled (gemma3's
    // local base); 0: the global layers' base and scale
    float          swa_rope_base;
    // the layer count of the model whose queries llama.cpp scales by 1/sqrt(n_embd / n_head) instead of
    // 1/sqrt(head size) (Gemma's 27B: query_pre_attn_scalar), when the file has no {arch}.attention.scale; 0: none
    uint32_t       n_layer_embd_query_scale;
    // the vocabulary's special tokens, but for <s>, <unk> and <|endoftext|>, take the whitespace after them in the
    // text (Phi-3's chat markers: rstrip in its tokenizer, which llama.cpp applies to files named Phi-3)
    bool           special_rstrip;
    specee_tensor  layer_tensors[SPECEE_MAX_LAYER_TENSORS]; // ends at SPECEE_TENSOR_COUNT
};

// the family named `arch`, nullptr when this runtime has none of that name
const specee_arch_family * specee_arch_family_find(const std::string & arch);
// whether family f's layers have tensor t
bool specee_arch_family_has(const specee_arch_family & f, specee_tensor t);
// the names of the families, comma separated ("llama, qwen2, ..."), for messages
std::string specee_arch_family_names();

// The GGUF keys, by the names python/specee/constants.py gives them (KEY_<NAME>; tests/test_constants.py keeps
// the two equal): "{arch}.xxx" is written "%s.xxx" here.
#define SPECEE_KEYS(X)                                                               \
    X(ARCHITECTURE, "general.architecture")                                         \
    X(NAME, "general.name")                                                         \
    X(FILE_TYPE, "general.file_type")                                               \
    X(CONTEXT_LENGTH, "%s.context_length")                                          \
    X(EMBEDDING_LENGTH, "%s.embedding_length")                                      \
    X(FEED_FORWARD_LENGTH, "%s.feed_forward_length")                                \
    X(BLOCK_COUNT, "%s.block_count")                                                \
    X(VOCAB_SIZE, "%s.vocab_size")                                                  \
    X(HEAD_COUNT, "%s.attention.head_count")                                        \
    X(HEAD_COUNT_KV, "%s.attention.head_count_kv")                                  \
    X(KEY_LENGTH, "%s.attention.key_length")                                        \
    X(VALUE_LENGTH, "%s.attention.value_length")                                    \
    X(LAYER_NORM_RMS_EPS, "%s.attention.layer_norm_rms_epsilon")                    \
    X(ROPE_DIMENSION_COUNT, "%s.rope.dimension_count")                              \
    X(ROPE_FREQ_BASE, "%s.rope.freq_base")                                          \
    X(ROPE_SCALING_TYPE, "%s.rope.scaling.type")                                    \
    X(ROPE_SCALING_FACTOR, "%s.rope.scaling.factor")                                \
    X(ROPE_SCALE_LINEAR, "%s.rope.scale_linear")                                    \
    X(ROPE_SCALING_ORIG_CTX_LEN, "%s.rope.scaling.original_context_length")         \
    X(ROPE_SCALING_ATTN_FACTOR, "%s.rope.scaling.attn_factor")                      \
    X(ROPE_FREQ_BASE_SWA, "%s.rope.freq_base_swa")                                  \
    X(ATTENTION_SCALE, "%s.attention.scale")                                        \
    X(SLIDING_WINDOW, "%s.attention.sliding_window")                                \
    X(SLIDING_WINDOW_PATTERN, "%s.attention.sliding_window_pattern")                \
    X(ATTN_LOGIT_SOFTCAPPING, "%s.attn_logit_softcapping")                          \
    X(FINAL_LOGIT_SOFTCAPPING, "%s.final_logit_softcapping")                        \
    X(POOLING_TYPE, "%s.pooling_type")                                              \
    X(EAGLE_VERSION, "specee.eagle.version")                                        \
    X(EAGLE_FEED_FORWARD_LENGTH, "specee.eagle.feed_forward_length")                \
    X(EAGLE_DRAFT_VOCAB, "specee.eagle.draft_vocab")                                \
    X(EAGLE_ACCEPTANCE, "specee.eagle.acceptance")                                  \
    X(EAGLE_FEATURE_LAYERS, "specee.eagle.feature_layers")                          \
    X(EXIT_LAYERS, "specee.exit.layers")                                            \
    X(EXIT_THRESHOLD, "specee.exit.threshold")                                      \
    X(EXIT_N_CANDIDATES, "specee.exit.n_candidates")                                \
    X(EXIT_SPEEDUP, "specee.exit.speedup")

#define SPECEE_KEY_DEFINE(name, value) static constexpr const char * SPECEE_KEY_##name = value;
SPECEE_KEYS(SPECEE_KEY_DEFINE)
#undef SPECEE_KEY_DEFINE
