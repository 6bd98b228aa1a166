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

#include "specee-ngram-cache.h"
#include "specee-speculative.h"
#include "specee-step.h"
#include "specee.h"

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

struct specee_lookup {
    specee_ngram_params  params{};
    std::vector<int32_t> tokens; // the sequence: the prompt and every emitted token, the root last
    // per match length n (index n - n_min): hash of the n tokens ending at position i -> those positions i, ascending
    std::vector<std::unordered_map<uint64_t, std::vector<int32_t>>> index;
    std::vector<double>  succ, trials; // per match length n (index n - n_min): accepted drafts and tries on this
                                       // sequence (observed, drafted or not), decayed each observation
    std::vector<double>  cache_succ, cache_trials; // the same for matches found in the cross-request cache
    specee_ngram_cache * cache     = nullptr; // the context's cross-request cache (nullptr: off)
    bool                 committed = true;    // the sequence's tokens went to the cache (or there were none)
    uint64_t             cache_epoch = 0;     // the cache's epoch when the sequence began (a clear since: not added)
    std::vector<double>  cost;    // cost[n]: a pass of n tokens in single passes (cost[1] = 1)
    std::vector<double>  pass_ms; // pass_ms[n]: the running time of this generator's passes of n tokens (0: none yet)
    // the step drafted and not finished yet: its match length (0: no match), chain length and the match's first token
    int32_t pending_match = 0, pending_len = 0, pending_first = -1;
    bool    pending_cache = false; // the match was the cache's
};

// The sequence (prompt and output so far) into the context's cross-request cache, once: where a request ends (the
// slots), or before the lookup's next sequence or settings replace it. Nothing when the cache is off.
void    specee_lookup_commit(specee_lookup & lk);
// checks nothing the options did not (specee_generator_check_values); passes of a few sizes are timed on the context
void    specee_lookup_init(specee_lookup & lk, const specee_ngram_params & params, specee_context & ctx);
// one line: what drafting costs here ("ngram: a pass of 2, 3, ... tokens costs 1.6, 2.2, ... single passes")
std::string specee_lookup_describe(const specee_lookup & lk);
// a new sequence: the prompt's n tokens and the first token sampled after them (the root); the sequence before goes
// to the cross-request cache (specee_lookup_commit)
void    specee_lookup_reset(specee_lookup & lk, const int32_t * tokens, int32_t n, int32_t first);
// A step in two parts, for a pass shared with other sequences (specee-slots.cpp): the draft fills dec's tree after
// root with at most `budget` tokens and returns its drafted nodes in row order (none: a plain step); after a pass
// that verified root + those nodes (specee_tree_verify_batch's rows, n_rows of them, the pass's rows row0.., their
// logits row by row at `logits`), the finish walks them, keeps the accepted cells, learns the match's acceptance and
// writes the emitted tokens (1..n_max) to out (step.root / root_pos advanced, steps / drafted / accepted counted).
std::vector<int32_t> specee_lookup_draft(specee_lookup & lk, specee_tree_decoder & dec, int32_t root, int32_t budget);
int32_t specee_lookup_finish(specee_lookup & lk, specee_tree_decoder & dec, specee_step step, int32_t n_rows,
                             const float * logits, int32_t row0, int32_t n_max, int32_t * out);
// One draft-and-verify step after step.root: as specee_tree_step (1..n_max tokens, root / root_pos advanced), the
// drafts from the lookup; a step that drafts nothing is a plain step. dec holds the step's tree.
int32_t specee_lookup_step(specee_lookup & lk, specee_tree_decoder & dec, specee_step step, int32_t * out, int32_t n_max);

// ---- for another drafter's tree (hybrid trees: specee-hybrid.h) -----------------------------------------------

// What lookup would draft after the sequence's end, read without changing anything: the longest match, its
// continuations and how far its chain pays on top of n_base rows already in the pass
struct specee_lookup_candidates {
    int32_t              n_match    = 0;   // the longest match's length (0: none, nothing below is set)
    bool                 from_cache = false; // the match is in the cross-request cache (none in the sequence)
    double               acceptance = 0.0; // the running acceptance of drafts from matches of that length
    std::vector<int32_t> chain;            // the most frequent continuation (the latest on a tie), l_max tokens at most
    std::vector<int32_t> others;           // the other continuations' first tokens, most frequent first
                                           // (ngram.branches - 1 at most)
    int32_t              len = 0;          // the chain's tokens that pay: the L <= chain.size() maximising
                                           // (1 + a + ... + a^L) / (c(n_base + L) / c(n_base)), 0 where none beats
                                           // not drafting by the margin (ngram.adaptive off: all of the chain)
};
specee_lookup_candidates specee_lookup_candidates_of(const specee_lookup & lk, int32_t l_max, int32_t n_base);
// After a step whose tree held the first `drafted` tokens of c.chain (0: none, the match still observed: the chain's
// first token against the first emitted) and emitted `emitted`: the acceptance of c.n_match's drafts learns from it,
// the emitted tokens join the sequence and its index, and the pass of n_rows tokens that took pass_ms is observed
void specee_lookup_observe(specee_lookup & lk, const specee_lookup_candidates & c, int32_t drafted,
                           const std::vector<int32_t> & emitted, int32_t n_rows, double pass_ms);
