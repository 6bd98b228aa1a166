// specee-early-exit.h: SpecEE's early-exit decoder over a draft head (greedy, lossy by design): a token's pass, layer
// range by layer range, checked at the scheduled layers (the predictors and the schedule: specee-exit.h)
#pragma once

#include "specee-exit.h"
#include "specee-step.h"

#include <cstdint>
#include <utility>
#include <vector>

// One token: evaluates step.root (the last emitted token, at step.root_pos) layer range by layer range, checking the
// scheduled layers; returns the next token and advances root / root_pos; layers_run receives the layers it ran.
int32_t specee_exit_step(specee_exit_decoder & dec, specee_step step, int32_t & layers_run);
// Checked exits (params.check): one token's step as specee_exit_step, with the waiting tokens' skipped layers joining
// its pass where they stopped (specee-exit-check.h). A token that exits waits with them; one that runs every layer
// checks them all: the checked tokens (and its own next token), or up to a wrong one and the full model's token in its
// place, go to `out` (token, layers its step ran). Returns how many tokens it put out (0 while a chain waits).
int32_t specee_exit_step_checked(specee_exit_decoder & dec, specee_step step,
                                 std::vector<std::pair<int32_t, int32_t>> & out);
