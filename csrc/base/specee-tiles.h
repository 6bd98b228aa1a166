// specee-tiles.h: what the tiles share: ggml's block layouts, a tile's arguments, the AVX2 helpers. A tile multiplies
// weight rows by up to 8 token rows of quantized activations, the weight's block unpacked once for all the tokens:
// for Q8_0 and the K-quants one row with the arithmetic of ggml's x86 vec_dot for the type (AVX2 build), for Q4_1
// eight rows with this runtime's own accumulation; a portable path does the same operations one scalar at a time
// (docs/kernels.md). Q8_0: specee-tiles-q8_0.h; Q4_1: specee-tiles-q4_1.h; super-blocks of 256: specee-tiles-k.h;
// the matmul op (specee-kernels.cpp) runs them on ggml's threads.
#pragma once

#include "ggml.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECEE_KERNELS_X86 1
#endif

// ---- ggml's block layouts (ggml-common.h; sizes checked against ggml_type_size at run time)

struct q4_1_block {
    uint16_t d;      // scale (fp16)
    uint16_t m;      // min (fp16)
    uint8_t  qs[16]; // element k < 16: low nibble of qs[k]; k >= 16: high nibble of qs[k - 16]
};

struct q8_1_block {
    uint16_t d;      // scale (fp16)
    uint16_t s;      // d * sum(qs) (fp16)
    int8_t   qs[32];
};

struct q8_0_block {
    uint16_t d;      // scale (fp16)
    int8_t   qs[32];
};

// a super-block of 256: eight sub-blocks of 32, each with a 6-bit scale and min (packed in 12 bytes); element
// d * scale * q - dmin * min with q the 4 bits
struct q4_k_block {
    uint16_t d;          // super-block scale for the scales (fp16)
    uint16_t dmin;       // super-block scale for the mins (fp16)
    uint8_t  scales[12]; // sub-block j < 4: scale scales[j] & 63, min scales[j + 4] & 63; j >= 4: the low nibbles
                         // of scales[j + 4] (scale) and its high nibbles (min), their top bits those of j - 4
    uint8_t  qs[128];    // in each 64 elements j: element l the low nibble of qs[32 j + l], element 32 + l its high
};

// Q4_K with a fifth bit: element j's bit 4 in qh (elements l and 32 + l of each 64 j: bits 2 j and 2 j + 1 of qh[l])
struct q5_k_block {
    uint16_t d;
    uint16_t dmin;
    uint8_t  scales[12]; // as Q4_K's
    uint8_t  qh[32];
    uint8_t  qs[128];    // as Q4_K's
};

// a super-block of 256: sixteen sub-blocks of 16, each with its int8 scale; element q - 32 with q the 6 bits
struct q6_k_block {
    uint8_t  ql[128];    // low 4 bits: in each half of 128, elements 0..63 the low nibbles of ql[0..63], 64..127 high
    uint8_t  qh[64];     // high 2 bits: in each half, qh[l] holds elements l, l + 32, l + 64, l + 96 (bits 0-1 .. 6-7)
    int8_t   scales[16]; // sub-block scales
    uint16_t d;          // super-block scale (fp16)
};

struct q8_k_block {
    float   d;          // scale
    int8_t  qs[256];
    int16_t bsums[16];  // sum of each 16 quants
};

static_assert(sizeof(q4_1_block) == 20, "block_q4_1 is 20 bytes");
static_assert(sizeof(q8_1_block) == 36, "block_q8_1 is 36 bytes");
static_assert(sizeof(q8_0_block) == 34, "block_q8_0 is 34 bytes");
static_assert(sizeof(q4_k_block) == 144, "block_q4_K is 144 bytes");
static_assert(sizeof(q5_k_block) == 176, "block_q5_K is 176 bytes");
static_assert(sizeof(q6_k_block) == 210, "block_q6_K is 210 bytes");
static_assert(sizeof(q8_k_block) == 292, "block_q8_K is 292 bytes");

