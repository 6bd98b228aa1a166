// specee-tiles-q4_1.cpp: Q4_1 weights times a pass's tokens, eight weight rows at a time (docs/kernels.md).
//
// ggml's vec_dot for Q4_1 keeps eight float lanes per (row, token) and converts and fused-multiply-adds each block's
// eight int32 partial sums into them: per (row, token, block) a byte product, a pairwise sum, a conversion and an
// FMA, two of them on the CPU's two multiply pipes, which bound a pass of several tokens. Here each output element
// has one float accumulator, and per block of 32:
//
//     acc = fma(d_x * d_y, (float) I, acc);  acc = fma(m_x, s_y, acc)
//
// with I the block's exact integer dot product of the weight's nibbles and the token's Q8_1 quants (ggml's
// quantizer), d_x * d_y rounded once as a float product, s_y = d_y * sum(quants) as the Q8_1 block carries it. Every
// float operation is defined per (row, token, block) in block order, so the result does not depend on how many rows
// or tokens share a tile, on the thread that computes it, or on the path (the portable one does the same operations
// one scalar at a time): a token's logits do not depend on its batch. They differ from ggml's in the last bits (the
// order of the sums); plain decoding uses this kernel too, so every mode agrees with it.
//
// The SIMD path puts eight weight rows in the eight lanes: a block's nibbles of eight rows are transposed once per
// tile (four-byte groups: vector g holds elements 4g..4g+3 of the eight rows), and per token each group's four
// quants, broadcast, meet it in one byte product; the eight products are summed in int16 (each pair sum at most
// 2 * 15 * 127, eight of them 30,480 < 2^15: exact), then one pairwise sum to int32 gives each row's I. So per
// (row, token, block) one byte product and an eighth of the rest.
#include "specee-tiles-q4_1.h"

#include <cmath>
#include <cstring>

static const q4_1_block & block_of(const void * row, int64_t b) { return ((const q4_1_block *) row)[b]; }

static const q4_1_rows8 & group_of(const void * rows, int64_t b) { return ((const q4_1_rows8 *) rows)[b]; }

// row r's block b, in either layout
static q4_1_block block_at(const specee_rows_args & ra, int r, int64_t b) {
    if (!ra.packed) {
        return block_of(ra.x[r], b);
    }
    const q4_1_rows8 & g = group_of(ra.x[0], b);
    q4_1_block         x;
    x.d = g.d[r];
    x.m = g.m[r];
    for (int k = 0; k < 4; ++k) {
        memcpy(x.qs + 4 * k, g.w[k] + 4 * r, 4);
    }
    return x;
}

void specee_rows_pack_q4_1(const void * src, void * dst, int64_t k, int64_t m) {
    const int64_t nb = k / 32;
    for (int64_t r0 = 0; r0 < m; r0 += 8) {
        q4_1_rows8 * out = (q4_1_rows8 *) dst + r0 / 8 * nb;
        for (int64_t b = 0; b < nb; ++b) {
            for (int r = 0; r < 8; ++r) {
                const q4_1_block & x = block_of((const q4_1_block *) src + (r0 + r) * nb, b);
                out[b].d[r]          = x.d;
                out[b].m[r]          = x.m;
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
                const q4_1_block xb = block_at(ra, r, b);
                const int8_t *   q  = ((const q8_1_block *) ta.y[t])[b].qs;
                int32_t          dot = 0;
                for (int k = 0; k < 16; ++k) {
                    dot += (xb.qs[k] & 0x0F) * q[k] + (xb.qs[k] >> 4) * q[k + 16];
                }
                const float dd = ggml_fp16_to_fp32(xb.d) * ta.d_y[b * ta.n_pad + t];
                acc            = std::fma(dd, (float) dot, acc);
                acc            = std::fma(ggml_fp16_to_fp32(xb.m), ta.s_y[b * ta.n_pad + t], acc);
            }
            ta.out[t * ta.stride + r] = acc;
        }
    }
}

#ifdef SPECEE_KERNELS_X86

