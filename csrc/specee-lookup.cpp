// specee-lookup.cpp: n-gram lookup drafting (the index of the sequence's n-grams, the drafted tree, the length chosen
// from acceptance and pass cost), verified with the EAGLE tree's pass and walk. See specee-lookup.h.
#include "specee-lookup.h"

#include "specee-context.h"
#include "specee-impl.h"
#include "specee-model.h"

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

// the chain length in 0..l_max with the most tokens per single-pass cost, for drafts from a match of n tokens
static int32_t chain_length(const specee_lookup & lk, int32_t n, bool cache, int32_t l_max) {
    const double a      = acceptance(lk, n, cache);
    double       tokens = 1.0, ak = 1.0, best = MARGIN; // L = 0: a plain step, one token per single pass
    int32_t      best_l = 0;
    for (int32_t l = 1; l <= l_max && l + 1 < (int32_t) lk.cost.size(); ++l) {
        ak *= a;
        tokens += ak;
        const double rate = tokens / lk.cost[l + 1];
        if (rate > best) {
            best   = rate;
            best_l = l;
        }
    }
    return best_l;
}

// A pass of n tokens took ms: its running time (the first pass of a size replaces the prior, then a moving average)
// and, once a single-token pass is known too, the cost of that size in single passes
static void observe_pass(specee_lookup & lk, int32_t n, double ms) {
    if (n >= (int32_t) lk.pass_ms.size()) {
        return;
    }
    double & t = lk.pass_ms[n];
    t          = t > 0.0 ? (1.0 - PASS_WEIGHT) * t + PASS_WEIGHT * ms : ms;
    if (lk.pass_ms[1] > 0.0) {
        for (int32_t k = 2; k < (int32_t) lk.pass_ms.size(); ++k) {
            if (lk.pass_ms[k] > 0.0) {
                lk.cost[k] = std::max(lk.pass_ms[k] / lk.pass_ms[1], 1.0);
            }
        }
    }
}

// ---- the step -----------------------------------------------------------------------------------------

// the tree in dec.nodes: the root, the best continuation's chain of `len` tokens, the other continuations' first
// tokens as more children of the root (point masses: no q); returns the drafted nodes in row order
static std::vector<int32_t> draft_tree(specee_lookup & lk, specee_tree_decoder & dec, int32_t root,
                                       const std::vector<continuation> & conts, bool from_cache, int32_t len,
                                       int32_t n_branches) {
    dec.nodes.clear();
    draft_node rn;
    rn.token = root;
    rn.row   = 0;
    dec.nodes.push_back(rn);
    const std::vector<int32_t> & t = lk.tokens;
    std::vector<int32_t>         chosen;
    auto add = [&](int32_t parent, int32_t token) {
        draft_node nd;
        nd.token  = token;
        nd.parent = parent;
        nd.depth  = dec.nodes[parent].depth + 1;
        nd.row    = (int32_t) chosen.size() + 1;
        dec.nodes.push_back(nd);
        const int32_t ni = (int32_t) dec.nodes.size() - 1;
        dec.nodes[parent].children.push_back(ni);
        chosen.push_back(ni);
        return ni;
    };
    int32_t parent = 0;
    if (len > 0 && from_cache) {
        for (int32_t tok : specee_ngram_cache_chain(*lk.cache, conts[0].from, len)) {
            parent = add(parent, tok);
        }
    }
    for (int64_t k = 0; !from_cache && k < len && conts[0].from + k < (int64_t) t.size(); ++k) {
        parent = add(parent, t[conts[0].from + k]);
    }
    for (int32_t b = 1; b < n_branches && b < (int32_t) conts.size(); ++b) {
        add(0, conts[b].token);
    }
    return chosen;
}

std::vector<int32_t> specee_lookup_draft(specee_lookup & lk, specee_tree_decoder & dec, int32_t root, int32_t budget) {
    // the longest match's continuations, as far as acceptance and pass cost say it pays
    int32_t                         n_match = 0;
    bool                            cache   = false;
    const std::vector<continuation> conts =
        budget > 0 ? continuations(lk, n_match, cache) : std::vector<continuation>{};
    const int32_t n_branches = conts.empty() ? 0 : std::min({lk.params.branches, (int32_t) conts.size(), budget});
    const int32_t l_max      = budget - (n_branches - 1);
    const int32_t len = conts.empty() ? 0 : lk.params.adaptive ? chain_length(lk, n_match, cache, l_max) : l_max;
    lk.pending_match  = conts.empty() ? 0 : n_match;
    lk.pending_cache  = cache;
    lk.pending_len    = len;
    lk.pending_first  = conts.empty() ? -1 : conts[0].token;
    return draft_tree(lk, dec, root, conts, cache, len, len > 0 ? n_branches : 0);
}

