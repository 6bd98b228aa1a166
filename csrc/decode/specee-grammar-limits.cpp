// specee-grammar-limits.cpp: the grammar front door's limits, and the screen (specee-grammar-limits.h states the
// contract). The figures are measured against llguidance 1.9 on SmolLM2's vocabulary (docs/hardening.md, "Grammars"):
// each limit sits well inside what the engine survives and compiles within its budget on a 2-core machine.
#include "specee-grammar-limits.h"
#include "specee-impl.h"
#include "specee.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

// ---- the grammar types' names ---------------------------------------------------------------------------

const char * const specee_grammar_type_names[SPECEE_N_GRAMMAR_TYPES] = {"none", "gbnf", "json_schema", "lark", "regex"};

extern "C" const char * specee_grammar_type_name(int32_t type) {
    return type >= 0 && type < SPECEE_N_GRAMMAR_TYPES ? specee_grammar_type_names[type] : "?";
}

// the one rule of a structured-output text's type: a JSON Schema is json_schema; a grammar is the type asked for, gbnf
// when none is
extern "C" int32_t specee_grammar_type_of(int32_t asked, bool schema) {
    return specee_guard<int32_t>(-1, [&] {
        if (asked < 0 || asked >= SPECEE_N_GRAMMAR_TYPES) {
            specee_fail("unknown grammar_type %d", asked);
        }
        if (schema) {
            if (asked != SPECEE_GRAMMAR_NONE && asked != SPECEE_GRAMMAR_JSON_SCHEMA) {
                specee_fail("json_schema is a JSON Schema, not grammar_type %s", specee_grammar_type_names[asked]);
            }
            return (int32_t) SPECEE_GRAMMAR_JSON_SCHEMA;
        }
        if (asked == SPECEE_GRAMMAR_JSON_SCHEMA) {
            specee_fail("grammar_type json_schema: give the schema as one (--json-schema or --json-schema-file; "
                        "Python: json_schema=)");
        }
        return asked == SPECEE_GRAMMAR_NONE ? (int32_t) SPECEE_GRAMMAR_GBNF : asked;
    });
}

// ---- the table ---------------------------------------------------------------------------------------

struct grammar_limit {
    const char * name;
    int64_t      value;
    const char * help;
};

static grammar_limit LIMITS[] = {
    {"max_bytes", 256 * 1024, "bytes of a grammar's or a JSON schema's text"},
    {"max_depth", 64, "nesting: a JSON schema's levels of objects and arrays, a grammar's groups"},
    {"max_rules", 1024, "rules of a GBNF or Lark grammar"},
    {"max_alternatives", 8192, "alternatives in all: '|' in a grammar, items of anyOf / oneOf / allOf / enum"},
    {"max_refs", 512, "\"$ref\"s in a JSON schema"},
    {"max_repeat", 10000, "a repetition's bound: {m,n} and ~ m..n, minItems / maxItems, minLength / maxLength, ..."},
    {"compile_ms", 3000, "milliseconds one compile may take (on a worker thread; then it is abandoned)"},
    {"compile_mb", 256, "MiB the process may grow by while one grammar compiles"},
    {"cache_entries", 64, "compiled grammars kept by their text (failures too), the least recently used dropped"},
    {"cache_mb", 16, "MiB the kept compiled grammars and their texts may hold, all together"},
};

static constexpr int32_t N_LIMITS = (int32_t) (sizeof(LIMITS) / sizeof(LIMITS[0]));

int64_t specee_grammar_limit_of(const char * name) {
    for (const grammar_limit & l : LIMITS) {
        if (name && strcmp(l.name, name) == 0) {
            return l.value;
        }
    }
    specee_fail("grammar limits: no limit '%s'", name ? name : "");
}

extern "C" int32_t specee_grammar_limit_count(void) { return N_LIMITS; }

extern "C" const char * specee_grammar_limit_name(int32_t i) { return i >= 0 && i < N_LIMITS ? LIMITS[i].name : nullptr; }

extern "C" const char * specee_grammar_limit_help(int32_t i) { return i >= 0 && i < N_LIMITS ? LIMITS[i].help : nullptr; }

extern "C" int64_t specee_grammar_limit(const char * name) {
    return specee_guard<int64_t>(-1, [&] { return specee_grammar_limit_of(name); });
}

extern "C" int32_t specee_grammar_set_limit(const char * name, int64_t value) {
    return specee_guard<int32_t>(-1, [&] {
        specee_grammar_limit_of(name); // the name is known
        if (value < 1) {
            specee_fail("grammar limits: %s must be >= 1, not %lld", name, (long long) value);
        }
        for (grammar_limit & l : LIMITS) {
            if (strcmp(l.name, name) == 0) {
                l.value = value;
            }
        }
        return 0;
    });
}

// ---- the screen --------------------------------------------------------------------------------------