// one token's I for the eight rows: the eight groups' byte products with the token's quants 4g..4g+3 broadcast,
// summed in int16, then pairwise to int32
SPECEE_AVX2 static inline __m256i rows_dot(const __m256i v[8], const int8_t * q) {
    __m256i s = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) {
        int32_t four;
        memcpy(&four, q + 4 * g, sizeof(four));
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(v[g], _mm256_set1_epi32(four)));
    }
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
}

template <int NT, bool PACKED>
SPECEE_AVX2 static void rows_avx2(const specee_tile_args & ta, const specee_rows_args & ra) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    // the d and m halves of the eight rows' headers: d to the low 8 bytes of each 128-bit lane, m to the high
    const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    __m256 acc[NT];
    for (int t = 0; t < NT; ++t) {
        acc[t] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < ta.nb; ++b) {
        __m256 dx, mx;
        __m256i w[4];
        if (PACKED) { // the layout the code below builds, written at load
            const q4_1_rows8 & g = group_of(ra.x[0], b);
            specee_prefetch(&g + SPECEE_ROWS_AHEAD, sizeof(g)); // past a row group's end too (specee-tiles.h)
            dx = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) g.d));
            mx = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) g.m));
            for (int k = 0; k < 4; ++k) {
                w[k] = _mm256_loadu_si256((const __m256i *) g.w[k]);
            }
        } else {
            // the next rows' lines while this tile computes: eight short rows read side by side train the
            // hardware's prefetcher too late (a one-token tile read 4.5 GB/s without this, ggml's vec_dot 6.7)
            for (int r = 0; ra.ahead && r < 8; ++r) {
                _mm_prefetch((const char *) &block_of(ra.x[r], b) + ra.ahead, _MM_HINT_T0);
            }
            int32_t h[8];
            for (int r = 0; r < 8; ++r) {
                memcpy(&h[r], &block_of(ra.x[r], b).d, sizeof(int32_t));
            }
            // lane r: row r's d (fp16) | m << 16; to [d0..d3 m0..m3 | d4..d7 m4..m7], then [d0..d7 | m0..m7]
            const __m256i hdr = _mm256_permute4x64_epi64(
                _mm256_shuffle_epi8(_mm256_setr_epi32(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]), split),
                _MM_SHUFFLE(3, 1, 2, 0));
            dx = _mm256_cvtph_ps(_mm256_castsi256_si128(hdr));
            mx = _mm256_cvtph_ps(_mm256_extracti128_si256(hdr, 1));
            // w[k] lane r = row r's bytes 4k..4k+3 (specee_rows_nibbles)
            const uint8_t * qs[8];
            for (int r = 0; r < 8; ++r) {
                qs[r] = block_of(ra.x[r], b).qs;
            }
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
            const __m256 dot = _mm256_cvtepi32_ps(rows_dot(v, ((const q8_1_block *) ta.y[t])[b].qs));
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dx, _mm256_broadcast_ss(d_y + t)), dot, acc[t]);
            acc[t] = _mm256_fmadd_ps(mx, _mm256_broadcast_ss(s_y + t), acc[t]);
        }
    }
    specee_rows_store(acc, NT, ta, ra);
}

static const specee_rows_fn ROWS_Q4_1[2][8] = {
    {rows_avx2<1, false>, rows_avx2<2, false>, rows_avx2<3, false>, rows_avx2<4, false>, rows_avx2<5, false>,
     rows_avx2<6, false>, rows_avx2<7, false>, rows_avx2<8, false>},
    {rows_avx2<1, true>, rows_avx2<2, true>, rows_avx2<3, true>, rows_avx2<4, true>, rows_avx2<5, true>,
     rows_avx2<6, true>, rows_avx2<7, true>, rows_avx2<8, true>}};

#endif

void specee_tile_rows_q4_1(const specee_tile_args & ta, const specee_rows_args & ra, int nt, bool simd) {
#ifdef SPECEE_KERNELS_X86
    if (simd) {
        ROWS_Q4_1[ra.packed][nt - 1](ta, ra);
        return;
    }
#endif
    (void) simd;
    rows_portable(ta, ra, nt);
}
