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
void           specee_vocab_free(specee_vocab * vocab);

struct specee_model;

// text to token ids (specee_tokenize without the C buffers); throws specee_error
std::vector<int32_t> specee_vocab_tokenize(const specee_model & m, const std::string & text, bool add_special,
                                           bool parse_special);
