// specee-tiles-q8_0.cpp: the tile of Q8_0 weights (blocks of 32; docs/kernels.md).
//
// A Q4_1 file's token embeddings and tied lm_head, every matrix of a Q8_0 file: ggml computes one token with
// ggml_vec_dot_q8_0_q8_0 and 2 or more with llamafile's tinyBLAS, whose 4x3 tiles re-derive each block's signs and
// scales per (row, token) pair. The tile reproduces the one-token vec_dot (ggml-cpu/arch/x86/quants.c, AVX2 build,
// checked against its disassembly) for every row count: per block the eight exact int32 lanes of |x| times sign(y, x)
// (maddubs + madd), converted and fused-multiply-added with d_x*d_y into the block's accumulator; at the end the lanes
// summed as ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)). |x| is taken once per block for all the tokens, so the results
// equal ggml's for every number of tokens, bit for bit, and a token's logits do not depend on its batch.
#include "specee-tiles-q8_0.h"

#include <cmath>
#include <cstring>

// the portable path: the same operations in the same order as the SIMD one (and ggml's AVX2 vec_dot), one scalar at
// a time; std::fma rounds once as the hardware's FMA does (this file is built with -ffp-contract=off)
// Q8_0: lane j of a block = the exact sum of the products of elements 4j..4j+3 (what maddubs + madd give from |x|
// and sign(y, x): no int16 overflow with ggml's quants in [-127, 127], even a weight of -128), no min term
static void tile_portable_q8_0(const specee_tile_args & ta, int nt) {
    float acc[8][8] = {};
    for (int64_t b = 0; b < ta.nb; ++b) {
        const q8_0_block & xb = ((const q8_0_block *) ta.x)[b];
        const float        dx = ggml_fp16_to_fp32(xb.d);
        for (int t = 0; t < nt; ++t) {
            const int8_t * r  = ((const q8_0_block *) ta.y[t])[b].qs;
            const float    dd = dx * ta.d_y[b * ta.n_pad + t];
            for (int j = 0; j < 8; ++j) {
                const int8_t * q    = xb.qs + 4 * j;
                const int32_t  lane = q[0] * r[4 * j] + q[1] * r[4 * j + 1] + q[2] * r[4 * j + 2] + q[3] * r[4 * j + 3];
                acc[t][j]           = std::fma(dd, (float) lane, acc[t][j]);
            }
        }
    }
    for (int t = 0; t < nt; ++t) {
        const float * a = acc[t];
        ta.out[t * ta.stride] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    }
}

#ifdef SPECEE_KERNELS_X86

// lane t of v in every lane (the tokens' d_x*d_y kept in a register: a store and reloads of single lanes stalled on
// store forwarding, measured in the 2-token tile)
template <int T> SPECEE_AVX2 static inline __m256 lane(__m256 v) {
    return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(T));
}

// Q8_0, one token's step of a block: acc += (d_x*d_y) * the 8 lanes of |x| . sign(y, x) (ggml's
// mul_sum_i8_pairs_float); ax = |x| is computed once per block for all the tokens
SPECEE_AVX2 static inline __m256 token_step_q8_0(__m256 acc, __m256i qx, __m256i ax, const void * y, int64_t b,
                                                 __m256 dd) {
    const __m256i qy  = _mm256_loadu_si256((const __m256i *) ((const q8_0_block *) y)[b].qs);
    const __m256i sy  = _mm256_sign_epi8(qy, qx);
    const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1));
    return _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(dot), acc);
}

template <int NT>
SPECEE_AVX2 static void tile_avx2_q8_0(const specee_tile_args & ta) {
    __m256        a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const float * d_y = ta.d_y;
    for (int64_t b = 0; b < ta.nb; ++b, d_y += ta.n_pad) {
        const q8_0_block & xb = ((const q8_0_block *) ta.x)[b];
        const __m256i      qx = _mm256_loadu_si256((const __m256i *) xb.qs);
        const __m256i      ax = _mm256_sign_epi8(qx, qx);
        const __m256       dd = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(xb.d)), _mm256_loadu_ps(d_y));
        a0 = token_step_q8_0(a0, qx, ax, ta.y[0], b, lane<0>(dd));
        if (NT > 1) a1 = token_step_q8_0(a1, qx, ax, ta.y[1], b, lane<1>(dd));
        if (NT > 2) a2 = token_step_q8_0(a2, qx, ax, ta.y[2], b, lane<2>(dd));
        if (NT > 3) a3 = token_step_q8_0(a3, qx, ax, ta.y[3], b, lane<3>(dd));
        if (NT > 4) a4 = token_step_q8_0(a4, qx, ax, ta.y[4], b, lane<4>(dd));
        if (NT > 5) a5 = token_step_q8_0(a5, qx, ax, ta.y[5], b, lane<5>(dd));
        if (NT > 6) a6 = token_step_q8_0(a6, qx, ax, ta.y[6], b, lane<6>(dd));
        if (NT > 7) a7 = token_step_q8_0(a7, qx, ax, ta.y[7], b, lane<7>(dd));
    }
    const __m256 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    for (int t = 0; t < NT; ++t) {
        ta.out[t * ta.stride] = specee_hsum_8(acc[t]);
    }
}

using tile_fn = void (*)(const specee_tile_args &);
static const tile_fn TILES_Q8_0[8] = {tile_avx2_q8_0<1>, tile_avx2_q8_0<2>, tile_avx2_q8_0<3>, tile_avx2_q8_0<4>,
                                      tile_avx2_q8_0<5>, tile_avx2_q8_0<6>, tile_avx2_q8_0<7>, tile_avx2_q8_0<8>};

#endif

void specee_tile_q8_0(const specee_tile_args & ta, int nt, bool simd) {
#ifdef SPECEE_KERNELS_X86
    if (simd) {
        TILES_Q8_0[nt - 1](ta);
        return;
    }
#endif
    (void) simd;
    tile_portable_q8_0(ta, nt);
}
