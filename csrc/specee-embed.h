// specee-embed.h: embeddings (specee-embed.cpp): a text's final-norm rows pooled as specee-pooling.h's table says,
// evaluated on a KV sequence of its own that is removed again; the context's specee_embed and the parallel slots'
// specee_slots_embed share it. Its public C API (specee_embed) is declared here, the pooling table's in
// specee-pooling.h.
#pragma once

#include "specee-pooling.h"
#include "specee.h"

#include <cstdint>

struct specee_context;

// the KV cache's sequence an embedding is evaluated on (above the slots' sequences, 1..SPECEE_MAX_SEQ - 2)
#define SPECEE_SEQ_EMBED (SPECEE_MAX_SEQ - 1)

// tokens[0..n) pooled into out [specee_pooling_n_out(model, pooling, n)] (not normalised; SPECEE_POOLING_MODEL: the
// model's pooling): the tokens evaluated alone, on sequence SPECEE_SEQ_EMBED at positions 0..n-1, whose cells are
// removed afterwards (on failure too); the cache's other sequences are untouched. Throws on an empty text, an unknown
// pooling, and where the free cells are too few (context overflow).
void specee_embed_impl(specee_context & ctx, const int32_t * tokens, int32_t n, int32_t pooling, float * out);

extern "C" {
// Embeddings of n_seqs texts' token ids (tokens: the texts one after another, n_tokens[i] ids each) into out: each
// text's specee_pooling_n_out floats, one text after another; a pooled vector is unit length when normalize (the
// pooling's row says which are). Each text is evaluated alone, on a sequence of its own at positions 0.., and its
// cells are removed afterwards: the cache's other sequences stay (sequence 0's cells make room when too few cells
// are free). Returns 0, or -1 with specee_last_error() (an empty text, one longer than the context, a bad token id
// or pooling; "text i: " before the message when n_seqs > 1).
int32_t specee_embed(specee_context * ctx, const int32_t * tokens, const int32_t * n_tokens, int32_t n_seqs,
                     int32_t pooling, bool normalize, float * out);
}
