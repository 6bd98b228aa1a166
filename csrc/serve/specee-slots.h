// specee-slots.h: the parallel slots' state (specee-slots.cpp: requests; specee-slot-step.cpp: a step, the shared
// pass; specee-slot-cache.cpp: a slot's cells saved and restored; specee-context-shift.cpp: the context shift of full
// slots)
#pragma once

#include "specee-generate.h"
#include "specee.h"

#include <memory>
#include <string>
#include <vector>

enum slot_state {
    SLOT_FREE    = 0,
    SLOT_PREFILL = 1,
    SLOT_DECODE  = 2,
    SLOT_DONE    = 3, // finished; its tokens wait to be read until the slot is released
};

struct specee_slot {
    std::unique_ptr<specee_generator, void (*)(specee_generator *)> gen{nullptr, specee_generator_free};
    int32_t              state  = SLOT_FREE;
    bool                 alone  = false; // a speculative mode: passes of its own
    std::vector<int32_t> prompt;
    int32_t              n_past    = 0;  // prompt tokens in the cache
    int32_t              n_predict = -1; // most tokens to generate, < 0: until the slot's context is full
    int32_t              n_generated = 0;
    std::vector<int32_t> out, out_layers; // generated, not read yet
    int32_t              n_probs = -1;   // alternatives per token; < 0: no log-probabilities
    std::vector<specee_token_logprob> out_probs; // 1 + n_probs per token of out
    bool                 post_sampling = false; // out_probs after the sampler's chain (specee_slots_set_post_sampling_probs)
    int32_t              finish = SPECEE_FINISH_NONE;
    std::string          error;
    uint64_t             order = 0; // when the request came (prefill order), or was last used (slot choice)
    bool                 full  = false; // its cache is full: a context shift is due before its next step
    int32_t              n_shifted = 0;
};

struct specee_slots {
    specee_context *         ctx = nullptr;
    std::vector<specee_slot> slots;
    int32_t                  n_chunk    = 0;
    int32_t                  n_ctx_slot = 0;
    bool                     unified    = false; // every slot may use the whole cache (specee_slots_set_unified)
    uint64_t                 clock      = 0;
    specee_slots_totals      totals{};
    bool                     ctx_shift = false; // context shift (specee-context-shift.h), keeping n_keep tokens
    int32_t                  n_keep    = 0;
};

// the request's prompt and output into the context's cross-request cache, where it ends (once; whatever its mode)
void specee_slots_commit_doc(specee_slots & s, specee_slot & sl);

// a token the slot's request produced (logits: its step's, for log-probabilities; NULL in a speculative step): kept
// for reading, or the end of the request
void specee_slot_emit(specee_slots & s, specee_slot & sl, int32_t t, int32_t layers, const float * logits = nullptr);
// a slot's request ends with an error (the slot's failure, not the pass's)
void specee_slot_fail(specee_slot & sl, const char * what);

// the free slot whose cache holds the longest prefix of the prompt (the least recently used of equals; its length in
// `cached`), -1: every slot holds a request (specee-slots.cpp; specee_slots_choose asks it for the prompt cache)
int32_t specee_slots_choose_impl(specee_slots & s, const int32_t * tokens, int32_t n, int32_t & cached);