// ---- weight rows times the tokens [t0, t0 + nt) (nt <= 8) of the quantized activations: out[t * stride]

struct specee_tile_args {
    const void *       x;      // the weight row's blocks (Q8_0, K-quants; Q4_1's rows: specee_rows_args)
    const void *       y[8];   // each token's blocks (q8_1_block or q8_0_block)
    const float *      d_y;    // [nb][n_pad] from token t0 (Q8_1, Q8_0; the K-quants read the block's own d)
    const float *      s_y;    // [nb][n_pad] from token t0
    int64_t            nb;
    int64_t            n_pad;
    float *            out;    // token t's result at out[t * stride]
    int64_t            stride;
};

// ---- the tiles of eight weight rows (Q4_1, Q4_K; this runtime's own sums): rows x[0..7] in the file's layout (a
// row repeated where fewer than eight are real), or with `packed` the eight rows' group in the type's eight-row
// layout at x[0], times the tokens y[0..nt) of a specee_tile_args; token t's result for row r (r < nr) at
// out[t * stride + r]; the specee_tile_args' x is unused
struct specee_rows_args {
    const void * x[8];
    int          nr;
    bool         packed;
    int64_t      ahead; // the file's layout: bytes from each row to the same block of the rows read next, or 0
};

// Q4_K's (and Q5_K's) eight 6-bit sub-block scales and mins from their 12 bytes (ggml's get_scale_min_k4)
inline void specee_k_scales(const uint8_t * s, int32_t sc[8], int32_t mn[8]) {
    for (int j = 0; j < 8; ++j) {
        if (j < 4) {
            sc[j] = s[j] & 63;
            mn[j] = s[j + 4] & 63;
        } else {
            sc[j] = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
            mn[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
    }
}

// ---- the eight-row layouts' 6-bit scales and mins (Q4_K, Q5_K): each row's sixteen decoded once, at load, the eight
// rows' in 96 bytes in an order a tile reads with a few shuffles (docs/kernels.md). Position i = 8 s + r (s in 0..3,
// r the row) holds sub-blocks s and s + 4: sc_lo[i] the low 4 bits of s's scale in bits 0-3 and of s + 4's in bits
// 4-7, sc_hi[i % 16] their top 2 bits in bits 2 (i / 16) and 4 + 2 (i / 16); the mins the same way
struct specee_k_six8 {
    uint8_t sc_lo[32];
    uint8_t sc_hi[16];
    uint8_t mn_lo[32];
    uint8_t mn_hi[16];
};

// row r's scales and mins (specee_k_scales') into g, zeroed before its first row
inline void specee_k_six8_put(specee_k_six8 & g, int r, const int32_t sc[8], const int32_t mn[8]) {
    for (int s = 0; s < 8; ++s) {
        const int i = 8 * (s % 4) + r, h = s / 4, up = 2 * (i / 16) + 4 * h;
        g.sc_lo[i] |= (uint8_t) ((sc[s] & 0x0F) << (4 * h));
        g.mn_lo[i] |= (uint8_t) ((mn[s] & 0x0F) << (4 * h));
        g.sc_hi[i % 16] |= (uint8_t) ((sc[s] >> 4) << up);
        g.mn_hi[i % 16] |= (uint8_t) ((mn[s] >> 4) << up);
    }
}

// row r's scale (lo, hi: sc_lo, sc_hi) or min (mn_lo, mn_hi) of sub-block s
inline int32_t specee_k_six8_get(const uint8_t * lo, const uint8_t * hi, int s, int r) {
    const int i = 8 * (s % 4) + r, h = s / 4;
    return ((lo[i] >> (4 * h)) & 0x0F) | (((hi[i % 16] >> (2 * (i / 16) + 4 * h)) & 3) << 4);
}

// Q4_K's and Q5_K's portable path over their eight-row group type G (d, dmin, six): the SIMD path's operations in
// its order, one scalar at a time (the tiles' files are built with -ffp-contract=off; std::fma rounds once as the
// hardware's FMA does); quant(g, r, s, e) is row r's unsigned quant e (0..31) of sub-block s
template <typename G, typename Quant>
inline void specee_k_rows_portable(const specee_tile_args & ta, const specee_rows_args & ra, int nt, Quant quant) {
    for (int r = 0; r < ra.nr; ++r) {
        for (int t = 0; t < nt; ++t) {
            float acc = 0.0f;
            for (int64_t b = 0; b < ta.nb; ++b) {
                const G &          g    = ((const G *) ra.x[0])[b];
                const q8_k_block & y    = ((const q8_k_block *) ta.y[t])[b];
                int32_t            sumi = 0, summ = 0;
                for (int s = 0; s < 8; ++s) {
                    int32_t dot = 0;
                    for (int e = 0; e < 32; ++e) {
                        dot += quant(g, r, s, e) * y.qs[32 * s + e];
                    }
                    sumi += specee_k_six8_get(g.six.sc_lo, g.six.sc_hi, s, r) * dot;
                    summ += specee_k_six8_get(g.six.mn_lo, g.six.mn_hi, s, r) * (y.bsums[2 * s] + y.bsums[2 * s + 1]);
                }
                const float dd = ggml_fp16_to_fp32(g.d[r]) * y.d;
                const float dm = ggml_fp16_to_fp32(g.dmin[r]) * y.d;
                acc            = std::fma(dd, (float) sumi, acc);
                acc            = std::fma(-dm, (float) summ, acc);
            }
            ta.out[t * ta.stride + r] = acc;
        }
    }
}

#ifdef SPECEE_KERNELS_X86

#define SPECEE_AVX2 __attribute__((target("avx2,fma,f16c")))

// an eight-row tile's SIMD path, one per token count
using specee_rows_fn = void (*)(const specee_tile_args &, const specee_rows_args &);

// an eight-row tile's accumulators (lane r: row r) to token t's outputs, the first nr rows
SPECEE_AVX2 inline void specee_rows_store(const __m256 * acc, int nt, const specee_tile_args & ta,
                                          const specee_rows_args & ra) {
    for (int t = 0; t < nt; ++t) {
        if (ra.nr == 8) {
            _mm256_storeu_ps(ta.out + t * ta.stride, acc[t]);
        } else {
            alignas(32) float res[8];
            _mm256_store_ps(res, acc[t]);
            memcpy(ta.out + t * ta.stride, res, sizeof(float) * ra.nr);
        }
    }
}

// the 16 bytes of nibbles of one block of eight rows (row r's at qs[r], the file's layout) as four vectors, vector k
// holding row r's bytes 4k..4k+3 at 4r (elements 4k..4k+3 in their low nibbles, 16 + 4k.. in the high), the eight-row
// layouts' order: rows r and r + 4 in one vector's halves, then a 4 x 4 transpose of 32-bit groups within each half
SPECEE_AVX2 inline void specee_rows_nibbles(const uint8_t * const qs[8], __m256i w[4]) {
    __m256i a[4];
    for (int r = 0; r < 4; ++r) {
        a[r] = _mm256_loadu2_m128i((const __m128i *) qs[r + 4], (const __m128i *) qs[r]);
    }
    const __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpacklo_epi32(a[2], a[3]);
    const __m256i t2 = _mm256_unpackhi_epi32(a[0], a[1]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
    w[0] = _mm256_unpacklo_epi64(t0, t1);
    w[1] = _mm256_unpackhi_epi64(t0, t1);
    w[2] = _mm256_unpacklo_epi64(t2, t3);
    w[3] = _mm256_unpackhi_epi64(t2, t3);
}

// Q4_K's and Q5_K's step of one token and super-block for the eight rows: acc + (d_x * d_y) * sumi - (dmin_x * d_y) *
// summ, summ the rows' mins (specee_k_six8_lanes' mnp) times the token's sums of the sub-blocks (pairs of ggml's sums
// of 16, as 16-bit pairs (2k, 2k + 1), each pair broadcast)
SPECEE_AVX2 inline __m256 specee_k_acc(__m256 acc, __m256 dx, __m256 mx, const q8_k_block & y, __m256i sumi,
                                       const __m256i mnp[4]) {
    const __m256i bs   = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *) y.bsums), _mm256_set1_epi16(1));
    const __m256i bp   = _mm256_packs_epi32(bs, bs); // [B0..B3 B0..B3 | B4..B7 B4..B7]
    __m256i       summ = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
        const __m256i pair = _mm256_permutevar8x32_epi32(bp, _mm256_set1_epi32(k < 2 ? k : k + 2));
        summ               = _mm256_add_epi32(summ, _mm256_madd_epi16(mnp[k], pair));
    }
    const __m256 dy = _mm256_set1_ps(y.d);
    acc             = _mm256_fmadd_ps(_mm256_mul_ps(dx, dy), _mm256_cvtepi32_ps(sumi), acc);
    return _mm256_fnmadd_ps(_mm256_mul_ps(mx, dy), _mm256_cvtepi32_ps(summ), acc);
}

