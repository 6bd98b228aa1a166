// specee-early-exit.cpp: SpecEE's exit predictors: the features of a layer's hidden state and the per-layer MLP
//
// At a checked layer l of a decoded token, with the EAGLE head's top n_cand candidates cand:
//   hn   = final_norm(h_l)                      the model's output norm applied to the layer's output
//   c_j  = lm_head[cand_j] . hn                 n_cand logits
//   p    = softmax(c)
//   feat = [c, p, p - p_prev]                   p_prev: p at the previously checked layer; at the first
//                                               check the third group is p itself (SpecEE's prob_gap)
//   prob = sigmoid(down . relu(up . feat + up_b) + down_b)
// The predictor fires when prob > threshold. Everything here is a few thousand multiply-adds per check, so it
// runs on the host from the weights' file mapping (the lm_head rows are read from the original, not the
// repacked, copy of the tensor).

#include "specee-arch.h"
#include "specee-context.h"
#include "specee-graph.h"
#include "specee-impl.h"
#include "specee-model.h"
#include "specee-sampling.h"
#include "specee-speculative.h"
#include "specee.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

// one row of a 2-D tensor of the file mapping as floats
static void row_f32(const ggml_tensor * t, int64_t row, float * out) {
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
static const float * tensor_f32(const ggml_tensor * t, std::vector<float> & scratch) {
    if (t->type == GGML_TYPE_F32 && ggml_is_contiguous(t)) {
        return (const float *) t->data;
    }
    scratch.resize((size_t) ggml_nelements(t));
    for (int64_t r = 0; r < ggml_nrows(t); ++r) {
        row_f32(t, r, scratch.data() + r * t->ne[0]);
    }
    return scratch.data();
}

// the lm_head as the file holds it (the model's own tensor may be a repacked copy)
static const ggml_tensor * lm_head_in_file(const specee_model & m) {
    const ggml_tensor * t = ggml_get_tensor(m.ctx_meta, specee_tensor_name(SPECEE_TENSOR_OUTPUT).c_str());
    return t ? t : ggml_get_tensor(m.ctx_meta, specee_tensor_name(SPECEE_TENSOR_TOKEN_EMBD).c_str());
}

static void specee_exit_features_impl(const specee_model & m, const float * h, const int32_t * cand, const float * p_prev,
                               float * feat, float * p_out) {
    const specee_hparams & hp     = m.hparams;
    const int32_t          n_cand = (int32_t) m.exit.n_cand;
    const int64_t          n_embd = hp.n_embd;

    // hn = final_norm(h)
    double ss = 0.0;
    for (int64_t i = 0; i < n_embd; ++i) {
        ss += (double) h[i] * h[i];
    }
    const float        scale = 1.0f / sqrtf((float) (ss / n_embd) + hp.f_norm_rms_eps);
    std::vector<float> s_w, hn(n_embd), row(n_embd);
    const float *      w = tensor_f32(m.output_norm, s_w);
    for (int64_t i = 0; i < n_embd; ++i) {
        hn[i] = h[i] * scale * w[i];
    }

    const ggml_tensor * head = lm_head_in_file(m);
    std::vector<float>  c(n_cand), p(n_cand);
    float               c_max = -INFINITY;
    for (int32_t j = 0; j < n_cand; ++j) {
        if (cand[j] < 0 || cand[j] >= (int32_t) hp.n_vocab) {
            specee_fail("candidate token %d is outside the vocabulary (%u tokens)", cand[j], hp.n_vocab);
        }
        row_f32(head, cand[j], row.data());
        double dot = 0.0;
        for (int64_t i = 0; i < n_embd; ++i) {
            dot += (double) row[i] * hn[i];
        }
        c[j]  = (float) dot;
        c_max = std::max(c_max, c[j]);
    }
    double sum = 0.0;
    for (int32_t j = 0; j < n_cand; ++j) {
        p[j] = expf(c[j] - c_max);
        sum += p[j];
    }
    for (int32_t j = 0; j < n_cand; ++j) {
        p[j] = (float) (p[j] / sum);
        feat[j]              = c[j];
        feat[n_cand + j]     = p[j];
        feat[2 * n_cand + j] = p_prev ? p[j] - p_prev[j] : p[j]; // SpecEE's code: the gap is p at the first check
        if (p_out) {
            p_out[j] = p[j];
        }
    }
}

static float specee_exit_predict_impl(const specee_model & m, int32_t layer, const float * feat) {
    if (layer < 0 || layer >= (int32_t) m.hparams.n_layer || !m.exit.pred[layer].up) {
        specee_fail("layer %d has no exit predictor", layer);
    }
    const specee_predictor & pr     = m.exit.pred[layer];
    const int64_t            n_in   = pr.up->ne[0];
    const int64_t            n_hid  = pr.up->ne[1];
    std::vector<float>       s_up, s_up_b, s_down, s_down_b;
    const float *            up     = tensor_f32(pr.up, s_up);
    const float *            up_b   = tensor_f32(pr.up_b, s_up_b);
    const float *            down   = tensor_f32(pr.down, s_down);
    const float *            down_b = tensor_f32(pr.down_b, s_down_b);
    double z = down_b[0];
    for (int64_t k = 0; k < n_hid; ++k) {
        double a = up_b[k];
        for (int64_t i = 0; i < n_in; ++i) {
            a += (double) up[k * n_in + i] * feat[i];
        }
        z += (double) down[k] * std::max(a, 0.0);
    }
    return (float) (1.0 / (1.0 + std::exp(-z)));
}

// ---- the decode step ------------------------------------------------------------------------------

using exit_clock = std::chrono::steady_clock;

static double ms_since(exit_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(exit_clock::now() - t0).count();
}

// the layers checked for this token: the static set, plus e-2, e, e+2 around each of the last 5 exits;
// only layers with a predictor, before the last layer (exiting there saves nothing)
static std::vector<int32_t> exit_schedule(const specee_spec & sp, const specee_exit_params & ep) {
    const specee_model & m       = *sp.model;
    const int32_t        n_layer = (int32_t) m.hparams.n_layer;
    std::vector<int32_t> layers;
    if (ep.layers) {
        layers.assign(ep.layers, ep.layers + ep.n_layers);
    } else {
        layers = m.exit.layers;
    }
    if (ep.dynamic) {
        for (int32_t e : sp.recent_exits) {
            for (int32_t d : {-2, 0, 2}) {
                layers.push_back(e + d);
            }
        }
    }
    std::vector<int32_t> out;
    for (int32_t il : layers) {
        if (il >= 0 && il < n_layer - 1 && m.exit.pred[il].up) {
            out.push_back(il);
        }
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
}

// the norm and full logits of one hidden state at an exit layer
static void exit_logits(specee_spec & sp, const float * h, std::vector<float> & norm, std::vector<float> & logits) {
    const specee_model & m = *sp.model;
    if (sp.exit_graph_meta.empty()) {
        sp.exit_graph_meta.resize(ggml_tensor_overhead() * 16 + ggml_graph_overhead_custom(16, false));
    }
    ggml_init_params ip   = {sp.exit_graph_meta.size(), sp.exit_graph_meta.data(), /*no_alloc =*/true};
    ggml_context *   ctx0 = ggml_init(ip);
    std::unique_ptr<ggml_context, void (*)(ggml_context *)> guard(ctx0, ggml_free);
    specee_graph_io io;
    ggml_cgraph *   gf = specee_build_exit_graph(ctx0, m, io, 16);

    ggml_backend_sched_t sched = specee_context_sched(*sp.ctx);
    ggml_backend_sched_reset(sched);
    if (!ggml_backend_sched_alloc_graph(sched, gf)) {
        specee_fail("cannot allocate the exit layer's lm_head graph");
    }
    ggml_backend_tensor_set(io.inp_embd, h, 0, (size_t) sp.n_embd * sizeof(float));
    specee_context_compute(*sp.ctx, gf, 1);
    norm.resize(sp.n_embd);
    logits.resize(sp.n_vocab);
    ggml_backend_tensor_get(io.result_norm, norm.data(), 0, norm.size() * sizeof(float));
    ggml_backend_tensor_get(io.result_output, logits.data(), 0, logits.size() * sizeof(float));
}

// SPECEE_EXIT_KV_FILL: the token's K/V in layers (exited, n_layer) from the exit layer's output h
static void fill_skipped_kv(specee_spec & sp, int32_t exited, const float * h, int32_t pos) {
    const specee_model & m       = *sp.model;
    const int32_t        n_layer = (int32_t) m.hparams.n_layer;
    specee_kv_cache &    kv      = specee_context_kv(*sp.ctx);
    const int64_t        cell    = specee_kv_batch_cells(sp.ctx)[0];

    const int32_t graph_size = 16 * n_layer + 16;
    std::vector<uint8_t> meta(ggml_tensor_overhead() * graph_size + ggml_graph_overhead_custom(graph_size, false));
    ggml_init_params     ip   = {meta.size(), meta.data(), /*no_alloc =*/true};
    ggml_context *       ctx0 = ggml_init(ip);
    std::unique_ptr<ggml_context, void (*)(ggml_context *)> guard(ctx0, ggml_free);
    specee_graph_io io;
    ggml_cgraph *   gf = specee_build_kv_fill_graph(ctx0, m, kv, exited + 1, n_layer, io, graph_size);

    ggml_backend_sched_t sched = specee_context_sched(*sp.ctx);
    ggml_backend_sched_reset(sched);
    if (!ggml_backend_sched_alloc_graph(sched, gf)) {
        specee_fail("cannot allocate the graph that fills the skipped layers' K/V");
    }
    ggml_backend_tensor_set(io.inp_embd, h, 0, (size_t) sp.n_embd * sizeof(float));
    ggml_backend_tensor_set(io.inp_pos, &pos, 0, sizeof(int32_t));
    ggml_backend_tensor_set(io.inp_kv_idxs, &cell, 0, sizeof(int64_t));
    specee_context_compute(*sp.ctx, gf, 1);
    for (int32_t il = exited + 1; il < n_layer; ++il) {
        kv.set_valid((int32_t) cell, il);
    }
}

static int32_t step_exit_impl(specee_spec & sp, specee_sampler & smpl, const specee_exit_params & ep,
                              int32_t * exit_layer) {
    if (sp.root < 0) {
        specee_fail("early exit: call specee_spec_prefill before specee_spec_step_exit");
    }
    if (!specee_sampler_greedy(smpl)) {
        specee_fail("early exit decodes greedily (the exit layer's argmax); use a greedy sampler (temperature 0)");
    }
    const specee_model & m       = *sp.model;
    const int32_t        n_layer = (int32_t) m.hparams.n_layer;
    const int32_t        n_cand  = (int32_t) m.exit.n_cand;
    if (ep.kv_policy != SPECEE_EXIT_KV_MASK && ep.kv_policy != SPECEE_EXIT_KV_FILL) {
        specee_fail("unknown early-exit KV policy %d (0: mask, 1: fill)", ep.kv_policy);
    }
    if (ep.force_exit_layer >= n_layer) {
        specee_fail("forced exit layer %d: the model has %d layers", ep.force_exit_layer, n_layer);
    }
    if (m.exit.n_pred == 0 && ep.force_exit_layer < 0 && ep.threshold < 1.0f) {
        specee_fail("early exit needs exit predictors (blk.N.pred.*): merge them into the model with "
                    "python -m specee.convert merge --predictors");
    }
    specee_context & ctx   = *sp.ctx;
    const int32_t    n_ctx = (int32_t) specee_n_ctx(&ctx);
    if (specee_kv_n_used(&ctx) >= n_ctx) {
        specee_fail("context full: no KV cell left for the next token (n_ctx = %d)", n_ctx);
    }
    specee_exit_stats & st = sp.exit_stats;

    // ---- candidates: the head's top n_cand after the pending pairs
    auto t0 = exit_clock::now();
    specee_draft_commit(sp);
    std::vector<int32_t> cand(std::min(n_cand, sp.n_dvocab));
    {
        std::vector<int32_t> idx(sp.n_dvocab);
        for (int32_t i = 0; i < sp.n_dvocab; ++i) {
            idx[i] = i;
        }
        const float * lg = sp.d_logits.data();
        std::partial_sort(idx.begin(), idx.begin() + cand.size(), idx.end(),
                          [&](int32_t a, int32_t b) { return lg[a] > lg[b] || (lg[a] == lg[b] && a < b); });
        const std::vector<int32_t> & dvocab = m.eagle.draft_vocab;
        for (size_t j = 0; j < cand.size(); ++j) {
            cand[j] = dvocab.empty() ? idx[j] : dvocab[idx[j]];
        }
    }
    st.t_head_ms += ms_since(t0);

    // ---- the token's layers, checked at the scheduled ones
    int32_t       tok = sp.root, pos = sp.root_pos;
    specee_batch  b   = {1, &tok, &pos, nullptr, nullptr};
    int32_t       l   = 0, exited = -1, next = -1;
    std::vector<float> feat(3 * n_cand), p(n_cand), p_prev, norm, logits;
    const std::vector<int32_t> sched =
        ep.force_exit_layer >= 0 ? std::vector<int32_t>{ep.force_exit_layer} : exit_schedule(sp, ep);
    for (int32_t s : sched) {
        t0 = exit_clock::now();
        if (specee_eval_layers(&ctx, &b, l, s + 1, SPECEE_EVAL_NO_LOGITS) != 0) {
            specee_fail("%s", specee_last_error());
        }
        st.t_layers_ms += ms_since(t0);
        l = s + 1;
        const float * h = specee_get_hidden(&ctx, -1);

        bool fire = ep.force_exit_layer >= 0;
        if (!fire) {
            t0 = exit_clock::now();
            if ((int32_t) cand.size() == n_cand) {
                specee_exit_features_impl(m, h, cand.data(), p_prev.empty() ? nullptr : p_prev.data(), feat.data(),
                                          p.data());
                fire = specee_exit_predict_impl(m, s, feat.data()) > ep.threshold;
                p_prev = p;
            }
            st.n_checks += 1;
            st.n_fired += fire;
            st.t_check_ms += ms_since(t0);
        }
        if (!fire) {
            continue;
        }
        t0 = exit_clock::now();
        exit_logits(sp, h, norm, logits);
        const int32_t t = specee_sampler_sample(&smpl, logits.data(), sp.n_vocab);
        st.t_exit_ms += ms_since(t0);
        if (t < 0) {
            specee_fail("%s", specee_last_error());
        }
        if (ep.force_exit_layer >= 0 || std::find(cand.begin(), cand.end(), t) != cand.end()) {
            exited = s;
            next   = t;
            if (ep.kv_policy == SPECEE_EXIT_KV_FILL) {
                t0 = exit_clock::now();
                fill_skipped_kv(sp, s, h, pos);
                st.t_fill_ms += ms_since(t0);
            }
            break;
        }
        st.n_rejected += 1;
    }
    if (exited < 0) {
        t0 = exit_clock::now();
        if (specee_eval_layers(&ctx, &b, l, n_layer, 0) != 0) {
            specee_fail("%s", specee_last_error());
        }
        st.t_layers_ms += ms_since(t0);
        next = specee_sampler_sample(&smpl, specee_get_logits(&ctx), sp.n_vocab);
        if (next < 0) {
            specee_fail("%s", specee_last_error());
        }
        const float * nm = specee_get_norm(&ctx);
        norm.assign(nm, nm + sp.n_embd);
    }
    specee_sampler_accept(&smpl, next);

    // ---- the pair (this token's feature, the next token) for the head; the next token becomes the root
    sp.pend_feat.insert(sp.pend_feat.end(), norm.begin(), norm.end());
    sp.pend_tok.push_back(next);
    sp.pend_pos.push_back(sp.root_pos);
    sp.root = next;
    sp.root_pos += 1;

    const int32_t layer = exited >= 0 ? exited : n_layer - 1;
    st.n_tokens += 1;
    st.n_exits += exited >= 0;
    st.sum_layers += layer + 1;
    if (exited >= 0) {
        sp.recent_exits.push_back(exited);
        if (sp.recent_exits.size() > 5) {
            sp.recent_exits.erase(sp.recent_exits.begin());
        }
    }
    if (exit_layer) {
        *exit_layer = layer;
    }
    return next;
}

// ---- C API ---------------------------------------------------------------------------------------

extern "C" int32_t specee_model_exit_n_pred(const specee_model * model) { return model ? model->exit.n_pred : 0; }

extern "C" bool specee_model_exit_has_pred(const specee_model * model, int32_t layer) {
    return model && layer >= 0 && layer < (int32_t) model->exit.pred.size() && model->exit.pred[layer].up;
}

extern "C" int32_t specee_model_exit_layers(const specee_model * model, int32_t * out, int32_t n_max) {
    const int32_t n = model ? (int32_t) model->exit.layers.size() : 0;
    for (int32_t i = 0; out && i < std::min(n, n_max); ++i) {
        out[i] = model->exit.layers[i];
    }
    return n;
}

extern "C" float specee_model_exit_threshold(const specee_model * model) { return model ? model->exit.threshold : 0.5f; }

extern "C" int32_t specee_model_exit_n_candidates(const specee_model * model) {
    return model ? (int32_t) model->exit.n_cand : 0;
}

extern "C" int32_t specee_exit_features(const specee_model * model, const float * h, const int32_t * cand,
                                        const float * p_prev, float * feat, float * p_out) {
    return specee_guard<int32_t>(-1, [&] {
        if (!model || !h || !cand || !feat) {
            specee_fail("specee_exit_features: model, h, cand and feat are required");
        }
        specee_exit_features_impl(*model, h, cand, p_prev, feat, p_out);
        return 0;
    });
}

extern "C" float specee_exit_predict(const specee_model * model, int32_t layer, const float * feat) {
    return specee_guard<float>(-1.0f, [&] {
        if (!model || !feat) {
            specee_fail("specee_exit_predict: model and feat are required");
        }
        return specee_exit_predict_impl(*model, layer, feat);
    });
}

extern "C" struct specee_exit_params specee_exit_default_params(void) {
    specee_exit_params p;
    p.threshold        = -1.0f; // the model's specee.exit.threshold
    p.layers           = nullptr;
    p.n_layers         = 0;
    p.dynamic          = true;
    p.force_exit_layer = -1;
    p.kv_policy        = SPECEE_EXIT_KV_MASK;
    return p;
}

extern "C" int32_t specee_spec_step_exit(specee_spec * spec, specee_sampler * smpl, const specee_exit_params * params,
                                         int32_t * exit_layer) {
    return specee_guard<int32_t>(-1, [&] {
        if (!spec || !smpl) {
            specee_fail("specee_spec_step_exit: no decoder or sampler");
        }
        specee_exit_params ep = params ? *params : specee_exit_default_params();
        if (ep.threshold < 0.0f) {
            ep.threshold = spec->model->exit.threshold;
        }
        return step_exit_impl(*spec, *smpl, ep, exit_layer);
    });
}

extern "C" struct specee_exit_stats specee_spec_get_exit_stats(const specee_spec * spec) {
    return spec ? spec->exit_stats : specee_exit_stats{};
}

extern "C" void specee_spec_reset_exit_stats(specee_spec * spec) {
    if (spec) {
        spec->exit_stats = specee_exit_stats{};
    }
}
