// specee-speculative.cpp: EAGLE tree speculative decoding, lossless.
//
// One step: the EAGLE head drafts a tree of tokens after the last emitted token (the root), the target
// verifies root + tree in one batched pass (tree mask, per-token positions), and a walk from the root
// emits the accepted path plus one token from the target's own distribution. The rejected branches' KV
// cells are dropped and the accepted ones moved into position order.
//
//   draft head   pairs (f_i, t_{i+1}) of a target feature (final-norm output at position i) and the next
//                token, at position i, in the head's own one-layer KV cache. Pairs are committed with the
//                target's real features once their tokens are emitted; the tree's nodes are drafted with
//                the head's own output feature in place of f, in cells dropped after the step.
//   trees        EAGLE-1: a fixed shape from a choices list ("[[0], [1], [0, 0]]": each path lists child
//                ranks from the root). EAGLE-2: top_k children of the root; at each further depth the
//                top_k nodes of the newest depth (by cumulative log-probability) get top_k children each;
//                then the best total_tokens drafted nodes make the tree.
//   acceptance   greedy: follow the child equal to the target's argmax. Sampling: per depth, recursive
//                rejection sampling over the children (see accept_sampled), lossless.
#include "specee-context.h"
#include "specee-graph.h"
#include "specee-impl.h"
#include "specee-kv-cache.h"
#include "specee-model.h"
#include "specee-sampling.h"
#include "specee-speculative.h"
#include "specee.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
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

// The defaults are sized for a CPU (measured on SmolLM2-135M Q4_1, see the README): ggml's CPU kernels for
// Q4_1 have no batched path, so verifying a tree token costs about 0.65 of a plain decode step, while a draft
// token is accepted about a third of the time; the smallest tree (one draft token) loses least.
static const char * const DEFAULT_CHOICES = "[[0]]";

// the nodes of a static tree in breadth-first order (node 0 is the root): any prefix is itself a tree
// whose siblings are a prefix of their ranks
static const char * resolve_choices(const char * choices) {
    const std::string name = choices && *choices ? choices : DEFAULT_CHOICES;
    for (const choices_preset & p : CHOICES_PRESETS) {
        if (name == p.name) {
            return p.choices;
        }
    }
    return choices && *choices ? choices : DEFAULT_CHOICES;
}

static tree_shape parse_choices(const char * choices_arg) {
    const std::string text = resolve_choices(choices_arg);
    size_t            i    = 0;
    auto              skip = [&] {
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
            skip();
            if (i < text.size() && text[i] == ',') {
                ++i;
                skip();
            } else if (i >= text.size() || text[i] != ']') {
                fail("expected ',' or ']'");
            }
        }
        expect(']');
        if (path.empty()) {
            fail("empty path");
        }
        paths.push_back(path);
        skip();
        if (i < text.size() && text[i] == ',') {
            ++i;
            skip();
        } else if (i >= text.size() || text[i] != ']') {
            fail("expected ',' or ']'");
        }
    }
    expect(']');
    skip();
    if (i != text.size()) {
        fail("unexpected text after the list");
    }
    if (paths.empty()) {
        fail("no paths");
    }

    auto path_str = [](const std::vector<int32_t> & p) {
        std::string s = "[";
        for (size_t k = 0; k < p.size(); ++k) {
            s += (k ? ", " : "") + std::to_string(p[k]);
        }
        return s + "]";
    };
    // breadth-first: by depth, then lexicographically
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

// ---- the decoder -----------------------------------------------------------------------------------

using spec_clock = std::chrono::steady_clock;

static double ms_since(spec_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(spec_clock::now() - t0).count();
}


