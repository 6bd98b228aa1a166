// specee-tiles-q6_k.h: Q6_K's tile in its eight-row layout: eight weight rows times up to eight token rows, with this
// runtime's own sums (per super-block of 256 one fma of an exact integer sum), so that eight rows share every float
// operation (specee-tiles.h; docs/kernels.md)
#pragma once

#include "specee-tiles.h"

// the eight-row layout of Q6_K (the loader's, for matrices of a multiple of 8 rows): per group of eight rows and
// super-block, 1,680 bytes, the file's size. The 256 six-bit values u (the weight is d * scale * (u - 32)) of a row in
// quads of four elements (quad q: elements 4q..4q+3, sub-block q / 4): lo[n] holds, at 4r..4r+3, row r's quads n
// (low nibbles) and n + 32 (high nibbles), hi[c] the top two bits of quads c, c + 16, c + 32 and c + 48 (bits 0-1,
// 2-3, 4-5, 6-7); scales[j][r] row r's scale of sub-block j
struct q6_k_rows8 {
    uint16_t d[8];
    int8_t   scales[16][8];
    uint8_t  lo[32][32];
    uint8_t  hi[16][32];
};
static_assert(sizeof(q6_k_rows8) == 8 * 210, "eight Q6_K super-blocks");

// the eight-row layout of a Q6_K matrix of m rows (a multiple of 8) of k elements: src in the file's layout
void specee_rows_pack_q6_k(const void * src, void * dst, int64_t k, int64_t m);

// rows in the eight-row layout (ra.packed) times the tokens' Q8_K blocks: the SIMD path (AVX2, where the caller
// checked this CPU has it) or the portable one; nt in 1..8
void specee_tile_rows_q6_k(const specee_tile_args & ta, const specee_rows_args & ra, int nt, bool simd);