// Q4_0's and Q4_1's tiles ask for the group this many blocks of 32 ahead while a block computes (specee_prefetch); the
// K-quants' tiles for the next super-block's group
static const int64_t SPECEE_ROWS_AHEAD = 8;

// the cache lines of [p, p + bytes) asked for ahead of use: the eight-row layouts are read as one stream, but a
// tile's reads within a group jump between its parts (nibbles, top bits, scales), which trained the hardware's
// prefetcher late: a one-token Q6_K tile read 9.3 GB/s without this, 18-19 with it. Asked past the end of a row
// group too: the next eight rows' groups follow it in the layout, so the stream does not stall where each row group
// begins (with a matrix's row of 18 blocks, SmolLM2's K = 576, a Q4_1 product of one token from memory took 3.4
// instead of 4.8 ms; docs/kernels.md). Past the matrix's end the hint reads nothing: x86 prefetches never fault.
SPECEE_AVX2 inline void specee_prefetch(const void * p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) {
        _mm_prefetch((const char *) p + off, _MM_HINT_T0);
    }
}

// ggml's hsum_float_8: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))
SPECEE_AVX2 inline float specee_hsum_8(__m256 x) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    r        = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r        = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

// the 6-bit values of sub-blocks 0-3 (a) and 4-7 (b) as bytes [s][r]: the low nibbles, the top bits shifted to bits
// 4-5 per half (positions 0-15 keep theirs in bits 0-1 / 4-5 of hi, 16-31 in bits 2-3 / 6-7)
SPECEE_AVX2 inline void specee_k_six8_bytes(const uint8_t * lo, const uint8_t * hi, __m256i & a, __m256i & b) {
    const __m256i l   = _mm256_loadu_si256((const __m256i *) lo);
    const __m256i h   = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) hi));
    const __m256i n4  = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    const __m256i up4 = _mm256_setr_epi32(4, 4, 4, 4, 2, 2, 2, 2), dn = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
    a = _mm256_or_si256(_mm256_and_si256(l, n4), _mm256_and_si256(_mm256_sllv_epi32(h, up4), top));
    b = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l, 4), n4), _mm256_and_si256(_mm256_srlv_epi32(h, dn), top));
}

