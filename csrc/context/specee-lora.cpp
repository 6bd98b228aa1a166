// specee-lora.cpp: LoRA adapters (specee-lora.h): loading an adapter file against a model, checked before anything
// is allocated, and a context's active set. The graph applies the set (specee-graph.cpp, build_mm).
#include "specee-lora.h"

#include "specee-context.h"
#include "specee-gguf.h"
#include "specee-impl.h"
#include "specee-model.h"

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <string>

specee_lora::~specee_lora() {
    for (ggml_backend_buffer_t b : bufs) {
        ggml_backend_buffer_free(b);
    }
    for (ggml_context * c : ctxs) {
        ggml_free(c);
    }
}

// ---- checks ---------------------------------------------------------------------------------------------

static bool ends_with(const std::string & s, const char * suffix) {
    const size_t n = strlen(suffix);
    return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

// the model's matrices an adapter may adapt, by name: its layers' matrices and the lm_head ("output.weight", also
// when it is the token embedding matrix)
static std::map<std::string, ggml_tensor *> adaptable_weights(specee_model & m) {
    std::map<std::string, ggml_tensor *> out;
    for (specee_layer & l : m.layers) {
        for (ggml_tensor ** t : specee_layer_weights(l, /*matrices_only =*/true)) {
            out[ggml_get_name(*t)] = *t;
        }
    }
    out[specee_tensor_name(SPECEE_TENSOR_OUTPUT)] = m.output;
    return out;
}

// the metadata an adapter must have: general.type "adapter", adapter.type "lora", the model's architecture; its
// alpha (adapter.lora.alpha, F32, finite, >= 0; absent: 0)
static float check_metadata(const specee_model & model, const gguf_context * g, const std::string & path) {
    const std::string type = specee_gguf_get_str(g, "general.type");
    if (type != "adapter") {
        specee_fail("%s: not an adapter (general.type is '%s', not 'adapter')", path.c_str(), type.c_str());
    }
    const std::string kind = specee_gguf_get_str(g, "adapter.type");
    if (kind != "lora") {
        specee_fail("%s: adapter.type is '%s', not 'lora'", path.c_str(), kind.c_str());
    }
    const std::string arch       = specee_gguf_get_str(g, "general.architecture");
    const std::string model_arch = specee_gguf_get_str(model.file.gguf, "general.architecture");
    if (arch != model_arch) {
        specee_fail("%s: an adapter for architecture '%s', but the model is '%s'", path.c_str(), arch.c_str(),
                    model_arch.c_str());
    }
    if (gguf_find_key(g, "adapter.alora.invocation_tokens") >= 0) { // applied from its invocation on, upstream
        specee_fail("%s: an activated LoRA (adapter.alora.invocation_tokens) is not supported", path.c_str());
    }
    const int64_t id = gguf_find_key(g, "adapter.lora.alpha");
    if (id < 0) {
        return 0.0f;
    }
    if (gguf_get_kv_type(g, id) != GGUF_TYPE_FLOAT32) {
        specee_fail("%s: adapter.lora.alpha is not a float32", path.c_str());
    }
    const float alpha = gguf_get_val_f32(g, id);
    if (!std::isfinite(alpha) || alpha < 0.0f) {
        specee_fail("%s: adapter.lora.alpha is %g (must be finite and >= 0)", path.c_str(), alpha);
    }
    return alpha;
}

// a and b of one matrix W [n_in, n_out]: 2-D, of a type with CPU kernels, a [n_in, r], b [r, n_out]
static void check_pair(const std::string & path, const std::string & name, const ggml_tensor * w,
                       const ggml_tensor * a, const ggml_tensor * b) {
    if (!a || !b) {
        specee_fail("%s: '%s' has %s but not %s", path.c_str(), name.c_str(), a ? "lora_a" : "lora_b",
                    a ? "lora_b" : "lora_a");
    }
    for (const ggml_tensor * t : {a, b}) {
        const bool known = t->type == GGML_TYPE_F32 || t->type == GGML_TYPE_F16 || t->type == GGML_TYPE_BF16 ||
                           t->type == GGML_TYPE_Q8_0;
        if (ggml_n_dims(t) > 2 || !known) {
            specee_fail("%s: '%s' must be a matrix of F32, F16, BF16 or Q8_0 (it is %dD %s)", path.c_str(),
                        ggml_get_name(t), ggml_n_dims(t), ggml_type_name(t->type));
        }
    }
    if (a->ne[0] != w->ne[0] || b->ne[1] != w->ne[1]) {
        specee_fail("%s: '%s' is [%lld, %lld] in the model, but lora_a is [%lld, %lld] and lora_b [%lld, %lld] "
                    "(an adapter for another model?)", path.c_str(), name.c_str(), (long long) w->ne[0],
                    (long long) w->ne[1], (long long) a->ne[0], (long long) a->ne[1], (long long) b->ne[0],
                    (long long) b->ne[1]);
    }
    if (a->ne[1] < 1) {
        specee_fail("%s: '%s' has an adapter of rank %lld (at least 1)", path.c_str(), name.c_str(), (long long) a->ne[1]);
    }
    if (a->ne[1] != b->ne[0]) {
        specee_fail("%s: '%s' has lora_a of rank %lld but lora_b of rank %lld", path.c_str(), name.c_str(),
                    (long long) a->ne[1], (long long) b->ne[0]);
    }
}

// the pairs of the file by the model matrix they adapt, every tensor accounted for (norms are skipped, as llama.cpp
// skips them)
static std::map<std::string, specee_lora_weight> read_pairs(ggml_context * meta, const std::string & path,
                                                           const std::map<std::string, ggml_tensor *> & model_w) {
    std::map<std::string, specee_lora_weight> pairs;
    for (ggml_tensor * t = ggml_get_first_tensor(meta); t; t = ggml_get_next_tensor(meta, t)) {
        const std::string name = ggml_get_name(t);
        const bool        is_a = ends_with(name, ".lora_a"), is_b = ends_with(name, ".lora_b");
        if (!is_a && !is_b) {
            if (ends_with(name, "_norm.weight")) {
                continue;
            }
            specee_fail("%s: tensor '%s' is neither a lora_a nor a lora_b", path.c_str(), name.c_str());
        }
        const std::string base = name.substr(0, name.size() - strlen(".lora_a"));
        if (!model_w.count(base)) {
            specee_fail("%s: '%s' adapts '%s', which the model %s", path.c_str(), name.c_str(), base.c_str(),
                        base == specee_tensor_name(SPECEE_TENSOR_TOKEN_EMBD)
                            ? "does not adapt (token embeddings are not supported)" : "lacks (another model?)");
        }
        (is_a ? pairs[base].a : pairs[base].b) = t;
    }
    if (pairs.empty()) {
        specee_fail("%s: the adapter has no lora_a / lora_b tensors", path.c_str());
    }
    for (const auto & p : pairs) {
        check_pair(path, p.first, model_w.at(p.first), p.second.a, p.second.b);
    }
    return pairs;
}

// ---- the context options' lists ---------------------------------------------------------------------

static bool parse_scale(const char * v, double & out) {
    char * end = nullptr;
    out        = strtod(v, &end);
    return *v && *end == '\0';
}

bool specee_lora_list_parse(const char * text, bool scaled, std::vector<std::string> * files,
                            std::vector<float> * scales) {
    std::stringstream ss(text);
    for (std::string item; std::getline(ss, item, ',');) {
        const size_t colon = item.rfind(':');
        double       scale = 1.0;
        if (scaled && (colon == std::string::npos || !parse_scale(item.c_str() + colon + 1, scale) ||
                       !std::isfinite(scale))) {
            return false;
        }
        const std::string file = scaled ? item.substr(0, colon) : item;
        if (file.empty()) {
            return false;
        }
        if (files && scales) {
            files->push_back(file);
            scales->push_back((float) scale);
        }
    }
    return true;
}

// ---- loading --------------------------------------------------------------------------------------------

// where an adapter's pair for W goes: W's buffer type off the host (a device, an RPC server), the CPU's plain one on
// the host (also where W was repacked)
static ggml_backend_buffer_type_t pair_buft(const ggml_tensor * w) {
    ggml_backend_buffer_type_t buft = w->buffer ? ggml_backend_buffer_get_type(w->buffer) : nullptr;
    return !buft || ggml_backend_buft_is_host(buft) ? ggml_backend_cpu_buffer_type() : buft;
}

// copies of the pairs in buffers beside their weights, filled from the file's mapping
static void place_pairs(specee_lora & lora, const std::map<std::string, specee_lora_weight> & pairs,
                        const std::map<std::string, ggml_tensor *> & model_w) {
    std::map<ggml_backend_buffer_type_t, ggml_context *> ctx_of;
    for (const auto & p : pairs) {
        const ggml_tensor *        w    = model_w.at(p.first);
        ggml_backend_buffer_type_t buft = pair_buft(w);
        if (!ctx_of.count(buft)) {
            ggml_init_params ip = {2 * pairs.size() * ggml_tensor_overhead(), nullptr, /*no_alloc =*/true};
            ctx_of[buft]        = ggml_init(ip);
            lora.ctxs.push_back(ctx_of[buft]);
        }
        ggml_tensor * a = ggml_dup_tensor(ctx_of[buft], p.second.a);
        ggml_tensor * b = ggml_dup_tensor(ctx_of[buft], p.second.b);
        ggml_set_name(a, ggml_get_name(p.second.a));
        ggml_set_name(b, ggml_get_name(p.second.b));
        lora.weights[w] = {a, b};
    }
    for (const auto & cb : ctx_of) {
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(cb.second, cb.first);
        if (!buf) {
            specee_fail("%s: cannot allocate %s memory for the adapter", lora.path.c_str(),
                        ggml_backend_buft_name(cb.first));
        }
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS); // ops run where their weights are
        lora.bufs.push_back(buf);
        specee_log_info("LoRA adapter %s: %.2f MiB in %s", lora.path.c_str(),
                        ggml_backend_buffer_get_size(buf) / 1048576.0, ggml_backend_buft_name(cb.first));
    }
    for (const auto & p : pairs) {
        const specee_lora_weight & dst = lora.weights.at(model_w.at(p.first));
        ggml_backend_tensor_set(dst.a, p.second.a->data, 0, ggml_nbytes(p.second.a));
        ggml_backend_tensor_set(dst.b, p.second.b->data, 0, ggml_nbytes(p.second.b));
    }
}

