// specee-drafter.cpp: the drafter interface's step (propose, one verification pass, finish), the finish every drafter
// shares (the walk, the caches, the drafter's observe, the stats), and the EAGLE draft head as a drafter. See
// specee-drafter.h.
#include "specee-drafter.h"

#include "specee-context.h"
#include "specee-impl.h"
#include "specee-model.h"

#include <algorithm>

// ---- the EAGLE draft head as a drafter --------------------------------------------------------------------------

static double nbytes(const ggml_tensor * t) { return t ? (double) ggml_nbytes(t) : 0.0; }

static double layer_bytes(const specee_layer & l) {
    return nbytes(l.wq) + nbytes(l.wk) + nbytes(l.wv) + nbytes(l.wqkv) + nbytes(l.wo) + nbytes(l.ffn_gate) +
           nbytes(l.ffn_up) + nbytes(l.ffn_down);
}

double specee_drafter_head_cost(const specee_model & m) {
    double model = nbytes(m.output);
    for (const specee_layer & l : m.layers) {
        model += layer_bytes(l);
    }
    const double head =
        nbytes(m.eagle.fc) + layer_bytes(m.eagle.layer) + nbytes(m.eagle.output ? m.eagle.output : m.output);
    return model > 0.0 ? head / model : 0.0;
}

// the head's tree (EAGLE-1's static shape or EAGLE-2's dynamic one, as the decoder was set up); its cost: a level of
// the head per depth of the tree
static specee_proposal eagle_propose(specee_drafter_state s, specee_step step, int32_t budget,
                                     const specee_pass_share &) {
    specee_proposal p;
    p.nodes       = specee_tree_draft(s.dec, step, std::min(s.dec.max_nodes, budget));
    int32_t depth = 0;
    for (int32_t ni : p.nodes) {
        depth = std::max(depth, s.dec.nodes[ni].depth);
    }
    p.cost = std::max(depth, 1) * specee_drafter_head_cost(*step.ctx.model);
    return p;
}

// the head learns nothing from a step beyond the pairs specee_tree_keep gave it
static void eagle_observe(specee_drafter_state, const specee_proposal &, const std::vector<int32_t> &, int32_t,
                          double) {}

const specee_drafter specee_drafter_eagle = {"eagle", eagle_propose, eagle_observe};

// ---- the step ----------------------------------------------------------------------------------------------

int32_t specee_drafter_finish(const specee_drafter & d, specee_drafter_state s, specee_step step,
                              const specee_proposal & p, const specee_verified & v, int32_t n_max, int32_t * out) {
    specee_tree_decoder & dec = s.dec;
    std::vector<int32_t>  emitted, path;
    specee_tree_pass_rows rows  = {&dec, v.logits, (int32_t) step.ctx.model->hparams.n_vocab};
    const int32_t         n_acc = specee_tree_walk(dec, step, n_max, specee_tree_pass_logits, &rows, emitted, path);
    specee_tree_keep(dec, step, v.n_rows, emitted, path, nullptr, v.row0);
    if (p.cache) { // the cross-request cache's drafts: the point nodes verified, and those accepted
        for (int32_t ni : p.nodes) {
            step.stats.n_cache_drafted += dec.nodes[ni].point;
        }
        for (int32_t k = 0, cur = 0; k < n_acc && cur >= 0; ++k) {
            cur = specee_tree_verified_child(dec, cur, emitted[k]);
            step.stats.n_cache_accepted += cur >= 0 && dec.nodes[cur].point;
        }
    }
    d.observe(s, p, emitted, v.n_pass, v.pass_ms);
    step.root = emitted.back();
    step.root_pos += (int32_t) emitted.size();
    step.stats.n_steps++;
    step.stats.n_drafted += v.n_rows - 1;
    step.stats.n_accepted += n_acc;
    std::copy(emitted.begin(), emitted.end(), out);
    return (int32_t) emitted.size();
}

std::vector<int32_t> specee_drafter_with_forced(specee_drafter_state s, specee_step step, specee_proposal & p,
                                                const std::vector<int32_t> & forced, int32_t budget) {
    std::vector<int32_t> nodes = specee_tree_filter(s.dec, step, p.nodes);
    // the drafts are all allowed now, so they follow the forced tokens as far as those reach: where they go no deeper,
    // the forced chain verifies at least as much for certain
    const int32_t n_forced = std::min((int32_t) forced.size(), std::max(budget, 0));
    int32_t       depth    = 0;
    for (int32_t ni : nodes) {
        depth = std::max(depth, s.dec.nodes[ni].depth);
    }
    if (n_forced > 0 && depth <= n_forced) {
        p       = specee_proposal{};
        p.nodes = nodes = specee_tree_chain(s.dec, step.root, {forced.begin(), forced.begin() + n_forced});
    }
    return nodes;
}

int32_t specee_drafter_step(const specee_drafter & d, specee_drafter_state s, specee_step step, int32_t * out,
                            int32_t n_max, const std::vector<int32_t> & forced) {
    specee_generator_stats & st     = step.stats;
    specee_context &         ctx    = step.ctx;
    const int32_t            n_free = (int32_t) ctx.cparams.n_ctx - (int32_t) ctx.kv.used;
    const int32_t            budget = std::min({n_free - 1, (int32_t) ctx.cparams.n_batch - 1, n_max - 1});

    auto            t0 = specee_clock::now();
    specee_proposal p  = d.propose(s, step, std::max(budget, 0), specee_pass_share{});
    st.t_draft_ms += specee_ms_since(t0);
    const std::vector<int32_t> nodes = specee_drafter_with_forced(s, step, p, forced, budget);

    // ---- verify root + tree in one pass
    t0                    = specee_clock::now();
    const int32_t n_rows  = specee_tree_pass(s.dec, step, nodes);
    const double  pass_ms = specee_ms_since(t0);
    st.t_verify_ms += pass_ms;

    // ---- walk from the root, keep what was accepted in both caches, let the drafter learn
    t0              = specee_clock::now();
    const int32_t n = specee_drafter_finish(d, s, step, p, {n_rows, ctx.logits.data(), 0, n_rows, pass_ms}, n_max, out);
    st.t_sample_ms += specee_ms_since(t0);
    return n;
}
