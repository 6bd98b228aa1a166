// specee-tiles-k.cpp: the tiles of the K-quants, weights in super-blocks of 256 (Q4_K, Q5_K, Q6_K; docs/kernels.md).
//
// ggml 0.20.2 on x86 multiplies these by n tokens as n separate vec_dots per weight row (it repacks Q4_K on AVX2,
// but the tile's caller keeps Q4_K in the file's layout: specee-placement.cpp). Each vec_dot sums a super-block in
// exact integers (eight int32 lanes of the sub-blocks' scales times byte dot products) and converts them once per
// super-block: one FMA with d_y*d_x per lane, the mins' term likewise; a tile unpacks the super-block and its scales
// once for every token and then runs that integer and float arithmetic per token, so the results are ggml's bit for
// bit (tests/test_kernels.py compares them for every row count).
#include "specee-tiles-k.h"

#include <cmath>
#include <cstring>
#include <type_traits>

// Q6_K (ggml's AVX2 ggml_vec_dot_q6_K_q8_K): per super-block, eight exact int32 lanes, lane j the sum over its
// eight groups of 32 of the group's sub-block scale times the products of elements 4j..4j+3 of the group (q in 0..63,
// maddubs + madd with the scales), minus 32 times the scale-weighted sums of two 16-element sub-blocks (the -32 of
// every q, from the activations' block sums); each lane converted and fused-multiply-added with d_y*d_x into its own
// accumulator, summed at the end as hsum_float_8
static void q6_k_unpack(const q6_k_block & xb, uint8_t q[256]) {
    for (int h = 0; h < 2; ++h) {
        const uint8_t * ql = xb.ql + 64 * h;
        const uint8_t * qh = xb.qh + 32 * h;
        uint8_t *       o  = q + 128 * h;
        for (int l = 0; l < 32; ++l) {
            o[l]      = (uint8_t) ((ql[l] & 0x0F) | ((qh[l] & 0x03) << 4));
            o[l + 32] = (uint8_t) ((ql[l + 32] & 0x0F) | ((qh[l] & 0x0C) << 2));
            o[l + 64] = (uint8_t) ((ql[l] >> 4) | (qh[l] & 0x30));
            o[l + 96] = (uint8_t) ((ql[l + 32] >> 4) | ((qh[l] & 0xC0) >> 2));
        }
    }
}

static void tile_portable_q6_k(const specee_tile_args & ta, int nt) {
    float acc[8][8] = {};
    for (int64_t b = 0; b < ta.nb; ++b) {
        const q6_k_block & xb = ((const q6_k_block *) ta.x)[b];
        uint8_t            q[256];
        q6_k_unpack(xb, q);
        const float dx = ggml_fp16_to_fp32(xb.d);
        for (int t = 0; t < nt; ++t) {
            const q8_k_block & yb = ((const q8_k_block *) ta.y[t])[b];
            const float        d  = yb.d * dx;
            for (int j = 0; j < 8; ++j) {
                int32_t lane = 0;
                for (int g = 0; g < 8; ++g) {
                    const int e  = 32 * g + 4 * j;
                    const int sc = xb.scales[2 * g + (j >= 4)];
                    lane += sc * (q[e] * yb.qs[e] + q[e + 1] * yb.qs[e + 1] + q[e + 2] * yb.qs[e + 2] +
                                  q[e + 3] * yb.qs[e + 3]);
                }
                lane -= 32 * (yb.bsums[2 * j] * xb.scales[2 * j] + yb.bsums[2 * j + 1] * xb.scales[2 * j + 1]);
                acc[t][j] = std::fma(d, (float) lane, acc[t][j]);
            }
        }
    }
    for (int t = 0; t < nt; ++t) {
        const float * a = acc[t];
        ta.out[t * ta.stride] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    }
}

