// specee-kernels.cpp: this runtime's CPU matmul kernels for Q4_1 and Q8_0 weights times 1..n token rows
// (docs/kernels.md).
//
// ggml 0.20.2 multiplies a Q4_1 matrix by n tokens as n separate ggml_vec_dot_q4_1_q8_1 per weight row, unpacking
// the weight's nibbles again for every token. Here a weight block is unpacked once per tile of up to 8 tokens and
// used for each of them. The arithmetic per output element is exactly ggml's x86 vec_dot (ggml-cpu/arch/x86/
// quants.c, AVX2 build, checked against its disassembly): per block of 32, eight int32 lanes (lane j = the sum of
// the products of elements 4j..4j+3, exact), each converted to float and fused-multiply-added with d_x*d_y into its
// own float accumulator; the min term as fma(m_x, s_y, summs) in a scalar; at the end the lanes summed as
// ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)), then + summs. So the results equal ggml's for every number of tokens, bit
// for bit, and a token's logits do not depend on its batch.
//
// Q8_0 (a Q4_1 file's token embeddings and tied lm_head, every matrix of a Q8_0 file) the same way: ggml computes
// one token with ggml_vec_dot_q8_0_q8_0 and 2 or more with llamafile's tinyBLAS, whose 4x3 tiles re-derive each
// block's signs and scales per (row, token) pair. The kernel reproduces the one-token vec_dot for every row count:
// per block the eight exact int32 lanes of |x| times sign(y, x) (maddubs + madd), converted and fused-multiply-added
// with d_x*d_y into the block's accumulator, the same final sum; |x| is taken once per block for all the tokens.
//
// Two custom ops on ggml's own threads (ggml_custom_4d: the graph's threadpool, no threads of ours): the
// activations quantized once per op with ggml's own Q8_1 quantizer (the values ggml's mul_mat would use), then the
// matmul, whose threads split the weight's rows.
#include "specee-kernels.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
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
    uint8_t  ql[128];    // low 4 bits: in each half of 128, elements 0..63 the low nibbles of ql[0..63], 64..127 the high
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

// the activations' type for a weight type (ggml's vec_dot_type): Q8_1 for Q4_1 (its blocks carry d*sum for the
// min), Q8_0 for Q8_0, Q8_K for the K-quants (super-blocks of 256 with their sums of 16)
static ggml_type act_type_of(ggml_type w) {
    return w == GGML_TYPE_Q8_0                              ? GGML_TYPE_Q8_0
         : w == GGML_TYPE_Q4_K || w == GGML_TYPE_Q5_K || w == GGML_TYPE_Q6_K ? GGML_TYPE_Q8_K
                                                            : GGML_TYPE_Q8_1;
}

// the elements of one weight (and activation) block
static int64_t block_elems(ggml_type act) { return act == GGML_TYPE_Q8_K ? 256 : 32; }

// ---- the quantized activations: one I8 tensor holding n rows of Q8_1 or Q8_0 blocks (ggml's layout, the
// quantizer's output) and each block's d and s (Q8_1; 0 for Q8_0) as floats, [nb][n_pad], so a tile reads 8 tokens'
// d or s in one load; then a span counter for each matmul that reads them (products of one input share its
// quantization: Q/K/V, gate/up), each on a cache line of its own, set to 0 by the quantizer and taken from by that
// matmul's threads

struct act_layout {
    int64_t n      = 0; // tokens
    int64_t nb     = 0; // blocks per token
    int64_t n_pad  = 0; // n rounded up to 8
    size_t  bsize  = 0; // bytes per block
    size_t  off_d  = 0;
    size_t  off_s  = 0;
    size_t  off_next = 0; // the first reader's next span (int64_t; reader i's at off_next + 64 i)
    size_t  nbytes = 0;
};

static act_layout layout_of(int64_t k, int64_t n, ggml_type act) {
    act_layout a;
    a.n     = n;
    a.nb    = k / block_elems(act);
    a.n_pad = (n + 7) / 8 * 8;
    a.bsize = act == GGML_TYPE_Q8_0 ? sizeof(q8_0_block) : act == GGML_TYPE_Q8_K ? sizeof(q8_k_block)
                                                                                : sizeof(q8_1_block);
    const size_t rows   = (size_t) (n * a.nb) * a.bsize;
    const size_t floats = (size_t) (a.nb * a.n_pad) * sizeof(float);
    a.off_d  = (rows + 63) / 64 * 64;
    a.off_s    = a.off_d + floats;
    a.off_next = (a.off_s + floats + 63) / 64 * 64;
    a.nbytes   = a.off_next + 64 * SPECEE_KERNELS_MAX_READERS;
    return a;
}

