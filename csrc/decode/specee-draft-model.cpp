// specee-draft-model.cpp: a draft model as a drafter (mode draft, specee-draft-model.h; specee-loader.cpp loads it
// beside the target, its vocabulary the target's), and its drafts: a greedy chain of up to draft.n_max tokens from the
// draft model's own context, on the target sequence's id there, kept in step with the tokens the target accepted.
//
// A token drafted greedily is not a sample of the draft model's distribution, so its nodes are point masses
// (draft_node::point): the walk draws the target's token at each row as plain decoding draws it and accepts the draft
// where it is that token (specee-speculative.cpp, points_only), so a seeded request gives plain decoding's tokens
// whether or not it drafts, as llama.cpp's server does.
#include "specee-context.h"
#include "specee-drafter.h"
#include "specee-draft-model.h"
#include "specee-kv-cache.h"
#include "specee-impl.h"
#include "specee-model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

// ---- the sequence --------------------------------------------------------------------------------------

std::string specee_draft_init(specee_tree_decoder & dec, specee_draft_seq & ds, const specee_generator_params & gp,
                              uint32_t seed) {
    const specee_draft_params & p = gp.draft;
    ds.params                     = p;
    ds.no_eog                     = gp.ignore_eos;
    dec.synth.clear();
    for (int32_t i = 0; i < p.n_synth_rates; ++i) { // unconditional rates to conditional ones (upstream's)
        const double prev = i ? p.synth_rates[i - 1] : 1.0;
        dec.synth.push_back(prev > 0.0 ? p.synth_rates[i] / prev : 0.0);
    }
    dec.synth_rng.seed(seed);
    return dec.synth.empty() ? "" : "draft: synthetic acceptance (--spec-synth-rates): drafted tokens are accepted at "
                                    "the given rates whatever the model says; the output is not the model's "
                                    "(benchmarks only)";
}

void specee_draft_seq_reset(specee_draft_seq & ds, const int32_t * tokens, int32_t n, int32_t first) {
    ds.tokens.assign(tokens, tokens + n);
    ds.tokens.push_back(first);
}

// the draft model's context acting on the target's current sequence while alive
struct draft_seq_scope {
    specee_kv_cache & kv;
    int32_t           saved;
    draft_seq_scope(specee_context & dctx, const specee_context & ctx) : kv(dctx.kv), saved(dctx.kv.seq_cur) {
        kv.seq_cur = ctx.kv.seq_cur;
    }
    ~draft_seq_scope() { kv.seq_cur = saved; }
};

// the draft model's most likely next token after its last batch (no end-of-generation token where the generation
// never emits one), and its probability (computed only when asked: p_min)
static int32_t top_token(const specee_context & dctx, bool no_eog, bool want_p, float & p) {
    const int32_t n_vocab = (int32_t) dctx.model->hparams.n_vocab;
    const float * lg      = dctx.logits.data() + (size_t) (dctx.n_outputs - 1) * n_vocab;
    int32_t       best    = -1;
    for (int32_t i = 0; i < n_vocab; ++i) {
        if ((best < 0 || lg[i] > lg[best]) && !(no_eog && specee_token_is_eog(dctx.model, i))) {
            best = i;
        }
    }
    p = 1.0f;
    if (want_p) {
        double sum = 0.0;
        for (int32_t i = 0; i < n_vocab; ++i) {
            sum += std::exp((double) lg[i] - lg[best]);
        }
        p = (float) (1.0 / sum);
    }
    return best;
}

// ---- the drafter ------------------------------------------------------------------------------------------

// The chain after the root: the draft model's cache brought to the sequence (its cached prefix kept, the rest and the
// root evaluated in one batch), then one token at a time while the draft is sure enough (p_min) and the budget
// lasts; a chain shorter than n_min is dropped. The drafted tokens' cells are removed again (the accepted ones come
// back with the next step's batch), so the draft's cache never holds more of a sequence than the target's.
static specee_proposal draft_propose(specee_drafter_state s, specee_step step, int32_t budget,
                                     const specee_pass_share &) {
    specee_tree_decoder & dec = s.dec;
    specee_draft_seq &    ds  = s.draft;
    dec.nodes.assign(1, draft_node{});
    dec.nodes[0].token = step.root;
    dec.nodes[0].row   = 0;
    specee_proposal p;
    const int32_t   n_max = std::min(ds.params.n_max, budget);
    if (!step.ctx.draft || n_max < std::max(ds.params.n_min, 1)) {
        return p;
    }
    if ((int32_t) ds.tokens.size() != step.root_pos + 1 || ds.tokens.back() != step.root) {
        specee_fail("draft model: the sequence's tokens are out of step with the generation (start again)");
    }
    specee_context & dctx = *step.ctx.draft;
    draft_seq_scope  scope(dctx, step.ctx);
    const int32_t    n = (int32_t) ds.tokens.size();
    const int32_t    e = std::min(specee_cached_prefix(dctx.kv, ds.tokens.data(), n), n - 1);
    dctx.kv.remove(e, -1);
    specee_batch b = {n - e, ds.tokens.data() + e, nullptr, nullptr, nullptr};
    specee_eval_impl(dctx, &b);
    int32_t n_evals = 1;
    for (int32_t k = 0; k < n_max; ++k) {
        float         prob = 1.0f;
        int32_t       tok  = top_token(dctx, ds.no_eog, ds.params.p_min > 0.0f, prob);
        if (prob < ds.params.p_min) {
            break;
        }
        draft_node nd;
        nd.token  = tok;
        nd.parent = k;
        nd.depth  = k + 1;
        nd.row    = k + 1;
        nd.point  = true;
        dec.nodes.push_back(nd);
        dec.nodes[k].children.push_back(k + 1);
        p.nodes.push_back(k + 1);
        if (k + 1 == n_max || specee_token_is_eog(dctx.model, tok)) {
            break;
        }
        const int32_t pos = step.root_pos + 1 + k;
        specee_batch  one = {1, &tok, &pos, nullptr, nullptr};
        specee_eval_impl(dctx, &one);
        n_evals++;
    }
    dctx.kv.remove(step.root_pos + 1, -1);
    if ((int32_t) p.nodes.size() < ds.params.n_min) {
        dec.nodes.resize(1);
        dec.nodes[0].children.clear();
        p.nodes.clear();
    }
    const double target_bytes = (double) std::max<uint64_t>(step.ctx.model->n_bytes, 1);
    p.cost                    = n_evals * (double) dctx.model->n_bytes / target_bytes;
    return p;
}

// the emitted tokens join the sequence (the draft's cache takes them with the next step's batch)
static void draft_observe(specee_drafter_state s, const specee_proposal &, const std::vector<int32_t> & emitted,
                          int32_t, double) {
    s.draft.tokens.insert(s.draft.tokens.end(), emitted.begin(), emitted.end());
}

const specee_drafter specee_drafter_draft = {"draft", draft_propose, draft_observe};
