// specee-early-exit.cpp: SpecEE early exit: the decoder that evaluates a token layer range by layer range and checks
// the exit predictors (specee-exit.cpp) at the scheduled layers. At a layer that fires, the exit layer's lm_head gives
// the next token, kept when it is among the draft head's candidates (a replayed exit keeps it whatever it is).
#include "specee-early-exit.h"

#include "specee-context.h"
#include "specee-draft-head.h"
#include "specee-impl.h"
#include "specee-model.h"
#include "specee-sampling.h"

#include <algorithm>
#include <vector>

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

// whether the token (the first row of the pass) leaves at scheduled layer s (its predictor fires; a replay fires at its
// layer only); its features are computed only where a predictor is checked
static bool check_fires(const specee_exit_decoder & dec, specee_context & ctx, int32_t s, int32_t forced,
                        exit_checks & ec, specee_generator_stats & st) {
    const specee_model & m = *ctx.model;
    if (s == forced || !m.exit.pred[s].up) {
        return s == forced;
    }
    const auto t0 = specee_clock::now();
    exit_checks_features(ec, ctx);
    const bool fire = exit_layer_fires(dec, m, s, forced, ec, {0}, st);
    st.t_check_ms += specee_ms_since(t0);
    return fire;
}

// One token's step; `out` receives what it puts out (token, layers its step ran): without checks its next token;
// with checks (dec.params.check) what checked_pass_check lets out, or nothing while the token waits
static void exit_step(specee_exit_decoder & dec, specee_step step, std::vector<std::pair<int32_t, int32_t>> & out) {
    specee_draft_head &      head    = *step.head;
    specee_sampler &         smpl    = step.smpl;
    specee_generator_stats & st      = step.stats;
    specee_context &         ctx     = *head.ctx;
    const specee_model &     m       = *head.model;
    const int32_t            n_layer = (int32_t) m.hparams.n_layer;
    const bool               check   = dec.params.check;

    exit_checks ec;
    exit_checks_begin(ec, {exit_candidates(head, (int32_t) m.exit.n_cand, st)});
    const std::vector<int32_t> & cand = ec.cand[0];

    // ---- the token's layers, checked at the scheduled ones; with checks the waiting tokens join the pass as rows
    // after the token's (specee-exit-check.cpp), else the pass is the token's alone
    int32_t                    forced = -1;
    const std::vector<int32_t> sched  = exit_pass_schedule(dec, m, forced);
    checked_pass               cp;
    checked_pass_begin(cp, dec.chain, ctx, 1, &step.root, &step.root_pos, nullptr, nullptr);
    int32_t            exited = -1, next = -1;
    std::vector<float> norm, logits;
    for (int32_t s : sched) {
        auto t0 = specee_clock::now();
        checked_pass_run(cp, s + 1, 0);
        st.t_layers_ms += specee_ms_since(t0);
        if (!check_fires(dec, ctx, s, forced, ec, st)) {
            continue;
        }
        t0 = specee_clock::now();
        norm.clear();
        logits.clear();
        exit_layer_logits(ctx, s, {}, norm, logits);
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
            exit_fill_skipped(ctx, s, {});
            st.t_fill_ms += specee_ms_since(t0);
        }
        break;
    }
    std::vector<float> feat; // the head's feature of the token: the exit layer's, or the full pass's
    if (exited >= 0) {
        feat = exit_head_features(ctx, exited, {0}, norm);
    } else {
        const auto t0 = specee_clock::now();
        checked_pass_run(cp, n_layer, 0);
        st.t_layers_ms += specee_ms_since(t0);
        if (!checked_pass_check(cp, step, out)) {
            exit_count_pass(dec, -1, n_layer, st);
            return; // a waiting token was wrong: the sequence goes on from the full model's token there
        }
        next = specee_sampler_sample_impl(smpl, ctx.logits.data(), head.n_vocab); // the token's row is the first
        const float * f = specee_context_feature(ctx, 0);
        feat.assign(f, f + head.n_feat);
    }
    if (exited >= 0 && check) {
        // the token waits, unchecked, with the waiting tokens of the pass
        checked_pass_stop(cp);
        checked_pass_wait(cp, 0, ctx.cells[0], step.root_pos, feat, next, specee_sampler_history(smpl));
    } else {
        out.emplace_back(next, exited >= 0 ? exited + 1 : n_layer);
    }
    specee_sampler_accept_impl(smpl, next);

    // ---- the pair (this token's feature, the next token) for the head; the next token becomes the root
    specee_draft_add_pair(head, feat.data(), next, step.root_pos);
    step.root = next;
    step.root_pos += 1;
    exit_count_pass(dec, exited, n_layer, st);
    if (exited >= 0 && check && specee_token_is_eog(&m, next)) {
        specee_exit_chain_flush(dec.chain, step, out); // nothing follows it: check it now
    }
}

int32_t specee_exit_step(specee_exit_decoder & dec, specee_step step, int32_t & layers_run) {
    std::vector<std::pair<int32_t, int32_t>> out;
    exit_step(dec, step, out);
    layers_run = out[0].second;
    return out[0].first;
}

int32_t specee_exit_step_checked(specee_exit_decoder & dec, specee_step step,
                                 std::vector<std::pair<int32_t, int32_t>> & out) {
    const size_t out0 = out.size();
    exit_step(dec, step, out);
    return (int32_t) (out.size() - out0);
}