// the eight rows' scales and mins of a super-block as a tile multiplies them: scv[s] row r's scale of sub-block s in
// 16-bit lanes 2r and 2r + 1, mnp[k] row r's mins of sub-blocks 2k and 2k + 1 in lanes 2r and 2r + 1; each vector one
// cross-lane permute of the 8 (or 16) bytes it takes and one byte shuffle into its lanes
SPECEE_AVX2 inline void specee_k_six8_lanes(const specee_k_six8 & g, __m256i scv[8], __m256i mnp[4]) {
    __m256i sc[2], mn[2];
    specee_k_six8_bytes(g.sc_lo, g.sc_hi, sc[0], sc[1]);
    specee_k_six8_bytes(g.mn_lo, g.mn_hi, mn[0], mn[1]);
    // scale s of rows 0-3 (low half) and 4-7 (high half) to 16-bit lanes 2r, 2r + 1; mins 2k, 2k + 1 to 2r and 2r + 1
    const __m256i dup  = _mm256_setr_epi8(0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3, -1, //
                                          4, -1, 4, -1, 5, -1, 5, -1, 6, -1, 6, -1, 7, -1, 7, -1);
    const __m256i pair = _mm256_setr_epi8(0, -1, 8, -1, 1, -1, 9, -1, 2, -1, 10, -1, 3, -1, 11, -1, //
                                          4, -1, 12, -1, 5, -1, 13, -1, 6, -1, 14, -1, 7, -1, 15, -1);
    for (int s = 0; s < 8; ++s) {
        const int     q = 2 * (s % 4);
        const __m256i at = _mm256_setr_epi32(q, q + 1, q, q + 1, q, q + 1, q, q + 1);
        const __m256i v  = _mm256_permutevar8x32_epi32(sc[s / 4], at);
        scv[s]          = _mm256_shuffle_epi8(v, dup);
    }
    for (int k = 0; k < 4; ++k) {
        const int     q = 4 * (k % 2);
        const __m256i at = _mm256_setr_epi32(q, q + 1, q + 2, q + 3, q, q + 1, q + 2, q + 3);
        const __m256i v  = _mm256_permutevar8x32_epi32(mn[k / 2], at);
        mnp[k]          = _mm256_shuffle_epi8(v, pair);
    }
}

