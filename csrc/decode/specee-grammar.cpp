// specee-grammar.cpp: structured output through llguidance's C API (specee-grammar.h states the contract).
//
// The engine's ABI and its loading: specee-llg.{h,cpp}; the front door every grammar passes before the engine sees it
// (limits, a compile on a worker with a budget, the cache of compiled grammars): specee-grammar-limits.cpp and
// specee-grammar-compile.cpp.
#include "specee-grammar.h"
#include "specee-gbnf.h"
#include "specee-grammar-compile.h"
#include "specee-grammar-limits.h"
#include "specee-impl.h"
#include "specee-llg.h"
#include "specee-model.h"
#include "specee-vocab.h"
#include "specee.h"

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

namespace {

// the vocabulary's own tokenizer, for llguidance's checks of token boundaries (no BOS, special tokens as text). Its
// user data is the vocabulary, held by the specee_grammar_vocab whose tokenizer calls this (the model may be gone);
// nothing thrown crosses into the engine.
size_t tokenize_cb(const void * user, const uint8_t * bytes, size_t n_bytes, uint32_t * out, size_t n_out) {
    std::vector<int32_t> ids;
    try {
        ids = specee_vocab_tokenize(*(const specee_vocab *) user, std::string((const char *) bytes, n_bytes), false,
                                    false);
    } catch (...) {
        return 0;
    }
    for (size_t i = 0; i < ids.size() && i < n_out; ++i) {
        out[i] = (uint32_t) ids[i];
    }
    return ids.size();
}

} // namespace

// ---- the grammar -----------------------------------------------------------------------------------------

// The mask worker (specee_grammar_prefetch): one thread per grammar, started on the first prefetch, that computes
// the current state's mask while the caller runs the model's pass. Every function below that reads or moves the
// matcher first waits for it (settle), so the matcher is only ever used by one thread at a time.
struct mask_worker {
    std::thread             thread;
    std::mutex              mutex;
    std::condition_variable cv;
    bool                    job  = false; // a mask to compute (set by prefetch, cleared by the worker when done)
    bool                    stop = false;
    std::exception_ptr      error;        // the job's failure, rethrown by settle
};

struct specee_grammar {
    const specee_model *  model = nullptr;
    int32_t               type  = SPECEE_GRAMMAR_NONE;
    std::string           text;
    std::shared_ptr<specee_grammar_vocab> vocab; // its model's vocabulary (grammar_vocab): kept while matcher is
    llg_matcher *         matcher = nullptr;
    std::vector<uint32_t> mask;
    bool                  mask_ok = false; // mask is the current state's
    std::vector<int32_t>  eog;             // the model's end-of-generation tokens
    int32_t               n_accepted = 0;
    bool                  ended      = false; // an end-of-generation token was accepted
    int32_t               n_end      = 0;     // end-of-generation tokens accepted (the last ones: they end the text)
    bool                  overlap    = true;  // prefetch computes masks on the worker (else it does nothing)
    double                t_mask_ms  = 0.0;   // masks on the caller's thread: computing them, or waiting for the worker
    mask_worker           worker;

    ~specee_grammar() {
        if (worker.thread.joinable()) {
            {
                std::lock_guard<std::mutex> lock(worker.mutex);
                worker.stop = true;
            }
            worker.cv.notify_all();
            worker.thread.join();
        }
        if (matcher) {
            specee_llg().free_matcher(matcher);
        }
    }
};

static std::string matcher_error(specee_grammar & g) { return specee_llg_message(specee_llg().matcher_get_error(g.matcher)); }

// a token's bytes for llguidance: its text; a control token's name after a 0xFF byte (llguidance's mark of a
// special token, which a grammar never produces as text)
static void token_bytes(const specee_model & m, int32_t t, std::string & out) {
    char    buf[512];
    int32_t n = specee_token_to_piece(&m, t, buf, sizeof(buf), false);
    if (n == 0) {
        n = specee_token_to_piece(&m, t, buf, sizeof(buf), true);
        if (n > 0) {
            out.assign("\xff");
            out.append(buf, n);
            return;
        }
    }
    out.assign(n > 0 ? std::string(buf, n) : std::string());
}