// dst <- the activations src[0] [k, n] F32 quantized to the type in userdata; threads split the tokens
static void quantize_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const ggml_type     act = (ggml_type) (intptr_t) userdata;
    const ggml_tensor * x   = dst->src[0];
    const act_layout    a   = layout_of(x->ne[0], x->ne[1], act);
    ggml_from_float_t   q   = ggml_get_type_traits_cpu(act)->from_float;
    uint8_t *           base = (uint8_t *) dst->data;
    float *             d    = (float *) (base + a.off_d);
    float *             s    = (float *) (base + a.off_s);
    if (ith == 0) { // the matmuls' threads start after ggml's barrier between the ops, which orders these stores
        for (int i = 0; i < SPECEE_KERNELS_MAX_READERS; ++i) {
            __atomic_store_n((int64_t *) (base + a.off_next + 64 * i), 0, __ATOMIC_RELAXED);
        }
    }
    for (int64_t t = ith; t < a.n_pad; t += nth) {
        if (t >= a.n) {
            for (int64_t b = 0; b < a.nb; ++b) {
                d[b * a.n_pad + t] = 0.0f;
                s[b * a.n_pad + t] = 0.0f;
            }
            continue;
        }
        uint8_t * row = base + (size_t) (t * a.nb) * a.bsize;
        q((const float *) ((const char *) x->data + t * x->nb[1]), row, x->ne[0]);
        for (int64_t b = 0; b < a.nb; ++b) {
            if (act == GGML_TYPE_Q8_0) {
                d[b * a.n_pad + t] = ggml_fp16_to_fp32(((const q8_0_block *) row)[b].d);
                s[b * a.n_pad + t] = 0.0f;
            } else if (act == GGML_TYPE_Q8_K) {
                d[b * a.n_pad + t] = ((const q8_k_block *) row)[b].d;
                s[b * a.n_pad + t] = 0.0f;
            } else {
                d[b * a.n_pad + t] = ggml_fp16_to_fp32(((const q8_1_block *) row)[b].d);
                s[b * a.n_pad + t] = ggml_fp16_to_fp32(((const q8_1_block *) row)[b].s);
            }
        }
    }
}

// ---- one weight row times the tokens [t0, t0 + nt) (nt <= 8) of the quantized activations: out[t * stride]

struct tile_args {
    const void *       x;      // the weight row's blocks (q4_1_block or q8_0_block)
    const void *       y[8];   // each token's blocks (q8_1_block or q8_0_block)
    const float *      d_y;    // [nb][n_pad] from token t0
    const float *      s_y;    // [nb][n_pad] from token t0
    int64_t            nb;
    int64_t            n_pad;
    float *            out;    // token t's result at out[t * stride]
    int64_t            stride;
};

// the portable path: the same operations in the same order as the SIMD one (and ggml's AVX2 vec_dot), one scalar at
// a time; std::fma rounds once as the hardware's FMA does (this file is built with -ffp-contract=off)
static void tile_portable_q4_1(const tile_args & ta, int nt) {
    float acc[8][8] = {};
    float summs[8]  = {};
    for (int64_t b = 0; b < ta.nb; ++b) {
        const q4_1_block & xb = ((const q4_1_block *) ta.x)[b];
        int32_t            q[32];
        for (int k = 0; k < 16; ++k) {
            q[k]      = xb.qs[k] & 0x0F;
            q[k + 16] = xb.qs[k] >> 4;
        }
        const float dx = ggml_fp16_to_fp32(xb.d);
        const float mx = ggml_fp16_to_fp32(xb.m);
        for (int t = 0; t < nt; ++t) {
            const int8_t * r  = ((const q8_1_block *) ta.y[t])[b].qs;
            const float    dd = dx * ta.d_y[b * ta.n_pad + t];
            summs[t]          = std::fma(mx, ta.s_y[b * ta.n_pad + t], summs[t]);
            for (int j = 0; j < 8; ++j) {
                const int32_t lane = q[4 * j] * r[4 * j] + q[4 * j + 1] * r[4 * j + 1] + q[4 * j + 2] * r[4 * j + 2] +
                                     q[4 * j + 3] * r[4 * j + 3];
                acc[t][j] = std::fma(dd, (float) lane, acc[t][j]);
            }
        }
    }
    for (int t = 0; t < nt; ++t) {
        const float * a = acc[t];
        ta.out[t * ta.stride] = (((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))) + summs[t];
    }
}

