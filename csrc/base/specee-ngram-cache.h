// specee-ngram-cache.h: the cross-request n-gram cache: the tokens of earlier requests (each one's prompt and output,
// a document) on a context, indexed by their n-grams, so that a request drafts what an earlier one said (boilerplate a
// server sees again and again, the same question asked twice of a Model that is reused). One per context (so per
// reused specee.Model, and per server): every generator and slot of the context adds to it and reads it.
//
// Bounded in memory: at most `capacity` tokens (the context option ngram_cache, 0: off), the oldest documents evicted
// first (a document longer than the whole cache keeps its last `capacity` tokens). The index holds, per kept token,
// one entry per n-gram length 1..SPECEE_NGRAM_CACHE_N_MAX ending there, so its size follows the tokens'.
//
// The lookup (specee-lookup.cpp) consults it where the sequence's own tokens have no match of a length: its
// continuations are drafted as the sequence's own would be, with their own acceptance estimates.
#pragma once

#include <cstdint>
#include <deque>
#include <unordered_map>
#include <vector>

// the longest n-gram the cache indexes (a lookup's longer matches are tried on the sequence only)
#define SPECEE_NGRAM_CACHE_N_MAX 4

struct specee_ngram_cache {
    int64_t             capacity = 0; // most tokens kept (0: off)
    std::deque<int32_t> tokens;       // the kept documents' tokens, oldest first: tokens[i] is at position base + i
    int64_t             base = 0;
    std::deque<int64_t> starts;       // each kept document's first position, oldest first (a document ends where the
                                      // next starts, the last at base + tokens.size())
    // hash of (n, the n tokens ending at position p) -> those positions p, ascending; only n-grams followed by a token
    // of their document
    std::unordered_map<uint64_t, std::vector<int64_t>> index;
    int64_t             n_entries = 0; // positions in the index, summed over its keys
    int64_t             n_added   = 0; // documents added since the context was made (evicted ones included)
    uint64_t            epoch     = 0; // cleared this many times: a sequence begun before a clear is not added
};

// a continuation of an n-gram in the cache: the token that followed it, how often, and the latest place it did
struct specee_ngram_cache_cont {
    int32_t token = -1, count = 0;
    int64_t from  = -1;
};

// A request's tokens on their way into the cache: its prompt, then every token it produced, added once where it ends
// (the slots: when it finishes or is cancelled; a generator: when its next request starts). Every request's, whatever
// its mode: a plain request's text is drafted from as a lookup request's is.
struct specee_ngram_cache_doc {
    std::vector<int32_t> tokens;
    uint64_t             epoch = 0;     // the cache's epoch when it began (a clear since: not added)
    bool                 open  = false; // begun (with the cache on) and not added yet
};

// off (capacity 0) or empty with room for `capacity` tokens; the kept documents are dropped
void    specee_ngram_cache_init(specee_ngram_cache & c, int64_t capacity);
// one document (a request's prompt and output), the oldest documents evicted until it fits; nothing when off or n < 2
void    specee_ngram_cache_add(specee_ngram_cache & c, const int32_t * tokens, int32_t n);
// the continuations of the n tokens at key[0..n) (1 <= n <= SPECEE_NGRAM_CACHE_N_MAX), most frequent first, then most
// recent; empty where the cache has none (or is off)
std::vector<specee_ngram_cache_cont> specee_ngram_cache_find(const specee_ngram_cache & c, const int32_t * key,
                                                             int32_t n);
// up to len tokens from position `from` on, within its document
std::vector<int32_t> specee_ngram_cache_chain(const specee_ngram_cache & c, int64_t from, int32_t len);
// a request's document: begun with its prompt (an open one before is dropped: end it first), tokens appended to it
// while open, and ended: added to the cache, unless the cache is off or was cleared since it began
void specee_ngram_cache_doc_begin(const specee_ngram_cache & c, specee_ngram_cache_doc & d, const int32_t * tokens,
                                  int32_t n);
void specee_ngram_cache_doc_append(specee_ngram_cache_doc & d, const int32_t * tokens, int32_t n);
void specee_ngram_cache_doc_end(specee_ngram_cache & c, specee_ngram_cache_doc & d);
// tokens kept
inline int64_t specee_ngram_cache_size(const specee_ngram_cache & c) { return (int64_t) c.tokens.size(); }
