// specee-sampling.cpp: picking the next token from a row of logits
//
// The chain is llama.cpp's common default, minus the samplers that default to off there:
//
//   repetition penalty -> top-k -> top-p -> min-p -> temperature -> softmax -> seeded draw
//
// temp <= 0 is greedy: the argmax of the penalised logits (every filter of the chain keeps the
// most likely token, so this is the same token the full chain would give at temperature 0).
// The draw uses std::mt19937 and a 53-bit uniform built from its raw output, so a seed gives the
// same tokens on every platform.
#include "specee-grammar.h"
#include "specee-impl.h"
#include "specee-option-values.h"
#include "specee-sampling.h"
#include "specee.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <climits>
#include <cstdlib>
#include <random>
#include <string>
#include <unordered_set>
#include <vector>

struct specee_candidate {
    int32_t id;
    float   logit;
    float   p;
};

struct specee_sampler {
    specee_sampler_params params{};
    uint32_t              seed_cur = 0; // the seed in use (params.seed, or a random one)
    std::mt19937          rng;
    std::vector<int32_t>  history;      // accepted tokens, oldest first (trimmed lazily)
    std::vector<specee_candidate> cur;  // scratch: the candidates of the current draw
    std::vector<std::pair<int32_t, float>> logit_bias; // (token, added to its logit) on target draws
    specee_grammar *      grammar      = nullptr; // owned
    bool                  grammar_live = false;   // a draw since the last reset: accepted tokens are generated ones
    bool                  drawn        = false;   // the last draw was from cur's distribution (not greedy or forced)
    ~specee_sampler() { specee_grammar_free_impl(grammar); }
};

// larger logit first; equal logits by lower id, so that every sort below is deterministic
static bool candidate_before(const specee_candidate & a, const specee_candidate & b) {
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
}

static uint32_t resolve_seed(uint32_t seed) {
    if (seed != SPECEE_DEFAULT_SEED) {
        return seed;
    }
    std::random_device rd;
    return rd();
}

// ---- the chain's steps -------------------------------------------------------------------------

// for tokens seen in the window: positive logits are divided by the penalty, the others multiplied
// (each distinct token once, however often it occurs)
static void apply_repeat_penalty(const specee_sampler & s, std::vector<specee_candidate> & cur) {
    const float penalty = s.params.repeat_penalty;
    const int32_t last_n = s.params.repeat_last_n;
    if (penalty == 1.0f || last_n == 0 || s.history.empty()) {
        return;
    }
    const size_t n     = last_n < 0 ? s.history.size() : std::min(s.history.size(), (size_t) last_n);
    const size_t begin = s.history.size() - n;
    std::unordered_set<int32_t> seen;
    for (size_t i = begin; i < s.history.size(); ++i) {
        const int32_t id = s.history[i];
        if (id < 0 || id >= (int32_t) cur.size() || !seen.insert(id).second) {
            continue;
        }
        float & logit = cur[id].logit; // cur is still indexed by token id here
        logit         = logit > 0.0f ? logit / penalty : logit * penalty;
    }
}

// keep the k most likely; leaves cur sorted
static void apply_top_k(std::vector<specee_candidate> & cur, int32_t k, bool & sorted) {
    if (k <= 0 || k >= (int32_t) cur.size()) {
        return;
    }
    std::partial_sort(cur.begin(), cur.begin() + k, cur.end(), candidate_before);
    cur.resize(k);
    sorted = true;
}

// p of every candidate from its logit (softmax over the candidates left)
static void compute_probs(std::vector<specee_candidate> & cur) {
    float max_logit = -INFINITY;
    for (const auto & c : cur) {
        max_logit = std::max(max_logit, c.logit);
    }
    double sum = 0.0;
    for (auto & c : cur) {
        c.p = std::exp(c.logit - max_logit);
        sum += c.p;
    }
    for (auto & c : cur) {
        c.p = (float) (c.p / sum);
    }
}

// keep the smallest set of most likely tokens whose probabilities add up to at least p; leaves cur sorted
static void apply_top_p(std::vector<specee_candidate> & cur, float p, bool & sorted) {
    if (p >= 1.0f) {
        return;
    }
    compute_probs(cur);
    // over a large vocabulary the nucleus is nearly always among the first few hundred tokens:
    // sort those first and the rest only when they do not reach p
    size_t n_sorted = cur.size();
    if (!sorted) {
        n_sorted = std::min<size_t>(cur.size(), 256);
        std::partial_sort(cur.begin(), cur.begin() + n_sorted, cur.end(), candidate_before);
    }
    double cum = 0.0;
    for (size_t i = 0; i < cur.size(); ++i) {
        if (i == n_sorted) {
            std::sort(cur.begin() + i, cur.end(), candidate_before);
            n_sorted = cur.size();
        }
        cum += cur[i].p;
        if (cum >= p) {
            cur.resize(i + 1);
            break;
        }
    }
    sorted = true;
}

