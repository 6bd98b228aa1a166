// specee-pooling.cpp: the pooling table (specee.h): each way of pooling a text's final-norm rows into an
// embedding, its name and what it gives for a model; specee-embed.cpp pools as it says.
#include "specee-model.h"
#include "specee.h"

#include <cstring>

// ---- the pooling table (enum specee_pooling's order) ---------------------------------------------------------

static const specee_pooling_info POOLINGS[] = {
    {"none", "every token's final-norm row [n_tokens, n_embd], not normalised", false},
    {"mean", "the mean of the text's final-norm rows [n_embd]", true},
    {"cls", "the first token's final-norm row [n_embd]", true},
    {"last", "the last token's final-norm row [n_embd]", true},
    {"rank", "a relevance score: the last token's final-norm row through the file's classifier head (cls, cls.output: "
             "[labels]), or without one its first element [1], as llama.cpp scores a causal model", false},
};
static constexpr int32_t N_POOLINGS = (int32_t) (sizeof(POOLINGS) / sizeof(POOLINGS[0]));

extern "C" const specee_pooling_info * specee_pooling_row(int32_t pooling) {
    return pooling >= 0 && pooling < N_POOLINGS ? &POOLINGS[pooling] : nullptr;
}

extern "C" int32_t specee_pooling_by_name(const char * name) {
    for (int32_t i = 0; name && i < N_POOLINGS; ++i) {
        if (strcmp(POOLINGS[i].name, name) == 0) {
            return i;
        }
    }
    return -1;
}

extern "C" int32_t specee_model_pooling(const specee_model * model) {
    const int32_t p = model ? model->hparams.pooling_type : -1;
    return p >= 0 && p < N_POOLINGS ? p : SPECEE_POOLING_MEAN;
}

extern "C" int32_t specee_pooling_n_out(const specee_model * model, int32_t pooling, int32_t n_tokens) {
    if (!model) {
        return -1;
    }
    const int32_t n_embd = (int32_t) model->hparams.n_embd;
    switch (pooling == SPECEE_POOLING_MODEL ? specee_model_pooling(model) : pooling) {
        case SPECEE_POOLING_NONE: return n_tokens * n_embd;
        case SPECEE_POOLING_MEAN:
        case SPECEE_POOLING_CLS:
        case SPECEE_POOLING_LAST: return n_embd;
        case SPECEE_POOLING_RANK: return (int32_t) model->hparams.n_cls_out;
        default:                  return -1;
    }
}
