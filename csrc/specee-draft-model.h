// specee-draft-model.h: a draft model, llama.cpp's default speculative decoding (-md): a second, smaller model with the
// target's vocabulary drafts a chain of tokens greedily, which one pass of the target verifies (mode "draft"). Part of
// the public API (specee.h includes it): the settings of mode draft, a field of specee_generator_params.
//
// The draft model is named by specee_model_params.draft_model (context option draft_model, -md): loaded with the
// target, refused unless its vocabulary is the target's token for token; each context of the target gets a context of
// the draft model beside it (its own KV cache, the same size), each sequence of the target its sequence there, kept
// in step with the tokens the target accepted (specee-draft-model.cpp).
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// the most tokens a draft model drafts per step, and the most synthetic acceptance rates
#define SPECEE_MAX_DRAFT 64

struct specee_draft_params {
    int32_t n_max; // most tokens drafted per step (llama.cpp's --draft-max / --spec-draft-n-max)
    int32_t n_min; // a chain shorter than this is not verified (a plain step instead; --draft-min)
    float   p_min; // drafting stops where the draft model's top probability falls below this (--draft-p-min)
    // Benchmarks only (llama.cpp's --spec-synth-rates): drafted token i of a step is accepted with the unconditional
    // probability synth_rates[i] (non-increasing, in [0, 1]) whatever the target says, from a generator seeded with
    // the sampler's seed; the output is not the model's. 0 rates: off.
    float   synth_rates[SPECEE_MAX_DRAFT];
    int32_t n_synth_rates;
};

#ifdef __cplusplus
}
#endif

#ifdef __cplusplus
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
#endif