// Evaluates pairs in the draft head. tree: the pairs are tree nodes, which see the committed cells, their
// ancestors' cells (anc) and themselves; otherwise the pairs are committed and causal. Output rows `out`
// get logits (d_logits); every pair's output feature lands in d_out. Returns the cells used.
static std::vector<int32_t> draft_eval(specee_spec & sp, const std::vector<int32_t> & tokens, const float * feats,
                                       const std::vector<int32_t> & pos, const std::vector<std::vector<int32_t>> * anc,
                                       const std::vector<int32_t> & out) {
    const int32_t n     = (int32_t) tokens.size();
    const bool    tree  = anc != nullptr;
    std::vector<int32_t> cells = sp.dkv.find_slots((uint32_t) n);
    for (int32_t i = 0; i < n; ++i) {
        sp.dkv.occupy(cells[i], pos[i]);
        sp.dkv.set_valid(cells[i], 0);
        sp.dkv_tree[cells[i]] = tree;
    }
    const int32_t n_kv = (int32_t) sp.dkv.n_kv();

    // mask [n][n_kv]
    std::vector<int32_t> batch_index(n_kv, -1);
    for (int32_t i = 0; i < n; ++i) {
        batch_index[cells[i]] = i;
    }
    std::vector<ggml_fp16_t> mask((size_t) n * n_kv, ggml_fp32_to_fp16(-INFINITY));
    const ggml_fp16_t        zero = ggml_fp32_to_fp16(0.0f);
    for (int32_t i = 0; i < n; ++i) {
        ggml_fp16_t * row = mask.data() + (size_t) i * n_kv;
        for (int32_t c = 0; c < n_kv; ++c) {
            const int32_t j = batch_index[c];
            bool          see;
            if (j >= 0) {
                see = tree ? j == i : pos[j] <= pos[i];
            } else {
                see = sp.dkv.pos[c] >= 0 && !sp.dkv_tree[c] && sp.dkv.pos[c] <= pos[i];
            }
            if (see) {
                row[c] = zero;
            }
        }
        if (tree) {
            for (int32_t c : (*anc)[i]) {
                row[c] = zero;
            }
        }
    }

    specee_graph_params gp;
    gp.n_tokens  = n;
    gp.n_kv      = n_kv;
    gp.n_outputs = (int32_t) out.size();

    ggml_init_params ip   = {sp.graph_meta.size(), sp.graph_meta.data(), /*no_alloc =*/true};
    ggml_context *   ctx0 = ggml_init(ip);
    std::unique_ptr<ggml_context, void (*)(ggml_context *)> guard(ctx0, ggml_free);
    specee_graph_io io;
    ggml_cgraph *   gf = specee_build_eagle_graph(ctx0, *sp.model, sp.dkv, gp, io, sp.graph_size);

    ggml_backend_sched_t sched = specee_context_sched(*sp.ctx);
    ggml_backend_sched_reset(sched);
    if (!ggml_backend_sched_alloc_graph(sched, gf)) {
        specee_fail("cannot allocate the draft head's graph (%d tokens, %d cells)", n, n_kv);
    }
    ggml_backend_tensor_set(io.inp_tokens, tokens.data(), 0, n * sizeof(int32_t));
    ggml_backend_tensor_set(io.inp_embd, feats, 0, (size_t) n * sp.n_embd * sizeof(float));
    ggml_backend_tensor_set(io.inp_pos, pos.data(), 0, n * sizeof(int32_t));
    std::vector<int64_t> idxs(cells.begin(), cells.end());
    ggml_backend_tensor_set(io.inp_kv_idxs, idxs.data(), 0, n * sizeof(int64_t));
    ggml_backend_tensor_set(io.inp_masks[0], mask.data(), 0, mask.size() * sizeof(ggml_fp16_t));
    if (io.inp_out_ids) {
        ggml_backend_tensor_set(io.inp_out_ids, out.data(), 0, out.size() * sizeof(int32_t));
    }
    specee_context_compute(*sp.ctx, gf, n);

    sp.d_out.resize((size_t) n * sp.n_embd);
    ggml_backend_tensor_get(io.l_out[0], sp.d_out.data(), 0, sp.d_out.size() * sizeof(float));
    sp.d_logits.resize((size_t) out.size() * sp.n_dvocab);
    if (io.result_output) {
        ggml_backend_tensor_get(io.result_output, sp.d_logits.data(), 0, sp.d_logits.size() * sizeof(float));
    }
    return cells;
}

// Commits the pending pairs to the head's cache; the last one's output becomes the root's feature and
// logits (d_out / d_logits row 0 afterwards hold the last pair's).
static void draft_commit_pending(specee_spec & sp) {
    const int32_t n       = (int32_t) sp.pend_tok.size();
    const int32_t n_batch = (int32_t) specee_n_batch(sp.ctx);
    std::vector<float> last_h;
    for (int32_t i0 = 0; i0 < n; i0 += n_batch) {
        const int32_t        m = std::min(n_batch, n - i0);
        std::vector<int32_t> tok(sp.pend_tok.begin() + i0, sp.pend_tok.begin() + i0 + m);
        std::vector<int32_t> pos(sp.pend_pos.begin() + i0, sp.pend_pos.begin() + i0 + m);
        const bool           last = i0 + m == n;
        draft_eval(sp, tok, sp.pend_feat.data() + (size_t) i0 * sp.n_embd, pos, nullptr,
                   last ? std::vector<int32_t>{m - 1} : std::vector<int32_t>{});
        if (last) {
            last_h.assign(sp.d_out.end() - sp.n_embd, sp.d_out.end());
        }
    }
    sp.d_out = std::move(last_h);
    sp.pend_tok.clear();
    sp.pend_pos.clear();
    sp.pend_feat.clear();
}

// a uniform in (0, 1): never 0, so logs stay finite
static double uniform_open(specee_sampler & smpl) {
    double u;
    do {
        u = specee_sampler_uniform(smpl);
    } while (u <= 0.0);
    return u;
}

