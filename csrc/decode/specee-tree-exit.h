// specee-tree-exit.h: tree exit: SpecEE's early exit inside an EAGLE tree's verification pass (greedy, lossy by design)
#pragma once

#include "specee-exit.h"
#include "specee-speculative.h"
#include "specee-step.h"
#include "specee.h"

#include <cstdint>
#include <utility>
#include <vector>

// Sets the tree decoder up to keep each expanded node's candidates (the model's specee.exit.n_candidates) and checks
// the exit parameters as early exit does (specee_exit_init); the tree itself is set up by specee_tree_init.
void    specee_tree_exit_init(specee_tree_decoder & tree, specee_exit_decoder & exit, const specee_model & model,
                              const specee_exit_params & params);
// One draft-and-verify step whose verification pass may stop at a checked layer: writes 1..n_max tokens and advances
// step.root / root_pos as specee_drafter_step does; layers_run receives the layers the pass ran; returns the count.
int32_t specee_tree_exit_step(specee_tree_decoder & tree, specee_exit_decoder & exit, specee_step step,
                              int32_t * out, int32_t n_max, int32_t & layers_run);
// The same step with checked exits (exit.check): the tokens of a pass that exits wait for their check (their skipped
// layers run with the next passes, specee-exit-check.h); the tokens it puts out go to `out` (token, layers its pass
// ran): checked ones, the full model's in place of a wrong one (a rollback), and those of a pass that ran every layer.
// Returns how many (0 while the step's tokens wait).
int32_t specee_tree_exit_step_checked(specee_tree_decoder & tree, specee_exit_decoder & exit, specee_step step,
                                      int32_t n_max, std::vector<std::pair<int32_t, int32_t>> & out);
