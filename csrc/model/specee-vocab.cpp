// specee-vocab.cpp: tokenizers (SentencePiece-style and GPT-2 byte-level BPE), special tokens, detokenizing
#include "specee-vocab.h"

#include "specee-impl.h"
#include "specee-model.h"
#include "specee-unicode.h"
#include "specee.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <memory>
#include <queue>
#include <string_view>
#include <unordered_map>

// ---- vocabulary --------------------------------------------------------------------------------

// tokenizer.ggml.token_type, as llama.cpp's converter writes it
enum token_type { TOKEN_NORMAL = 1, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE };

struct specee_token_data {
    std::string text;  // as stored in the vocabulary
    std::string piece; // the bytes it stands for (control tokens: their text)
    float       score  = 0.0f;
    int32_t     type   = TOKEN_NORMAL;
    bool        rstrip = false; // a special token that takes the whitespace after it in text
};

struct bpe_merge {
    int32_t rank, merged;
};

struct specee_vocab {
    bool          spm           = false; // SentencePiece-style ("llama"); else byte-level BPE ("gpt2")
    specee_pretok pretok        = SPECEE_PRETOK_DEFAULT;
    bool          ignore_merges = false; // Llama 3: a word that is a token is not merged
    bool          add_bos = false, add_eos = false, add_space_prefix = false;
    int32_t       bos = -1, eos = -1, eot = -1, unk = -1;

    std::vector<specee_token_data>           tokens;
    std::unordered_map<std::string, int32_t> ids;      // token text -> id
    std::unordered_map<uint64_t, bpe_merge>  merges;   // BPE: (left, right) token ids -> rank, merged token
    std::vector<int32_t>                     specials; // control, user-defined, unknown: longest text first
    std::vector<int32_t>                     eog;
    int32_t     fim[SPECEE_FIM_COUNT] = {-1, -1, -1, -1, -1, -1}; // specee.h's FIM tokens, -1: none
    int32_t     byte_ids[256];  // the token of each byte (SPM: <0xNN>, BPE: its GPT-2 character), -1 if none
    std::string byte_text[256]; // BPE: each byte as its GPT-2 character

    std::atomic<int32_t> n_refs{1}; // the model's, and those retained (specee_vocab_retain)
};

static uint64_t pair_key(int32_t left, int32_t right) { return ((uint64_t) (uint32_t) left << 32) | (uint32_t) right; }

// hidden in text unless asked for ("special")
static bool is_hidden(const specee_token_data & t) {
    return t.type == TOKEN_CONTROL || t.type == TOKEN_UNKNOWN || t.type == TOKEN_UNUSED;
}

static const std::string k_spm_space = "\xE2\x96\x81"; // U+2581, SentencePiece's visible space

static std::string replace_all(const std::string & s, const std::string & from, const std::string & to) {
    std::string out;
    size_t      pos = 0;
    for (size_t m; (m = s.find(from, pos)) != std::string::npos; pos = m + from.size()) {
        out.append(s, pos, m - pos);
        out += to;
    }
    out.append(s, pos, std::string::npos);
    return out;
}

// ---- loading -----------------------------------------------------------------------------------

static int64_t find_key(const gguf_context * g, const char * key, gguf_type type, gguf_type elem = GGUF_TYPE_COUNT) {
    const int64_t id = gguf_find_key(g, key);
    if (id >= 0 && (gguf_get_kv_type(g, id) != type || (type == GGUF_TYPE_ARRAY && gguf_get_arr_type(g, id) != elem))) {
        specee_fail("metadata key '%s' has the wrong type", key);
    }
    return id;
}

static std::string get_string(const gguf_context * g, const char * key) {
    const int64_t id = find_key(g, key, GGUF_TYPE_STRING);
    return id < 0 ? "" : gguf_get_val_str(g, id);
}

static void get_bool(const gguf_context * g, const char * key, bool & out) {
    const int64_t id = find_key(g, key, GGUF_TYPE_BOOL);
    if (id >= 0) {
        out = gguf_get_val_bool(g, id);
    }
}

