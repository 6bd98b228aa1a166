// specee-loader.cpp: loading a GGUF into a specee_model, and freeing it. In steps: the file is a GGUF of a family
// this runtime has (specee-arch.cpp's table: llama, qwen2, ...); its metadata (specee-gguf.cpp) and
// hyperparameters; its weights, those its family's layers have, found by name with their shapes checked; the
// draft head and exit predictors it carries (specee-head-weights.cpp); the file mapped with the tensors pointing
// into it; a draft head file, when given; then the weights placed on devices and the CPU's repacked
// (specee-placement.cpp). The C API that loads and frees models and draft head files.
#include "specee-arch.h"
#include "specee-gguf.h"
#include "specee-head-weights.h"
#include "specee-impl.h"
#include "specee-kernels.h"
#include "specee-model.h"
#include "specee-placement.h"
#include "specee-vocab.h"
#include "specee.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <sys/stat.h>

specee_model::~specee_model() {
    specee_vocab_free(vocab);
    for (ggml_backend_buffer_t b : buf_dev) {
        ggml_backend_buffer_free(b);
    }
    for (ggml_context * c : ctx_dev) {
        ggml_free(c);
    }
    for (ggml_backend_buffer_t b : buf_repack) {
        specee_kernels_rows_release(b);
        ggml_backend_buffer_free(b);
    }
    for (ggml_context * c : ctx_repack) {
        ggml_free(c);
    }
}

// ---- the file and its metadata -------------------------------------------------------------------

// a readable file that starts with GGUF's magic; says what it is otherwise
static void check_gguf_file(const char * path) {
    struct stat st;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
        specee_fail("'%s' is a directory, not a GGUF model file", path);
    }
    FILE * f = fopen(path, "rb");
    if (!f) {
        specee_fail("cannot open model file '%s': %s", path, strerror(errno));
    }
    char         magic[4] = {0};
    const size_t got      = fread(magic, 1, 4, f);
    fclose(f);
    if (got == 0) {
        specee_fail("'%s' is an empty file, not a GGUF model", path);
    }
    if (got < 4 || memcmp(magic, "GGUF", 4) != 0) {
        specee_fail("'%s' is not a GGUF file (bad magic)", path);
    }
}

// the header and metadata (tensor data not yet mapped), the metadata also as printable strings; the architecture's
// family
static const specee_arch_family & read_metadata(specee_model & m) {
    const char * path = m.path.c_str();
    std::string  why;
    m.file.gguf = specee_gguf_open(path, &m.file.ctx_meta, why);
    if (!m.file.gguf) {
        specee_fail("'%s' is a corrupt or truncated GGUF file (its header or metadata could not be read): %s", path,
                    why.c_str());
    }
    for (int64_t i = 0; i < gguf_get_n_kv(m.file.gguf); ++i) {
        m.meta.emplace_back(gguf_get_key(m.file.gguf, i), specee_gguf_value_str(m.file.gguf, i));
    }
    const std::string arch = specee_gguf_get_str(m.file.gguf, SPECEE_KEY_ARCHITECTURE);
    if (arch == "eauto") {
        // SpecEE's llama.cpp fork: the same tensors, the llama keys named eauto.*, no specee.* keys (convert/eauto.py)
        specee_fail("unsupported architecture 'eauto' in %s: this is SpecEE's own GGUF; `python -m specee.convert "
                    "import-specee %s -o OUT.gguf` rewrites it as a llama GGUF with its EAGLE head and exit "
                    "predictors, which this runtime runs", path, path);
    }
    const specee_arch_family * family = specee_arch_family_find(arch);
    if (!family) {
        specee_fail("unsupported architecture '%s' in %s (this runtime runs %s models)", arch.c_str(), path,
                    specee_arch_family_names().c_str());
    }
    return *family;
}