// Children of node `ni` from one row of the head's logits: up to k tokens, appended to the tree.
// Greedy: the k most likely (deterministic), scored by log-softmax. Sampling: k draws without replacement
// from q, the sampler's distribution over the draft logits (Gumbel-top-k), in the order drawn; q is kept
// for the acceptance test. Scores never increase along siblings (a running minimum), so any selection of
// the best nodes keeps whole prefixes of each node's children.
static void draft_children(specee_spec & sp, specee_sampler & smpl, int32_t ni, const float * logits, int32_t k) {
    const std::vector<int32_t> & dvocab = sp.model->eagle.draft_vocab;
    auto target_id = [&](int32_t d) { return dvocab.empty() ? d : dvocab[d]; };
    std::vector<std::pair<int32_t, float>> picks; // (draft id, log-probability)

    if (specee_sampler_greedy(smpl)) {
        float mx = -INFINITY;
        for (int32_t i = 0; i < sp.n_dvocab; ++i) {
            mx = std::max(mx, logits[i]);
        }
        double sum = 0.0;
        for (int32_t i = 0; i < sp.n_dvocab; ++i) {
            sum += std::exp((double) logits[i] - mx);
        }
        const float lse = mx + (float) std::log(sum);
        k               = std::min(k, sp.n_dvocab);
        std::vector<int32_t> idx(sp.n_dvocab);
        for (int32_t i = 0; i < sp.n_dvocab; ++i) {
            idx[i] = i;
        }
        std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int32_t a, int32_t b) {
            return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
        });
        for (int32_t i = 0; i < k; ++i) {
            picks.emplace_back(idx[i], logits[idx[i]] - lse);
        }
    } else {
        sparse_dist q;
        specee_sampler_dist(smpl, logits, sp.n_dvocab, false, q);
        std::vector<std::pair<double, int32_t>> keys; // (log q + Gumbel noise, index in q)
        for (int32_t i = 0; i < (int32_t) q.size(); ++i) {
            keys.emplace_back(std::log((double) q[i].second) - std::log(-std::log(uniform_open(smpl))), i);
        }
        k = std::min<int32_t>(k, (int32_t) keys.size());
        std::partial_sort(keys.begin(), keys.begin() + k, keys.end(),
                          [](const auto & a, const auto & b) { return a.first > b.first; });
        for (int32_t i = 0; i < k; ++i) {
            picks.emplace_back(q[keys[i].second].first, std::log(q[keys[i].second].second));
        }
        for (auto & e : q) {
            e.first = target_id(e.first);
        }
        sp.nodes[ni].q = std::move(q);
    }

    float run_min = sp.nodes[ni].score;
    for (int32_t i = 0; i < (int32_t) picks.size(); ++i) {
        draft_node c;
        c.token  = target_id(picks[i].first);
        c.parent = ni;
        c.depth  = sp.nodes[ni].depth + 1;
        run_min  = std::min(run_min, sp.nodes[ni].score + picks[i].second);
        c.score  = run_min;
        sp.nodes[ni].children.push_back((int32_t) sp.nodes.size());
        sp.nodes.push_back(std::move(c));
    }
}

// draft cells of a node's ancestors below the root (the root's pair is committed)
static std::vector<int32_t> ancestor_cells(const specee_spec & sp, int32_t ni) {
    std::vector<int32_t> cells;
    for (int32_t a = sp.nodes[ni].parent; a > 0; a = sp.nodes[a].parent) {
        cells.push_back(sp.nodes[a].dcell);
    }
    return cells;
}

// Runs the head on tree nodes (pairs of the parent's output feature and the node's token) and draws each
// one's children: k_of(node) of them.
template <typename K>
static void draft_expand(specee_spec & sp, specee_sampler & smpl, const std::vector<int32_t> & batch, K k_of) {
    const int32_t n = (int32_t) batch.size();
    if (n == 0) {
        return;
    }
    std::vector<int32_t>              tok(n), pos(n), out(n);
    std::vector<float>                feats((size_t) n * sp.n_embd);
    std::vector<std::vector<int32_t>> anc(n);
    const int32_t                     root_pos = specee_kv_pos_max(sp.ctx) + 1;
    for (int32_t i = 0; i < n; ++i) {
        const draft_node & nd = sp.nodes[batch[i]];
        tok[i]                = nd.token;
        pos[i]                = root_pos + nd.depth - 1;
        out[i]                = i;
        anc[i]                = ancestor_cells(sp, batch[i]);
        std::copy(sp.nodes[nd.parent].h.begin(), sp.nodes[nd.parent].h.end(), feats.begin() + (size_t) i * sp.n_embd);
    }
    const std::vector<int32_t> cells = draft_eval(sp, tok, feats.data(), pos, &anc, out);
    const std::vector<float>   logits = sp.d_logits;
    for (int32_t i = 0; i < n; ++i) {
        draft_node & nd = sp.nodes[batch[i]];
        nd.dcell        = cells[i];
        nd.h.assign(sp.d_out.begin() + (size_t) i * sp.n_embd, sp.d_out.begin() + (size_t) (i + 1) * sp.n_embd);
    }
    for (int32_t i = 0; i < n; ++i) {
        draft_children(sp, smpl, batch[i], logits.data() + (size_t) i * sp.n_dvocab, k_of(batch[i]));
    }
}

