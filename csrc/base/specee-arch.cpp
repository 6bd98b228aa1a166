// specee-arch.cpp: the names the runtime reads: the tensor-name table, the GGUF key table, the model families' table,
// and the C API that lists them (python/specee/constants.py mirrors them; tests/test_constants.py keeps the two equal)
#include "specee-arch.h"

#include "specee.h"

#include "ggml.h"

#include <cstdio>
#include <vector>

static const char * const TENSOR_FORMATS[SPECEE_TENSOR_COUNT] = {
    /* TOKEN_EMBD  */ "token_embd.weight",
    /* OUTPUT_NORM */ "output_norm.weight",
    /* OUTPUT      */ "output.weight",
    /* ROPE_FREQS  */ "rope_freqs.weight",
    /* ATTN_NORM   */ "blk.%d.attn_norm.weight",
    /* ATTN_Q      */ "blk.%d.attn_q.weight",
    /* ATTN_K      */ "blk.%d.attn_k.weight",
    /* ATTN_V      */ "blk.%d.attn_v.weight",
    /* ATTN_OUTPUT */ "blk.%d.attn_output.weight",
    /* FFN_NORM    */ "blk.%d.ffn_norm.weight",
    /* FFN_GATE    */ "blk.%d.ffn_gate.weight",
    /* FFN_UP      */ "blk.%d.ffn_up.weight",
    /* FFN_DOWN    */ "blk.%d.ffn_down.weight",
    /* ATTN_Q_BIAS */ "blk.%d.attn_q.bias",
    /* ATTN_K_BIAS */ "blk.%d.attn_k.bias",
    /* ATTN_V_BIAS */ "blk.%d.attn_v.bias",
    /* ATTN_Q_NORM */ "blk.%d.attn_q_norm.weight",
    /* ATTN_K_NORM */ "blk.%d.attn_k_norm.weight",
    /* ATTN_QKV    */ "blk.%d.attn_qkv.weight",
    /* ROPE_FACTORS_LONG  */ "rope_factors_long.weight",
    /* ROPE_FACTORS_SHORT */ "rope_factors_short.weight",
    /* ATTN_POST_NORM */ "blk.%d.post_attention_norm.weight",
    /* FFN_POST_NORM  */ "blk.%d.post_ffw_norm.weight",
    /* CLS            */ "cls.weight",
    /* CLS_BIAS       */ "cls.bias",
    /* CLS_OUT        */ "cls.output.weight",
    /* CLS_OUT_BIAS   */ "cls.output.bias",
    /* EAGLE_TOKEN_EMBD */ "eagle.token_embd.weight",
    /* EAGLE_FC         */ "eagle.fc.weight",
    /* EAGLE_FC_BIAS    */ "eagle.fc.bias",
    /* EAGLE_ATTN_Q     */ "eagle.attn_q.weight",
    /* EAGLE_ATTN_K     */ "eagle.attn_k.weight",
    /* EAGLE_ATTN_V     */ "eagle.attn_v.weight",
    /* EAGLE_ATTN_OUTPUT */ "eagle.attn_output.weight",
    /* EAGLE_FFN_NORM   */ "eagle.ffn_norm.weight",
    /* EAGLE_FFN_GATE   */ "eagle.ffn_gate.weight",
    /* EAGLE_FFN_UP     */ "eagle.ffn_up.weight",
    /* EAGLE_FFN_DOWN   */ "eagle.ffn_down.weight",
    /* EAGLE_OUTPUT     */ "eagle.output.weight",
    /* EAGLE_ATTN_NORM  */ "eagle.attn_norm.weight",
    /* EAGLE_HIDDEN_NORM */ "eagle.hidden_norm.weight",
    /* EAGLE_OUTPUT_NORM */ "eagle.output_norm.weight",
    /* PRED_UP          */ "blk.%d.pred.up.weight",
    /* PRED_UP_BIAS     */ "blk.%d.pred.up.bias",
    /* PRED_DOWN        */ "blk.%d.pred.down.weight",
    /* PRED_DOWN_BIAS   */ "blk.%d.pred.down.bias",
};