// Q4_K (ggml's AVX2 ggml_vec_dot_q4_K_q8_K): per super-block, eight exact int32 lanes, lane j the sum over the eight
// sub-blocks of the sub-block's scale times the products of its elements 4j..4j+3, converted and fused-multiply-added
// with d_y*d_x into the lane's accumulator; the mins in four lanes, lane i the exact min[2i] * sum(y of sub-block 2i)
// + the same for 2i + 1, fused-multiply-added with (-d_y)*dmin_x; at the end hsum_float_8 of the eight, plus
// (m0 + m2) + (m1 + m3).
// Q5_K (ggml_vec_dot_q5_K_q8_K): the same eight lanes of 5-bit quants; the mins' four lanes summed to one exact
// integer per super-block and fused-multiply-added with (-d_y)*dmin_x into a scalar (the compiler contracts ggml's
// summs += dmin * sum, checked in its disassembly); at the end hsum_float_8 plus that scalar.
// Both unpack a super-block to its 256 quants in element order: sub-block s is elements 32 s .. 32 s + 31
template <bool FIVE> static void tile_portable_q45_k(const specee_tile_args & ta, int nt) {
    using block       = typename std::conditional<FIVE, q5_k_block, q4_k_block>::type;
    float acc[8][8]   = {};
    float accm[8][4]  = {};
    float summs[8]    = {};
    for (int64_t b = 0; b < ta.nb; ++b) {
        const block & xb = ((const block *) ta.x)[b];
        int32_t       sc[8], mn[8];
        specee_k_scales(xb.scales, sc, mn);
        uint8_t q[256];
        for (int j = 0; j < 4; ++j) {
            for (int l = 0; l < 32; ++l) {
                const int v      = xb.qs[32 * j + l];
                q[64 * j + l]      = (uint8_t) (v & 0x0F);
                q[64 * j + 32 + l] = (uint8_t) (v >> 4);
                if (FIVE) {
                    const uint8_t * qh = ((const q5_k_block &) xb).qh;
                    q[64 * j + l] |= (uint8_t) (((qh[l] >> (2 * j)) & 1) << 4);
                    q[64 * j + 32 + l] |= (uint8_t) (((qh[l] >> (2 * j + 1)) & 1) << 4);
                }
            }
        }
        const float dx = ggml_fp16_to_fp32(xb.d), mx = ggml_fp16_to_fp32(xb.dmin);
        for (int t = 0; t < nt; ++t) {
            const q8_k_block & yb = ((const q8_k_block *) ta.y[t])[b];
            const float        d  = yb.d * dx;
            const float        dm = -yb.d * mx;
            for (int l = 0; l < 8; ++l) {
                int32_t lane = 0;
                for (int s = 0; s < 8; ++s) {
                    const int e   = 32 * s + 4 * l;
                    int32_t   dot = 0;
                    for (int i = 0; i < 4; ++i) {
                        dot += q[e + i] * yb.qs[e + i];
                    }
                    lane += sc[s] * dot;
                }
                acc[t][l] = std::fma(d, (float) lane, acc[t][l]);
            }
            int32_t m[4];
            for (int i = 0; i < 4; ++i) {
                m[i] = mn[2 * i] * (yb.bsums[4 * i] + yb.bsums[4 * i + 1]) +
                       mn[2 * i + 1] * (yb.bsums[4 * i + 2] + yb.bsums[4 * i + 3]);
                accm[t][i] = std::fma(dm, (float) m[i], accm[t][i]);
            }
            summs[t] = std::fma(dm, (float) ((m[0] + m[1]) + (m[2] + m[3])), summs[t]);
        }
    }
    for (int t = 0; t < nt; ++t) {
        const float * a   = acc[t];
        const float * am  = accm[t];
        const float   sum = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
        ta.out[t * ta.stride] = sum + (FIVE ? summs[t] : (am[0] + am[2]) + (am[1] + am[3]));
    }
}

#ifdef SPECEE_KERNELS_X86

// Q4_K's and Q5_K's eight exact int32 lanes of a super-block for one token: the unpacked quants q (low and high half
// of each 64 elements) times the token's bytes, each 32 weighted by its sub-block's scale (sc, broadcast to 16 bits)
SPECEE_AVX2 static inline __m256i k_lanes(const __m256i * q, const __m256i * sc, const q8_k_block & yb) {
    __m256i sumi = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
        const __m256i yl = _mm256_loadu_si256((const __m256i *) (yb.qs + 64 * j));
        const __m256i yh = _mm256_loadu_si256((const __m256i *) (yb.qs + 64 * j + 32));
        const __m256i pl = _mm256_madd_epi16(_mm256_load_si256(sc + 2 * j),
                                             _mm256_maddubs_epi16(_mm256_load_si256(q + 2 * j), yl));
        const __m256i ph = _mm256_madd_epi16(_mm256_load_si256(sc + 2 * j + 1),
                                             _mm256_maddubs_epi16(_mm256_load_si256(q + 2 * j + 1), yh));
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
    }
    return sumi;
}