// a token id key; an id outside the vocabulary is ignored with a warning (the token is then the default, or none),
// as llama.cpp does
static void get_token_id(const gguf_context * g, const char * key, size_t n_tokens, int32_t & out) {
    const int64_t id = gguf_find_key(g, key);
    if (id < 0) {
        return;
    }
    const gguf_type type = gguf_get_kv_type(g, id);
    if (type != GGUF_TYPE_UINT32 && type != GGUF_TYPE_INT32) {
        specee_fail("metadata key '%s' is not a token id", key);
    }
    const int64_t v = type == GGUF_TYPE_UINT32 ? (int64_t) gguf_get_val_u32(g, id) : gguf_get_val_i32(g, id);
    if (v >= 0 && (size_t) v < n_tokens) {
        out = (int32_t) v;
    } else {
        fprintf(stderr, "specee: warning: %s = %lld is not a token id (the vocabulary has %zu tokens), ignored\n", key,
                (long long) v, n_tokens);
    }
}

// the bytes a token stands for when detokenizing
static std::string token_piece(const specee_vocab & v, const specee_token_data & t) {
    if (t.type == TOKEN_BYTE) {
        unsigned int b = 0;
        return sscanf(t.text.c_str(), "<0x%02X>", &b) == 1 ? std::string(1, (char) b) : t.text;
    }
    if (t.type != TOKEN_NORMAL) {
        return t.text;
    }
    if (v.spm) {
        return replace_all(t.text, k_spm_space, " ");
    }
    std::string out; // GPT-2 characters back to bytes
    for (size_t off = 0; off < t.text.size();) {
        uint32_t     cpt;
        const size_t len  = specee_utf8_decode(t.text.data() + off, t.text.size() - off, cpt);
        const int    byte = specee_cpt_to_byte(cpt);
        if (byte >= 0) {
            out += (char) byte;
        } else {
            out.append(t.text, off, len);
        }
        off += len;
    }
    return out;
}

// the token list with each token's score and type (tokenizer.ggml.tokens, scores, token_type)
static void read_tokens(specee_vocab & v, const gguf_context * g, uint32_t n_vocab) {
    const int64_t kt = find_key(g, "tokenizer.ggml.tokens", GGUF_TYPE_ARRAY, GGUF_TYPE_STRING);
    if (kt < 0) {
        specee_fail("the tokenizer has no token list (tokenizer.ggml.tokens)");
    }
    const size_t  n  = gguf_get_arr_n(g, kt);
    if (n > n_vocab) {
        specee_fail("the tokenizer has %zu tokens but the model's token_embd.weight only %u rows", n, n_vocab);
    }
    const int64_t ks = find_key(g, "tokenizer.ggml.scores", GGUF_TYPE_ARRAY, GGUF_TYPE_FLOAT32);
    const int64_t ky = find_key(g, "tokenizer.ggml.token_type", GGUF_TYPE_ARRAY, GGUF_TYPE_INT32);
    if ((ks >= 0 && gguf_get_arr_n(g, ks) != n) || (ky >= 0 && gguf_get_arr_n(g, ky) != n)) {
        specee_fail("tokenizer.ggml.scores or token_type does not have one entry per token (%zu)", n);
    }
    const float *   scores = ks >= 0 ? (const float *) gguf_get_arr_data(g, ks) : nullptr;
    const int32_t * types  = ky >= 0 ? (const int32_t *) gguf_get_arr_data(g, ky) : nullptr;
    v.tokens.resize(n);
    for (size_t i = 0; i < n; ++i) {
        specee_token_data & t = v.tokens[i];
        t.text                = gguf_get_arr_str(g, kt, i);
        t.score               = scores ? scores[i] : 0.0f;
        t.type                = types ? types[i] : TOKEN_NORMAL;
        v.ids.emplace(t.text, (int32_t) i); // the first of duplicate texts wins
    }
}

