// specee-step.h: the state a decoding step reads and advances, passed to every step function as one struct (as
// llama2.c passes its RunState): EAGLE's tree step and its parts (specee-speculative.h), early exit
// (specee-early-exit.h), tree exit (specee-tree-exit.h), checked exits' check and flush (specee-exit-check.h) and
// n-gram lookup (specee-lookup.h, the one decoder without a draft head).
//
// Contract: the state lives in its owner (a generator, specee-generate.h); a specee_step only refers to it, as a
// pointer does, and is passed by value (a copy refers to the same state). It is made for a step
// (specee_generator_step) and dropped after. A step that emits tokens moves root to the last of them and root_pos past
// them, and adds what it did and how long it took to stats; the parts of a step say what they touch.
#pragma once

#include "specee.h"

#include <cstdint>

struct specee_context;
struct specee_draft_head;
struct specee_sampler;

struct specee_step {
    specee_context &         ctx;      // the target's context (its model: ctx.model)
    specee_draft_head *      head;     // the draft head, or nullptr for a drafter without one (n-gram lookup)
    specee_sampler &         smpl;     // the sampler: draws, and keeps the emitted tokens' history
    int32_t &                root;     // the last emitted token, not in the target's cache yet
    int32_t &                root_pos; // its position
    specee_generator_stats & stats;    // counts and times, added to
};
