// specee-tiles-q5_k.h: Q5_K's tile in its eight-row layout: eight weight rows times up to eight token rows, with this
// runtime's own sums as Q4_K's (specee-tiles-q4_k.h), the fifth bit of each weight added where the nibbles are split
// (specee-tiles.h; docs/kernels.md)
#pragma once

#include "specee-tiles.h"

// the eight-row layout of Q5_K (the loader's, for matrices of a multiple of 8 rows): per group of eight rows and
// super-block, 1,408 bytes as in the file: Q4_K's eight-row layout (specee-tiles-q4_k.h) with, before the nibbles,
// h[k] holding row r's qh[4k..4k+3] at 4r (element 32 s + l's fifth bit is bit s of qh[l])
struct q5_k_rows8 {
    uint16_t      d[8];
    uint16_t      dmin[8];
    specee_k_six8 six;
    uint8_t       h[8][32];
    uint8_t       w[4][8][32];
};
static_assert(sizeof(q5_k_rows8) == 8 * 176, "eight Q5_K super-blocks");

// the eight-row layout of a Q5_K matrix of m rows (a multiple of 8) of k elements: src in the file's layout
void specee_rows_pack_q5_k(const void * src, void * dst, int64_t k, int64_t m);

// rows in the eight-row layout (ra.packed) times the tokens' Q8_K blocks: the SIMD path (AVX2, where the caller
// checked this CPU has it) or the portable one; nt in 1..8
void specee_tile_rows_q5_k(const specee_tile_args & ta, const specee_rows_args & ra, int nt, bool simd);
