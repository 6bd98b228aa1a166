// specee-hybrid.cpp: hybrid trees: n-gram lookup's chain grafted onto the EAGLE-2 head's tree, one pass, one walk;
// lookup alone where it is confident. See specee-hybrid.h.
#include "specee-hybrid.h"

#include "specee-context.h"
#include "specee-impl.h"
#include "specee-model.h"

#include <algorithm>
#include <vector>

// lookup is confident, and the head does not run, where its match is the longest it tries and its running acceptance
// from such matches is at least this: above lookup's prior (0.8), so a sequence's own lookups must have been right
static const double CONFIDENT = 0.85;

static bool confident(const specee_lookup & lk, const specee_lookup_candidates & c) {
    return c.len > 0 && c.n_match >= lk.params.n_max && c.acceptance >= CONFIDENT;
}

// the verified child of node `parent` holding `token`, or -1
static int32_t verified_child(const specee_tree_decoder & dec, int32_t parent, int32_t token) {
    for (int32_t k : dec.nodes[parent].children) {
        if (dec.nodes[k].row >= 0 && dec.nodes[k].token == token) {
            return k;
        }
    }
    return -1;
}

// Grafts the first c.len tokens of lookup's chain, and (where the chain is drafted) its other continuations' first
// tokens as children of the root, onto the tree in dec.nodes whose verified nodes are `nodes` (rows 1.. in order):
// the chain follows verified nodes holding its tokens and goes on with point nodes, each with the next row (after
// its parent's: rows grow along every path, as specee_tree_keep needs) and placed before its parent's unverified
// children (the sampling walk tries a prefix of verified ones). At most `budget` verified nodes in all. Returns the
// chain's tokens in the tree.
static int32_t graft(specee_tree_decoder & dec, std::vector<int32_t> & nodes, const specee_lookup_candidates & c,
                     int32_t budget) {
    auto add = [&](int32_t parent, int32_t token) {
        draft_node nd;
        nd.token  = token;
        nd.parent = parent;
        nd.depth  = dec.nodes[parent].depth + 1;
        nd.row    = (int32_t) nodes.size() + 1;
        nd.point  = true;
        dec.nodes.push_back(nd);
        const int32_t          ni   = (int32_t) dec.nodes.size() - 1;
        std::vector<int32_t> & kids = dec.nodes[parent].children;
        kids.insert(std::find_if(kids.begin(), kids.end(), [&](int32_t k) { return dec.nodes[k].row < 0; }), ni);
        nodes.push_back(ni);
        return ni;
    };
    int32_t cur = 0, n = 0;
    for (; n < c.len; ++n) {
        int32_t next = verified_child(dec, cur, c.chain[n]);
        if (next < 0) {
            if ((int32_t) nodes.size() >= budget) {
                break;
            }
            next = add(cur, c.chain[n]);
        }
        cur = next;
    }
    for (size_t b = 0; n > 0 && b < c.others.size() && (int32_t) nodes.size() < budget; ++b) {
        if (verified_child(dec, 0, c.others[b]) < 0) {
            add(0, c.others[b]);
        }
    }
    return n;
}

int32_t specee_hybrid_step(specee_tree_decoder & dec, specee_lookup & lk, specee_step step, int32_t * out,
                           int32_t n_max) {
    specee_generator_stats & st     = step.stats;
    specee_context &         ctx    = step.ctx;
    const int32_t            n_free = (int32_t) ctx.cparams.n_ctx - (int32_t) ctx.kv.used;
    const int32_t            budget = std::min(
        {dec.max_nodes + lk.params.draft_max, n_free - 1, (int32_t) ctx.cparams.n_batch - 1, n_max - 1});

    // ---- draft: lookup's candidates first; the head's tree unless lookup is confident, then the chain on top of it
    auto                     t0 = specee_clock::now();
    specee_lookup_candidates c  = specee_lookup_candidates_of(lk, std::min(lk.params.draft_max, budget), 1);
    std::vector<int32_t>     nodes;
    if (confident(lk, c)) {
        dec.nodes.clear();
        draft_node rn;
        rn.token = step.root;
        rn.row   = 0;
        dec.nodes.push_back(rn);
    } else {
        nodes = specee_tree_draft(dec, step, std::min(dec.max_nodes, budget));
        if (c.n_match > 0) { // how far the chain pays beside the head's rows
            const int32_t rest = budget - (int32_t) nodes.size();
            c = specee_lookup_candidates_of(lk, std::min(lk.params.draft_max, rest), 1 + (int32_t) nodes.size());
        }
    }
    const int32_t drafted = graft(dec, nodes, c, budget);
    st.t_draft_ms += specee_ms_since(t0);

    // ---- verify root + tree in one pass
    t0                         = specee_clock::now();
    const int32_t n_rows  = specee_tree_verify(dec, step, nodes);
    const double  pass_ms = specee_ms_since(t0);
    st.t_verify_ms += pass_ms;

    // ---- walk, keep what was accepted in both caches, and let lookup learn from the step
    t0 = specee_clock::now();
    std::vector<int32_t>  emitted, path;
    specee_tree_pass_rows rows  = {&dec, ctx.logits.data(), (int32_t) ctx.model->hparams.n_vocab};
    const int32_t         n_acc = specee_tree_walk(dec, step, n_max, specee_tree_pass_logits, &rows, emitted, path);
    specee_tree_keep(dec, step, n_rows, emitted, path, nullptr);
    specee_lookup_observe(lk, c, drafted, emitted, n_rows, pass_ms);
    step.root = emitted.back();
    step.root_pos += (int32_t) emitted.size();
    st.t_sample_ms += specee_ms_since(t0);

    st.n_steps++;
    st.n_drafted += n_rows - 1;
    st.n_accepted += n_acc;
    std::copy(emitted.begin(), emitted.end(), out);
    return (int32_t) emitted.size();
}

std::string specee_hybrid_describe(const specee_lookup & lk) {
    return specee_format("ngram+eagle2: lookup's chain grafted onto the draft head's tree where it pays; lookup alone "
                         "(the head skipped) where its match has %d tokens and its acceptance is at least %.2f",
                         lk.params.n_max, CONFIDENT);
}
