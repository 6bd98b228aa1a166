// specee-early-exit.h: SpecEE's early-exit decoder over a draft head (greedy, lossy by design)
#pragma once

#include "specee-draft-head.h"
#include "specee-exit-check.h"
#include "specee.h"

#include <cstdint>
#include <utility>
#include <vector>

struct specee_exit_decoder {
    specee_exit_params   params{};        // threshold resolved; layers / replay copied below
    std::vector<int32_t> layers;          // the static schedule (block indices)
    std::vector<int32_t> replay;          // forced exit layers, cycled; empty: the predictors decide
    size_t               n_replayed = 0;
    std::vector<int32_t> recent_exits;    // the last exit layers, newest last (the dynamic schedule)

    specee_exit_chain    chain;           // checked exits: the tokens waiting for their check
};

// checks the parameters against the model (the schedule's layers need predictors, unless replayed)
void    specee_exit_init(specee_exit_decoder & dec, const specee_model & model, const specee_exit_params & params);
// One token: evaluates `root` (the last emitted token, at root_pos) layer range by layer range, checking the
// scheduled layers; returns the next token and advances root / root_pos; *layers_run receives the layers it ran.
int32_t specee_exit_step(specee_exit_decoder & dec, specee_draft_head & head, specee_sampler & smpl, int32_t & root,
                         int32_t & root_pos, int32_t & layers_run, specee_generator_stats & st);
// Checked exits (params.check): one token's step as specee_exit_step, with the waiting tokens' skipped layers joining
// its pass where they stopped (specee-exit-check.h). A token that exits waits with them; one that runs every layer
// checks them all: the checked tokens (and its own next token), or up to a wrong one and the full model's token in its
// place, go to `out` (token, layers its step ran). Returns how many tokens it put out (0 while a chain waits).
int32_t specee_exit_step_checked(specee_exit_decoder & dec, specee_draft_head & head, specee_sampler & smpl,
                                 int32_t & root, int32_t & root_pos, std::vector<std::pair<int32_t, int32_t>> & out,
                                 specee_generator_stats & st);

// The parts tree exit (specee-tree-exit.cpp) shares:
// the layers checked for the next token (or tree pass): the static set, plus e-2, e, e+2 around each of the last 5
// exits, those with a predictor before the last layer, ascending
std::vector<int32_t> exit_schedule(const specee_exit_decoder & dec, const specee_model & m);
// the layers checked in this pass (of a token, or a tree); a replay (exit.replay) exits where it says (*forced, else -1),
// after the checks before that layer (they cost what they cost, but decide nothing)
std::vector<int32_t> exit_pass_schedule(specee_exit_decoder & dec, const specee_model & m, int32_t & forced);
// a pass's stats (n_steps, n_exits, n_layers_run; exited < 0: every layer ran) and, after an exit, its layer among the
// recent ones the dynamic schedule checks around
void exit_count_pass(specee_exit_decoder & dec, int32_t exited, int32_t n_layer, specee_generator_stats & st);
// SpecEE's 12 features of a layer's output h [n_embd] for the candidates cand [n_cand]; p_prev: p at the previously
// checked layer, or nullptr; p_out [n_cand] (nullptr: not needed) receives p
void  specee_exit_features_impl(const specee_model & m, const float * h, const int32_t * cand, const float * p_prev,
                                float * feat, float * p_out);
// the layer's predictor on feat: a probability; throws for a layer without one
float specee_exit_predict_impl(const specee_model & m, int32_t layer, const float * feat);