// tokenizer.ggml.pre names and the rules they stand for (the names llama.cpp's converter writes for each regex);
// llama3_flags: a word that is a token is not merged, and a BOS token is added
struct pretok_name {
    const char *  name;
    specee_pretok pretok;
    bool          llama3_flags;
};
static const pretok_name k_pretok_names[] = {
    {"default", SPECEE_PRETOK_DEFAULT, false},
    {"gpt-2", SPECEE_PRETOK_GPT2, false},      {"phi-2", SPECEE_PRETOK_GPT2, false},
    {"mpt", SPECEE_PRETOK_GPT2, false},        {"olmo", SPECEE_PRETOK_GPT2, false},
    {"llama3", SPECEE_PRETOK_LLAMA3, true},    {"llama-v3", SPECEE_PRETOK_LLAMA3, true},
    {"llama-bpe", SPECEE_PRETOK_LLAMA3, true}, {"falcon3", SPECEE_PRETOK_LLAMA3, true},
    {"falcon-h1", SPECEE_PRETOK_LLAMA3, true}, {"pixtral", SPECEE_PRETOK_LLAMA3, true},
    {"lfm2", SPECEE_PRETOK_LLAMA3, true},
    {"qwen2", SPECEE_PRETOK_QWEN2, false},     {"deepseek-r1-qwen", SPECEE_PRETOK_QWEN2, false},
    {"smollm", SPECEE_PRETOK_SMOLLM, false},   {"starcoder", SPECEE_PRETOK_SMOLLM, false},
    {"refact", SPECEE_PRETOK_SMOLLM, false},   {"codeshell", SPECEE_PRETOK_SMOLLM, false},
};

extern "C" const char * specee_vocab_pre_name(int32_t i) {
    const int32_t n = (int32_t) (sizeof(k_pretok_names) / sizeof(k_pretok_names[0]));
    return i >= 0 && i < n ? k_pretok_names[i].name : nullptr;
}

// a byte-level BPE vocabulary's merges (tokenizer.ggml.merges) and pre-tokenizer (tokenizer.ggml.pre)
static void read_bpe(specee_vocab & v, const gguf_context * g) {
    const int64_t km = find_key(g, "tokenizer.ggml.merges", GGUF_TYPE_ARRAY, GGUF_TYPE_STRING);
    if (km < 0) {
        specee_fail("the BPE tokenizer has no merges (tokenizer.ggml.merges)");
    }
    // "left right" -> (left id, right id): rank and merged token; merges of non-tokens never apply
    for (size_t i = 0; i < gguf_get_arr_n(g, km); ++i) {
        const std::string merge = gguf_get_arr_str(g, km, i);
        const size_t      sp    = merge.find(' ', 1);
        if (sp == std::string::npos) {
            continue;
        }
        auto a = v.ids.find(merge.substr(0, sp)), b = v.ids.find(merge.substr(sp + 1));
        auto m = v.ids.find(merge.substr(0, sp) + merge.substr(sp + 1));
        if (a != v.ids.end() && b != v.ids.end() && m != v.ids.end()) {
            v.merges.emplace(pair_key(a->second, b->second), bpe_merge{(int32_t) i, m->second});
        }
    }
    const std::string pre = get_string(g, "tokenizer.ggml.pre");
    const pretok_name * known = nullptr;
    for (const pretok_name & k : k_pretok_names) {
        known = (pre == k.name) ? &k : known;
    }
    if (!pre.empty() && !known) {
        std::string names;
        for (const pretok_name & k : k_pretok_names) {
            names += std::string(names.empty() ? "" : ", ") + k.name;
        }
        specee_fail("unsupported pre-tokenizer '%s' (tokenizer.ggml.pre): tokenizing by other rules would give other "
                    "tokens than the model was trained on; known: %s", pre.c_str(), names.c_str());
    }
    v.pretok = known ? known->pretok : SPECEE_PRETOK_DEFAULT; // no name: llama.cpp's "default"
    if (known && known->llama3_flags) {
        v.ignore_merges = v.add_bos = true;
    }
}

// the special tokens' ids and the add_* flags the file gives (over the tokenizer's defaults)
static void read_special_ids(specee_vocab & v, const gguf_context * g) {
    const size_t n = v.tokens.size();
    get_token_id(g, "tokenizer.ggml.bos_token_id", n, v.bos);
    get_token_id(g, "tokenizer.ggml.eos_token_id", n, v.eos);
    get_token_id(g, "tokenizer.ggml.eot_token_id", n, v.eot);
    get_token_id(g, "tokenizer.ggml.unknown_token_id", n, v.unk);
    v.bos = v.bos < (int32_t) n ? v.bos : -1;
    v.eos = v.eos < (int32_t) n ? v.eos : -1;
    v.unk = v.unk < (int32_t) n ? v.unk : -1;
    get_bool(g, "tokenizer.ggml.add_bos_token", v.add_bos);
    get_bool(g, "tokenizer.ggml.add_eos_token", v.add_eos);
    get_bool(g, "tokenizer.ggml.add_space_prefix", v.add_space_prefix);
}

