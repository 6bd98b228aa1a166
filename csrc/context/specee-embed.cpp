// specee-embed.cpp: embeddings, a text's final-norm rows pooled (none, mean, cls, last, rank: the table below, what
// /v1/embeddings, /rerank and Model.embed give). Each text is evaluated alone on a sequence of its own, at positions
// 0.., with no logits, and its cells are removed afterwards: the cache's other sequences (the single-sequence calls'
// conversation, the parallel slots' requests) stay as they were.
#include "specee-embed.h"

#include "specee-context.h"
#include "specee-gguf.h"
#include "specee-impl.h"
#include "specee-model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

// a pooling resolved (SPECEE_POOLING_MODEL: the model's), checked against the model
static int32_t pooling_of(const specee_model & model, int32_t pooling) {
    const int32_t p = pooling == SPECEE_POOLING_MODEL ? specee_model_pooling(&model) : pooling;
    if (!specee_pooling_row(p)) {
        specee_fail("unknown pooling %d (0..%d: none, mean, cls, last, rank; -1: the model's)", pooling,
                    (int32_t) SPECEE_POOLING_RANK);
    }
    return p;
}

// ---- one text ----------------------------------------------------------------------------------------------

// rank pooling's scores [n_cls_out] of a text's last final-norm row h, as llama.cpp's build_pooling gives them: through
// the classifier head where the file has one (tanh(cls h + b), then cls.output h + b, a softmax for Qwen3), else h's
// first element. The head is read from the file mapping on the host, whichever device the layers are on.
static void rank_scores(const specee_model & m, const float * h, float * out) {
    const int32_t      n_embd = (int32_t) m.hparams.n_embd;
    std::vector<float> x(h, h + n_embd), row(n_embd), s_b;
    auto               affine = [&](const ggml_tensor * w, const ggml_tensor * b, int32_t n_rows, float * y) {
        const float * bias = b ? specee_gguf_tensor_f32(b, s_b) : nullptr;
        for (int32_t r = 0; r < n_rows; ++r) {
            specee_gguf_row_f32(w, r, row.data());
            double acc = bias ? bias[r] : 0.0;
            for (int32_t j = 0; j < n_embd; ++j) {
                acc += (double) row[j] * x[j];
            }
            y[r] = (float) acc;
        }
    };
    if (m.cls) {
        std::vector<float> y(n_embd);
        affine(m.cls, m.cls_b, n_embd, y.data());
        for (int32_t j = 0; j < n_embd; ++j) {
            x[j] = std::tanh(y[j]);
        }
    }
    if (!m.cls_out) {
        out[0] = x[0];
        return;
    }
    const int32_t n_out = (int32_t) m.hparams.n_cls_out;
    affine(m.cls_out, m.cls_out_b, n_out, out);
    if (m.hparams.rank_softmax) {
        const float top = *std::max_element(out, out + n_out);
        double      sum = 0.0;
        for (int32_t r = 0; r < n_out; ++r) {
            out[r] = std::exp(out[r] - top);
            sum += out[r];
        }
        for (int32_t r = 0; r < n_out; ++r) {
            out[r] = (float) (out[r] / sum);
        }
    }
}

// the text's final-norm rows [n, n_embd] pooled into out
static void pool_rows(const specee_model & m, const float * rows, int32_t n, int32_t pooling, float * out) {
    const int32_t n_embd = (int32_t) m.hparams.n_embd;
    switch (pooling) {
        case SPECEE_POOLING_NONE:
            std::copy(rows, rows + (size_t) n * n_embd, out);
            break;
        case SPECEE_POOLING_MEAN:
            // the rows summed in order, then divided (numpy's mean over rows, to the bit)
            std::fill(out, out + n_embd, 0.0f);
            for (int32_t i = 0; i < n; ++i) {
                for (int32_t j = 0; j < n_embd; ++j) {
                    out[j] += rows[(size_t) i * n_embd + j];
                }
            }
            for (int32_t j = 0; j < n_embd; ++j) {
                out[j] /= (float) n;
            }
            break;
        case SPECEE_POOLING_CLS:
            std::copy(rows, rows + n_embd, out);
            break;
        case SPECEE_POOLING_LAST:
            std::copy(rows + (size_t) (n - 1) * n_embd, rows + (size_t) n * n_embd, out);
            break;
        default: // rank: a causal model reads its last token, as llama.cpp does
            rank_scores(m, rows + (size_t) (n - 1) * n_embd, out);
            break;
    }
}

