// specee-hybrid.h: hybrid trees (mode ngram+eagle2; its drafter is specee_drafter_hybrid, specee-drafter.h): n-gram
// lookup's candidates grafted onto the EAGLE-2 head's tree as extra branches, verified in the same pass with the same
// walk (specee-speculative.h), so a step gains whichever drafter is right. Where lookup is confident (its match is the
// longest it tries, ngram.n_max tokens, and its running acceptance on the sequence from such matches is at least 0.85)
// the head does not run: the step is lookup's alone and the head's cost is saved (its pairs wait, pending, for its
// next step, which commits them in one evaluation).
//
// Contract: a drafter's (specee-drafter.h). The lookup's chain is drafted as far as its acceptance and this machine's
// pass cost say it pays on top of the head's rows and the head's cost (specee_lookup_candidates_of); where a verified
// node of the head's tree already holds the chain's next token the chain goes on from it, else a point node is added
// (draft_node::point), before the head's unverified children (specee_lookup_graft). Greedy output equals plain
// decoding's; sampling keeps the target's distribution (a point node is its own proposal: accepted with the target's
// probability of its token, removed from the residual when rejected; the head's children keep their q). The lookup
// learns from every step (specee_lookup_observe).
#pragma once

#include "specee-drafter.h"
#include "specee-lookup.h"

#include <cstdint>
#include <string>

// one line: when the head is skipped ("ngram+eagle2: ...")
std::string specee_hybrid_describe(const specee_lookup & lk);