// end of generation: eos, eot, and the end-of-turn tokens of common chat formats (the first found in this order is
// the eot when the file names none)
static void find_end_of_generation(specee_vocab & v) {
    static const char * eog_texts[] = {"<|eot_id|>",    "<|im_end|>", "<|end|>", "<end_of_turn>",
                                       "<|endoftext|>", "<|eom_id|>", "</s>"};
    const size_t        n_eot_texts = 5; // the ones that can be the eot
    for (size_t k = 0; k < std::size(eog_texts); ++k) {
        auto it = v.ids.find(eog_texts[k]);
        if (it != v.ids.end()) {
            v.eot = v.eot < 0 && k < n_eot_texts ? it->second : v.eot;
            v.eog.push_back(it->second);
        }
    }
    for (int32_t id : {v.eos, v.eot}) {
        if (id >= 0 && std::find(v.eog.begin(), v.eog.end(), id) == v.eog.end()) {
            v.eog.push_back(id);
        }
    }
}

// ---- fill-in-the-middle tokens -----------------------------------------------------------------

// Each FIM token (specee.h's order): its name, the metadata keys that name it (the current key, then the older
// one), and the texts code models give it in their vocabularies, found when no key names it (the first in the
// vocabulary wins). Pad, repository and file separator tokens end generation.
struct fim_row {
    const char * name;
    const char * keys[2];
    const char * texts[8];
};

