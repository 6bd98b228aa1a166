// specee-tree-choices.h: EAGLE-1's static tree shapes, from a choices list or a preset's name
#pragma once

#include "specee.h"

#include <cstdint>
#include <vector>

// a static tree: each node's parent (the root's: -1) and number of children
struct tree_shape {
    std::vector<int32_t> parent;     // -1 for the root
    std::vector<int32_t> n_children; // children ranks 0 .. n_children - 1
};

// the shape of a choices list ("[[0], [1], [0, 0]]": child-rank paths from the root) or a preset's name
// (mc_sim_7b_63); throws with the reason where the text is not a tree (a path whose parent path is missing, ...)
tree_shape specee_tree_parse_choices(const char * choices);
// its drafted nodes (the root not counted); throws as specee_tree_parse_choices
int32_t    specee_tree_count_choices(const char * choices);