// Q8_0: lane j of a block = the exact sum of the products of elements 4j..4j+3 (what maddubs + madd give from |x|
// and sign(y, x): no int16 overflow with ggml's quants in [-127, 127], even a weight of -128), no min term
static void tile_portable_q8_0(const tile_args & ta, int nt) {
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

static void tile_portable_q6_k(const tile_args & ta, int nt) {
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

// Q4_K's (and Q5_K's) eight 6-bit sub-block scales and mins from their 12 bytes
static void k_scales(const uint8_t * s, int32_t sc[8], int32_t mn[8]) {
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

// Q4_K (ggml's AVX2 ggml_vec_dot_q4_K_q8_K): per super-block, eight exact int32 lanes, lane j the sum over the eight
// sub-blocks of the sub-block's scale times the products of its elements 4j..4j+3, converted and fused-multiply-added
// with d_y*d_x into the lane's accumulator; the mins in four lanes, lane i the exact min[2i] * sum(y of sub-block 2i)
// + the same for 2i + 1, fused-multiply-added with (-d_y)*dmin_x; at the end hsum_float_8 of the eight, plus
// (m0 + m2) + (m1 + m3)
static void tile_portable_q4_k(const tile_args & ta, int nt) {
    float acc[8][8] = {};
    float accm[8][4] = {};
    for (int64_t b = 0; b < ta.nb; ++b) {
        const q4_k_block & xb = ((const q4_k_block *) ta.x)[b];
        int32_t            sc[8], mn[8];
        k_scales(xb.scales, sc, mn);
        const float dx = ggml_fp16_to_fp32(xb.d), mx = ggml_fp16_to_fp32(xb.dmin);
        for (int t = 0; t < nt; ++t) {
            const q8_k_block & yb = ((const q8_k_block *) ta.y[t])[b];
            const float        d  = yb.d * dx;
            const float        dm = -yb.d * mx;
            for (int l = 0; l < 8; ++l) {
                int32_t lane = 0;
                for (int j = 0; j < 4; ++j) {
                    const uint8_t * q  = xb.qs + 32 * j + 4 * l;
                    const int8_t *  yl = yb.qs + 64 * j + 4 * l;
                    const int8_t *  yh = yl + 32;
                    int32_t         lo = 0, hi = 0;
                    for (int i = 0; i < 4; ++i) {
                        lo += (q[i] & 0x0F) * yl[i];
                        hi += (q[i] >> 4) * yh[i];
                    }
                    lane += sc[2 * j] * lo + sc[2 * j + 1] * hi;
                }
                acc[t][l] = std::fma(d, (float) lane, acc[t][l]);
            }
            for (int i = 0; i < 4; ++i) {
                const int32_t s0 = yb.bsums[4 * i] + yb.bsums[4 * i + 1], s1 = yb.bsums[4 * i + 2] + yb.bsums[4 * i + 3];
                accm[t][i] = std::fma(dm, (float) (mn[2 * i] * s0 + mn[2 * i + 1] * s1), accm[t][i]);
            }
        }
    }
    for (int t = 0; t < nt; ++t) {
        const float * a = acc[t];
        const float * m = accm[t];
        ta.out[t * ta.stride] =
            (((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))) + ((m[0] + m[2]) + (m[1] + m[3]));
    }
}

// Q5_K (ggml's AVX2 ggml_vec_dot_q5_K_q8_K): Q4_K's eight lanes with 5-bit quants; the mins' four lanes summed to
// one exact integer per super-block and fused-multiply-added with (-d_y)*dmin_x into a scalar (the compiler contracts
// ggml's summs += dmin * sum, checked in its disassembly); at the end hsum_float_8 plus that scalar
static void tile_portable_q5_k(const tile_args & ta, int nt) {
    float acc[8][8] = {};
    float summs[8]  = {};
    for (int64_t b = 0; b < ta.nb; ++b) {
        const q5_k_block & xb = ((const q5_k_block *) ta.x)[b];
        int32_t            sc[8], mn[8];
        k_scales(xb.scales, sc, mn);
        const float dx = ggml_fp16_to_fp32(xb.d), mx = ggml_fp16_to_fp32(xb.dmin);
        for (int t = 0; t < nt; ++t) {
            const q8_k_block & yb = ((const q8_k_block *) ta.y[t])[b];
            const float        d  = yb.d * dx;
            const float        dm = -yb.d * mx;
            for (int l = 0; l < 8; ++l) {
                int32_t lane = 0;
                for (int j = 0; j < 4; ++j) {
                    int32_t lo = 0, hi = 0;
                    for (int i = 0; i < 4; ++i) {
                        const int e = 4 * l + i;
                        const int q = xb.qs[32 * j + e];
                        lo += ((q & 0x0F) | (((xb.qh[e] >> (2 * j)) & 1) << 4)) * yb.qs[64 * j + e];
                        hi += ((q >> 4) | (((xb.qh[e] >> (2 * j + 1)) & 1) << 4)) * yb.qs[64 * j + 32 + e];
                    }
                    lane += sc[2 * j] * lo + sc[2 * j + 1] * hi;
                }
                acc[t][l] = std::fma(d, (float) lane, acc[t][l]);
            }
            int32_t m = 0;
            for (int k = 0; k < 8; ++k) {
                m += mn[k] * (yb.bsums[2 * k] + yb.bsums[2 * k + 1]);
            }
            summs[t] = std::fma(dm, (float) m, summs[t]);
        }
    }
    for (int t = 0; t < nt; ++t) {
        const float * a = acc[t];
        ta.out[t * ta.stride] = (((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))) + summs[t];
    }
}

static void tile_portable(const tile_args & ta, int nt, ggml_type w) {
    if (w == GGML_TYPE_Q5_K) {
        tile_portable_q5_k(ta, nt);
    } else if (w == GGML_TYPE_Q8_0) {
        tile_portable_q8_0(ta, nt);
    } else if (w == GGML_TYPE_Q4_K) {
        tile_portable_q4_k(ta, nt);
    } else if (w == GGML_TYPE_Q6_K) {
        tile_portable_q6_k(ta, nt);
    } else {
        tile_portable_q4_1(ta, nt);
    }
}

#ifdef SPECEE_KERNELS_X86

#define SPECEE_AVX2 __attribute__((target("avx2,fma,f16c")))

// ggml's hsum_float_8: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))
SPECEE_AVX2 static inline float hsum_8(__m256 x) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    r        = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r        = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

// one token's step of a block: acc += (d_x*d_y) * the 8 lanes of the block's byte dot product
// lane t of v in every lane (the tokens' d_x*d_y kept in a register: a store and reloads of single lanes stalled on
// store forwarding, measured in the 2-token tile)
template <int T> SPECEE_AVX2 static inline __m256 lane(__m256 v) {
    return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(T));
}

SPECEE_AVX2 static inline __m256 token_step(__m256 acc, __m256i qx, const void * y, int64_t b, __m256 dd) {
    const q8_1_block & yb  = ((const q8_1_block *) y)[b];
    const __m256i qy  = _mm256_loadu_si256((const __m256i *) yb.qs);
    const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(qx, qy), _mm256_set1_epi16(1));
    return _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(dot), acc);
}