static const fim_row k_fim_rows[SPECEE_FIM_COUNT] = {
    {"pre", {"tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"},
     {"<|fim_prefix|>", "<fim_prefix>", "<fim-prefix>", "<PRE>", "▁<PRE>", "<｜fim▁begin｜>", "<|code_prefix|>",
      "<|prefix|>"}},
    {"suf", {"tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"},
     {"<|fim_suffix|>", "<fim_suffix>", "<fim-suffix>", "<SUF>", "▁<SUF>", "<｜fim▁hole｜>", "<|code_suffix|>",
      "<|suffix|>"}},
    {"mid", {"tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"},
     {"<|fim_middle|>", "<fim_middle>", "<fim-middle>", "<MID>", "▁<MID>", "<｜fim▁end｜>", "<|code_middle|>",
      "<|middle|>"}},
    {"pad", {"tokenizer.ggml.fim_pad_token_id", nullptr}, {"<|fim_pad|>", "<fim_pad>", "<fim-pad>", "<PAD>", "[PAD]"}},
    {"rep", {"tokenizer.ggml.fim_rep_token_id", nullptr},
     {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"}},
    {"sep", {"tokenizer.ggml.fim_sep_token_id", nullptr}, {"<|file_sep|>"}},
};

// the FIM tokens of the file's keys, else of their texts (a normal token found by its text becomes a control token,
// hidden in output as llama.cpp hides it); the ones that end generation join the eog list (after the others, whose
// order stays)
static void find_fim_tokens(specee_vocab & v, const gguf_context * g) {
    for (int k = 0; k < SPECEE_FIM_COUNT; ++k) {
        const fim_row & row = k_fim_rows[k];
        int32_t &       id  = v.fim[k];
        for (const char * key : row.keys) {
            if (key && id < 0) {
                get_token_id(g, key, v.tokens.size(), id);
            }
        }
        for (size_t i = 0; id < 0 && i < std::size(row.texts) && row.texts[i]; ++i) {
            auto it = v.ids.find(row.texts[i]);
            if (it != v.ids.end()) {
                id = it->second;
                v.tokens[id].type = v.tokens[id].type == TOKEN_NORMAL ? TOKEN_CONTROL : v.tokens[id].type;
            }
        }
        if (k >= SPECEE_FIM_PAD && id >= 0 && std::find(v.eog.begin(), v.eog.end(), id) == v.eog.end()) {
            v.eog.push_back(id);
        }
    }
}

// what tokenizing and detokenizing look up: the special tokens (longest first, which take the whitespace after them
// when the family's do), each byte's token, each token's piece
static void build_indexes(specee_vocab & v, bool special_rstrip) {
    for (int32_t i = 0; i < (int32_t) v.tokens.size(); ++i) {
        specee_token_data & t = v.tokens[i];
        if (t.type != TOKEN_CONTROL && t.type != TOKEN_USER_DEFINED && t.type != TOKEN_UNKNOWN) {
            continue;
        }
        if (!t.text.empty()) {
            v.specials.push_back(i);
            t.rstrip = special_rstrip && t.text != "<s>" && t.text != "<unk>" && t.text != "<|endoftext|>";
        }
    }
    std::stable_sort(v.specials.begin(), v.specials.end(),
                     [&](int32_t a, int32_t b) { return v.tokens[a].text.size() > v.tokens[b].text.size(); });

    for (int b = 0; b < 256; ++b) {
        char hex[8];
        snprintf(hex, sizeof(hex), "<0x%02X>", b);
        v.byte_text[b] = specee_utf8_encode(specee_byte_to_cpt((uint8_t) b));
        auto it        = v.ids.find(v.spm ? std::string(hex) : v.byte_text[b]);
        v.byte_ids[b]  = it != v.ids.end() ? it->second : -1;
    }
    for (specee_token_data & t : v.tokens) {
        t.piece = token_piece(v, t);
    }
}

specee_vocab * specee_vocab_load(const gguf_context * g, uint32_t n_vocab, bool special_rstrip) {
    const std::string model = get_string(g, "tokenizer.ggml.model");
    if (model.empty() || model == "none" || model == "no_vocab") {
        return nullptr;
    }
    if (model != "llama" && model != "gpt2") {
        specee_fail("unsupported tokenizer '%s' (tokenizer.ggml.model): this runtime reads 'llama' (SentencePiece) "
                    "and 'gpt2' (byte-level BPE) vocabularies", model.c_str());
    }
    auto           owned = std::make_unique<specee_vocab>();
    specee_vocab & v     = *owned;
    v.spm                = model == "llama";
    read_tokens(v, g, n_vocab);
    if (v.spm) {
        v.bos = 1, v.eos = 2, v.unk = 0; // SentencePiece's defaults
        v.add_bos = v.add_space_prefix = true;
    } else {
        read_bpe(v, g);
    }
    read_special_ids(v, g);
    find_end_of_generation(v);
    find_fim_tokens(v, g);
    build_indexes(v, special_rstrip);
    return owned.release();
}

specee_vocab * specee_vocab_retain(specee_vocab * vocab) {
    if (vocab) {
        vocab->n_refs.fetch_add(1);
    }
    return vocab;
}

void specee_vocab_free(specee_vocab * vocab) {
    if (vocab && vocab->n_refs.fetch_sub(1) == 1) {
        delete vocab;
    }
}

int32_t specee_vocab_n_refs(const specee_vocab * vocab) { return vocab ? vocab->n_refs.load() : 0; }

// ---- merging -----------------------------------------------------------------------------------
// Both tokenizers start from small symbols and keep merging the adjacent pair that costs least, the
// leftmost one on ties. SentencePiece: UTF-8 characters; a pair merges when its concatenation is a
// token, the higher the token's score the cheaper; characters left in no token become <0xNN> byte
// tokens. Byte-level BPE: the bytes of one pre-tokenizer word as their GPT-2 characters' tokens; a
// pair merges when it is listed in the merges, the lower the rank the cheaper; bytes without a token
// are dropped.

struct symbol {
    int     prev, next; // neighbours in the list, -1 at the ends
    size_t  off, len;   // bytes of the text; len 0 once merged into the left neighbour
    int32_t id;         // its token, -1 when none
};

struct bigram {
    int     left, right;
    float   cost;
    size_t  len; // of both symbols when queued: if a side has grown since, the pair is stale
    int32_t merged;
};

struct bigram_order {
    bool operator()(const bigram & a, const bigram & b) const {
        return a.cost > b.cost || (a.cost == b.cost && a.left > b.left);
    }
};

static void merge_symbols(const specee_vocab & v, const std::string & text, std::vector<symbol> & syms) {
    std::priority_queue<bigram, std::vector<bigram>, bigram_order> queue;

    auto try_pair = [&](int left, int right) {
        if (left < 0 || right < 0) {
            return;
        }
        const size_t len = syms[left].len + syms[right].len;
        if (v.spm) {
            auto it = v.ids.find(text.substr(syms[left].off, len));
            if (it != v.ids.end() && (v.tokens[it->second].type == TOKEN_NORMAL ||
                                      v.tokens[it->second].type == TOKEN_USER_DEFINED)) {
                queue.push({left, right, -v.tokens[it->second].score, len, it->second});
            }
        } else if (syms[left].id >= 0 && syms[right].id >= 0) {
            auto it = v.merges.find(pair_key(syms[left].id, syms[right].id));
            if (it != v.merges.end()) {
                queue.push({left, right, (float) it->second.rank, len, it->second.merged});
            }
        }
    };
    for (int i = 1; i < (int) syms.size(); ++i) {
        try_pair(i - 1, i);
    }
    while (!queue.empty()) {
        const bigram b = queue.top();
        queue.pop();
        symbol & left  = syms[b.left];
        symbol & right = syms[b.right];
        if (left.len == 0 || right.len == 0 || left.len + right.len != b.len) {
            continue;
        }
        left.len += right.len;
        left.id   = b.merged;
        right.len = 0;
        left.next = right.next;
        if (right.next >= 0) {
            syms[right.next].prev = b.left;
        }
        try_pair(left.prev, b.left);
        try_pair(b.left, left.next);
    }
}

static void tokenize_spm(const specee_vocab & v, const std::string & text, std::vector<int32_t> & out) {
    std::vector<symbol> syms;
    for (size_t off = 0; off < text.size();) {
        uint32_t     cpt;
        const size_t len = specee_utf8_decode(text.data() + off, text.size() - off, cpt);
        const int    i   = (int) syms.size();
        auto         it  = v.ids.find(text.substr(off, len));
        syms.push_back({i - 1, off + len < text.size() ? i + 1 : -1, off, len, it != v.ids.end() ? it->second : -1});
        off += len;
    }
    merge_symbols(v, text, syms);
    for (int i = syms.empty() ? -1 : 0; i >= 0; i = syms[i].next) {
        if (syms[i].id >= 0) {
            out.push_back(syms[i].id);
            continue;
        }
        for (size_t k = 0; k < syms[i].len; ++k) {
            const int32_t id = v.byte_ids[(uint8_t) text[syms[i].off + k]];
            if (id >= 0 || v.unk >= 0) {
                out.push_back(id >= 0 ? id : v.unk);
            }
        }
    }
}

static void tokenize_bpe(const specee_vocab & v, const std::string & text, std::vector<int32_t> & out) {
    std::vector<symbol> syms;
    for (const std::string & word : specee_pretokenize(text, v.pretok)) {
        if (v.ignore_merges) { // Llama 3: a word that is a token is taken whole
            std::string chars;
            for (char c : word) {
                chars += v.byte_text[(uint8_t) c];
            }
            auto it = v.ids.find(chars);
            if (it != v.ids.end()) {
                out.push_back(it->second);
                continue;
            }
        }
        const int n = (int) word.size();
        syms.resize(n);
        for (int i = 0; i < n; ++i) {
            syms[i] = {i - 1, i + 1 < n ? i + 1 : -1, (size_t) i, 1, v.byte_ids[(uint8_t) word[i]]};
        }
        merge_symbols(v, word, syms);
        for (int i = n > 0 ? 0 : -1; i >= 0; i = syms[i].next) {
            if (syms[i].id >= 0) {
                out.push_back(syms[i].id);
            }
        }
    }
}

// ---- tokenizing --------------------------------------------------------------------------------

static bool is_ascii_space(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}

struct fragment {
    int32_t token; // a special token, or -1 for the text [off, off + len)
    size_t  off, len;
};

// Split out the special tokens' texts, longest token first. User-defined tokens always split; control
// and unknown tokens only when parse_special (otherwise they are read as plain text). A token that rstrips drops the
// ASCII whitespace after it in its fragment.
static std::vector<fragment> split_specials(const specee_vocab & v, const std::string & text, bool parse_special) {
    std::vector<fragment> frags;
    if (!text.empty()) {
        frags.push_back({-1, 0, text.size()});
    }
    for (int32_t id : v.specials) {
        const std::string & s = v.tokens[id].text;
        if (!parse_special && v.tokens[id].type != TOKEN_USER_DEFINED) {
            continue;
        }
        std::vector<fragment> next;
        for (const fragment & f : frags) {
            if (f.token >= 0) {
                next.push_back(f);
                continue;
            }
            const std::string_view upto(text.data(), f.off + f.len);
            size_t                 pos = f.off;
            for (size_t m; (m = upto.find(s, pos)) != std::string_view::npos;) {
                if (m > pos) {
                    next.push_back({-1, pos, m - pos});
                }
                next.push_back({id, m, s.size()});
                pos = m + s.size();
                while (v.tokens[id].rstrip && pos < upto.size() && is_ascii_space(upto[pos])) {
                    ++pos;
                }
            }
            if (pos < f.off + f.len) {
                next.push_back({-1, pos, f.off + f.len - pos});
            }
        }
        frags.swap(next);
    }
    return frags;
}

// BOS as the vocabulary asks, unless parsed special text already starts with it (a chat template that writes it)
static std::vector<int32_t> tokenize(const specee_vocab & v, const std::string & text, bool add_special,
                                     bool parse_special) {
    std::vector<int32_t>        out;
    const std::vector<fragment> frags = split_specials(v, text, parse_special);
    if (add_special && v.add_bos && !(!frags.empty() && frags[0].token >= 0 && frags[0].token == v.bos)) {
        if (v.bos < 0) {
            specee_fail("the vocabulary asks for a BOS token but has none");
        }
        out.push_back(v.bos);
    }
    bool after_special = true; // SentencePiece: a space prefix at the start and after special tokens
    for (const fragment & f : frags) {
        if (f.token >= 0) {
            out.push_back(f.token);
            after_special = true;
            continue;
        }
        std::string s = text.substr(f.off, f.len);
        if (v.spm) {
            s = replace_all((v.add_space_prefix && after_special ? " " : "") + s, " ", k_spm_space);
            tokenize_spm(v, s, out);
        } else {
            tokenize_bpe(v, s, out);
        }
        after_special = false;
    }
    if (add_special && v.add_eos) {
        if (v.eos < 0) {
            specee_fail("the vocabulary asks for an EOS token but has none");
        }
        out.push_back(v.eos);
    }
    return out;
}

// ---- C API -------------------------------------------------------------------------------------

static const specee_vocab & vocab_of(const specee_model * model) {
    if (!model || !model->vocab) {
        specee_fail("the model file has no tokenizer (no tokenizer.ggml.* metadata)");
    }
    return *model->vocab;
}

static const specee_token_data & token_of(const specee_vocab & v, int32_t token) {
    if (token < 0 || (size_t) token >= v.tokens.size()) {
        specee_fail("token id %d is out of range [0, %zu)", token, v.tokens.size());
    }
    return v.tokens[token];
}

// the whole string, or -(its length) when it does not fit
static int32_t copy_out(const std::string & s, char * buf, int32_t len) {
    if (s.size() > (size_t) INT32_MAX) {
        specee_fail("the text is too long (%zu bytes)", s.size());
    }
    if ((int32_t) s.size() > len) {
        return -(int32_t) s.size();
    }
    if (!s.empty()) {
        memcpy(buf, s.data(), s.size());
    }
    return (int32_t) s.size();
}

extern "C" int32_t specee_token_bos(const specee_model * m) { return m && m->vocab ? m->vocab->bos : -1; }
extern "C" int32_t specee_token_eos(const specee_model * m) { return m && m->vocab ? m->vocab->eos : -1; }
extern "C" int32_t specee_token_eot(const specee_model * m) { return m && m->vocab ? m->vocab->eot : -1; }

extern "C" bool specee_token_is_eog(const specee_model * m, int32_t token) {
    if (!m || !m->vocab) {
        return false;
    }
    const std::vector<int32_t> & eog = m->vocab->eog;
    return std::find(eog.begin(), eog.end(), token) != eog.end();
}

extern "C" int32_t specee_token_eog_ids(const specee_model * m, int32_t * out, int32_t n_max) {
    if (!m || !m->vocab) {
        return 0;
    }
    const std::vector<int32_t> & eog = m->vocab->eog;
    for (int32_t i = 0; out && i < std::min(n_max, (int32_t) eog.size()); ++i) {
        out[i] = eog[i];
    }
    return (int32_t) eog.size();
}

extern "C" const char * specee_fim_name(int32_t kind) {
    return kind >= 0 && kind < SPECEE_FIM_COUNT ? k_fim_rows[kind].name : nullptr;
}

extern "C" int32_t specee_token_fim(const specee_model * m, int32_t kind) {
    return m && m->vocab && kind >= 0 && kind < SPECEE_FIM_COUNT ? m->vocab->fim[kind] : -1;
}

extern "C" const char * specee_token_text(const specee_model * m, int32_t token) {
    return specee_guard<const char *>(nullptr, [&] { return token_of(vocab_of(m), token).text.c_str(); });
}

std::vector<int32_t> specee_vocab_tokenize(const specee_model & m, const std::string & text, bool add_special,
                                           bool parse_special) {
    return tokenize(vocab_of(&m), text, add_special, parse_special);
}

std::vector<int32_t> specee_vocab_tokenize(const specee_vocab & vocab, const std::string & text, bool add_special,
                                           bool parse_special) {
    return tokenize(vocab, text, add_special, parse_special);
}

extern "C" int32_t specee_tokenize(const specee_model * m, const char * text, int32_t text_len, int32_t * tokens,
                                   int32_t n_max, bool add_special, bool parse_special) {
    return specee_guard<int32_t>(INT32_MIN, [&] {
        const specee_vocab & v = vocab_of(m);
        if (!text || n_max < 0 || (n_max > 0 && !tokens)) {
            specee_fail("specee_tokenize: no text or no room for the tokens");
        }
        const std::string          s(text, text_len < 0 ? strlen(text) : (size_t) text_len);
        const std::vector<int32_t> ids = tokenize(v, s, add_special, parse_special);
        if (ids.size() > (size_t) INT32_MAX) {
            specee_fail("the text gives too many tokens (%zu)", ids.size());
        }
        if ((int32_t) ids.size() > n_max) {
            return -(int32_t) ids.size();
        }
        std::copy(ids.begin(), ids.end(), tokens);
        return (int32_t) ids.size();
    });
}

extern "C" int32_t specee_token_to_piece(const specee_model * m, int32_t token, char * buf, int32_t len,
                                         bool special) {
    return specee_guard<int32_t>(INT32_MIN, [&] {
        const specee_token_data & t = token_of(vocab_of(m), token);
        return copy_out(!special && is_hidden(t) ? std::string() : t.piece, buf, len);
    });
}

extern "C" int32_t specee_detokenize(const specee_model * m, const int32_t * tokens, int32_t n_tokens, char * text,
                                     int32_t text_len_max, bool remove_special, bool unparse_special) {
    return specee_guard<int32_t>(INT32_MIN, [&] {
        const specee_vocab & v = vocab_of(m);
        if (n_tokens < 0 || (n_tokens > 0 && !tokens)) {
            specee_fail("specee_detokenize: bad token list");
        }
        int32_t i0 = 0, i1 = n_tokens;
        if (remove_special && v.add_bos && i1 > i0 && tokens[i0] == v.bos) {
            i0++;
        }
        if (remove_special && v.add_eos && i1 > i0 && tokens[i1 - 1] == v.eos) {
            i1--;
        }
        std::string out;
        bool        strip = v.add_space_prefix; // the space SentencePiece put in front of the text
        for (int32_t i = i0; i < i1; ++i) {
            const specee_token_data & t = token_of(v, tokens[i]);
            if (!unparse_special && is_hidden(t)) {
                continue;
            }
            const bool skip = strip && t.type == TOKEN_NORMAL && !t.piece.empty() && t.piece[0] == ' ';
            out.append(t.piece, skip ? 1 : 0, std::string::npos);
            strip = strip && t.piece.empty();
        }
        return copy_out(out, text, text_len_max);
    });
}
