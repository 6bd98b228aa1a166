// specee-vocab.h: the tokenizer, read from the GGUF's tokenizer.ggml.* metadata
#pragma once

#include "gguf.h"

#include <cstdint>
#include <string>
#include <vector>

struct specee_vocab;

// the vocabulary of a model file whose token_embd has n_vocab rows (no more tokens than that); nullptr when the
// file has none (token-id use only); special_rstrip: the family's (specee_arch_family). Throws specee_error.
specee_vocab * specee_vocab_load(const gguf_context * gguf, uint32_t n_vocab, bool special_rstrip);
// Shared: the model holds the reference load gave it; what must read the vocabulary after its model may be gone (the
// grammar engine's tokenizer callback, called by a compile abandoned past its budget: specee-grammar-compile.h) holds
// one of its own (retain returns vocab). free drops one reference; the last frees it. n_refs: references held now.
specee_vocab * specee_vocab_retain(specee_vocab * vocab);
void           specee_vocab_free(specee_vocab * vocab);
int32_t        specee_vocab_n_refs(const specee_vocab * vocab);

struct specee_model;

// text to token ids (specee_tokenize without the C buffers), of the model's vocabulary or of one held directly;
// throws specee_error
std::vector<int32_t> specee_vocab_tokenize(const specee_model & m, const std::string & text, bool add_special,
                                           bool parse_special);
std::vector<int32_t> specee_vocab_tokenize(const specee_vocab & vocab, const std::string & text, bool add_special,
                                           bool parse_special);

// ---- fill-in-the-middle (FIM) tokens: public C API beside specee.h ---------------------------------------------
// Code models mark the prefix, suffix and middle of a fill-in-the-middle prompt with tokens of their own; where a file
// names them in its metadata they are taken from there, else from their text in the vocabulary. specee-server's
// /infill (llama.cpp's layout) and Model.fim_tokens read them here, nowhere else.
extern "C" {
enum specee_fim {
    SPECEE_FIM_PRE = 0, // before the prefix
    SPECEE_FIM_SUF = 1, // before the suffix
    SPECEE_FIM_MID = 2, // after both: the model writes the middle
    SPECEE_FIM_PAD = 3, // padding (ends generation)
    SPECEE_FIM_REP = 4, // before a repository's name (ends generation)
    SPECEE_FIM_SEP = 5, // before each file of a repository (ends generation)
    SPECEE_FIM_COUNT = 6,
};

// the kind's name ("pre", "suf", "mid", "pad", "rep", "sep"), NULL out of range
const char * specee_fim_name(int32_t kind);
// the kind's token id in the model's vocabulary, -1 when it has none (or kind is out of range)
int32_t specee_token_fim(const specee_model * model, int32_t kind);
}
