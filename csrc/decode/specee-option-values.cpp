// specee-option-values.cpp: a value held to its row of an option table (specee-options.cpp), in and out of text.
//
// The checks that need no model: a value set in the struct held to its row's columns (range, unset mark, names, list
// length), for the generation options (specee_generator_check_values; the generator adds the model's) and the
// sampler's parameters alone (specee_sampler_check_params); the text form every frontend sets both tables with (the
// CLI's flags, Python's GenerateOptions and Model, specee-bench, specee-server, the evaluations), and reads back.
#include "specee-impl.h"
#include "specee-lora.h"
#include "specee-option-values.h"
#include "specee-options.h"
#include "specee-tree-choices.h"
#include "specee.h"

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

static const specee_option_row * find_option(specee_option_table table, const char * name) {
    for (int32_t i = 0; name && i < table.n; ++i) {
        if (strcmp(table.rows[i].info.name, name) == 0) {
            return &table.rows[i];
        }
    }
    return nullptr;
}

static int32_t index_of(const char * const * names, int32_t n, const char * name) {
    for (int32_t i = 0; name && i < n; ++i) {
        if (strcmp(name, names[i]) == 0) {
            return i;
        }
    }
    return -1;
}

// ---- checks that need no model --------------------------------------------------------------------------

static int32_t floats_cap(const specee_option_row & o) { return o.cap > 0 ? o.cap : SPECEE_MAX_DEVICES; }

// x in the row's range: [lo, hi] without the ends `open` excludes (NAN never)
static bool in_range(const specee_option_row & o, double x) {
    return ((o.open & SPECEE_OPEN_LO) ? x > o.lo : x >= o.lo) && ((o.open & SPECEE_OPEN_HI) ? x < o.hi : x <= o.hi);
}

static std::string choices_text(const specee_option_row & o) {
    if (o.n_names == 2) {
        return std::string("'") + o.names[0] + "' or '" + o.names[1] + "'";
    }
    std::string s = "one of ";
    for (int32_t i = 0; i < o.n_names; ++i) {
        s += (i ? ", " : "") + std::string(o.names[i]);
    }
    return s;
}

// a value as set in the struct (not from text) held to its row: a number in the row's range (or its unset mark), a
// choice one of its names, a list's items in the range and at most as many as it holds. The table's columns are the
// one place a range is written: setting from text reads them too (set_value).
static void check_row(const char * base, const specee_option_row & o) {
    const char * f = base + o.offset;
    if (o.info.type == SPECEE_OPTION_INT || o.info.type == SPECEE_OPTION_FLOAT) {
        if (strcmp(o.info.name, "seed") == 0) { // every uint32_t is a seed (SPECEE_DEFAULT_SEED: random)
            return;
        }
        // each as a double (a ?: of int32_t and float would round the integer to a float: 2**31-1 to 2**31)
        const double x = o.info.type == SPECEE_OPTION_INT ? (double) *(const int32_t *) f : (double) *(const float *) f;
        if (!in_range(o, x) && !(x == o.unset)) { // NAN too
            specee_fail("%s must be %s, got %g", o.info.name, o.info.expect, x);
        }
    } else if (o.info.type == SPECEE_OPTION_CHOICE) {
        const int32_t k = *(const int32_t *) f;
        if (k < 0 || k >= o.n_names) {
            specee_fail("%s must be %s, got %d", o.info.name, choices_text(o).c_str(), k);
        }
    } else if (o.info.type == SPECEE_OPTION_LIST || o.info.type == SPECEE_OPTION_FLOATS) {
        const bool    ints = o.info.type == SPECEE_OPTION_LIST;
        const int32_t n    = *(const int32_t *) (base + o.count_offset);
        const int32_t cap  = ints ? SPECEE_MAX_EXIT_LAYERS : floats_cap(o);
        if (n < 0 || n > cap) {
            specee_fail("%s: %d values (0..%d)", o.info.name, n, cap);
        }
        for (int32_t i = 0; i < n; ++i) {
            const double x = ints ? (double) ((const int32_t *) f)[i] : (double) ((const float *) f)[i];
            if (!in_range(o, x)) {
                specee_fail("%s must be %s, got %g", o.info.name, o.info.expect, x);
            }
        }
    }
}

