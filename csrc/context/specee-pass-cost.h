// specee-pass-cost.h: what a pass of n tokens costs on a context (specee-pass-cost.cpp)
#pragma once

#include <cstdint>

struct specee_context;

// What a pass of n tokens (every one with logits, as a tree verification) costs on this context's devices and
// threads, in single-token passes; timed once per n and context. The timing passes go after the cache's last
// position and are removed again (the last batch's results are overwritten). NAN when the cache has no room.
// (specee-pass-cost.cpp)
double specee_context_pass_cost(specee_context & ctx, int32_t n);
// the same when a pass of n tokens was timed (or set) before on this context, NAN otherwise (nothing is timed)
double specee_context_pass_cost_known(const specee_context & ctx, int32_t n);
// the cost given for a pass of n tokens (specee_context_set_pass_cost), NAN where none was given: such a cost holds
// for the context's life, and what the generators observe of their own passes does not replace it
double specee_context_pass_cost_given(const specee_context & ctx, int32_t n);
