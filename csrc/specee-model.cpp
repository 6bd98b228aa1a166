// specee-model.cpp: reading a llama-architecture GGUF: hyperparameters, metadata, weights (mmapped)
#include "specee-model.h"

#include "specee-arch.h"
#include "specee-impl.h"
#include "specee-placement.h"
#include "specee-vocab.h"
#include "specee.h"

#include "ggml-alloc.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <map>
#include <memory>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

// ---- errors and logging --------------------------------------------------------------------------

static thread_local std::string g_last_error;
static bool                     g_verbose = false;

void specee_set_error(const std::string & msg) { g_last_error = msg; }
bool specee_verbose() { return g_verbose; }

std::string specee_format(const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char buf[1024];
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    return buf;
}

void specee_fail(const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char buf[1024];
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    throw specee_error(buf);
}

// ggml's error lines while gguf_open runs on this thread: ggml's GGUF parser says why it rejects a file only
// through its log
static thread_local std::vector<std::string> * g_captured = nullptr;
static thread_local bool                       g_last_was_error = false;

static void log_callback(ggml_log_level level, const char * text, void *) {
    // errors reach the caller through specee_last_error(); ggml's own lines only when verbose
    if (g_captured) {
        if (level == GGML_LOG_LEVEL_ERROR) {
            g_captured->emplace_back(text);
        } else if (level == GGML_LOG_LEVEL_CONT && g_last_was_error && !g_captured->empty()) {
            g_captured->back() += text;
        }
    }
    g_last_was_error = level == GGML_LOG_LEVEL_ERROR || (level == GGML_LOG_LEVEL_CONT && g_last_was_error);
    if (g_verbose) {
        fputs(text, stderr);
    }
}

extern "C" const char * specee_last_error(void) { return g_last_error.c_str(); }

extern "C" void specee_log_set_verbose(bool verbose) {
    g_verbose = verbose;
    ggml_log_set(log_callback, nullptr);
}

