// specee-context.h: a context's internals for the runtime's other files (the draft head's evaluation in
// specee-speculative.cpp runs its graphs on the context's backend, scheduler and threads)
#pragma once

#include "ggml-backend.h"
#include "ggml.h"

#include <cstdint>

struct specee_context;
struct specee_kv_cache;
struct specee_model;

ggml_backend_sched_t       specee_context_sched(specee_context & ctx);
ggml_backend_buffer_type_t specee_context_buft(specee_context & ctx);
int32_t                    specee_context_graph_size(const specee_context & ctx);
// compute a graph allocated with specee_context_sched, with the threads for a batch of n_tokens
void                       specee_context_compute(specee_context & ctx, ggml_cgraph * gf, int32_t n_tokens);
specee_kv_cache &          specee_context_kv(specee_context & ctx);
const specee_model *       specee_context_model(const specee_context & ctx);
