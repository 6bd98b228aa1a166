// specee-grammar-compile.cpp: compiling a grammar within a budget, and the cache of compiled grammars
// (specee-grammar-compile.h states the contract).
#include "specee-grammar-compile.h"
#include "specee-grammar-limits.h"
#include "specee-impl.h"
#include "specee-vocab.h"
#include "specee.h"

#include <pthread.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

// ---- the vocabulary as the engine sees it --------------------------------------------------------------

specee_grammar_vocab::~specee_grammar_vocab() {
    if (tok) {
        specee_llg().free_tokenizer(tok);
    }
    specee_vocab_free(vocab);
}

bool specee_grammar_vocab::orphaned() const { return specee_vocab_n_refs(vocab) <= 1; }

namespace {

// ---- the worker ------------------------------------------------------------------------------------------

constexpr size_t  COMPILE_STACK   = 256u << 20; // address space, touched only as deep as the engine recurses
constexpr int32_t MAX_ABANDONED   = 2;          // abandoned compiles still running: new ones are refused meanwhile
std::atomic<int32_t> g_abandoned{0};

// the process's resident memory, bytes (0 where /proc is not there)
int64_t rss_bytes() {
    FILE * f = fopen("/proc/self/statm", "r");
    long   pages = 0, resident = 0;
    if (!f) {
        return 0;
    }
    const int n = fscanf(f, "%ld %ld", &pages, &resident);
    fclose(f);
    return n == 2 ? (int64_t) resident * sysconf(_SC_PAGESIZE) : 0;
}

// freed memory back to the system (glibc keeps it in its arenas otherwise: a hostile grammar's hundreds of MB stay)
void trim() {
#if defined(__GLIBC__)
    malloc_trim(0);
#endif
}

// bytes malloc has handed out and not had back, all arenas together (0 where unknown): what a compile keeps is the
// difference across it, where the change of RSS says nothing when the compile reuses freed pages
int64_t heap_in_use() {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
    const struct mallinfo2 mi = mallinfo2();
    return (int64_t) (mi.uordblks + mi.hblkhd);
#else
    return 0;
#endif
}

struct compile_job {
    std::mutex                            mutex;
    std::condition_variable               cv;
    bool                                  done      = false;
    bool                                  abandoned = false; // the caller has gone: the worker frees what it made
    std::shared_ptr<specee_grammar_vocab> vocab; // what the engine reads (ci's tokenizer, its callback's data)
    llg_constraint_init                   ci{};
    std::string                           kind, text;
    llg_matcher *                         matcher = nullptr; // the result: a matcher, or
    std::string                           error;             // the engine's refusal
    int64_t                               held = 0;          // bytes the compile left allocated: the matcher's size
};

void * compile_main(void * arg) {
    std::shared_ptr<compile_job> job(std::move(*(std::shared_ptr<compile_job> *) arg));
    delete (std::shared_ptr<compile_job> *) arg;
    const llg_api & a     = specee_llg();
    const int64_t   used0 = heap_in_use();
    llg_matcher *   m     = a.new_matcher(&job->ci, job->kind.c_str(), job->text.c_str());
    std::string     error;
    if (a.matcher_is_error(m)) {
        error = specee_llg_message(a.matcher_get_error(m));
    } else { // the first mask: the engine's lexer is built here, and some refusals only come now
        std::vector<uint32_t> mask(a.matcher_get_mask_byte_size(m) / 4 + 1);
        uint32_t ff[64]; // and the tokens it forces first (jump-forward asks at once): an endless chain fails here
        if (a.matcher_compute_mask_into(m, mask.data(), (mask.size() - 1) * 4) != 0 ||
            a.matcher_compute_ff_tokens(m, ff, 64) < 0) {
            error = specee_llg_message(a.matcher_get_error(m));
        }
    }
    if (!error.empty()) {
        a.free_matcher(m);
        m = nullptr;
    }
    const int64_t held = heap_in_use() - used0;
    trim(); // what the compile made and dropped (the engine's scratch, a refused grammar) leaves the process
    {
        std::lock_guard<std::mutex> lock(job->mutex);
        if (!job->abandoned) {
            job->matcher = m;
            job->error   = error;
            job->held    = held;
            job->done    = true;
            job->cv.notify_all();
            return nullptr;
        }
    }
    // abandoned: the caller has gone. What the compile made goes, and with the job this worker's hold on the
    // vocabulary (the last one when its model was freed meanwhile), all before the count says the worker is done.
    if (m) {
        a.free_matcher(m);
    }
    job.reset();
    trim();
    g_abandoned -= 1;
    return nullptr;
}

// waits for the job within the budget; abandons it past the budget (throws)
void wait_within_budget(compile_job & job, const char * name) {
    const int64_t budget_ms = specee_grammar_limit_of("compile_ms");
    const int64_t budget_b  = specee_grammar_limit_of("compile_mb") << 20;
    const int64_t rss0      = rss_bytes();
    const auto    t0        = specee_clock::now();
    std::unique_lock<std::mutex> lock(job.mutex);
    while (!job.cv.wait_for(lock, std::chrono::milliseconds(10), [&] { return job.done; })) {
        const bool late = specee_ms_since(t0) > (double) budget_ms;
        const bool big  = rss0 > 0 && rss_bytes() - rss0 > budget_b;
        if (late || big) {
            job.abandoned = true;
            g_abandoned += 1;
            if (late) {
                specee_fail("%s: compiling it took longer than %lld ms (the grammar limit compile_ms)", name,
                            (long long) budget_ms);
            }
            specee_fail("%s: compiling it took more than %lld MiB (the grammar limit compile_mb)", name,
                        (long long) (budget_b >> 20));
        }
    }
}

llg_matcher * compile_on_worker(const std::shared_ptr<specee_grammar_vocab> & vocab, int32_t type, const char * kind,
                                const std::string & engine_text, std::string & error, int64_t & held) {
    const char * name = specee_grammar_type_name(type);
    if (g_abandoned.load() >= MAX_ABANDONED) {
        specee_fail("%s: the grammar engine is still busy with grammars that ran out of their budget; try again "
                    "later", name);
    }
    auto job   = std::make_shared<compile_job>();
    job->vocab = vocab;
    job->kind  = kind;
    job->text  = engine_text;
    const llg_api & a = specee_llg();
    a.constraint_init_set_defaults(&job->ci, vocab->tok);
    job->ci.log_stderr_level = 0; // its warnings come back as errors or not at all, never on the terminal
    job->ci.log_buffer_level = 0;
    job->ci.limits.verbose_errors = false; // no parser state, no grammar in its messages
    // the engine's own limits, from the memory budget: its lexer states cost about 2 KiB each
    job->ci.limits.max_lexer_states = (size_t) std::max<int64_t>(1024, (specee_grammar_limit_of("compile_mb") << 20) / 4096);

    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, COMPILE_STACK);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t t;
    auto *    arg = new std::shared_ptr<compile_job>(job);
    const int rc  = pthread_create(&t, &attr, compile_main, arg);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        delete arg;
        specee_fail("%s: cannot start a thread to compile it: %s", name, strerror(rc));
    }
    wait_within_budget(*job, name);
    error = job->error;
    held  = job->held;
    return job->matcher;
}

