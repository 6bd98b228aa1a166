// specee-tiles-q4_0.h: Q4_0's tile in its eight-row layout: eight weight rows times up to eight token rows, with
// the arithmetic of ggml's repacked Q4_0 (per block one fma of the exact integer dot product), so that eight rows share
// every float operation and the results are ggml's own (specee-tiles.h; docs/kernels.md)
#pragma once

#include "specee-tiles.h"

// the eight-row layout of Q4_0 (the loader's, for matrices of a multiple of 8 rows): per group of eight rows and
// block of 32, 144 bytes, the file's size: the eight rows' d (fp16), then four vectors of 32 bytes, vector k holding
// row r's qs[4k..4k+3] at 4r (as Q4_1's layout, without the mins)
struct q4_0_rows8 {
    uint16_t d[8];
    uint8_t  w[4][32];
};
static_assert(sizeof(q4_0_rows8) == 8 * 18, "eight Q4_0 blocks");

// the eight-row layout of a Q4_0 matrix of m rows (a multiple of 8) of k elements: src in the file's layout
void specee_rows_pack_q4_0(const void * src, void * dst, int64_t k, int64_t m);

// rows in the eight-row layout (ra.packed) or the file's times the tokens' Q8_0 blocks, whose integer sums the
// quantizer keeps in ta.s_y: the SIMD path (AVX2, where the caller checked this CPU has it) or the portable one; nt in
// 1..8
void specee_tile_rows_q4_0(const specee_tile_args & ta, const specee_rows_args & ra, int nt, bool simd);
