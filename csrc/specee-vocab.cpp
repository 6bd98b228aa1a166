// specee-vocab.cpp: tokenizers (SentencePiece-style and GPT-2 byte-level BPE), special tokens, detokenizing
#include "specee-vocab.h"

struct specee_vocab {
};

specee_vocab * specee_vocab_load(const gguf_context *) { return nullptr; }

void specee_vocab_free(specee_vocab * vocab) { delete vocab; }
