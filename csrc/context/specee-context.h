// specee-context.h: a context's internals for the runtime's other files: the backends and their scheduler, the
// KV cache, the one graph runner every graph goes through, and batch evaluation by layer ranges (specee-context.cpp);
// its parameters' resolution and memory check: specee-context-params.h; what a pass costs: specee-pass-cost.h
#pragma once

#include "specee-context-params.h"
#include "specee-graph.h"
#include "specee-kv-cache.h"
#include "specee-ngram-cache.h"
#include "specee.h"

#include "ggml-backend.h"
#include "ggml.h"

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

struct specee_model;

struct specee_context {
    specee_model *        model = nullptr;
    specee_context_params cparams{};
    specee_kv_cache       kv;
    std::recursive_mutex  mutex; // every C API call on the context (and its generators) holds it

    // ---- backends: the model's devices in order, then the CPU; one scheduler over them
    std::vector<ggml_backend_t> backends;
    ggml_backend_t              backend_cpu      = nullptr;
    ggml_threadpool_t           threadpool       = nullptr;
    ggml_threadpool_t           threadpool_batch = nullptr;
    ggml_backend_sched_t        sched            = nullptr;

    // ---- the graph runner: graph and tensor metadata live in `graph_meta`; worst-case graphs are reserved
    std::vector<uint8_t> graph_meta;
    int32_t              graph_size = 0;
    ggml_context *       graph_ctx  = nullptr; // the graph being built (freed by the next specee_graph_begin)
    // the last layers graph, computed again as it is while nothing else was built and its shape is the same (ggml's
    // RPC backend then recomputes it from its own copy instead of receiving it again)
    std::vector<int32_t> reuse_key;
    ggml_cgraph *        reuse_gf = nullptr;
    specee_graph_io      reuse_io;

    // ---- the hidden state between layer ranges: one [n_embd, n_batch] F32 tensor per backend, so a range that
    // continues on the same device reads it in place (it crosses devices only where the layers do)
    std::vector<ggml_tensor *>         state;  // [backends.size()]
    ggml_context *                     state_ctx = nullptr;
    std::vector<ggml_backend_buffer_t> state_bufs;

    // ---- named intermediates read by the scheduler's eval callback
    std::vector<std::string>                       capture_names;
    std::map<std::string, std::vector<float>>      captured;
    std::map<std::string, std::pair<int64_t, int64_t>> captured_shape; // (ne0, rows)

    // ---- the last batch
    int32_t              n_tokens   = 0;
    int32_t              layer_done = 0; // layers [0, layer_done) evaluated for it
    std::vector<int32_t> tokens, pos, cells;
    std::vector<int32_t> seqs; // [n_tokens] each token's sequence, or empty: every token of kv.seq_cur
    std::vector<uint8_t> tree_mask; // [n_tokens * n_tokens] or empty: causal
    std::vector<int32_t> out_ids;

    // ---- results of the last batch (hidden is read from `state` on demand)
    std::vector<float>              hidden;        // [n_tokens * n_embd] after layer_done - 1, when read
    bool                            hidden_read = false;
    std::vector<std::vector<float>> hidden_layers; // [n_layer][n_tokens * n_embd] when kept
    std::vector<float>              norm;          // [n_tokens * n_embd]
    std::vector<float>              features;      // EAGLE-3: [n_tokens * 3 n_embd] its feature layers' outputs
    std::vector<float>              logits;        // [n_outputs * n_vocab]
    int32_t                         n_outputs = 0;

    // ---- what a pass costs here (specee_context_pass_cost): pass_ms[n] the fastest pass of n tokens, 0: not timed;
    // pass_given[n] a cost given for n tokens (specee_context_set_pass_cost), 0: none; a given cost wins and is kept
    std::vector<double> pass_ms;
    std::vector<double> pass_given;
    // ---- earlier requests' tokens for n-gram lookup (cparams.ngram_cache of them; specee-ngram-cache.h)
    specee_ngram_cache ngram_cache;
    // ---- the draft model's context (its model: model->draft), the same size, each sequence on the same id there
    std::unique_ptr<specee_context> draft;
    // ---- the active LoRA adapters (specee-lora.h; the draft model's context has none)
    specee_lora_set lora;

    ~specee_context();
};

// ---- the graph runner ----------------------------------------------------------------------------------

// a fresh no_alloc ggml context over the runner's metadata memory, for building one graph
ggml_context * specee_graph_begin(specee_context & ctx);
// allocate the graph's tensors in the scheduler's (reserved) compute buffers; throws on failure
void           specee_graph_alloc(specee_context & ctx, ggml_cgraph * gf, const char * what);
// compute it with the threads for a batch of n_tokens; throws on failure
void           specee_graph_compute(specee_context & ctx, ggml_cgraph * gf, int32_t n_tokens);
// grow the scheduler's buffers to fit a worst-case graph (done once per graph shape class)
void           specee_graph_reserve(specee_context & ctx, ggml_cgraph * gf, const char * what);

// ---- evaluation (internals of specee_eval / specee_eval_layers: throw instead of returning -1) ---------------

void specee_eval_layers_impl(specee_context & ctx, const specee_batch * batch, int32_t l0, int32_t l1, uint32_t flags);
void specee_eval_impl(specee_context & ctx, const specee_batch * batch);
// Tokens already in cells (K/V valid in layers [0, l0)) continued through layers [l0, l1) from the hidden states
// hidden [n * n_embd] (after layer l0 - 1) with tree_mask (NULL: causal): a new batch, every row with logits at the
// last layer; how checked exits run an exited token's skipped layers with a later token's pass
void specee_eval_resume_impl(specee_context & ctx, const std::vector<int32_t> & cells, const float * hidden, int32_t l0,
                             int32_t l1, uint32_t flags, const uint8_t * tree_mask);
// the hidden state after the last evaluated layer of the last batch [n_tokens * n_embd]
const std::vector<float> & specee_context_hidden(specee_context & ctx);
// The draft head's feature of row i of the last batch (the target's, for a committed pair): EAGLE-1 the final-norm
// output [n_embd], EAGLE-3 the outputs of its feature layers [3 n_embd]
const float * specee_context_feature(const specee_context & ctx, int32_t i);
// the backend index (into ctx.backends) that holds layer il's weights; n_layer: the output's
inline int32_t specee_context_backend_of_layer(const specee_context & ctx, int32_t il) {
    return specee_backend_of_layer(*ctx.model, (int32_t) ctx.backends.size(), il);
}
