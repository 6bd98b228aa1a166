// specee-hybrid.cpp: the hybrid drafter (mode ngram+eagle2): n-gram lookup's chain grafted onto the EAGLE-2 head's
// tree, one pass, one walk; lookup alone where it is confident. See specee-hybrid.h.
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

// lookup's candidates first; the head's tree unless lookup is confident, then the chain as far as it pays on top of
// the head's rows and the head's cost
static specee_proposal hybrid_propose(specee_drafter_state s, specee_step step, int32_t budget,
                                      const specee_pass_share & share) {
    specee_lookup &       lk  = s.lookup;
    specee_tree_decoder & dec = s.dec;
    budget                    = std::min(budget, dec.max_nodes + lk.params.draft_max);
    specee_proposal          p;
    specee_lookup_candidates c = specee_lookup_candidates_of(lk, std::min(lk.params.draft_max, budget), share);
    if (confident(lk, c)) {
        dec.nodes.assign(1, draft_node{});
        dec.nodes[0].token = step.root;
        dec.nodes[0].row   = 0;
    } else {
        p = specee_drafter_eagle.propose(s, step, std::min(dec.max_nodes, budget), share);
        if (c.n_match > 0) {
            specee_pass_share with_head = share;
            with_head.n_rows += (int32_t) p.nodes.size();
            with_head.extra += p.cost;
            const int32_t rest = budget - (int32_t) p.nodes.size();
            c = specee_lookup_candidates_of(lk, std::min(lk.params.draft_max, rest), with_head);
        }
    }
    specee_lookup_graft(lk, dec, p.nodes, c, budget);
    p.cache = c.from_cache;
    return p;
}

const specee_drafter specee_drafter_hybrid = {"ngram+eagle2", hybrid_propose, specee_lookup_drafter_observe};

std::string specee_hybrid_describe(const specee_lookup & lk) {
    return specee_format("ngram+eagle2: lookup's chain grafted onto the draft head's tree where it pays; lookup alone "
                         "(the head skipped) where its match has %d tokens and its acceptance is at least %.2f",
                         lk.params.n_max, CONFIDENT);
}
