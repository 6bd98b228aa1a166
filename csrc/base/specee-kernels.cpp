// specee-kernels.cpp: this runtime's CPU matmul of Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K weights times 1..n token
// rows, in ggml's graph (docs/kernels.md): the tiles (specee-tiles.h) give the same results for every number of
// tokens, so a token's logits do not depend on its batch: ggml's own vec_dot bits for Q8_0 and the K-quants in the
// file's layout, ggml's repacked Q4_0's bits for Q4_0 in the eight-row layout, this runtime's own sums for Q4_1 and
// for the K-quants in the eight-row layouts (which plain decoding uses too).
//
// Two custom ops on ggml's own threads (ggml_custom_4d: the graph's threadpool, no threads of ours): the
// activations quantized once with ggml's own quantizer for the weight type (the values ggml's mul_mat would use;
// shared by the products of one input), then the matmul, whose threads split the weight's rows.
#include "specee-kernels.h"

#include "specee-tiles-k.h"
#include "specee-tiles-q8_0.h"
#include "specee-tiles-q4_0.h"
#include "specee-tiles-q4_1.h"
#include "specee-tiles-q4_k.h"
#include "specee-tiles-q5_k.h"
#include "specee-tiles-q6_k.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <mutex>
#include <vector>

// the activations' type for a weight type (ggml's vec_dot_type): Q8_1 for Q4_1 (its blocks carry d*sum for the
// min), Q8_0 for Q8_0 and Q4_0, Q8_K for the K-quants (super-blocks of 256 with their sums of 16)
static ggml_type act_type_of(ggml_type w) {
    return w == GGML_TYPE_Q8_0 || w == GGML_TYPE_Q4_0       ? GGML_TYPE_Q8_0
         : w == GGML_TYPE_Q4_K || w == GGML_TYPE_Q5_K || w == GGML_TYPE_Q6_K ? GGML_TYPE_Q8_K
                                                            : GGML_TYPE_Q8_1;
}

// the elements of one weight (and activation) block
static int64_t block_elems(ggml_type act) { return act == GGML_TYPE_Q8_K ? 256 : 32; }

// whether the tiles read each block's d and s from the arrays beside the blocks (Q8_1, Q8_0); Q8_K's tiles read the
// block's own float d
static bool scales_apart(ggml_type act) { return act != GGML_TYPE_Q8_K; }

// ---- the quantized activations: one I8 tensor holding n rows of Q8_1, Q8_0 or Q8_K blocks (ggml's layout, the
// quantizer's output) and, for Q8_1 and Q8_0, each block's d and s (Q8_1's; for Q8_0 the exact sum of its quants,
// which Q4_0's tile takes) as floats, [nb][n_pad], so a tile reads 8 tokens' d or s in one load; then a span counter
// for each matmul that reads them (products of one input share its quantization: Q/K/V, gate/up), each on a cache
// line of its own, set to 0 by the quantizer and taken from by that matmul's threads

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
    const size_t floats = scales_apart(act) ? (size_t) (a.nb * a.n_pad) * sizeof(float) : 0;
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
    for (int64_t t = ith; t < (scales_apart(act) ? a.n_pad : a.n); t += nth) {
        if (t >= a.n) {
            for (int64_t b = 0; b < a.nb; ++b) {
                d[b * a.n_pad + t] = 0.0f;
                s[b * a.n_pad + t] = 0.0f;
            }
            continue;
        }
        uint8_t * row = base + (size_t) (t * a.nb) * a.bsize;
        q((const float *) ((const char *) x->data + t * x->nb[1]), row, x->ne[0]);
        for (int64_t b = 0; scales_apart(act) && b < a.nb; ++b) {
            if (act == GGML_TYPE_Q8_0) {
                const q8_0_block & y   = ((const q8_0_block *) row)[b];
                int32_t            sum = 0;
                for (int i = 0; i < 32; ++i) {
                    sum += y.qs[i];
                }
                d[b * a.n_pad + t] = ggml_fp16_to_fp32(y.d);
                s[b * a.n_pad + t] = (float) sum;
            } else {
                d[b * a.n_pad + t] = ggml_fp16_to_fp32(((const q8_1_block *) row)[b].d);
                s[b * a.n_pad + t] = ggml_fp16_to_fp32(((const q8_1_block *) row)[b].s);
            }
        }
    }
}

