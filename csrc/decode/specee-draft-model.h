// specee-draft-model.h: a draft model, llama.cpp's default speculative decoding (-md): a second, smaller model with the
// target's vocabulary drafts a chain of tokens greedily, which one pass of the target verifies (mode "draft"). Its
// settings (specee_draft_params, a field of specee_generator_params) are in specee.h's generation section.
//
// The draft model is named by specee_model_params.draft_model (context option draft_model, -md): loaded with the
// target, refused unless its vocabulary is the target's token for token; each context of the target gets a context of
// the draft model beside it (its own KV cache, the same size), each sequence of the target its sequence there, kept
// in step with the tokens the target accepted (specee-draft-model.cpp).
#pragma once

#include <cstdint>
#include <string>

struct specee_tree_decoder;
struct specee_draft_seq;
struct specee_generator_params;

// (specee-draft-model.cpp) Mode draft's settings into the sequence and the tree decoder (synthetic rates as conditional
// ones, their generator seeded); returns a line saying that synthetic acceptance is on, "" otherwise
std::string specee_draft_init(specee_tree_decoder & dec, specee_draft_seq & ds, const specee_generator_params & p,
                              uint32_t seed);
// a new sequence: the prompt's n tokens and the first token sampled after them (the root)
void specee_draft_seq_reset(specee_draft_seq & ds, const int32_t * tokens, int32_t n, int32_t first);