// NT tokens (1..8) at once: NT accumulators of 8 lanes, each its own variable (an array of them ends up in memory);
// the tokens' min terms in one vector (lane t: token t)
template <int NT>
SPECEE_AVX2 static void tile_avx2_q4_1(const tile_args & ta) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256        a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    __m256        summs = _mm256_setzero_ps();
    const float * d_y   = ta.d_y;
    const float * s_y   = ta.s_y;
    for (int64_t b = 0; b < ta.nb; ++b, d_y += ta.n_pad, s_y += ta.n_pad) {
        const q4_1_block & xb  = ((const q4_1_block *) ta.x)[b];
        const __m128i      raw = _mm_loadu_si128((const __m128i *) xb.qs);
        const __m256i      qx  = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
        // d and m (adjacent halves) converted in one instruction, then each broadcast (the same values as one at a
        // time: fp16 to fp32 is exact)
        int32_t dm_bits;
        memcpy(&dm_bits, &xb.d, sizeof(dm_bits));
        const __m128       dm  = _mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits));
        const __m256       dx  = _mm256_broadcastss_ps(dm);
        const __m256       mx  = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
        // the 8 tokens' d_x*d_y in one multiply (lane t: token t, each rounded as ggml's scalar product), each
        // broadcast from the register (lane<t>)
        const __m256 dd = _mm256_mul_ps(dx, _mm256_loadu_ps(d_y));
        summs           = _mm256_fmadd_ps(mx, _mm256_loadu_ps(s_y), summs);
        a0    = token_step(a0, qx, ta.y[0], b, lane<0>(dd));
        if (NT > 1) a1 = token_step(a1, qx, ta.y[1], b, lane<1>(dd));
        if (NT > 2) a2 = token_step(a2, qx, ta.y[2], b, lane<2>(dd));
        if (NT > 3) a3 = token_step(a3, qx, ta.y[3], b, lane<3>(dd));
        if (NT > 4) a4 = token_step(a4, qx, ta.y[4], b, lane<4>(dd));
        if (NT > 5) a5 = token_step(a5, qx, ta.y[5], b, lane<5>(dd));
        if (NT > 6) a6 = token_step(a6, qx, ta.y[6], b, lane<6>(dd));
        if (NT > 7) a7 = token_step(a7, qx, ta.y[7], b, lane<7>(dd));
    }
    alignas(32) float sm[8];
    _mm256_store_ps(sm, summs);
    const __m256 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    for (int t = 0; t < NT; ++t) {
        ta.out[t * ta.stride] = hsum_8(acc[t]) + sm[t];
    }
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
SPECEE_AVX2 static void tile_avx2_q8_0(const tile_args & ta) {
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
        ta.out[t * ta.stride] = hsum_8(acc[t]);
    }
}

