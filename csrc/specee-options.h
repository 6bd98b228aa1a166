// specee-options.h: the mode table's rows, the generation options' checks and the stats' derived figures
// (specee-options.cpp, specee-stats.cpp)
#pragma once

#include "specee.h"

#include <string>
#include <vector>

// mode's row of the mode table (specee_mode_info); throws for an unknown mode
const specee_mode_info & specee_mode_row_impl(int32_t mode);
// throws when a value is out of range whatever the model (sampling, mode, trees, exit settings)
void specee_generator_check_values(const specee_generator_params & p);
// mean_accepted_tokens, exit_ratio, mean_layers_run from the counts, for the mode in use
void specee_generator_stats_derive(specee_generator_stats & st, int32_t mode);
// The LoRA adapters of the context option lora ("FNAME,...", scale 1 each) or, scaled, lora_scaled ("FNAME:SCALE,...",
// the scale after the last ':', finite) appended to files and scales (NULL: only checked); false when malformed (an
// empty name or scale). specee-lora.cpp
bool specee_lora_list_parse(const char * text, bool scaled, std::vector<std::string> * files = nullptr,
                            std::vector<float> * scales = nullptr);
