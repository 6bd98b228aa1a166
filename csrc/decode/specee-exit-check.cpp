// specee-exit-check.cpp: checked exits, the part early exit and tree exit share.
//
// A token t that exits after layer e has run layers [0, e]; the token emitted after it is unchecked. The next pass runs
// its own batch through layers [0, e] alone, and from layer e + 1 on t rides along as an extra row, started from the
// hidden state it kept (specee_eval_resume_impl): t's skipped layers cost no pass of their own, and the new batch
// attends to t's real K/V in every layer. If that pass exits too, t stops with it and waits on; whenever a pass reaches
// the last layer, every waiting token has reached it in the same batch, and its logits are the full model's. Each
// waiting token's successor is then compared with the full model's greedy token, drawn with the sampler's history as
// it stood before the chain began (penalties count as in plain decoding). The first disagreement takes the sequence
// back: the full model's token replaces the exited one, and the cells and draft pairs of everything after it go.
// Tokens are put out only once checked, so a caller sees plain decoding's greedy tokens (as EAGLE's verification,
// up to rounding between a batch and a single row).
//
// The batch of a pass: the decoder's rows first (rows 0..n_cur-1, with their tree mask), then the waiting tokens that
// joined, in position order. A later waiting token stopped no later than the earlier ones (it stopped where a pass
// they had joined stopped, or below where they wait), so at any layer the joined ones are the newest. Waiting rows
// attend to each other causally and never to the decoder's rows (which are later positions); the decoder's rows
// attend to every waiting row.
#include "specee-exit-check.h"

#include "specee-context.h"
#include "specee-draft-head.h"
#include "specee-impl.h"
#include "specee-model.h"
#include "specee-sampling.h"

#include <algorithm>

void checked_pass_begin(checked_pass & cp, specee_exit_chain & chain, specee_context & ctx, int32_t n_cur,
                        const int32_t * tok, const int32_t * pos, const uint8_t * tree_mask, const int8_t * output) {
    cp.chain = &chain;
    cp.ctx   = &ctx;
    cp.n_cur = n_cur;
    cp.tok.assign(tok, tok + n_cur);
    cp.pos.assign(pos, pos + n_cur);
    cp.tree_mask.assign(tree_mask ? tree_mask : nullptr, tree_mask ? tree_mask + (size_t) n_cur * n_cur : nullptr);
    cp.output.assign(output ? output : nullptr, output ? output + n_cur : nullptr);
    cp.first   = (int32_t) chain.pending.size();
    cp.l       = n_cur > 0 || chain.pending.empty() ? 0 : chain.pending.back().resume;
    cp.started = false;
    const specee_model & m = *ctx.model;
    cp.features.assign(m.eagle.version == 3 ? (size_t) n_cur * 3 * m.hparams.n_embd : 0, 0.0f);
}

// the pass's mask when waiting rows join a batch with a tree mask: [n_cur tree rows, then n_wait waiting rows]
static std::vector<uint8_t> joined_mask(const checked_pass & cp, int32_t n_wait) {
    const int32_t        n_cur = cp.n_cur, n = n_cur + n_wait;
    std::vector<uint8_t> mask((size_t) n * n, 0);
    for (int32_t i = 0; i < n; ++i) {
        for (int32_t j = 0; j < n; ++j) {
            uint8_t see;
            if (i < n_cur) {
                see = j < n_cur ? cp.tree_mask[(size_t) i * n_cur + j] : 1; // a tree row sees every waiting row
            } else {
                see = j >= n_cur && j <= i; // waiting rows, in position order: causal among themselves
            }
            mask[(size_t) i * n + j] = see;
        }
    }
    return mask;
}

