// specee-lookup.h: n-gram lookup, a drafter that costs nothing: the next tokens are often already in the sequence (a
// summary copies its article, an edit its code, a small model repeats itself). The drafts are copied from where the
// sequence's last n tokens stood before (n from ngram.n_max down to ngram.n_min: the longest match first); the
// continuations found there are the root's children, ranked by how often each followed (ngram.branches of them), the
// best one continued as a chain. They are verified in one pass of the target as an EAGLE tree is, with the same walk
// (specee-speculative.cpp): greedy output equals plain decoding's, and sampling keeps the target's distribution (a
// lookup draft is a point mass: it is accepted with the target's probability of its token, a rejected one is removed
// from the target's distribution before the next is tried or the bonus token is drawn).
//
// How far it drafts adapts per sequence: the acceptance of its drafts on this sequence from matches of the same length
// (a running estimate a per match length: a match of 4 tokens is surer than one of 2) and this
// machine's cost of a pass of n tokens c(n) (passes of 2, 3, 5, 9, ... tokens timed once per context, linear between
// them, then each size from the steps' own passes) choose the chain length L that maximises
// (1 + a + ... + a^L) / c(L + 1); L = 0 (a plain step) where that says drafting loses. A step that finds a match but
// does not draft still observes it: the lookup's first token against the token the step emitted (free, no pass), so
// a sequence where lookup has been wrong drafts nothing until lookup turns right, and a sequence that starts to
// repeat itself is drafted again.
#pragma once

#include "specee-drafter.h"
#include "specee-ngram-cache.h"
#include "specee-speculative.h"
#include "specee-step.h"
#include "specee.h"

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

// What lookup would draft after the sequence's end (specee_lookup_candidates_of): the longest match, its
// continuations and how far its chain pays in the pass it joins
struct specee_lookup_candidates {
    int32_t              n_match    = 0;   // the longest match's length (0: none, nothing below is set)
    bool                 from_cache = false; // the match is in the cross-request cache (none in the sequence)
    double               acceptance = 0.0; // the running acceptance of drafts from matches of that length
    std::vector<int32_t> chain;            // the most frequent continuation (the latest on a tie), l_max tokens at most
    std::vector<int32_t> others;           // the other continuations' first tokens, most frequent first
                                           // (ngram.branches - 1 at most)
    int32_t              len = 0;          // the chain's tokens that pay: the L <= chain.size() maximising the pass's
                                           // tokens per cost, (t - 1 + 1 + a + ... + a^L) / (c(n + L) + x), over
                                           // not drafting's t / (c(n) + x) (share: n rows yielding t tokens, x
                                           // besides the pass), 0 where none beats it by the margin
                                           // (ngram.adaptive off: all of the chain)
};

struct specee_lookup {
    specee_ngram_params  params{};
    std::vector<int32_t> tokens; // the sequence: the prompt and every emitted token, the root last
    // per match length n (index n - n_min): hash of the n tokens ending at position i -> those positions i, ascending
    std::vector<std::unordered_map<uint64_t, std::vector<int32_t>>> index;
    std::vector<double>  succ, trials; // per match length n (index n - n_min): accepted drafts and tries on this
                                       // sequence (observed, drafted or not), decayed each observation
    std::vector<double>  cache_succ, cache_trials; // the same for matches found in the cross-request cache
    specee_ngram_cache * cache = nullptr; // the context's cross-request cache (nullptr: off), read only: requests join
                                          // it through their generator's document (specee_ngram_cache_doc)
    std::vector<double>  cost;    // cost[n]: a pass of n tokens in single passes (cost[1] = 1)
    std::vector<double>  pass_ms; // pass_ms[n]: the running time of this generator's passes of n tokens (0: none yet)
    std::vector<bool>    given;   // given[n]: cost[n] was given on the context (specee_context_pass_cost_given): kept
    // what the step drafted and has not observed yet: lookup's candidates and the tokens of their chain in the tree
    specee_lookup_candidates pending;
    int32_t                  pending_drafted = 0;
};

// checks nothing the options did not (specee_generator_check_values); passes of a few sizes are timed on the context
void    specee_lookup_init(specee_lookup & lk, const specee_ngram_params & params, specee_context & ctx);
// the pass-cost table as far as passes of n_rows rows (init: ngram.draft_max + 1; the slots: a batch of several
// sequences' drafts), passes of 2^k + 1 rows and n_rows timed on the context (once per context), linear between
void    specee_lookup_time_passes(specee_lookup & lk, specee_context & ctx, int32_t n_rows);
// one line: what drafting costs here ("ngram: a pass of 2, 3, ... tokens costs 1.6, 2.2, ... single passes")
std::string specee_lookup_describe(const specee_lookup & lk);
// a new sequence: the prompt's n tokens and the first token sampled after them (the root)
void    specee_lookup_reset(specee_lookup & lk, const int32_t * tokens, int32_t n, int32_t first);

// ---- drafting (the lookup drafter, specee_drafter_lookup; the hybrid's, specee-hybrid.cpp) -------------------

// What lookup would draft now, read without changing anything: a chain of l_max tokens at most, its length by the
// pass it joins (share)
specee_lookup_candidates specee_lookup_candidates_of(const specee_lookup & lk, int32_t l_max,
                                                     const specee_pass_share & share);
// Grafts the first c.len tokens of lookup's chain, and (where the chain is drafted) its other continuations' first
// tokens as children of the root, onto the tree in dec.nodes whose verified nodes are `nodes` (rows 1.. in order;
// the root alone: lookup's own tree): the chain follows verified nodes holding its tokens and goes on with point
// nodes, each with the next row (after its parent's: rows grow along every path, as specee_tree_keep needs) and placed
// before its parent's unverified children (the sampling walk tries a prefix of verified ones). At most `budget`
// verified nodes in all. Returns the chain's tokens in the tree; the candidates wait in lk.pending for the observe.
int32_t specee_lookup_graft(specee_lookup & lk, specee_tree_decoder & dec, std::vector<int32_t> & nodes,
                            const specee_lookup_candidates & c, int32_t budget);
// After the step's walk (the candidates grafted last, lk.pending: n_match 0 where none): their match's acceptance
// learns from the emitted tokens (a chain drafted: how far they follow it; not drafted, the chain's first token
// against the first emitted), the emitted tokens join the sequence and its index, and the pass of n_pass rows that
// took pass_ms is observed
void specee_lookup_observe(specee_lookup & lk, const std::vector<int32_t> & emitted, int32_t n_pass, double pass_ms);
// the lookup drafter's observe (the hybrid's too): specee_lookup_observe on the state's lookup
void specee_lookup_drafter_observe(specee_drafter_state s, const specee_proposal & p,
                                   const std::vector<int32_t> & emitted, int32_t n_pass, double pass_ms);