// keep the tokens whose probability is at least p times the largest one (order kept)
static void apply_min_p(std::vector<specee_candidate> & cur, float p) {
    if (p <= 0.0f || cur.empty()) {
        return;
    }
    float max_logit = -INFINITY;
    for (const auto & c : cur) {
        max_logit = std::max(max_logit, c.logit);
    }
    const float min_logit = max_logit + std::log(p);
    size_t      n         = 0;
    for (const auto & c : cur) {
        if (c.logit >= min_logit) {
            cur[n++] = c;
        }
    }
    cur.resize(n);
}

// a uniform double in [0, 1) with 53 random bits
static double uniform_01(std::mt19937 & rng) {
    const uint64_t a = rng() >> 5; // 27 bits
    const uint64_t b = rng() >> 6; // 26 bits
    return (double) ((a << 26) | b) / 9007199254740992.0; // 2^53
}

static int32_t draw(std::vector<specee_candidate> & cur, std::mt19937 & rng) {
    compute_probs(cur);
    const double u   = uniform_01(rng);
    double       cum = 0.0;
    for (const auto & c : cur) {
        cum += c.p;
        if (u < cum) {
            return c.id;
        }
    }
    // rounding left u above the total: the last candidate with any probability
    for (size_t i = cur.size(); i-- > 0;) {
        if (cur[i].p > 0.0f) {
            return cur[i].id;
        }
    }
    return cur.front().id;
}

// ---- API ---------------------------------------------------------------------------------------

extern "C" struct specee_sampler_params specee_sampler_default_params(void) {
    specee_sampler_params p;
    p.temp           = 0.8f;
    p.top_k          = 40;
    p.top_p          = 0.95f;
    p.min_p          = 0.05f;
    p.repeat_penalty = 1.0f;
    p.repeat_last_n  = 64;
    p.seed           = SPECEE_DEFAULT_SEED;
    return p;
}

specee_sampler * specee_sampler_init_impl(const specee_sampler_params & params) {
    specee_sampler_check_params(params);
    auto * s     = new specee_sampler;
    s->params    = params;
    s->seed_cur  = resolve_seed(params.seed);
    s->rng.seed(s->seed_cur);
    return s;
}

extern "C" specee_sampler * specee_sampler_init(struct specee_sampler_params params) {
    return specee_guard<specee_sampler *>(nullptr, [&] { return specee_sampler_init_impl(params); });
}

extern "C" void specee_sampler_free(specee_sampler * smpl) { delete smpl; }

// the lowest token the grammar allows (an end-of-generation token once it is done)
static int32_t first_allowed(specee_grammar & g, int32_t n_vocab) {
    for (int32_t i = 0; i < n_vocab; ++i) {
        if (specee_grammar_allows(g, i)) {
            return i;
        }
    }
    specee_fail("%s: the grammar allows no token here", specee_grammar_type_name(specee_grammar_type_of(g)));
}

