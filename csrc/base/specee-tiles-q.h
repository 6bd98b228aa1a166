// specee-tiles-q.h: the tiles of weights in blocks of 32, Q4_1 and Q8_0 (specee-tiles.h)
#pragma once

#include "specee-tiles.h"

// the tile of weight type w (Q4_1 or Q8_0) for nt tokens (1..8): the SIMD path (AVX2, where the caller checked this
// CPU has it) or the portable one
void specee_tile_q(const specee_tile_args & ta, int nt, ggml_type w, bool simd);