void specee_generator_check_values(const specee_generator_params & p) {
    const specee_option_table t = specee_generator_option_table();
    for (int32_t i = 0; i < t.n; ++i) {
        check_row((const char *) &p, t.rows[i]);
    }
    if (memchr(p.eagle.choices, '\0', sizeof(p.eagle.choices)) == nullptr) {
        specee_fail("eagle choices: the text is not terminated");
    }
    if (p.eagle.choices[0]) {
        specee_tree_count_choices(p.eagle.choices); // throws with the reason
    }
    if (memchr(p.logit_bias, '\0', sizeof(p.logit_bias)) == nullptr) {
        specee_fail("logit_bias: the text is not terminated");
    }
    specee_parse_logit_bias(p.logit_bias); // throws with the item that is not TOKEN(+|-)BIAS
    // what no row says alone (n_min <= n_max and a rate per drafted token are the generator's: check_params)
    for (int32_t i = 1; i < p.draft.n_synth_rates; ++i) {
        if (p.draft.synth_rates[i] > p.draft.synth_rates[i - 1]) {
            specee_fail("draft synth_rates: the rates must be non-increasing, got %g after %g",
                        (double) p.draft.synth_rates[i], (double) p.draft.synth_rates[i - 1]);
        }
    }
}

// a sampler made alone (specee_sampler_init) held to the same rows: those inside specee_generator_params::sampling
void specee_sampler_check_params(const specee_sampler_params & params) {
    specee_generator_params p;
    memset(&p, 0, sizeof(p));
    p.sampling                = params;
    const size_t              at = offsetof(specee_generator_params, sampling);
    const specee_option_table t  = specee_generator_option_table();
    for (int32_t i = 0; i < t.n; ++i) {
        if (t.rows[i].offset >= at && t.rows[i].offset < at + sizeof(params)) {
            check_row((const char *) &p, t.rows[i]);
        }
    }
}

std::vector<std::pair<int32_t, float>> specee_parse_logit_bias(const char * text) {
    std::vector<std::pair<int32_t, float>> out;
    const std::string                      all(text ? text : "");
    for (size_t a = 0; a < all.size();) {
        size_t            b    = all.find(',', a);
        const std::string item = all.substr(a, b == std::string::npos ? std::string::npos : b - a);
        a                      = b == std::string::npos ? all.size() : b + 1;
        const size_t      sign = item.find_first_of("+-", 1);
        char *            end  = nullptr;
        const long        tok  = sign == std::string::npos ? -1 : strtol(item.c_str(), &end, 10);
        if (tok < 0 || tok > INT32_MAX || end != item.c_str() + sign) {
            specee_fail("logit_bias: '%s' is not TOKEN(+|-)BIAS, e.g. 15043+1 or 2-inf", item.c_str());
        }
        const std::string value = item.substr(sign + 1);
        float             bias  = 0.0f;
        if (value == "inf") {
            bias = INFINITY;
        } else {
            bias = strtof(value.c_str(), &end);
            if (value.empty() || *end != '\0' || !std::isfinite(bias)) {
                specee_fail("logit_bias: '%s' is not TOKEN(+|-)BIAS, e.g. 15043+1 or 2-inf", item.c_str());
            }
        }
        out.emplace_back((int32_t) tok, item[sign] == '-' ? -bias : bias);
    }
    return out;
}

// ---- text in -------------------------------------------------------------------------------------------

static bool parse_number(const char * v, double & out) {
    errno      = 0;
    char * end = nullptr;
    out        = strtod(v, &end);
    return *v && *end == '\0' && errno != ERANGE && !std::isnan(out);
}

static bool parse_bool(const char * v, bool & out) {
    for (const char * t : {"true", "1", "on"}) {
        if (strcmp(v, t) == 0) {
            return out = true;
        }
    }
    for (const char * f : {"false", "0", "off"}) {
        if (strcmp(v, f) == 0) {
            out = false;
            return true;
        }
    }
    return false;
}

// "16,20,24" into at most SPECEE_MAX_EXIT_LAYERS integers in the row's range
static bool parse_list(const char * v, int32_t * out, int32_t & n, const specee_option_row & o) {
    n = 0;
    for (const char * s = v;;) {
        char *     end = nullptr;
        errno          = 0;
        const long x   = strtol(s, &end, 10);
        if (end == s || errno == ERANGE || !in_range(o, (double) x) || n == SPECEE_MAX_EXIT_LAYERS || *s == '+' ||
            *s == ' ') {
            return false;
        }
        out[n++] = (int32_t) x;
        if (*end == '\0') {
            return true;
        }
        if (*end != ',') {
            return false;
        }
        s = end + 1;
    }
}

