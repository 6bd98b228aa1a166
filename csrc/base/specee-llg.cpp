// specee-llg.cpp: loading llguidance's library (specee-llg.h states the contract).
#include "specee-llg.h"
#include "specee-impl.h"
#include "specee.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>

namespace {

std::mutex  g_lib_mutex;
std::string g_lib_path; // specee_grammar_set_library
llg_api     g_api{};
bool        g_loaded = false;

#ifndef SPECEE_LLGUIDANCE_DEFAULT
#define SPECEE_LLGUIDANCE_DEFAULT ""
#endif
#ifndef SPECEE_LIBPYTHON_DEFAULT
#define SPECEE_LIBPYTHON_DEFAULT ""
#endif

const char * first_set(const char * a, const char * b) { return a && a[0] ? a : b; }

template <typename F> void resolve(void * h, const char * name, F & fn) {
    fn = reinterpret_cast<F>(dlsym(h, name));
    if (!fn) {
        specee_fail("structured output: the llguidance library has no %s (llguidance 1.x is needed)", name);
    }
}

} // namespace

const llg_api & specee_llg() {
    std::lock_guard<std::mutex> lock(g_lib_mutex);
    if (g_loaded) {
        return g_api;
    }
    const std::string path = !g_lib_path.empty() ? g_lib_path : first_set(getenv("SPECEE_LLGUIDANCE"), SPECEE_LLGUIDANCE_DEFAULT);
    if (path.empty()) {
        specee_fail("structured output needs the llguidance package (pip install llguidance), and none was found "
                    "when this was built: set SPECEE_LLGUIDANCE to its library (python -c \"import llguidance._lib as "
                    "l; print(l.__file__)\")");
    }
    void * h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        // a process without Python: the wheel's library links against libpython's symbols, so load those first
        const char * py = first_set(getenv("SPECEE_LIBPYTHON"), SPECEE_LIBPYTHON_DEFAULT);
        if (py[0] && dlopen(py, RTLD_NOW | RTLD_GLOBAL)) {
            h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
        }
    }
    if (!h) {
        const char * e = dlerror();
        specee_fail("structured output: cannot load llguidance from %s: %s (set SPECEE_LLGUIDANCE to its library, "
                    "and SPECEE_LIBPYTHON to libpython when it asks for Python's symbols)", path.c_str(), e ? e : "?");
    }
    llg_api a{};
    resolve(h, "llg_constraint_init_set_defaults", a.constraint_init_set_defaults);
    resolve(h, "llg_new_tokenizer_v2", a.new_tokenizer_v2);
    resolve(h, "llg_free_tokenizer", a.free_tokenizer);
    resolve(h, "llg_new_matcher", a.new_matcher);
    resolve(h, "llg_free_matcher", a.free_matcher);
    resolve(h, "llg_matcher_get_error", a.matcher_get_error);
    resolve(h, "llg_matcher_is_error", a.matcher_is_error);
    resolve(h, "llg_matcher_get_mask_byte_size", a.matcher_get_mask_byte_size);
    resolve(h, "llg_matcher_compute_mask_into", a.matcher_compute_mask_into);
    resolve(h, "llg_matcher_consume_token", a.matcher_consume_token);
    resolve(h, "llg_matcher_consume_tokens", a.matcher_consume_tokens);
    resolve(h, "llg_matcher_rollback", a.matcher_rollback);
    resolve(h, "llg_matcher_reset", a.matcher_reset);
    resolve(h, "llg_matcher_is_accepting", a.matcher_is_accepting);
    resolve(h, "llg_matcher_is_stopped", a.matcher_is_stopped);
    resolve(h, "llg_matcher_compute_ff_tokens", a.matcher_compute_ff_tokens);
    resolve(h, "llg_matcher_validate_tokens", a.matcher_validate_tokens);
    resolve(h, "llg_clone_matcher", a.clone_matcher);
    g_api    = a;
    g_loaded = true;
    return g_api;
}

extern "C" void specee_grammar_set_library(const char * path) {
    std::lock_guard<std::mutex> lock(g_lib_mutex);
    if (!g_loaded) {
        g_lib_path = path ? path : "";
    }
}

std::string specee_llg_message(const char * e) {
    std::string s = e ? e : "";
    if (s.find("panicked") != std::string::npos || s.find("backtrace") != std::string::npos) {
        return "the grammar engine failed on it (too large or too deep)";
    }
    s = s.substr(0, s.find('\n'));
    if (s == "NoExtensionBias") { // the engine's word for a rule that can only refer to itself (a $ref cycle)
        return "a rule or $ref that refers only to itself, never reaching a value";
    }
    if (s.size() > 200) {
        s = s.substr(0, 200) + "...";
    }
    return s.empty() ? "the grammar engine refused it" : s;
}