static specee_lora * lora_init_impl(specee_model * model, const char * path) {
    if (!model || !path) {
        specee_fail("no model or no adapter path");
    }
    specee_gguf_file f;
    std::string      why;
    f.gguf = specee_gguf_open(path, &f.ctx_meta, why);
    if (!f.gguf) {
        specee_fail("%s: cannot read it as GGUF: %s", path, why.c_str());
    }
    auto lora   = std::make_unique<specee_lora>();
    lora->model = model;
    lora->path  = path;
    lora->alpha = check_metadata(*model, f.gguf, lora->path);
    const std::map<std::string, ggml_tensor *>      model_w = adaptable_weights(*model);
    const std::map<std::string, specee_lora_weight> pairs   = read_pairs(f.ctx_meta, lora->path, model_w);
    specee_gguf_map(f, lora->path, /*use_mmap =*/true);
    specee_gguf_bind_tensors(f, lora->path); // checks every tensor lies inside the file
    place_pairs(*lora, pairs, model_w);
    return lora.release();
}

// ---- the public API -------------------------------------------------------------------------------------

specee_lora * specee_lora_init(specee_model * model, const char * path) {
    return specee_guard<specee_lora *>(nullptr, [&] { return lora_init_impl(model, path); });
}

int32_t specee_lora_init_from_options(specee_model * model, const specee_context_options * o, specee_lora ** adapters,
                                      float * scales, int32_t n_max) {
    return specee_guard<int32_t>(-1, [&] {
        std::vector<std::string> files;
        std::vector<float>       sc;
        if (!o || !specee_lora_list_parse(o->lora, false, &files, &sc) ||
            !specee_lora_list_parse(o->lora_scaled, true, &files, &sc)) {
            specee_fail("lora / lora_scaled: not a list of FNAME / FNAME:SCALE");
        }
        if ((int32_t) files.size() > n_max) {
            specee_fail("%zu LoRA adapters, at most %d", files.size(), n_max);
        }
        std::vector<std::unique_ptr<specee_lora>> loaded;
        for (const std::string & f : files) {
            loaded.emplace_back(lora_init_impl(model, f.c_str()));
        }
        for (size_t i = 0; i < loaded.size(); ++i) {
            adapters[i] = loaded[i].release();
            scales[i]   = o->lora_init_without_apply ? 0.0f : sc[i];
        }
        return (int32_t) files.size();
    });
}