// Drafts the tree of this step: sp.nodes (root first); the nodes to verify get rows 1.. in breadth-first
// order, at most `budget` of them. Returns the verified nodes in row order.
static std::vector<int32_t> draft_tree(specee_spec & sp, specee_sampler & smpl, int32_t budget) {
    sp.nodes.clear();
    draft_node root;
    root.token = sp.root;
    sp.nodes.push_back(root);
    draft_commit_pending(sp);
    sp.nodes[0].h = sp.d_out;
    const std::vector<float> root_logits(sp.d_logits.begin(), sp.d_logits.begin() + sp.n_dvocab);

    std::vector<int32_t> chosen;
    if (budget <= 0) {
        sp.nodes[0].row = 0;
        return chosen;
    }
    if (sp.params.tree == SPECEE_SPEC_TREE_STATIC) {
        // the shape's first `budget` nodes (breadth-first, so a tree); node i of a depth is expanded when its
        // shape node has children inside the budget
        const tree_shape & sh      = sp.shape;
        const int32_t      n_shape = std::min<int32_t>(budget, (int32_t) sh.parent.size() - 1) + 1;
        std::vector<int32_t> n_kids(n_shape, 0);
        for (int32_t s = 1; s < n_shape; ++s) {
            n_kids[sh.parent[s]]++;
        }
        // children of drafted nodes map to shape nodes in order: the j-th child of shape node s is the
        // j-th shape node whose parent is s
        std::vector<std::vector<int32_t>> shape_kids(n_shape);
        for (int32_t s = 1; s < n_shape; ++s) {
            shape_kids[sh.parent[s]].push_back(s);
        }
        auto assign_shapes = [&](int32_t ni) {
            const std::vector<int32_t> & kids = sp.nodes[ni].children;
            for (size_t j = 0; j < kids.size(); ++j) {
                sp.nodes[kids[j]].shape = shape_kids[sp.nodes[ni].shape][j];
            }
        };
        draft_children(sp, smpl, 0, root_logits.data(), n_kids[0]);
        assign_shapes(0);
        std::vector<int32_t> level = sp.nodes[0].children;
        while (!level.empty()) {
            std::vector<int32_t> expand;
            for (int32_t ni : level) {
                if (n_kids[sp.nodes[ni].shape] > 0) {
                    expand.push_back(ni);
                }
            }
            const size_t first_new = sp.nodes.size();
            draft_expand(sp, smpl, expand, [&](int32_t ni) { return n_kids[sp.nodes[ni].shape]; });
            for (int32_t ni : expand) {
                assign_shapes(ni);
            }
            level.clear();
            for (size_t ni = first_new; ni < sp.nodes.size(); ++ni) {
                level.push_back((int32_t) ni);
            }
        }
        // breadth-first by shape index = the order of the choices
        for (int32_t ni = 1; ni < (int32_t) sp.nodes.size(); ++ni) {
            chosen.push_back(ni);
        }
        std::sort(chosen.begin(), chosen.end(),
                  [&](int32_t a, int32_t b) { return sp.nodes[a].shape < sp.nodes[b].shape; });
    } else {
        const int32_t top_k = sp.params.top_k;
        draft_children(sp, smpl, 0, root_logits.data(), top_k);
        std::vector<int32_t> level = sp.nodes[0].children;
        for (int32_t d = 1; d < sp.params.depth && !level.empty(); ++d) {
            // the top_k nodes of the newest depth by score (earlier drawn first on ties)
            std::stable_sort(level.begin(), level.end(),
                             [&](int32_t a, int32_t b) { return sp.nodes[a].score > sp.nodes[b].score; });
            level.resize(std::min<size_t>(level.size(), (size_t) top_k));
            std::sort(level.begin(), level.end());
            const size_t first_new = sp.nodes.size();
            draft_expand(sp, smpl, level, [&](int32_t) { return top_k; });
            level.clear();
            for (size_t ni = first_new; ni < sp.nodes.size(); ++ni) {
                level.push_back((int32_t) ni);
            }
        }
        // rerank every drafted node: the best `budget` (scores do not increase from parent to child or
        // along siblings, and ties go to the earlier node, so the chosen set is a tree)
        for (int32_t ni = 1; ni < (int32_t) sp.nodes.size(); ++ni) {
            chosen.push_back(ni);
        }
        std::stable_sort(chosen.begin(), chosen.end(),
                         [&](int32_t a, int32_t b) { return sp.nodes[a].score > sp.nodes[b].score; });
        chosen.resize(std::min<size_t>(chosen.size(), (size_t) budget));
        std::sort(chosen.begin(), chosen.end(), [&](int32_t a, int32_t b) {
            return sp.nodes[a].depth != sp.nodes[b].depth ? sp.nodes[a].depth < sp.nodes[b].depth : a < b;
        });
    }
    if ((int32_t) chosen.size() > budget) {
        chosen.resize(budget);
    }
    sp.nodes[0].row = 0;
    for (size_t r = 0; r < chosen.size(); ++r) {
        sp.nodes[chosen[r]].row = (int32_t) r + 1;
    }
    return chosen;
}

