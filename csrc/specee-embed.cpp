// specee-embed.cpp: pooled embeddings, the mean final-norm output over a text's tokens (what /v1/embeddings and
// Model.embed give). Each text is evaluated alone on a sequence of its own, at positions 0.., with no logits, and
// its cells are removed afterwards: the cache's other sequences (the single-sequence calls' conversation, the
// parallel slots' requests) stay as they were.
#include "specee-embed.h"

#include "specee-context.h"
#include "specee-impl.h"
#include "specee-model.h"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

void specee_embed_impl(specee_context & ctx, const int32_t * tokens, int32_t n, float * out) {
    const int32_t n_embd = (int32_t) ctx.model->hparams.n_embd;
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
    // the rows summed in order, then divided (numpy's mean over rows, to the bit)
    std::fill(out, out + n_embd, 0.0f);
    for (int32_t i = 0; i < n; ++i) {
        for (int32_t j = 0; j < n_embd; ++j) {
            out[j] += ctx.norm[(size_t) i * n_embd + j];
        }
    }
    for (int32_t j = 0; j < n_embd; ++j) {
        out[j] /= (float) n;
    }
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
static void embed_one(specee_context & ctx, const int32_t * tokens, int32_t n, float * out) {
    if (n <= 0) {
        specee_fail("cannot embed an empty text");
    }
    if (n > (int32_t) ctx.cparams.n_ctx) {
        specee_fail("the text has %d tokens, more than fit the context of %u", n, ctx.cparams.n_ctx);
    }
    if ((uint32_t) n > ctx.kv.size - ctx.kv.used) {
        ctx.kv.seq_remove(0, 0, -1); // the single-sequence calls' cache, kept only for prompt-prefix reuse
    }
    specee_embed_impl(ctx, tokens, n, out);
}

extern "C" int32_t specee_embed(specee_context * ctx, const int32_t * tokens, const int32_t * n_tokens, int32_t n_seqs,
                                bool normalize_out, float * out) {
    if (!ctx) {
        specee_set_error("no context");
        return -1;
    }
    std::lock_guard<std::recursive_mutex> lock(ctx->mutex);
    return specee_guard<int32_t>(-1, [&] {
        if (n_seqs < 0 || (n_seqs > 0 && (!tokens || !n_tokens || !out))) {
            specee_fail("specee_embed: bad arguments");
        }
        const int32_t n_embd = (int32_t) ctx->model->hparams.n_embd;
        size_t        at     = 0;
        for (int32_t i = 0; i < n_seqs; ++i) {
            float * v = out + (size_t) i * n_embd;
            try {
                embed_one(*ctx, tokens + at, n_tokens[i], v);
            } catch (const std::exception & e) {
                if (n_seqs == 1) {
                    throw;
                }
                specee_fail("text %d: %s", i, e.what());
            }
            if (normalize_out) {
                normalize(v, n_embd);
            }
            at += (size_t) n_tokens[i];
        }
        return 0;
    });
}
