// specee-context-shift.cpp: llama.cpp's context shift of the parallel slots (specee-context-shift.h): before a
// step, each slot whose cache is full keeps n_keep tokens and drops half of the rest; the shift of a generator's
// sequence is the generator's (specee_generator_shift, specee-generate.cpp). The slots' step calls it
// (specee-slot-step.cpp).
#include "specee-context-shift.h"
#include "specee-context.h"
#include "specee-generate.h"
#include "specee-slots.h"

#include <algorithm>
#include <mutex>

// llama.cpp's context shift of the full slots: n_keep tokens kept (< 0: the prompt), half of the rest dropped
void specee_slots_shift_full(specee_slots & s) {
    for (specee_slot & sl : s.slots) {
        if (sl.state != SLOT_DECODE || !sl.full) {
            continue;
        }
        specee_generator & g      = *sl.gen;
        const int32_t      n_keep = std::min(s.n_keep < 0 ? (int32_t) sl.prompt.size() : s.n_keep, s.n_ctx_slot - 4);
        const int32_t      n_left = g.root_pos - n_keep;
        sl.full                   = false;
        if (specee_generator_shift(g, n_keep, std::clamp(n_left / 2, 0, std::max(0, n_left - 1)))) {
            sl.n_shifted++;
            continue;
        }
        sl.finish = SPECEE_FINISH_CONTEXT; // a cell shared with another slot: it ends as without a shift
        sl.state  = SLOT_DONE;
        specee_slots_commit_doc(s, sl);
    }
}

extern "C" int32_t specee_slots_set_context_shift(specee_slots * s, bool enable, int32_t n_keep) {
    std::lock_guard<std::recursive_mutex> lock(s->ctx->mutex);
    s->ctx_shift = enable;
    s->n_keep    = n_keep;
    return 0;
}

extern "C" int32_t specee_slots_n_shifted(const specee_slots * s, int32_t slot) {
    return slot >= 0 && slot < (int32_t) s->slots.size() ? s->slots[slot].n_shifted : 0;
}
