// specee-context-shift.h: context shift (llama-server's --context-shift), part of the public API beside specee.h:
// a request whose generation fills its slot's share of the context goes on instead of ending. Its first n_keep
// tokens stay, half of the rest (after them) is dropped, and the cells after the dropped ones move down to close the
// gap: their cached K turned by RoPE by the position difference (V does not depend on positions), as llama.cpp's
// K-shift does (specee_generator_shift, specee-generate.cpp; the slots' part in specee-context-shift.cpp). Off by
// default, as upstream.
#pragma once

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct specee_slots;

// Context shift for the slots' requests from now on: n_keep leading tokens kept (< 0: the whole prompt); a request in
// a mode whose state a shift keeps (plain, ngram, draft; not one with a draft head or exits) shifts, the others end
// with SPECEE_FINISH_CONTEXT as without it. 0, or -1 with specee_last_error().
int32_t specee_slots_set_context_shift(struct specee_slots * slots, bool enable, int32_t n_keep);
// how often the slot's request was shifted (llama.cpp's `truncated` when > 0)
int32_t specee_slots_n_shifted(const struct specee_slots * slots, int32_t slot);

#ifdef __cplusplus
}
#endif

#ifdef __cplusplus
// llama.cpp's context shift of the slots whose cache is full, before a step (each slot's generator shifted)
void specee_slots_shift_full(struct specee_slots & s);
#endif