// their mins' four exact lanes: lane i = min[2i] * (the token's sum of sub-block 2i) + the same for 2i + 1
SPECEE_AVX2 static inline __m128i k_mins(__m128i mins, const q8_k_block & yb) {
    const __m256i bsums = _mm256_loadu_si256((const __m256i *) yb.bsums);
    return _mm_madd_epi16(mins, _mm_hadd_epi16(_mm256_castsi256_si128(bsums), _mm256_extracti128_si256(bsums, 1)));
}

// a super-block's scales broadcast to 16-bit lanes (sc[8]) and its mins in one vector: specee_k_scales four bytes at
// a time (scales 0-3 and mins 0-3 the low 6 bits of bytes 0-3 and 4-7; scales and mins 4-7 the low and high nibbles
// of bytes 8-11 under the top 2 bits of bytes 0-3 and 4-7), widened to 16 bits, each scale then broadcast by a shuffle
SPECEE_AVX2 static inline __m128i k_scale_vectors(const uint8_t * scales, __m256i * sc) {
    uint32_t w[3];
    memcpy(w, scales, sizeof(w));
    const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, low2 = 0x03030303u;
    const uint32_t sc03 = w[0] & low6, mn03 = w[1] & low6;
    const uint32_t sc47 = (w[2] & low4) | (((w[0] >> 6) & low2) << 4);
    const uint32_t mn47 = ((w[2] >> 4) & low4) | (((w[1] >> 6) & low2) << 4);
    // 16-bit lanes: scales 0-7, then mins 0-7
    const __m256i v16 = _mm256_cvtepu8_epi16(_mm_setr_epi32((int) sc03, (int) sc47, (int) mn03, (int) mn47));
    const __m256i scs = _mm256_permute2x128_si256(v16, v16, 0x00); // the scales in both halves
    for (int j = 0; j < 8; ++j) {
        sc[j] = _mm256_shuffle_epi8(scs, _mm256_set1_epi16((int16_t) (((2 * j + 1) << 8) | (2 * j))));
    }
    return _mm256_extracti128_si256(v16, 1);
}

// Q4_K: a super-block's nibbles split once (low and high of each 64 elements) and its scales broadcast to 16-bit
// lanes, kept on the stack for every token's step; per token ggml's integer lanes, the mins' four lanes, two FMAs
SPECEE_AVX2 static inline void token_step_q4_k(__m256 & acc, __m128 & accm, const __m256i * q, const __m256i * sc,
                                               __m128i mins, const void * y, int64_t b, float dx, float mx) {
    const q8_k_block & yb   = ((const q8_k_block *) y)[b];
    const __m256i      sumi = k_lanes(q, sc, yb);
    const __m128i prod = k_mins(mins, yb);
    acc  = _mm256_fmadd_ps(_mm256_set1_ps(yb.d * dx), _mm256_cvtepi32_ps(sumi), acc);
    accm = _mm_fmadd_ps(_mm_set1_ps(-yb.d * mx), _mm_cvtepi32_ps(prod), accm);
}

template <int NT>
SPECEE_AVX2 static void tile_avx2_q4_k(const specee_tile_args & ta) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256        a[8];
    __m128        m[8];
    for (int t = 0; t < NT; ++t) {
        a[t] = _mm256_setzero_ps();
        m[t] = _mm_setzero_ps();
    }
    alignas(32) __m256i q[8], sc[8];
    for (int64_t b = 0; b < ta.nb; ++b) {
        const q4_k_block & xb = ((const q4_k_block *) ta.x)[b];
        for (int j = 0; j < 4; ++j) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *) (xb.qs + 32 * j));
            q[2 * j]          = _mm256_and_si256(raw, low);
            q[2 * j + 1]      = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        }
        const __m128i mins = k_scale_vectors(xb.scales, sc);
        const float dx = _cvtsh_ss(xb.d), mx = _cvtsh_ss(xb.dmin);
        for (int t = 0; t < NT; ++t) {
            token_step_q4_k(a[t], m[t], q, sc, mins, ta.y[t], b, dx, mx);
        }
    }
    for (int t = 0; t < NT; ++t) {
        __m128 r = _mm_add_ps(m[t], _mm_movehl_ps(m[t], m[t]));
        r        = _mm_add_ss(r, _mm_movehdup_ps(r));
        ta.out[t * ta.stride] = specee_hsum_8(a[t]) + _mm_cvtss_f32(r);
    }
}

