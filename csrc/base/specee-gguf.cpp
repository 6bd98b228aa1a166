// specee-gguf.cpp: reading a GGUF file: opening it (ggml's reasons for a refusal), typed metadata with bounds,
// printable metadata, tensors by name with checked shapes and types, mapping the file and pointing its tensors
// into the mapping. Shared by the model's file and a draft head file.
#include "specee-gguf.h"

#include "specee-impl.h"

#include "ggml-cpu.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

specee_gguf_file::~specee_gguf_file() {
    if (buf) {
        ggml_backend_buffer_free(buf);
    }
    if (ctx_meta) {
        ggml_free(ctx_meta);
    }
    if (gguf) {
        gguf_free(gguf);
    }
    if (addr) {
        if (mapped) {
            munmap(addr, size);
        } else {
            free(addr);
        }
    }
}

gguf_context * specee_gguf_open(const char * path, ggml_context ** ctx_meta, std::string & why) {
    std::vector<std::string> lines;
    specee_log_capture_errors(&lines);
    gguf_init_params gp = {/*no_alloc =*/true, /*ctx =*/ctx_meta};
    gguf_context *   g  = gguf_init_from_file(path, gp);
    specee_log_capture_errors(nullptr);
    for (std::string line : lines) {
        // "gguf_init_from_file_impl: duplicate tensor name 'x' ...\n" -> "duplicate tensor name 'x' ..."
        const size_t colon = line.find(": ");
        if (colon != std::string::npos && line.find(' ') > colon) {
            line.erase(0, colon + 2);
        }
        while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) {
            line.pop_back();
        }
        why += (why.empty() ? "" : "; ") + line;
    }
    if (!g && why.empty()) {
        why = "no reason given";
    }
    return g;
}

// ---- metadata ------------------------------------------------------------------------------------

std::string specee_gguf_key(const char * fmt, const std::string & arch) { return specee_format(fmt, arch.c_str()); }

// the entries of a per-layer int32/uint32 array key (e.g. head_count_kv), which must all agree for this runtime
static int64_t uniform_array_int(const gguf_context * g, int64_t id, const std::string & key) {
    const enum gguf_type at = gguf_get_arr_type(g, id);
    const size_t         n  = gguf_get_arr_n(g, id);
    if ((at != GGUF_TYPE_UINT32 && at != GGUF_TYPE_INT32) || n == 0) {
        specee_fail("metadata key '%s' has an unexpected array type", key.c_str());
    }
    const uint32_t * a = (const uint32_t *) gguf_get_arr_data(g, id);
    for (size_t i = 1; i < n; ++i) {
        if (a[i] != a[0]) {
            specee_fail("metadata '%s' varies per layer, which is not supported", key.c_str());
        }
    }
    return at == GGUF_TYPE_UINT32 ? (int64_t) a[0] : (int64_t) (int32_t) a[0];
}

bool specee_gguf_get_int(const gguf_context * g, const std::string & key, uint32_t & out, int64_t lo, int64_t hi,
                         bool required) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0) {
        if (required) {
            specee_fail("missing metadata key '%s'", key.c_str());
        }
        return false;
    }
    int64_t v = 0;
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT8:  v = gguf_get_val_u8(g, id); break;
        case GGUF_TYPE_INT8:   v = gguf_get_val_i8(g, id); break;
        case GGUF_TYPE_UINT16: v = gguf_get_val_u16(g, id); break;
        case GGUF_TYPE_INT16:  v = gguf_get_val_i16(g, id); break;
        case GGUF_TYPE_UINT32: v = gguf_get_val_u32(g, id); break;
        case GGUF_TYPE_INT32:  v = gguf_get_val_i32(g, id); break;
        case GGUF_TYPE_UINT64: v = (int64_t) std::min<uint64_t>(gguf_get_val_u64(g, id), INT64_MAX); break;
        case GGUF_TYPE_INT64:  v = gguf_get_val_i64(g, id); break;
        case GGUF_TYPE_ARRAY:  v = uniform_array_int(g, id, key); break;
        default: specee_fail("metadata key '%s' is not an integer", key.c_str());
    }
    if (v < lo || v > hi) {
        specee_fail("invalid hyperparameters: %s = %lld is out of range (expected %lld..%lld)", key.c_str(),
                    (long long) v, (long long) lo, (long long) hi);
    }
    out = (uint32_t) v;
    return true;
}

static bool get_f32(const gguf_context * g, const std::string & key, float & out) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0) {
        return false;
    }
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_FLOAT32: out = gguf_get_val_f32(g, id); break;
        case GGUF_TYPE_FLOAT64: out = (float) gguf_get_val_f64(g, id); break;
        default: specee_fail("metadata key '%s' is not a float", key.c_str());
    }
    return true;
}

