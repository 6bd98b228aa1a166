// specee-speculative.h: the EAGLE decoder's state, for the runtime's other files (SpecEE early exit in
// specee-early-exit.cpp drives the same draft head and KV bookkeeping one token at a time)
#pragma once

#include "specee-kv-cache.h"
#include "specee.h"

#include <cstdint>
#include <utility>
#include <vector>

struct specee_context;
struct specee_model;

// a static tree: each node's parent (the root's: -1) and number of children
struct tree_shape {
    std::vector<int32_t> parent;     // -1 for the root
    std::vector<int32_t> n_children; // children ranks 0 .. n_children - 1
};

using sparse_dist = std::vector<std::pair<int32_t, float>>; // (target token, p > 0)

// a drafted node; node 0 of a step is the root (the last emitted token)
struct draft_node {
    int32_t     token  = -1;
    int32_t     parent = -1;
    int32_t     depth  = 0;
    int32_t     shape  = 0;    // static tree: the node of tree_shape it drafts
    float       score  = 0.0f; // cumulative log-probability of the path under the draft (ranking)
    int32_t     dcell  = -1;   // draft KV cell, once expanded (the root's is committed)
    int32_t     row    = -1;   // row in the verification batch, -1 when not verified
    std::vector<int32_t> children; // in the order they were drawn
    std::vector<float>   h;        // the head's output feature for this node (expanded nodes)
    sparse_dist          q;        // the distribution its children were drawn from (sampling)
};

struct specee_spec {
    specee_context *       ctx   = nullptr;
    const specee_model *   model = nullptr;
    specee_spec_params     params{};
    tree_shape             shape; // static tree
    int32_t                max_nodes = 0; // draft tokens per step at most
    int32_t                n_embd = 0, n_vocab = 0, n_dvocab = 0;

    specee_kv_cache        dkv;      // the head's one-layer cache
    std::vector<uint8_t>   dkv_tree; // [dkv.size] cell holds a node of the current tree (dropped after the step)
    std::vector<uint8_t>   graph_meta;
    int32_t                graph_size = 256;

    // pairs (feature, token) whose draft K/V is not cached yet, at positions pend_pos
    std::vector<int32_t> pend_tok, pend_pos;
    std::vector<float>   pend_feat;
    std::vector<float>   dangling; // feature of the last cached target token whose next token is unknown
    int32_t              root     = -1; // last emitted token (not in the target's cache), -1 before prefill
    int32_t              root_pos = -1; // its position

    // the current step
    std::vector<draft_node> nodes;
    std::vector<float>      d_out;    // head output features of the last draft batch [n][n_embd]
    std::vector<float>      d_logits; // its logits [n_out][n_dvocab]

    specee_spec_stats stats{};

    // SpecEE early exit (specee-early-exit.cpp)
    specee_exit_stats    exit_stats{};
    std::vector<int32_t> recent_exits;    // the last exit layers, newest last (the dynamic schedule)
    std::vector<uint8_t> exit_graph_meta; // the norm + lm_head graph at an exit layer
};

// commits the pending (feature, token) pairs to the head's cache; afterwards d_logits row 0 holds the head's
// logits after the last pair (over its draft vocabulary), d_out its output feature
void specee_draft_commit(specee_spec & sp);