void checked_pass_run(checked_pass & cp, int32_t b, uint32_t flags) {
    specee_context &               ctx     = *cp.ctx;
    const specee_model &           m       = *ctx.model;
    const int32_t                  n_layer = (int32_t) m.hparams.n_layer;
    const int64_t                  n_embd  = m.hparams.n_embd;
    const std::vector<exit_pending> & pend = cp.chain->pending;
    while (cp.l < b) {
        int32_t join = cp.first;
        while (join > 0 && pend[join - 1].resume <= cp.l) {
            --join;
        }
        const int32_t  stop = join > 0 ? std::min(b, pend[join - 1].resume) : b;
        const uint32_t fl   = stop == n_layer ? flags : flags | SPECEE_EVAL_NO_LOGITS;
        if (!cp.started && join == cp.first) {
            // the decoder's batch from its first layer (nothing waits at layer 0: a waiting token ran layer 0)
            specee_batch bt = {cp.n_cur, cp.tok.data(), cp.pos.data(), cp.tree_mask.empty() ? nullptr : cp.tree_mask.data(),
                               cp.output.empty() ? nullptr : cp.output.data()};
            specee_eval_layers_impl(ctx, &bt, cp.l, stop, fl);
        } else if (join == cp.first) {
            const std::vector<int32_t> toks = ctx.tokens;
            specee_batch               bt   = {(int32_t) toks.size(), toks.data(), nullptr, nullptr, nullptr};
            specee_eval_layers_impl(ctx, &bt, cp.l, stop, fl);
        } else {
            // rows join: the decoder's rows and those already waiting in the pass continue from their hidden state
            // after layer l - 1, the joining ones from the state they kept
            std::vector<int32_t> cells;
            std::vector<float>   hid;
            const int32_t        n_old = cp.started ? ctx.n_tokens : 0;
            const float *        h     = cp.started ? specee_context_hidden(ctx).data() : nullptr;
            const int32_t        n_dec = cp.started ? cp.n_cur : 0;
            cells.insert(cells.end(), ctx.cells.begin(), ctx.cells.begin() + n_dec);
            hid.insert(hid.end(), h, h + (size_t) n_dec * n_embd);
            for (int32_t k = join; k < cp.first; ++k) {
                cells.push_back(pend[k].cell);
                hid.insert(hid.end(), pend[k].h.begin(), pend[k].h.end());
            }
            cells.insert(cells.end(), ctx.cells.begin() + n_dec, ctx.cells.begin() + n_old);
            hid.insert(hid.end(), h + (size_t) n_dec * n_embd, h + (size_t) n_old * n_embd);
            const int32_t              n_wait = (int32_t) pend.size() - join;
            const std::vector<uint8_t> mask   = cp.tree_mask.empty() ? std::vector<uint8_t>() : joined_mask(cp, n_wait);
            specee_eval_resume_impl(ctx, cells, hid.data(), cp.l, stop, fl, mask.empty() ? nullptr : mask.data());
        }
        // EAGLE-3: the decoder's rows' feature-layer outputs computed in this range, kept across the pass's batches
        // and put back in the context's (a batch that rows joined holds only its own range's)
        for (size_t k = 0; m.eagle.version == 3 && k < m.eagle.feature_layers.size(); ++k) {
            const int32_t fl_k = m.eagle.feature_layers[k];
            for (int32_t r = 0; fl_k >= cp.l && fl_k < stop && r < cp.n_cur; ++r) {
                const float * f = ctx.features.data() + ((size_t) r * 3 + k) * n_embd;
                std::copy(f, f + n_embd, cp.features.begin() + ((size_t) r * 3 + k) * n_embd);
            }
        }
        if (m.eagle.version == 3 && cp.n_cur > 0) {
            std::copy(cp.features.begin(), cp.features.end(), ctx.features.begin());
        }
        cp.started = true;
        cp.first   = join;
        cp.l       = stop;
    }
}

void checked_pass_stop(checked_pass & cp) {
    const int64_t              n_embd = cp.ctx->model->hparams.n_embd;
    const std::vector<float> & h      = specee_context_hidden(*cp.ctx);
    std::vector<exit_pending> & pend  = cp.chain->pending;
    for (int32_t k = cp.first; k < (int32_t) pend.size(); ++k) {
        const size_t row = (size_t) (cp.n_cur + k - cp.first);
        pend[k].resume   = cp.l;
        pend[k].h.assign(h.begin() + row * n_embd, h.begin() + (row + 1) * n_embd);
    }
}

