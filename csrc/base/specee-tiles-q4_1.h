// specee-tiles-q4_1.h: Q4_1's tile: eight weight rows times up to eight token rows, with this runtime's own
// accumulation (one float accumulator per output element, per block one fma of the block's exact integer dot and one
// of its min term), so that eight rows share every float operation (specee-tiles.h; docs/kernels.md)
#pragma once

#include "specee-tiles.h"

// the eight-row layout of Q4_1 (the loader's, for matrices of a multiple of 8 rows): per group of eight rows and
// block of 32, 160 bytes: the eight rows' d (fp16), their m, then four vectors of 32 bytes, vector k holding row
// r's qs[4k..4k+3] at 4r (the tile's transposition done once at load)
struct q4_1_rows8 {
    uint16_t d[8];
    uint16_t m[8];
    uint8_t  w[4][32];
};
static_assert(sizeof(q4_1_rows8) == 8 * 20, "eight Q4_1 blocks");


// the SIMD path (AVX2, where the caller checked this CPU has it) or the portable one; nt in 1..8
void specee_tile_rows_q4_1(const specee_tile_args & ta, const specee_rows_args & ra, int nt, bool simd);

// the eight-row layout of a Q4_1 matrix of m rows (a multiple of 8) of k elements: src in the file's layout
void specee_rows_pack_q4_1(const void * src, void * dst, int64_t k, int64_t m);