// Q5_K: Q4_K's tile with the fifth bit added at the unpacking, and the mins summed to one integer per token
SPECEE_AVX2 static inline void token_step_q5_k(__m256 & acc, float & summs, const __m256i * q, const __m256i * sc,
                                               __m128i mins, const void * y, int64_t b, float dx, float mx) {
    const q8_k_block & yb   = ((const q8_k_block *) y)[b];
    const __m256i      sumi = k_lanes(q, sc, yb);
    __m128i prod = k_mins(mins, yb);
    prod         = _mm_hadd_epi32(prod, prod);
    prod         = _mm_hadd_epi32(prod, prod);
    acc   = _mm256_fmadd_ps(_mm256_set1_ps(yb.d * dx), _mm256_cvtepi32_ps(sumi), acc);
    summs = std::fma(-yb.d * mx, (float) _mm_cvtsi128_si32(prod), summs);
}

template <int NT>
SPECEE_AVX2 static void tile_avx2_q5_k(const specee_tile_args & ta) {
    const __m256i low = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    __m256        a[8];
    float         summs[8] = {};
    for (int t = 0; t < NT; ++t) {
        a[t] = _mm256_setzero_ps();
    }
    alignas(32) __m256i q[8], sc[8];
    for (int64_t b = 0; b < ta.nb; ++b) {
        const q5_k_block & xb = ((const q5_k_block *) ta.x)[b];
        const __m256i      hb = _mm256_loadu_si256((const __m256i *) xb.qh);
        for (int j = 0; j < 4; ++j) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *) (xb.qs + 32 * j));
            const __m256i h0  = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * j), one);     // bit 2 j of each byte
            const __m256i h1  = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * j + 1), one); // bit 2 j + 1
            q[2 * j]     = _mm256_or_si256(_mm256_and_si256(raw, low), _mm256_slli_epi16(h0, 4));
            q[2 * j + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), _mm256_slli_epi16(h1, 4));
        }
        const __m128i mins = k_scale_vectors(xb.scales, sc);
        const float dx = _cvtsh_ss(xb.d), mx = _cvtsh_ss(xb.dmin);
        for (int t = 0; t < NT; ++t) {
            token_step_q5_k(a[t], summs[t], q, sc, mins, ta.y[t], b, dx, mx);
        }
    }
    for (int t = 0; t < NT; ++t) {
        ta.out[t * ta.stride] = specee_hsum_8(a[t]) + summs[t];
    }
}

// Q6_K: a super-block unpacked once (its 256 q in 0..63 and each group's scales widened to 16 bits, kept on the
// stack where every token's step reads them), then per token ggml's integer lanes and one FMA a super-block
SPECEE_AVX2 static inline __m256 token_step_q6_k(__m256 acc, const __m256i * q, const __m256i * sc, __m256i sc16,
                                                 const void * y, int64_t b, __m256 dx) {
    const q8_k_block & yb   = ((const q8_k_block *) y)[b];
    __m256i            sumi = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) {
        const __m256i qy = _mm256_loadu_si256((const __m256i *) (yb.qs + 32 * g));
        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_load_si256(sc + g),
                                                        _mm256_maddubs_epi16(_mm256_load_si256(q + g), qy)));
    }
    const __m256i bsums = _mm256_loadu_si256((const __m256i *) yb.bsums);
    sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(_mm256_madd_epi16(bsums, sc16), 5));
    const __m256 d = _mm256_mul_ps(_mm256_set1_ps(yb.d), dx);
    return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
}

