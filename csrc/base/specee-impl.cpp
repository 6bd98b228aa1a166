// specee-impl.cpp: errors and logging. Owns the last error (specee_last_error, per thread), the library's logging
// switch (specee_log_set_verbose) and ggml's log callback, which can also collect ggml's error lines for a caller
// (specee-gguf.cpp: why ggml refused a file).
#include "specee-impl.h"

#include "specee.h"

#include "ggml.h"

#include <cstdio>

static thread_local std::string g_last_error;
static bool                     g_verbose = false;

void specee_set_error(const std::string & msg) { g_last_error = msg; }
bool specee_verbose() { return g_verbose; }

std::string specee_format(const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char buf[1024];
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    return buf;
}

void specee_fail(const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char buf[1024];
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    throw specee_error(buf);
}

void specee_log_info(const char * fmt, ...) {
    if (!g_verbose) {
        return;
    }
    va_list ap;
    va_start(ap, fmt);
    char buf[1024];
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    fprintf(stderr, "specee: %s\n", buf);
}

// ggml's error lines while a caller collects them (on this thread): ggml's GGUF parser says why it rejects a file
// only through its log
static thread_local std::vector<std::string> * g_captured = nullptr;
static thread_local bool                       g_last_was_error = false;

static void log_callback(ggml_log_level level, const char * text, void *) {
    // errors reach the caller through specee_last_error(); ggml's own lines only when verbose
    if (g_captured) {
        if (level == GGML_LOG_LEVEL_ERROR) {
            g_captured->emplace_back(text);
        } else if (level == GGML_LOG_LEVEL_CONT && g_last_was_error && !g_captured->empty()) {
            g_captured->back() += text;
        }
    }
    g_last_was_error = level == GGML_LOG_LEVEL_ERROR || (level == GGML_LOG_LEVEL_CONT && g_last_was_error);
    if (g_verbose) {
        fputs(text, stderr);
    }
}

void specee_log_capture_errors(std::vector<std::string> * lines) {
    if (lines) {
        ggml_log_set(log_callback, nullptr);
    }
    g_captured = lines;
}

// ---- C API ---------------------------------------------------------------------------------------

extern "C" const char * specee_last_error(void) { return g_last_error.c_str(); }

extern "C" void specee_log_set_verbose(bool verbose) {
    g_verbose = verbose;
    ggml_log_set(log_callback, nullptr);
}
