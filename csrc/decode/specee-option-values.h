// specee-option-values.h: a value held to its row of an option table (specee-options.h), set from text and read
// back as text (specee-option-values.cpp)
#pragma once

#include "specee.h"

#include <cstdint>
#include <utility>
#include <vector>

// throws when a value is out of its row's range whatever the model (sampling, mode, trees, exit settings)
void specee_generator_check_values(const specee_generator_params & p);
// throws when a sampler parameter is out of its row's range (the sampling rows of the generation options)
void specee_sampler_check_params(const specee_sampler_params & params);
// llama.cpp's --logit-bias text "TOKEN(+|-)BIAS,..." ("15043+1,2-inf") as (token, bias) pairs; throws naming the
// item that is not one
std::vector<std::pair<int32_t, float>> specee_parse_logit_bias(const char * text);