// The chain up to the draw. Greedy: returns the argmax of the (penalised) logits. Otherwise leaves in s.cur
// the candidates the draw picks from, with their tempered logits, and returns -1.
static int32_t run_chain(specee_sampler & s, const float * logits, int32_t n_vocab, bool penalty) {
    if (!logits || n_vocab <= 0) {
        specee_fail("no logits to sample from (n_vocab = %d)", n_vocab);
    }
    s.drawn = false;
    const bool plain = !penalty || (s.logit_bias.empty() && !s.grammar &&
                                    (s.params.repeat_penalty == 1.0f || s.params.repeat_last_n == 0 || s.history.empty()));
    if (s.params.temp <= 0.0f && plain) { // greedy on the logits as they are: the argmax, no candidate list
        int32_t best = 0;
        for (int32_t i = 0; i < n_vocab; ++i) {
            if (std::isnan(logits[i])) {
                specee_fail("logit %d is NaN", i);
            }
            if (logits[i] > logits[best]) {
                best = i;
            }
        }
        return best;
    }
    auto & cur = s.cur;
    cur.resize(n_vocab);
    for (int32_t i = 0; i < n_vocab; ++i) {
        if (std::isnan(logits[i])) {
            specee_fail("logit %d is NaN", i);
        }
        cur[i] = {i, logits[i], 0.0f};
    }
    if (penalty) { // a draw from the target's logits (the draft's may be over a reduced vocabulary)
        for (const auto & [token, bias] : s.logit_bias) {
            if (token >= n_vocab) {
                specee_fail("logit bias for token %d, but there are %d logits", token, n_vocab);
            }
            cur[token].logit += bias;
        }
        apply_repeat_penalty(s, cur);
        if (s.grammar) {
            s.grammar_live = true;
            if (specee_grammar_done(*s.grammar)) {
                return first_allowed(*s.grammar, n_vocab); // only the end is left (even under ignore-EOS)
            }
            const uint32_t * mask = specee_grammar_mask_impl(*s.grammar);
            for (int32_t i = 0; i < n_vocab; ++i) {
                if (!((mask[i / 32] >> (i % 32)) & 1u)) {
                    cur[i].logit = -INFINITY;
                }
            }
        }
    }

    if (s.params.temp <= 0.0f) {
        int32_t best = 0;
        for (int32_t i = 1; i < n_vocab; ++i) {
            if (cur[i].logit > cur[best].logit) {
                best = i;
            }
        }
        if (cur[best].logit == -INFINITY && s.grammar && penalty) {
            return first_allowed(*s.grammar, n_vocab);
        }
        return best;
    }

    float max_logit = -INFINITY;
    for (const auto & c : cur) {
        max_logit = std::max(max_logit, c.logit);
    }
    if (max_logit == -INFINITY) {
        if (s.grammar && penalty) {
            return first_allowed(*s.grammar, n_vocab); // what the grammar allows was biased away (ignore-EOS)
        }
        specee_fail("every logit is -inf: nothing to sample");
    }
    bool sorted = false;
    apply_top_k(cur, s.params.top_k, sorted);
    apply_top_p(cur, s.params.top_p, sorted);
    apply_min_p(cur, s.params.min_p);
    for (auto & c : cur) {
        c.logit /= s.params.temp;
    }
    return -1;
}

int32_t specee_sampler_sample_impl(specee_sampler & s, const float * logits, int32_t n_vocab) {
    const int32_t best = run_chain(s, logits, n_vocab, true);
    if (best >= 0) {
        return best;
    }
    s.drawn = true;
    return draw(s.cur, s.rng);
}

void specee_sampler_drawn_logprobs(const specee_sampler & s, int32_t t, int32_t n_top,
                                   std::vector<specee_token_logprob> & out) {
    std::vector<specee_candidate> kept;
    if (s.drawn) {
        for (const specee_candidate & c : s.cur) {
            if (c.p > 0.0f) {
                kept.push_back(c);
            }
        }
        std::sort(kept.begin(), kept.end(), [](const specee_candidate & a, const specee_candidate & b) {
            return a.p != b.p ? a.p > b.p : a.id < b.id;
        });
    } else {
        kept.push_back({t, 0.0f, 1.0f}); // greedy, or the grammar's only token: t alone, certain
    }
    float lp_t = -INFINITY;
    for (const specee_candidate & c : kept) {
        if (c.id == t) {
            lp_t = std::log(c.p);
        }
    }
    out.push_back({t, lp_t});
    for (int32_t i = 0; i < n_top; ++i) {
        out.push_back(i < (int32_t) kept.size() ? specee_token_logprob{kept[i].id, std::log(kept[i].p)}
                                                : specee_token_logprob{-1, -INFINITY});
    }
}

void specee_sampler_dist(specee_sampler & s, const float * logits, int32_t n_vocab, bool penalty,
                         std::vector<std::pair<int32_t, float>> & out) {
    out.clear();
    const int32_t best = run_chain(s, logits, n_vocab, penalty);
    if (best >= 0) {
        out.emplace_back(best, 1.0f);
        return;
    }
    compute_probs(s.cur);
    for (const auto & c : s.cur) {
        if (c.p > 0.0f) {
            out.emplace_back(c.id, c.p);
        }
    }
}

double specee_sampler_uniform(specee_sampler & s) { return uniform_01(s.rng); }

bool specee_sampler_greedy(const specee_sampler & s) { return s.params.temp <= 0.0f; }

extern "C" int32_t specee_sampler_probs(specee_sampler * smpl, const float * logits, int32_t n_vocab, float * probs) {
    return specee_guard<int32_t>(-1, [&] {
        if (!smpl || !probs) {
            specee_fail("no sampler or no output array");
        }
        std::vector<std::pair<int32_t, float>> dist;
        specee_sampler_dist(*smpl, logits, n_vocab, true, dist);
        std::fill(probs, probs + n_vocab, 0.0f);
        for (const auto & d : dist) {
            probs[d.first] = d.second;
        }
        return 0;
    });
}

