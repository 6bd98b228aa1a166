// specee-unicode.cpp: UTF-8, category lookup, the GPT-2 byte mapping and the BPE pre-tokenizer regexes
#include "specee-unicode.h"

#include <algorithm>
#include <cstring>

// ---- code points -------------------------------------------------------------------------------

uint8_t specee_unicode_flags(uint32_t cpt) {
    // the last range starting at or before cpt
    const specee_unicode_range * begin = specee_unicode_ranges;
    const specee_unicode_range * end   = specee_unicode_ranges + specee_unicode_n_ranges;
    const specee_unicode_range * it =
        std::upper_bound(begin, end, cpt, [](uint32_t c, const specee_unicode_range & r) { return c < r.first; });
    return it == begin ? 0 : (it - 1)->flags;
}

size_t specee_utf8_decode(const char * s, size_t n, uint32_t & cpt) {
    const uint8_t c = (uint8_t) s[0];
    size_t        len;
    uint32_t      min;
    if (c < 0x80) {
        cpt = c;
        return 1;
    } else if ((c & 0xE0) == 0xC0) {
        len = 2, min = 0x80, cpt = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
        len = 3, min = 0x800, cpt = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
        len = 4, min = 0x10000, cpt = c & 0x07;
    } else {
        cpt = 0xFFFD; // a continuation byte or 0xF8..0xFF
        return 1;
    }
    bool ok = len <= n;
    for (size_t i = 1; ok && i < len; ++i) {
        ok  = ((uint8_t) s[i] & 0xC0) == 0x80;
        cpt = (cpt << 6) | ((uint8_t) s[i] & 0x3F);
    }
    // overlong forms, surrogates and values past U+10FFFF are invalid too
    if (!ok || cpt < min || cpt > 0x10FFFF || (cpt >= 0xD800 && cpt <= 0xDFFF)) {
        cpt = 0xFFFD;
        return 1;
    }
    return len;
}

std::string specee_utf8_encode(uint32_t cpt) {
    if (cpt < 0x80) {
        return std::string(1, (char) cpt);
    }
    const int   n = cpt < 0x800 ? 2 : cpt < 0x10000 ? 3 : 4; // bytes; the first carries n high bits
    std::string s(n, '\0');
    for (int i = n - 1; i > 0; --i, cpt >>= 6) {
        s[i] = (char) (0x80 | (cpt & 0x3F));
    }
    s[0] = (char) ((0xF00 >> n) | cpt);
    return s;
}

// ---- GPT-2 byte mapping ------------------------------------------------------------------------
// Printable Latin-1 bytes stand for themselves; the 68 others (controls, space, 0x7F..0xA0, soft
// hyphen) take the code points 256, 257, ... in byte order, so every byte is a visible character.

struct byte_map {
    uint32_t to_cpt[256];
    int16_t  to_byte[256 + 68];
};

static const byte_map & get_byte_map() {
    static const byte_map m = [] {
        byte_map r;
        uint32_t next = 256;
        std::fill(r.to_byte, r.to_byte + 256 + 68, (int16_t) -1);
        for (int b = 0; b < 256; ++b) {
            const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
            r.to_cpt[b]             = printable ? (uint32_t) b : next++;
            r.to_byte[r.to_cpt[b]] = (int16_t) b;
        }
        return r;
    }();
    return m;
}

uint32_t specee_byte_to_cpt(uint8_t byte) { return get_byte_map().to_cpt[byte]; }

int specee_cpt_to_byte(uint32_t cpt) { return cpt < 256 + 68 ? get_byte_map().to_byte[cpt] : -1; }

// ---- pre-tokenizers ----------------------------------------------------------------------------
// Each regex is a matcher: given a piece [pos, end) of code points it returns the end of the match at
// pos (always > pos). Alternatives are tried in the regex's order, as a backtracking engine would;
// text no alternative matches (the "gaps" of a split regex) comes back as a piece of its own. The
// pre-tokenizers apply their regexes one after the other, each within the pieces of the previous one.

