// specee-draft-head.h: the EAGLE draft head's state: its one-layer KV cache of (feature, token) pairs, the pairs
// not yet in that cache, and the evaluation of pairs. Both decoders (the tree decoder of specee-speculative.cpp and
// the early-exit decoder of specee-early-exit.cpp) draft with one.
//
// A pair at position i is (f_i, t_{i+1}): the target's feature at position i (EAGLE-1: its final-norm output [n_embd];
// EAGLE-3: the outputs of the head's three feature layers [3 n_embd]) and the next token. Pairs are committed with
// the target's real features once their tokens are emitted; tree nodes are drafted with the head's own output
// feature [n_embd] in place of f (EAGLE-3: its pre-norm output, which skips fc), in cells dropped after the step.
#pragma once

#include "specee-kv-cache.h"

#include <cstdint>
#include <vector>

struct specee_context;
struct specee_model;

struct specee_draft_head {
    specee_context *     ctx   = nullptr;
    const specee_model * model = nullptr;
    int32_t              n_embd = 0, n_vocab = 0, n_dvocab = 0; // n_dvocab: rows of the head's lm_head
    int32_t              n_feat = 0; // width of a committed pair's feature: n_embd, or 3 n_embd (EAGLE-3)

    specee_kv_cache      kv;       // the head's one-layer cache
    std::vector<uint8_t> kv_tree;  // [kv.size] cell holds a node of the current tree (dropped after the step)
    std::vector<int32_t> pair_tok; // token t_{i+1} of the pair at each position i formed so far (committed or pending)

    // pairs (feature, token) whose K/V are not cached yet, at positions pend_pos
    std::vector<int32_t> pend_tok, pend_pos;
    std::vector<float>   pend_feat; // [n][n_feat]

    // results of the last evaluation
    std::vector<float> out;    // output features [n][n_embd]
    std::vector<float> logits; // logits of the output rows [n_out][n_dvocab]
};

// a head over the context's model (which must have one); extra_cells: tree nodes in flight beyond n_ctx
void specee_draft_head_init(specee_draft_head & h, specee_context & ctx, uint32_t extra_cells);
// queue the pair (the target's feature [n_feat], token) at position pos
void specee_draft_add_pair(specee_draft_head & h, const float * feat, int32_t token, int32_t pos);
// commit the pending pairs to the cache; afterwards h.out / h.logits row 0 hold the last pair's output (none pending:
// both empty)
void specee_draft_commit(specee_draft_head & h);
// forget the pairs at positions >= p (the sequence changed there)
void specee_draft_truncate(specee_draft_head & h, int32_t p);
// the positions 0.. whose pairs agree with `tokens` (pair i holds tokens[i + 1])
int32_t specee_draft_matching_prefix(const specee_draft_head & h, const int32_t * tokens, int32_t n);
// Evaluates pairs. anc != NULL: the pairs are tree nodes (features: the head's own outputs [n][n_embd]), which see the
// committed cells, their ancestors' cells (anc[i]) and themselves; otherwise they are committed and causal (features:
// the target's [n][n_feat]). Output rows `rows` get logits; every pair's output
// feature lands in h.out. seen_upto (tree nodes only; NULL: their own positions): node i sees the committed cells at
// positions <= seen_upto[i] only, as if the cache ended there. Returns the cells used.
std::vector<int32_t> specee_draft_eval(specee_draft_head & h, const std::vector<int32_t> & tokens, const float * feats,
                                       const std::vector<int32_t> & pos, const std::vector<std::vector<int32_t>> * anc,
                                       const std::vector<int32_t> & rows,
                                       const std::vector<int32_t> * seen_upto = nullptr);
// free the current tree's cells
void specee_draft_drop_tree(specee_draft_head & h);
// the target token of a row of the head's lm_head
int32_t specee_draft_target_id(const specee_draft_head & h, int32_t row);
