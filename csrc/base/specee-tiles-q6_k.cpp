// specee-tiles-q6_k.cpp: Q6_K weights times a pass's tokens, eight weight rows at a time, in the loader's eight-row
// layout (docs/kernels.md).
//
// As Q4_K's tile (specee-tiles-q4_k.cpp): each output element has one float accumulator, and per super-block of 256
//
//     acc = fma(d_x * d_y, (float) sumi, acc)
//
// with sumi = sum over the sixteen sub-blocks of 16 of the sub-block's int8 scale times the exact integer dot product
// of the six-bit values u and the token's Q8_K quants (ggml's quantizer), minus 32 times the sum of the scales times
// the token's sums of 16 (the weights are u - 32): an exact integer (below 2^31), converted once. Every float
// operation is defined per (row, token, super-block) in super-block order, so the result does not depend on how many
// rows or tokens share a tile, the thread or the path. They differ from ggml's vec_dot in the last bits; plain
// decoding uses this kernel too.
//
// The SIMD path puts eight rows in the lanes: per token and quad one byte product with the token's four quants
// broadcast; two quads summed in int16 (each pair sum at most 2 * 63 * 128, two of them 32,256 < 2^15: exact), then
// one vpmaddwd with the eight rows' scale of the sub-block.
#include "specee-tiles-q6_k.h"

#include <cmath>
#include <cstring>

static const q6_k_rows8 & group_of(const void * rows, int64_t b) { return ((const q6_k_rows8 *) rows)[b]; }

// row r's six-bit value of element e in a group
static int32_t six_bits(const q6_k_rows8 & g, int r, int e) {
    const int q = e / 4, at = 4 * r + e % 4;
    return ((g.lo[q % 32][at] >> (q >= 32 ? 4 : 0)) & 0x0F) | (((g.hi[q % 16][at] >> (2 * (q / 16))) & 3) << 4);
}

void specee_rows_pack_q6_k(const void * src, void * dst, int64_t k, int64_t m) {
    const int64_t nb = k / 256;
    for (int64_t r0 = 0; r0 < m; r0 += 8) {
        q6_k_rows8 * out = (q6_k_rows8 *) dst + r0 / 8 * nb;
        for (int64_t b = 0; b < nb; ++b) {
            q6_k_rows8 & g = out[b];
            memset(&g, 0, sizeof(g));
            for (int r = 0; r < 8; ++r) {
                const q6_k_block & x = ((const q6_k_block *) src)[(r0 + r) * nb + b];
                g.d[r]               = x.d;
                for (int j = 0; j < 16; ++j) {
                    g.scales[j][r] = x.scales[j];
                }
                // element e = 128 h + 32 i + l (ggml's order): the low 4 bits in ql[64 h + 32 (i % 2) + l], low
                // nibble for i < 2, high for i >= 2; the top 2 bits in qh[32 h + l] at bits 2 i
                for (int e = 0; e < 256; ++e) {
                    const int h = e / 128, i = e % 128 / 32, l = e % 32;
                    const int lo = (x.ql[64 * h + 32 * (i % 2) + l] >> (i >= 2 ? 4 : 0)) & 0x0F;
                    const int up = (x.qh[32 * h + l] >> (2 * i)) & 3;
                    const int q = e / 4, at = 4 * r + e % 4;
                    g.lo[q % 32][at] |= (uint8_t) (lo << (q >= 32 ? 4 : 0));
                    g.hi[q % 16][at] |= (uint8_t) (up << (2 * (q / 16)));
                }
            }
        }
    }
}

// the portable path: the same operations in the same order, one scalar at a time (this file is built with
// -ffp-contract=off; std::fma rounds once as the hardware's FMA does)
static void rows_portable(const specee_tile_args & ta, const specee_rows_args & ra, int nt) {
    for (int r = 0; r < ra.nr; ++r) {
        for (int t = 0; t < nt; ++t) {
            float acc = 0.0f;
            for (int64_t b = 0; b < ta.nb; ++b) {
                const q6_k_rows8 & g = group_of(ra.x[0], b);
                const q8_k_block & y = ((const q8_k_block *) ta.y[t])[b];
                int32_t            sumi = 0, summ = 0;
                for (int j = 0; j < 16; ++j) {
                    int32_t dot = 0;
                    for (int e = 16 * j; e < 16 * j + 16; ++e) {
                        dot += six_bits(g, r, e) * y.qs[e];
                    }
                    sumi += g.scales[j][r] * dot;
                    summ += g.scales[j][r] * y.bsums[j];
                }
                acc = std::fma(ggml_fp16_to_fp32(g.d[r]) * y.d, (float) (sumi - 32 * summ), acc);
            }
            ta.out[t * ta.stride + r] = acc;
        }
    }
}

#ifdef SPECEE_KERNELS_X86

