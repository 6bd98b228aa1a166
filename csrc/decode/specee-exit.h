// specee-exit.h: SpecEE's exit predictors and what both exit decoders do with them: early exit (a token,
// specee-early-exit.cpp) and tree exit (a tree's verified rows, specee-tree-exit.cpp). A single token is a tree of one
// row, so the checks, the exit layer's logits, the skipped layers' K/V and the head's features after an exit are
// written here once, for rows of a pass.
//
// Owns: the exit decoder's state (specee_exit_decoder) and its set-up; the 12 features of a row and the per-layer
// predictor; the schedule of checked layers (the static set, the dynamic one around recent exits, a replay's layer);
// a pass's stats; after an exit, the exit layer's lm_head, the skipped layers' K/V and the draft head's features.
// The rows of a pass are rows of the context's last batch: its hidden state after the last evaluated layer
// (specee_context_hidden), its positions and cells.
#pragma once

#include "specee-exit-check.h"
#include "specee.h"

#include <cstdint>
#include <vector>

struct specee_context;
struct specee_model;

// ---- the decoder's state ----------------------------------------------------------------------------------

struct specee_exit_decoder {
    specee_exit_params   params{};        // threshold resolved; layers / replay copied below
    std::vector<int32_t> layers;          // the static schedule (block indices)
    std::vector<int32_t> replay;          // forced exit layers, cycled; empty: the predictors decide
    size_t               n_replayed = 0;
    std::vector<int32_t> recent_exits;    // the last exit layers, newest last (the dynamic schedule)

    specee_exit_chain    chain;           // checked exits: the tokens waiting for their check
};

// checks the parameters against the model (the schedule's layers need predictors, unless replayed)
void specee_exit_init(specee_exit_decoder & dec, const specee_model & model, const specee_exit_params & params);

// ---- the predictors -----------------------------------------------------------------------------------

// SpecEE's 12 features of a layer's output h [n_embd] for the candidates cand [n_cand]; p_prev: p at the previously
// checked layer, or nullptr; p_out [n_cand] (nullptr: not needed) receives p
void  specee_exit_features_impl(const specee_model & m, const float * h, const int32_t * cand, const float * p_prev,
                                float * feat, float * p_out);
// the layer's predictor on feat: a probability; throws for a layer without one
float specee_exit_predict_impl(const specee_model & m, int32_t layer, const float * feat);

// What a pass's checks know of its rows (row r: row r of the pass's batch; a single token: one row)
struct exit_checks {
    std::vector<std::vector<int32_t>> cand;   // [rows] the draft head's top n_cand tokens there (target ids); a row
                                              // with fewer (a head vocabulary smaller than n_cand) is never checked
    std::vector<std::vector<float>>   feat;   // [rows] the 12 features at the last checked layer (empty: none)
    std::vector<std::vector<float>>   p_prev; // [rows] p at the previous checked layer (empty: not checked yet)
};

// a pass's checks over rows with these candidates, nothing checked yet
void exit_checks_begin(exit_checks & ec, std::vector<std::vector<int32_t>> cand);
// the features of every row from the context's hidden state after the layer just evaluated
void exit_checks_features(exit_checks & ec, specee_context & ctx);
// Whether scheduled layer s exits the pass. A replayed exit (forced >= 0, exit_pass_schedule) fires at its layer
// only; a layer with a predictor is checked otherwise, firing when it is > threshold on every one of `rows` (a row
// without features never fires), and counted (st.n_checks, st.n_fired) whether or not a replay overrides it.
bool exit_layer_fires(const specee_exit_decoder & dec, const specee_model & m, int32_t s, int32_t forced,
                      const exit_checks & ec, const std::vector<int32_t> & rows, specee_generator_stats & st);

// ---- the schedule and a pass's stats ----------------------------------------------------------------------

// the layers checked for the next token (or tree pass): the static set, plus e-2, e, e+2 around each of the last 5
// exits, those with a predictor before the last layer (exiting there saves nothing), ascending
std::vector<int32_t> exit_schedule(const specee_exit_decoder & dec, const specee_model & m);
// the layers checked in this pass (of a token, or a tree); a replay (exit.replay) exits where it says (*forced, else
// -1), after the checks before that layer (they cost what they cost, but decide nothing)
std::vector<int32_t> exit_pass_schedule(specee_exit_decoder & dec, const specee_model & m, int32_t & forced);
// a pass's stats (n_steps, n_exits, n_layers_run; exited < 0: every layer ran) and, after an exit, its layer among the
// recent ones the dynamic schedule checks around
void exit_count_pass(specee_exit_decoder & dec, int32_t exited, int32_t n_layer, specee_generator_stats & st);

// ---- after an exit --------------------------------------------------------------------------------------

// Rows of the last pass after an exit at layer il, given as `rows` (row indices of the batch) or, empty, the pass's
// first row alone (a single token's: read in place, the graph builders' n_rows = 0).
// The final norm and lm_head at layer il (on the device that holds it), appended to norm [.., n_embd] and logits
// [.., n_vocab] in the order of `rows`
void exit_layer_logits(specee_context & ctx, int32_t il, const std::vector<int32_t> & rows, std::vector<float> & norm,
                       std::vector<float> & logits);
// SPECEE_EXIT_KV_FILL: the rows' K/V in layers (il, n_layer) computed from layer il's output, at the rows' positions
// into their cells, which then hold every layer
void exit_fill_skipped(specee_context & ctx, int32_t il, const std::vector<int32_t> & rows);
// The draft head's features of the rows [rows][n_feat] (rows as above, not empty): EAGLE-1 the exit layer's
// final-norm output, norm [rows][n_embd] (exit_layer_logits'); EAGLE-3 the outputs of its feature layers, those past
// layer il (not computed) taken as layer il's output
std::vector<float> exit_head_features(specee_context & ctx, int32_t il, const std::vector<int32_t> & rows,
                                      const std::vector<float> & norm);
