// specee-tiles-q4_k.h: Q4_K's tile in its eight-row layout: eight weight rows times up to eight token rows, with this
// runtime's own sums (per super-block of 256 one fma of the exact integer sum of the sub-blocks' scaled dot products
// and one of the mins' term), so that eight rows share every float operation (specee-tiles.h; docs/kernels.md)
#pragma once

#include "specee-tiles.h"

// the eight-row layout of Q4_K (the loader's, for matrices of a multiple of 8 rows): per group of eight rows and
// super-block, 1,152 bytes as in the file: the eight rows' d (fp16), their dmin, their 6-bit scales and mins (96
// bytes, decoded at load and stored so that a tile gets them in its lanes with a few shuffles: below), then for each
// 64 elements j and four-byte group k a vector of 32 bytes holding row r's qs[32 j + 4 k .. + 3] at 4 r (low
// nibbles: elements 4k.. of sub-block 2j, high: of sub-block 2j + 1).
//
// The scales (and the mins the same way): position i = 8 s + r (s in 0..3, r the row) holds sub-block s's and
// s + 4's. sc_lo[i]: the low 4 bits of sub-block s's scale in bits 0-3 and of s + 4's in bits 4-7; sc_hi[i % 16]:
// their top 2 bits in bits 2 (i / 16) and 4 + 2 (i / 16) (q4_k_rows8_scale reads one)
struct q4_k_rows8 {
    uint16_t d[8];
    uint16_t dmin[8];
    uint8_t  sc_lo[32];
    uint8_t  sc_hi[16];
    uint8_t  mn_lo[32];
    uint8_t  mn_hi[16];
    uint8_t  w[4][8][32];
};
static_assert(sizeof(q4_k_rows8) == 8 * 144, "eight Q4_K super-blocks");

// row r's 6-bit scale (or min: lo, hi from mn_lo, mn_hi) of sub-block s in a group
inline int32_t q4_k_rows8_scale(const uint8_t * lo, const uint8_t * hi, int s, int r) {
    const int i = 8 * (s % 4) + r, h = s / 4;
    return ((lo[i] >> (4 * h)) & 0x0F) | (((hi[i % 16] >> (2 * (i / 16) + 4 * h)) & 3) << 4);
}

// the eight-row layout of a Q4_K matrix of m rows (a multiple of 8) of k elements: src in the file's layout
void specee_rows_pack_q4_k(const void * src, void * dst, int64_t k, int64_t m);

// rows in the eight-row layout (ra.packed) times the tokens' Q8_K blocks: the SIMD path (AVX2, where the caller
// checked this CPU has it) or the portable one; nt in 1..8
void specee_tile_rows_q4_k(const specee_tile_args & ta, const specee_rows_args & ra, int nt, bool simd);