// "3,1" into at most the row's cap of finite numbers in its range
static bool parse_floats(const char * v, float * out, int32_t & n, const specee_option_row & o) {
    const int32_t cap = floats_cap(o);
    n                 = 0;
    for (const char * s = v;;) {
        const char * end = strchr(s, ',');
        std::string  item(s, end ? (size_t) (end - s) : strlen(s));
        double       x = 0.0;
        if (n == cap || !parse_number(item.c_str(), x) || !std::isfinite(x) || !in_range(o, x)) {
            return false;
        }
        out[n++] = (float) x;
        if (!end) {
            return true;
        }
        s = end + 1;
    }
}

[[noreturn]] static void refuse(const specee_option_row & o, const char * v) {
    if (o.info.type == SPECEE_OPTION_CHOICE) {
        specee_fail("%s must be %s, not '%s'", o.info.name, choices_text(o).c_str(), v);
    }
    if (strcmp(o.info.name, "seed") == 0) {
        specee_fail("seed must be -1 (random) or in 0..2**32-1, not '%s'", v);
    }
    // an integer past a limit: the limit passed said (and the whole range where it has two ends)
    double     x      = 0.0;
    const bool number = o.info.type == SPECEE_OPTION_INT && parse_number(v, x);
    const bool above = number && x > o.hi, below = number && x < o.lo;
    if (above || below || (o.info.type == SPECEE_OPTION_INT && o.lo > INT_MIN && o.hi == INT_MAX)) {
        const bool        both  = o.lo > INT_MIN && o.hi < INT_MAX;
        const std::string range = both ? std::string(" (") + o.info.expect + ")" : "";
        specee_fail("%s must be %s %.0f%s, not '%s'", o.info.name, above ? "at most" : ">=", above ? o.hi : o.lo,
                    range.c_str(), v);
    }
    specee_fail("%s must be %s, not '%s'", o.info.name, o.info.expect, v);
}

// a value into the struct at `base` (specee_generator_params or specee_context_options); throws when refused
static void set_value(char * base, const specee_option_row & o, const char * v) {
    char * field = base + o.offset;
    double x     = 0.0;
    bool   b     = false;
    switch (o.info.type) {
        case SPECEE_OPTION_INT:
            if (!parse_number(v, x) || x != std::floor(x) || !in_range(o, x)) {
                refuse(o, v);
            }
            if (strcmp(o.info.name, "seed") == 0) {
                *(uint32_t *) field = x < 0 ? SPECEE_DEFAULT_SEED : (uint32_t) x;
            } else {
                *(int32_t *) field = (int32_t) x;
            }
            break;
        case SPECEE_OPTION_FLOAT:
            if (!parse_number(v, x) || !in_range(o, x)) {
                refuse(o, v);
            }
            *(float *) field = (float) x;
            break;
        case SPECEE_OPTION_BOOL:
            if (!parse_bool(v, b)) {
                refuse(o, v);
            }
            *(bool *) field = b;
            break;
        case SPECEE_OPTION_CHOICE: {
            const int32_t k = index_of(o.names, o.n_names, v);
            if (k < 0) {
                refuse(o, v);
            }
            *(int32_t *) field = k;
            break;
        }
        case SPECEE_OPTION_TEXT: {
            const bool        more = o.info.repeatable && field[0] && v[0]; // a list set again: extended
            const std::string text = more ? std::string(field) + "," + v : std::string(v);
            if (text.size() >= SPECEE_MAX_CHOICES) {
                specee_fail("%s is longer than %d bytes", o.info.name, SPECEE_MAX_CHOICES - 1);
            }
            if (o.info.repeatable && !specee_lora_list_parse(v, strcmp(o.info.name, "lora_scaled") == 0)) {
                refuse(o, v);
            }
            snprintf(field, SPECEE_MAX_CHOICES, "%s", text.c_str());
            break;
        }
        case SPECEE_OPTION_LIST:
            if (!parse_list(v, (int32_t *) field, *(int32_t *) (base + o.count_offset), o)) {
                refuse(o, v);
            }
            break;
        case SPECEE_OPTION_FLOATS:
            if (!parse_floats(v, (float *) field, *(int32_t *) (base + o.count_offset), o)) {
                refuse(o, v);
            }
            break;
    }
}

static size_t field_size(const specee_option_row & o) {
    switch (o.info.type) {
        case SPECEE_OPTION_TEXT: return SPECEE_MAX_CHOICES;
        case SPECEE_OPTION_LIST: return sizeof(int32_t) * SPECEE_MAX_EXIT_LAYERS;
        case SPECEE_OPTION_FLOATS: return sizeof(float) * floats_cap(o);
        case SPECEE_OPTION_BOOL: return sizeof(bool);
        default: return 4;
    }
}