// Which layers slide: {arch}.attention.sliding_window_pattern as a per-layer bool array, or as n (layer il slides
// unless il % n == n - 1; 0: all do), else the family's n
static void load_swa_layers(specee_model & m, const specee_arch_family & family, const std::string & key) {
    specee_hparams &     hp = m.hparams;
    const gguf_context * g  = m.file.gguf;
    const int64_t        id = gguf_find_key(g, key.c_str());
    hp.swa_layers.assign(hp.n_layer, 0);
    if (id >= 0 && gguf_get_kv_type(g, id) == GGUF_TYPE_ARRAY && gguf_get_arr_type(g, id) == GGUF_TYPE_BOOL) {
        if (gguf_get_arr_n(g, id) != hp.n_layer) {
            specee_fail("invalid hyperparameters: %s has %zu entries for %u layers", key.c_str(),
                        gguf_get_arr_n(g, id), hp.n_layer);
        }
        const bool * is_swa = (const bool *) gguf_get_arr_data(g, id);
        for (uint32_t il = 0; il < hp.n_layer; ++il) {
            hp.swa_layers[il] = is_swa[il] ? 1 : 0;
        }
        return;
    }
    uint32_t n = family.swa_pattern;
    specee_gguf_get_int(g, key, n, 0, SPECEE_MAX_LAYERS, false);
    for (uint32_t il = 0; il < hp.n_layer; ++il) {
        hp.swa_layers[il] = n == 0 || il % n < n - 1;
    }
}

// what a family's layer adds to llama's: the FFN's activation, scaled embeddings, the query scale, soft-capping,
// sliding-window layers with their RoPE base (as llama.cpp reads them: a family without sliding windows in the table
// ignores a window its file gives)
static void load_family_hparams(specee_model & m, const specee_arch_family & family) {
    const std::string    arch = family.name;
    const gguf_context * g    = m.file.gguf;
    specee_hparams &     hp   = m.hparams;
    auto                 key  = [&](const char * fmt) { return specee_gguf_key(fmt, arch); };
    hp.ffn_act    = family.ffn_act;
    hp.embd_scale = family.embd_scale;
    hp.attn_scale = 1.0f / sqrtf((float) hp.n_embd_head_k);
    if (family.n_layer_embd_query_scale != 0 && hp.n_layer == family.n_layer_embd_query_scale) {
        hp.attn_scale = 1.0f / sqrtf((float) (hp.n_embd / hp.n_head)); // Gemma 27B's query_pre_attn_scalar
    }
    specee_gguf_get_f32_in(g, key(SPECEE_KEY_ATTENTION_SCALE), hp.attn_scale, 0.0f, INFINITY);
    specee_gguf_get_f32_in(g, key(SPECEE_KEY_ATTN_LOGIT_SOFTCAPPING), hp.attn_softcap, 0.0f, INFINITY);
    specee_gguf_get_f32_in(g, key(SPECEE_KEY_FINAL_LOGIT_SOFTCAPPING), hp.final_softcap, 0.0f, INFINITY);
    hp.rope_freq_base_swa  = hp.rope_freq_base;
    hp.rope_freq_scale_swa = hp.rope_freq_scale;
    if (family.swa_pattern == 0) {
        return;
    }
    hp.n_swa = family.swa_default;
    specee_gguf_get_int(g, key(SPECEE_KEY_SLIDING_WINDOW), hp.n_swa, 0, INT32_MAX, false);
    if (hp.n_swa == 0) {
        return;
    }
    load_swa_layers(m, family, key(SPECEE_KEY_SLIDING_WINDOW_PATTERN));
    // the sliding layers' RoPE as llama.cpp turns them: the global base and scale, or (gemma3) a base of their own,
    // unscaled; the file's base in either case
    if (family.swa_rope_base > 0.0f) {
        hp.rope_freq_base_swa  = family.swa_rope_base;
        hp.rope_freq_scale_swa = 1.0f;
    }
    specee_gguf_get_f32_in(g, key(SPECEE_KEY_ROPE_FREQ_BASE_SWA), hp.rope_freq_base_swa, 0.0f, INFINITY);
}

