// specee-impl.h: internals shared by the runtime's files (errors, formatting)
#pragma once

#include <cstdarg>
#include <stdexcept>
#include <string>

// thrown inside the runtime; the C API catches it and stores the message for specee_last_error()
struct specee_error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

std::string specee_format(const char * fmt, ...) __attribute__((format(printf, 1, 2)));
[[noreturn]] void specee_fail(const char * fmt, ...) __attribute__((format(printf, 1, 2)));

void specee_set_error(const std::string & msg);
bool specee_verbose();

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