// ---- the cache -------------------------------------------------------------------------------------------

struct cached {
    std::shared_ptr<specee_grammar_vocab> vocab; // its matcher's: kept while the matcher is
    int32_t                               type;
    std::string                           text;
    llg_matcher *                         matcher; // start state; null with error
    std::string                           error;
    uint64_t                              used;
    int64_t                               cost = 0; // bytes it holds: the matcher (what its compile left allocated),
                                                    // the texts
};

std::mutex          g_cache_mutex;
std::vector<cached> g_cache;
uint64_t            g_tick = 0;
int64_t             g_hits = 0;

// the entry's matcher cloned (or its error thrown); false on a miss. Under g_cache_mutex.
bool from_cache(const specee_grammar_vocab * vocab, int32_t type, const std::string & text, llg_matcher *& out) {
    for (cached & c : g_cache) {
        if (c.vocab.get() == vocab && c.type == type && c.text == text) {
            c.used = ++g_tick;
            g_hits += 1;
            if (!c.matcher) {
                specee_fail("%s", c.error.c_str());
            }
            out = specee_llg().clone_matcher(c.matcher);
            return true;
        }
    }
    return false;
}

void drop(cached & c) {
    if (c.matcher) {
        specee_llg().free_matcher(c.matcher);
    }
}