static void load_hparams(specee_model & m, const specee_arch_family & family) {
    const std::string    arch = family.name;
    const gguf_context * g   = m.file.gguf;
    specee_hparams &     hp  = m.hparams;
    auto                 key = [&](const char * fmt) { return specee_gguf_key(fmt, arch); };
    specee_gguf_get_int(g, key(SPECEE_KEY_BLOCK_COUNT), hp.n_layer, 1, SPECEE_MAX_LAYERS, true);
    specee_gguf_get_int(g, key(SPECEE_KEY_EMBEDDING_LENGTH), hp.n_embd, 1, SPECEE_MAX_EMBD, true);
    specee_gguf_get_int(g, key(SPECEE_KEY_FEED_FORWARD_LENGTH), hp.n_ff, 1, SPECEE_MAX_FF, true);
    specee_gguf_get_int(g, key(SPECEE_KEY_HEAD_COUNT), hp.n_head, 1, SPECEE_MAX_HEADS, true);
    hp.n_head_kv = hp.n_head;
    specee_gguf_get_int(g, key(SPECEE_KEY_HEAD_COUNT_KV), hp.n_head_kv, 1, SPECEE_MAX_HEADS, false);
    hp.n_ctx_train = 4096;
    specee_gguf_get_int(g, key(SPECEE_KEY_CONTEXT_LENGTH), hp.n_ctx_train, 1, INT32_MAX, false); // positions: int32
    if (hp.n_head % hp.n_head_kv != 0) {
        specee_fail("invalid hyperparameters: n_head=%u is not a multiple of n_head_kv=%u", hp.n_head, hp.n_head_kv);
    }
    hp.n_embd_head_k = hp.n_embd / hp.n_head;
    specee_gguf_get_int(g, key(SPECEE_KEY_KEY_LENGTH), hp.n_embd_head_k, 1, SPECEE_MAX_HEAD_DIM, false);
    hp.n_embd_head_v = hp.n_embd_head_k;
    specee_gguf_get_int(g, key(SPECEE_KEY_VALUE_LENGTH), hp.n_embd_head_v, 1, SPECEE_MAX_HEAD_DIM, false);
    hp.n_rot = hp.n_embd_head_k;
    specee_gguf_get_int(g, key(SPECEE_KEY_ROPE_DIMENSION_COUNT), hp.n_rot, 0, SPECEE_MAX_HEAD_DIM, false);
    if (hp.n_embd_head_k == 0 || hp.n_rot != hp.n_embd_head_k || hp.n_embd_head_k % 2 != 0) {
        specee_fail("invalid hyperparameters: rope dimension %u must equal the head size %u (even, > 0)", hp.n_rot,
                    hp.n_embd_head_k);
    }
    // a NaN, infinite, zero or negative epsilon or RoPE base computes NaN (or trips ggml's asserts) at the first
    // evaluation: refused here
    specee_gguf_get_f32_in(g, key(SPECEE_KEY_LAYER_NORM_RMS_EPS), hp.f_norm_rms_eps, 0.0f, 1.0f);
    specee_gguf_get_f32_in(g, key(SPECEE_KEY_ROPE_FREQ_BASE), hp.rope_freq_base, 0.0f, INFINITY);

    // RoPE scaling: linear (position interpolation) and YaRN; Llama 3's per-frequency factors come
    // as the rope_freqs tensor
    const std::string scale_type = specee_gguf_get_str(g, key(SPECEE_KEY_ROPE_SCALING_TYPE));
    if (!scale_type.empty() && scale_type != "none" && scale_type != "linear" && scale_type != "yarn") {
        specee_fail("unsupported rope scaling type '%s' (none, linear and yarn are supported)", scale_type.c_str());
    }
    float factor = 0.0f;
    if (scale_type != "none" &&
        !specee_gguf_get_f32_in(g, key(SPECEE_KEY_ROPE_SCALING_FACTOR), factor, 0.0f, INFINITY)) {
        specee_gguf_get_f32_in(g, key(SPECEE_KEY_ROPE_SCALE_LINEAR), factor, 0.0f, INFINITY);
    }
    hp.rope_freq_scale = factor > 0.0f ? 1.0f / factor : 1.0f;
    hp.rope_ext_factor = scale_type == "yarn" ? 1.0f : 0.0f;
    hp.n_ctx_orig      = hp.n_ctx_train;
    specee_gguf_get_int(g, key(SPECEE_KEY_ROPE_SCALING_ORIG_CTX_LEN), hp.n_ctx_orig, 1, INT32_MAX, false);
    specee_gguf_get_f32_in(g, key(SPECEE_KEY_ROPE_SCALING_ATTN_FACTOR), hp.rope_attn_factor, 0.0f, INFINITY);
    hp.rope_type = family.rope_type;
    uint32_t pooling = 0; // -1 (llama.cpp's "unspecified") .. rank
    if (specee_gguf_get_int(g, key(SPECEE_KEY_POOLING_TYPE), pooling, -1, SPECEE_POOLING_RANK, false)) {
        hp.pooling_type = (int32_t) pooling;
    }
    load_family_hparams(m, family);
}

