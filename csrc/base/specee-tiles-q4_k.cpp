// specee-tiles-q4_k.cpp: Q4_K weights times a pass's tokens, eight weight rows at a time, in the loader's eight-row
// layout (docs/kernels.md).
//
// As Q4_1's tile (specee-tiles-q4_1.cpp): each output element has one float accumulator, and per super-block of 256
//
//     acc = fma(d_x * d_y, (float) sumi, acc);  acc = fma(-(dmin_x * d_y), (float) summ, acc)
//
// with sumi = sum over the eight sub-blocks of the sub-block's 6-bit scale times its exact integer dot product of
// the nibbles and the token's Q8_K quants (ggml's quantizer), summ = sum of the sub-blocks' 6-bit mins times the
// token's sums of their 32 quants; both exact integers, converted once (rounded to nearest, as a scalar conversion
// does). Every float operation is defined per (row, token, super-block) in super-block order, so the result does not
// depend on how many rows or tokens share a tile, the thread or the path: a token's logits do not depend on its
// batch. They differ from ggml's vec_dot in the last bits (it keeps eight float lanes); plain decoding uses this
// kernel too.
//
// The SIMD path puts eight rows in the lanes: per token and sub-block eight byte products with the token's four
// quants broadcast, summed in int16 (each pair sum at most 2 * 15 * 128, eight of them 30,720 < 2^15: exact), then
// one vpmaddwd with the eight rows' scale of that sub-block gives scale * dot per row, summed in int32.
#include "specee-tiles-q4_k.h"

#include <cmath>
#include <cstring>

static const q4_k_block & block_of(const void * row, int64_t b) { return ((const q4_k_block *) row)[b]; }


void specee_rows_pack_q4_k(const void * src, void * dst, int64_t k, int64_t m) {
    const int64_t nb = k / 256;
    for (int64_t r0 = 0; r0 < m; r0 += 8) {
        q4_k_rows8 * out = (q4_k_rows8 *) dst + r0 / 8 * nb;
        for (int64_t b = 0; b < nb; ++b) {
            memset(&out[b].six, 0, sizeof(out[b].six));
            for (int r = 0; r < 8; ++r) {
                const q4_k_block & x = block_of((const q4_k_block *) src + (r0 + r) * nb, b);
                out[b].d[r]          = x.d;
                out[b].dmin[r]       = x.dmin;
                int32_t sc[8], mn[8];
                specee_k_scales(x.scales, sc, mn);
                specee_k_six8_put(out[b].six, r, sc, mn);
                for (int j = 0; j < 4; ++j) {
                    for (int q = 0; q < 8; ++q) {
                        memcpy(out[b].w[j][q] + 4 * r, x.qs + 32 * j + 4 * q, 4);
                    }
                }
            }
        }
    }
}

#ifdef SPECEE_KERNELS_X86

// sumi + sub-block s's sum for one token: the eight rows' nibbles v[k] (elements 4k..4k+3) times the token's quants
// ys, the pair sums of eight vpmaddubsw added in int16 (each at most 2 * 15 * 128, eight 30,720 < 2^15: exact), then
// weighted by the scales (vpmaddwd)
SPECEE_AVX2 static inline __m256i sub_block_step(__m256i sumi, const __m256i v[8], const int8_t * ys, __m256i scale) {
    __m256i d = _mm256_setzero_si256();
    for (int k = 0; k < 8; ++k) {
        int32_t four;
        memcpy(&four, ys + 4 * k, sizeof(four));
        d = _mm256_add_epi16(d, _mm256_maddubs_epi16(v[k], _mm256_set1_epi32(four)));
    }
    return _mm256_add_epi32(sumi, _mm256_madd_epi16(d, scale));
}

// sub-block s's nibbles of the eight rows: w[s / 2][k], the low nibbles for even s
SPECEE_AVX2 static inline void rows_values(const q4_k_rows8 & g, int s, __m256i v[8]) {
    for (int k = 0; k < 8; ++k) {
        const __m256i w = _mm256_loadu_si256((const __m256i *) g.w[s / 2][k]);
        v[k]            = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(w, 4) : w, _mm256_set1_epi8(0x0F));
    }
}

template <int NT>
constexpr specee_rows_fn rows_avx2 = specee_k_rows_avx2<NT, q4_k_rows8, rows_values, sub_block_step>;

static const specee_rows_fn ROWS_Q4_K[8] = {rows_avx2<1>, rows_avx2<2>, rows_avx2<3>, rows_avx2<4>,
                                            rows_avx2<5>, rows_avx2<6>, rows_avx2<7>, rows_avx2<8>};

#endif

void specee_tile_rows_q4_k(const specee_tile_args & ta, const specee_rows_args & ra, int nt, bool simd) {
#ifdef SPECEE_KERNELS_X86
    if (simd) {
        ROWS_Q4_K[nt - 1](ta, ra);
        return;
    }
#endif
    (void) simd;
    specee_k_rows_portable<q4_k_rows8>(ta, ra, nt, [](const q4_k_rows8 & g, int r, int s, int e) {
        const uint8_t v = g.w[s / 2][e / 4][4 * r + e % 4];
        return s % 2 ? v >> 4 : v & 0x0F;
    });
}
