// specee-arch.cpp: the llama architecture's names: the tensor-name table, the GGUF key table, and the C API that lists
// both (python/specee/constants.py mirrors them; tests/test_constants.py keeps the two equal)
#include "specee-arch.h"

#include "specee.h"

#include <cstdio>

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