void checked_pass_wait(checked_pass & cp, int32_t row, int32_t cell, int32_t pos, const std::vector<float> & feat,
                       int32_t next, const std::vector<int32_t> & history) {
    const int64_t              n_embd = cp.ctx->model->hparams.n_embd;
    const std::vector<float> & h      = specee_context_hidden(*cp.ctx);
    if (cp.chain->pending.empty()) {
        cp.chain->history = history;
    }
    exit_pending w;
    w.cell   = cell;
    w.pos    = pos;
    w.resume = cp.l;
    w.h.assign(h.begin() + (size_t) row * n_embd, h.begin() + (size_t) (row + 1) * n_embd);
    w.feat   = feat;
    w.next   = next;
    w.layers = cp.l;
    cp.chain->pending.push_back(std::move(w));
}

bool checked_pass_check(checked_pass & cp, specee_step step, std::vector<std::pair<int32_t, int32_t>> & out) {
    specee_context &            ctx     = *cp.ctx;
    const specee_model &        m       = *ctx.model;
    const int32_t               n_layer = (int32_t) m.hparams.n_layer;
    const int32_t               n_vocab = (int32_t) m.hparams.n_vocab;
    std::vector<exit_pending> & pend    = cp.chain->pending;
    const int32_t               n_pend  = (int32_t) pend.size();
    if (n_pend == 0) {
        return true;
    }
    if (cp.l != n_layer || cp.first != 0 || ctx.n_tokens != cp.n_cur + n_pend || ctx.n_outputs != ctx.n_tokens) {
        specee_fail("checked exits: a pass of %d rows (%d with logits) after %d layers cannot check %d waiting tokens",
                    ctx.n_tokens, ctx.n_outputs, cp.l, n_pend);
    }
    specee_sampler &         smpl = step.smpl;
    specee_generator_stats & st   = step.stats;
    const auto               t0   = specee_clock::now();
    specee_sampler_set_history(smpl, cp.chain->history);
    for (int32_t i = 0; i < n_pend; ++i) {
        const exit_pending & w   = pend[i];
        const int32_t        row = cp.n_cur + i;
        const int32_t        t   = specee_sampler_sample_impl(smpl, ctx.logits.data() + (size_t) row * n_vocab, n_vocab);
        specee_sampler_accept_impl(smpl, t);
        if (t == w.next) {
            out.emplace_back(t, w.layers);
            st.n_verified += 1;
            continue;
        }
        // the full model disagrees: its token follows w, and whatever was emitted after w is taken back
        out.emplace_back(t, n_layer);
        st.n_rollbacks += 1;
        st.n_discarded += n_pend - i;
        ctx.kv.remove(w.pos + 1, -1);
        specee_draft_truncate(*step.head, w.pos);
        const float * f = m.eagle.version == 3 ? w.feat.data() : ctx.norm.data() + (size_t) row * m.hparams.n_embd;
        specee_draft_add_pair(*step.head, f, t, w.pos);
        step.root     = t;
        step.root_pos = w.pos + 1;
        pend.clear();
        st.t_sample_ms += specee_ms_since(t0);
        return false;
    }
    pend.clear();
    st.t_sample_ms += specee_ms_since(t0);
    return true;
}

int32_t specee_exit_chain_flush(specee_exit_chain & chain, specee_step step,
                                std::vector<std::pair<int32_t, int32_t>> & out) {
    if (chain.pending.empty()) {
        return 0;
    }
    const size_t out0 = out.size();
    checked_pass cp;
    checked_pass_begin(cp, chain, step.ctx, 0, nullptr, nullptr, nullptr, nullptr);
    const auto t0 = specee_clock::now();
    checked_pass_run(cp, (int32_t) step.ctx.model->hparams.n_layer, 0);
    step.stats.t_layers_ms += specee_ms_since(t0);
    checked_pass_check(cp, step, out);
    return (int32_t) (out.size() - out0);
}