const char * specee_tensor_format(specee_tensor t) {
    return (t >= 0 && t < SPECEE_TENSOR_COUNT) ? TENSOR_FORMATS[t] : nullptr;
}

std::string specee_tensor_name(specee_tensor t, int il) {
    char buf[256];
    snprintf(buf, sizeof(buf), TENSOR_FORMATS[t], il);
    return buf;
}

// ---- model families ------------------------------------------------------------------------------

#define LLAMA_ATTN                                                                                     \
    SPECEE_TENSOR_ATTN_NORM, SPECEE_TENSOR_ATTN_Q, SPECEE_TENSOR_ATTN_K, SPECEE_TENSOR_ATTN_V, SPECEE_TENSOR_ATTN_OUTPUT
#define LLAMA_FFN SPECEE_TENSOR_FFN_NORM, SPECEE_TENSOR_FFN_GATE, SPECEE_TENSOR_FFN_UP, SPECEE_TENSOR_FFN_DOWN

#define GEMMA_POST_NORMS SPECEE_TENSOR_ATTN_POST_NORM, SPECEE_TENSOR_FFN_POST_NORM

static const specee_arch_family FAMILIES[] = {
    // llama (and Mistral, which upstream's converter writes as llama): Q/K rows permuted to GGML's RoPE order
    {"llama", GGML_ROPE_TYPE_NORMAL, SPECEE_FFN_SILU, false, 0, 0, 0.0f, 0, false,
     {LLAMA_ATTN, LLAMA_FFN, SPECEE_TENSOR_COUNT}},
    // Qwen2 / Qwen2.5: biases on the Q, K and V projections
    {"qwen2", GGML_ROPE_TYPE_NEOX, SPECEE_FFN_SILU, false, 0, 0, 0.0f, 0, false,
     {LLAMA_ATTN, SPECEE_TENSOR_ATTN_Q_BIAS, SPECEE_TENSOR_ATTN_K_BIAS, SPECEE_TENSOR_ATTN_V_BIAS, LLAMA_FFN,
      SPECEE_TENSOR_COUNT}},
    // Qwen3: RMS norms of each head's Q and K before RoPE, no biases
    {"qwen3", GGML_ROPE_TYPE_NEOX, SPECEE_FFN_SILU, false, 0, 0, 0.0f, 0, false,
     {LLAMA_ATTN, SPECEE_TENSOR_ATTN_Q_NORM, SPECEE_TENSOR_ATTN_K_NORM, LLAMA_FFN, SPECEE_TENSOR_COUNT}},
    // Phi-3: one QKV matrix, one gate+up matrix; its chat markers take the whitespace after them
    {"phi3", GGML_ROPE_TYPE_NEOX, SPECEE_FFN_SILU, false, 0, 0, 0.0f, 0, true,
     {SPECEE_TENSOR_ATTN_NORM, SPECEE_TENSOR_ATTN_QKV, SPECEE_TENSOR_ATTN_OUTPUT, SPECEE_TENSOR_FFN_NORM,
      SPECEE_TENSOR_FFN_UP, SPECEE_TENSOR_FFN_DOWN, SPECEE_TENSOR_COUNT}},
    // Gemma 2: scaled embeddings, GeGLU, norms after attention and FFN, every other layer a sliding window (4096 by
    // default), soft-capped attention and final logits (keys)
    {"gemma2", GGML_ROPE_TYPE_NEOX, SPECEE_FFN_GELU, true, 2, 4096, 0.0f, 46, false,
     {LLAMA_ATTN, GEMMA_POST_NORMS, LLAMA_FFN, SPECEE_TENSOR_COUNT}},
    // Gemma 3 (text): Gemma 2's layer with Qwen3's Q/K norms, five sliding layers in six (with their own RoPE base,
    // {arch}.rope.freq_base_swa), no attention soft-capping
    {"gemma3", GGML_ROPE_TYPE_NEOX, SPECEE_FFN_GELU, true, 6, 0, 10000.0f, 62, false,
     {LLAMA_ATTN, SPECEE_TENSOR_ATTN_Q_NORM, SPECEE_TENSOR_ATTN_K_NORM, GEMMA_POST_NORMS, LLAMA_FFN,
      SPECEE_TENSOR_COUNT}},
};
static const int N_FAMILIES = (int) (sizeof(FAMILIES) / sizeof(FAMILIES[0]));

