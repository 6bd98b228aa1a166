// specee-options.h: the mode table's rows and the generation options' checks (specee-options.cpp)
#pragma once

#include "specee.h"

// mode's row of the mode table (specee_mode_info); throws for an unknown mode
const specee_mode_info & specee_mode_row_impl(int32_t mode);
// throws when a value is out of range whatever the model (sampling, mode, trees, exit settings)
void specee_generator_check_values(const specee_generator_params & p);
