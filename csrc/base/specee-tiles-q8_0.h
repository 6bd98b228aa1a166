// specee-tiles-q8_0.h: the tile of Q8_0 weights (blocks of 32, ggml's vec_dot bits; specee-tiles.h)
#pragma once

#include "specee-tiles.h"

// the Q8_0 tile for nt tokens (1..8): the SIMD path (AVX2, where the caller checked this CPU has it) or the portable
// one
void specee_tile_q8_0(const specee_tile_args & ta, int nt, bool simd);
