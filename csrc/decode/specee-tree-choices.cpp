// specee-tree-choices.cpp: EAGLE-1's static trees: a choices list (each path lists child ranks from the root, as
// "[[0], [1], [0, 0]]") or a preset's name, read and checked into a tree shape. See specee-tree-choices.h.
#include "specee-tree-choices.h"

#include "specee-impl.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

// ---- choices lists -------------------------------------------------------------------------------

// Medusa's mc_sim_7b_63, TensorRT-LLM's default EAGLE-1 tree (63 draft tokens, depth 4)
static const char * const CHOICES_MC_SIM_7B_63 =
    "[[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5], "
    "[0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8], [9], "
    "[1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], "
    "[0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], "
    "[0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0], "
    "[0, 0, 0, 1], [1, 6], [0, 7, 0]]";

struct choices_preset {
    const char * name;
    const char * choices;
};

static const choices_preset CHOICES_PRESETS[] = {
    {"mc_sim_7b_63", CHOICES_MC_SIM_7B_63},
};

// the nodes of a static tree in breadth-first order (node 0 is the root): any prefix is itself a tree
// whose siblings are a prefix of their ranks (the default tree is chosen in specee-generate.cpp)
static const char * resolve_choices(const char * choices) {
    if (!choices || !*choices) {
        specee_fail("no EAGLE choices given");
    }
    for (const choices_preset & p : CHOICES_PRESETS) {
        if (strcmp(choices, p.name) == 0) {
            return p.choices;
        }
    }
    return choices;
}

// the paths of a choices list ("[[0], [1], [0, 0]]") as written; throws naming what is wrong and where
static std::vector<std::vector<int32_t>> read_paths(const std::string & text) {
    size_t i    = 0;
    auto   skip = [&] {
        while (i < text.size() && isspace((unsigned char) text[i])) {
            ++i;
        }
    };
    auto fail = [&](const char * what) {
        const std::string where = i < text.size() ? specee_format("at character %zu", i + 1) : "at the end";
        specee_fail("bad EAGLE choices '%s': %s %s (expected a list of paths like [[0], [1], [0, 0]], or the "
                    "preset mc_sim_7b_63)",
                    text.size() > 80 ? (text.substr(0, 77) + "...").c_str() : text.c_str(), what, where.c_str());
    };
    auto expect = [&](char c) {
        skip();
        if (i >= text.size() || text[i] != c) {
            fail(specee_format("expected '%c'", c).c_str());
        }
        ++i;
    };
    // after an item of a list: a comma and the next, or the list's end
    auto comma_or_end = [&]() {
        skip();
        if (i < text.size() && text[i] == ',') {
            ++i;
            skip();
        } else if (i >= text.size() || text[i] != ']') {
            fail("expected ',' or ']'");
        }
    };

    std::vector<std::vector<int32_t>> paths;
    expect('[');
    skip();
    while (i < text.size() && text[i] != ']') {
        std::vector<int32_t> path;
        expect('[');
        skip();
        while (i < text.size() && text[i] != ']') {
            if (!isdigit((unsigned char) text[i])) {
                fail("expected a child rank (an integer >= 0)");
            }
            long v = 0;
            while (i < text.size() && isdigit((unsigned char) text[i])) {
                v = v * 10 + (text[i++] - '0');
                if (v > 4096) {
                    fail("child rank too large");
                }
            }
            path.push_back((int32_t) v);
            comma_or_end();
        }
        expect(']');
        if (path.empty()) {
            fail("empty path");
        }
        paths.push_back(path);
        comma_or_end();
    }
    expect(']');
    skip();
    if (i != text.size()) {
        fail("unexpected text after the list");
    }
    if (paths.empty()) {
        fail("no paths");
    }
    return paths;
}

static std::string path_str(const std::vector<int32_t> & p) {
    std::string s = "[";
    for (size_t k = 0; k < p.size(); ++k) {
        s += (k ? ", " : "") + std::to_string(p[k]);
    }
    return s + "]";
}

// The tree the paths describe, its nodes breadth-first (by depth, then lexicographically): each node's parent and
// number of children. Every path's parent and earlier siblings must be listed.
static tree_shape shape_of(std::vector<std::vector<int32_t>> paths) {
    std::sort(paths.begin(), paths.end(), [](const std::vector<int32_t> & a, const std::vector<int32_t> & b) {
        return a.size() != b.size() ? a.size() < b.size() : a < b;
    });
    tree_shape shape;
    shape.parent.push_back(-1);
    shape.n_children.push_back(0);
    std::vector<std::vector<int32_t>> done = {{}};
    for (size_t k = 0; k < paths.size(); ++k) {
        const std::vector<int32_t> & p = paths[k];
        if (k > 0 && p == paths[k - 1]) {
            specee_fail("bad EAGLE choices: the path %s is listed twice", path_str(p).c_str());
        }
        std::vector<int32_t> up(p.begin(), p.end() - 1);
        const auto           it = std::find(done.begin(), done.end(), up);
        if (it == done.end()) {
            specee_fail("bad EAGLE choices: the path %s has no parent %s in the list", path_str(p).c_str(),
                        path_str(up).c_str());
        }
        const int32_t parent = (int32_t) (it - done.begin());
        if (p.back() != shape.n_children[parent]) {
            std::vector<int32_t> prev = p;
            prev.back()--;
            specee_fail("bad EAGLE choices: the path %s needs its earlier sibling %s in the list (children are "
                        "ranks 0, 1, 2, ... of the draft's candidates)",
                        path_str(p).c_str(), path_str(prev).c_str());
        }
        shape.n_children[parent]++;
        shape.parent.push_back(parent);
        shape.n_children.push_back(0);
        done.push_back(p);
    }
    return shape;
}

tree_shape specee_tree_parse_choices(const char * choices) { return shape_of(read_paths(resolve_choices(choices))); }

int32_t specee_tree_count_choices(const char * choices) {
    return (int32_t) specee_tree_parse_choices(choices).parent.size() - 1;
}

extern "C" int32_t specee_eagle_check_choices(const char * choices) {
    return specee_guard<int32_t>(-1, [&] { return specee_tree_count_choices(choices); });
}