// ---- verification and acceptance ---------------------------------------------------------------------

// Sampling acceptance at one node: recursive rejection sampling over its children (SpecInfer's multi-
// candidate speculative sampling; with children drawn without replacement, as here, the recursive form
// of Jeon et al. 2024). p is the target's distribution at the node after the sampler's transforms, and
// the children x_1, x_2, ... were drawn one after another from q_1 = q (the head's distribution there)
// and q_{i+1} = q_i without x_i, renormalised. For child i: accept x_i with probability
// min(1, p_i(x_i) / q_i(x_i)); else p_{i+1} = norm(max(p_i - q_i, 0)) and try the next child; when none is
// left, draw from p_{i+1}.
// Why this is lossless: given that step i is reached with residual p_i, step i emits y with probability
// q_i(y) min(1, p_i(y)/q_i(y)) = min(p_i(y), q_i(y)) and rejects with probability
// sum_y max(q_i(y) - p_i(y), 0) = sum_y max(p_i(y) - q_i(y), 0); what follows a rejection emits y with
// probability p_{i+1}(y) (by induction), so in total y comes out with min(p_i, q_i)(y) + max(p_i - q_i, 0)(y)
// = p_i(y). As p_1 = p, every emitted token is distributed as the target's own draw, whatever q is and
// whichever tokens were drafted. (A rejected x_i has q_i(x_i) > p_i(x_i), so p_{i+1}(x_i) = 0: consistent
// with x_i leaving q.) The head's q only changes how often a draft is accepted. Deeper nodes follow
// because the target's distribution at an accepted child is computed with that child in the context, and
// the sampler's history (repetition penalty) gets each emitted token before the next depth is judged.
static int32_t accept_sampled(specee_spec & sp, specee_sampler & smpl, int32_t ni, const float * logits,
                              std::vector<double> & p, std::vector<double> & q, int32_t & child) {
    const int32_t n_vocab = sp.n_vocab;
    sparse_dist   dist;
    specee_sampler_dist(smpl, logits, n_vocab, true, dist);
    std::fill(p.begin(), p.end(), 0.0);
    for (const auto & e : dist) {
        p[e.first] = e.second;
    }
    child                  = -1;
    const draft_node & nd  = sp.nodes[ni];
    bool               q_in = false;
    for (int32_t c : nd.children) {
        if (sp.nodes[c].row < 0) {
            break; // the verified children are a prefix of the drawn ones
        }
        if (!q_in) {
            std::fill(q.begin(), q.end(), 0.0);
            for (const auto & e : nd.q) {
                q[e.first] += e.second;
            }
            q_in = true;
        }
        const int32_t x  = sp.nodes[c].token;
        const double  px = p[x], qx = q[x];
        if (qx > 0.0 && specee_sampler_uniform(smpl) * qx < px) {
            child = c;
            return x;
        }
        double sp_sum = 0.0, sq_sum = 0.0;
        for (int32_t t = 0; t < n_vocab; ++t) {
            p[t] = std::max(p[t] - q[t], 0.0);
            sp_sum += p[t];
        }
        q[x] = 0.0;
        for (int32_t t = 0; t < n_vocab; ++t) {
            sq_sum += q[t];
        }
        if (sp_sum <= 0.0) {
            // only rounding gets here (a rejection needs q > p somewhere, hence p > q elsewhere)
            specee_fail("speculative sampling: the residual distribution is empty");
        }
        for (int32_t t = 0; t < n_vocab; ++t) {
            p[t] /= sp_sum;
            q[t] = sq_sum > 0.0 ? q[t] / sq_sum : 0.0;
        }
    }
    // draw from the residual (the target's distribution itself when no child was tried)
    const double u   = specee_sampler_uniform(smpl);
    double       cum = 0.0;
    int32_t      last = -1;
    for (int32_t t = 0; t < n_vocab; ++t) {
        if (p[t] > 0.0) {
            cum += p[t];
            last = t;
            if (u < cum) {
                return t;
            }
        }
    }
    return last;
}

