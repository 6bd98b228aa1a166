// specee-lookup.cpp: n-gram lookup drafting (the index of the sequence's n-grams, the drafted tree, the length chosen
// from acceptance and pass cost), verified with the EAGLE tree's pass and walk. See specee-lookup.h.
#include "specee-lookup.h"

#include "specee-context.h"
#include "specee-impl.h"
#include "specee-model.h"
#include "specee-pass-cost.h"

#include <algorithm>
#include <cmath>
#include <mutex>

// the running acceptance per match length: successes and trials decayed by DECAY an observation, read with
// PRIOR_WEIGHT trials at PRIOR
static const double DECAY = 0.9, PRIOR = 0.8, PRIOR_WEIGHT = 2.0;
// a chain is drafted only where its expected tokens per single-pass cost beat a plain step's by this much: the
// estimate comes from a few observations, and a chain drafted on a lucky run of them costs its whole pass (on the
// default Q4_1 here a pass of 9 tokens costs 5.4 single passes); measured: without it, categories where lookup is
// right about half the time decoded at 0.87-0.95x plain (docs/lookup.md)
static const double MARGIN = 1.1;
// the weight of a new pass in a size's running pass time
static const double PASS_WEIGHT = 0.2;

// ---- the index -----------------------------------------------------------------------------------------

// FNV-1a over the n tokens ending at position i
static uint64_t ngram_hash(const std::vector<int32_t> & t, int32_t i, int32_t n) {
    uint64_t h = 1469598103934665603ull;
    for (int32_t k = i - n + 1; k <= i; ++k) {
        h = (h ^ (uint32_t) t[k]) * 1099511628211ull;
    }
    return h;
}

static void append(specee_lookup & lk, int32_t token) {
    lk.tokens.push_back(token);
    const int32_t i = (int32_t) lk.tokens.size() - 1;
    for (int32_t n = lk.params.n_min; n <= lk.params.n_max && n <= i + 1; ++n) {
        lk.index[n - lk.params.n_min][ngram_hash(lk.tokens, i, n)].push_back(i);
    }
}

// a continuation of the sequence's last n tokens: the token that followed them at an earlier place, how often it did,
// and the latest place it did (the position of its first token: in the sequence, or in the cross-request cache)
struct continuation {
    int32_t token = -1, count = 0;
    int64_t from  = -1;
};

// the continuations of the longest match (n_max down to n_min, its length in *n_match), most frequent first, then
// most recent: at each length the sequence's own first, else the cross-request cache's (*from_cache set)
static std::vector<continuation> continuations(const specee_lookup & lk, int32_t & n_match, bool & from_cache) {
    const std::vector<int32_t> & t    = lk.tokens;
    const int32_t                last = (int32_t) t.size() - 1;
    from_cache                        = false;
    for (int32_t n = std::min(lk.params.n_max, last + 1); n >= lk.params.n_min; --n) {
        std::vector<continuation> out;
        const auto &              map = lk.index[n - lk.params.n_min];
        const auto                it  = n <= last ? map.find(ngram_hash(t, last, n)) : map.end();
        static const std::vector<int32_t> none;
        for (int32_t p : it == map.end() ? none : it->second) {
            if (p >= last || !std::equal(t.begin() + (p - n + 1), t.begin() + p + 1, t.begin() + (last - n + 1))) {
                continue; // the sequence's own end, or a hash collision
            }
            auto c = std::find_if(out.begin(), out.end(), [&](const continuation & x) { return x.token == t[p + 1]; });
            if (c == out.end()) {
                out.push_back({t[p + 1], 0, p + 1});
                c = out.end() - 1;
            }
            c->count += 1;
            c->from = std::max<int64_t>(c->from, p + 1);
        }
        if (out.empty() && lk.cache && n <= SPECEE_NGRAM_CACHE_N_MAX) { // none in the sequence: the cache's
            for (const specee_ngram_cache_cont & x : specee_ngram_cache_find(*lk.cache, t.data() + (last - n + 1), n)) {
                out.push_back({x.token, x.count, x.from});
            }
            from_cache = !out.empty();
        }
        if (!out.empty()) {
            n_match = n;
            std::stable_sort(out.begin(), out.end(), [](const continuation & a, const continuation & b) {
                return a.count != b.count ? a.count > b.count : a.from > b.from;
            });
            return out;
        }
    }
    return {};
}

// ---- how far to draft ----------------------------------------------------------------------------------

