// specee-early-exit.cpp: SpecEE's exit predictors: the features of a layer's hidden state and the per-layer MLP
//
// At a checked layer l of a decoded token, with the EAGLE head's top n_cand candidates cand:
//   hn   = final_norm(h_l)                      the model's output norm applied to the layer's output
//   c_j  = lm_head[cand_j] . hn                 n_cand logits
//   p    = softmax(c)
//   feat = [c, p, p - p_prev]                   p_prev: p at the previously checked layer (zeros at the first)
//   prob = sigmoid(down . relu(up . feat + up_b) + down_b)
// The predictor fires when prob > threshold. Everything here is a few thousand multiply-adds per check, so it
// runs on the host from the weights' file mapping (the lm_head rows are read from the original, not the
// repacked, copy of the tensor).

#include "specee-arch.h"
#include "specee-impl.h"
#include "specee-model.h"
#include "specee.h"

#include "ggml-cpu.h"

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

static std::vector<float> tensor_f32(const ggml_tensor * t) {
    std::vector<float> out((size_t) ggml_nelements(t));
    for (int64_t r = 0; r < ggml_nrows(t); ++r) {
        row_f32(t, r, out.data() + r * t->ne[0]);
    }
    return out;
}

// the lm_head as the file holds it (the model's own tensor may be a repacked copy)
static const ggml_tensor * lm_head_in_file(const specee_model & m) {
    const ggml_tensor * t = ggml_get_tensor(m.ctx_meta, specee_tensor_name(SPECEE_TENSOR_OUTPUT).c_str());
    return t ? t : ggml_get_tensor(m.ctx_meta, specee_tensor_name(SPECEE_TENSOR_TOKEN_EMBD).c_str());
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
    std::vector<float> w(n_embd), hn(n_embd), row(n_embd);
    row_f32(m.output_norm, 0, w.data());
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
        feat[2 * n_cand + j] = p_prev ? p[j] - p_prev[j] : 0.0f;
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
    const std::vector<float> up     = tensor_f32(pr.up);
    const std::vector<float> up_b   = tensor_f32(pr.up_b);
    const std::vector<float> down   = tensor_f32(pr.down);
    const std::vector<float> down_b = tensor_f32(pr.down_b);
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