template <int NT>
SPECEE_AVX2 static void tile_avx2_q6_k(const specee_tile_args & ta) {
    const __m256i m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
    __m256        a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    alignas(32) __m256i q[8], sc[8];
    for (int64_t b = 0; b < ta.nb; ++b) {
        const q6_k_block & xb = ((const q6_k_block *) ta.x)[b];
        for (int h = 0; h < 2; ++h) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *) (xb.ql + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *) (xb.ql + 64 * h + 32));
            const __m256i hi = _mm256_loadu_si256((const __m256i *) (xb.qh + 32 * h));
            q[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, m15), _mm256_slli_epi16(_mm256_and_si256(hi, m3), 4));
            q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m15),
                                           _mm256_slli_epi16(_mm256_and_si256(hi, _mm256_set1_epi8(12)), 2));
            q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m15),
                                           _mm256_and_si256(hi, _mm256_set1_epi8(48)));
            q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m15),
                                           _mm256_srli_epi16(_mm256_and_si256(hi, _mm256_set1_epi8(-64)), 2));
        }
        // group g: its first 16 elements (16-bit lanes 0..7) take scale 2g, the last 16 scale 2g + 1
        for (int g = 0; g < 8; ++g) {
            const __m128i lo = _mm_set1_epi16(xb.scales[2 * g]);
            const __m128i up = _mm_set1_epi16(xb.scales[2 * g + 1]);
            sc[g] = _mm256_set_m128i(up, lo);
        }
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) xb.scales));
        const __m256  dx   = _mm256_set1_ps(_cvtsh_ss(xb.d));
        a0 = token_step_q6_k(a0, q, sc, sc16, ta.y[0], b, dx);
        if (NT > 1) a1 = token_step_q6_k(a1, q, sc, sc16, ta.y[1], b, dx);
        if (NT > 2) a2 = token_step_q6_k(a2, q, sc, sc16, ta.y[2], b, dx);
        if (NT > 3) a3 = token_step_q6_k(a3, q, sc, sc16, ta.y[3], b, dx);
        if (NT > 4) a4 = token_step_q6_k(a4, q, sc, sc16, ta.y[4], b, dx);
        if (NT > 5) a5 = token_step_q6_k(a5, q, sc, sc16, ta.y[5], b, dx);
        if (NT > 6) a6 = token_step_q6_k(a6, q, sc, sc16, ta.y[6], b, dx);
        if (NT > 7) a7 = token_step_q6_k(a7, q, sc, sc16, ta.y[7], b, dx);
    }
    const __m256 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    for (int t = 0; t < NT; ++t) {
        ta.out[t * ta.stride] = specee_hsum_8(acc[t]);
    }
}

using tile_fn = void (*)(const specee_tile_args &);
static const tile_fn TILES_Q4_K[8] = {tile_avx2_q4_k<1>, tile_avx2_q4_k<2>, tile_avx2_q4_k<3>, tile_avx2_q4_k<4>,
                                      tile_avx2_q4_k<5>, tile_avx2_q4_k<6>, tile_avx2_q4_k<7>, tile_avx2_q4_k<8>};
static const tile_fn TILES_Q5_K[8] = {tile_avx2_q5_k<1>, tile_avx2_q5_k<2>, tile_avx2_q5_k<3>, tile_avx2_q5_k<4>,
                                      tile_avx2_q5_k<5>, tile_avx2_q5_k<6>, tile_avx2_q5_k<7>, tile_avx2_q5_k<8>};
static const tile_fn TILES_Q6_K[8] = {tile_avx2_q6_k<1>, tile_avx2_q6_k<2>, tile_avx2_q6_k<3>, tile_avx2_q6_k<4>,
                                      tile_avx2_q6_k<5>, tile_avx2_q6_k<6>, tile_avx2_q6_k<7>, tile_avx2_q6_k<8>};

#endif

void specee_tile_k(const specee_tile_args & ta, int nt, ggml_type w, bool simd) {
#ifdef SPECEE_KERNELS_X86
    if (simd) {
        (w == GGML_TYPE_Q4_K ? TILES_Q4_K : w == GGML_TYPE_Q5_K ? TILES_Q5_K : TILES_Q6_K)[nt - 1](ta);
        return;
    }
#endif
    (void) simd;
    if (w == GGML_TYPE_Q4_K) {
        tile_portable_q45_k<false>(ta, nt);
    } else if (w == GGML_TYPE_Q5_K) {
        tile_portable_q45_k<true>(ta, nt);
    } else {
        tile_portable_q6_k(ta, nt);
    }
}