// the running acceptance of drafts from matches of n tokens (in the sequence, or in the cache)
static double acceptance(const specee_lookup & lk, int32_t n, bool cache) {
    const int32_t k = n - lk.params.n_min;
    return cache ? (lk.cache_succ[k] + PRIOR * PRIOR_WEIGHT) / (lk.cache_trials[k] + PRIOR_WEIGHT)
                 : (lk.succ[k] + PRIOR * PRIOR_WEIGHT) / (lk.trials[k] + PRIOR_WEIGHT);
}

// A pass of n tokens took ms: its running time (the first pass of a size replaces the prior, then a moving average)
// and, once a single-token pass is known too, the cost of that size in single passes (not where a cost was given)
static void observe_pass(specee_lookup & lk, int32_t n, double ms) {
    if (n >= (int32_t) lk.pass_ms.size()) {
        return;
    }
    double & t = lk.pass_ms[n];
    t          = t > 0.0 ? (1.0 - PASS_WEIGHT) * t + PASS_WEIGHT * ms : ms;
    if (lk.pass_ms[1] > 0.0) {
        for (int32_t k = 2; k < (int32_t) lk.pass_ms.size(); ++k) {
            if (lk.pass_ms[k] > 0.0 && !lk.given[k]) {
                lk.cost[k] = std::max(lk.pass_ms[k] / lk.pass_ms[1], 1.0);
            }
        }
    }
}

// ---- set-up ------------------------------------------------------------------------------------------

void specee_lookup_init(specee_lookup & lk, const specee_ngram_params & params, specee_context & ctx) {
    lk.params = params;
    lk.cache  = ctx.ngram_cache.capacity > 0 ? &ctx.ngram_cache : nullptr;
    lk.index.assign(params.n_max - params.n_min + 1, {});
    lk.tokens.clear();
    lk.succ.assign(params.n_max - params.n_min + 1, 0.0);
    lk.trials.assign(params.n_max - params.n_min + 1, 0.0);
    lk.cache_succ.assign(params.n_max - params.n_min + 1, 0.0);
    lk.cache_trials.assign(params.n_max - params.n_min + 1, 0.0);
    lk.cost.assign(2, 1.0); // cost[1] = 1: a single pass
    lk.pass_ms.assign(2, 0.0);
    lk.given.assign(2, false);
    specee_lookup_time_passes(lk, ctx, params.draft_max + 1);
}

// A pass of n tokens in single passes: before the first steps, passes of 2, 3, 5, 9 tokens (and the longest up to
// TIMED_MAX) timed here, linear between them and on beyond the last (a pass's cost grows in steps where the kernels
// change tiles; timing every size would cost a large model many passes before its first token, and a server's
// batches of every slot's chains more); then each size the steps use, from their own passes (observe_pass). A size
// the context timed or was given before is taken as it is, so its other generators and slots time nothing again.
// Where no pass can be timed, the dearest case the CPU measured here (3.2 for 4 tokens).
static constexpr int32_t TIMED_MAX = 9;

void specee_lookup_time_passes(specee_lookup & lk, specee_context & ctx, int32_t n_rows) {
    int32_t prev = (int32_t) lk.cost.size() - 1;
    if (n_rows <= prev) {
        return;
    }
    lk.cost.resize(n_rows + 1, 1.0);
    lk.pass_ms.resize(n_rows + 1, 0.0);
    lk.given.resize(n_rows + 1, false);
    int32_t before = prev > 1 ? prev - 1 : 1; // the two sizes known last, for the cost beyond them
    for (int32_t n = prev + 1; n <= n_rows; ++n) {
        double c = specee_context_pass_cost_known(ctx, n);
        lk.given[n] = !std::isnan(specee_context_pass_cost_given(ctx, n));
        if (std::isnan(c)) {
            if (n != n_rows && ((n - 1) & (n - 2)) != 0) { // timed: 2^k + 1, and the last
                continue;
            }
            if (n > TIMED_MAX) {
                continue;
            }
            c = specee_context_pass_cost(ctx, n);
        }
        lk.cost[n] = std::isnan(c) ? 1.0 + 0.73 * (n - 1) : std::max(c, 1.0);
        for (int32_t k = prev + 1; k < n; ++k) {
            lk.cost[k] = lk.cost[prev] + (lk.cost[n] - lk.cost[prev]) * (k - prev) / (n - prev);
        }
        before = prev;
        prev   = n;
    }
    const double slope = prev > before ? std::max((lk.cost[prev] - lk.cost[before]) / (prev - before), 0.0) : 0.73;
    for (int32_t k = prev + 1; k <= n_rows; ++k) { // beyond the sizes known: on along the last two
        lk.cost[k] = lk.cost[prev] + slope * (k - prev);
    }
}