// gguf_init_from_file, with the reasons ggml logs for a rejected file joined into `why` ("no reason given" when it
// logged none)
static gguf_context * gguf_open(const char * path, ggml_context ** ctx_meta, std::string & why) {
    std::vector<std::string> lines;
    ggml_log_set(log_callback, nullptr);
    g_captured          = &lines;
    gguf_init_params gp = {/*no_alloc =*/true, /*ctx =*/ctx_meta};
    gguf_context *   g  = gguf_init_from_file(path, gp);
    g_captured          = nullptr;
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

// ---- GGUF metadata helpers ---------------------------------------------------------------------

static std::string key_of(const char * fmt, const std::string & arch) { return specee_format(fmt, arch.c_str()); }

// An integer key (any integer type, or a per-layer array of int32/uint32 whose entries agree) that must lie in
// [lo, hi]; false when absent and not required
static bool get_int(const gguf_context * g, const std::string & key, uint32_t & out, int64_t lo, int64_t hi,
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
        case GGUF_TYPE_ARRAY: {
            // per-layer arrays (e.g. head_count_kv): all entries must agree for this runtime
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
            v = at == GGUF_TYPE_UINT32 ? (int64_t) a[0] : (int64_t) (int32_t) a[0];
            break;
        }
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

// a float key that, when present, must be finite and in (lo, hi)
static bool get_f32_in(const gguf_context * g, const std::string & key, float & out, float lo, float hi) {
    if (!get_f32(g, key, out)) {
        return false;
    }
    if (!std::isfinite(out) || out <= lo || out >= hi) {
        specee_fail("invalid hyperparameters: %s = %g (expected a finite number > %g%s)", key.c_str(), (double) out,
                    (double) lo, std::isfinite(hi) ? specee_format(" and < %g", (double) hi).c_str() : "");
    }
    return true;
}

static std::string get_str(const gguf_context * g, const std::string & key) {
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

static std::string value_str(const gguf_context * g, int64_t id) {
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

// ---- loading -------------------------------------------------------------------------------------

specee_model::~specee_model() {
    specee_vocab_free(vocab);
    for (ggml_backend_buffer_t b : buf_dev) {
        ggml_backend_buffer_free(b);
    }
    for (ggml_context * c : ctx_dev) {
        ggml_free(c);
    }
    for (ggml_backend_buffer_t b : buf_repack) {
        ggml_backend_buffer_free(b);
    }
    for (ggml_context * c : ctx_repack) {
        ggml_free(c);
    }
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

static std::string shape_str(const int64_t * ne, int n) {
    std::string s = "[";
    for (int i = 0; i < n; ++i) {
        s += (i ? ", " : "") + std::to_string(ne[i]);
    }
    return s + "]";
}

static ggml_tensor * get_tensor_in(ggml_context * cm, const std::string & path, specee_tensor which, int il,
                                   std::vector<int64_t> shape, bool required = true) {
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

static ggml_tensor * get_tensor(specee_model & m, specee_tensor which, int il, std::vector<int64_t> shape,
                                bool required = true) {
    return get_tensor_in(m.ctx_meta, m.path, which, il, std::move(shape), required);
}

static std::string size_label(uint64_t n_params) {
    if (n_params >= 1000000000ull) {
        return specee_format("%.1fB", n_params / 1e9);
    }
    if (n_params >= 1000000ull) {
        return specee_format("%.0fM", n_params / 1e6);
    }
    return specee_format("%.0fK", n_params / 1e3);
}

// Bounds on what a file may declare: far beyond any Llama, they reject corrupt values before anything is sized by
// them and keep the sizes computed from them (head size x heads, ...) inside 32 bits
static const int64_t MAX_LAYERS   = 4096;
static const int64_t MAX_EMBD     = 1 << 20;
static const int64_t MAX_FF       = 1 << 22;
static const int64_t MAX_HEADS    = 4096;
static const int64_t MAX_HEAD_DIM = 1 << 16;

static void load_hparams(specee_model & m, const std::string & arch) {
    const gguf_context * g  = m.gguf;
    specee_hparams &     hp = m.hparams;
    get_int(g, key_of(SPECEE_KEY_BLOCK_COUNT, arch), hp.n_layer, 1, MAX_LAYERS, true);
    get_int(g, key_of(SPECEE_KEY_EMBEDDING_LENGTH, arch), hp.n_embd, 1, MAX_EMBD, true);
    get_int(g, key_of(SPECEE_KEY_FEED_FORWARD_LENGTH, arch), hp.n_ff, 1, MAX_FF, true);
    get_int(g, key_of(SPECEE_KEY_HEAD_COUNT, arch), hp.n_head, 1, MAX_HEADS, true);
    hp.n_head_kv = hp.n_head;
    get_int(g, key_of(SPECEE_KEY_HEAD_COUNT_KV, arch), hp.n_head_kv, 1, MAX_HEADS, false);
    hp.n_ctx_train = 4096;
    get_int(g, key_of(SPECEE_KEY_CONTEXT_LENGTH, arch), hp.n_ctx_train, 1, INT32_MAX, false); // positions are int32
    if (hp.n_head % hp.n_head_kv != 0) {
        specee_fail("invalid hyperparameters: n_head=%u is not a multiple of n_head_kv=%u", hp.n_head, hp.n_head_kv);
    }
    hp.n_embd_head_k = hp.n_embd / hp.n_head;
    get_int(g, key_of(SPECEE_KEY_KEY_LENGTH, arch), hp.n_embd_head_k, 1, MAX_HEAD_DIM, false);
    hp.n_embd_head_v = hp.n_embd_head_k;
    get_int(g, key_of(SPECEE_KEY_VALUE_LENGTH, arch), hp.n_embd_head_v, 1, MAX_HEAD_DIM, false);
    hp.n_rot = hp.n_embd_head_k;
    get_int(g, key_of(SPECEE_KEY_ROPE_DIMENSION_COUNT, arch), hp.n_rot, 0, MAX_HEAD_DIM, false);
    if (hp.n_embd_head_k == 0 || hp.n_rot != hp.n_embd_head_k || hp.n_embd_head_k % 2 != 0) {
        specee_fail("invalid hyperparameters: rope dimension %u must equal the head size %u (even, > 0)", hp.n_rot,
                    hp.n_embd_head_k);
    }
    // a NaN, infinite, zero or negative epsilon or RoPE base computes NaN (or trips ggml's asserts) at the first
    // evaluation: refused here
    get_f32_in(g, key_of(SPECEE_KEY_LAYER_NORM_RMS_EPS, arch), hp.f_norm_rms_eps, 0.0f, 1.0f);
    get_f32_in(g, key_of(SPECEE_KEY_ROPE_FREQ_BASE, arch), hp.rope_freq_base, 0.0f, INFINITY);

    // RoPE scaling: linear (position interpolation) and YaRN; Llama 3's per-frequency factors come
    // as the rope_freqs tensor
    const std::string scale_type = get_str(g, key_of(SPECEE_KEY_ROPE_SCALING_TYPE, arch));
    if (!scale_type.empty() && scale_type != "none" && scale_type != "linear" && scale_type != "yarn") {
        specee_fail("unsupported rope scaling type '%s' (none, linear and yarn are supported)", scale_type.c_str());
    }
    float factor = 0.0f;
    if (scale_type != "none" && !get_f32_in(g, key_of(SPECEE_KEY_ROPE_SCALING_FACTOR, arch), factor, 0.0f, INFINITY)) {
        get_f32_in(g, key_of(SPECEE_KEY_ROPE_SCALE_LINEAR, arch), factor, 0.0f, INFINITY);
    }
    hp.rope_freq_scale = factor > 0.0f ? 1.0f / factor : 1.0f;
    hp.rope_ext_factor = scale_type == "yarn" ? 1.0f : 0.0f;
    hp.n_ctx_orig      = hp.n_ctx_train;
    get_int(g, key_of(SPECEE_KEY_ROPE_SCALING_ORIG_CTX_LEN, arch), hp.n_ctx_orig, 1, INT32_MAX, false);
}

// The blk.N tensors must be those of layers 0..n_layer-1: a file whose block_count is smaller than its layers
// would run a truncated model (missing layers are found by get_tensor). Exit predictors (blk.N.pred.*) are checked
// by read_exit.
static void check_layer_tensors(const specee_model & m, const std::string & arch) {
    for (ggml_tensor * t = ggml_get_first_tensor(m.ctx_meta); t; t = ggml_get_next_tensor(m.ctx_meta, t)) {
        const char * name = ggml_get_name(t);
        if (strncmp(name, "blk.", 4) != 0 || strstr(name, ".pred.")) {
            continue;
        }
        char *          end = nullptr;
        const long long il  = strtoll(name + 4, &end, 10);
        if (end == name + 4 || *end != '.' || il < 0 || il >= (long long) m.hparams.n_layer) {
            specee_fail("tensor '%s' in %s is not one of layers 0..%u: %s = %u does not match the file's blk.* "
                        "tensors", name, m.path.c_str(), m.hparams.n_layer - 1,
                        key_of(SPECEE_KEY_BLOCK_COUNT, arch).c_str(), m.hparams.n_layer);
        }
    }
}

static void map_path(const std::string & path, bool use_mmap, void *& addr, size_t & size, bool & mapped) {
    const int fd = open(path.c_str(), O_RDONLY);
    if (fd < 0) {
        specee_fail("cannot open model file '%s': %s", path.c_str(), strerror(errno));
    }
    struct stat st;
    fstat(fd, &st);
    size = (size_t) st.st_size;
    if (use_mmap) {
        void * p = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
        close(fd);
        if (p == MAP_FAILED) {
            specee_fail("cannot mmap '%s': %s", path.c_str(), strerror(errno));
        }
        addr   = p;
        mapped = true;
        return;
    }
    addr = aligned_alloc(4096, (size + 4095) / 4096 * 4096);
    if (!addr) {
        close(fd);
        specee_fail("out of memory reading '%s' (%zu bytes)", path.c_str(), size);
    }
    size_t done = 0;
    while (done < size) {
        const ssize_t r = read(fd, (char *) addr + done, size - done);
        if (r <= 0) {
            close(fd);
            specee_fail("error reading '%s'", path.c_str());
        }
        done += (size_t) r;
    }
    close(fd);
}

static void map_file(specee_model & m, bool use_mmap) { map_path(m.path, use_mmap, m.addr, m.size, m.mapped); }

// the draft head's matrices that only matrix products read (its token_embd is read by get_rows), when the head is
// on the CPU
static std::vector<ggml_tensor **> eagle_matrices(specee_model & m) {
    specee_eagle & e = m.eagle;
    if (e.version == 0 || m.output_device >= 0) {
        return {};
    }
    std::vector<ggml_tensor **> w = {&e.fc, &e.layer.wq, &e.layer.wk, &e.layer.wv, &e.layer.wo, &e.layer.ffn_gate,
                                     &e.layer.ffn_up, &e.layer.ffn_down};
    if (e.output) {
        w.push_back(&e.output);
    }
    return w;
}

// the layers' and the output's matrices that stay on the CPU
static std::vector<ggml_tensor **> cpu_matrices(specee_model & m) {
    std::vector<ggml_tensor **> w;
    for (size_t il = 0; il < m.layers.size(); ++il) {
        if (specee_model_device_of_layer(m, (int32_t) il) >= 0) {
            continue;
        }
        specee_layer & l = m.layers[il];
        for (ggml_tensor ** t : {&l.wq, &l.wk, &l.wv, &l.wo, &l.ffn_gate, &l.ffn_up, &l.ffn_down}) {
            w.push_back(t);
        }
    }
    if (m.output != m.tok_embd && m.output_device < 0) {
        w.push_back(&m.output); // a tied output is also read by get_rows, which repacked data cannot serve
    }
    return w;
}

// The CPU backend's extra buffer types hold some quantized matrices in a repacked, interleaved layout
// that its matmul kernels run faster on (e.g. Q4_0 as 8x8 blocks on AVX2), as upstream llama.cpp does by
// default. Weights of `cands` that one of them supports for their mul_mat are copied (and repacked) out of the
// mapping; everything else stays mapped.
static void repack_weights(specee_model & m, std::vector<ggml_tensor **> cands) {
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!dev || cands.empty()) {
        return;
    }
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(dev), "ggml_backend_dev_get_extra_bufts");
    if (!get_extra || getenv("SPECEE_NO_REPACK")) {
        return;
    }

    ggml_init_params ip = {(cands.size() * 3 + 8) * ggml_tensor_overhead(), nullptr, /*no_alloc =*/true};
    std::unique_ptr<ggml_context, void (*)(ggml_context *)> probe(ggml_init(ip), ggml_free);
    std::vector<ggml_backend_buffer_type_t> chosen(cands.size(), nullptr);
    for (ggml_backend_buffer_type_t * buft = get_extra(dev); buft && *buft; ++buft) {
        // ggml's AMX tile kernels as GCC 12 compiles them with -march=native die with SIGILL on the Sapphire
        // Rapids machines this was developed on (the tile state is enabled; the fault is in the generated
        // code). ggml/install.sh builds ggml without AMX; a ggml built with it is used only on SPECEE_AMX=1
        if (strstr(ggml_backend_buft_name(*buft), "AMX") && !getenv("SPECEE_AMX")) {
            continue;
        }
        ggml_backend_buffer_t dummy = ggml_backend_buft_alloc_buffer(*buft, 0);
        for (size_t i = 0; i < cands.size(); ++i) {
            if (chosen[i]) {
                continue;
            }
            ggml_tensor * w = ggml_dup_tensor(probe.get(), *cands[i]);
            w->buffer       = dummy;
            ggml_tensor * x = ggml_new_tensor_2d(probe.get(), GGML_TYPE_F32, w->ne[0], 512);
            if (ggml_backend_dev_supports_op(dev, ggml_mul_mat(probe.get(), w, x))) {
                chosen[i] = *buft;
            }
            w->buffer = nullptr;
        }
        ggml_backend_buffer_free(dummy);
        probe.reset(ggml_init(ip));

        std::vector<size_t> idx;
        for (size_t i = 0; i < cands.size(); ++i) {
            if (chosen[i] == *buft) {
                idx.push_back(i);
            }
        }
        if (idx.empty()) {
            continue;
        }
        ggml_init_params rp = {idx.size() * ggml_tensor_overhead(), nullptr, /*no_alloc =*/true};
        ggml_context *   rctx = ggml_init(rp);
        m.ctx_repack.push_back(rctx);
        std::vector<std::pair<ggml_tensor *, ggml_tensor *>> pairs;
        for (size_t i : idx) {
            ggml_tensor * src = *cands[i];
            ggml_tensor * dst = ggml_dup_tensor(rctx, src);
            ggml_set_name(dst, ggml_get_name(src));
            pairs.emplace_back(src, dst);
            *cands[i] = dst;
        }
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(rctx, *buft);
        if (!buf) {
            specee_fail("cannot allocate %s for repacked weights", ggml_backend_buft_name(*buft));
        }
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        m.buf_repack.push_back(buf);
        for (auto & p : pairs) {
            ggml_backend_tensor_set(p.second, p.first->data, 0, ggml_nbytes(p.first));
        }
    }
}

// ---- EAGLE draft head ----------------------------------------------------------------------------

specee_weights_file::~specee_weights_file() {
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

static bool has_eagle_tensors(ggml_context * cm) {
    for (ggml_tensor * t = ggml_get_first_tensor(cm); t; t = ggml_get_next_tensor(cm, t)) {
        if (strncmp(ggml_get_name(t), "eagle.", 6) == 0) {
            return true;
        }
    }
    return false;
}

// The head's tensors in cm (metadata in g), shapes checked against the base model's hyperparameters.
// every layer on the CPU (at least one) has its matrices in a repacking buffer
static bool cpu_layers_repacked(const specee_model & m) {
    bool any = false;
    for (size_t il = 0; il < m.layers.size(); ++il) {
        if (specee_model_device_of_layer(m, (int32_t) il) >= 0) {
            continue;
        }
        const ggml_backend_buffer_t b = m.layers[il].ffn_up->buffer;
        if (std::find(m.buf_repack.begin(), m.buf_repack.end(), b) == m.buf_repack.end()) {
            return false;
        }
        any = true;
    }
    return any;
}

static specee_eagle read_eagle(const specee_model & m, ggml_context * cm, const gguf_context * g,
                               const std::string & path) {
    const specee_hparams & hp = m.hparams;
    specee_eagle           e;
    e.source = path;
    e.version = 1;
    get_int(g, SPECEE_KEY_EAGLE_VERSION, e.version, 0, UINT32_MAX, false);
    if (e.version != 1) {
        specee_fail("the EAGLE head in %s is version %u; this runtime runs EAGLE-1 heads (%s = 1)", path.c_str(),
                    e.version, SPECEE_KEY_EAGLE_VERSION);
    }
    const int64_t n_embd = hp.n_embd;
    const int64_t n_q    = (int64_t) hp.n_embd_head_k * hp.n_head;
    const int64_t n_out  = (int64_t) hp.n_embd_head_v * hp.n_head;
    try {
        ggml_tensor * gate = ggml_get_tensor(cm, specee_tensor_name(SPECEE_TENSOR_EAGLE_FFN_GATE).c_str());
        e.n_ff             = gate ? (uint32_t) gate->ne[1] : 0;
        get_int(g, SPECEE_KEY_EAGLE_FEED_FORWARD_LENGTH, e.n_ff, 1, MAX_FF, false);
        const int64_t n_ff = e.n_ff;

        specee_layer & l = e.layer;
        e.tok_embd = get_tensor_in(cm, path, SPECEE_TENSOR_EAGLE_TOKEN_EMBD, -1, {n_embd, (int64_t) hp.n_vocab}, false);
        e.fc       = get_tensor_in(cm, path, SPECEE_TENSOR_EAGLE_FC, -1, {2 * n_embd, n_embd});
        e.fc_b     = get_tensor_in(cm, path, SPECEE_TENSOR_EAGLE_FC_BIAS, -1, {n_embd});
        l.wq       = get_tensor_in(cm, path, SPECEE_TENSOR_EAGLE_ATTN_Q, -1, {n_embd, n_q});
        l.wk       = get_tensor_in(cm, path, SPECEE_TENSOR_EAGLE_ATTN_K, -1, {n_embd, (int64_t) hp.n_embd_k_gqa()});
        l.wv       = get_tensor_in(cm, path, SPECEE_TENSOR_EAGLE_ATTN_V, -1, {n_embd, (int64_t) hp.n_embd_v_gqa()});
        l.wo       = get_tensor_in(cm, path, SPECEE_TENSOR_EAGLE_ATTN_OUTPUT, -1, {n_out, n_embd});
        l.ffn_norm = get_tensor_in(cm, path, SPECEE_TENSOR_EAGLE_FFN_NORM, -1, {n_embd});
        l.ffn_gate = get_tensor_in(cm, path, SPECEE_TENSOR_EAGLE_FFN_GATE, -1, {n_embd, n_ff});
        l.ffn_up   = get_tensor_in(cm, path, SPECEE_TENSOR_EAGLE_FFN_UP, -1, {n_embd, n_ff});
        l.ffn_down = get_tensor_in(cm, path, SPECEE_TENSOR_EAGLE_FFN_DOWN, -1, {n_ff, n_embd});
        ggml_tensor * out = ggml_get_tensor(cm, specee_tensor_name(SPECEE_TENSOR_EAGLE_OUTPUT).c_str());
        e.output = get_tensor_in(cm, path, SPECEE_TENSOR_EAGLE_OUTPUT, -1, {n_embd, out ? out->ne[1] : 0}, false);
    } catch (const specee_error & err) {
        specee_fail("the EAGLE head in %s does not fit the model (n_embd %u, %u heads / %u KV heads, vocab %u): %s",
                    path.c_str(), hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_vocab, err.what());
    }

    // a reduced draft vocabulary: eagle.output's rows are the target tokens listed in draft_vocab
    const int64_t id = gguf_find_key(g, SPECEE_KEY_EAGLE_DRAFT_VOCAB);
    if (e.output) {
        if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY ||
            (gguf_get_arr_type(g, id) != GGUF_TYPE_INT32 && gguf_get_arr_type(g, id) != GGUF_TYPE_UINT32)) {
            specee_fail("the EAGLE head in %s has eagle.output.weight but no int32 array %s (its rows' target ids)",
                        path.c_str(), SPECEE_KEY_EAGLE_DRAFT_VOCAB);
        }
        const size_t    n   = gguf_get_arr_n(g, id);
        const int32_t * ids = (const int32_t *) gguf_get_arr_data(g, id);
        if ((int64_t) n != e.output->ne[1]) {
            specee_fail("the EAGLE head in %s: %s lists %zu tokens but eagle.output.weight has %lld rows", path.c_str(),
                        SPECEE_KEY_EAGLE_DRAFT_VOCAB, n, (long long) e.output->ne[1]);
        }
        e.draft_vocab.assign(ids, ids + n);
        for (int32_t t : e.draft_vocab) {
            if (t < 0 || t >= (int32_t) hp.n_vocab) {
                specee_fail("the EAGLE head in %s: %s holds token id %d outside the vocabulary [0, %u)", path.c_str(),
                            SPECEE_KEY_EAGLE_DRAFT_VOCAB, t, hp.n_vocab);
            }
        }
    } else if (id >= 0) {
        specee_fail("the EAGLE head in %s has %s but no eagle.output.weight", path.c_str(), SPECEE_KEY_EAGLE_DRAFT_VOCAB);
    }
    return e;
}

static bool has_pred_tensors(ggml_context * cm) {
    for (ggml_tensor * t = ggml_get_first_tensor(cm); t; t = ggml_get_next_tensor(cm, t)) {
        if (strstr(ggml_get_name(t), ".pred.")) {
            return true;
        }
    }
    return false;
}

// SpecEE's exit predictors (blk.N.pred.*, any subset of the layers) and the specee.exit.* settings of a file
static specee_exit_cfg read_exit(const specee_model & m, ggml_context * cm, const gguf_context * g,
                                 const std::string & path) {
    specee_exit_cfg x;
    x.pred.resize(m.hparams.n_layer);
    uint32_t n_cand = 4;
    get_int(g, SPECEE_KEY_EXIT_N_CANDIDATES, n_cand, 0, UINT32_MAX, false);
    if (n_cand < 1 || n_cand > 64) {
        specee_fail("%s = %u in %s: expected 1..64 candidates", SPECEE_KEY_EXIT_N_CANDIDATES, n_cand, path.c_str());
    }
    x.n_cand = n_cand;
    for (uint32_t il = 0; il < m.hparams.n_layer; ++il) {
        specee_predictor &  p     = x.pred[il];
        const ggml_tensor * probe = ggml_get_tensor(cm, specee_tensor_name(SPECEE_TENSOR_PRED_UP, (int) il).c_str());
        if (!probe) {
            continue;
        }
        const int64_t n_hidden = probe->ne[1];
        p.up   = get_tensor_in(cm, path, SPECEE_TENSOR_PRED_UP, il, {3 * (int64_t) n_cand, n_hidden});
        p.up_b = get_tensor_in(cm, path, SPECEE_TENSOR_PRED_UP_BIAS, il, {n_hidden});
        p.down = get_tensor_in(cm, path, SPECEE_TENSOR_PRED_DOWN, il, {n_hidden, 1});
        p.down_b = get_tensor_in(cm, path, SPECEE_TENSOR_PRED_DOWN_BIAS, il, {1});
        x.n_pred += 1;
    }
    for (ggml_tensor * t = ggml_get_first_tensor(cm); t; t = ggml_get_next_tensor(cm, t)) {
        int il = -1;
        if (strstr(ggml_get_name(t), ".pred.") && sscanf(ggml_get_name(t), "blk.%d.", &il) == 1 &&
            (il < 0 || il >= (int) m.hparams.n_layer)) {
            specee_fail("'%s' has an exit predictor for layer %d but the model has %u layers", path.c_str(), il,
                        m.hparams.n_layer);
        }
    }
    const int64_t kid = gguf_find_key(g, SPECEE_KEY_EXIT_LAYERS);
    if (kid >= 0) {
        if (gguf_get_kv_type(g, kid) != GGUF_TYPE_ARRAY || gguf_get_arr_type(g, kid) != GGUF_TYPE_INT32) {
            specee_fail("%s in %s is not an int32 array", SPECEE_KEY_EXIT_LAYERS, path.c_str());
        }
        const auto * v = (const int32_t *) gguf_get_arr_data(g, kid);
        for (size_t i = 0; i < gguf_get_arr_n(g, kid); ++i) {
            if (v[i] < 0 || v[i] >= (int32_t) m.hparams.n_layer || !x.pred[v[i]].up) {
                specee_fail("%s in %s lists layer %d, which has no predictor (blk.%d.pred.*)", SPECEE_KEY_EXIT_LAYERS,
                            path.c_str(), v[i], v[i]);
            }
            x.layers.push_back(v[i]);
        }
    }
    const int64_t tid = gguf_find_key(g, SPECEE_KEY_EXIT_THRESHOLD);
    if (tid >= 0) {
        if (gguf_get_kv_type(g, tid) != GGUF_TYPE_FLOAT32) {
            specee_fail("%s in %s is not a float32", SPECEE_KEY_EXIT_THRESHOLD, path.c_str());
        }
        x.threshold = gguf_get_val_f32(g, tid);
    }
    return x;
}

// A head from its own GGUF (eagle.* tensors, specee.* keys; other tensors are ignored), replacing the
// model's head if it has one; exit predictors in the same file (blk.N.pred.*) replace the model's too.
static void load_eagle_file(specee_model & m, const char * path, bool use_mmap) {
    if (!path || !*path) {
        specee_fail("no EAGLE head path given");
    }
    auto f = std::make_unique<specee_weights_file>();
    FILE * fp = fopen(path, "rb");
    if (!fp) {
        specee_fail("cannot open the EAGLE head file '%s': %s", path, strerror(errno));
    }
    fclose(fp);
    std::string why;
    f->gguf = gguf_open(path, &f->ctx_meta, why);
    if (!f->gguf) {
        specee_fail("'%s' is not a GGUF file, or a corrupt or truncated one: %s", path,
                    why.c_str());
    }
    if (!has_eagle_tensors(f->ctx_meta)) {
        specee_fail("'%s' holds no EAGLE head (no eagle.* tensors)", path);
    }
    specee_eagle e = read_eagle(m, f->ctx_meta, f->gguf, path);
    const bool   with_exit = has_pred_tensors(f->ctx_meta);
    specee_exit_cfg x;
    if (with_exit) {
        x = read_exit(m, f->ctx_meta, f->gguf, path);
    }

    map_path(path, use_mmap, f->addr, f->size, f->mapped);
    const size_t data_offset = gguf_get_data_offset(f->gguf);
    f->buf                   = ggml_backend_cpu_buffer_from_ptr(f->addr, f->size);
    if (!f->buf) {
        specee_fail("cannot create a backend buffer over '%s'", path);
    }
    ggml_backend_buffer_set_usage(f->buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    for (int64_t i = 0; i < gguf_get_n_tensors(f->gguf); ++i) {
        const char *  name = gguf_get_tensor_name(f->gguf, i);
        ggml_tensor * t    = ggml_get_tensor(f->ctx_meta, name);
        const size_t  off  = data_offset + gguf_get_tensor_offset(f->gguf, i);
        if (off + ggml_nbytes(t) > f->size) {
            specee_fail("'%s' is truncated: tensor '%s' needs bytes up to %zu but the file has %zu", path, name,
                        off + ggml_nbytes(t), f->size);
        }
        if (ggml_backend_tensor_alloc(f->buf, t, (char *) f->addr + off) != GGML_STATUS_SUCCESS) {
            specee_fail("cannot place tensor '%s'", name);
        }
    }
    m.eagle      = std::move(e);
    if (with_exit) {
        m.exit = std::move(x); // the head's predictors replace the model file's
    }
    m.eagle_file = std::move(f);
}


specee_model * specee_model_load_impl(const char * path, const specee_model_params & params) {
    const bool use_mmap = params.use_mmap;
    if (!path || !*path) {
        specee_fail("no model path given");
    }
    auto * mp = new specee_model();
    std::unique_ptr<specee_model> guard(mp);
    specee_model & m = *mp;
    m.path           = path;

    struct stat st;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
        specee_fail("'%s' is a directory, not a GGUF model file", path);
    }
    FILE * f = fopen(path, "rb");
    if (!f) {
        specee_fail("cannot open model file '%s': %s", path, strerror(errno));
    }
    char magic[4] = {0};
    const size_t got = fread(magic, 1, 4, f);
    fclose(f);
    if (got == 0) {
        specee_fail("'%s' is an empty file, not a GGUF model", path);
    }
    if (got < 4 || memcmp(magic, "GGUF", 4) != 0) {
        specee_fail("'%s' is not a GGUF file (bad magic)", path);
    }

    std::string why;
    m.gguf = gguf_open(path, &m.ctx_meta, why);
    if (!m.gguf) {
        specee_fail("'%s' is a corrupt or truncated GGUF file (its header or metadata could not be read): %s", path,
                    why.c_str());
    }

    for (int64_t i = 0; i < gguf_get_n_kv(m.gguf); ++i) {
        m.meta.emplace_back(gguf_get_key(m.gguf, i), value_str(m.gguf, i));
    }
    const std::string arch = get_str(m.gguf, SPECEE_KEY_ARCHITECTURE);
    if (arch != "llama") {
        specee_fail("unsupported architecture '%s' in %s (this runtime runs 'llama' models)", arch.c_str(), path);
    }
    load_hparams(m, arch);
    check_layer_tensors(m, arch);

    // ---- weights
    specee_hparams & hp         = m.hparams;
    const int64_t    n_embd     = hp.n_embd;
    ggml_tensor *    embd_probe = ggml_get_tensor(m.ctx_meta, specee_tensor_name(SPECEE_TENSOR_TOKEN_EMBD).c_str());
    if (!embd_probe) {
        specee_fail("missing tensor '%s' in %s", specee_tensor_name(SPECEE_TENSOR_TOKEN_EMBD).c_str(), path);
    }
    if (embd_probe->ne[1] < 1 || embd_probe->ne[1] > INT32_MAX) {
        specee_fail("tensor '%s' has %lld rows: not a vocabulary size", ggml_get_name(embd_probe),
                    (long long) embd_probe->ne[1]);
    }
    hp.n_vocab = (uint32_t) embd_probe->ne[1];
    uint32_t n_vocab_key = 0;
    if (get_int(m.gguf, key_of(SPECEE_KEY_VOCAB_SIZE, arch), n_vocab_key, 0, UINT32_MAX, false) && n_vocab_key != hp.n_vocab) {
        specee_fail("tensor 'token_embd.weight' has the wrong shape: %u rows but %s says %u", hp.n_vocab,
                    key_of(SPECEE_KEY_VOCAB_SIZE, arch).c_str(), n_vocab_key);
    }
    m.vocab = specee_vocab_load(m.gguf, hp.n_vocab);
    const int64_t n_vocab = hp.n_vocab;
    const int64_t n_q     = (int64_t) hp.n_embd_head_k * hp.n_head;
    const int64_t n_out   = (int64_t) hp.n_embd_head_v * hp.n_head;

    m.tok_embd    = get_tensor(m, SPECEE_TENSOR_TOKEN_EMBD, -1, {n_embd, n_vocab});
    m.output_norm = get_tensor(m, SPECEE_TENSOR_OUTPUT_NORM, -1, {n_embd});
    m.output      = get_tensor(m, SPECEE_TENSOR_OUTPUT, -1, {n_embd, n_vocab}, false);
    if (!m.output) {
        m.output = m.tok_embd; // tied embeddings
    }
    m.rope_freqs = get_tensor(m, SPECEE_TENSOR_ROPE_FREQS, -1, {(int64_t) hp.n_rot / 2}, false);
    m.layers.resize(hp.n_layer);
    for (uint32_t il = 0; il < hp.n_layer; ++il) {
        specee_layer & l = m.layers[il];
        l.attn_norm      = get_tensor(m, SPECEE_TENSOR_ATTN_NORM, il, {n_embd});
        l.wq             = get_tensor(m, SPECEE_TENSOR_ATTN_Q, il, {n_embd, n_q});
        l.wk             = get_tensor(m, SPECEE_TENSOR_ATTN_K, il, {n_embd, (int64_t) hp.n_embd_k_gqa()});
        l.wv             = get_tensor(m, SPECEE_TENSOR_ATTN_V, il, {n_embd, (int64_t) hp.n_embd_v_gqa()});
        l.wo             = get_tensor(m, SPECEE_TENSOR_ATTN_OUTPUT, il, {n_out, n_embd});
        l.ffn_norm       = get_tensor(m, SPECEE_TENSOR_FFN_NORM, il, {n_embd});
        l.ffn_gate       = get_tensor(m, SPECEE_TENSOR_FFN_GATE, il, {n_embd, (int64_t) hp.n_ff});
        l.ffn_up         = get_tensor(m, SPECEE_TENSOR_FFN_UP, il, {n_embd, (int64_t) hp.n_ff});
        l.ffn_down       = get_tensor(m, SPECEE_TENSOR_FFN_DOWN, il, {(int64_t) hp.n_ff, n_embd});
    }
    if (has_eagle_tensors(m.ctx_meta)) {
        m.eagle = read_eagle(m, m.ctx_meta, m.gguf, m.path);
    }
    m.exit = read_exit(m, m.ctx_meta, m.gguf, m.path);

    // ---- check every tensor lies inside the file, then point the tensors into the mapping
    map_file(m, use_mmap);
    const size_t data_offset = gguf_get_data_offset(m.gguf);
    std::map<ggml_type, uint64_t> type_bytes;
    for (int64_t i = 0; i < gguf_get_n_tensors(m.gguf); ++i) {
        const char *  name = gguf_get_tensor_name(m.gguf, i);
        ggml_tensor * t    = ggml_get_tensor(m.ctx_meta, name);
        const size_t  off  = data_offset + gguf_get_tensor_offset(m.gguf, i);
        if (off + ggml_nbytes(t) > m.size) {
            specee_fail("'%s' is truncated: tensor '%s' needs bytes up to %zu but the file has %zu", path, name,
                        off + ggml_nbytes(t), m.size);
        }
        if (strncmp(name, "eagle.", 6) == 0 || strstr(name, ".pred.")) {
            continue; // the draft head and the exit predictors are not counted in the model's size
        }
        m.n_params += (uint64_t) ggml_nelements(t);
        m.n_bytes += ggml_nbytes(t);
        if (ggml_n_dims(t) >= 2) {
            type_bytes[t->type] += ggml_nbytes(t);
        }
    }
    m.buf = ggml_backend_cpu_buffer_from_ptr(m.addr, m.size);
    if (!m.buf) {
        specee_fail("cannot create a backend buffer over '%s'", path);
    }
    // weights: the scheduler runs an op where its weights are, instead of copying them to another device
    ggml_backend_buffer_set_usage(m.buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    for (int64_t i = 0; i < gguf_get_n_tensors(m.gguf); ++i) {
        ggml_tensor * t = ggml_get_tensor(m.ctx_meta, gguf_get_tensor_name(m.gguf, i));
        if (ggml_backend_tensor_alloc(m.buf, t, (char *) m.addr + data_offset + gguf_get_tensor_offset(m.gguf, i)) !=
            GGML_STATUS_SUCCESS) {
            specee_fail("cannot place tensor '%s'", ggml_get_name(t));
        }
    }

    if (params.draft_head) {
        load_eagle_file(m, params.draft_head, use_mmap);
    }
    specee_place_weights(m, params);

    std::vector<ggml_tensor **> cands = cpu_matrices(m), head = eagle_matrices(m);
    cands.insert(cands.begin(), head.begin(), head.end());
    repack_weights(m, cands);
    m.cpu_layers_repacked = cpu_layers_repacked(m);
    size_t repacked = 0;
    for (ggml_backend_buffer_t b : m.buf_repack) {
        repacked += ggml_backend_buffer_get_size(b);
    }
    if (repacked > 0) {
        m.placement += specee_format("\nCPU_REPACK: %.1f MiB of %s in the CPU's interleaved layouts%s",
                                     repacked / 1024.0 / 1024.0,
                                     m.cpu_layers_repacked ? "the CPU layers' matrices" : "matrices",
                                     m.cpu_layers_repacked ? " (default EAGLE tree: three draft tokens)" : "");
    }

    ggml_type main_type = GGML_TYPE_F32;
    uint64_t  best      = 0;
    for (const auto & kv : type_bytes) {
        if (kv.second > best) {
            best      = kv.second;
            main_type = kv.first;
        }
    }
    std::string type_name = ggml_type_name(main_type);
    for (char & c : type_name) {
        c = (char) toupper(c);
    }
    m.desc = arch + " " + size_label(m.n_params) + " " + type_name;
    return guard.release();
}

int32_t specee_model_device_of_layer(const specee_model & m, int32_t il) {
    if (il >= 0 && il < (int32_t) m.layer_device.size()) {
        return m.layer_device[il];
    }
    return m.output_device;
}

// ---- C API ---------------------------------------------------------------------------------------

extern "C" struct specee_model_params specee_model_default_params(void) {
    specee_model_params p;
    p.use_mmap       = true;
    p.n_gpu_layers   = -1;
    p.offload_order  = SPECEE_OFFLOAD_AUTO;
    p.devices        = nullptr;
    p.rpc_servers    = nullptr;
    p.tensor_split   = nullptr;
    p.n_tensor_split = 0;
    p.draft_head     = nullptr;
    return p;
}

extern "C" specee_model * specee_model_load(const char * path, struct specee_model_params params) {
    return specee_guard<specee_model *>(nullptr, [&] { return specee_model_load_impl(path, params); });
}

extern "C" void specee_model_free(specee_model * model) { delete model; }

extern "C" int32_t  specee_model_n_layer(const specee_model * m) { return (int32_t) m->hparams.n_layer; }
extern "C" int32_t  specee_model_n_embd(const specee_model * m) { return (int32_t) m->hparams.n_embd; }
extern "C" int32_t  specee_model_n_ff(const specee_model * m) { return (int32_t) m->hparams.n_ff; }
extern "C" int32_t  specee_model_n_head(const specee_model * m) { return (int32_t) m->hparams.n_head; }
extern "C" int32_t  specee_model_n_head_kv(const specee_model * m) { return (int32_t) m->hparams.n_head_kv; }
extern "C" int32_t  specee_model_n_vocab(const specee_model * m) { return (int32_t) m->hparams.n_vocab; }
extern "C" int32_t  specee_model_n_ctx_train(const specee_model * m) { return (int32_t) m->hparams.n_ctx_train; }
extern "C" uint64_t specee_model_n_params(const specee_model * m) { return m->n_params; }
extern "C" uint64_t specee_model_size(const specee_model * m) { return m->n_bytes; }
extern "C" const char * specee_model_desc(const specee_model * m) { return m->desc.c_str(); }

extern "C" int32_t specee_model_meta_count(const specee_model * m) { return (int32_t) m->meta.size(); }

extern "C" const char * specee_model_meta_key(const specee_model * m, int32_t i) {
    return (i >= 0 && i < (int32_t) m->meta.size()) ? m->meta[i].first.c_str() : nullptr;
}

extern "C" const char * specee_model_meta_value(const specee_model * m, int32_t i) {
    return (i >= 0 && i < (int32_t) m->meta.size()) ? m->meta[i].second.c_str() : nullptr;
}

extern "C" const char * specee_arch_tensor_name(int32_t i) {
    return (i >= 0 && i < SPECEE_TENSOR_EAGLE_FIRST) ? specee_tensor_format((specee_tensor) i) : nullptr;
}

extern "C" const char * specee_arch_eagle_tensor_name(int32_t i) {
    const int32_t t = SPECEE_TENSOR_EAGLE_FIRST + i;
    return (i >= 0 && t < SPECEE_TENSOR_PRED_FIRST) ? specee_tensor_format((specee_tensor) t) : nullptr;
}

extern "C" const char * specee_arch_pred_tensor_name(int32_t i) {
    const int32_t t = SPECEE_TENSOR_PRED_FIRST + i;
    return (i >= 0 && t < SPECEE_TENSOR_COUNT) ? specee_tensor_format((specee_tensor) t) : nullptr;
}

extern "C" int32_t specee_model_load_eagle(specee_model * model, const char * path) {
    return specee_guard<int32_t>(-1, [&] {
        if (!model) {
            specee_fail("no model");
        }
        load_eagle_file(*model, path, model->mapped || !model->addr);
        specee_place_eagle(*model);
        repack_weights(*model, eagle_matrices(*model));
        return 0;
    });
}

extern "C" bool specee_model_has_eagle(const specee_model * model) { return model && model->eagle.version > 0; }

extern "C" const int32_t * specee_model_eagle_draft_vocab(const specee_model * model) {
    return specee_model_has_eagle(model) && model->eagle.output ? model->eagle.draft_vocab.data() : nullptr;
}

extern "C" int32_t specee_model_eagle_n_vocab(const specee_model * model) {
    if (!specee_model_has_eagle(model)) {
        return 0;
    }
    return model->eagle.output ? (int32_t) model->eagle.draft_vocab.size() : (int32_t) model->hparams.n_vocab;
}