static int32_t spec_step_impl(specee_spec & sp, specee_sampler & smpl, int32_t * out, int32_t n_max) {
    if (sp.root < 0) {
        specee_fail("speculative decoding: call specee_spec_prefill before specee_spec_step");
    }
    if (n_max <= 0 || !out) {
        specee_fail("speculative decoding: no room for output tokens (n_max = %d)", n_max);
    }
    specee_context & ctx    = *sp.ctx;
    const int32_t    n_ctx  = (int32_t) specee_n_ctx(&ctx);
    const int32_t    n_free = n_ctx - specee_kv_n_used(&ctx);
    if (n_free < 1) {
        specee_fail("context full: no KV cell left for the next token (n_ctx = %d)", n_ctx);
    }
    const int32_t budget = std::min({sp.max_nodes, n_free - 1, (int32_t) specee_n_batch(&ctx) - 1});

    // ---- draft
    const auto                 t0    = spec_clock::now();
    const std::vector<int32_t> nodes = draft_tree(sp, smpl, budget);
    sp.stats.t_draft_ms += ms_since(t0);

    // ---- verify root + tree in one pass
    const auto           t1 = spec_clock::now();
    const int32_t        n  = (int32_t) nodes.size() + 1;
    std::vector<int32_t> tok(n), pos(n);
    std::vector<uint8_t> mask((size_t) n * n, 0);
    std::vector<int8_t>  outputs(n, 1);
    tok[0] = sp.root;
    pos[0] = sp.root_pos;
    std::vector<int32_t> row_node(n, 0);
    for (int32_t r = 1; r < n; ++r) {
        const draft_node & nd = sp.nodes[nodes[r - 1]];
        tok[r]                = nd.token;
        pos[r]                = sp.root_pos + nd.depth;
        row_node[r]           = nodes[r - 1];
    }
    for (int32_t r = 0; r < n; ++r) {
        for (int32_t a = row_node[r]; a >= 0; a = sp.nodes[a].parent) {
            mask[(size_t) r * n + sp.nodes[a].row] = 1; // itself and its ancestors
        }
    }
    specee_batch b = {n, tok.data(), pos.data(), mask.data(), outputs.data()};
    if (specee_eval_layers(&ctx, &b, 0, specee_model_n_layer(sp.model), 0) != 0) {
        specee_fail("%s", specee_last_error());
    }
    sp.stats.t_verify_ms += ms_since(t1);

    // ---- walk from the root
    const auto            t2      = spec_clock::now();
    const float *         logits  = specee_get_logits(&ctx);
    const int32_t         n_vocab = sp.n_vocab;
    const bool            greedy  = specee_sampler_greedy(smpl);
    std::vector<int32_t>  emitted;
    std::vector<int32_t>  path; // accepted nodes whose tokens stay in the cache (all emitted tokens but the last)
    std::vector<double>   p, q;
    if (!greedy) {
        p.resize(n_vocab);
        q.resize(n_vocab);
    }
    int32_t cur = 0, n_acc = 0;
    for (;;) {
        const float * lg = logits + (size_t) sp.nodes[cur].row * n_vocab;
        int32_t       child = -1, t;
        if (greedy) {
            t = specee_sampler_sample(&smpl, lg, n_vocab); // the (penalised) argmax
            if (t < 0) {
                specee_fail("%s", specee_last_error());
            }
            for (int32_t c : sp.nodes[cur].children) {
                if (sp.nodes[c].row >= 0 && sp.nodes[c].token == t) {
                    child = c;
                    break;
                }
            }
        } else {
            t = accept_sampled(sp, smpl, cur, lg, p, q, child);
        }
        specee_sampler_accept(&smpl, t);
        emitted.push_back(t);
        n_acc += child >= 0;
        if (child < 0 || (int32_t) emitted.size() >= n_max || specee_token_is_eog(sp.model, t)) {
            break;
        }
        path.push_back(child);
        cur = child;
    }

    // ---- target cache: drop the rejected cells, keep root + path in position order in the batch's first cells
    const int32_t *      cells = specee_kv_batch_cells(&ctx);
    std::vector<uint8_t> keep(n, 0);
    keep[0] = 1;
    for (int32_t ni : path) {
        keep[sp.nodes[ni].row] = 1;
    }
    std::vector<int32_t> drop;
    for (int32_t r = 0; r < n; ++r) {
        if (!keep[r]) {
            drop.push_back(cells[r]);
        }
    }
    std::vector<int32_t> batch_cells(cells, cells + n);
    specee_kv_remove_cells(&ctx, drop.data(), (int32_t) drop.size());
    specee_kv_cache & kv = specee_context_kv(ctx);
    for (size_t j = 0; j < path.size(); ++j) {
        kv.move_cell(batch_cells[sp.nodes[path[j]].row], batch_cells[j + 1]);
    }

    // ---- head cache: drop the tree's cells; the emitted tokens' pairs use the target's features
    for (uint32_t c = 0; c < sp.dkv.size; ++c) {
        if (sp.dkv_tree[c]) {
            sp.dkv.free_cell((int32_t) c);
            sp.dkv_tree[c] = 0;
        }
    }
    const float * norm = specee_get_norm(&ctx);
    for (size_t j = 0; j < emitted.size(); ++j) {
        const int32_t row = j == 0 ? 0 : sp.nodes[path[j - 1]].row;
        sp.pend_feat.insert(sp.pend_feat.end(), norm + (size_t) row * sp.n_embd, norm + (size_t) (row + 1) * sp.n_embd);
        sp.pend_tok.push_back(emitted[j]);
        sp.pend_pos.push_back(sp.root_pos + (int32_t) j);
    }
    sp.root     = emitted.back();
    sp.root_pos = sp.root_pos + (int32_t) emitted.size();
    sp.stats.t_accept_ms += ms_since(t2);

    sp.stats.n_steps++;
    sp.stats.n_drafted += n - 1;
    sp.stats.n_accepted += n_acc;
    sp.stats.n_tokens += (int32_t) emitted.size();
    std::copy(emitted.begin(), emitted.end(), out);
    return (int32_t) emitted.size();
}