std::string specee_lookup_describe(const specee_lookup & lk) {
    std::string s = "ngram: a pass of 2";
    for (size_t n = 3; n < lk.cost.size(); ++n) {
        s += ", " + std::to_string(n);
    }
    s += " tokens costs";
    for (size_t n = 2; n < lk.cost.size(); ++n) {
        s += specee_format("%s %.2f", n == 2 ? "" : ",", lk.cost[n]);
    }
    const bool given = std::find(lk.given.begin() + 2, lk.given.end(), true) != lk.given.end();
    return s + " single passes here (" + (given ? "given for this context where set, else " : "") +
           "timed at 2, 3, 5, 9, on along the last two beyond; then from the steps' own passes): a step drafts as far "
           "as its acceptance on the sequence pays for";
}

void specee_lookup_reset(specee_lookup & lk, const int32_t * tokens, int32_t n, int32_t first) {
    lk.tokens.clear();
    for (auto & map : lk.index) {
        map.clear();
    }
    std::fill(lk.succ.begin(), lk.succ.end(), 0.0);
    std::fill(lk.trials.begin(), lk.trials.end(), 0.0);
    std::fill(lk.cache_succ.begin(), lk.cache_succ.end(), 0.0);
    std::fill(lk.cache_trials.begin(), lk.cache_trials.end(), 0.0);
    lk.pending         = specee_lookup_candidates{};
    lk.pending_drafted = 0;
    for (int32_t i = 0; i < n; ++i) {
        append(lk, tokens[i]);
    }
    append(lk, first);
}

// ---- drafting ------------------------------------------------------------------------------------------

// a pass of n tokens in single passes: the table, then its last step's slope beyond it
static double cost_of(const specee_lookup & lk, int32_t n) {
    const int32_t last = (int32_t) lk.cost.size() - 1;
    if (n <= last) {
        return lk.cost[std::max(n, 1)];
    }
    const double slope = last >= 2 ? lk.cost[last] - lk.cost[last - 1] : 1.0;
    return lk.cost[last] + slope * (n - last);
}

// the chain length in 0..l_max that gives the pass the most tokens per cost, for a chain whose tokens are each right
// with probability a: its share's n rows yield t tokens for c(n) + x; L more rows, t - 1 + (1 + a + ... + a^L) tokens
// for c(n + L) + x; L = 0 unless it beats not drafting by MARGIN. Alone (n = 1, t = 1, x = 0):
// (1 + ... + a^L) / c(1 + L).
static int32_t chain_length(const specee_lookup & lk, double a, int32_t l_max, const specee_pass_share & share) {
    const double base   = share.n_tokens / (cost_of(lk, share.n_rows) + share.extra);
    double       tokens = 1.0, ak = 1.0, best = MARGIN;
    int32_t      best_l = 0;
    for (int32_t l = 1; l <= l_max; ++l) {
        ak *= a;
        tokens += ak;
        const double rate = (share.n_tokens - 1.0 + tokens) / (cost_of(lk, share.n_rows + l) + share.extra) / base;
        if (rate > best) {
            best   = rate;
            best_l = l;
        }
    }
    return best_l;
}

specee_lookup_candidates specee_lookup_candidates_of(const specee_lookup & lk, int32_t l_max,
                                                     const specee_pass_share & share) {
    specee_lookup_candidates c;
    if (l_max <= 0 || lk.tokens.empty()) {
        return c;
    }
    int32_t                         n_match = 0;
    bool                            cache   = false;
    const std::vector<continuation> conts   = continuations(lk, n_match, cache);
    if (conts.empty()) {
        return c;
    }
    c.n_match    = n_match;
    c.from_cache = cache;
    c.acceptance = acceptance(lk, n_match, cache);
    if (cache) {
        c.chain = specee_ngram_cache_chain(*lk.cache, conts[0].from, l_max);
    }
    for (int64_t k = 0; !cache && k < l_max && conts[0].from + k < (int64_t) lk.tokens.size(); ++k) {
        c.chain.push_back(lk.tokens[conts[0].from + k]);
    }
    for (int32_t b = 1; b < lk.params.branches && b < (int32_t) conts.size(); ++b) {
        c.others.push_back(conts[b].token);
    }
    c.len = lk.params.adaptive ? chain_length(lk, c.acceptance, (int32_t) c.chain.size(), share)
                               : (int32_t) c.chain.size();
    return c;
}

