// specee-ngram-cache.cpp: the cross-request n-gram cache (documents of tokens, their n-grams' index, eviction of the
// oldest). See specee-ngram-cache.h.
#include "specee-ngram-cache.h"

#include <algorithm>

// FNV-1a over n and the n tokens at t[0..n) (n in the hash: the lengths share one map)
template <typename It> static uint64_t key_hash(It t, int32_t n) {
    uint64_t h = (1469598103934665603ull ^ (uint64_t) n) * 1099511628211ull;
    for (int32_t k = 0; k < n; ++k) {
        h = (h ^ (uint32_t) t[k]) * 1099511628211ull;
    }
    return h;
}

void specee_ngram_cache_init(specee_ngram_cache & c, int64_t capacity) {
    c          = specee_ngram_cache{};
    c.capacity = std::max<int64_t>(capacity, 0);
}

// the end of the document that holds position p (one past its last position)
static int64_t doc_end(const specee_ngram_cache & c, int64_t p) {
    const auto it = std::upper_bound(c.starts.begin(), c.starts.end(), p);
    return it == c.starts.end() ? c.base + (int64_t) c.tokens.size() : *it;
}

// the index's keys of the n-grams of the document [b, e) followed by a token of it: calls f(key, p) in position order
template <typename F> static void each_key(const specee_ngram_cache & c, int64_t b, int64_t e, F && f) {
    for (int64_t p = b; p + 1 < e; ++p) {
        for (int32_t n = 1; n <= SPECEE_NGRAM_CACHE_N_MAX && p - n + 1 >= b; ++n) {
            f(key_hash(c.tokens.begin() + (p - n + 1 - c.base), n), p);
        }
    }
}

// the oldest document out: its positions leave the index (they are the oldest of each key's list, at its front)
static void evict_oldest(specee_ngram_cache & c) {
    const int64_t b = c.starts.front();
    const int64_t e = c.starts.size() > 1 ? c.starts[1] : c.base + (int64_t) c.tokens.size();
    std::unordered_map<uint64_t, int64_t> drop; // key -> positions to drop from its front
    each_key(c, b, e, [&](uint64_t k, int64_t) { drop[k]++; });
    for (const auto & [k, n] : drop) {
        auto it = c.index.find(k);
        if (it == c.index.end()) {
            continue; // not reached: every key of the document was indexed
        }
        std::vector<int64_t> & v = it->second;
        const int64_t          m = std::min<int64_t>(n, (int64_t) v.size());
        v.erase(v.begin(), v.begin() + m);
        c.n_entries -= m;
        if (v.empty()) {
            c.index.erase(it);
        }
    }
    c.tokens.erase(c.tokens.begin(), c.tokens.begin() + (e - b));
    c.base = e;
    c.starts.pop_front();
}

void specee_ngram_cache_add(specee_ngram_cache & c, const int32_t * tokens, int32_t n) {
    if (c.capacity <= 0 || !tokens || n < 2) {
        return;
    }
    if (n > c.capacity) { // the document's last tokens: the ones a continuation of it would repeat
        tokens += n - c.capacity;
        n = (int32_t) c.capacity;
    }
    while (!c.starts.empty() && (int64_t) c.tokens.size() + n > c.capacity) {
        evict_oldest(c);
    }
    const int64_t b = c.base + (int64_t) c.tokens.size();
    c.starts.push_back(b);
    c.tokens.insert(c.tokens.end(), tokens, tokens + n);
    each_key(c, b, b + n, [&](uint64_t k, int64_t p) {
        c.index[k].push_back(p);
        c.n_entries++;
    });
    c.n_added++;
}

std::vector<specee_ngram_cache_cont> specee_ngram_cache_find(const specee_ngram_cache & c, const int32_t * key,
                                                             int32_t n) {
    std::vector<specee_ngram_cache_cont> out;
    if (c.capacity <= 0 || n < 1 || n > SPECEE_NGRAM_CACHE_N_MAX) {
        return out;
    }
    const auto it = c.index.find(key_hash(key, n));
    if (it == c.index.end()) {
        return out;
    }
    for (int64_t p : it->second) {
        const auto at = c.tokens.begin() + (p - n + 1 - c.base);
        if (!std::equal(at, at + n, key)) {
            continue; // a hash collision
        }
        const int32_t t = c.tokens[p + 1 - c.base];
        auto          x = std::find_if(out.begin(), out.end(), [&](const specee_ngram_cache_cont & y) { return y.token == t; });
        if (x == out.end()) {
            out.push_back({t, 0, p + 1});
            x = out.end() - 1;
        }
        x->count += 1;
        x->from = std::max(x->from, p + 1);
    }
    std::stable_sort(out.begin(), out.end(), [](const specee_ngram_cache_cont & a, const specee_ngram_cache_cont & b) {
        return a.count != b.count ? a.count > b.count : a.from > b.from;
    });
    return out;
}

std::vector<int32_t> specee_ngram_cache_chain(const specee_ngram_cache & c, int64_t from, int32_t len) {
    std::vector<int32_t> out;
    if (from < c.base || from >= c.base + (int64_t) c.tokens.size()) {
        return out;
    }
    const int64_t e = std::min(doc_end(c, from), from + std::max(len, 0));
    for (int64_t p = from; p < e; ++p) {
        out.push_back(c.tokens[p - c.base]);
    }
    return out;
}

// ---- a request's document ------------------------------------------------------------------------------

void specee_ngram_cache_doc_begin(const specee_ngram_cache & c, specee_ngram_cache_doc & d, const int32_t * tokens,
                                  int32_t n) {
    d.open  = c.capacity > 0;
    d.epoch = c.epoch;
    d.tokens.assign(d.open ? tokens : tokens + n, tokens + n);
}

void specee_ngram_cache_doc_append(specee_ngram_cache_doc & d, const int32_t * tokens, int32_t n) {
    if (d.open) {
        d.tokens.insert(d.tokens.end(), tokens, tokens + n);
    }
}

void specee_ngram_cache_doc_end(specee_ngram_cache & c, specee_ngram_cache_doc & d) {
    if (d.open && d.epoch == c.epoch) {
        specee_ngram_cache_add(c, d.tokens.data(), (int32_t) d.tokens.size());
    }
    d.open = false;
    d.tokens.clear();
}