// A JSON Schema object whose output is compact JSON (no whitespace between tokens: a model cannot pad it without end,
// and the output's keys, quotes and braces become forced tokens), unless it gives llguidance's own "x-guidance"
// settings. Other schema texts (true, false, malformed ones) go as they are, for the engine to judge.
static std::string compact_json(const char * text) {
    const std::string s(text);
    const size_t      b = s.find_first_not_of(" \t\r\n");
    if (b == std::string::npos || s[b] != '{' || s.find("\"x-guidance\"") != std::string::npos) {
        return s;
    }
    const size_t next = s.find_first_not_of(" \t\r\n", b + 1);
    const bool   empty = next != std::string::npos && s[next] == '}';
    return s.substr(0, b + 1) + "\"x-guidance\":{\"whitespace_flexible\":false}" + (empty ? "" : ",") + s.substr(b + 1);
}

// The model's vocabulary as the engine sees it (specee-grammar-compile.h), built once per vocabulary (49k tokens take
// a noticeable fraction of a second) and kept while its model keeps the vocabulary: found by the vocabulary's address,
// which no other vocabulary can take while a view holds it. Orphans (their model freed) leave the list here; their
// views go with the last grammar, compile or cached matcher that holds them.
static std::shared_ptr<specee_grammar_vocab> grammar_vocab(const specee_model & m, const std::vector<int32_t> & eog) {
    // never destroyed: nothing to free at exit, where compiles abandoned past their budget may still run
    static auto &     views = *new std::vector<std::shared_ptr<specee_grammar_vocab>>;
    static std::mutex mutex;
    if (!m.vocab) {
        specee_fail("structured output: the model file has no tokenizer");
    }
    std::lock_guard<std::mutex> lock(mutex);
    std::shared_ptr<specee_grammar_vocab> found;
    for (size_t i = 0; i < views.size();) {
        if (views[i]->orphaned()) {
            views.erase(views.begin() + (long) i);
            continue;
        }
        found = views[i]->vocab == m.vocab ? views[i] : found;
        ++i;
    }
    if (found) {
        return found;
    }

    const int32_t         n_vocab = specee_model_n_vocab(&m);
    std::vector<uint32_t> lens(n_vocab);
    std::string           all, piece;
    for (int32_t t = 0; t < n_vocab; ++t) {
        token_bytes(m, t, piece);
        lens[t] = (uint32_t) piece.size();
        all += piece;
    }
    auto view   = std::make_shared<specee_grammar_vocab>();
    view->vocab = specee_vocab_retain(m.vocab);
    std::vector<uint32_t> eos_extra(eog.begin() + 1, eog.end());
    llg_tokenizer_init_v2 ti{};
    ti.struct_size         = sizeof(ti);
    ti.vocab_size          = (uint32_t) n_vocab;
    ti.tok_eos             = (uint32_t) eog[0];
    ti.token_lens          = lens.data();
    ti.token_bytes         = (const uint8_t *) all.data();
    ti.tokenize_fn         = tokenize_cb;
    ti.tokenize_user_data  = view->vocab;
    ti.tok_eos_extra       = eos_extra.data();
    ti.tok_eos_extra_count = (uint32_t) eos_extra.size();
    char err[1024] = "";
    view->tok      = specee_llg().new_tokenizer_v2(&ti, err, sizeof(err));
    if (!view->tok) {
        specee_fail("structured output: llguidance refused the model's vocabulary: %s", err);
    }
    views.push_back(view);
    return view;
}

