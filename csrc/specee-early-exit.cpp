// specee-early-exit.cpp: SpecEE early exit: the exit predictors (the features of a layer's hidden state and the
// per-layer MLP) and the decoder that checks them layer range by layer range
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

#include "specee-early-exit.h"

#include "specee-arch.h"
#include "specee-context.h"
#include "specee-graph.h"
#include "specee-impl.h"
#include "specee-model.h"
#include "specee-sampling.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
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

// the output norm and the lm_head as the file holds them: readable on the host, whichever device (or repacked CPU
// buffer) the model's own copies are in
static const ggml_tensor * in_file(const specee_model & m, specee_tensor which) {
    return ggml_get_tensor(m.file.ctx_meta, specee_tensor_name(which).c_str());
}

static const ggml_tensor * lm_head_in_file(const specee_model & m) {
    const ggml_tensor * t = in_file(m, SPECEE_TENSOR_OUTPUT);
    return t ? t : in_file(m, SPECEE_TENSOR_TOKEN_EMBD);
}

void specee_exit_features_impl(const specee_model & m, const float * h, const int32_t * cand, const float * p_prev,
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
    const float *      w = tensor_f32(in_file(m, SPECEE_TENSOR_OUTPUT_NORM), s_w);
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

float specee_exit_predict_impl(const specee_model & m, int32_t layer, const float * feat) {
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

// ---- the decoder ----------------------------------------------------------------------------------

// the layers checked for this token: the static set, plus e-2, e, e+2 around each of the last 5 exits;
// only layers with a predictor, before the last layer (exiting there saves nothing)
std::vector<int32_t> exit_schedule(const specee_exit_decoder & dec, const specee_model & m) {
    const int32_t        n_layer = (int32_t) m.hparams.n_layer;
    std::vector<int32_t> layers  = dec.layers;
    if (dec.params.dynamic) {
        for (int32_t e : dec.recent_exits) {
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

// the norm and full logits of the token's hidden state after layer il (on that layer's device; the token's row is the
// first of the batch)
static void exit_logits(specee_context & ctx, int32_t il, std::vector<float> & norm, std::vector<float> & logits) {
    const specee_model & m  = *ctx.model;
    specee_graph_io      io;
    ggml_cgraph *        gf = specee_build_exit_graph(specee_graph_begin(ctx), m,
                                                      ctx.state[specee_context_backend_of_layer(ctx, il)], io, 16);
    specee_graph_alloc(ctx, gf, "the exit layer's lm_head");
    specee_graph_compute(ctx, gf, 1);
    norm.resize(m.hparams.n_embd);
    logits.resize(m.hparams.n_vocab);
    ggml_backend_tensor_get(io.result_norm, norm.data(), 0, norm.size() * sizeof(float));
    ggml_backend_tensor_get(io.result_output, logits.data(), 0, logits.size() * sizeof(float));
}

// SPECEE_EXIT_KV_FILL: the token's K/V in layers (exited, n_layer) from the exit layer's output
static void fill_skipped_kv(specee_context & ctx, int32_t exited, int32_t pos) {
    const specee_model & m       = *ctx.model;
    const int32_t        n_layer = (int32_t) m.hparams.n_layer;
    const int64_t        cell    = ctx.cells[0];
    specee_graph_io      io;
    ggml_cgraph *        gf = specee_build_kv_fill_graph(specee_graph_begin(ctx), m, ctx.kv,
                                                         ctx.state[specee_context_backend_of_layer(ctx, exited)],
                                                         exited + 1, n_layer, io, ctx.graph_size);
    specee_graph_alloc(ctx, gf, "the skipped layers' K/V");
    ggml_backend_tensor_set(io.inp_pos, &pos, 0, sizeof(int32_t));
    ggml_backend_tensor_set(io.inp_kv_idxs, &cell, 0, sizeof(int64_t));
    specee_graph_compute(ctx, gf, 1);
    for (int32_t il = exited + 1; il < n_layer; ++il) {
        ctx.kv.set_valid((int32_t) cell, il);
    }
}

// The head's feature of the decoded token: EAGLE-1 the final norm of the layer it left at (`norm`); EAGLE-3 the outputs
// of its feature layers (feat3: the pass's, checked_pass.features), those past the exit layer (not computed) taken as
// the exit layer's output (the token's row of the state)
static std::vector<float> exit_feature(specee_context & ctx, int32_t exited, const std::vector<float> & norm,
                                       const std::vector<float> & feat3) {
    const specee_eagle & e = ctx.model->eagle;
    if (e.version != 3) {
        return norm;
    }
    const int64_t      n_embd = ctx.model->hparams.n_embd;
    std::vector<float> f(feat3.begin(), feat3.begin() + 3 * n_embd);
    if (exited >= 0) {
        const float * h = specee_context_hidden(ctx).data(); // the output of layer `exited`, the token's row first
        for (size_t k = 0; k < e.feature_layers.size(); ++k) {
            if (e.feature_layers[k] > exited) {
                std::copy(h, h + n_embd, f.begin() + (int64_t) k * n_embd);
            }
        }
    }
    return f;
}

void specee_exit_init(specee_exit_decoder & dec, const specee_model & m, const specee_exit_params & params) {
    const int32_t n_layer = (int32_t) m.hparams.n_layer;
    dec.params = params;
    if (dec.params.threshold < 0.0f) {
        dec.params.threshold = m.exit.threshold;
    }
    dec.layers = params.n_layers > 0 ? std::vector<int32_t>(params.layers, params.layers + params.n_layers)
                                     : m.exit.layers;
    dec.replay.assign(params.replay, params.replay + params.n_replay);
    for (int32_t l : dec.replay) {
        if (l < 0 || l >= n_layer) {
            specee_fail("replayed exit layer %d: the model has layers 0..%d", l, n_layer - 1);
        }
    }
    if (!dec.replay.empty() || dec.params.threshold >= 1.0f) {
        return; // replays, and a threshold no predictor reaches, need no predictors
    }
    if (m.exit.n_pred == 0) {
        specee_fail("early exit needs exit predictors (blk.N.pred.*): merge them into the model with python -m "
                    "specee.convert merge --predictors, or load a draft head file that has them (--draft-head)");
    }
    for (int32_t l : dec.layers) {
        if (l < 0 || l >= n_layer - 1 || !m.exit.pred[l].up) {
            specee_fail("exit layer %d has no exit predictor (or is the last layer); layers with one: blk.N.pred.* "
                        "of the model or its draft head file", l);
        }
    }
}

// the draft head's top n_cand candidates for the token after the root (target ids)
static std::vector<int32_t> exit_candidates(specee_draft_head & head, int32_t n_cand, specee_generator_stats & st) {
    const auto t0 = specee_clock::now();
    specee_draft_commit(head);
    std::vector<int32_t> cand = specee_top_k(head.logits.data(), head.n_dvocab, n_cand);
    for (int32_t & c : cand) {
        c = specee_draft_target_id(head, c);
    }
    st.t_head_ms += specee_ms_since(t0);
    return cand;
}

std::vector<int32_t> exit_pass_schedule(specee_exit_decoder & dec, const specee_model & m, int32_t & forced) {
    const int32_t        n_layer = (int32_t) m.hparams.n_layer;
    std::vector<int32_t> sched   = exit_schedule(dec, m);
    forced                       = -1;
    if (!dec.replay.empty()) {
        forced = dec.replay[dec.n_replayed++ % dec.replay.size()];
        sched.erase(std::remove_if(sched.begin(), sched.end(), [&](int32_t il) { return il >= forced; }), sched.end());
        if (forced < n_layer - 1) {
            sched.push_back(forced);
        }
    }
    return sched;
}

// whether the token (the first row of the pass) leaves at scheduled layer s (its predictor fires; a replay fires at its
// layer only); p_prev carries the candidates' softmax from one check to the next
static bool check_fires(const specee_exit_decoder & dec, specee_context & ctx, int32_t s, int32_t forced,
                        const std::vector<int32_t> & cand, std::vector<float> & p_prev, specee_generator_stats & st) {
    const specee_model & m      = *ctx.model;
    const int32_t        n_cand = (int32_t) m.exit.n_cand;
    bool                 fire   = s == forced;
    if (!fire && m.exit.pred[s].up) {
        const auto t0 = specee_clock::now();
        if ((int32_t) cand.size() == n_cand) {
            std::vector<float> feat(3 * n_cand), p(n_cand);
            const float *      h = specee_context_hidden(ctx).data();
            specee_exit_features_impl(m, h, cand.data(), p_prev.empty() ? nullptr : p_prev.data(), feat.data(),
                                      p.data());
            fire   = specee_exit_predict_impl(m, s, feat.data()) > dec.params.threshold && forced < 0;
            p_prev = p;
        }
        st.n_checks += 1;
        st.n_fired += fire;
        st.t_check_ms += specee_ms_since(t0);
    }
    return fire;
}

void exit_count_pass(specee_exit_decoder & dec, int32_t exited, int32_t n_layer, specee_generator_stats & st) {
    st.n_steps += 1;
    st.n_exits += exited >= 0;
    st.n_layers_run += exited >= 0 ? exited + 1 : n_layer;
    if (exited >= 0) {
        dec.recent_exits.push_back(exited);
        if (dec.recent_exits.size() > 5) {
            dec.recent_exits.erase(dec.recent_exits.begin());
        }
    }
}

// One token's step; `out` receives what it puts out (token, layers its step ran): without checks its next token;
// with checks (dec.params.check) what checked_pass_check lets out, or nothing while the token waits
static void exit_step(specee_exit_decoder & dec, specee_draft_head & head, specee_sampler & smpl, int32_t & root,
                      int32_t & root_pos, std::vector<std::pair<int32_t, int32_t>> & out, specee_generator_stats & st) {
    specee_context &     ctx     = *head.ctx;
    const specee_model & m       = *head.model;
    const int32_t        n_layer = (int32_t) m.hparams.n_layer;
    const bool           check   = dec.params.check;

    const std::vector<int32_t> cand = exit_candidates(head, (int32_t) m.exit.n_cand, st);

    // ---- the token's layers, checked at the scheduled ones; with checks the waiting tokens join the pass as rows
    // after the token's (specee-exit-check.cpp), else the pass is the token's alone
    int32_t                    forced = -1;
    const std::vector<int32_t> sched  = exit_pass_schedule(dec, m, forced);
    checked_pass               cp;
    checked_pass_begin(cp, dec.chain, ctx, 1, &root, &root_pos, nullptr, nullptr);
    int32_t            exited = -1, next = -1;
    std::vector<float> p_prev, norm, logits;
    for (int32_t s : sched) {
        auto t0 = specee_clock::now();
        checked_pass_run(cp, s + 1, 0);
        st.t_layers_ms += specee_ms_since(t0);
        if (!check_fires(dec, ctx, s, forced, cand, p_prev, st)) {
            continue;
        }
        t0 = specee_clock::now();
        exit_logits(ctx, s, norm, logits);
        const int32_t t = specee_sampler_sample_impl(smpl, logits.data(), head.n_vocab);
        st.t_exit_ms += specee_ms_since(t0);
        if (forced < 0 && std::find(cand.begin(), cand.end(), t) == cand.end()) {
            st.n_rejected += 1;
            continue;
        }
        exited = s;
        next   = t;
        if (dec.params.kv == SPECEE_EXIT_KV_FILL) {
            t0 = specee_clock::now();
            fill_skipped_kv(ctx, s, root_pos);
            st.t_fill_ms += specee_ms_since(t0);
        }
        break;
    }
    if (exited < 0) {
        const auto t0 = specee_clock::now();
        checked_pass_run(cp, n_layer, 0);
        st.t_layers_ms += specee_ms_since(t0);
        if (!checked_pass_check(cp, head, smpl, root, root_pos, out, st)) {
            exit_count_pass(dec, -1, n_layer, st);
            return; // a waiting token was wrong: the sequence goes on from the full model's token there
        }
        next = specee_sampler_sample_impl(smpl, ctx.logits.data(), head.n_vocab); // the token's row is the first
        norm.assign(ctx.norm.begin(), ctx.norm.begin() + m.hparams.n_embd);
    }
    const std::vector<float> feat = exit_feature(ctx, exited, norm, cp.features);
    if (exited >= 0 && check) {
        // the token waits, unchecked, with the waiting tokens of the pass
        checked_pass_stop(cp);
        checked_pass_wait(cp, 0, ctx.cells[0], root_pos, feat, next, specee_sampler_history(smpl));
    } else {
        out.emplace_back(next, exited >= 0 ? exited + 1 : n_layer);
    }
    specee_sampler_accept_impl(smpl, next);

    // ---- the pair (this token's feature, the next token) for the head; the next token becomes the root
    specee_draft_add_pair(head, feat.data(), next, root_pos);
    root = next;
    root_pos += 1;
    exit_count_pass(dec, exited, n_layer, st);
    if (exited >= 0 && check && specee_token_is_eog(&m, next)) {
        specee_exit_chain_flush(dec.chain, head, smpl, root, root_pos, out, st); // nothing follows it: check it now
    }
}

int32_t specee_exit_step(specee_exit_decoder & dec, specee_draft_head & head, specee_sampler & smpl, int32_t & root,
                         int32_t & root_pos, int32_t & layers_run, specee_generator_stats & st) {
    std::vector<std::pair<int32_t, int32_t>> out;
    exit_step(dec, head, smpl, root, root_pos, out, st);
    layers_run = out[0].second;
    return out[0].first;
}

int32_t specee_exit_step_checked(specee_exit_decoder & dec, specee_draft_head & head, specee_sampler & smpl,
                                 int32_t & root, int32_t & root_pos, std::vector<std::pair<int32_t, int32_t>> & out,
                                 specee_generator_stats & st) {
    const size_t out0 = out.size();
    exit_step(dec, head, smpl, root, root_pos, out, st);
    return (int32_t) (out.size() - out0);
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

