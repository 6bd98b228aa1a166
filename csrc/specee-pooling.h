// specee-pooling.h: the public C API of embeddings and reranking scores (beside specee.h; specee-embed.cpp and the
// slots' specee_slots_embed implement it). How a text's final-norm rows become its output is a pooling, one row of
// one table that every frontend reads (Model.embed, specee-server's --pooling and /rerank).
#pragma once

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct specee_model   specee_model;
typedef struct specee_context specee_context;
typedef struct specee_slots   specee_slots;

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

// Embeddings of n_seqs texts' token ids (tokens: the texts one after another, n_tokens[i] ids each) into out: each
// text's specee_pooling_n_out floats, one text after another; a pooled vector is unit length when normalize (the
// pooling's row says which are). Each text is evaluated alone, on a sequence of its own at positions 0.., and its
// cells are removed afterwards: the cache's other sequences stay (sequence 0's cells make room when too few cells
// are free). Returns 0, or -1 with specee_last_error() (an empty text, one longer than the context, a bad token id
// or pooling; "text i: " before the message when n_seqs > 1).
int32_t specee_embed(specee_context * ctx, const int32_t * tokens, const int32_t * n_tokens, int32_t n_seqs,
                     int32_t pooling, bool normalize, float * out);
// One text's embedding (not normalised) between the parallel slots' passes, within a slot's share of the context (free
// slots' cached prompts make room); 0, or -1 with specee_last_error()
int32_t specee_slots_embed(specee_slots * slots, const int32_t * tokens, int32_t n_tokens, int32_t pooling,
                           float * out);

#ifdef __cplusplus
}
#endif