// Q4_K: a super-block's nibbles split once (low and high of each 64 elements) and its scales broadcast to 16-bit
// lanes, kept on the stack for every token's step; per token ggml's integer lanes, the mins' four lanes, two FMAs
SPECEE_AVX2 static inline void token_step_q4_k(__m256 & acc, __m128 & accm, const __m256i * q, const __m256i * sc,
                                               __m128i mins, const void * y, int64_t b, float dx, float mx) {
    const q8_k_block & yb   = ((const q8_k_block *) y)[b];
    __m256i            sumi = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
        const __m256i yl = _mm256_loadu_si256((const __m256i *) (yb.qs + 64 * j));
        const __m256i yh = _mm256_loadu_si256((const __m256i *) (yb.qs + 64 * j + 32));
        const __m256i pl = _mm256_madd_epi16(_mm256_load_si256(sc + 2 * j),
                                             _mm256_maddubs_epi16(_mm256_load_si256(q + 2 * j), yl));
        const __m256i ph = _mm256_madd_epi16(_mm256_load_si256(sc + 2 * j + 1),
                                             _mm256_maddubs_epi16(_mm256_load_si256(q + 2 * j + 1), yh));
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
    }
    const __m256i bsums = _mm256_loadu_si256((const __m256i *) yb.bsums);
    const __m128i s32   = _mm_hadd_epi16(_mm256_castsi256_si128(bsums), _mm256_extracti128_si256(bsums, 1));
    const __m128i prod  = _mm_madd_epi16(mins, s32);
    acc  = _mm256_fmadd_ps(_mm256_set1_ps(yb.d * dx), _mm256_cvtepi32_ps(sumi), acc);
    accm = _mm_fmadd_ps(_mm_set1_ps(-yb.d * mx), _mm_cvtepi32_ps(prod), accm);
}

template <int NT>
SPECEE_AVX2 static void tile_avx2_q4_k(const tile_args & ta) {
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
        int32_t scv[8], mnv[8];
        k_scales(xb.scales, scv, mnv);
        for (int j = 0; j < 8; ++j) {
            sc[j] = _mm256_set1_epi16((int16_t) scv[j]);
        }
        const __m128i mins = _mm_setr_epi16((int16_t) mnv[0], (int16_t) mnv[1], (int16_t) mnv[2], (int16_t) mnv[3],
                                            (int16_t) mnv[4], (int16_t) mnv[5], (int16_t) mnv[6], (int16_t) mnv[7]);
        const float dx = _cvtsh_ss(xb.d), mx = _cvtsh_ss(xb.dmin);
        for (int t = 0; t < NT; ++t) {
            token_step_q4_k(a[t], m[t], q, sc, mins, ta.y[t], b, dx, mx);
        }
    }
    for (int t = 0; t < NT; ++t) {
        __m128 r = _mm_add_ps(m[t], _mm_movehl_ps(m[t], m[t]));
        r        = _mm_add_ss(r, _mm_movehdup_ps(r));
        ta.out[t * ta.stride] = hsum_8(a[t]) + _mm_cvtss_f32(r);
    }
}

// Q5_K: Q4_K's tile with the fifth bit added at the unpacking, and the mins summed to one integer per token
SPECEE_AVX2 static inline void token_step_q5_k(__m256 & acc, float & summs, const __m256i * q, const __m256i * sc,
                                               __m128i mins, const void * y, int64_t b, float dx, float mx) {
    const q8_k_block & yb   = ((const q8_k_block *) y)[b];
    __m256i            sumi = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
        const __m256i yl = _mm256_loadu_si256((const __m256i *) (yb.qs + 64 * j));
        const __m256i yh = _mm256_loadu_si256((const __m256i *) (yb.qs + 64 * j + 32));
        const __m256i pl = _mm256_madd_epi16(_mm256_load_si256(sc + 2 * j),
                                             _mm256_maddubs_epi16(_mm256_load_si256(q + 2 * j), yl));
        const __m256i ph = _mm256_madd_epi16(_mm256_load_si256(sc + 2 * j + 1),
                                             _mm256_maddubs_epi16(_mm256_load_si256(q + 2 * j + 1), yh));
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
    }
    const __m256i bsums = _mm256_loadu_si256((const __m256i *) yb.bsums);
    const __m128i s32   = _mm_hadd_epi16(_mm256_castsi256_si128(bsums), _mm256_extracti128_si256(bsums, 1));
    __m128i       prod  = _mm_madd_epi16(mins, s32);
    prod                = _mm_hadd_epi32(prod, prod);
    prod                = _mm_hadd_epi32(prod, prod);
    acc   = _mm256_fmadd_ps(_mm256_set1_ps(yb.d * dx), _mm256_cvtepi32_ps(sumi), acc);
    summs = std::fma(-yb.d * mx, (float) _mm_cvtsi128_si32(prod), summs);
}