void specee_lora_free(specee_lora * adapter) {
    delete adapter;
}

float specee_lora_alpha(const specee_lora * adapter) {
    return adapter ? adapter->alpha : 0.0f;
}

int32_t specee_lora_n_weights(const specee_lora * adapter) {
    return adapter ? (int32_t) adapter->weights.size() : 0;
}

const char * specee_lora_path(const specee_lora * adapter) {
    return adapter ? adapter->path.c_str() : "";
}

int32_t specee_context_set_lora(specee_context * ctx, specee_lora * const * adapters, const float * scales,
                                int32_t n) {
    return specee_guard<int32_t>(-1, [&] {
        if (!ctx || n < 0 || (n > 0 && (!adapters || !scales))) {
            specee_fail("set_lora: no context, or n > 0 without adapters and scales");
        }
        if (n > SPECEE_LORA_MAX) {
            specee_fail("set_lora: %d adapters, at most %d are active at once", n, SPECEE_LORA_MAX);
        }
        std::lock_guard<std::recursive_mutex> lock(ctx->mutex);
        std::vector<specee_lora_active>       set;
        for (int32_t i = 0; i < n; ++i) {
            if (!adapters[i] || adapters[i]->model != ctx->model) {
                specee_fail("set_lora: adapter %d was not loaded for this context's model", i);
            }
            if (!std::isfinite(scales[i])) {
                specee_fail("set_lora: the scale of adapter %d is not finite", i);
            }
            for (const specee_lora_active & s : set) {
                if (s.adapter == adapters[i]) {
                    specee_fail("set_lora: adapter %d is given twice", i);
                }
            }
            set.push_back({adapters[i], scales[i]});
        }
        bool same = set.size() == ctx->lora.size();
        for (size_t i = 0; same && i < set.size(); ++i) {
            same = set[i].adapter == ctx->lora[i].adapter && set[i].scale == ctx->lora[i].scale;
        }
        if (same) {
            return 0;
        }
        ctx->lora = std::move(set);
        ctx->reuse_key.clear(); // the kept graph was built for the old set
        ctx->reuse_gf = nullptr;
        specee_kv_clear(ctx); // its cells hold the old set's K/V (the draft model's stay: it is not adapted)
        return 0;
    });
}

int32_t specee_context_n_lora(const specee_context * ctx) {
    return ctx ? (int32_t) ctx->lora.size() : 0;
}

specee_lora * specee_context_lora(const specee_context * ctx, int32_t i, float * scale) {
    if (!ctx || i < 0 || i >= (int32_t) ctx->lora.size()) {
        return nullptr;
    }
    if (scale) {
        *scale = ctx->lora[i].scale;
    }
    return const_cast<specee_lora *>(ctx->lora[i].adapter);
}