bool specee_gguf_get_f32_in(const gguf_context * g, const std::string & key, float & out, float lo, float hi) {
    if (!get_f32(g, key, out)) {
        return false;
    }
    if (!std::isfinite(out) || out <= lo || out >= hi) {
        specee_fail("invalid hyperparameters: %s = %g (expected a finite number > %g%s)", key.c_str(), (double) out,
                    (double) lo, std::isfinite(hi) ? specee_format(" and < %g", (double) hi).c_str() : "");
    }
    return true;
}

std::string specee_gguf_get_str(const gguf_context * g, const std::string & key) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_STRING) {
        return "";
    }
    return gguf_get_val_str(g, id);
}

static std::string scalar_str(enum gguf_type t, const void * p) {
    switch (t) {
        case GGUF_TYPE_UINT8:   return std::to_string(*(const uint8_t *) p);
        case GGUF_TYPE_INT8:    return std::to_string(*(const int8_t *) p);
        case GGUF_TYPE_UINT16:  return std::to_string(*(const uint16_t *) p);
        case GGUF_TYPE_INT16:   return std::to_string(*(const int16_t *) p);
        case GGUF_TYPE_UINT32:  return std::to_string(*(const uint32_t *) p);
        case GGUF_TYPE_INT32:   return std::to_string(*(const int32_t *) p);
        case GGUF_TYPE_UINT64:  return std::to_string(*(const uint64_t *) p);
        case GGUF_TYPE_INT64:   return std::to_string(*(const int64_t *) p);
        case GGUF_TYPE_FLOAT32: return specee_format("%g", *(const float *) p);
        case GGUF_TYPE_FLOAT64: return specee_format("%g", *(const double *) p);
        case GGUF_TYPE_BOOL:    return *(const int8_t *) p ? "true" : "false";
        default:                return "?";
    }
}

static size_t scalar_size(enum gguf_type t) {
    switch (t) {
        case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL:     return 1;
        case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16:                        return 2;
        case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
        default:                                                            return 8;
    }
}

std::string specee_gguf_value_str(const gguf_context * g, int64_t id) {
    const enum gguf_type t = gguf_get_kv_type(g, id);
    if (t == GGUF_TYPE_STRING) {
        return gguf_get_val_str(g, id);
    }
    if (t != GGUF_TYPE_ARRAY) {
        return scalar_str(t, gguf_get_val_data(g, id));
    }
    const enum gguf_type at = gguf_get_arr_type(g, id);
    const size_t         n  = gguf_get_arr_n(g, id);
    if (n > 16 || at == GGUF_TYPE_ARRAY) {
        return specee_format("[%s x %zu]", gguf_type_name(at), n);
    }
    std::string s = "[";
    for (size_t i = 0; i < n; ++i) {
        if (i) {
            s += ", ";
        }
        if (at == GGUF_TYPE_STRING) {
            s += gguf_get_arr_str(g, id, i);
        } else {
            s += scalar_str(at, (const char *) gguf_get_arr_data(g, id) + i * scalar_size(at));
        }
    }
    return s + "]";
}

// ---- tensors -------------------------------------------------------------------------------------

static std::string shape_str(const int64_t * ne, int n) {
    std::string s = "[";
    for (int i = 0; i < n; ++i) {
        s += (i ? ", " : "") + std::to_string(ne[i]);
    }
    return s + "]";
}

ggml_tensor * specee_gguf_tensor(ggml_context * cm, const std::string & path, specee_tensor which, int il,
                                 std::vector<int64_t> shape, bool required) {
    const std::string name = specee_tensor_name(which, il);
    ggml_tensor *     t    = ggml_get_tensor(cm, name.c_str());
    if (!t) {
        if (required) {
            specee_fail("missing tensor '%s' in %s", name.c_str(), path.c_str());
        }
        return nullptr;
    }
    bool ok = ggml_n_dims(t) <= (int) shape.size();
    for (size_t i = 0; ok && i < shape.size(); ++i) {
        ok = t->ne[i] == shape[i];
    }
    if (!ok) {
        specee_fail("tensor '%s' has the wrong shape: expected %s, got %s", name.c_str(),
                    shape_str(shape.data(), (int) shape.size()).c_str(), shape_str(t->ne, ggml_n_dims(t)).c_str());
    }
    // vectors (norms, biases, RoPE factors) are added and multiplied elementwise to F32 activations, which ggml
    // does only with F32; matrices are multiplied (or their rows read): a type with CPU kernels for that
    if (shape.size() == 1 && t->type != GGML_TYPE_F32) {
        specee_fail("tensor '%s' in %s has type %s: a vector (norm, bias) must be F32", name.c_str(), path.c_str(),
                    ggml_type_name(t->type));
    }
    if (shape.size() > 1 && t->type != GGML_TYPE_F32 &&
        (!ggml_get_type_traits(t->type)->to_float || !ggml_get_type_traits_cpu(t->type)->vec_dot)) {
        specee_fail("tensor '%s' in %s has type %s, which has no matrix kernels (F32, F16, BF16 or a quantized type)",
                    name.c_str(), path.c_str(), ggml_type_name(t->type));
    }
    return t;
}

