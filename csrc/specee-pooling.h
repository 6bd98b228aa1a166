// specee-pooling.h: the public C API of the pooling table (beside specee.h; specee-pooling.cpp implements it). How a
// text's final-norm rows become its embedding or reranking score is a pooling, one row of one table that every
// frontend reads (Model.embed, specee-server's --pooling and /rerank); specee_embed (specee-embed.h) and
// specee_slots_embed (specee-slot-cache.h) pool as it says.
#pragma once

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct specee_model   specee_model;

// The poolings, numbered as llama.cpp numbers them (the GGUF key {arch}.pooling_type holds this number)
enum specee_pooling {
    SPECEE_POOLING_MODEL = -1, // the model's own: its file's {arch}.pooling_type, else mean
    SPECEE_POOLING_NONE  = 0,  // every token's final-norm row: [n_tokens][n_embd] per text
    SPECEE_POOLING_MEAN  = 1,  // the rows' mean: [n_embd]
    SPECEE_POOLING_CLS   = 2,  // the first token's row: [n_embd]
    SPECEE_POOLING_LAST  = 3,  // the last token's row: [n_embd]
    SPECEE_POOLING_RANK  = 4,  // relevance scores: the last token's row through the file's classifier head (cls:
                               // tanh(W h + b), then cls.output: [labels]; Qwen3: a softmax over them), else that
                               // row's first element [1]
};

struct specee_pooling_info {
    const char * name;       // "mean": Model.embed(pooling=...), specee-server's --pooling
    const char * help;       // one line: what a text gives
    bool         normalized; // what it gives is scaled to unit length when normalizing is asked for (none and rank:
                             // never, as llama.cpp)
};

// pooling p's row (p >= 0), NULL past the end
const struct specee_pooling_info * specee_pooling_row(int32_t pooling);
// the pooling of a name, -1 when unknown
int32_t specee_pooling_by_name(const char * name);
// the model's own pooling: its file's {arch}.pooling_type, else SPECEE_POOLING_MEAN
int32_t specee_model_pooling(const specee_model * model);
// the floats one text of n_tokens tokens gives with a pooling (SPECEE_POOLING_MODEL: the model's); -1 when unknown
int32_t specee_pooling_n_out(const specee_model * model, int32_t pooling, int32_t n_tokens);

#ifdef __cplusplus
}
#endif
