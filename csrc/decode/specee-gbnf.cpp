// specee-gbnf.cpp: llama.cpp's GBNF read as llguidance's Lark (specee-gbnf.h; specee-grammar.cpp compiles through it)
#include "specee-gbnf.h"
#include "specee-impl.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

// llguidance reads Lark; llama.cpp's GBNF maps onto it term for term: `name ::= ...` becomes `r_name: ...` (Lark's
// rule names are lower case: '-' becomes '_', and every name gets an r_ prefix so none clashes with `start` or
// another), `root` is `start`, "strings" stay strings, [classes] and `.` become /regular expressions/ (Rust's
// syntax takes GBNF's \x, \u and \U escapes), and the operators * + ? {m,n} ( ) | are the same. Comments go.

namespace {

struct gbnf_reader {
    const std::string & src;
    size_t              i = 0;

    [[noreturn]] void fail(const char * what) const {
        const size_t line = 1 + (size_t) std::count(src.begin(), src.begin() + (ptrdiff_t) std::min(i, src.size()), '\n');
        specee_fail("gbnf: line %zu: %s", line, what);
    }

    // spaces and comments; newlines too unless they end a rule (a newline not followed by more of it)
    void skip(bool newlines) {
        while (i < src.size()) {
            const char c = src[i];
            if (c == '#') {
                while (i < src.size() && src[i] != '\n') {
                    ++i;
                }
            } else if (c == ' ' || c == '\t' || c == '\r' || (newlines && c == '\n')) {
                ++i;
            } else {
                break;
            }
        }
    }

    static bool name_char(char c) { return isalnum((unsigned char) c) || c == '-' || c == '_'; }