int32_t specee_lookup_graft(specee_lookup & lk, specee_tree_decoder & dec, std::vector<int32_t> & nodes,
                            const specee_lookup_candidates & c, int32_t budget) {
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
        int32_t next = specee_tree_verified_child(dec, cur, c.chain[n]);
        if (next < 0) {
            if ((int32_t) nodes.size() >= budget) {
                break;
            }
            next = add(cur, c.chain[n]);
        }
        cur = next;
    }
    for (size_t b = 0; n > 0 && b < c.others.size() && (int32_t) nodes.size() < budget; ++b) {
        if (specee_tree_verified_child(dec, 0, c.others[b]) < 0) {
            add(0, c.others[b]);
        }
    }
    lk.pending         = c;
    lk.pending_drafted = n;
    return n;
}

void specee_lookup_observe(specee_lookup & lk, const std::vector<int32_t> & emitted, int32_t n_pass, double pass_ms) {
    const specee_lookup_candidates & c       = lk.pending;
    const int32_t                    drafted = lk.pending_drafted;
    observe_pass(lk, n_pass, pass_ms);
    if (c.n_match > 0 && !emitted.empty()) {
        const int32_t k      = c.n_match - lk.params.n_min;
        double &      succ   = c.from_cache ? lk.cache_succ[k] : lk.succ[k];
        double &      trials = c.from_cache ? lk.cache_trials[k] : lk.trials[k];
        succ *= DECAY;
        trials *= DECAY;
        if (drafted > 0) {
            int32_t n_acc = 0; // the drafted chain's tokens that the emitted ones follow
            while (n_acc < drafted && n_acc < (int32_t) emitted.size() && emitted[n_acc] == c.chain[n_acc]) {
                ++n_acc;
            }
            succ += n_acc;
            trials += n_acc + (n_acc < drafted && n_acc < (int32_t) emitted.size() ? 1 : 0); // and its break
        } else {
            succ += emitted[0] == c.chain[0] ? 1.0 : 0.0;
            trials += 1.0;
        }
    }
    lk.pending         = specee_lookup_candidates{};
    lk.pending_drafted = 0;
    for (int32_t tok : emitted) {
        append(lk, tok);
    }
}

// ---- the lookup drafter: its chain and branches grafted onto the root alone --------------------------------

static specee_proposal lookup_propose(specee_drafter_state s, specee_step step, int32_t budget,
                                      const specee_pass_share & share) {
    specee_lookup & lk = s.lookup;
    budget             = std::min(budget, lk.params.draft_max);
    // the chain leaves room for the other continuations, one row each
    specee_lookup_candidates c = specee_lookup_candidates_of(lk, budget, share);
    const int32_t            k = std::min((int32_t) c.others.size(), budget - 1);
    if (k > 0 && (int32_t) c.chain.size() > budget - k) {
        c = specee_lookup_candidates_of(lk, budget - k, share);
    }
    specee_tree_decoder & dec = s.dec;
    dec.nodes.assign(1, draft_node{});
    dec.nodes[0].token = step.root;
    dec.nodes[0].row   = 0;
    specee_proposal p;
    specee_lookup_graft(lk, dec, p.nodes, c, budget);
    p.cache = c.from_cache;
    return p;
}

// what the lookup drafter and the hybrid learn from a step: lookup's estimates (the head learns in specee_tree_keep)
void specee_lookup_drafter_observe(specee_drafter_state s, const specee_proposal &,
                                   const std::vector<int32_t> & emitted, int32_t n_pass, double pass_ms) {
    specee_lookup_observe(s.lookup, emitted, n_pass, pass_ms);
}

const specee_drafter specee_drafter_lookup = {"ngram", lookup_propose, specee_lookup_drafter_observe};

// ---- C API: the context's cross-request cache (here: specee-ngram-cache.cpp is included by the context) -----

extern "C" struct specee_ngram_cache_info specee_ngram_cache_get_info(const specee_context * ctx) {
    specee_ngram_cache_info info{};
    if (!ctx) {
        return info;
    }
    std::lock_guard<std::recursive_mutex> lock(const_cast<specee_context *>(ctx)->mutex);
    const specee_ngram_cache & c = ctx->ngram_cache;
    info.capacity                = c.capacity;
    info.n_tokens                = (int64_t) c.tokens.size();
    info.n_entries               = c.n_entries;
    info.n_docs                  = (int64_t) c.starts.size();
    info.n_added                 = c.n_added;
    return info;
}

extern "C" void specee_ngram_cache_clear(specee_context * ctx) {
    if (!ctx) {
        return;
    }
    std::lock_guard<std::recursive_mutex> lock(ctx->mutex);
    const uint64_t epoch = ctx->ngram_cache.epoch;
    specee_ngram_cache_init(ctx->ngram_cache, ctx->ngram_cache.capacity);
    ctx->ngram_cache.epoch = epoch + 1;
}