// drops the entries of orphaned vocabularies (their model is gone: no compile asks for them again), and with the
// last of them the vocabulary, unless a grammar or an abandoned compile still holds it. Under g_cache_mutex.
void drop_orphans() {
    bool dropped = false;
    for (size_t i = 0; i < g_cache.size();) {
        if (g_cache[i].vocab->orphaned()) {
            drop(g_cache[i]);
            g_cache.erase(g_cache.begin() + (long) i);
            dropped = true;
        } else {
            ++i;
        }
    }
    if (dropped) {
        trim();
    }
}

// remembers an entry (the least recently used dropped to make room). Under g_cache_mutex.
void remember(cached && entry) {
    const size_t  cap  = (size_t) specee_grammar_limit_of("cache_entries");
    const int64_t room = specee_grammar_limit_of("cache_mb") << 20;
    entry.cost += (int64_t) (sizeof(cached) + entry.text.size() + entry.error.size());
    int64_t       held = entry.cost;
    for (const cached & c : g_cache) {
        held += c.cost;
    }
    while (!g_cache.empty() && (g_cache.size() >= cap || held > room)) {
        size_t lru = 0;
        for (size_t i = 1; i < g_cache.size(); ++i) {
            lru = g_cache[i].used < g_cache[lru].used ? i : lru;
        }
        held -= g_cache[lru].cost;
        drop(g_cache[lru]);
        g_cache.erase(g_cache.begin() + (long) lru);
        trim();
    }
    entry.used = ++g_tick;
    g_cache.push_back(std::move(entry));
}

} // namespace

llg_matcher * specee_grammar_compile(const std::shared_ptr<specee_grammar_vocab> & vocab, int32_t type,
                                     const std::string & text, const char * kind, const std::string & engine_text) {
    {
        std::lock_guard<std::mutex> lock(g_cache_mutex);
        drop_orphans();
        llg_matcher * m = nullptr;
        if (from_cache(vocab.get(), type, text, m)) {
            return m;
        }
    }
    std::string error;
    int64_t     held = 0;
    llg_matcher * m;
    try {
        m = compile_on_worker(vocab, type, kind, engine_text, error, held);
    } catch (const specee_error & e) { // out of budget: kept as a refusal too
        std::lock_guard<std::mutex> lock(g_cache_mutex);
        remember({vocab, type, text, nullptr, e.what(), 0, 0});
        throw;
    }
    const std::string message = error.empty() ? "" : std::string(specee_grammar_type_name(type)) + ": " + error;
    std::lock_guard<std::mutex> lock(g_cache_mutex);
    if (!m) {
        remember({vocab, type, text, nullptr, message, 0, 0});
        specee_fail("%s", message.c_str());
    }
    if (held + (int64_t) text.size() <= specee_grammar_limit_of("cache_mb") << 20) {
        remember({vocab, type, text, specee_llg().clone_matcher(m), "", 0, std::max<int64_t>(held, 0)});
    }
    return m;
}

void specee_grammar_release_memory() { trim(); }

extern "C" int32_t specee_grammar_cache_size(void) {
    std::lock_guard<std::mutex> lock(g_cache_mutex);
    return (int32_t) g_cache.size();
}

extern "C" int64_t specee_grammar_cache_hits(void) {
    std::lock_guard<std::mutex> lock(g_cache_mutex);
    return g_hits;
}

extern "C" void specee_grammar_cache_clear(void) {
    std::lock_guard<std::mutex> lock(g_cache_mutex);
    for (cached & c : g_cache) {
        drop(c);
    }
    g_cache.clear();
    trim();
}

extern "C" int32_t specee_grammar_n_abandoned(void) { return g_abandoned.load(); }