    std::string name() {
        const size_t b = i;
        while (i < src.size() && name_char(src[i])) {
            ++i;
        }
        if (b == i) {
            fail("a rule name expected");
        }
        return src.substr(b, i - b);
    }
};

std::string lark_name(const std::string & gbnf) {
    std::string n = "r_";
    for (char c : gbnf) {
        n += c == '-' ? '_' : (char) tolower((unsigned char) c);
    }
    return n;
}

// a quoted string as Lark takes it (the escapes are JSON's, which GBNF's \x.. \u.... are turned into)
void convert_string(gbnf_reader & r, std::string & out) {
    out += '"';
    ++r.i; // the opening quote
    while (r.i < r.src.size() && r.src[r.i] != '"') {
        char c = r.src[r.i++];
        if (c == '\n') {
            r.fail("a string runs past the end of its line");
        }
        if (c != '\\') {
            out += c;
            continue;
        }
        if (r.i >= r.src.size()) {
            r.fail("an escape at the end of the grammar");
        }
        c = r.src[r.i++];
        int digits = c == 'x' ? 2 : c == 'u' ? 4 : c == 'U' ? 8 : 0;
        if (digits == 0) {
            if (!strchr("nrt\"\\[]", c)) {
                r.fail("unknown escape in a string");
            }
            out += c == '[' || c == ']' ? std::string(1, c) : std::string("\\") + c;
            continue;
        }
        uint32_t cp = 0;
        for (; digits > 0; --digits) {
            if (r.i >= r.src.size() || !isxdigit((unsigned char) r.src[r.i])) {
                r.fail("bad hexadecimal escape in a string");
            }
            cp = cp * 16 + (uint32_t) strtol(std::string(1, r.src[r.i++]).c_str(), nullptr, 16);
        }
        if (cp > 0x10FFFF) {
            r.fail("a code point past U+10FFFF");
        }
        char buf[16];
        if (cp > 0xFFFF) { // a surrogate pair
            cp -= 0x10000;
            snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
        } else {
            snprintf(buf, sizeof(buf), "\\u%04x", cp);
        }
        out += buf;
    }
    if (r.i >= r.src.size()) {
        r.fail("a string without its closing quote");
    }
    ++r.i;
    out += '"';
}

// [...] as a regular expression
void convert_class(gbnf_reader & r, std::string & out) {
    out += "/[";
    ++r.i;
    while (r.i < r.src.size() && r.src[r.i] != ']') {
        const char c = r.src[r.i++];
        if (c == '\n') {
            r.fail("a character class runs past the end of its line");
        }
        if (c == '\\') {
            if (r.i >= r.src.size()) {
                r.fail("an escape at the end of the grammar");
            }
            const char e = r.src[r.i++];
            out += e == '/' ? std::string("\\/") : std::string("\\") + e;
        } else {
            out += c == '/' ? std::string("\\/") : std::string(1, c);
        }
    }
    if (r.i >= r.src.size()) {
        r.fail("a character class without its closing ]");
    }
    ++r.i;
    out += "]/";
}

// one rule's alternatives, to the end of the rule (a newline outside parentheses, unless the next line goes on
// with '|')
void convert_body(gbnf_reader & r, std::string & out, std::vector<std::string> & used) {
    int depth = 0;
    bool empty = true;
    for (;;) {
        r.skip(depth > 0);
        if (r.i >= r.src.size()) {
            break;
        }
        const char c = r.src[r.i];
        if (c == '\n') {
            // the rule ends at a newline outside parentheses (as llama.cpp reads it), unless the next line starts
            // with '|'
            size_t j = r.i;
            while (j < r.src.size() && strchr("\n \t\r", r.src[j])) {
                ++j;
            }
            if (j < r.src.size() && r.src[j] == '|') {
                r.i = j;
                continue;
            }
            break;
        }
        empty = false;
        if (c == '"') {
            convert_string(r, out);
        } else if (c == '[') {
            convert_class(r, out);
        } else if (c == '.') {
            out += "/(?s:.)/";
            ++r.i;
        } else if (c == '(') {
            out += '(';
            ++depth;
            ++r.i;
        } else if (c == ')') {
            if (depth == 0) {
                r.fail("a ')' without its '('");
            }
            out += ')';
            --depth;
            ++r.i;
        } else if (c == '|') {
            out += c;
            ++r.i;
            r.skip(true); // the next alternative may start on the next line
        } else if (c == '*' || c == '+' || c == '?') {
            out += c;
            ++r.i;
        } else if (c == '{') {
            const size_t b = r.i;
            while (r.i < r.src.size() && r.src[r.i] != '}' && r.src[r.i] != '\n') {
                ++r.i;
            }
            if (r.i >= r.src.size() || r.src[r.i] != '}') {
                r.fail("a repetition {m,n} without its closing }");
            }
            ++r.i;
            const std::string rep = r.src.substr(b, r.i - b);
            if (rep.find_first_not_of("{}0123456789, ") != std::string::npos || rep == "{}") {
                r.fail("a repetition is {m}, {m,} or {m,n}");
            }
            out += rep;
        } else if (gbnf_reader::name_char(c)) {
            const std::string n = r.name();
            used.push_back(n);
            out += lark_name(n);
        } else {
            r.fail(specee_format("unexpected '%c'", c).c_str());
        }
        out += ' ';
    }
    if (depth > 0) {
        r.fail("a '(' without its ')'");
    }
    if (empty) {
        r.fail("a rule with an empty body");
    }
}

} // namespace

std::string specee_gbnf_to_lark(const std::string & gbnf) {
    gbnf_reader              r{gbnf};
    std::string              out;
    std::vector<std::string> defined, used;
    for (;;) {
        r.skip(true);
        if (r.i >= gbnf.size()) {
            break;
        }
        const std::string n = r.name();
        r.skip(false);
        if (gbnf.compare(r.i, 3, "::=") != 0) {
            r.fail(specee_format("'::=' expected after the rule name '%s'", n.c_str()).c_str());
        }
        r.i += 3;
        r.skip(true); // the body may start on the next line
        if (std::find(defined.begin(), defined.end(), n) != defined.end()) {
            r.fail(specee_format("rule '%s' is defined twice", n.c_str()).c_str());
        }
        defined.push_back(n);
        out += lark_name(n) + ": ";
        convert_body(r, out, used);
        out += '\n';
    }
    if (std::find(defined.begin(), defined.end(), "root") == defined.end()) {
        specee_fail("gbnf: no rule named root (where the output starts)");
    }
    for (const std::string & u : used) {
        if (std::find(defined.begin(), defined.end(), u) == defined.end()) {
            specee_fail("gbnf: rule '%s' is used but not defined", u.c_str());
        }
    }
    return "start: r_root\n" + out;
}
