// specee-early-exit.h: SpecEE's early-exit decoder over a draft head (greedy, lossy by design)
#pragma once

#include "specee-draft-head.h"
#include "specee.h"

#include <cstdint>
#include <utility>
#include <vector>

// Checked exits: a token that exited, its layers past the exit not run yet
struct exit_pending {
    int32_t            cell   = -1; // its KV cell (valid in layers [0, resume))
    int32_t            pos    = -1;
    int32_t            resume = 0;  // the first layer it has not run
    std::vector<float> h;           // [n_embd] its hidden state after layer resume - 1
    std::vector<float> feat;        // the draft head's feature it was paired with (a rollback pairs it again)
    int32_t            next   = -1; // the token emitted after it (its exit layer's argmax), to be checked
    int32_t            layers = 0;  // layers its own step ran (exit layer + 1)
};

struct specee_exit_decoder {
    specee_exit_params   params{};        // threshold resolved; layers / replay copied below
    std::vector<int32_t> layers;          // the static schedule (block indices)
    std::vector<int32_t> replay;          // forced exit layers, cycled; empty: the predictors decide
    size_t               n_replayed = 0;
    std::vector<int32_t> recent_exits;    // the last exit layers, newest last (the dynamic schedule)

    // checked exits: the unchecked tokens in position order (their resume layers never increase along it), and the
    // sampler's history before the first of them was emitted (a check draws as plain decoding would have)
    std::vector<exit_pending> pending;
    std::vector<int32_t>      chain_history;
};

// checks the parameters against the model (the schedule's layers need predictors, unless replayed)
void    specee_exit_init(specee_exit_decoder & dec, const specee_model & model, const specee_exit_params & params);
// One token: evaluates `root` (the last emitted token, at root_pos) layer range by layer range, checking the
// scheduled layers; returns the next token and advances root / root_pos; *layers_run receives the layers it ran.
int32_t specee_exit_step(specee_exit_decoder & dec, specee_draft_head & head, specee_sampler & smpl, int32_t & root,
                         int32_t & root_pos, int32_t & layers_run, specee_generator_stats & st);
// Checked exits (params.check): one token's step as specee_exit_step, with the unchecked tokens' skipped layers
// joining its pass where they stopped. A token that exits joins them; one that runs every layer checks them all
// against the full model's logits: the checked tokens (and its own next token), or up to a wrong one and the full
// model's token in its place, go to `out` (token, layers its step ran), and the cache and the head drop whatever
// followed a wrong one. Returns how many tokens it put out (0 while a chain is unchecked).
int32_t specee_exit_step_checked(specee_exit_decoder & dec, specee_draft_head & head, specee_sampler & smpl,
                                 int32_t & root, int32_t & root_pos, std::vector<std::pair<int32_t, int32_t>> & out,
                                 specee_generator_stats & st);
// Checked exits with no room for another token (or after an end-of-generation token): the unchecked tokens' remaining
// layers alone, then their checks as above. Returns how many tokens it put out.
int32_t specee_exit_flush(specee_exit_decoder & dec, specee_draft_head & head, specee_sampler & smpl, int32_t & root,
                          int32_t & root_pos, std::vector<std::pair<int32_t, int32_t>> & out,
                          specee_generator_stats & st);