specee_grammar * specee_grammar_init_impl(const specee_model & m, int32_t type, const char * text) {
    if (!text) {
        specee_fail("grammar: no text");
    }
    const char * kind = nullptr;
    switch (type) {
        case SPECEE_GRAMMAR_GBNF: // llguidance's Lark reader takes GBNF's `rule ::= ...` form
        case SPECEE_GRAMMAR_LARK: kind = "lark"; break;
        case SPECEE_GRAMMAR_JSON_SCHEMA: kind = "json"; break;
        case SPECEE_GRAMMAR_REGEX: kind = "regex"; break;
        default: specee_fail("grammar: unknown type %d (gbnf, json_schema, lark or regex)", type);
    }
    if (type == SPECEE_GRAMMAR_JSON_SCHEMA && text[strspn(text, " \t\r\n")] == '\0') {
        specee_fail("json_schema: empty schema (give {} for any JSON value)");
    }
    if (type != SPECEE_GRAMMAR_JSON_SCHEMA && text[strspn(text, " \t\r\n")] == '\0') {
        specee_fail("%s: empty grammar", specee_grammar_type_name(type));
    }
    specee_grammar_screen(type, text); // the front door's limits, before the converter or the engine sees it
    const std::string lark = type == SPECEE_GRAMMAR_GBNF ? specee_gbnf_to_lark(text) : std::string();
    const std::string json = type == SPECEE_GRAMMAR_JSON_SCHEMA ? compact_json(text) : std::string();
    const llg_api & a       = specee_llg();
    auto            g       = std::make_unique<specee_grammar>();
    g->model                = &m;
    g->type                 = type;
    g->text                 = text;
    g->eog.resize(specee_token_eog_ids(&m, nullptr, 0));
    specee_token_eog_ids(&m, g->eog.data(), (int32_t) g->eog.size());
    if (g->eog.empty()) {
        specee_fail("structured output: the model's vocabulary has no end-of-generation token");
    }
    g->vocab   = grammar_vocab(m, g->eog);
    g->matcher = specee_grammar_compile(g->vocab, type, text, kind,
                                        type == SPECEE_GRAMMAR_GBNF ? lark : type == SPECEE_GRAMMAR_JSON_SCHEMA ? json : text);
    g->mask.assign(a.matcher_get_mask_byte_size(g->matcher) / 4, 0);
    return g.release();
}

void specee_grammar_free_impl(specee_grammar * g) {
    const bool large = g && g->text.size() >= 8192; // its memory back to the system at the end of its request
    delete g;
    if (large) {
        specee_grammar_release_memory();
    }
}

int32_t specee_grammar_type_of(const specee_grammar & g) { return g.type; }

const std::string & specee_grammar_text(const specee_grammar & g) { return g.text; }

int32_t specee_grammar_n_accepted(const specee_grammar & g) { return g.n_accepted; }

// the current state's mask into g.mask (whichever thread runs it)
static void compute_mask(specee_grammar & g) {
    const llg_api & a = specee_llg();
    if (g.ended) {
        std::fill(g.mask.begin(), g.mask.end(), 0u); // past the end (ignore-EOS): only the end again
    } else if (a.matcher_compute_mask_into(g.matcher, g.mask.data(), g.mask.size() * 4) != 0) {
        specee_fail("%s: %s", specee_grammar_type_name(g.type), matcher_error(g).c_str());
    }
    // every end-of-generation token ends the text where the grammar's own EOS may
    const bool end = g.ended || ((g.mask[g.eog[0] / 32] >> (g.eog[0] % 32)) & 1u);
    for (int32_t t : g.eog) {
        if (end) {
            g.mask[t / 32] |= 1u << (t % 32);
        }
    }
    g.mask_ok = true;
}

static void worker_loop(specee_grammar * g) {
    mask_worker &                w = g->worker;
    std::unique_lock<std::mutex> lock(w.mutex);
    for (;;) {
        w.cv.wait(lock, [&] { return w.job || w.stop; });
        if (w.stop) {
            return;
        }
        lock.unlock();
        std::exception_ptr error;
        try {
            compute_mask(*g);
        } catch (...) {
            error = std::current_exception();
        }
        lock.lock();
        w.error = error;
        w.job   = false;
        w.cv.notify_all();
    }
}

// waits for the worker's mask, if one is being computed (the wait counts as mask time), and rethrows its failure
static void settle(specee_grammar & g) {
    mask_worker & w = g.worker;
    if (!w.thread.joinable()) {
        return;
    }
    std::unique_lock<std::mutex> lock(w.mutex);
    if (w.job) {
        const auto t0 = specee_clock::now();
        w.cv.wait(lock, [&] { return !w.job; });
        g.t_mask_ms += specee_ms_since(t0);
    }
    if (w.error) {
        std::exception_ptr e = w.error;
        w.error              = nullptr;
        std::rethrow_exception(e);
    }
}