// The blk.N tensors must be those of layers 0..n_layer-1: a file whose block_count is smaller than its layers
// would run a truncated model (missing layers are found by read_weights). Exit predictors (blk.N.pred.*) are checked
// by specee_read_exit.
static void check_layer_tensors(const specee_model & m, const std::string & arch) {
    ggml_context * cm = m.file.ctx_meta;
    for (ggml_tensor * t = ggml_get_first_tensor(cm); t; t = ggml_get_next_tensor(cm, t)) {
        const char * name = ggml_get_name(t);
        if (strncmp(name, "blk.", 4) != 0 || strstr(name, ".pred.")) {
            continue;
        }
        char *          end = nullptr;
        const long long il  = strtoll(name + 4, &end, 10);
        if (end == name + 4 || *end != '.' || il < 0 || il >= (long long) m.hparams.n_layer) {
            specee_fail("tensor '%s' in %s is not one of layers 0..%u: %s = %u does not match the file's blk.* "
                        "tensors", name, m.path.c_str(), m.hparams.n_layer - 1,
                        specee_gguf_key(SPECEE_KEY_BLOCK_COUNT, arch).c_str(), m.hparams.n_layer);
        }
    }
}

// the vocabulary size: token_embd's rows, which the vocab_size key (when there) must agree with
static void read_vocab_size(specee_model & m, const std::string & arch) {
    const std::string embd  = specee_tensor_name(SPECEE_TENSOR_TOKEN_EMBD);
    ggml_tensor *     probe = ggml_get_tensor(m.file.ctx_meta, embd.c_str());
    if (!probe) {
        specee_fail("missing tensor '%s' in %s", embd.c_str(), m.path.c_str());
    }
    if (probe->ne[1] < 1 || probe->ne[1] > INT32_MAX) {
        specee_fail("tensor '%s' has %lld rows: not a vocabulary size", ggml_get_name(probe), (long long) probe->ne[1]);
    }
    m.hparams.n_vocab     = (uint32_t) probe->ne[1];
    const std::string key = specee_gguf_key(SPECEE_KEY_VOCAB_SIZE, arch);
    uint32_t          n   = 0;
    if (specee_gguf_get_int(m.file.gguf, key, n, 0, UINT32_MAX, false) && n != m.hparams.n_vocab) {
        specee_fail("tensor 'token_embd.weight' has the wrong shape: %u rows but %s says %u", m.hparams.n_vocab,
                    key.c_str(), n);
    }
}

// ---- the weights ---------------------------------------------------------------------------------

// the slot of a layer tensor in specee_layer, and its shape for these hyperparameters (fused: ffn_up holds the gate
// rows too)
static ggml_tensor ** layer_slot(specee_layer & l, specee_tensor t) {
    switch (t) {
        case SPECEE_TENSOR_ATTN_NORM:   return &l.attn_norm;
        case SPECEE_TENSOR_ATTN_Q:      return &l.wq;
        case SPECEE_TENSOR_ATTN_K:      return &l.wk;
        case SPECEE_TENSOR_ATTN_V:      return &l.wv;
        case SPECEE_TENSOR_ATTN_QKV:    return &l.wqkv;
        case SPECEE_TENSOR_ATTN_Q_BIAS: return &l.bq;
        case SPECEE_TENSOR_ATTN_K_BIAS: return &l.bk;
        case SPECEE_TENSOR_ATTN_V_BIAS: return &l.bv;
        case SPECEE_TENSOR_ATTN_Q_NORM: return &l.q_norm;
        case SPECEE_TENSOR_ATTN_K_NORM: return &l.k_norm;
        case SPECEE_TENSOR_ATTN_OUTPUT: return &l.wo;
        case SPECEE_TENSOR_FFN_NORM:    return &l.ffn_norm;
        case SPECEE_TENSOR_FFN_GATE:    return &l.ffn_gate;
        case SPECEE_TENSOR_FFN_UP:      return &l.ffn_up;
        case SPECEE_TENSOR_FFN_DOWN:    return &l.ffn_down;
        case SPECEE_TENSOR_ATTN_POST_NORM: return &l.attn_post_norm;
        case SPECEE_TENSOR_FFN_POST_NORM:  return &l.ffn_post_norm;
        default:                        return nullptr;
    }
}