static int32_t spec_prefill_impl(specee_spec & sp, specee_sampler & smpl, const int32_t * tokens, int32_t n) {
    if (!tokens || n <= 0) {
        specee_fail("empty prompt: nothing to prefill");
    }
    specee_context & ctx = *sp.ctx;
    const int32_t    p0  = specee_kv_pos_max(&ctx) + 1;
    if (specee_kv_n_used(&ctx) == 0 || sp.root < 0 || sp.root_pos != p0) {
        // a new sequence, or the cache was changed behind our back: the head starts over
        sp.dkv.clear();
        std::fill(sp.dkv_tree.begin(), sp.dkv_tree.end(), 0);
        sp.pend_tok.clear();
        sp.pend_pos.clear();
        sp.pend_feat.clear();
        sp.dangling.clear();
    } else {
        // the last emitted token was not evaluated: its pair is re-formed with whatever token comes next
        sp.dangling.assign(sp.pend_feat.end() - sp.n_embd, sp.pend_feat.end());
        sp.pend_feat.resize(sp.pend_feat.size() - sp.n_embd);
        sp.pend_tok.pop_back();
        sp.pend_pos.pop_back();
    }
    sp.root = -1;

    specee_batch b = {n, tokens, nullptr, nullptr, nullptr};
    if (specee_eval(&ctx, &b) != 0) {
        specee_fail("%s", specee_last_error());
    }
    const float * norm = specee_get_norm(&ctx);
    if (!sp.dangling.empty()) {
        sp.pend_feat.insert(sp.pend_feat.end(), sp.dangling.begin(), sp.dangling.end());
        sp.pend_tok.push_back(tokens[0]);
        sp.pend_pos.push_back(p0 - 1);
    }
    for (int32_t i = 0; i + 1 < n; ++i) {
        sp.pend_feat.insert(sp.pend_feat.end(), norm + (size_t) i * sp.n_embd, norm + (size_t) (i + 1) * sp.n_embd);
        sp.pend_tok.push_back(tokens[i + 1]);
        sp.pend_pos.push_back(p0 + i);
    }
    const int32_t t = specee_sampler_sample(&smpl, specee_get_logits(&ctx), sp.n_vocab);
    if (t < 0) {
        specee_fail("%s", specee_last_error());
    }
    specee_sampler_accept(&smpl, t);
    sp.pend_feat.insert(sp.pend_feat.end(), norm + (size_t) (n - 1) * sp.n_embd, norm + (size_t) n * sp.n_embd);
    sp.pend_tok.push_back(t);
    sp.pend_pos.push_back(p0 + n - 1);
    sp.dangling.clear();
    sp.root     = t;
    sp.root_pos = p0 + n;
    return t;
}

static specee_spec * spec_init_impl(specee_context * ctx, const specee_spec_params & params) {
    if (!ctx) {
        specee_fail("no context");
    }
    const specee_model * model = specee_context_model(*ctx);
    if (!specee_model_has_eagle(model)) {
        specee_fail("speculative decoding needs an EAGLE head: merge one into the model (python -m specee.convert "
                    "merge) or load one with specee_model_load_eagle (--draft-head)");
    }
    auto sp    = std::make_unique<specee_spec>();
    sp->ctx    = ctx;
    sp->model  = model;
    sp->params = params;
    sp->n_embd   = (int32_t) model->hparams.n_embd;
    sp->n_vocab  = (int32_t) model->hparams.n_vocab;
    sp->n_dvocab = specee_model_eagle_n_vocab(model);

    int32_t max_expand = 0;
    if (params.tree == SPECEE_SPEC_TREE_STATIC) {
        sp->shape     = parse_choices(params.choices);
        sp->max_nodes = (int32_t) sp->shape.parent.size() - 1;
        for (int32_t k : sp->shape.n_children) {
            max_expand += k > 0;
        }
    } else if (params.tree == SPECEE_SPEC_TREE_DYNAMIC) {
        if (params.total_tokens < 1 || params.depth < 1 || params.top_k < 1) {
            specee_fail("bad EAGLE-2 tree: total_tokens (%d), depth (%d) and top_k (%d) must be >= 1",
                        params.total_tokens, params.depth, params.top_k);
        }
        if (params.top_k > 256 || params.depth > 64) {
            specee_fail("bad EAGLE-2 tree: top_k (%d) must be <= 256 and depth (%d) <= 64", params.top_k,
                        params.depth);
        }
        sp->max_nodes = params.total_tokens;
        max_expand    = params.top_k * (params.depth - 1);
    } else {
        specee_fail("unknown speculative tree kind %d (0: static EAGLE-1 tree, 1: dynamic EAGLE-2 tree)", params.tree);
    }
    if (sp->max_nodes + 1 > (int32_t) specee_n_batch(ctx)) {
        specee_fail("the draft tree has %d tokens, more than fit in one verification batch (n_batch = %u, root "
                    "included)",
                    sp->max_nodes, specee_n_batch(ctx));
    }

    specee_hparams hp = model->hparams;
    hp.n_layer        = 1;
    sp->dkv.init(hp, specee_n_ctx(ctx) + (uint32_t) max_expand + 1, specee_context_buft(*ctx));
    sp->dkv_tree.assign(sp->dkv.size, 0);
    sp->graph_meta.resize(ggml_tensor_overhead() * sp->graph_size + ggml_graph_overhead_custom(sp->graph_size, false));
    return sp.release();
}