// the Q4_K and Q5_K eight-row tiles (their files give the group type G with d, dmin and six; VALUES: sub-block s's
// values of the eight rows, elements 4k..4k+3 in v[k]; STEP: sumi plus one token's sum of a sub-block, weighted by its
// scales): per super-block the scales and the next group's prefetch, then the sub-blocks outside and the tokens
// inside, so a sub-block's eight vectors are built once for all the tile's tokens
template <int NT, typename G, void (*VALUES)(const G &, int, __m256i *),
          __m256i (*STEP)(__m256i, const __m256i *, const int8_t *, __m256i)>
SPECEE_AVX2 void specee_k_rows_avx2(const specee_tile_args & ta, const specee_rows_args & ra) {
    __m256 acc[NT];
    for (int t = 0; t < NT; ++t) {
        acc[t] = _mm256_setzero_ps();
    }
    __m256i scv[8], mnp[4]; // specee_k_six8_lanes
    for (int64_t b = 0; b < ta.nb; ++b) {
        const G &    g  = ((const G *) ra.x[0])[b];
        const __m256 dx = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) g.d));
        const __m256 mx = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) g.dmin));
        specee_k_six8_lanes(g.six, scv, mnp);
        specee_prefetch(&g + 1, sizeof(g)); // the next group while this one computes, past a row group's end too
        __m256i sumi[NT];
        for (int t = 0; t < NT; ++t) {
            sumi[t] = _mm256_setzero_si256();
        }
        for (int s = 0; s < 8; ++s) {
            __m256i v[8];
            VALUES(g, s, v);
            for (int t = 0; t < NT; ++t) {
                sumi[t] = STEP(sumi[t], v, ((const q8_k_block *) ta.y[t])[b].qs + 32 * s, scv[s]);
            }
        }
        for (int t = 0; t < NT; ++t) {
            acc[t] = specee_k_acc(acc[t], dx, mx, ((const q8_k_block *) ta.y[t])[b], sumi[t], mnp);
        }
    }
    specee_rows_store(acc, NT, ta, ra);
}

#endif