namespace {

struct counts {
    int64_t depth        = 0; // deepest nesting seen
    int64_t rules        = 0;
    int64_t alternatives = 0;
    int64_t refs         = 0;
    int64_t repeat       = 0; // largest repetition bound
};

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

bool is_ident(char c) { return isalnum((unsigned char) c) || c == '_' || c == '-' || c == '.'; }

// the numbers of a repetition's bound from text[i] on (digits, commas, dots, spaces; stops at anything else): the
// largest, saturated
int64_t bound_at(const std::string & s, size_t i) {
    int64_t best = 0, cur = 0;
    for (; i < s.size() && (isdigit((unsigned char) s[i]) || s[i] == ',' || s[i] == '.' || is_ws(s[i])); ++i) {
        if (isdigit((unsigned char) s[i])) {
            cur = std::min<int64_t>(cur * 10 + (s[i] - '0'), INT64_C(1) << 40);
            best = std::max(best, cur);
        } else {
            cur = 0;
        }
    }
    return best;
}

// the end of a quoted string starting at s[i] (the quote), escapes skipped
size_t skip_quoted(const std::string & s, size_t i) {
    const char q = s[i];
    for (++i; i < s.size() && s[i] != q; ++i) {
        if (s[i] == '\\') {
            ++i;
        }
    }
    return i; // at the closing quote (or the end)
}

// the repetition bounds of a regular expression in s[b, e): {m,n} outside character classes
void scan_regex_bounds(const std::string & s, size_t b, size_t e, counts & c) {
    bool in_class = false;
    for (size_t i = b; i < e; ++i) {
        if (s[i] == '\\') {
            ++i;
        } else if (s[i] == '[') {
            in_class = true;
        } else if (s[i] == ']') {
            in_class = false;
        } else if (!in_class && s[i] == '{') {
            c.repeat = std::max(c.repeat, bound_at(s, i + 1));
        } else if (!in_class && s[i] == '|') {
            c.alternatives += 1;
        }
    }
}

const char * const ALTERNATIVE_KEYS[] = {"anyOf", "oneOf", "allOf", "enum", "prefixItems"};
const char * const REPEAT_KEYS[]      = {"minItems",      "maxItems",      "minLength",   "maxLength",
                                         "minProperties", "maxProperties", "minContains", "maxContains"};

template <size_t N> bool one_of(const std::string & s, size_t b, size_t e, const char * const (&names)[N]) {
    for (const char * n : names) {
        if (e - b == strlen(n) && s.compare(b, e - b, n) == 0) {
            return true;
        }
    }
    return false;
}

// A JSON schema, by its tokens: nesting, "$ref" keys, the items of alternatives' arrays, repetition keywords' numbers
// and the bounds in "pattern" strings. Malformed JSON is left to the engine.
void scan_json(const std::string & s, counts & c) {
    std::vector<char> stack; // 'o' object, 'a' array, 'A' an array of alternatives
    size_t            key_b = 0, key_e = 0; // the key whose value comes next (empty: none)
    for (size_t i = 0; i < s.size(); ++i) {
        const char ch = s[i];
        if (ch == '"') {
            const size_t e    = skip_quoted(s, i);
            size_t       next = e + 1;
            while (next < s.size() && is_ws(s[next])) {
                ++next;
            }
            if (next < s.size() && s[next] == ':' && !stack.empty() && stack.back() == 'o') { // a key
                key_b = i + 1, key_e = e;
                c.refs += (e - i - 1 == 4 && s.compare(i + 1, 4, "$ref") == 0);
                i = next;
                continue;
            }
            if (key_e - key_b == 7 && s.compare(key_b, 7, "pattern") == 0) {
                scan_regex_bounds(s, i + 1, std::min(e, s.size()), c);
            }
            key_b = key_e = 0;
            i             = e;
        } else if (ch == '{' || ch == '[') {
            const bool alt = ch == '[' && one_of(s, key_b, key_e, ALTERNATIVE_KEYS);
            stack.push_back(ch == '{' ? 'o' : alt ? 'A' : 'a');
            c.depth = std::max(c.depth, (int64_t) stack.size());
            if (alt) {
                size_t next = i + 1;
                while (next < s.size() && is_ws(s[next])) {
                    ++next;
                }
                c.alternatives += next < s.size() && s[next] != ']';
            }
            key_b = key_e = 0;
        } else if (ch == '}' || ch == ']') {
            if (!stack.empty()) {
                stack.pop_back();
            }
        } else if (ch == ',') {
            c.alternatives += !stack.empty() && stack.back() == 'A';
            key_b = key_e = 0;
        } else if ((isdigit((unsigned char) ch) || ch == '-') && one_of(s, key_b, key_e, REPEAT_KEYS)) {
            const double v = strtod(s.c_str() + i, nullptr);
            c.repeat       = std::max(c.repeat, v >= 1e12 ? INT64_C(1) << 40 : (int64_t) std::max(v, 0.0));
            key_b = key_e = 0;
        }
    }
}

// A GBNF, Lark or regex grammar, by its tokens: strings, character classes (GBNF, regex) and /regexes/ (Lark) are
// skipped but for their bounds; groups nest; '|' separates alternatives; {m,n} and ~ m..n are bounds; `name ::=`
// (GBNF) and `name:` at a line's start (Lark) are rules. Lark's %json { ... } is read as JSON.
void scan_grammar(int32_t type, const std::string & s, counts & c) {
    const bool lark  = type == SPECEE_GRAMMAR_LARK;
    const bool regex = type == SPECEE_GRAMMAR_REGEX;
    int64_t    depth = 0;
    bool       line_start = true;
    for (size_t i = 0; i < s.size(); ++i) {
        const char ch = s[i];
        if (ch == '\n') {
            line_start = true;
            continue;
        }
        if (line_start && lark && (isalpha((unsigned char) ch) || ch == '_' || ch == '?' || ch == '!')) {
            size_t e = i + 1;
            while (e < s.size() && (is_ident(s[e]) || s[e] == '{' || s[e] == '}' || s[e] == ',')) {
                ++e;
            }
            while (e < s.size() && (s[e] == ' ' || s[e] == '\t')) {
                ++e;
            }
            c.rules += e < s.size() && s[e] == ':' && (e + 1 >= s.size() || s[e + 1] != ':');
        }
        line_start = line_start && is_ws(ch);
        if (regex && ch == '\\') {
            ++i;
        } else if (!regex && (ch == '"' || (lark && ch == '\''))) {
            i = skip_quoted(s, i);
        } else if (!regex && (ch == '#' || (lark && ch == '/' && i + 1 < s.size() && s[i + 1] == '/'))) {
            while (i + 1 < s.size() && s[i + 1] != '\n') {
                ++i;
            }
        } else if (lark && ch == '/') {
            const size_t e = skip_quoted(s, i);
            scan_regex_bounds(s, i + 1, std::min(e, s.size()), c);
            i = e;
        } else if (lark && s.compare(i, 5, "%json") == 0) {
            size_t b = s.find('{', i), d = 0, e = b;
            for (; e < s.size(); ++e) { // the JSON object's extent, strings skipped
                e = s[e] == '"' ? skip_quoted(s, e) : e;
                d += e < s.size() && s[e] == '{';
                d -= e < s.size() && s[e] == '}' && d > 0;
                if (e < s.size() && s[e] == '}' && d == 0) {
                    break;
                }
            }
            if (b != std::string::npos) {
                counts j;
                scan_json(s.substr(b, e + 1 - b), j);
                c.depth = std::max(c.depth, depth + j.depth);
                c.refs += j.refs, c.alternatives += j.alternatives, c.repeat = std::max(c.repeat, j.repeat);
                i = std::min(e, s.size());
            }
        } else if (!lark && ch == '[') { // a character class
            for (++i; i < s.size() && s[i] != ']'; ++i) {
                i += s[i] == '\\';
            }
        } else if (ch == '(' || (lark && ch == '[')) {
            c.depth = std::max(c.depth, ++depth);
        } else if (ch == ')' || (lark && ch == ']')) {
            depth -= depth > 0;
        } else if (ch == '|') {
            c.alternatives += 1;
        } else if (ch == '{' || (lark && ch == '~')) {
            c.repeat = std::max(c.repeat, bound_at(s, i + 1));
        } else if (!lark && !regex && s.compare(i, 3, "::=") == 0) {
            c.rules += 1;
            i += 2;
        }
    }
}

[[noreturn]] void refuse(const char * what, const char * limit) {
    specee_fail("%s (the grammar limit %s is %lld)", what, limit, (long long) specee_grammar_limit_of(limit));
}

} // namespace