int32_t specee_lookup_finish(specee_lookup & lk, specee_tree_decoder & dec, specee_step step, int32_t n_rows,
                             const float * logits, int32_t row0, int32_t n_max, int32_t * out) {
    specee_context & ctx = step.ctx;
    std::vector<int32_t>  emitted, path;
    specee_tree_pass_rows rows  = {&dec, logits, (int32_t) ctx.model->hparams.n_vocab};
    const int32_t         n_acc = specee_tree_walk(dec, step, n_max, specee_tree_pass_logits, &rows, emitted, path);
    specee_tree_keep(dec, step, n_rows, emitted, path, nullptr, row0);
    // learn how far this sequence's lookups hold: an observation of the match length's acceptance, drafted or not
    if (lk.pending_match > 0) {
        const int32_t k      = lk.pending_match - lk.params.n_min;
        const int32_t len    = lk.pending_len;
        double &      succ   = lk.pending_cache ? lk.cache_succ[k] : lk.succ[k];
        double &      trials = lk.pending_cache ? lk.cache_trials[k] : lk.trials[k];
        succ *= DECAY;
        trials *= DECAY;
        if (len > 0) {
            succ += n_acc;
            trials += n_acc + (n_acc < len ? 1 : 0); // the accepted run, and the draft that broke it
        } else { // not drafted: what the lookup would have drafted first against the token that came
            succ += emitted[0] == lk.pending_first ? 1.0 : 0.0;
            trials += 1.0;
        }
        if (lk.pending_cache) {
            step.stats.n_cache_drafted += n_rows - 1;
            step.stats.n_cache_accepted += n_acc;
        }
    }
    lk.pending_match = 0;
    for (int32_t tok : emitted) {
        append(lk, tok);
    }
    step.root = emitted.back();
    step.root_pos += (int32_t) emitted.size();
    step.stats.n_steps++;
    step.stats.n_drafted += n_rows - 1;
    step.stats.n_accepted += n_acc;
    std::copy(emitted.begin(), emitted.end(), out);
    return (int32_t) emitted.size();
}

int32_t specee_lookup_step(specee_lookup & lk, specee_tree_decoder & dec, specee_step step, int32_t * out,
                           int32_t n_max) {
    specee_generator_stats & st     = step.stats;
    specee_context &         ctx    = step.ctx;
    const int32_t            n_free = (int32_t) ctx.cparams.n_ctx - (int32_t) ctx.kv.used;
    const int32_t budget = std::min({lk.params.draft_max, n_free - 1, (int32_t) ctx.cparams.n_batch - 1, n_max - 1});

    auto                       t0    = specee_clock::now();
    const std::vector<int32_t> nodes = specee_lookup_draft(lk, dec, step.root, budget);
    st.t_draft_ms += specee_ms_since(t0);

    // ---- verify root + drafts in one pass
    t0                         = specee_clock::now();
    const int32_t n_rows  = specee_tree_verify(dec, step, nodes);
    const double  pass_ms = specee_ms_since(t0);
    st.t_verify_ms += pass_ms;
    observe_pass(lk, n_rows, pass_ms);

    t0              = specee_clock::now();
    const int32_t n = specee_lookup_finish(lk, dec, step, n_rows, ctx.logits.data(), 0, n_max, out);
    st.t_sample_ms += specee_ms_since(t0);
    return n;
}

// ---- set-up ------------------------------------------------------------------------------------------

