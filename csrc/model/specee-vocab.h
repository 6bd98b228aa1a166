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