static std::vector<int64_t> layer_shape(const specee_hparams & hp, specee_tensor t, bool fused_gate_up) {
    const int64_t n_embd = hp.n_embd;
    const int64_t n_q    = (int64_t) hp.n_embd_head_k * hp.n_head;
    const int64_t n_k    = hp.n_embd_k_gqa();
    const int64_t n_v    = hp.n_embd_v_gqa();
    const int64_t n_ff   = hp.n_ff;
    switch (t) {
        case SPECEE_TENSOR_ATTN_Q:      return {n_embd, n_q};
        case SPECEE_TENSOR_ATTN_K:      return {n_embd, n_k};
        case SPECEE_TENSOR_ATTN_V:      return {n_embd, n_v};
        case SPECEE_TENSOR_ATTN_QKV:    return {n_embd, n_q + n_k + n_v};
        case SPECEE_TENSOR_ATTN_Q_BIAS: return {n_q};
        case SPECEE_TENSOR_ATTN_K_BIAS: return {n_k};
        case SPECEE_TENSOR_ATTN_V_BIAS: return {n_v};
        case SPECEE_TENSOR_ATTN_Q_NORM:
        case SPECEE_TENSOR_ATTN_K_NORM: return {(int64_t) hp.n_embd_head_k};
        case SPECEE_TENSOR_ATTN_OUTPUT: return {(int64_t) hp.n_embd_head_v * hp.n_head, n_embd};
        case SPECEE_TENSOR_FFN_GATE:    return {n_embd, n_ff};
        case SPECEE_TENSOR_FFN_UP:      return {n_embd, fused_gate_up ? 2 * n_ff : n_ff};
        case SPECEE_TENSOR_FFN_DOWN:    return {n_ff, n_embd};
        default:                        return {n_embd}; // attn_norm, ffn_norm, the post norms
    }
}

// a reranker's classifier head, when the file has one: cls [n_embd, n_embd] (+ bias), cls.output [n_embd, n_labels]
// (+ bias); its scores through a softmax for Qwen3, as llama.cpp runs it
static void read_cls_head(specee_model & m) {
    const int64_t n_embd = m.hparams.n_embd;
    auto tensor = [&](specee_tensor which, std::vector<int64_t> shape) {
        return specee_gguf_tensor(m.file.ctx_meta, m.path, which, -1, std::move(shape), false);
    };
    m.cls   = tensor(SPECEE_TENSOR_CLS, {n_embd, n_embd});
    m.cls_b = tensor(SPECEE_TENSOR_CLS_BIAS, {n_embd});
    const ggml_tensor * probe = ggml_get_tensor(m.file.ctx_meta, specee_tensor_name(SPECEE_TENSOR_CLS_OUT).c_str());
    const int64_t n_out = probe ? std::max<int64_t>(probe->ne[1], 1) : 1;
    if (n_out > n_embd) {
        specee_fail("tensor '%s' has %lld labels, more than n_embd = %lld", ggml_get_name(probe), (long long) n_out,
                    (long long) n_embd);
    }
    m.cls_out   = tensor(SPECEE_TENSOR_CLS_OUT, {n_embd, n_out});
    m.cls_out_b = tensor(SPECEE_TENSOR_CLS_OUT_BIAS, {n_out});
    if ((m.cls_b && !m.cls) || (m.cls_out_b && !m.cls_out)) {
        specee_fail("%s has a classifier bias without its weight (cls, cls.output)", m.path.c_str());
    }
    m.hparams.n_cls_out    = m.cls_out ? (uint32_t) n_out : 1;
    m.hparams.rank_softmax = m.cls_out && specee_gguf_get_str(m.file.gguf, SPECEE_KEY_ARCHITECTURE) == "qwen3";
}