struct utext {
    std::vector<uint32_t> cpt;
    std::vector<uint8_t>  flags;
    std::vector<size_t>   offs; // byte offset of each code point, then the text's length
};

typedef size_t (*match_fn)(const utext & t, size_t pos, size_t end);

static bool is_letter(uint8_t f) { return f & SPECEE_UFLAG_LETTER; }
static bool is_number(uint8_t f) { return f & SPECEE_UFLAG_NUMBER; }
static bool is_space(uint8_t f) { return f & SPECEE_UFLAG_WHITESPACE; }
// [^\s\p{L}\p{N}] (unassigned code points included)
static bool is_other(uint8_t f) { return !(f & (SPECEE_UFLAG_WHITESPACE | SPECEE_UFLAG_LETTER | SPECEE_UFLAG_NUMBER)); }
static bool is_newline(uint32_t c) { return c == '\r' || c == '\n'; }

// 's|'t|'re|'ve|'m|'ll|'d (any_case: (?i:...)); returns pos when none matches
static size_t match_contraction(const utext & t, size_t pos, size_t end, bool any_case) {
    if (t.cpt[pos] != '\'' || pos + 1 >= end) {
        return pos;
    }
    auto lower = [&](size_t i) { return any_case && t.cpt[i] >= 'A' && t.cpt[i] <= 'Z' ? t.cpt[i] + 32 : t.cpt[i]; };
    const uint32_t a = lower(pos + 1);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') {
        return pos + 2;
    }
    if (pos + 2 < end) {
        const uint32_t b = lower(pos + 2);
        if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) {
            return pos + 3;
        }
    }
    return pos;
}

// \s+(?!\S)|\s+ at a whitespace code point: a run followed by a non-space leaves its last space to it
static size_t match_spaces(const utext & t, size_t pos, size_t end) {
    size_t e = pos;
    while (e < end && is_space(t.flags[e])) {
        e++;
    }
    return (e < end && e - pos > 1) ? e - 1 : e;
}

// the class ' ?\p{L}+', ' ?\p{N}+' and ' ?[^\s\p{L}\p{N}]+' tell apart (0: whitespace)
static int word_class(uint8_t f) { return is_letter(f) ? 1 : is_number(f) ? 2 : is_other(f) ? 3 : 0; }

// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
static size_t match_gpt2(const utext & t, size_t pos, size_t end) {
    const size_t e = match_contraction(t, pos, end, false);
    if (e > pos) {
        return e;
    }
    size_t    p   = (t.cpt[pos] == ' ' && pos + 1 < end) ? pos + 1 : pos;
    const int cls = word_class(t.flags[p]);
    if (cls == 0) {
        return match_spaces(t, pos, end);
    }
    while (p < end && word_class(t.flags[p]) == cls) {
        p++;
    }
    return p;
}

// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max_digits}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
static size_t match_llama3_like(const utext & t, size_t pos, size_t end, size_t max_digits) {
    size_t e = match_contraction(t, pos, end, true);
    if (e > pos) {
        return e;
    }
    const uint32_t c = t.cpt[pos];
    const uint8_t  f = t.flags[pos];
    size_t         p = pos;
    if (!is_letter(f) && !is_number(f) && !is_newline(c) && pos + 1 < end) {
        p = pos + 1; // the optional leading code point
    }
    if (is_letter(t.flags[p])) {
        while (p < end && is_letter(t.flags[p])) {
            p++;
        }
        return p;
    }
    if (is_number(f)) {
        for (p = pos; p < end && p < pos + max_digits && is_number(t.flags[p]); ++p) {
        }
        return p;
    }
    p = (c == ' ' && pos + 1 < end) ? pos + 1 : pos;
    if (is_other(t.flags[p])) {
        while (p < end && is_other(t.flags[p])) {
            p++;
        }
        while (p < end && is_newline(t.cpt[p])) {
            p++;
        }
        return p;
    }
    // \s*[\r\n]+: the whitespace run up to its last line break
    size_t last_nl = pos;
    for (e = pos; e < end && is_space(t.flags[e]); ++e) {
        if (is_newline(t.cpt[e])) {
            last_nl = e + 1;
        }
    }
    return last_nl > pos ? last_nl : match_spaces(t, pos, end);
}