void specee_sampler_set_logit_bias_impl(specee_sampler & s, int32_t token, float bias) {
    if (token < 0 || std::isnan(bias)) {
        specee_fail("logit bias: a negative token (%d) or a NaN bias", token);
    }
    for (auto & [t, b] : s.logit_bias) {
        if (t == token) {
            b = bias;
            return;
        }
    }
    s.logit_bias.emplace_back(token, bias);
}

extern "C" int32_t specee_sampler_set_logit_bias(specee_sampler * smpl, int32_t token, float bias) {
    return specee_guard<int32_t>(-1, [&] {
        if (!smpl) {
            specee_fail("no sampler");
        }
        specee_sampler_set_logit_bias_impl(*smpl, token, bias);
        return 0;
    });
}

extern "C" int32_t specee_sampler_sample(specee_sampler * smpl, const float * logits, int32_t n_vocab) {
    return specee_guard<int32_t>(-1, [&] {
        if (!smpl) {
            specee_fail("no sampler");
        }
        return specee_sampler_sample_impl(*smpl, logits, n_vocab);
    });
}

void specee_sampler_accept_impl(specee_sampler & s, int32_t token) {
    if (s.grammar && s.grammar_live) {
        specee_grammar_accept_impl(*s.grammar, token);
    }
    auto &        h      = s.history;
    const int32_t last_n = s.params.repeat_last_n;
    h.push_back(token);
    // keep at most 2 * last_n tokens, trimming to last_n now and then (the window is the tail)
    if (last_n >= 0 && h.size() > 2 * (size_t) std::max(last_n, 32)) {
        h.erase(h.begin(), h.end() - std::max(last_n, 32));
    }
}

void specee_sampler_reset_impl(specee_sampler & s) {
    s.history.clear();
    if (s.grammar) {
        specee_grammar_reset_impl(*s.grammar);
    }
    s.grammar_live = false;
    s.seed_cur = resolve_seed(s.params.seed);
    s.rng.seed(s.seed_cur);
}

uint32_t specee_sampler_seed(const specee_sampler & s) { return s.seed_cur; }

void specee_sampler_copy_history(specee_sampler & dst, const specee_sampler & src) {
    dst.history      = src.history;
    dst.grammar_live = src.grammar_live;
}

std::vector<int32_t> specee_sampler_history(const specee_sampler & s) { return s.history; }

void specee_sampler_set_grammar(specee_sampler & s, specee_grammar * g) {
    if (g != s.grammar) {
        specee_grammar_free_impl(s.grammar);
    }
    s.grammar = g;
}

specee_grammar * specee_sampler_take_grammar(specee_sampler & s) {
    specee_grammar * g = s.grammar;
    s.grammar          = nullptr;
    return g;
}

specee_grammar * specee_sampler_grammar(const specee_sampler & s) { return s.grammar; }

void specee_sampler_prefetch(specee_sampler & s) {
    if (s.grammar && s.grammar_live) {
        specee_grammar_prefetch(*s.grammar);
    }
}

double specee_sampler_mask_ms(const specee_sampler & s) { return s.grammar ? specee_grammar_mask_ms(*s.grammar) : 0.0; }

void specee_sampler_set_history(specee_sampler & s, const std::vector<int32_t> & history) { s.history = history; }

extern "C" void specee_sampler_accept(specee_sampler * smpl, int32_t token) { specee_sampler_accept_impl(*smpl, token); }

extern "C" void specee_sampler_reset(specee_sampler * smpl) { specee_sampler_reset_impl(*smpl); }

std::vector<int32_t> specee_top_k(const float * x, int32_t n, int32_t k) {
    k = std::max(0, std::min(k, n));
    std::vector<int32_t> idx(n);
    for (int32_t i = 0; i < n; ++i) {
        idx[i] = i;
    }
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                      [&](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
    idx.resize(k);
    return idx;
}

void specee_logprobs(const float * logits, int32_t n_vocab, int32_t t, int32_t n_top,
                     std::vector<specee_token_logprob> & out) {
    const float max_logit = *std::max_element(logits, logits + n_vocab);
    double      sum       = 0.0;
    for (int32_t i = 0; i < n_vocab; ++i) {
        sum += std::exp((double) (logits[i] - max_logit));
    }
    const float lse = max_logit + (float) std::log(sum);
    out.push_back({t, logits[t] - lse});
    for (int32_t id : specee_top_k(logits, n_vocab, n_top)) { // most likely first, equal logits by id
        out.push_back({id, logits[id] - lse});
    }
}
