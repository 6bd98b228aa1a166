// specee-speculative.h: the EAGLE tree decoder (lossless speculative decoding) over a draft head
#pragma once

#include "specee-draft-head.h"
#include "specee-step.h"
#include "specee-tree-choices.h"
#include "specee.h"

#include <cstdint>
#include <random>
#include <utility>
#include <vector>


using sparse_dist = std::vector<std::pair<int32_t, float>>; // (target token, p > 0)

// a drafted node; node 0 of a step is the root (the last emitted token)
struct draft_node {
    int32_t              token  = -1;
    int32_t              parent = -1;
    int32_t              depth  = 0;
    int32_t              shape  = 0;    // static tree: the node of tree_shape it drafts
    float                score  = 0.0f; // cumulative log-probability of the path under the draft (ranking)
    int32_t              dcell  = -1;   // draft KV cell, once expanded (the root's is committed)
    int32_t              row    = -1;   // row in the verification batch, -1 when not verified
    std::vector<int32_t> children;      // in the order they were drawn
    std::vector<float>   h;             // the head's output feature for this node (expanded nodes)
    sparse_dist          q;             // the distribution its children were drawn from (sampling)
    std::vector<int32_t> cand;          // tree exit: the head's top n_cand tokens here (target ids; every verified
                                        // node, its leaves expanded for them)
    bool                 point = false; // drafted by a drafter without a distribution (n-gram lookup, grafted into a
                                        // head's tree: specee-hybrid.cpp): a point mass, its parent's q does not apply
    bool                 refused = false; // the grammar refuses its token (or an ancestor's): dropped before the pass,
                                          // never verified (specee_tree_filter)
};

struct specee_tree_decoder {
    specee_draft_head *     head    = nullptr;
    bool                    dynamic = true; // EAGLE-2 (else EAGLE-1's static shape)
    specee_eagle_params     params{};
    tree_shape              shape;          // static tree
    int32_t                 max_nodes  = 0; // draft tokens per step at most
    int32_t                 max_expand = 0; // tree nodes whose K/V the head caches at once, at most
    std::vector<draft_node> nodes;          // the current step's tree
    size_t                  n_replayed = 0; // steps taken with params.replay
    int32_t                 n_cand     = 0; // tree exit: candidates kept per expanded node (0: none kept)
    // benchmarks (draft.synth_rates): the drafted child at depth d accepted with probability synth[d] (conditional on
    // the depths before) whatever the target says, never an end-of-generation token; empty: off
    std::vector<double>     synth;
    std::mt19937            synth_rng;
};

// The batch of a verification pass: root + the drafted nodes (rows 1.. in `nodes` order), each row attending to
// itself and its ancestors, every row with logits
struct specee_tree_batch {
    std::vector<int32_t> tok, pos;
    std::vector<uint8_t> mask;
    std::vector<int8_t>  outputs;
    specee_batch         view() const;
};

// where a walk reads the target's logits of a verified node [n_vocab]
using specee_node_logits = const float * (*) (void * user, int32_t node);

// checks the parameters; the head's cache must hold max_expand cells beyond n_ctx (specee_tree_extra_cells)
void    specee_tree_init(specee_tree_decoder & dec, bool dynamic, const specee_eagle_params & params);
// The parts of a draft-and-verify step after step.root (the last emitted token, not in the cache yet, at
// step.root_pos), for the drafters' step (specee-drafter.h: the head is one drafter) and the tree-exit decoder
// (specee-tree-exit.cpp);
// none of them moves step.root / root_pos or adds to step.stats:
// the tree of this step after step.root in dec.nodes (root first, its pending pairs committed); the nodes to verify
// get rows 1.. in breadth-first order, at most `budget` of them; returns them in row order
std::vector<int32_t> specee_tree_draft(specee_tree_decoder & dec, specee_step step, int32_t budget);
specee_tree_batch    specee_tree_verify_batch(const specee_tree_decoder & dec, int32_t root, int32_t root_pos,
                                              const std::vector<int32_t> & nodes);
// Drafts filtered by the sampler's grammar before the pass (none: nodes as they are): a node whose token the grammar
// refuses after its path, and its subtree, gets no row (refused; the walk treats it as a draft the target rejected,
// which it would be: its probability under the masked target is 0) and the rows left are renumbered 1.. in the same
// order. Returns the nodes kept, in row order; adds the refused nodes that had rows to stats.n_grammar_dropped.
std::vector<int32_t> specee_tree_filter(specee_tree_decoder & dec, specee_step step, const std::vector<int32_t> & nodes);
// One pass of the target over step.root + the drafted nodes the grammar allows (specee_tree_filter, then
// specee_tree_verify_batch), with the grammar's mask for the root's row computed meanwhile; returns the pass's rows
int32_t              specee_tree_verify(specee_tree_decoder & dec, specee_step step, const std::vector<int32_t> & nodes);
// the same pass without the filter, over nodes already filtered
int32_t specee_tree_pass(const specee_tree_decoder & dec, specee_step step, const std::vector<int32_t> & nodes);
// dec.nodes <- root and a chain of the given tokens after it (rows 1..n in order: jump-forward's forced tokens);
// returns the chain's nodes
std::vector<int32_t> specee_tree_chain(specee_tree_decoder & dec, int32_t root, const std::vector<int32_t> & tokens);
// Walks the verified tree from the root (the acceptance rule of the mode: greedy, sampled or replayed), reading each
// node's logits through logits_of(user, node); fills the emitted tokens and the accepted nodes whose tokens stay in
// the cache (the nodes the emitted tokens but the last were drawn at); returns the drafted tokens accepted
int32_t specee_tree_walk(specee_tree_decoder & dec, specee_step step, int32_t n_max, specee_node_logits logits_of,
                         void * user, std::vector<int32_t> & emitted, std::vector<int32_t> & path);
// a full verification pass's logits for specee_tree_walk: every row's, in row order (the context's logits)
struct specee_tree_pass_rows {
    const specee_tree_decoder * dec;
    const float *               logits;
    int32_t                     n_vocab;
};
const float * specee_tree_pass_logits(void * user, int32_t node); // user: a specee_tree_pass_rows
// The caches after a walk: the target's keeps root + path in position order in the tree's first cells (the rejected
// cells dropped); the head's drops the tree's cells and takes the emitted tokens' pairs, each with the feature of the
// row its token was drawn at: feats [emitted][n_feat], or nullptr: the pass's (specee_context_feature), at positions
// step.root_pos.. (root_pos not advanced yet). The tree's n rows are the pass's rows row0.. (a block of a shared pass;
// 0: the pass is the tree's).
void specee_tree_keep(specee_tree_decoder & dec, specee_step step, int32_t n, const std::vector<int32_t> & emitted,
                      const std::vector<int32_t> & path, const float * feats, int32_t row0 = 0);
// the verified child of node `parent` holding `token`, or -1
int32_t specee_tree_verified_child(const specee_tree_decoder & dec, int32_t parent, int32_t token);