// the base model's tensors, those of each layer as its family's row lists them, shapes checked against the
// hyperparameters
static void read_weights(specee_model & m, const specee_arch_family & family) {
    const specee_hparams & hp      = m.hparams;
    const int64_t          n_embd  = hp.n_embd;
    const int64_t          n_vocab = hp.n_vocab;
    auto tensor = [&](specee_tensor which, int il, std::vector<int64_t> shape, bool required = true) {
        return specee_gguf_tensor(m.file.ctx_meta, m.path, which, il, std::move(shape), required);
    };
    m.tok_embd    = tensor(SPECEE_TENSOR_TOKEN_EMBD, -1, {n_embd, n_vocab});
    m.output_norm = tensor(SPECEE_TENSOR_OUTPUT_NORM, -1, {n_embd});
    m.output      = tensor(SPECEE_TENSOR_OUTPUT, -1, {n_embd, n_vocab}, false);
    if (!m.output) {
        m.output = m.tok_embd; // tied embeddings
    }
    m.rope_freqs = tensor(SPECEE_TENSOR_ROPE_FREQS, -1, {(int64_t) hp.n_rot / 2}, false);
    m.rope_long  = tensor(SPECEE_TENSOR_ROPE_FACTORS_LONG, -1, {(int64_t) hp.n_rot / 2}, false);
    m.rope_short = tensor(SPECEE_TENSOR_ROPE_FACTORS_SHORT, -1, {(int64_t) hp.n_rot / 2}, false);
    if (!m.rope_long != !m.rope_short) {
        specee_fail("%s has '%s' without '%s': LongRoPE needs both", m.path.c_str(),
                    specee_tensor_name(m.rope_long ? SPECEE_TENSOR_ROPE_FACTORS_LONG : SPECEE_TENSOR_ROPE_FACTORS_SHORT)
                        .c_str(),
                    specee_tensor_name(m.rope_long ? SPECEE_TENSOR_ROPE_FACTORS_SHORT : SPECEE_TENSOR_ROPE_FACTORS_LONG)
                        .c_str());
    }
    if (m.rope_long && m.rope_freqs) {
        specee_fail("%s has both rope_freqs and LongRoPE factors", m.path.c_str());
    }
    read_cls_head(m);
    const bool fused_gate_up = !specee_arch_family_has(family, SPECEE_TENSOR_FFN_GATE);
    m.layers.resize(hp.n_layer);
    for (int il = 0; il < (int) hp.n_layer; ++il) {
        for (int j = 0; j < SPECEE_MAX_LAYER_TENSORS && family.layer_tensors[j] != SPECEE_TENSOR_COUNT; ++j) {
            const specee_tensor t = family.layer_tensors[j];
            *layer_slot(m.layers[il], t) = tensor(t, il, layer_shape(hp, t, fused_gate_up));
        }
    }
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

// the model's size (the draft head and the exit predictors not counted) and its description ("llama 135M Q8_0":
// the type holding the most bytes of matrices)
static void describe(specee_model & m, const std::string & arch) {
    const gguf_context *          g = m.file.gguf;
    std::map<ggml_type, uint64_t> type_bytes;
    for (int64_t i = 0; i < gguf_get_n_tensors(g); ++i) {
        const char *  name = gguf_get_tensor_name(g, i);
        ggml_tensor * t    = ggml_get_tensor(m.file.ctx_meta, name);
        if (strncmp(name, "eagle.", 6) == 0 || strstr(name, ".pred.")) {
            continue;
        }
        m.n_params += (uint64_t) ggml_nelements(t);
        m.n_bytes += ggml_nbytes(t);
        if (ggml_n_dims(t) >= 2) {
            type_bytes[t->type] += ggml_nbytes(t);
        }
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
}

// a line of what loading did that the user did not ask for: first in model.placement (tools print it), and on
// stderr when the library's logging is on
static void add_note(specee_model & m, const std::string & note) {
    if (note.empty()) {
        return;
    }
    m.placement = "note: " + note + "\n" + m.placement;
    specee_log_info("note: %s", note.c_str());
}

// ---- a draft model ---------------------------------------------------------------------------------------

// Loads params.draft_model into target.draft (-md), refused unless its vocabulary is the target's token for token;
// throws with the reason
static void draft_model_load(specee_model & target, const specee_model_params & params) {
    specee_model_params dp = specee_model_default_params();
    dp.use_mmap            = params.use_mmap;
    dp.n_gpu_layers        = params.n_gpu_layers_draft;
    dp.devices             = params.devices;
    dp.tensor_split        = params.tensor_split;
    dp.n_tensor_split      = params.n_tensor_split;
    dp.kernels             = params.kernels;
    specee_model * d       = specee_model_load(params.draft_model, dp);
    if (!d) {
        specee_fail("draft model %s: %s", params.draft_model, specee_last_error());
    }
    std::unique_ptr<specee_model> draft(d);
    const int32_t                 n_vocab = (int32_t) target.hparams.n_vocab;
    if ((int32_t) draft->hparams.n_vocab != n_vocab) {
        specee_fail("draft model %s has %d tokens, the model %d: a draft model must have the model's vocabulary",
                    params.draft_model, (int32_t) draft->hparams.n_vocab, n_vocab);
    }
    for (int32_t t = 0; t < n_vocab; ++t) {
        const char * a = specee_token_text(&target, t);
        const char * b = specee_token_text(draft.get(), t);
        if (strcmp(a ? a : "", b ? b : "") != 0) {
            specee_fail("draft model %s: token %d is '%s' there but '%s' in the model: a draft model must have the "
                        "model's vocabulary", params.draft_model, t, b ? b : "", a ? a : "");
        }
    }
    target.draft = std::move(draft);
}

// ---- loading -------------------------------------------------------------------------------------

// throws specee_error naming the problem
static specee_model * load_impl(const char * path, const specee_model_params & params) {
    if (!path || !*path) {
        specee_fail("no model path given");
    }
    auto m  = std::make_unique<specee_model>();
    m->path = path;
    check_gguf_file(path);
    const specee_arch_family & family = read_metadata(*m);
    const std::string          arch   = family.name;
    load_hparams(*m, family);
    check_layer_tensors(*m, arch);
    read_vocab_size(*m, arch);
    m->vocab = specee_vocab_load(m->file.gguf, m->hparams.n_vocab, family.special_rstrip);
    read_weights(*m, family);
    if (specee_has_eagle_tensors(m->file.ctx_meta)) {
        m->eagle = specee_read_eagle(m->hparams, m->file.ctx_meta, m->file.gguf, m->path);
    }
    m->exit = specee_read_exit(m->hparams, m->file.ctx_meta, m->file.gguf, m->path);

    specee_gguf_map(m->file, m->path, params.use_mmap);
    specee_gguf_bind_tensors(m->file, m->path);
    std::string note;
    if (params.draft_head) {
        note = specee_load_draft_head_file(*m, params.draft_head, params.use_mmap);
    }
    specee_place_weights(*m, params);
    specee_repack_weights(*m, params.kernels);
    add_note(*m, note);
    describe(*m, arch);
    if (params.draft_model) {
        draft_model_load(*m, params);
    }
    return m.release();
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
    p.draft_model    = nullptr;
    p.n_gpu_layers_draft = -1;
    p.kernels            = 0; // auto
    return p;
}

extern "C" specee_model * specee_model_load(const char * path, struct specee_model_params params) {
    return specee_guard<specee_model *>(nullptr, [&] { return load_impl(path, params); });
}

extern "C" void specee_model_free(specee_model * model) { delete model; }

extern "C" int32_t specee_model_load_eagle(specee_model * model, const char * path) {
    return specee_guard<int32_t>(-1, [&] {
        if (!model) {
            specee_fail("no model");
        }
        const std::string note =
            specee_load_draft_head_file(*model, path, model->file.mapped || !model->file.addr);
        specee_place_eagle(*model);
        add_note(*model, note);
        return 0;
    });
}
