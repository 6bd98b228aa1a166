// specee-tiles-k.h: the tiles of the K-quants, weights in super-blocks of 256: Q4_K, Q5_K, Q6_K (specee-tiles.h)
#pragma once

#include "specee-tiles.h"

// the tile of weight type w (Q4_K, Q5_K or Q6_K) for nt tokens (1..8): the SIMD path (AVX2, where the caller checked
// this CPU has it) or the portable one
void specee_tile_k(const specee_tile_args & ta, int nt, ggml_type w, bool simd);