// The head alone over pairs at positions 0.. (its cache is cleared before and after: prefill again to decode)
static void spec_eval_head_impl(specee_spec & sp, const int32_t * tokens, const float * feats, int32_t n,
                                float * logits, float * out) {
    if (!tokens || !feats || n <= 0) {
        specee_fail("no pairs to evaluate");
    }
    for (int32_t i = 0; i < n; ++i) {
        if (tokens[i] < 0 || tokens[i] >= sp.n_vocab) {
            specee_fail("token id %d at index %d is out of range [0, %d)", tokens[i], i, sp.n_vocab);
        }
    }
    auto reset = [&] {
        sp.dkv.clear();
        std::fill(sp.dkv_tree.begin(), sp.dkv_tree.end(), 0);
        sp.pend_tok.clear();
        sp.pend_pos.clear();
        sp.pend_feat.clear();
        sp.dangling.clear();
        sp.root = -1;
    };
    reset();
    const int32_t n_batch = (int32_t) specee_n_batch(sp.ctx);
    if (n > (int32_t) sp.dkv.size) {
        specee_fail("%d pairs do not fit the head's cache of %u cells", n, sp.dkv.size);
    }
    for (int32_t i0 = 0; i0 < n; i0 += n_batch) {
        const int32_t        m = std::min(n_batch, n - i0);
        std::vector<int32_t> tok(tokens + i0, tokens + i0 + m), pos(m), rows(m);
        for (int32_t i = 0; i < m; ++i) {
            pos[i]  = i0 + i;
            rows[i] = i;
        }
        draft_eval(sp, tok, feats + (size_t) i0 * sp.n_embd, pos, nullptr, rows);
        if (logits) {
            std::copy(sp.d_logits.begin(), sp.d_logits.end(), logits + (size_t) i0 * sp.n_dvocab);
        }
        if (out) {
            std::copy(sp.d_out.begin(), sp.d_out.end(), out + (size_t) i0 * sp.n_embd);
        }
    }
    reset();
}

// ---- C API -------------------------------------------------------------------------------------------

extern "C" struct specee_spec_params specee_spec_default_params(void) {
    specee_spec_params p;
    p.tree         = SPECEE_SPEC_TREE_DYNAMIC;
    p.choices      = nullptr;
    p.total_tokens = 1; // see DEFAULT_CHOICES: on a CPU the smallest tree is the fastest
    p.depth        = 1;
    p.top_k        = 1;
    return p;
}

extern "C" specee_spec * specee_spec_init(specee_context * ctx, struct specee_spec_params params) {
    return specee_guard<specee_spec *>(nullptr, [&] { return spec_init_impl(ctx, params); });
}

extern "C" void specee_spec_free(specee_spec * spec) { delete spec; }

extern "C" int32_t specee_spec_prefill(specee_spec * spec, specee_sampler * smpl, const int32_t * tokens,
                                       int32_t n_tokens) {
    return specee_guard<int32_t>(-1, [&] {
        if (!spec || !smpl) {
            specee_fail("no speculative decoder or no sampler");
        }
        return spec_prefill_impl(*spec, *smpl, tokens, n_tokens);
    });
}

extern "C" int32_t specee_spec_step(specee_spec * spec, specee_sampler * smpl, int32_t * tokens, int32_t n_max) {
    return specee_guard<int32_t>(-1, [&] {
        if (!spec || !smpl) {
            specee_fail("no speculative decoder or no sampler");
        }
        return spec_step_impl(*spec, *smpl, tokens, n_max);
    });
}

extern "C" struct specee_spec_stats specee_spec_get_stats(const specee_spec * spec) { return spec->stats; }

extern "C" void specee_spec_reset_stats(specee_spec * spec) { spec->stats = specee_spec_stats{}; }

extern "C" int32_t specee_spec_eval_head(specee_spec * spec, const int32_t * tokens, const float * features,
                                         int32_t n, float * logits, float * out) {
    return specee_guard<int32_t>(-1, [&] {
        if (!spec) {
            specee_fail("no speculative decoder");
        }
        spec_eval_head_impl(*spec, tokens, features, n, logits, out);
        return 0;
    });
}

extern "C" int32_t specee_spec_check_choices(const char * choices) {
    return specee_guard<int32_t>(-1, [&] { return (int32_t) parse_choices(choices).parent.size() - 1; });
}

void specee_draft_commit(specee_spec & sp) { draft_commit_pending(sp); }
