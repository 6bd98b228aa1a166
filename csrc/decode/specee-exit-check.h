// specee-exit-check.h: checked exits: tokens that left a pass early wait, their skipped layers run as extra rows of
// the next passes, and once a pass reaches the last layer their successors are checked against the full model's
// greedy tokens; the first wrong one is taken back (a rollback). Shared by early exit and tree exit.
#pragma once

#include "specee-step.h"
#include "specee.h"

#include <cstdint>
#include <utility>
#include <vector>

struct specee_context;

// a token that exited: its layers past the exit not run yet
struct exit_pending {
    int32_t            cell   = -1; // its KV cell (valid in layers [0, resume))
    int32_t            pos    = -1;
    int32_t            resume = 0;  // the first layer it has not run
    std::vector<float> h;           // [n_embd] its hidden state after layer resume - 1
    std::vector<float> feat;        // the draft head's feature it was paired with (a rollback pairs it again)
    int32_t            next   = -1; // the token emitted after it (an exit layer's argmax), to be checked
    int32_t            layers = 0;  // the layers its own pass ran (exit layer + 1), for the caller's record
};

// The waiting tokens in position order (their resume layers never increase along it: a later token stopped where a
// pass that the earlier ones had joined stopped, or below them), and the sampler's history before the first of them
// was emitted (a check draws as plain decoding would have).
struct specee_exit_chain {
    std::vector<exit_pending> pending;
    std::vector<int32_t>      history;
};

// One pass of a batch of the decoder's own (rows 0..n_cur-1: a token, or a tree with its mask) through layer ranges,
// the waiting tokens joining it as rows n_cur.. when the range reaches the layer where each stopped. With nothing
// waiting it is the batch's plain layer-range evaluation.
struct checked_pass {
    specee_exit_chain *  chain = nullptr;
    specee_context *     ctx   = nullptr;
    int32_t              n_cur = 0;   // the decoder's rows (0: a flush, only waiting tokens)
    std::vector<int32_t> tok, pos;    // [n_cur]
    std::vector<uint8_t> tree_mask;   // [n_cur * n_cur], or empty: causal
    std::vector<int8_t>  output;      // [n_cur] rows with logits at the last layer, or empty: the last one
    int32_t              first = 0;   // chain->pending[first..] are rows n_cur.. of the pass
    int32_t              l     = 0;   // layers done
    bool                 started = false; // the context's last batch is this pass's
    std::vector<float>   features;    // EAGLE-3: [n_cur][3 n_embd] the decoder's rows' feature-layer outputs so far
};

// a pass of the batch (n_cur tokens at pos, tree_mask / output as specee_batch's, NULL allowed), or of the waiting
// tokens alone (n_cur 0: from the layer the newest stopped at)
void    checked_pass_begin(checked_pass & cp, specee_exit_chain & chain, specee_context & ctx, int32_t n_cur,
                           const int32_t * tok, const int32_t * pos, const uint8_t * tree_mask, const int8_t * output);
// layers [cp.l, b) (flags: SPECEE_EVAL_*; the last layer gives every row of the pass logits)
void    checked_pass_run(checked_pass & cp, int32_t b, uint32_t flags);
// the decoder's rows exit after layer cp.l - 1: the waiting tokens in the pass stop there too (resume and hidden state)
void    checked_pass_stop(checked_pass & cp);
// a row of the decoder's batch exits after layer cp.l - 1, unchecked: it waits, with its cell (the row's, or where it
// was moved), position, the head's feature it was paired with and the token emitted after it. The first one of a
// chain records the sampler's history before that token was accepted (pass `history`).
void    checked_pass_wait(checked_pass & cp, int32_t row, int32_t cell, int32_t pos, const std::vector<float> & feat,
                          int32_t next, const std::vector<int32_t> & history);
// After a pass that ran every layer for every waiting token: each waiting token's successor against the full model's
// greedy token (drawn with the chain's history). Every agreed token goes to `out` (token, layers its pass ran);
// returns true when all agreed (the sampler's history then holds them, and the caller goes on with its own rows), or
// false after a rollback at the first that did not: the full model's token goes to `out`, the cache and the head drop
// everything after the wrong one's position (the decoder's rows included), step.root / root_pos continue from it.
bool    checked_pass_check(checked_pass & cp, specee_step step, std::vector<std::pair<int32_t, int32_t>> & out);
// the waiting tokens alone through their remaining layers, then checked: a chain's end when no token follows (a full
// context, an end-of-generation token). Returns how many tokens it put out.
int32_t specee_exit_chain_flush(specee_exit_chain & chain, specee_step step,
                                std::vector<std::pair<int32_t, int32_t>> & out);
