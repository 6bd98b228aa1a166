#include "specee-arch.h"

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
    /* ATTN_OUT    */ "blk.%d.attn_output.weight",
    /* FFN_NORM    */ "blk.%d.ffn_norm.weight",
    /* FFN_GATE    */ "blk.%d.ffn_gate.weight",
    /* FFN_UP      */ "blk.%d.ffn_up.weight",
    /* FFN_DOWN    */ "blk.%d.ffn_down.weight",
};

const char * specee_tensor_format(specee_tensor t) {
    return (t >= 0 && t < SPECEE_TENSOR_COUNT) ? TENSOR_FORMATS[t] : nullptr;
}

std::string specee_tensor_name(specee_tensor t, int il) {
    char buf[256];
    snprintf(buf, sizeof(buf), TENSOR_FORMATS[t], il);
    return buf;
}