template <int NT>
SPECEE_AVX2 static void tile_avx2_q5_k(const tile_args & ta) {
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
        int32_t scv[8], mnv[8];
        k_scales(xb.scales, scv, mnv);
        for (int j = 0; j < 8; ++j) {
            sc[j] = _mm256_set1_epi16((int16_t) scv[j]);
        }
        const __m128i mins = _mm_setr_epi16((int16_t) mnv[0], (int16_t) mnv[1], (int16_t) mnv[2], (int16_t) mnv[3],
                                            (int16_t) mnv[4], (int16_t) mnv[5], (int16_t) mnv[6], (int16_t) mnv[7]);
        const float dx = _cvtsh_ss(xb.d), mx = _cvtsh_ss(xb.dmin);
        for (int t = 0; t < NT; ++t) {
            token_step_q5_k(a[t], summs[t], q, sc, mins, ta.y[t], b, dx, mx);
        }
    }
    for (int t = 0; t < NT; ++t) {
        ta.out[t * ta.stride] = hsum_8(a[t]) + summs[t];
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
SPECEE_AVX2 static void tile_avx2_q6_k(const tile_args & ta) {
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
        ta.out[t * ta.stride] = hsum_8(acc[t]);
    }
}

// each type's tile for 1..8 tokens (index nt - 1)
using tile_fn = void (*)(const tile_args &);
static const tile_fn TILES_Q4_1[8] = {tile_avx2_q4_1<1>, tile_avx2_q4_1<2>, tile_avx2_q4_1<3>, tile_avx2_q4_1<4>,
                                      tile_avx2_q4_1<5>, tile_avx2_q4_1<6>, tile_avx2_q4_1<7>, tile_avx2_q4_1<8>};
static const tile_fn TILES_Q8_0[8] = {tile_avx2_q8_0<1>, tile_avx2_q8_0<2>, tile_avx2_q8_0<3>, tile_avx2_q8_0<4>,
                                      tile_avx2_q8_0<5>, tile_avx2_q8_0<6>, tile_avx2_q8_0<7>, tile_avx2_q8_0<8>};

static const tile_fn TILES_Q6_K[8] = {tile_avx2_q6_k<1>, tile_avx2_q6_k<2>, tile_avx2_q6_k<3>, tile_avx2_q6_k<4>,
                                      tile_avx2_q6_k<5>, tile_avx2_q6_k<6>, tile_avx2_q6_k<7>, tile_avx2_q6_k<8>};

static const tile_fn TILES_Q4_K[8] = {tile_avx2_q4_k<1>, tile_avx2_q4_k<2>, tile_avx2_q4_k<3>, tile_avx2_q4_k<4>,
                                      tile_avx2_q4_k<5>, tile_avx2_q4_k<6>, tile_avx2_q4_k<7>, tile_avx2_q4_k<8>};

static const tile_fn TILES_Q5_K[8] = {tile_avx2_q5_k<1>, tile_avx2_q5_k<2>, tile_avx2_q5_k<3>, tile_avx2_q5_k<4>,
                                      tile_avx2_q5_k<5>, tile_avx2_q5_k<6>, tile_avx2_q5_k<7>, tile_avx2_q5_k<8>};

static void tile_simd(const tile_args & ta, int nt, ggml_type w) {
    (w == GGML_TYPE_Q8_0   ? TILES_Q8_0
     : w == GGML_TYPE_Q4_K ? TILES_Q4_K
     : w == GGML_TYPE_Q5_K ? TILES_Q5_K
     : w == GGML_TYPE_Q6_K ? TILES_Q6_K
                           : TILES_Q4_1)[nt - 1](ta);
}

#else

static void tile_simd(const tile_args & ta, int nt, ggml_type w) {
    tile_portable(ta, nt, w);
}

#endif

// ---- the matmul op: dst [m, n] <- src[0] (Q4_1 or Q8_0 [k, m]) x the quantized src[1]; the weight's rows in chunks
// of ROW_CHUNK rows (a chunk stays in cache across the token tiles) in spans of chunks, each thread's first span its
// own and the rest taken in turn from a counter, as ggml's mul_mat does: a thread that the OS holds back (another
// process, the server's event loop) leaves its spans to the others instead of stalling the pass at the barrier after
// the op. Each output element is still computed by one tile call, the same arithmetic whichever thread runs it.

enum kernel_path { PATH_PORTABLE = 0, PATH_SIMD = 1 };

// the matmul's userdata: its path and which of the quantization's readers it is (its span counter)
static intptr_t matmul_userdata(kernel_path path, int reader) { return (intptr_t) path + 2 * (intptr_t) reader; }

static const int64_t ROW_CHUNK = 16;

