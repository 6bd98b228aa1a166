// specee-stats.h: a generation's statistics, derived (specee-stats.cpp)
#pragma once

#include "specee.h"

// mean_accepted_tokens, exit_ratio, mean_layers_run from the counts, for the mode in use
void specee_generator_stats_derive(specee_generator_stats & st, int32_t mode);