// quads n and n + 32 of the eight rows from lo[n] and hi[n % 16] (n < 32): the low (high) nibbles under their top
// two bits, moved to bits 4-5
SPECEE_AVX2 static inline void rows_quads(const q6_k_rows8 & g, int n, __m256i & a, __m256i & b) {
    const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    const __m256i l   = _mm256_loadu_si256((const __m256i *) g.lo[n]);
    const __m256i h   = _mm256_loadu_si256((const __m256i *) g.hi[n % 16]);
    const bool    up  = n >= 16; // quad n's top bits at 2-3 (else 0-1), quad n + 32's at 6-7 (else 4-5)
    a = _mm256_or_si256(_mm256_and_si256(l, low),
                        _mm256_and_si256(up ? _mm256_slli_epi16(h, 2) : _mm256_slli_epi16(h, 4), top));
    b = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l, 4), low),
                        _mm256_and_si256(up ? _mm256_srli_epi16(h, 2) : h, top));
}

template <int NT>
SPECEE_AVX2 static void rows_avx2(const specee_tile_args & ta, const specee_rows_args & ra) {
    __m256 acc[NT];
    for (int t = 0; t < NT; ++t) {
        acc[t] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < ta.nb; ++b) {
        const q6_k_rows8 & g  = group_of(ra.x[0], b);
        const __m256       dx = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) g.d));
        specee_prefetch(&g + 1, sizeof(g)); // the next group while this one computes, past a row group's end too
        // sc[j]: row r's scale of sub-block j in 16-bit lanes 2r and 2r + 1; pr[p]: row r's scales of sub-blocks 2p
        // and 2p + 1 in lanes 2r and 2r + 1
        __m256i sc[16], pr[8];
        for (int p = 0; p < 8; ++p) {
            const __m256i s  = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) g.scales[2 * p]));
            const __m256i lo = _mm256_unpacklo_epi16(s, s), hi = _mm256_unpackhi_epi16(s, s);
            sc[2 * p]        = _mm256_permute2x128_si256(lo, hi, 0x20);
            sc[2 * p + 1]    = _mm256_permute2x128_si256(lo, hi, 0x31);
            const __m128i a = _mm256_castsi256_si128(s), c = _mm256_extracti128_si256(s, 1);
            pr[p]           = _mm256_set_m128i(_mm_unpackhi_epi16(a, c), _mm_unpacklo_epi16(a, c));
        }
        __m256i sumi[NT];
        for (int t = 0; t < NT; ++t) {
            sumi[t] = _mm256_setzero_si256();
        }
        for (int jj = 0; jj < 8; ++jj) { // sub-blocks jj and jj + 8: quads 4 jj.. and 32 + 4 jj..
            __m256i v[8];
            for (int k = 0; k < 4; ++k) { // built where they are used, once for every token of the tile
                rows_quads(g, 4 * jj + k, v[k], v[4 + k]);
            }
            for (int t = 0; t < NT; ++t) {
                const int8_t * ys = ((const q8_k_block *) ta.y[t])[b].qs;
                for (int h = 0; h < 2; ++h) {
                    const int      j = jj + 8 * h;
                    const int8_t * q = ys + 16 * j;
                    __m256i        s[2];
                    for (int i = 0; i < 2; ++i) { // quads 2i, 2i + 1 of the sub-block: exact in int16
                        int32_t f0, f1;
                        memcpy(&f0, q + 8 * i, sizeof(f0));
                        memcpy(&f1, q + 8 * i + 4, sizeof(f1));
                        s[i] = _mm256_add_epi16(_mm256_maddubs_epi16(v[4 * h + 2 * i], _mm256_set1_epi32(f0)),
                                                _mm256_maddubs_epi16(v[4 * h + 2 * i + 1], _mm256_set1_epi32(f1)));
                    }
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(_mm256_madd_epi16(s[0], sc[j]),
                                                                         _mm256_madd_epi16(s[1], sc[j])));
                }
            }
        }
        for (int t = 0; t < NT; ++t) {
            const q8_k_block & y    = ((const q8_k_block *) ta.y[t])[b];
            const __m256i      bs   = _mm256_loadu_si256((const __m256i *) y.bsums); // 32-bit lane p: sums 2p, 2p + 1
            __m256i            summ = _mm256_setzero_si256();
            for (int p = 0; p < 8; ++p) {
                const __m256i pair = _mm256_permutevar8x32_epi32(bs, _mm256_set1_epi32(p));
                summ               = _mm256_add_epi32(summ, _mm256_madd_epi16(pr[p], pair));
            }
            const __m256i total = _mm256_sub_epi32(sumi[t], _mm256_slli_epi32(summ, 5));
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dx, _mm256_set1_ps(y.d)), _mm256_cvtepi32_ps(total), acc[t]);
        }
    }
    specee_rows_store(acc, NT, ta, ra);
}

static const specee_rows_fn ROWS_Q6_K[8] = {rows_avx2<1>, rows_avx2<2>, rows_avx2<3>, rows_avx2<4>,
                                            rows_avx2<5>, rows_avx2<6>, rows_avx2<7>, rows_avx2<8>};

#endif

void specee_tile_rows_q6_k(const specee_tile_args & ta, const specee_rows_args & ra, int nt, bool simd) {
#ifdef SPECEE_KERNELS_X86
    if (simd) {
        ROWS_Q6_K[nt - 1](ta, ra);
        return;
    }
#endif
    (void) simd;
    rows_portable(ta, ra, nt);
}
