// specee-tiles-q4_0.cpp: Q4_0 weights times a pass's tokens, eight weight rows at a time, in the loader's eight-row
// layout (docs/kernels.md).
//
// ggml repacks Q4_0 into eight interleaved rows on AVX2 and multiplies one token with a GEMV and four or more with a
// GEMM whose results are the GEMV's bit for bit: per (row, token, block) of 32
//
//     acc = fma((float) I, d_x * d_y, acc)
//
// with I the exact integer dot product of the signed weights (nibble - 8) and the token's Q8_0 quants, blocks in
// order from 0. Two or three tokens (a verification of one or two drafts) run the GEMV once per token, each reading
// every weight again. This tile does the same operations, so its results are ggml's (and upstream's) bits for every
// row count, with the weights read once per tile: I = (the nibbles' dot product) - 8 * (the quants' sum), both exact
// integers (the sum kept by the quantizer), their difference exact in float (|I| < 2^24). Eight rows sit in the eight
// lanes as in Q4_1's tile (specee-tiles-q4_1.cpp): per token eight byte products summed in int16 (at most
// 8 * 2 * 15 * 127 = 30,480), one pairwise sum to int32. Matrices the loader leaves in the file's layout (a tied
// embedding, which its row lookups read, or rows not a multiple of 8) take the same tile, their eight rows' blocks
// transposed as it goes, as upstream repacks such an lm_head for its GEMV.
#include "specee-tiles-q4_0.h"

#include <cmath>
#include <cstring>

struct q4_0_block {
    uint16_t d;      // scale (fp16)
    uint8_t  qs[16]; // element k < 16: low nibble of qs[k]; k >= 16: high nibble of qs[k - 16]; value nibble - 8
};
static_assert(sizeof(q4_0_block) == 18, "block_q4_0 is 18 bytes");

static const q4_0_rows8 & group_of(const void * rows, int64_t b) { return ((const q4_0_rows8 *) rows)[b]; }

static const q4_0_block & block_of(const void * row, int64_t b) { return ((const q4_0_block *) row)[b]; }

// row r's d and byte k (elements k and 16 + k) of block b, in either layout
static uint16_t d_at(const specee_rows_args & ra, int r, int64_t b) {
    return ra.packed ? group_of(ra.x[0], b).d[r] : block_of(ra.x[r], b).d;
}

static uint8_t byte_at(const specee_rows_args & ra, int r, int64_t b, int k) {
    return ra.packed ? group_of(ra.x[0], b).w[k / 4][4 * r + k % 4] : block_of(ra.x[r], b).qs[k];
}

void specee_rows_pack_q4_0(const void * src, void * dst, int64_t k, int64_t m) {
    const int64_t nb = k / 32;
    for (int64_t r0 = 0; r0 < m; r0 += 8) {
        q4_0_rows8 * out = (q4_0_rows8 *) dst + r0 / 8 * nb;
        for (int64_t b = 0; b < nb; ++b) {
            for (int r = 0; r < 8; ++r) {
                const q4_0_block & x = ((const q4_0_block *) src)[(r0 + r) * nb + b];
                out[b].d[r]          = x.d;
                for (int q = 0; q < 4; ++q) {
                    memcpy(out[b].w[q] + 4 * r, x.qs + 4 * q, 4);
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
                const int8_t * q   = ((const q8_0_block *) ta.y[t])[b].qs;
                int32_t        dot = 0;
                for (int k = 0; k < 16; ++k) {
                    const uint8_t v = byte_at(ra, r, b, k);
                    dot += ((v & 0x0F) - 8) * q[k] + ((v >> 4) - 8) * q[k + 16];
                }
                const float dd = ggml_fp16_to_fp32(d_at(ra, r, b)) * ta.d_y[b * ta.n_pad + t];
                acc            = std::fma((float) dot, dd, acc);
            }
            ta.out[t * ta.stride + r] = acc;
        }
    }
}

#ifdef SPECEE_KERNELS_X86

template <int NT, bool PACKED>
SPECEE_AVX2 static void rows_avx2(const specee_tile_args & ta, const specee_rows_args & ra) {
    const __m256i low   = _mm256_set1_epi8(0x0F);
    const __m256i ones  = _mm256_set1_epi16(1);
    const __m256  eight = _mm256_set1_ps(8.0f);
    __m256        acc[NT];
    for (int t = 0; t < NT; ++t) {
        acc[t] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < ta.nb; ++b) {
        __m256  dx;
        __m256i w[4];
        if (PACKED) {
            const q4_0_rows8 & g = group_of(ra.x[0], b);
            dx                   = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) g.d));
            specee_prefetch(&g + SPECEE_ROWS_AHEAD, sizeof(g)); // past a row group's end too (specee-tiles.h)
            for (int k = 0; k < 4; ++k) {
                w[k] = _mm256_loadu_si256((const __m256i *) g.w[k]);
            }
        } else { // the file's layout, transposed as it goes (specee_rows_nibbles)
            for (int r = 0; ra.ahead && r < 8; ++r) {
                _mm_prefetch((const char *) &block_of(ra.x[r], b) + ra.ahead, _MM_HINT_T0);
            }
            uint16_t        h[8];
            const uint8_t * qs[8];
            for (int r = 0; r < 8; ++r) {
                h[r]  = block_of(ra.x[r], b).d;
                qs[r] = block_of(ra.x[r], b).qs;
            }
            dx = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) h));
            specee_rows_nibbles(qs, w);
        }
        __m256i v[8];
        for (int k = 0; k < 4; ++k) {
            v[k]     = _mm256_and_si256(w[k], low);
            v[k + 4] = _mm256_and_si256(_mm256_srli_epi16(w[k], 4), low);
        }
        const float * d_y = ta.d_y + b * ta.n_pad;
        const float * s_y = ta.s_y + b * ta.n_pad;
        for (int t = 0; t < NT; ++t) {
            const int8_t * q = ((const q8_0_block *) ta.y[t])[b].qs;
            __m256i        s = _mm256_setzero_si256();
            for (int k = 0; k < 8; ++k) {
                int32_t four;
                memcpy(&four, q + 4 * k, sizeof(four));
                s = _mm256_add_epi16(s, _mm256_maddubs_epi16(v[k], _mm256_set1_epi32(four)));
            }
            // the nibbles' dot minus 8 times the quants' sum: exact (8 * sum exact, the difference below 2^24)
            const __m256 dot = _mm256_fnmadd_ps(eight, _mm256_broadcast_ss(s_y + t),
                                                _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones)));
            acc[t] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dx, _mm256_broadcast_ss(d_y + t)), acc[t]);
        }
    }
    specee_rows_store(acc, NT, ta, ra);
}

static const specee_rows_fn ROWS_Q4_0[2][8] = {
    {rows_avx2<1, false>, rows_avx2<2, false>, rows_avx2<3, false>, rows_avx2<4, false>, rows_avx2<5, false>,
     rows_avx2<6, false>, rows_avx2<7, false>, rows_avx2<8, false>},
    {rows_avx2<1, true>, rows_avx2<2, true>, rows_avx2<3, true>, rows_avx2<4, true>, rows_avx2<5, true>,
     rows_avx2<6, true>, rows_avx2<7, true>, rows_avx2<8, true>}};

#endif

void specee_tile_rows_q4_0(const specee_tile_args & ta, const specee_rows_args & ra, int nt, bool simd) {
#ifdef SPECEE_KERNELS_X86
    if (simd) {
        ROWS_Q4_0[ra.packed][nt - 1](ta, ra);
        return;
    }
#endif
    (void) simd;
    rows_portable(ta, ra, nt);
}
