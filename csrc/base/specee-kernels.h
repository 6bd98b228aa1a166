// specee-kernels.h: the CPU matmul kernels of this runtime: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K weights times a small
// batch of token rows, with each weight block unpacked once for every row of a tile, and results that do not depend on
// how many tokens share a pass: ggml's own bits (Q8_0 and the K-quants in the file's layout: its vec_dot; Q4_0: its
// repacked GEMV's) or this runtime's own sums (Q4_1, and the K-quants in the eight-row layouts)
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>

// which kernels a context's graphs use for the weights they can (a context option, `kernels`)
enum specee_kernels_mode {
    SPECEE_KERNELS_AUTO     = 0, // the SIMD path where this CPU and ggml's build match it, else ggml's mul_mat
    SPECEE_KERNELS_PORTABLE = 1, // the portable C path (same arithmetic, slower): tests, and CPUs without AVX2
    SPECEE_KERNELS_OFF      = 2, // ggml's mul_mat everywhere (the loader leaves Q4_1 in the file's layout then)
};

// how many products may read one quantization of their input
#define SPECEE_KERNELS_MAX_READERS 4

// the quantized activations of one input, shared by the products that read it (Q, K and V; gate and up): a graph
// builder's local while it builds those products, never kept across graphs
struct specee_mm_shared {
    const ggml_tensor * cur       = nullptr; // the input quantized
    ggml_type           act       = GGML_TYPE_COUNT;
    ggml_tensor *       q         = nullptr; // its quantization (the quantizer's op)
    int                 n_readers = 0;
};

// w x [n_out, n_tokens] for a weight w [n_in, n_out] and activations cur [n_in, n_tokens] F32: this runtime's kernel
// (two custom ops: cur quantized once to Q8_1, Q8_0 or Q8_K, then the matmul) where w has a tile in a plain CPU buffer
// and the mode allows it, ggml_mul_mat otherwise. With `shared`, a quantization of cur to the same type that an
// earlier product of the same `shared` built is read again instead of quantizing cur once more (same values)
ggml_tensor * specee_mul_mat(ggml_context * ctx0, ggml_tensor * w, ggml_tensor * cur, int32_t mode,
                             specee_mm_shared * shared = nullptr);

// whether this runtime has a kernel for weights of ggml type `type` in their file's layout (Q4_0, Q4_1, Q8_0, Q4_K,
// Q5_K, Q6_K)
bool specee_kernels_type(int32_t type);

// whether specee_mul_mat(w, cur) uses this runtime's kernel under `mode`
bool specee_kernels_apply(const ggml_tensor * w, const ggml_tensor * cur, int32_t mode);

// the path SPECEE_KERNELS_AUTO takes on this machine: "avx2" or "off"
const char * specee_kernels_auto_path(void);

// how many weight products of ggml type `type` this process has built with the kernel so far (tests: which weights
// a model's graphs route through it)
int64_t specee_kernels_built(int32_t type);

// how many quantizations of activations those products have built (fewer than products where inputs are shared)
int64_t specee_kernels_built_quantizations(void);

// ---- Q4_1, Q4_K and Q4_0 in this runtime's eight-row layouts (the tile's transposition done once, at load;
// docs/kernels.md)

// whether w can be held in one: Q4_1, Q4_K or Q4_0, 2-D, contiguous, its rows a multiple of 8
bool specee_kernels_rows_fit(const ggml_tensor * w);

// w's bytes in the file's layout (src) written to dst in the eight-row layout (ggml_nbytes(w) bytes)
void specee_kernels_rows_pack(const ggml_tensor * w, const void * src, void * dst);

// a buffer whose Q4_1 tensors hold the eight-row layout: every product of them goes to the kernel whatever the
// mode (ggml's mul_mat cannot read it); released before the buffer is freed
void specee_kernels_rows_hold(ggml_backend_buffer_t buf);
void specee_kernels_rows_release(ggml_backend_buffer_t buf);

// One matmul on ggml's CPU backend, for tests and benchmarks: out [n][m] <- the matrix w of ggml type `type` (one
// with a kernel; m rows of k, ggml's bytes) times the activations x [n][k] under `mode` (SPECEE_KERNELS_OFF: ggml's
// mul_mat; Q4_0 then in ggml's repacked layout), computed `repeats` times with n_threads threads; with `rows8` a
// Q4_1, Q4_0 or K-quant matrix (m a multiple of 8) is held in its eight-row layout as the loader holds it; returns
// the fastest compute's seconds (-1: bad arguments)
double specee_kernels_mul_mat(int32_t type, const void * w, int64_t k, int64_t m, const float * x, int64_t n,
                              int32_t mode, int32_t n_threads, int32_t repeats, bool rows8, float * out);

// This CPU's peak rate of the tiles' integer products on one thread, byte products per second: `iters` rounds of eight
// independent vpmaddubsw (32 byte products each) and vpaddw chains (benchmarks: a tile's roofline; -1 without AVX2)
double specee_kernels_int8_peak(int64_t iters);
