// specee-context-params.h: a context's parameters before anything is allocated (specee-context-params.cpp): their
// resolution, the memory check, and which backend holds a layer
#pragma once

#include "specee.h"

#include "ggml-backend.h"
#include "ggml.h"

#include <cstdint>
#include <vector>

struct specee_model;

// the backend index (of n_backends, the CPU's last) that holds layer il's weights; n_layer: the output's
int32_t specee_backend_of_layer(const specee_model & model, int32_t n_backends, int32_t il);

// the parameters with their defaults filled in (0: the default) and the thread counts capped; throws on a bad one
specee_context_params specee_context_params_resolve(const specee_model & model, specee_context_params params);
// Refuses, before anything is allocated, a context whose KV cache (n_ctx cells, V of type_v) and compute buffers
// (n_batch tokens) do not fit in the memory available where they go (the host's for the CPU's layers, a device's free
// memory for its layers): the model's, the context's backends (the CPU's last)
void specee_context_check_memory(const specee_model & model, const std::vector<ggml_backend_t> & backends,
                                 ggml_backend_t backend_cpu, uint32_t n_ctx, uint32_t n_batch, ggml_type type_v);
