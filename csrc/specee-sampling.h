// specee-sampling.h: the sampler's internals for the speculative loop (distributions and uniform draws)
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

struct specee_sampler;

// The distribution the sampler draws from for one row of logits, as (token, p > 0) pairs: the chain's
// transforms (repetition penalty when `penalty`, top-k, top-p, min-p, temperature); greedy: the argmax, p = 1.
void   specee_sampler_dist(specee_sampler & s, const float * logits, int32_t n_vocab, bool penalty,
                           std::vector<std::pair<int32_t, float>> & out);
// the next uniform in [0, 1) of the sampler's seeded generator
double specee_sampler_uniform(specee_sampler & s);
bool   specee_sampler_greedy(const specee_sampler & s);
