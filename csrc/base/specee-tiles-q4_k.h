// specee-tiles-q4_k.h: Q4_K's tile in its eight-row layout: eight weight rows times up to eight token rows, with this
// runtime's own sums (per super-block of 256 one fma of the exact integer sum of the sub-blocks' scaled dot products
// and one of the mins' term), so that eight rows share every float operation (specee-tiles.h; docs/kernels.md)
#pragma once

#include "specee-tiles.h"

// the eight-row layout of Q4_K (the loader's, for matrices of a multiple of 8 rows): per group of eight rows and
// super-block, 1,152 bytes as in the file: the eight rows' d (fp16), their dmin, their 6-bit scales and mins decoded
// at load (specee_k_six8), then for each 64 elements j and four-byte group k a vector of 32 bytes holding row r's
// qs[32 j + 4 k .. + 3] at 4 r (low nibbles: elements 4k.. of sub-block 2j, high: of sub-block 2j + 1)
struct q4_k_rows8 {
    uint16_t      d[8];
    uint16_t      dmin[8];
    specee_k_six8 six;
    uint8_t       w[4][8][32];
};
static_assert(sizeof(q4_k_rows8) == 8 * 144, "eight Q4_K super-blocks");

// the eight-row layout of a Q4_K matrix of m rows (a multiple of 8) of k elements: src in the file's layout
void specee_rows_pack_q4_k(const void * src, void * dst, int64_t k, int64_t m);

// rows in the eight-row layout (ra.packed) times the tokens' Q8_K blocks: the SIMD path (AVX2, where the caller
// checked this CPU has it) or the portable one; nt in 1..8
void specee_tile_rows_q4_k(const specee_tile_args & ta, const specee_rows_args & ra, int nt, bool simd);