static void matmul_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const ggml_tensor * w    = dst->src[0];
    const ggml_tensor * qa   = dst->src[1];
    const int64_t       m    = dst->ne[0];
    const act_layout    a    = layout_of(w->ne[0], dst->ne[1], act_type_of(w->type));
    const bool          simd = (intptr_t) userdata % 2 == PATH_SIMD;
    const uint8_t *     base = (const uint8_t *) qa->data;
    int64_t *           next = (int64_t *) (base + a.off_next + 64 * ((intptr_t) userdata / 2));
    // a span: an eighth of a thread's share of the rows, in whole ROW_CHUNKs, read from start to end (rows handed out
    // one ROW_CHUNK at a time interleaved the threads' reads and measured 10-25 % slower from memory)
    const int64_t span    = std::max<int64_t>(1, m / (nth * 8 * ROW_CHUNK)) * ROW_CHUNK;
    const int64_t n_spans = (m + span - 1) / span;

    tile_args ta;
    ta.nb     = a.nb;
    ta.n_pad  = a.n_pad;
    ta.stride = dst->nb[1] / sizeof(float);
    for (int64_t sp = ith; sp < n_spans; sp = nth + __atomic_fetch_add(next, 1, __ATOMIC_RELAXED)) {
        const int64_t end = std::min(m, (sp + 1) * span);
        for (int64_t c0 = sp * span; c0 < end; c0 += ROW_CHUNK) {
            const int64_t c1 = std::min(end, c0 + ROW_CHUNK);
            for (int64_t t0 = 0; t0 < a.n; t0 += 8) {
                const int nt = (int) std::min<int64_t>(a.n - t0, 8);
                for (int t = 0; t < nt; ++t) {
                    ta.y[t] = base + (size_t) ((t0 + t) * a.nb) * a.bsize;
                }
                ta.d_y = (const float *) (base + a.off_d) + t0;
                ta.s_y = (const float *) (base + a.off_s) + t0;
                for (int64_t r = c0; r < c1; ++r) {
                    ta.x   = (const char *) w->data + r * w->nb[1];
                    ta.out = (float *) dst->data + t0 * ta.stride + r;
                    if (simd) {
                        tile_simd(ta, nt, w->type);
                    } else {
                        tile_portable(ta, nt, w->type);
                    }
                }
            }
        }
    }
}

// ---- choosing the path

const char * specee_kernels_auto_path(void) {
#ifdef SPECEE_KERNELS_X86
    // ggml's own Q4_1 and Q8_0 dot products must be its AVX2 ones (what the kernel reproduces): ggml built with AVX2
    // and FMA; with AVX-512 VNNI or AVX-VNNI-INT8 ggml's lanes come from vpdpbusd / vpdpbssd, the same integers
    // (untested here: docs/kernels.md)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
        ggml_cpu_has_avx2() && ggml_cpu_has_fma() && ggml_cpu_has_f16c()) {
        return "avx2";
    }
#endif
    return "off";
}

static bool in_plain_cpu_buffer(const ggml_tensor * w) {
    if (!w->buffer || !ggml_backend_buffer_is_host(w->buffer)) {
        return false; // no buffer yet, a device's, or a repacked layout (ggml's extra CPU buffers are not host)
    }
    // ggml's plain CPU buffer types (allocated, or a mapped file's) name no device
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(w->buffer));
    return !dev || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
}

bool specee_kernels_apply(const ggml_tensor * w, const ggml_tensor * cur, int32_t mode) {
    if (mode == SPECEE_KERNELS_OFF || (mode == SPECEE_KERNELS_AUTO && strcmp(specee_kernels_auto_path(), "off") == 0)) {
        return false;
    }
    if (!specee_kernels_type(w->type) || ggml_type_size(GGML_TYPE_Q4_1) != sizeof(q4_1_block) ||
        ggml_type_size(GGML_TYPE_Q8_1) != sizeof(q8_1_block) || ggml_type_size(GGML_TYPE_Q8_0) != sizeof(q8_0_block) ||
        ggml_type_size(GGML_TYPE_Q4_K) != sizeof(q4_k_block) || ggml_type_size(GGML_TYPE_Q5_K) != sizeof(q5_k_block) ||
        ggml_type_size(GGML_TYPE_Q6_K) != sizeof(q6_k_block) ||
        ggml_type_size(GGML_TYPE_Q8_K) != sizeof(q8_k_block)) {
        return false;
    }
    if (cur->type != GGML_TYPE_F32 || !ggml_is_contiguous(cur) || !ggml_is_contiguous(w) || cur->ne[2] != 1 ||
        cur->ne[3] != 1 || w->ne[2] != 1 || w->ne[3] != 1 || cur->ne[0] != w->ne[0] ||
        w->ne[0] % block_elems(act_type_of(w->type)) != 0) {
        return false;
    }
    return in_plain_cpu_buffer(w);
}

bool specee_kernels_type(int32_t type) {
    return type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q8_0 || type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q5_K ||
           type == GGML_TYPE_Q6_K;
}

static std::atomic<int64_t> built[GGML_TYPE_COUNT], built_quantizations{0};

static const int64_t Q8_0_GGML_FROM = 16;

int64_t specee_kernels_built(int32_t type) {
    return type >= 0 && type < GGML_TYPE_COUNT ? built[type].load() : 0;
}