void specee_lookup_init(specee_lookup & lk, const specee_ngram_params & params, specee_context & ctx) {
    specee_lookup_commit(lk); // a sequence of the old settings goes to the cache before its tokens do
    lk.params = params;
    lk.cache  = ctx.ngram_cache.capacity > 0 ? &ctx.ngram_cache : nullptr;
    lk.index.assign(params.n_max - params.n_min + 1, {});
    lk.tokens.clear();
    lk.succ.assign(params.n_max - params.n_min + 1, 0.0);
    lk.trials.assign(params.n_max - params.n_min + 1, 0.0);
    lk.cache_succ.assign(params.n_max - params.n_min + 1, 0.0);
    lk.cache_trials.assign(params.n_max - params.n_min + 1, 0.0);
    // a pass of n tokens in single passes: before the first steps, passes of 2, 3, 5, 9, ... tokens (and the longest)
    // timed here, linear between them (a pass's cost grows in steps where the kernels change tiles; timing every
    // size would cost a large model many passes before its first token); then each size the steps use, from their
    // own passes (observe_pass). Where no pass can be timed, the dearest case the CPU measured here (3.2 for 4 tokens).
    lk.cost.assign(params.draft_max + 2, 1.0);
    const int32_t n_last = params.draft_max + 1;
    int32_t       prev   = 1;
    for (int32_t n = 2; n <= n_last; n = n == n_last ? n_last + 1 : std::min(2 * n - 1, n_last)) {
        const double c = specee_context_pass_cost(ctx, n);
        lk.cost[n]     = std::isnan(c) ? 1.0 + 0.73 * (n - 1) : std::max(c, 1.0);
        for (int32_t k = prev + 1; k < n; ++k) {
            lk.cost[k] = lk.cost[prev] + (lk.cost[n] - lk.cost[prev]) * (k - prev) / (n - prev);
        }
        prev = n;
    }
    lk.pass_ms.assign(params.draft_max + 2, 0.0);
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
    return s + " single passes here (timed at 2, 3, 5, 9, ...; then from the steps' own passes): a step drafts as far "
               "as its acceptance on the sequence pays for";
}

void specee_lookup_commit(specee_lookup & lk) {
    if (lk.cache && !lk.committed && !lk.tokens.empty() && lk.cache->epoch == lk.cache_epoch) {
        specee_ngram_cache_add(*lk.cache, lk.tokens.data(), (int32_t) lk.tokens.size());
    }
    lk.committed = true;
}

void specee_lookup_reset(specee_lookup & lk, const int32_t * tokens, int32_t n, int32_t first) {
    specee_lookup_commit(lk); // the sequence before: earlier requests' tokens for this one's lookups
    lk.committed   = false;
    lk.cache_epoch = lk.cache ? lk.cache->epoch : 0;
    lk.tokens.clear();
    for (auto & map : lk.index) {
        map.clear();
    }
    std::fill(lk.succ.begin(), lk.succ.end(), 0.0);
    std::fill(lk.trials.begin(), lk.trials.end(), 0.0);
    std::fill(lk.cache_succ.begin(), lk.cache_succ.end(), 0.0);
    std::fill(lk.cache_trials.begin(), lk.cache_trials.end(), 0.0);
    for (int32_t i = 0; i < n; ++i) {
        append(lk, tokens[i]);
    }
    append(lk, first);
}

// ---- for another drafter's tree ------------------------------------------------------------------------

// a pass of n tokens in single passes: the table, then its last step's slope beyond it
static double cost_of(const specee_lookup & lk, int32_t n) {
    const int32_t last = (int32_t) lk.cost.size() - 1;
    if (n <= last) {
        return lk.cost[std::max(n, 1)];
    }
    const double slope = last >= 2 ? lk.cost[last] - lk.cost[last - 1] : 1.0;
    return lk.cost[last] + slope * (n - last);
}

specee_lookup_candidates specee_lookup_candidates_of(const specee_lookup & lk, int32_t l_max, int32_t n_base) {
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
    if (!lk.params.adaptive) {
        c.len = (int32_t) c.chain.size();
        return c;
    }
    const double base   = cost_of(lk, n_base);
    double       tokens = 1.0, ak = 1.0, best = MARGIN;
    for (int32_t l = 1; l <= (int32_t) c.chain.size(); ++l) {
        ak *= c.acceptance;
        tokens += ak;
        const double rate = tokens / (cost_of(lk, n_base + l) / base);
        if (rate > best) {
            best  = rate;
            c.len = l;
        }
    }
    return c;
}

void specee_lookup_observe(specee_lookup & lk, const specee_lookup_candidates & c, int32_t drafted,
                           const std::vector<int32_t> & emitted, int32_t n_rows, double pass_ms) {
    observe_pass(lk, n_rows, pass_ms);
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
    for (int32_t tok : emitted) {
        append(lk, tok);
    }
}

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