void specee_embed_impl(specee_context & ctx, const int32_t * tokens, int32_t n, int32_t pooling, float * out) {
    const int32_t p      = pooling_of(*ctx.model, pooling);
    if (!tokens || n <= 0) {
        specee_fail("cannot embed an empty text");
    }
    std::vector<int32_t> seq(n, SPECEE_SEQ_EMBED), pos(n);
    std::vector<int8_t>  no_out(n, 0);
    for (int32_t i = 0; i < n; ++i) {
        pos[i] = i;
    }
    ctx.kv.seq_remove(SPECEE_SEQ_EMBED, 0, -1);
    specee_batch b = {n, tokens, pos.data(), nullptr, no_out.data(), seq.data()};
    try {
        specee_eval_impl(ctx, &b);
    } catch (...) {
        ctx.kv.seq_remove(SPECEE_SEQ_EMBED, 0, -1);
        throw;
    }
    pool_rows(*ctx.model, ctx.norm.data(), n, p, out);
    ctx.kv.seq_remove(SPECEE_SEQ_EMBED, 0, -1);
}

// v scaled to unit length (a zero vector stays zero)
static void normalize(float * v, int32_t n) {
    double ss = 0.0;
    for (int32_t j = 0; j < n; ++j) {
        ss += (double) v[j] * v[j];
    }
    const float norm = (float) std::max(std::sqrt(ss), 1e-12);
    for (int32_t j = 0; j < n; ++j) {
        v[j] /= norm;
    }
}

// one text of the context's specee_embed: checked against the context, room made from sequence 0 where needed
static void embed_one(specee_context & ctx, const int32_t * tokens, int32_t n, int32_t pooling, float * out) {
    if (n <= 0) {
        specee_fail("cannot embed an empty text");
    }
    if (n > (int32_t) ctx.cparams.n_ctx) {
        specee_fail("the text has %d tokens, more than fit the context of %u", n, ctx.cparams.n_ctx);
    }
    if ((uint32_t) n > ctx.kv.size - ctx.kv.used) {
        ctx.kv.seq_remove(0, 0, -1); // the single-sequence calls' cache, kept only for prompt-prefix reuse
    }
    specee_embed_impl(ctx, tokens, n, pooling, out);
}

extern "C" int32_t specee_embed(specee_context * ctx, const int32_t * tokens, const int32_t * n_tokens, int32_t n_seqs,
                                int32_t pooling, bool normalize_out, float * out) {
    if (!ctx) {
        specee_set_error("no context");
        return -1;
    }
    std::lock_guard<std::recursive_mutex> lock(ctx->mutex);
    return specee_guard<int32_t>(-1, [&] {
        if (n_seqs < 0 || (n_seqs > 0 && (!tokens || !n_tokens || !out))) {
            specee_fail("specee_embed: bad arguments");
        }
        const int32_t p  = pooling_of(*ctx->model, pooling);
        const bool    to_unit = normalize_out && specee_pooling_row(p)->normalized;
        size_t        at = 0, at_out = 0;
        for (int32_t i = 0; i < n_seqs; ++i) {
            float * v = out + at_out;
            try {
                embed_one(*ctx, tokens + at, n_tokens[i], p, v);
            } catch (const std::exception & e) {
                if (n_seqs == 1) {
                    throw;
                }
                specee_fail("text %d: %s", i, e.what());
            }
            const int32_t n_out = specee_pooling_n_out(ctx->model, p, n_tokens[i]);
            if (to_unit) {
                normalize(v, n_out);
            }
            at += (size_t) n_tokens[i];
            at_out += (size_t) n_out;
        }
        return 0;
    });
}
