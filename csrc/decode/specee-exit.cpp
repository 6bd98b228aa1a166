// specee-exit.cpp: SpecEE's exit predictors (the features of a layer's hidden state and the per-layer MLP), the
// schedule of checked layers, and what follows an exit, for rows of a pass: early exit's token is a pass of one row,
// tree exit's verified tree a pass of many (specee-exit.h).
//
// At a checked layer l of a row, with the EAGLE head's top n_cand candidates cand there:
//   hn   = final_norm(h_l)                      the model's output norm applied to the layer's output
//   c_j  = lm_head[cand_j] . hn                 n_cand logits
//   p    = softmax(c)
//   feat = [c, p, p - p_prev]                   p_prev: p at the previously checked layer; at the first
//                                               check the third group is p itself (SpecEE's prob_gap)
//   prob = sigmoid(down . relu(up . feat + up_b) + down_b)
// The predictor fires when prob > threshold. Everything here is a few thousand multiply-adds per check, so it
// runs on the host from the weights' file mapping (the lm_head rows are read from the original, not the
// repacked, copy of the tensor).
#include "specee-exit.h"

#include "specee-arch.h"
#include "specee-context.h"
#include "specee-gguf.h"
#include "specee-graph.h"
#include "specee-impl.h"
#include "specee-model.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

// ---- the decoder's state ----------------------------------------------------------------------------------

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

// ---- the predictors -----------------------------------------------------------------------------------

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
    const float *      w = specee_gguf_tensor_f32(in_file(m, SPECEE_TENSOR_OUTPUT_NORM), s_w);
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
        specee_gguf_row_f32(head, cand[j], row.data());
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
    const float *            up     = specee_gguf_tensor_f32(pr.up, s_up);
    const float *            up_b   = specee_gguf_tensor_f32(pr.up_b, s_up_b);
    const float *            down   = specee_gguf_tensor_f32(pr.down, s_down);
    const float *            down_b = specee_gguf_tensor_f32(pr.down_b, s_down_b);
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

void exit_checks_begin(exit_checks & ec, std::vector<std::vector<int32_t>> cand) {
    ec.cand = std::move(cand);
    ec.feat.assign(ec.cand.size(), {});
    ec.p_prev.assign(ec.cand.size(), {});
}

void exit_checks_features(exit_checks & ec, specee_context & ctx) {
    const specee_model &       m      = *ctx.model;
    const int32_t              n_cand = (int32_t) m.exit.n_cand;
    const int64_t              n_embd = m.hparams.n_embd;
    const std::vector<float> & h      = specee_context_hidden(ctx);
    std::vector<float>         p(n_cand);
    for (size_t r = 0; r < ec.cand.size(); ++r) {
        if ((int32_t) ec.cand[r].size() != n_cand) {
            ec.feat[r].clear();
            continue;
        }
        ec.feat[r].resize(3 * n_cand);
        specee_exit_features_impl(m, h.data() + r * n_embd, ec.cand[r].data(),
                                  ec.p_prev[r].empty() ? nullptr : ec.p_prev[r].data(), ec.feat[r].data(), p.data());
        ec.p_prev[r] = p;
    }
}

// whether layer il's predictor is > threshold on every one of the rows
static bool rows_fire(const exit_checks & ec, const specee_model & m, int32_t il, const std::vector<int32_t> & rows,
                      float threshold) {
    for (int32_t r : rows) {
        const std::vector<float> & feat = ec.feat[r];
        if (feat.empty() || !(specee_exit_predict_impl(m, il, feat.data()) > threshold)) {
            return false;
        }
    }
    return true;
}

bool exit_layer_fires(const specee_exit_decoder & dec, const specee_model & m, int32_t s, int32_t forced,
                      const exit_checks & ec, const std::vector<int32_t> & rows, specee_generator_stats & st) {
    bool fire = s == forced;
    if (!fire && m.exit.pred[s].up) {
        fire = rows_fire(ec, m, s, rows, dec.params.threshold) && forced < 0;
        st.n_checks += 1;
        st.n_fired += fire;
    }
    return fire;
}

// ---- the schedule and a pass's stats ----------------------------------------------------------------------

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

// ---- after an exit --------------------------------------------------------------------------------------