// ---- the matmul op: dst [m, n] <- src[0] (a weight type with a tile, [k, m]) x the quantized src[1]; the weight's
// rows in chunks of ROW_CHUNK rows (a chunk stays in cache across the token tiles) in spans of chunks, each thread's
// first span its own and the rest taken in turn from a counter, as ggml's mul_mat does: a thread that the OS holds
// back (another process, the server's event loop) leaves its spans to the others instead of stalling the pass at the
// barrier after the op. Each output element is still computed by one tile call, the same arithmetic whichever thread
// runs it.

enum kernel_path { PATH_PORTABLE = 0, PATH_SIMD = 1 };

// the one-row tile of weight type w, Q8_0 or a K-quant (specee-tiles.h)
static void tile(const specee_tile_args & ta, int nt, ggml_type w, bool simd) {
    if (act_type_of(w) == GGML_TYPE_Q8_K) { // the K-quants
        specee_tile_k(ta, nt, w, simd);
    } else {
        specee_tile_q8_0(ta, nt, simd);
    }
}

// the matmul's userdata: its path, whether the weight holds the eight-row layout, and which of the quantization's
// readers it is (its span counter)
static intptr_t matmul_userdata(kernel_path path, bool rows8, int reader) {
    return (intptr_t) path + 2 * (intptr_t) rows8 + 4 * (intptr_t) reader;
}

static const int64_t ROW_CHUNK = 16;

static void matmul_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const ggml_tensor * w    = dst->src[0];
    const ggml_tensor * qa   = dst->src[1];
    const int64_t       m    = dst->ne[0];
    const act_layout    a    = layout_of(w->ne[0], dst->ne[1], act_type_of(w->type));
    const bool          simd  = (intptr_t) userdata % 2 == PATH_SIMD;
    const bool          rows8 = (intptr_t) userdata / 2 % 2 == 1;
    const uint8_t *     base  = (const uint8_t *) qa->data;
    int64_t *           next  = (int64_t *) (base + a.off_next + 64 * ((intptr_t) userdata / 4));
    // a span: an eighth of a thread's share of the rows, in whole ROW_CHUNKs, read from start to end (rows handed out
    // one ROW_CHUNK at a time interleaved the threads' reads and measured 10-25 % slower from memory)
    const int64_t span    = std::max<int64_t>(1, m / (nth * 8 * ROW_CHUNK)) * ROW_CHUNK;
    const int64_t n_spans = (m + span - 1) / span;

    specee_tile_args ta;
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
                if (w->type == GGML_TYPE_Q4_1 || w->type == GGML_TYPE_Q4_0 || rows8) { // eight rows at a time, the
                    // last of a chunk repeated
                    for (int64_t r0 = c0; r0 < c1; r0 += 8) {
                        specee_rows_args ra;
                        ra.nr     = (int) std::min<int64_t>(c1 - r0, 8);
                        ra.packed = rows8;
                        ra.ahead  = !rows8 && ra.nr == 8 && r0 + 16 <= m ? 8 * w->nb[1] : 0;
                        for (int i = 0; i < 8; ++i) { // rows8: the group's bytes start where its first row's would
                            ra.x[i] = (const char *) w->data + std::min(r0 + i, c1 - 1) * w->nb[1];
                        }
                        ta.out = (float *) dst->data + t0 * ta.stride + r0;
                        if (w->type == GGML_TYPE_Q4_K) {
                            specee_tile_rows_q4_k(ta, ra, nt, simd);
                        } else if (w->type == GGML_TYPE_Q5_K) {
                            specee_tile_rows_q5_k(ta, ra, nt, simd);
                        } else if (w->type == GGML_TYPE_Q6_K) {
                            specee_tile_rows_q6_k(ta, ra, nt, simd);
                        } else if (w->type == GGML_TYPE_Q4_0) {
                            specee_tile_rows_q4_0(ta, ra, nt, simd);
                        } else {
                            specee_tile_rows_q4_1(ta, ra, nt, simd);
                        }
                    }
                    continue;
                }
                for (int64_t r = c0; r < c1; ++r) {
                    ta.x   = (const char *) w->data + r * w->nb[1];
                    ta.out = (float *) dst->data + t0 * ta.stride + r;
                    tile(ta, nt, w->type, simd);
                }
            }
        }
    }
}