const specee_arch_family * specee_arch_family_find(const std::string & arch) {
    for (const specee_arch_family & f : FAMILIES) {
        if (arch == f.name) {
            return &f;
        }
    }
    return nullptr;
}

bool specee_arch_family_has(const specee_arch_family & f, specee_tensor t) {
    for (int i = 0; i < SPECEE_MAX_LAYER_TENSORS && f.layer_tensors[i] != SPECEE_TENSOR_COUNT; ++i) {
        if (f.layer_tensors[i] == t) {
            return true;
        }
    }
    return false;
}

std::string specee_arch_family_names() {
    std::string out;
    for (const specee_arch_family & f : FAMILIES) {
        out += (out.empty() ? "" : ", ") + std::string(f.name);
    }
    return out;
}

// ---- C API ---------------------------------------------------------------------------------------

#define SPECEE_KEY_ENTRY(name, value) "KEY_" #name "=" value,
static const char * const KEY_TABLE[] = {SPECEE_KEYS(SPECEE_KEY_ENTRY)};
#undef SPECEE_KEY_ENTRY

extern "C" const char * specee_arch_key(int32_t i) {
    return (i >= 0 && i < (int32_t) (sizeof(KEY_TABLE) / sizeof(KEY_TABLE[0]))) ? KEY_TABLE[i] : nullptr;
}

extern "C" const char * specee_arch_tensor_name(int32_t i) {
    return (i >= 0 && i < SPECEE_TENSOR_EAGLE_FIRST) ? specee_tensor_format((specee_tensor) i) : nullptr;
}

extern "C" const char * specee_arch_eagle_tensor_name(int32_t i) {
    const int32_t t = SPECEE_TENSOR_EAGLE_FIRST + i;
    return (i >= 0 && t < SPECEE_TENSOR_PRED_FIRST) ? specee_tensor_format((specee_tensor) t) : nullptr;
}

extern "C" const char * specee_arch_pred_tensor_name(int32_t i) {
    const int32_t t = SPECEE_TENSOR_PRED_FIRST + i;
    return (i >= 0 && t < SPECEE_TENSOR_COUNT) ? specee_tensor_format((specee_tensor) t) : nullptr;
}

extern "C" const char * specee_arch_family_row(int32_t i) {
    // "NAME ROPE ACT EMBD_SCALE SWA_PATTERN SWA_DEFAULT SWA_ROPE_BASE N_LAYER_EMBD_QUERY_SCALE SPECIAL_RSTRIP
    // TENSOR,TENSOR,...",
    // built once (a static local's initialisation is thread-safe)
    static const std::vector<std::string> rows = [] {
        std::vector<std::string> out;
        for (const specee_arch_family & f : FAMILIES) {
            std::string row = std::string(f.name) + (f.rope_type == GGML_ROPE_TYPE_NEOX ? " neox " : " normal ") +
                              (f.ffn_act == SPECEE_FFN_GELU ? "gelu " : "silu ") + (f.embd_scale ? "1 " : "0 ") +
                              std::to_string(f.swa_pattern) + " " + std::to_string(f.swa_default) + " " +
                              std::to_string((int64_t) f.swa_rope_base) + " " +
                              std::to_string(f.n_layer_embd_query_scale) + (f.special_rstrip ? " 1 " : " 0 ");
            for (int j = 0; j < SPECEE_MAX_LAYER_TENSORS && f.layer_tensors[j] != SPECEE_TENSOR_COUNT; ++j) {
                row += (j ? "," : "") + std::string(TENSOR_FORMATS[f.layer_tensors[j]]);
            }
            out.push_back(row);
        }
        return out;
    }();
    return (i >= 0 && i < N_FAMILIES) ? rows[i].c_str() : nullptr;
}