int64_t specee_kernels_built_quantizations(void) { return built_quantizations.load(); }

ggml_tensor * specee_mul_mat(ggml_context * ctx0, ggml_tensor * w, ggml_tensor * cur, int32_t mode,
                             specee_mm_shared * shared) {
    // one token: ggml's own vec_dot, whose results the kernel reproduces bit for bit (tests/test_kernels.py) and
    // which measured 10-20% faster than the kernel's one-token tile here (docs/kernels.md); the portable mode keeps
    // the kernel for every row count so that tests run it
    // Q8_0 from Q8_0_GGML_FROM tokens: ggml's tinyBLAS, whose 4 x 3 register tiles beat the kernel's 1 x 8 on large
    // batches and whose results equal its one-token vec_dot's bit for bit (tests/test_kernels.py checks 2..512 rows)
    if (!specee_kernels_apply(w, cur, mode) ||
        (mode == SPECEE_KERNELS_AUTO && (cur->ne[1] == 1 || (w->type == GGML_TYPE_Q8_0 && cur->ne[1] >= Q8_0_GGML_FROM)))) {
        return ggml_mul_mat(ctx0, w, cur);
    }
    const int64_t   n   = cur->ne[1];
    const ggml_type act = act_type_of(w->type);
    ggml_tensor *   q   = nullptr;
    int             reader = 0;
    if (shared && shared->cur == cur && shared->act == act && shared->n_readers < SPECEE_KERNELS_MAX_READERS) {
        q      = shared->q; // this input is already quantized to this type: one more reader
        reader = shared->n_readers++;
    } else {
        const act_layout a = layout_of(w->ne[0], n, act);
        // w rides along as an unused source so that the scheduler runs the quantizer where the weight is (the CPU)
        ggml_tensor * qargs[2] = {cur, w};
        q = ggml_custom_4d(ctx0, GGML_TYPE_I8, (int64_t) a.nbytes, 1, 1, 1, qargs, 2, quantize_op, GGML_N_TASKS_MAX,
                           (void *) (intptr_t) act);
        ggml_format_name(q, "%s-%s", cur->name, ggml_type_name(act));
        ++built_quantizations;
        if (shared) {
            *shared = {cur, act, q, 1};
        }
    }
    ++built[w->type];
    const kernel_path path    = mode == SPECEE_KERNELS_PORTABLE ? PATH_PORTABLE : PATH_SIMD;
    ggml_tensor *     args[2] = {w, q};
    return ggml_custom_4d(ctx0, GGML_TYPE_F32, w->ne[1], n, 1, 1, args, 2, matmul_op, GGML_N_TASKS_MAX,
                          (void *) matmul_userdata(path, reader));
}

// ---- one matmul alone (tests, benchmarks)

double specee_kernels_mul_mat(int32_t type, const void * w, int64_t k, int64_t m, const float * x, int64_t n,
                              int32_t mode, int32_t n_threads, int32_t repeats, float * out) {
    if (!specee_kernels_type(type) || k <= 0 ||
        k % block_elems(act_type_of((ggml_type) type)) != 0 || m <= 0 || n <= 0 || repeats <= 0) {
        return -1.0;
    }
    ggml_init_params wp   = {4 * ggml_tensor_overhead(), nullptr, true};
    ggml_context *   wctx = ggml_init(wp);
    ggml_tensor *    wt   = ggml_new_tensor_2d(wctx, (ggml_type) type, k, m);
    ggml_tensor *    xt   = ggml_new_tensor_2d(wctx, GGML_TYPE_F32, k, n);
    ggml_backend_t   cpu  = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(cpu, n_threads > 0 ? n_threads : 1);
    ggml_backend_buffer_t wbuf = ggml_backend_alloc_ctx_tensors(wctx, cpu);
    ggml_backend_tensor_set(wt, w, 0, ggml_nbytes(wt));
    ggml_backend_tensor_set(xt, x, 0, ggml_nbytes(xt));

    ggml_init_params gp   = {16 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true};
    ggml_context *   gctx = ggml_init(gp);
    ggml_tensor *    y    = specee_mul_mat(gctx, wt, xt, mode);
    ggml_cgraph *    gf   = ggml_new_graph(gctx);
    ggml_build_forward_expand(gf, y);
    ggml_gallocr_t galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(cpu));
    ggml_gallocr_alloc_graph(galloc, gf);

    double best = -1.0;
    for (int32_t i = 0; i < repeats; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        ggml_backend_graph_compute(cpu, gf);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best           = best < 0.0 || s < best ? s : best;
    }
    ggml_backend_tensor_get(y, out, 0, (size_t) (m * n) * sizeof(float));

    ggml_gallocr_free(galloc);
    ggml_free(gctx);
    ggml_backend_buffer_free(wbuf);
    ggml_backend_free(cpu);
    ggml_free(wctx);
    return best;
}