// ---- choosing the path

const char * specee_kernels_auto_path(void) {
#ifdef SPECEE_KERNELS_X86
    // ggml's own dot products must be its AVX2 ones (what the tiles reproduce): ggml built with AVX2
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

// ---- the eight-row layout's buffers

static std::mutex                                rows8_mutex;
static std::vector<ggml_backend_buffer_t> rows8_buffers;

bool specee_kernels_rows_fit(const ggml_tensor * w) {
    const bool q4_1 = w->type == GGML_TYPE_Q4_1 && w->ne[0] % 32 == 0 && ggml_type_size(w->type) == sizeof(q4_1_block);
    const bool q4_k = w->type == GGML_TYPE_Q4_K && w->ne[0] % 256 == 0 && ggml_type_size(w->type) == sizeof(q4_k_block);
    const bool q4_0 =
        w->type == GGML_TYPE_Q4_0 && w->ne[0] % 32 == 0 && ggml_type_size(w->type) == sizeof(q4_0_rows8) / 8;
    const bool q6_k = w->type == GGML_TYPE_Q6_K && w->ne[0] % 256 == 0 && ggml_type_size(w->type) == sizeof(q6_k_block);
    const bool q5_k = w->type == GGML_TYPE_Q5_K && w->ne[0] % 256 == 0 && ggml_type_size(w->type) == sizeof(q5_k_block);
    return (q4_1 || q4_k || q4_0 || q5_k || q6_k) && ggml_is_contiguous(w) && w->ne[2] == 1 && w->ne[3] == 1 &&
           w->ne[1] % 8 == 0;
}

void specee_kernels_rows_pack(const ggml_tensor * w, const void * src, void * dst) {
    if (w->type == GGML_TYPE_Q4_K) {
        specee_rows_pack_q4_k(src, dst, w->ne[0], w->ne[1]);
    } else if (w->type == GGML_TYPE_Q4_0) {
        specee_rows_pack_q4_0(src, dst, w->ne[0], w->ne[1]);
    } else if (w->type == GGML_TYPE_Q5_K) {
        specee_rows_pack_q5_k(src, dst, w->ne[0], w->ne[1]);
    } else if (w->type == GGML_TYPE_Q6_K) {
        specee_rows_pack_q6_k(src, dst, w->ne[0], w->ne[1]);
    } else {
        specee_rows_pack_q4_1(src, dst, w->ne[0], w->ne[1]);
    }
}

void specee_kernels_rows_hold(ggml_backend_buffer_t buf) {
    std::lock_guard<std::mutex> lock(rows8_mutex);
    rows8_buffers.push_back(buf);
}

void specee_kernels_rows_release(ggml_backend_buffer_t buf) {
    std::lock_guard<std::mutex> lock(rows8_mutex);
    rows8_buffers.erase(std::remove(rows8_buffers.begin(), rows8_buffers.end(), buf), rows8_buffers.end());
}

static bool held_in_rows8(const ggml_tensor * w) {
    std::lock_guard<std::mutex> lock(rows8_mutex);
    return w->buffer && std::find(rows8_buffers.begin(), rows8_buffers.end(), w->buffer) != rows8_buffers.end();
}

bool specee_kernels_apply(const ggml_tensor * w, const ggml_tensor * cur, int32_t mode) {
    if (held_in_rows8(w)) {
        return true; // only the kernel reads that layout
    }
    if (mode == SPECEE_KERNELS_OFF || (mode == SPECEE_KERNELS_AUTO && strcmp(specee_kernels_auto_path(), "off") == 0)) {
        return false;
    }
    if (!specee_kernels_type(w->type) || ggml_type_size(GGML_TYPE_Q4_1) != sizeof(q4_1_block) ||
        ggml_type_size(GGML_TYPE_Q4_0) != sizeof(q4_0_rows8) / 8 ||
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
    return type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q8_0 || type == GGML_TYPE_Q4_K ||
           type == GGML_TYPE_Q5_K || type == GGML_TYPE_Q6_K;
}

static std::atomic<int64_t> built[GGML_TYPE_COUNT], built_quantizations{0};

static const int64_t Q8_0_GGML_FROM = 16;

int64_t specee_kernels_built(int32_t type) {
    return type >= 0 && type < GGML_TYPE_COUNT ? built[type].load() : 0;
}

int64_t specee_kernels_built_quantizations(void) { return built_quantizations.load(); }

ggml_tensor * specee_mul_mat(ggml_context * ctx0, ggml_tensor * w, ggml_tensor * cur, int32_t mode,
                             specee_mm_shared * shared) {
    // one token of Q8_0 or a K-quant: ggml's own vec_dot, whose results the kernel reproduces bit for bit
    // (tests/test_kernels.py) and which measured 10-20% faster than the kernel's one-token tile here
    // (docs/kernels.md); Q4_1 takes the kernel for every row count (its own sums; faster for one token too), and Q4_0
    // (a tied embedding the loader leaves in the file's layout: ggml's repacked bits, as upstream's lm_head); the
    // portable mode keeps the kernel for every row count so that tests run it
    // Q8_0 from Q8_0_GGML_FROM tokens: ggml's tinyBLAS, whose 4 x 3 register tiles beat the kernel's 1 x 8 on large
    // batches and whose results equal its one-token vec_dot's bit for bit (tests/test_kernels.py checks 2..512 rows)
    const bool rows8 = held_in_rows8(w);
    if (!specee_kernels_apply(w, cur, mode) ||
        (mode == SPECEE_KERNELS_AUTO && !rows8 &&
         ((cur->ne[1] == 1 && w->type != GGML_TYPE_Q4_1 && w->type != GGML_TYPE_Q4_0) ||
                                                   (w->type == GGML_TYPE_Q8_0 && cur->ne[1] >= Q8_0_GGML_FROM)))) {
        return ggml_mul_mat(ctx0, w, cur);
    }
    if (rows8 && (cur->type != GGML_TYPE_F32 || !ggml_is_contiguous(cur) || cur->ne[0] != w->ne[0] ||
                  cur->ne[2] != 1 || cur->ne[3] != 1)) {
        GGML_ABORT("a matrix in the eight-row layout times activations the kernel does not take");
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
    const bool        simd = mode != SPECEE_KERNELS_PORTABLE && strcmp(specee_kernels_auto_path(), "off") != 0;
    const kernel_path path    = simd ? PATH_SIMD : PATH_PORTABLE;
    ggml_tensor *     args[2] = {w, q};
    return ggml_custom_4d(ctx0, GGML_TYPE_F32, w->ne[1], n, 1, 1, args, 2, matmul_op, GGML_N_TASKS_MAX,
                          (void *) matmul_userdata(path, rows8, reader));
}

// ---- this CPU's int8 peak (benchmarks: the roofline a tile is held against)

#ifdef SPECEE_KERNELS_X86
// `iters` rounds of eight independent vpmaddubsw + vpaddw chains: x passes through an empty asm each round and the
// eight y are read from memory through a pointer that does too, so that the compiler can neither hoist nor merge the
// products, and the nine chains' registers fit the sixteen
SPECEE_AVX2 static double int8_peak_avx2(int64_t iters) {
    alignas(32) int8_t ys[8][32];
    for (int i = 0; i < 8; ++i) {
        memset(ys[i], i + 1, sizeof(ys[i]));
    }
    const int8_t * py = &ys[0][0];
    __m256i        x  = _mm256_set1_epi8(3), a[8];
    for (int i = 0; i < 8; ++i) {
        a[i] = _mm256_setzero_si256();
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t it = 0; it < iters; ++it) {
        __asm__ volatile("" : "+x"(x), "+r"(py));
        for (int i = 0; i < 8; ++i) {
            a[i] = _mm256_add_epi16(a[i], _mm256_maddubs_epi16(x, _mm256_load_si256((const __m256i *) (py + 32 * i))));
        }
    }
    const double s   = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    __m256i      sum = a[0];
    for (int i = 1; i < 8; ++i) {
        sum = _mm256_add_epi16(sum, a[i]);
    }
    volatile int keep = _mm256_extract_epi16(sum, 0); // the chains' results are used
    (void) keep;
    return (double) iters * 8.0 * 32.0 / s;
}
#endif

double specee_kernels_int8_peak(int64_t iters) {
#ifdef SPECEE_KERNELS_X86
    if (iters > 0 && strcmp(specee_kernels_auto_path(), "off") != 0) {
        return int8_peak_avx2(iters);
    }
#endif
    (void) iters;
    return -1.0;
}

// ---- one matmul alone (tests, benchmarks)

double specee_kernels_mul_mat(int32_t type, const void * w, int64_t k, int64_t m, const float * x, int64_t n,
                              int32_t mode, int32_t n_threads, int32_t repeats, bool rows8, float * out) {
    // Q4_0: in the eight-row layout (the kernel), or with mode off in ggml's repacked layout as its loader holds it
    const bool q4_0 = type == GGML_TYPE_Q4_0 && (rows8 || mode == SPECEE_KERNELS_OFF);
    if ((!specee_kernels_type(type) && !q4_0) || k <= 0 ||
        k % block_elems(act_type_of((ggml_type) type)) != 0 || m <= 0 || n <= 0 || repeats <= 0 ||
        (rows8 && ((type != GGML_TYPE_Q4_1 && type != GGML_TYPE_Q4_K && type != GGML_TYPE_Q5_K &&
                    type != GGML_TYPE_Q6_K && !q4_0) ||
                   m % 8 != 0))) {
        return -1.0;
    }
    ggml_init_params wp   = {4 * ggml_tensor_overhead(), nullptr, true};
    ggml_context *   wctx = ggml_init(wp);
    ggml_tensor *    wt   = ggml_new_tensor_2d(wctx, (ggml_type) type, k, m);
    ggml_tensor *    xt   = ggml_new_tensor_2d(wctx, GGML_TYPE_F32, k, n);
    ggml_backend_t   cpu  = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(cpu, n_threads > 0 ? n_threads : 1);
    ggml_backend_buffer_t repacked = nullptr; // Q4_0 under ggml: its repacked layout (GEMV and GEMM), m a multiple of 8
    if (q4_0 && !rows8 && m % 8 == 0) {
        ggml_backend_dev_t dev       = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        auto               get_extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
            ggml_backend_dev_backend_reg(dev), "ggml_backend_dev_get_extra_bufts");
        for (ggml_backend_buffer_type_t * b = get_extra ? get_extra(dev) : nullptr; b && *b && !repacked; ++b) {
            if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) {
                repacked = ggml_backend_buft_alloc_buffer(*b, ggml_backend_buft_get_alloc_size(*b, wt));
                ggml_backend_tensor_alloc(repacked, wt, ggml_backend_buffer_get_base(repacked));
            }
        }
    }
    ggml_backend_buffer_t wbuf = ggml_backend_alloc_ctx_tensors(wctx, cpu);
    if (rows8) {
        specee_kernels_rows_pack(wt, w, wt->data);
        specee_kernels_rows_hold(wbuf);
    } else {
        ggml_backend_tensor_set(wt, w, 0, ggml_nbytes(wt));
    }
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
    specee_kernels_rows_release(wbuf);
    ggml_backend_buffer_free(wbuf);
    if (repacked) {
        ggml_backend_buffer_free(repacked);
    }
    ggml_backend_free(cpu);
    ggml_free(wctx);
    return best;
}