// ---- the file's data -----------------------------------------------------------------------------

void specee_gguf_map(specee_gguf_file & f, const std::string & path, bool use_mmap) {
    const int fd = open(path.c_str(), O_RDONLY);
    if (fd < 0) {
        specee_fail("cannot open model file '%s': %s", path.c_str(), strerror(errno));
    }
    struct stat st;
    fstat(fd, &st);
    f.size = (size_t) st.st_size;
    if (use_mmap) {
        void * p = mmap(nullptr, f.size, PROT_READ, MAP_SHARED, fd, 0);
        close(fd);
        if (p == MAP_FAILED) {
            specee_fail("cannot mmap '%s': %s", path.c_str(), strerror(errno));
        }
        f.addr   = p;
        f.mapped = true;
        return;
    }
    f.addr = aligned_alloc(4096, (f.size + 4095) / 4096 * 4096);
    if (!f.addr) {
        close(fd);
        specee_fail("out of memory reading '%s' (%zu bytes)", path.c_str(), f.size);
    }
    size_t done = 0;
    while (done < f.size) {
        const ssize_t r = read(fd, (char *) f.addr + done, f.size - done);
        if (r <= 0) {
            close(fd);
            specee_fail("error reading '%s'", path.c_str());
        }
        done += (size_t) r;
    }
    close(fd);
}

void specee_gguf_release(const specee_gguf_file & f, const void * data, size_t n) {
    const uintptr_t lo = (uintptr_t) data, hi = lo + n, base = (uintptr_t) f.addr;
    if (!f.addr || lo < base || hi > base + f.size) {
        return;
    }
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    // a mapping's neighbours on the edge pages fault back in from the file; an owned copy keeps its edge pages
    const uintptr_t from = f.mapped ? lo / page * page : (lo + page - 1) / page * page;
    const uintptr_t to   = f.mapped ? (hi + page - 1) / page * page : hi / page * page;
    if (to > from) {
        madvise((void *) from, to - from, MADV_DONTNEED);
    }
}

void specee_gguf_bind_tensors(specee_gguf_file & f, const std::string & path) {
    const size_t data_offset = gguf_get_data_offset(f.gguf);
    for (int64_t i = 0; i < gguf_get_n_tensors(f.gguf); ++i) {
        const char *  name = gguf_get_tensor_name(f.gguf, i);
        ggml_tensor * t    = ggml_get_tensor(f.ctx_meta, name);
        const size_t  off  = data_offset + gguf_get_tensor_offset(f.gguf, i);
        if (off + ggml_nbytes(t) > f.size) {
            specee_fail("'%s' is truncated: tensor '%s' needs bytes up to %zu but the file has %zu", path.c_str(), name,
                        off + ggml_nbytes(t), f.size);
        }
    }
    f.buf = ggml_backend_cpu_buffer_from_ptr(f.addr, f.size);
    if (!f.buf) {
        specee_fail("cannot create a backend buffer over '%s'", path.c_str());
    }
    // weights: the scheduler runs an op where its weights are, instead of copying them to another device
    ggml_backend_buffer_set_usage(f.buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    for (int64_t i = 0; i < gguf_get_n_tensors(f.gguf); ++i) {
        ggml_tensor * t = ggml_get_tensor(f.ctx_meta, gguf_get_tensor_name(f.gguf, i));
        if (ggml_backend_tensor_alloc(f.buf, t, (char *) f.addr + data_offset + gguf_get_tensor_offset(f.gguf, i)) !=
            GGML_STATUS_SUCCESS) {
            specee_fail("cannot place tensor '%s'", ggml_get_name(t));
        }
    }
}

// ---- tensors of the file mapping as floats --------------------------------------------------------------

// one row of a 2-D tensor of the file mapping as floats
void specee_gguf_row_f32(const ggml_tensor * t, int64_t row, float * out) {
    const char * src = (const char *) t->data + row * t->nb[1];
    if (t->type == GGML_TYPE_F32) {
        memcpy(out, src, t->ne[0] * sizeof(float));
        return;
    }
    const ggml_type_traits * tt = ggml_get_type_traits(t->type);
    if (!tt->to_float) {
        specee_fail("tensor '%s' has type %s, which cannot be read as floats", ggml_get_name(t), ggml_type_name(t->type));
    }
    tt->to_float(src, out, t->ne[0]);
}

// a tensor of the file mapping as floats: its own data when it is F32 (the exported predictors are), else
// converted into `scratch`
const float * specee_gguf_tensor_f32(const ggml_tensor * t, std::vector<float> & scratch) {
    if (t->type == GGML_TYPE_F32 && ggml_is_contiguous(t)) {
        return (const float *) t->data;
    }
    scratch.resize((size_t) ggml_nelements(t));
    for (int64_t r = 0; r < ggml_nrows(t); ++r) {
        specee_gguf_row_f32(t, r, scratch.data() + r * t->ne[0]);
    }
    return scratch.data();
}
