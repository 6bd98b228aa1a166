// specee-context-shift.h: context shift (llama-server's --context-shift; its public calls in specee.h's slots
// section): a request whose generation fills its slot's share of the context goes on instead of ending. Its first
// n_keep tokens stay, half of the rest (after them) is dropped, and the cells after the dropped ones move down to close
// the gap: their cached K turned by RoPE by the position difference (V does not depend on positions), as llama.cpp's
// K-shift does (specee_generator_shift, specee-generate.cpp; the slots' part in specee-context-shift.cpp). Off by
// default, as upstream.
#pragma once

struct specee_slots;

// llama.cpp's context shift of the slots whose cache is full, before a step (each slot's generator shifted)
void specee_slots_shift_full(struct specee_slots & s);