// option `name` of `table` in *p set from text ("" or NULL: the default's value), then the whole struct checked by
// `check`; p is unchanged when anything is refused
template <typename T>
static int32_t set_option(specee_option_table table, T * p, const char * name, const char * value,
                          const char * what, T (*defaults)(), void (*check)(const T &)) {
    return specee_guard<int32_t>(-1, [&] {
        const specee_option_row * o = find_option(table, name);
        if (!p || !o) {
            specee_fail("unknown %s option '%s'", what, name ? name : "(null)");
        }
        T q = *p;
        if (!value || !*value) { // the default
            const T d = defaults();
            memcpy((char *) &q + o->offset, (const char *) &d + o->offset, field_size(*o));
            if (o->count_offset) {
                *(int32_t *) ((char *) &q + o->count_offset) = 0;
            }
        } else {
            set_value((char *) &q, *o, value);
        }
        if (check) {
            check(q);
        }
        *p = q;
        return 0;
    });
}

extern "C" int32_t specee_generator_params_set(struct specee_generator_params * p, const char * name,
                                               const char * value) {
    return set_option(specee_generator_option_table(), p, name, value, "generation", specee_generator_default_params,
                      specee_generator_check_values);
}

extern "C" int32_t specee_context_options_set(struct specee_context_options * o, const char * name,
                                              const char * value) {
    return set_option<specee_context_options>(specee_context_option_table(), o, name, value, "context",
                                              specee_context_options_default, nullptr);
}

// ---- text out ------------------------------------------------------------------------------------------

// the shortest text that reads back as the same float
static std::string float_text(float x) {
    char b[64];
    for (int digits = 6; digits <= 9; ++digits) {
        snprintf(b, sizeof(b), "%.*g", digits, (double) x);
        if (strtof(b, nullptr) == x) {
            break;
        }
    }
    return b;
}

// a value's text; "" for a number outside the range of explicit values (the default's mark: 0 trees, threshold -1)
static std::string value_text(const char * base, const specee_option_row & o) {
    const char * field = base + o.offset;
    switch (o.info.type) {
        case SPECEE_OPTION_INT: {
            if (strcmp(o.info.name, "seed") == 0) {
                const uint32_t s = *(const uint32_t *) field;
                return s == SPECEE_DEFAULT_SEED ? "-1" : std::to_string(s);
            }
            const int32_t v = *(const int32_t *) field;
            return in_range(o, v) ? std::to_string(v) : "";
        }
        case SPECEE_OPTION_FLOAT: {
            const float v = *(const float *) field;
            return in_range(o, v) ? float_text(v) : "";
        }
        case SPECEE_OPTION_BOOL: return *(const bool *) field ? "true" : "false";
        case SPECEE_OPTION_CHOICE: {
            const int32_t k = *(const int32_t *) field;
            return k >= 0 && k < o.n_names ? o.names[k] : "?";
        }
        case SPECEE_OPTION_TEXT: return field;
        case SPECEE_OPTION_LIST: {
            const int32_t n = *(const int32_t *) (base + o.count_offset);
            std::string   s;
            for (int32_t i = 0; i < n; ++i) {
                s += (i ? "," : "") + std::to_string(((const int32_t *) field)[i]);
            }
            return s;
        }
        case SPECEE_OPTION_FLOATS: {
            const int32_t n = *(const int32_t *) (base + o.count_offset);
            std::string   s;
            for (int32_t i = 0; i < n; ++i) {
                s += (i ? "," : "") + float_text(((const float *) field)[i]);
            }
            return s;
        }
    }
    return "";
}

static int32_t get_option(specee_option_table table, const char * base, const char * name, char * buf,
                          int32_t len) {
    const specee_option_row * o = find_option(table, name);
    if (!base || !o) {
        return INT32_MIN;
    }
    const std::string s = value_text(base, *o);
    if ((int32_t) s.size() >= len || !buf) {
        return -(int32_t) s.size() - 1;
    }
    memcpy(buf, s.c_str(), s.size() + 1);
    return (int32_t) s.size();
}

extern "C" int32_t specee_generator_params_get(const struct specee_generator_params * p, const char * name, char * buf,
                                               int32_t len) {
    return get_option(specee_generator_option_table(), (const char *) p, name, buf, len);
}

extern "C" int32_t specee_context_options_get(const struct specee_context_options * o, const char * name, char * buf,
                                              int32_t len) {
    return get_option(specee_context_option_table(), (const char *) o, name, buf, len);
}