void specee_grammar_prefetch(specee_grammar & g) {
    settle(g);
    if (!g.overlap || g.mask_ok) {
        return;
    }
    mask_worker & w = g.worker;
    if (!w.thread.joinable()) {
        w.thread = std::thread(worker_loop, &g);
    }
    {
        std::lock_guard<std::mutex> lock(w.mutex);
        w.job = true;
    }
    w.cv.notify_all();
}

void specee_grammar_set_overlap(specee_grammar & g, bool on) {
    settle(g);
    g.overlap = on;
}

double specee_grammar_mask_ms(const specee_grammar & g) { return g.t_mask_ms; }

const uint32_t * specee_grammar_mask_impl(specee_grammar & g) {
    settle(g);
    if (!g.mask_ok) {
        const auto t0 = specee_clock::now();
        compute_mask(g);
        g.t_mask_ms += specee_ms_since(t0);
    }
    return g.mask.data();
}

int32_t specee_grammar_valid_prefix(specee_grammar & g, const int32_t * tokens, int32_t n) {
    settle(g);
    const llg_api & a = specee_llg();
    auto is_eog = [&](int32_t t) { return std::find(g.eog.begin(), g.eog.end(), t) != g.eog.end(); };
    if (g.ended) { // only the end again
        int32_t k = 0;
        while (k < n && is_eog(tokens[k])) {
            ++k;
        }
        return k;
    }
    // the tokens before the first end-of-generation token go to the matcher's check as they are
    std::vector<uint32_t> run;
    int32_t               k = 0;
    for (; k < n && !is_eog(tokens[k]); ++k) {
        if (tokens[k] < 0 || (size_t) tokens[k] / 32 >= g.mask.size()) {
            break;
        }
        run.push_back((uint32_t) tokens[k]);
    }
    const int32_t ok = run.empty() ? 0 : a.matcher_validate_tokens(g.matcher, run.data(), run.size());
    if (ok < 0) {
        specee_fail("%s: %s", specee_grammar_type_name(g.type), matcher_error(g).c_str());
    }
    if (ok < (int32_t) run.size() || k == n || !is_eog(tokens[k])) {
        return ok;
    }
    // an end-of-generation token after the run: allowed where the text so far is complete
    if (run.empty()) {
        return specee_grammar_allows(g, tokens[k]) ? k + 1 : k;
    }
    bool accepting = false;
    if (a.matcher_consume_tokens(g.matcher, run.data(), run.size()) == 0) {
        accepting = a.matcher_is_accepting(g.matcher);
        if (a.matcher_rollback(g.matcher, run.size()) != 0) {
            specee_fail("%s: %s", specee_grammar_type_name(g.type), matcher_error(g).c_str());
        }
    }
    return accepting ? k + 1 : k;
}

bool specee_grammar_allows(specee_grammar & g, int32_t token) {
    const uint32_t * mask = specee_grammar_mask_impl(g);
    return token >= 0 && (size_t) token / 32 < g.mask.size() && ((mask[token / 32] >> (token % 32)) & 1u);
}

void specee_grammar_accept_impl(specee_grammar & g, int32_t token) {
    settle(g);
    if (!specee_grammar_allows(g, token)) {
        specee_fail("%s: token %d is not allowed here by the grammar", specee_grammar_type_name(g.type), token);
    }
    const bool eog = std::find(g.eog.begin(), g.eog.end(), token) != g.eog.end();
    if (eog) {
        g.ended = true;
        g.n_end += 1;
    } else if (specee_llg().matcher_consume_token(g.matcher, (uint32_t) token) != 0) {
        specee_fail("%s: %s", specee_grammar_type_name(g.type), matcher_error(g).c_str());
    }
    g.n_accepted += 1;
    g.mask_ok = false;
}