void specee_grammar_screen(int32_t type, const char * text) {
    const char * kind = specee_grammar_type_name(type);
    const size_t n    = text ? strlen(text) : 0;
    char         what[160];
    if ((int64_t) n > specee_grammar_limit_of("max_bytes")) {
        snprintf(what, sizeof(what), "%s: %zu bytes, too large", kind, n);
        refuse(what, "max_bytes");
    }
    const std::string s(text ? text : "", n);
    counts            c;
    if (type == SPECEE_GRAMMAR_JSON_SCHEMA) {
        scan_json(s, c);
    } else {
        scan_grammar(type, s, c);
    }
    const struct {
        int64_t      n;
        const char * limit;
        const char * what;
    } checks[] = {
        {c.depth, "max_depth", "nested %lld levels deep, too deep"},
        {c.rules, "max_rules", "%lld rules, too many"},
        {c.alternatives, "max_alternatives", "%lld alternatives, too many"},
        {c.refs, "max_refs", "%lld $refs, too many"},
        {c.repeat, "max_repeat", "a repetition bound of %lld, too large"},
    };
    for (const auto & k : checks) {
        if (k.n > specee_grammar_limit_of(k.limit)) {
            char part[96];
            snprintf(part, sizeof(part), k.what, (long long) k.n);
            snprintf(what, sizeof(what), "%s: %s", kind, part);
            refuse(what, k.limit);
        }
    }
}
