// specee-embed.h: embeddings (specee-embed.cpp): a text's final-norm rows pooled as the pooling table says,
// evaluated on a KV sequence of its own that is removed again; the context's specee_embed and the parallel slots'
// specee_slots_embed share it. Their public C API, and the pooling table's, are in specee.h.
#pragma once

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
