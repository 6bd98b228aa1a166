// specee-vocab.h: the tokenizer, read from the GGUF's tokenizer.ggml.* metadata
#pragma once

#include "gguf.h"

struct specee_vocab;

// the vocabulary of a model file; nullptr when the file has none (token-id use only). Throws specee_error.
specee_vocab * specee_vocab_load(const gguf_context * gguf);
void           specee_vocab_free(specee_vocab * vocab);