static size_t match_llama3(const utext & t, size_t pos, size_t end) { return match_llama3_like(t, pos, end, 3); }

static size_t match_qwen2(const utext & t, size_t pos, size_t end) { return match_llama3_like(t, pos, end, 1); }

// \p{N} alone; the text between numbers is a piece
static size_t match_each_number(const utext & t, size_t pos, size_t end) {
    if (is_number(t.flags[pos])) {
        return pos + 1;
    }
    while (pos < end && !is_number(t.flags[pos])) {
        pos++;
    }
    return pos;
}

// llama.cpp's "default" regexes [\p{P}\$\+<=>\^~\|]+ and \p{N}+: a run of the class, or of the text between
static bool is_default_punct(const utext & t, size_t i) {
    const uint32_t c = t.cpt[i];
    return (t.flags[i] & SPECEE_UFLAG_PUNCTUATION) || (c > 0 && c < 0x80 && strchr("$+<=>^~|", (int) c));
}

static size_t match_punct_runs(const utext & t, size_t pos, size_t end) {
    const bool punct = is_default_punct(t, pos);
    while (pos < end && is_default_punct(t, pos) == punct) {
        pos++;
    }
    return pos;
}

static size_t match_number_runs(const utext & t, size_t pos, size_t end) {
    const bool num = is_number(t.flags[pos]);
    while (pos < end && is_number(t.flags[pos]) == num) {
        pos++;
    }
    return pos;
}

// [0-9][0-9][0-9], or the text up to the next such triple
static size_t match_digit_triples(const utext & t, size_t pos, size_t end) {
    auto triple = [&](size_t i) {
        return i + 3 <= end && std::all_of(&t.cpt[i], &t.cpt[i] + 3, [](uint32_t c) { return c >= '0' && c <= '9'; });
    };
    if (triple(pos)) {
        return pos + 3;
    }
    do {
        pos++;
    } while (pos < end && !triple(pos));
    return pos;
}

std::vector<std::string> specee_pretokenize(const std::string & text, specee_pretok kind) {
    utext t;
    for (size_t off = 0; off < text.size();) {
        uint32_t cpt;
        const size_t len = specee_utf8_decode(text.data() + off, text.size() - off, cpt);
        t.cpt.push_back(cpt);
        t.flags.push_back(specee_unicode_flags(cpt));
        t.offs.push_back(off);
        off += len;
    }
    t.offs.push_back(text.size());

    std::vector<match_fn> steps;
    switch (kind) {
        case SPECEE_PRETOK_DEFAULT:
            steps = {match_punct_runs, match_gpt2, match_number_runs, match_digit_triples};
            break;
        case SPECEE_PRETOK_GPT2:   steps = {match_gpt2}; break;
        case SPECEE_PRETOK_LLAMA3: steps = {match_llama3}; break;
        case SPECEE_PRETOK_SMOLLM: steps = {match_each_number, match_gpt2}; break;
        case SPECEE_PRETOK_QWEN2:  steps = {match_qwen2}; break;
    }

    std::vector<size_t> ends; // the end of each piece, in code points
    if (!t.cpt.empty()) {
        ends.push_back(t.cpt.size());
    }
    for (match_fn match : steps) {
        std::vector<size_t> next;
        size_t              pos = 0;
        for (size_t end : ends) {
            while (pos < end) {
                pos = match(t, pos, end);
                next.push_back(pos);
            }
        }
        ends.swap(next);
    }

    std::vector<std::string> words;
    size_t                   begin = 0;
    for (size_t end : ends) {
        words.push_back(text.substr(t.offs[begin], t.offs[end] - t.offs[begin]));
        begin = end;
    }
    return words;
}
