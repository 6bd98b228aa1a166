// specee-drafter.h: drafters. A drafter proposes a tree of candidate tokens after a sequence's last token (a chain is
// a tree of one branch), with what drafting cost, and learns from what the target accepted. The EAGLE draft head is
// one (here: eagle, eagle2), n-gram lookup over the sequence and the cross-request cache another (specee-lookup.cpp:
// ngram), the hybrid both, lookup's chain merged into the head's tree (specee-hybrid.cpp: ngram+eagle2), and a draft
// model a greedy chain from a second model's own context (specee-draft-model.cpp: draft).
// Whoever proposed it, a tree is verified in one pass of the target and walked by one rule (specee_tree_walk: greedy
// output equals plain decoding's; sampling keeps the target's distribution, a drafter without a distribution proposing
// point masses, draft_node::point), alone (specee_drafter_step) or as a block of rows of a pass shared with other
// sequences (specee-slots.cpp: propose, the shared pass, specee_drafter_finish).
//
// Contract: propose leaves the tree in s.dec.nodes (node 0 the root, step.root; the nodes to verify with rows 1.. in
// the order returned, rows growing along every path) and changes no cache but the draft head's own; observe runs once
// per proposal, after the walk kept the accepted cells. Neither moves step.root / root_pos or adds to step.stats (the
// step and the finish below do). Adding a drafter: its propose and observe in its own file with its specee_drafter, a
// mode row saying what it reads (specee-options.cpp), and the mode's case in specee_generator_drafter
// (specee-generate.cpp, where the decoders are named).
#pragma once

#include "specee-speculative.h"
#include "specee-step.h"

#include <cstdint>
#include <string>
#include <vector>

struct specee_lookup;
struct specee_model;

// The pass a proposal's rows join: the rows already in it, this sequence's root included (alone: 1), the tokens they
// yield (a plain row one, a tree's root at least one), and what the step costs besides the pass, in single passes (the
// draft head's levels). A drafter that weighs its rows against the pass cost (lookup) drafts where its extra tokens per
// extra cost beat the pass's tokens per cost: in a batch a row costs its marginal cost there, not a pass of its own.
struct specee_pass_share {
    int32_t n_rows   = 1;
    double  n_tokens = 1.0;
    double  extra    = 0.0;
};

// what a drafter proposed for one step
struct specee_proposal {
    std::vector<int32_t> nodes;         // the nodes to verify, in row order (rows 1..; none: a plain step)
    double               cost  = 0.0;   // drafting's cost in single target passes, the drafter's estimate (lookup:
                                        // 0; the draft head: its weights' share of the model's, per level drafted)
    bool                 cache = false; // its point nodes come from the cross-request cache (stats n_cache_*)
};

// the draft model's side of a sequence (specee-draft-model.cpp): its settings, and the sequence's tokens so far (the
// root last), a prefix of which the draft model's context caches on the sequence's id
struct specee_draft_seq {
    specee_draft_params  params{};
    bool                 no_eog = false; // the generation never emits an end-of-generation token (ignore_eos)
    std::vector<int32_t> tokens;
};


// the state drafters read and learn into: the step's tree (and the head's tree settings), the sequence's lookup and
// draft-model sequence
struct specee_drafter_state {
    specee_tree_decoder & dec;
    specee_lookup &       lookup;
    specee_draft_seq &    draft;
};

struct specee_drafter {
    const char * name;
    // the tree after step.root, at most `budget` nodes to verify (>= 0: the room the pass, the cache and the request
    // leave; each drafter keeps within its own settings too); `share`: the pass its rows join
    specee_proposal (*propose)(specee_drafter_state s, specee_step step, int32_t budget,
                               const specee_pass_share & share);
    // after the walk: the emitted tokens, and the pass (n_pass rows, pass_ms) the proposal's rows were part of
    void (*observe)(specee_drafter_state s, const specee_proposal & p, const std::vector<int32_t> & emitted,
                    int32_t n_pass, double pass_ms);
};

extern const specee_drafter specee_drafter_eagle;  // the draft head's tree (EAGLE-1 static or EAGLE-2 dynamic)
extern const specee_drafter specee_drafter_lookup; // n-gram lookup's chain and branches (specee-lookup.cpp)
extern const specee_drafter specee_drafter_hybrid; // lookup's chain grafted onto the head's tree (specee-hybrid.cpp)
extern const specee_drafter specee_drafter_draft;  // a draft model's greedy chain (specee-draft-model.cpp)

// a level of the draft head's drafting in single target passes, from the bytes each reads (decoding reads every weight
// once a pass): the head's fc, layer and output rows against the model's layers and lm_head
double specee_drafter_head_cost(const specee_model & m);

// The pass that verified a proposal: its rows are the pass's rows row0 .. row0 + n_rows - 1 (root first), their
// logits row by row at `logits`; the whole pass had n_pass rows and took pass_ms
struct specee_verified {
    int32_t       n_rows  = 0;
    const float * logits  = nullptr;
    int32_t       row0    = 0;
    int32_t       n_pass  = 0;
    double        pass_ms = 0.0;
};

// One draft-and-verify step after step.root: writes 1..n_max tokens (it stops after an end-of-generation token),
// advances root / root_pos, adds to stats; returns the count. s.dec holds the step's tree.
// The nodes a step verifies: the proposal's that the grammar allows (specee_tree_filter), or, where those reach no
// deeper than the tokens the grammar forces after step.root (`forced`, at most budget of them), the forced chain
// instead (p becomes it: specee_tree_chain). The generator's step and the slots' trees both decide so.
std::vector<int32_t> specee_drafter_with_forced(specee_drafter_state s, specee_step step, specee_proposal & p,
                                                const std::vector<int32_t> & forced, int32_t budget);
// forced: the tokens a grammar forces after step.root (jump-forward; none: an ordinary step), verified as the step's
// tree where the drafter's own (filtered by the grammar) reaches no deeper
int32_t specee_drafter_step(const specee_drafter & d, specee_drafter_state s, specee_step step, int32_t * out,
                            int32_t n_max, const std::vector<int32_t> & forced = {});
// The step's second half, after a pass that verified the proposal: the walk, the accepted cells kept (the head's
// pairs too), the drafter's observe, root / root_pos advanced, steps / drafted / accepted counted; the emitted tokens
// (1..n_max) to out, their count returned
int32_t specee_drafter_finish(const specee_drafter & d, specee_drafter_state s, specee_step step,
                              const specee_proposal & p, const specee_verified & v, int32_t n_max, int32_t * out);
