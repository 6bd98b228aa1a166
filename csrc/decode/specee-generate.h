// specee-generate.h: the generator's internals for the runtime's other files (the batching loop of
// specee-slots.cpp drives generators of several sequences on one context)
#pragma once

#include "specee-draft-head.h"
#include "specee-drafter.h"
#include "specee-exit.h"
#include "specee-lookup.h"
#include "specee-sampling.h"
#include "specee-speculative.h"
#include "specee-step.h"
#include "specee.h"

#include <memory>
#include <string>
#include <vector>

struct specee_context;
struct specee_kv_cache;

struct specee_generator {
    specee_context *          ctx = nullptr;
    specee_generator_params   params{};
    int32_t                   mode = SPECEE_MODE_PLAIN; // resolved
    std::string               why;                      // what `auto` chose and why, and that a replayed
                                                        // acceptance makes the text meaningless ("" otherwise)
    std::unique_ptr<specee_sampler, void (*)(specee_sampler *)> smpl{nullptr, specee_sampler_free};
    std::unique_ptr<specee_draft_head> head; // eagle, eagle2, early_exit
    specee_tree_decoder       tree;
    specee_exit_decoder       exit;
    specee_lookup             lookup; // ngram
    specee_draft_seq          draft;  // draft: the sequence on the draft model's context

    bool                 started  = false;
    int32_t              root     = -1; // the last emitted token, not in the cache yet
    int32_t              root_pos = -1; // its position
    // tokens to return before decoding more, with the layers their steps ran: the first token (sampled by start), and
    // checked exits' tokens beyond what a call of next had room for
    std::vector<std::pair<int32_t, int32_t>> queue;
    specee_generator_stats stats{};
    int32_t              seq = 0; // the KV cache's sequence this generator decodes
    // the request's prompt and output for the context's cross-request n-gram cache, whatever the mode; kept by the
    // generator's callers: specee_generator_start / _next (ended when the next request starts), the slots
    specee_ngram_cache_doc doc;
};

// the generator's state for one step of its decoder (specee-step.h; head: nullptr in a mode without one)
inline specee_step specee_generator_step(specee_generator & g) {
    return {*g.ctx, g.head.get(), *g.smpl, g.root, g.root_pos, g.stats};
}

// While alive, the context's single-sequence cache operations act on the generator's sequence
struct specee_seq_scope {
    specee_kv_cache & kv;
    int32_t           saved;
    explicit specee_seq_scope(specee_generator & g);
    ~specee_seq_scope();
};

// the drafter of the generator's mode where its step is a drafted tree verified in one full pass (eagle, eagle2, ngram,
// ngram+eagle2: specee-drafter.h); nullptr for the others (plain, and the exits, whose passes stop early)
const specee_drafter * specee_generator_drafter(const specee_generator & g);

void    specee_generator_set_params_impl(specee_generator & g, const specee_generator_params & params);
// specee_generator_start / _next without the lock and the error guard (they throw); on the generator's sequence
// when a specee_seq_scope is alive
int32_t specee_generator_start_impl(specee_generator & g, const int32_t * tokens, int32_t n);
int32_t specee_generator_next_impl(specee_generator & g, int32_t * out, int32_t * layers_run, int32_t n_max);
// Context shift (specee-context-shift.h has the slots'): whether the generator's mode keeps its state through a shift, and the
// shift of its sequence: positions [n_keep, n_keep + n_discard) dropped, the later ones moved down (their K turned),
// root_pos and the mode's state brought along; false (nothing changed) where it cannot (a cell shared with another
// sequence, a mode that cannot)
bool specee_generator_can_shift(const specee_generator & g);
bool specee_generator_shift(specee_generator & g, int32_t n_keep, int32_t n_discard);

// Jump-forward (decoding under a grammar, params.jump_forward): the tokens the grammar forces next, at most
// budget (and JUMP_MAX), as a chain of drafts after the root in g.tree.nodes; returns the chain's nodes in row order,
// none when the grammar forces nothing (or there is no grammar, or jump-forward is off).
constexpr int32_t JUMP_MAX = 32;
std::vector<int32_t> specee_jump_forward_draft(specee_generator & g, int32_t budget);
// After the chain's pass (n_rows rows from row0, logits: the chain's rows'): the walk as a plain step draws, what it
// accepted kept in the cache; writes the emitted tokens (1..n_max), advances root / root_pos and the stats
int32_t specee_jump_forward_finish(specee_generator & g, int32_t n_rows, const float * logits, int32_t row0,
                                   int32_t n_max, int32_t * out);
// the tokens the grammar forces next (at most budget and JUMP_MAX; none without a grammar or with jump-forward off),
// for a drafter's step (specee_drafter_step's `forced`)
std::vector<int32_t> specee_jump_forward_tokens(specee_generator & g, int32_t budget);