void specee_grammar_rollback_impl(specee_grammar & g, int32_t n) {
    settle(g);
    if (n < 0 || n > g.n_accepted) {
        specee_fail("grammar rollback: %d tokens, but %d were accepted", n, g.n_accepted);
    }
    if (n == 0) {
        return;
    }
    // accepted end-of-generation tokens are the last ones and never reached the matcher
    const int32_t n_matcher = n - std::min(n, g.n_end);
    if (n_matcher > 0 && specee_llg().matcher_rollback(g.matcher, (size_t) n_matcher) != 0) {
        specee_fail("%s: %s", specee_grammar_type_name(g.type), matcher_error(g).c_str());
    }
    g.n_end -= std::min(n, g.n_end);
    g.ended = g.n_end > 0;
    g.n_accepted -= n;
    g.mask_ok = false;
}

void specee_grammar_reset_impl(specee_grammar & g) {
    settle(g);
    if (g.n_accepted == 0 && !g.ended) {
        return;
    }
    if (specee_llg().matcher_reset(g.matcher) != 0) {
        specee_fail("%s: %s", specee_grammar_type_name(g.type), matcher_error(g).c_str());
    }
    g.ended      = false;
    g.n_end      = 0;
    g.n_accepted = 0;
    g.mask_ok    = false;
}

bool specee_grammar_done(specee_grammar & g) {
    settle(g);
    return g.ended || specee_llg().matcher_is_stopped(g.matcher);
}

std::vector<int32_t> specee_grammar_forced(specee_grammar & g, int32_t n_max) {
    settle(g);
    std::vector<uint32_t> ff(std::max(n_max, 1));
    if (g.ended) {
        return {};
    }
    const int32_t n = specee_llg().matcher_compute_ff_tokens(g.matcher, ff.data(), ff.size());
    if (n < 0) {
        specee_fail("%s: %s", specee_grammar_type_name(g.type), matcher_error(g).c_str());
    }
    return std::vector<int32_t>(ff.begin(), ff.begin() + std::min(n, n_max));
}

// ---- C API -----------------------------------------------------------------------------------------------

extern "C" specee_grammar * specee_grammar_init(const specee_model * model, int32_t type, const char * text) {
    return specee_guard<specee_grammar *>(nullptr, [&] {
        if (!model) {
            specee_fail("no model");
        }
        return specee_grammar_init_impl(*model, type, text);
    });
}

extern "C" void specee_grammar_free(specee_grammar * g) { specee_grammar_free_impl(g); }

extern "C" int32_t specee_grammar_mask(specee_grammar * g, uint32_t * mask, int32_t n_words) {
    return specee_guard<int32_t>(-1, [&] {
        const uint32_t * m = specee_grammar_mask_impl(*g);
        const int32_t    n = (int32_t) g->mask.size();
        if (mask && n_words >= n) {
            std::copy(m, m + n, mask);
        }
        return n;
    });
}

extern "C" int32_t specee_grammar_accept(specee_grammar * g, int32_t token) {
    return specee_guard<int32_t>(-1, [&] {
        specee_grammar_accept_impl(*g, token);
        return 0;
    });
}

extern "C" int32_t specee_grammar_rollback(specee_grammar * g, int32_t n_tokens) {
    return specee_guard<int32_t>(-1, [&] {
        specee_grammar_rollback_impl(*g, n_tokens);
        return 0;
    });
}

extern "C" int32_t specee_grammar_forced_tokens(specee_grammar * g, int32_t * tokens, int32_t n_max) {
    return specee_guard<int32_t>(-1, [&] {
        const std::vector<int32_t> ff = specee_grammar_forced(*g, n_max);
        std::copy(ff.begin(), ff.end(), tokens);
        return (int32_t) ff.size();
    });
}

extern "C" int32_t specee_grammar_valid_prefix(specee_grammar * g, const int32_t * tokens, int32_t n_tokens) {
    return specee_guard<int32_t>(-1, [&] {
        if (n_tokens < 0 || (n_tokens > 0 && !tokens)) {
            specee_fail("grammar valid_prefix: no tokens (n = %d)", n_tokens);
        }
        return specee_grammar_valid_prefix(*g, tokens, n_tokens);
    });
}

extern "C" int32_t specee_grammar_check(const specee_model * model, int32_t type, const char * text) {
    specee_grammar * g = specee_grammar_init(model, type, text);
    specee_grammar_free(g);
    return g ? 0 : -1;
}
