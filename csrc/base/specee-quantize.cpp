// specee-quantize.cpp: rows of floats into any ggml type, with ggml's own quantizers (ggml_quantize_chunk, what
// llama-quantize runs), so `python -m specee.convert quantize` and `convert hf --outtype` make every type upstream
// makes, with an importance matrix or without, byte for byte
#include "specee-impl.h"
#include "specee.h"

#include "ggml.h"

#include <cstdint>

extern "C" int64_t specee_quantize(int32_t type, const float * src, void * dst, int64_t n_rows, int64_t n_per_row,
                                   const float * imatrix) {
    return specee_guard<int64_t>(-1, [&]() -> int64_t {
        if (type < 0 || type >= GGML_TYPE_COUNT || ggml_type_size((ggml_type) type) == 0) {
            specee_fail("type %d is not a ggml tensor type", type);
        }
        const ggml_type t = (ggml_type) type;
        if (!imatrix && ggml_quantize_requires_imatrix(t)) {
            specee_fail("%s needs an importance matrix (llama-imatrix's output, --imatrix FILE) to keep its quality",
                        ggml_type_name(t));
        }
        if (n_rows < 0 || n_per_row <= 0 || n_per_row % ggml_blck_size(t) != 0) {
            specee_fail("rows of %lld values cannot be %s (a row must be whole blocks of %lld values; rows: %lld)",
                        (long long) n_per_row, ggml_type_name(t), (long long) ggml_blck_size(t), (long long) n_rows);
        }
        if (!dst) {
            return (int64_t) ggml_row_size(t, n_per_row) * n_rows;
        }
        if (!src) {
            specee_fail("no rows to quantize");
        }
        ggml_quantize_init(t);
        return (int64_t) ggml_quantize_chunk(t, src, dst, 0, n_rows, n_per_row, imatrix);
    });
}
