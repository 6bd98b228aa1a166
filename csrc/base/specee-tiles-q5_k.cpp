// specee-tiles-q5_k.cpp: Q5_K weights times a pass's tokens, eight weight rows at a time, in the loader's eight-row
// layout (docs/kernels.md).
//
// Q4_K's tile (specee-tiles-q4_k.cpp) with five-bit values: per (row, token, super-block)
//
//     acc = fma(d_x * d_y, (float) sumi, acc);  acc = fma(-(dmin_x * d_y), (float) summ, acc)
//
// sumi = sum over the eight sub-blocks of the 6-bit scale times the exact integer dot product of the five-bit values
// and the token's Q8_K quants, summ = sum of the mins times the token's sums of 32: exact integers, converted once, in
// super-block order, so a result does not depend on its batch, thread or path. On the SIMD path four byte products
// are summed in int16 (each pair sum at most 2 * 31 * 128, four of them 31,744 < 2^15), two vpmaddwd per sub-block.
#include "specee-tiles-q5_k.h"

#include <cmath>
#include <cstring>

void specee_rows_pack_q5_k(const void * src, void * dst, int64_t k, int64_t m) {
    const int64_t nb = k / 256;
    for (int64_t r0 = 0; r0 < m; r0 += 8) {
        q5_k_rows8 * out = (q5_k_rows8 *) dst + r0 / 8 * nb;
        for (int64_t b = 0; b < nb; ++b) {
            memset(&out[b].six, 0, sizeof(out[b].six));
            for (int r = 0; r < 8; ++r) {
                const q5_k_block & x = ((const q5_k_block *) src)[(r0 + r) * nb + b];
                out[b].d[r]          = x.d;
                out[b].dmin[r]       = x.dmin;
                int32_t sc[8], mn[8];
                specee_k_scales(x.scales, sc, mn);
                specee_k_six8_put(out[b].six, r, sc, mn);
                for (int q = 0; q < 8; ++q) {
                    memcpy(out[b].h[q] + 4 * r, x.qh + 4 * q, 4);
                    for (int j = 0; j < 4; ++j) {
                        memcpy(out[b].w[j][q] + 4 * r, x.qs + 32 * j + 4 * q, 4);
                    }
                }
            }
        }
    }
}

#ifdef SPECEE_KERNELS_X86

// sub-block s's four-element group k of the eight rows as five-bit values: the nibbles of w[s / 2][k] (low for even
// s) with bit s of h[k] moved to bit 4
SPECEE_AVX2 static inline __m256i rows_fives(const q5_k_rows8 & g, int s, int k) {
    const __m256i w  = _mm256_loadu_si256((const __m256i *) g.w[s / 2][k]);
    const __m256i h  = _mm256_loadu_si256((const __m256i *) g.h[k]);
    const __m256i lo = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(w, 4) : w, _mm256_set1_epi8(0x0F));
    // bit s to bit 4 within each byte (16-bit shifts; the mask keeps only what came from the same byte)
    const __m256i up = s <= 4 ? _mm256_sll_epi16(h, _mm_cvtsi32_si128(4 - s))
                              : _mm256_srl_epi16(h, _mm_cvtsi32_si128(s - 4));
    return _mm256_or_si256(lo, _mm256_and_si256(up, _mm256_set1_epi8(0x10)));
}

// sumi + sub-block s's sum for one token: the eight rows' five-bit values v[k] (elements 4k..4k+3) times the token's
// quants ys, four byte products summed at a time in int16 (exact), then weighted by the scales (vpmaddwd)
SPECEE_AVX2 static inline __m256i sub_block_step(__m256i sumi, const __m256i v[8], const int8_t * ys, __m256i scale) {
    __m256i d[2];
    for (int half = 0; half < 2; ++half) {
        d[half] = _mm256_setzero_si256();
        for (int k = 4 * half; k < 4 * half + 4; ++k) {
            int32_t four;
            memcpy(&four, ys + 4 * k, sizeof(four));
            d[half] = _mm256_add_epi16(d[half], _mm256_maddubs_epi16(v[k], _mm256_set1_epi32(four)));
        }
    }
    return _mm256_add_epi32(sumi, _mm256_add_epi32(_mm256_madd_epi16(d[0], scale), _mm256_madd_epi16(d[1], scale)));
}

// sub-block s's five-bit values of the eight rows
SPECEE_AVX2 static inline void rows_values(const q5_k_rows8 & g, int s, __m256i v[8]) {
    for (int k = 0; k < 8; ++k) {
        v[k] = rows_fives(g, s, k);
    }
}

template <int NT>
constexpr specee_rows_fn rows_avx2 = specee_k_rows_avx2<NT, q5_k_rows8, rows_values, sub_block_step>;

static const specee_rows_fn ROWS_Q5_K[8] = {rows_avx2<1>, rows_avx2<2>, rows_avx2<3>, rows_avx2<4>,
                                            rows_avx2<5>, rows_avx2<6>, rows_avx2<7>, rows_avx2<8>};

#endif

void specee_tile_rows_q5_k(const specee_tile_args & ta, const specee_rows_args & ra, int nt, bool simd) {
#ifdef SPECEE_KERNELS_X86
    if (simd) {
        ROWS_Q5_K[nt - 1](ta, ra);
        return;
    }
#endif
    (void) simd;
    specee_k_rows_portable<q5_k_rows8>(ta, ra, nt, [](const q5_k_rows8 & g, int r, int s, int e) {
        const uint8_t v = g.w[s / 2][e / 4][4 * r + e % 4];
        return (s % 2 ? v >> 4 : v & 0x0F) | ((g.h[e / 4][4 * r + e % 4] >> s) & 1) << 4;
    });
}