void exit_layer_logits(specee_context & ctx, int32_t il, const std::vector<int32_t> & rows, std::vector<float> & norm,
                       std::vector<float> & logits) {
    const specee_model & m       = *ctx.model;
    const int32_t        n_rows  = (int32_t) rows.size();
    const int32_t        n       = std::max(n_rows, 1);
    const int64_t        n_vocab = m.hparams.n_vocab, n_embd = m.hparams.n_embd;
    specee_graph_io      io;
    ggml_tensor *        state = ctx.state[specee_context_backend_of_layer(ctx, il)]; // layer il's output
    ggml_cgraph *        gf    = specee_build_exit_graph(specee_graph_begin(ctx), m, state, io,
                                                                 16 + 4 * SPECEE_LORA_MAX, n_rows,
                                                                 {&ctx.lora, ctx.cparams.kernels});
    specee_graph_alloc(ctx, gf, "the exit layer's lm_head");
    if (n_rows > 0) {
        ggml_backend_tensor_set(io.inp_out_ids, rows.data(), 0, rows.size() * sizeof(int32_t));
    }
    specee_graph_compute(ctx, gf, n);
    const size_t first_norm = norm.size(), first_logits = logits.size();
    norm.resize(first_norm + n * n_embd);
    logits.resize(first_logits + n * n_vocab);
    ggml_backend_tensor_get(io.result_norm, norm.data() + first_norm, 0, n * n_embd * sizeof(float));
    ggml_backend_tensor_get(io.result_output, logits.data() + first_logits, 0, n * n_vocab * sizeof(float));
}

void exit_fill_skipped(specee_context & ctx, int32_t il, const std::vector<int32_t> & rows) {
    const specee_model & m       = *ctx.model;
    const int32_t        n_layer = (int32_t) m.hparams.n_layer;
    const int32_t        n_rows  = (int32_t) rows.size();
    const int32_t        n       = std::max(n_rows, 1);
    std::vector<int32_t> pos(n);
    std::vector<int64_t> cells(n);
    for (int32_t i = 0; i < n; ++i) {
        const int32_t r = n_rows > 0 ? rows[i] : 0;
        pos[i]          = ctx.pos[r];
        cells[i]        = ctx.cells[r];
    }
    specee_graph_io io;
    ggml_cgraph *   gf = specee_build_kv_fill_graph(specee_graph_begin(ctx), m, ctx.kv,
                                                    ctx.state[specee_context_backend_of_layer(ctx, il)], il + 1,
                                                    n_layer, io, ctx.graph_size, n_rows,
                                                    {&ctx.lora, ctx.cparams.kernels});
    specee_graph_alloc(ctx, gf, "the skipped layers' K/V");
    if (n_rows > 0) {
        ggml_backend_tensor_set(io.inp_out_ids, rows.data(), 0, rows.size() * sizeof(int32_t));
    }
    ggml_backend_tensor_set(io.inp_pos, pos.data(), 0, pos.size() * sizeof(int32_t));
    ggml_backend_tensor_set(io.inp_kv_idxs, cells.data(), 0, cells.size() * sizeof(int64_t));
    specee_graph_compute(ctx, gf, n);
    for (int64_t c : cells) {
        for (int32_t l = il + 1; l < n_layer; ++l) {
            ctx.kv.set_valid((int32_t) c, l);
        }
    }
}

std::vector<float> exit_head_features(specee_context & ctx, int32_t il, const std::vector<int32_t> & rows,
                                      const std::vector<float> & norm) {
    const specee_eagle & e = ctx.model->eagle;
    if (e.version != 3) {
        return norm;
    }
    const int64_t              n_embd = ctx.model->hparams.n_embd;
    const std::vector<float> & h      = specee_context_hidden(ctx); // layer il's output
    std::vector<float>         feats;
    for (int32_t row : rows) {
        const float *      f0 = specee_context_feature(ctx, row);
        std::vector<float> f(f0, f0 + 3 * n_embd);
        for (size_t k = 0; k < e.feature_layers.size(); ++k) {
            if (e.feature_layers[k] > il) {
                std::copy(h.begin() + row * n_embd, h.begin() + (row + 1) * n_embd, f.begin() + (int64_t) k * n_embd);
            }
        }
        feats.insert(feats.end(), f.begin(), f.end());
    }
    return feats;
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
