// specee-impl.h: internals shared by the runtime's files: errors and logging (specee-impl.cpp), formatting, timing,
// top-k (specee-sampling.cpp)
#pragma once

#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

// thrown inside the runtime; the C API catches it and stores the message for specee_last_error()
struct specee_error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

std::string specee_format(const char * fmt, ...) __attribute__((format(printf, 1, 2)));
[[noreturn]] void specee_fail(const char * fmt, ...) __attribute__((format(printf, 1, 2)));

void specee_set_error(const std::string & msg);
// the library's logging is on (specee_log_set_verbose): ggml's lines and the library's informational ones
bool specee_verbose();
// an informational line on stderr ("specee: ...\n"), only when the library's logging is on
void specee_log_info(const char * fmt, ...) __attribute__((format(printf, 1, 2)));
// while `lines` is set (on this thread), the error lines ggml logs are also appended to it; nullptr stops
void specee_log_capture_errors(std::vector<std::string> * lines);

// run f() at the API boundary: exceptions become specee_last_error() and the value `err`
template <typename T, typename F> T specee_guard(T err, F && f) {
    try {
        specee_set_error("");
        return f();
    } catch (const std::exception & e) {
        specee_set_error(e.what());
        return err;
    }
}

using specee_clock = std::chrono::steady_clock;

inline double specee_ms_since(specee_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(specee_clock::now() - t0).count();
}
