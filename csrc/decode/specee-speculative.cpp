// specee-speculative.cpp: EAGLE tree speculative decoding, lossless.
//
// One step: the EAGLE head drafts a tree of tokens after the last emitted token (the root), the target
// verifies root + tree in one batched pass (tree mask, per-token positions), and a walk from the root
// emits the accepted path plus one token from the target's own distribution. The rejected branches' KV
// cells are dropped and the accepted ones moved into position order.
//
//   draft head   specee-draft-head.h: pairs (f_i, t_{i+1}) in the head's one-layer cache; the tree's nodes are
//                drafted with the head's own output feature in place of f, in cells dropped after the step.
//   trees        EAGLE-1: a fixed shape from a choices list ("[[0], [1], [0, 0]]": each path lists child
//                ranks from the root). EAGLE-2: top_k children of the root; at each further depth the
//                top_k nodes of the newest depth (by cumulative log-probability) get top_k children each;
//                then the best total_tokens drafted nodes make the tree.
//   acceptance   greedy: follow the child equal to the target's argmax. Sampling: per depth, recursive
//                rejection sampling over the children (see accept_sampled), lossless; children that are all point
//                masses: plain decoding's draw, the child equal to it accepted (points_only).
#include "specee-speculative.h"

#include "specee-context.h"
#include "specee-grammar.h"
#include "specee-impl.h"
#include "specee-model.h"
#include "specee-sampling.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

// ---- drafting ----------------------------------------------------------------------------------------

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
//
// Under a grammar, the children are the best (greedy) or the drawn (sampling) tokens the grammar allows after the
// node's path: a candidate it refuses is skipped (stats.n_grammar_masked) and the next one taken, among the head's
// best MASK_SCAN beyond k (greedy); sampling takes q over the allowed tokens of its support, renormalized, where that
// support has at most MASK_SCAN_Q tokens (else the drafts are drawn from q unmasked and specee_tree_filter drops the
// refused ones). Either way what the tree holds is what the target could emit, and the acceptance test sees the q the
// children were drawn from.
static const int32_t MASK_SCAN   = 16;
static const int32_t MASK_SCAN_Q = 64;

// the tokens from the root's child down to node ni (empty for the root)
static std::vector<int32_t> path_tokens(const specee_tree_decoder & dec, int32_t ni) {
    std::vector<int32_t> path;
    for (int32_t a = ni; a > 0; a = dec.nodes[a].parent) {
        path.push_back(dec.nodes[a].token);
    }
    std::reverse(path.begin(), path.end());
    return path;
}

// whether the grammar allows `token` after the path (path's last slot is overwritten)
static bool grammar_allows_after(specee_grammar & g, std::vector<int32_t> & path, int32_t token) {
    path.back() = token;
    return specee_grammar_valid_prefix(g, path.data(), (int32_t) path.size()) == (int32_t) path.size();
}

static void draft_children(specee_tree_decoder & dec, specee_step step, int32_t ni, const float * logits, int32_t k) {
    const specee_draft_head & head = *step.head;
    specee_sampler &          smpl = step.smpl;
    specee_grammar *          gr   = k > 0 ? specee_sampler_grammar(smpl) : nullptr;
    std::vector<int32_t>      path;
    if (gr) {
        path = path_tokens(dec, ni);
        path.push_back(-1); // the candidate's slot
    }
    if (dec.n_cand > 0) {
        // tree exit: the candidates its checks score at this node, as early exit takes them (the head's top n_cand)
        std::vector<int32_t> & cand = dec.nodes[ni].cand;
        cand                        = specee_top_k(logits, head.n_dvocab, dec.n_cand);
        for (int32_t & c : cand) {
            c = specee_draft_target_id(head, c);
        }
    }
    std::vector<std::pair<int32_t, float>> picks; // (draft row, log-probability)
    if (specee_sampler_greedy(smpl)) {
        float mx = -INFINITY;
        for (int32_t i = 0; i < head.n_dvocab; ++i) {
            mx = std::max(mx, logits[i]);
        }
        double sum = 0.0;
        for (int32_t i = 0; i < head.n_dvocab; ++i) {
            sum += std::exp((double) logits[i] - mx);
        }
        const float lse = mx + (float) std::log(sum);
        for (int32_t i : specee_top_k(logits, head.n_dvocab, gr ? std::min(head.n_dvocab, k + MASK_SCAN) : k)) {
            if ((int32_t) picks.size() == k) {
                break;
            }
            if (gr && !grammar_allows_after(*gr, path, specee_draft_target_id(head, i))) {
                step.stats.n_grammar_masked++;
                continue;
            }
            picks.emplace_back(i, logits[i] - lse);
        }
    } else {
        sparse_dist q;
        specee_sampler_dist(smpl, logits, head.n_dvocab, false, q);
        if (gr && (int32_t) q.size() <= MASK_SCAN_Q) {
            sparse_dist allowed;
            double      mass = 0.0;
            for (const auto & e : q) {
                if (grammar_allows_after(*gr, path, specee_draft_target_id(head, e.first))) {
                    allowed.push_back(e);
                    mass += e.second;
                } else {
                    step.stats.n_grammar_masked++;
                }
            }
            for (auto & e : allowed) {
                e.second = (float) (e.second / mass);
            }
            q = std::move(allowed);
        }
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
            e.first = specee_draft_target_id(head, e.first);
        }
        dec.nodes[ni].q = std::move(q);
    }

    float run_min = dec.nodes[ni].score;
    for (int32_t i = 0; i < (int32_t) picks.size(); ++i) {
        draft_node c;
        c.token  = specee_draft_target_id(head, picks[i].first);
        c.parent = ni;
        c.depth  = dec.nodes[ni].depth + 1;
        run_min  = std::min(run_min, dec.nodes[ni].score + picks[i].second);
        c.score  = run_min;
        dec.nodes[ni].children.push_back((int32_t) dec.nodes.size());
        dec.nodes.push_back(std::move(c));
    }
}

// draft cells of a node's ancestors below the root (the root's pair is committed)
static std::vector<int32_t> ancestor_cells(const specee_tree_decoder & dec, int32_t ni) {
    std::vector<int32_t> cells;
    for (int32_t a = dec.nodes[ni].parent; a > 0; a = dec.nodes[a].parent) {
        cells.push_back(dec.nodes[a].dcell);
    }
    return cells;
}

// Runs the head on tree nodes (pairs of the parent's output feature and the node's token) and draws each
// one's children: k_of(node) of them.
template <typename K>
static void draft_expand(specee_tree_decoder & dec, specee_step step, const std::vector<int32_t> & batch, K k_of) {
    specee_draft_head & head = *step.head;
    const int32_t       n    = (int32_t) batch.size();
    if (n == 0) {
        return;
    }
    std::vector<int32_t>              tok(n), pos(n), rows(n);
    std::vector<float>                feats((size_t) n * head.n_embd);
    std::vector<std::vector<int32_t>> anc(n);
    for (int32_t i = 0; i < n; ++i) {
        const draft_node & nd = dec.nodes[batch[i]];
        tok[i]                = nd.token;
        pos[i]                = step.root_pos + nd.depth - 1;
        rows[i]               = i;
        anc[i]                = ancestor_cells(dec, batch[i]);
        const std::vector<float> & ph = dec.nodes[nd.parent].h;
        std::copy(ph.begin(), ph.end(), feats.begin() + (size_t) i * head.n_embd);
    }
    const std::vector<int32_t> cells  = specee_draft_eval(head, tok, feats.data(), pos, &anc, rows);
    const std::vector<float>   logits = head.logits;
    for (int32_t i = 0; i < n; ++i) {
        draft_node & nd = dec.nodes[batch[i]];
        nd.dcell        = cells[i];
        nd.h.assign(head.out.begin() + (size_t) i * head.n_embd, head.out.begin() + (size_t) (i + 1) * head.n_embd);
    }
    for (int32_t i = 0; i < n; ++i) {
        draft_children(dec, step, batch[i], logits.data() + (size_t) i * head.n_dvocab, k_of(batch[i]));
    }
}

// the nodes from index `first` on, in order: a depth just drafted, or (from 1) every drafted node
static std::vector<int32_t> nodes_from(const specee_tree_decoder & dec, size_t first) {
    std::vector<int32_t> out;
    for (size_t ni = first; ni < dec.nodes.size(); ++ni) {
        out.push_back((int32_t) ni);
    }
    return out;
}

// EAGLE-1: the static shape's first `budget` nodes, drafted depth by depth; the drafted nodes in the choices' order
static std::vector<int32_t> draft_static(specee_tree_decoder & dec, specee_step step, int32_t budget,
                                         const float * root_logits) {
    // the shape's first `budget` nodes (breadth-first, so a tree); node i of a depth is expanded when its
    // shape node has children inside the budget
    const tree_shape &   sh      = dec.shape;
    const int32_t        n_shape = std::min<int32_t>(budget, (int32_t) sh.parent.size() - 1) + 1;
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
        const std::vector<int32_t> & kids = dec.nodes[ni].children;
        for (size_t j = 0; j < kids.size(); ++j) {
            dec.nodes[kids[j]].shape = shape_kids[dec.nodes[ni].shape][j];
        }
    };
    draft_children(dec, step, 0, root_logits, n_kids[0]);
    assign_shapes(0);
    std::vector<int32_t> level = dec.nodes[0].children;
    while (!level.empty()) {
        std::vector<int32_t> expand;
        for (int32_t ni : level) {
            if (n_kids[dec.nodes[ni].shape] > 0) {
                expand.push_back(ni);
            }
        }
        const size_t first_new = dec.nodes.size();
        draft_expand(dec, step, expand, [&](int32_t ni) { return n_kids[dec.nodes[ni].shape]; });
        for (int32_t ni : expand) {
            assign_shapes(ni);
        }
        level = nodes_from(dec, first_new);
    }
    // breadth-first by shape index = the order of the choices
    std::vector<int32_t> chosen = nodes_from(dec, 1);
    std::sort(chosen.begin(), chosen.end(),
              [&](int32_t a, int32_t b) { return dec.nodes[a].shape < dec.nodes[b].shape; });
    return chosen;
}

// EAGLE-2: the top_k best nodes of each depth expanded, then the best `budget` of all drafted nodes, by depth
static std::vector<int32_t> draft_dynamic(specee_tree_decoder & dec, specee_step step, int32_t budget,
                                          const float * root_logits) {
    const int32_t top_k = dec.params.topk;
    draft_children(dec, step, 0, root_logits, top_k);
    std::vector<int32_t> level = dec.nodes[0].children;
    for (int32_t d = 1; d < dec.params.depth && !level.empty(); ++d) {
        // the top_k nodes of the newest depth by score (earlier drawn first on ties)
        std::stable_sort(level.begin(), level.end(),
                         [&](int32_t a, int32_t b) { return dec.nodes[a].score > dec.nodes[b].score; });
        level.resize(std::min<size_t>(level.size(), (size_t) top_k));
        std::sort(level.begin(), level.end());
        const size_t first_new = dec.nodes.size();
        draft_expand(dec, step, level, [&](int32_t) { return top_k; });
        level = nodes_from(dec, first_new);
    }
    // rerank every drafted node: the best `budget` (scores do not increase from parent to child or
    // along siblings, and ties go to the earlier node, so the chosen set is a tree)
    std::vector<int32_t> chosen = nodes_from(dec, 1);
    std::stable_sort(chosen.begin(), chosen.end(),
                     [&](int32_t a, int32_t b) { return dec.nodes[a].score > dec.nodes[b].score; });
    chosen.resize(std::min<size_t>(chosen.size(), (size_t) budget));
    std::sort(chosen.begin(), chosen.end(), [&](int32_t a, int32_t b) {
        return dec.nodes[a].depth != dec.nodes[b].depth ? dec.nodes[a].depth < dec.nodes[b].depth : a < b;
    });
    return chosen;
}

// Drafts the tree of this step: dec.nodes (root first); the nodes to verify get rows 1.. in breadth-first
// order, at most `budget` of them. Returns the verified nodes in row order.
std::vector<int32_t> specee_tree_draft(specee_tree_decoder & dec, specee_step step, int32_t budget) {
    specee_draft_head & head = *step.head;
    dec.nodes.clear();
    draft_node rn;
    rn.token = step.root;
    dec.nodes.push_back(rn);
    specee_draft_commit(head);
    dec.nodes[0].h = head.out;
    const std::vector<float> root_logits(head.logits.begin(), head.logits.begin() + head.n_dvocab);

    if (budget <= 0) {
        dec.nodes[0].row = 0;
        if (dec.n_cand > 0) {
            draft_children(dec, step, 0, root_logits.data(), 0); // the root's candidates only
        }
        return {};
    }
    std::vector<int32_t> chosen = dec.dynamic ? draft_dynamic(dec, step, budget, root_logits.data())
                                              : draft_static(dec, step, budget, root_logits.data());
    if ((int32_t) chosen.size() > budget) {
        chosen.resize(budget);
    }
    dec.nodes[0].row = 0;
    for (size_t r = 0; r < chosen.size(); ++r) {
        dec.nodes[chosen[r]].row = (int32_t) r + 1;
    }
    if (dec.n_cand > 0) {
        // tree exit: the verified leaves get candidates too (one more head pass, no children), so that a pass that
        // exits at a leaf still ends with the target's own token there, as a full pass does
        std::vector<int32_t> leaves;
        for (int32_t ni : chosen) {
            if (dec.nodes[ni].h.empty()) {
                leaves.push_back(ni);
            }
        }
        draft_expand(dec, step, leaves, [](int32_t) { return 0; });
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
static int32_t accept_sampled(const specee_tree_decoder & dec, specee_sampler & smpl, int32_t n_vocab, int32_t ni,
                              const float * logits, std::vector<double> & p, std::vector<double> & q, int32_t & child) {
    sparse_dist   dist;
    specee_sampler_dist(smpl, logits, n_vocab, true, dist);
    std::fill(p.begin(), p.end(), 0.0);
    for (const auto & e : dist) {
        p[e.first] = e.second;
    }
    child                 = -1;
    const draft_node & nd = dec.nodes[ni];
    bool               q_in = false;
    for (int32_t c : nd.children) {
        // a child the grammar refused (specee_tree_filter) is a draft rejected for sure: p(x) = 0, so the test below
        // would reject it whatever the uniform; it takes no uniform, the residuals are updated as for any rejection
        const bool refused = dec.nodes[c].refused;
        if (dec.nodes[c].row < 0 && !refused) {
            break; // the verified children (and refused ones) are a prefix of the drawn ones
        }
        const int32_t x = dec.nodes[c].token;
        if (nd.q.empty() || dec.nodes[c].point) {
            // a drafter's point mass (n-gram lookup, alone or grafted into the head's tree): its own proposal, q =
            // [x], so x is accepted with probability p(x) and a rejection leaves norm(max(p - [x], 0)): p without x.
            // The head's children drawn from q are independent of it, so the head's running q stays as it was.
            if (!refused && specee_sampler_uniform(smpl) < p[x]) {
                child = c;
                return x;
            }
            p[x] = 0.0;
            double sp_sum = 0.0;
            for (int32_t t = 0; t < n_vocab; ++t) {
                sp_sum += p[t];
            }
            if (sp_sum <= 0.0) {
                specee_fail("speculative sampling: the residual distribution is empty");
            }
            for (int32_t t = 0; t < n_vocab; ++t) {
                p[t] /= sp_sum;
            }
            continue;
        }
        if (!q_in) {
            std::fill(q.begin(), q.end(), 0.0);
            for (const auto & e : nd.q) {
                q[e.first] += e.second;
            }
            q_in = true;
        }
        const double px = p[x], qx = q[x];
        if (!refused && qx > 0.0 && specee_sampler_uniform(smpl) * qx < px) {
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

specee_batch specee_tree_batch::view() const {
    return {(int32_t) tok.size(), tok.data(), pos.data(), mask.data(), outputs.data()};
}

specee_tree_batch specee_tree_verify_batch(const specee_tree_decoder & dec, int32_t root, int32_t root_pos,
                                           const std::vector<int32_t> & nodes) {
    const int32_t        n = (int32_t) nodes.size() + 1;
    specee_tree_batch    b;
    std::vector<int32_t> row_node(n, 0);
    b.tok.resize(n);
    b.pos.resize(n);
    b.mask.assign((size_t) n * n, 0);
    b.outputs.assign(n, 1);
    b.tok[0] = root;
    b.pos[0] = root_pos;
    for (int32_t r = 1; r < n; ++r) {
        const draft_node & nd = dec.nodes[nodes[r - 1]];
        b.tok[r]              = nd.token;
        b.pos[r]              = root_pos + nd.depth;
        row_node[r]           = nodes[r - 1];
    }
    for (int32_t r = 0; r < n; ++r) {
        for (int32_t a = row_node[r]; a >= 0; a = dec.nodes[a].parent) {
            b.mask[(size_t) r * n + dec.nodes[a].row] = 1; // itself and its ancestors
        }
    }
    return b;
}

std::vector<int32_t> specee_tree_filter(specee_tree_decoder & dec, specee_step step, const std::vector<int32_t> & nodes) {
    specee_grammar * g = specee_sampler_grammar(step.smpl);
    if (!g || nodes.empty()) {
        return nodes;
    }
    // rows grow along every path (a parent's row before its children's), so parents are judged first
    std::vector<int32_t> kept, path;
    for (int32_t ni : nodes) {
        draft_node & nd = dec.nodes[ni];
        nd.refused      = nd.parent > 0 && dec.nodes[nd.parent].refused;
        if (!nd.refused) {
            path.clear();
            for (int32_t a = ni; a > 0; a = dec.nodes[a].parent) {
                path.push_back(dec.nodes[a].token);
            }
            std::reverse(path.begin(), path.end());
            nd.refused = specee_grammar_valid_prefix(*g, path.data(), (int32_t) path.size()) < (int32_t) path.size();
        }
        if (nd.refused) {
            nd.row = -1;
            step.stats.n_grammar_dropped++;
        } else {
            nd.row = (int32_t) kept.size() + 1;
            kept.push_back(ni);
        }
    }
    return kept;
}

int32_t specee_tree_pass(const specee_tree_decoder & dec, specee_step step, const std::vector<int32_t> & nodes) {
    const specee_tree_batch tb = specee_tree_verify_batch(dec, step.root, step.root_pos, nodes);
    const specee_batch      b  = tb.view();
    specee_sampler_prefetch(step.smpl); // the root row's mask, while the pass runs
    specee_eval_layers_impl(step.ctx, &b, 0, (int32_t) step.ctx.model->hparams.n_layer, 0);
    return b.n_tokens;
}

int32_t specee_tree_verify(specee_tree_decoder & dec, specee_step step, const std::vector<int32_t> & nodes) {
    return specee_tree_pass(dec, step, specee_tree_filter(dec, step, nodes));
}

std::vector<int32_t> specee_tree_chain(specee_tree_decoder & dec, int32_t root, const std::vector<int32_t> & tokens) {
    dec.nodes.assign(1, draft_node{});
    dec.nodes[0].token = root;
    dec.nodes[0].row   = 0;
    std::vector<int32_t> nodes;
    for (int32_t k = 0; k < (int32_t) tokens.size(); ++k) {
        draft_node nd;
        nd.token  = tokens[k];
        nd.parent = k;
        nd.depth  = k + 1;
        nd.row    = k + 1;
        dec.nodes.push_back(nd);
        dec.nodes[k].children.push_back(k + 1);
        nodes.push_back(k + 1);
    }
    return nodes;
}

// Walks the verified tree from the root: each step draws the target's token at the current node and moves to the
// child that drafted it, until no child did (or n_max tokens, or an end of generation).
// Whether a node's children are all point masses (a drafter without a distribution: n-gram lookup, a draft model's
// greedy chain; or none at all). Then sampling draws the target's token as plain decoding draws it, and a child is
// accepted where it is that token: each child x is accepted with probability p(x), as the point-mass test of
// accept_sampled accepts it (there, rejected children leave the residual p without them), so the distribution is the
// same, and the sampler's draws are plain decoding's: a seeded run emits plain decoding's tokens (as llama.cpp's).
static bool points_only(const specee_tree_decoder & dec, int32_t ni) {
    const draft_node & nd = dec.nodes[ni];
    if (nd.q.empty()) {
        return true;
    }
    for (int32_t c : nd.children) {
        if ((dec.nodes[c].row >= 0 || dec.nodes[c].refused) && !dec.nodes[c].point) {
            return false;
        }
    }
    return true;
}

int32_t specee_tree_walk(specee_tree_decoder & dec, specee_step step, int32_t n_max, specee_node_logits logits_of,
                         void * user, std::vector<int32_t> & emitted, std::vector<int32_t> & path) {
    specee_sampler &    smpl    = step.smpl;
    const int32_t       n_vocab = (int32_t) step.ctx.model->hparams.n_vocab;
    const bool          greedy  = specee_sampler_greedy(smpl);
    std::vector<double> p, q;
    if (!greedy) {
        p.resize(n_vocab);
        q.resize(n_vocab);
    }
    int32_t cur = 0, n_acc = 0;
    // a replay forces how many drafted tokens this step accepts: the best-ranked verified child at each depth
    const int32_t replay = dec.params.n_replay > 0 ?
                               dec.params.replay[dec.n_replayed++ % (size_t) dec.params.n_replay] : -1;
    for (;;) {
        const float * lg    = logits_of(user, cur);
        int32_t       child = -1, t;
        if (!dec.synth.empty()) {
            t = specee_sampler_sample_impl(smpl, lg, n_vocab); // the target's token, where the draft is not taken
            const int32_t depth = dec.nodes[cur].depth;
            for (int32_t c : dec.nodes[cur].children) {
                if (dec.nodes[c].row < 0) {
                    continue;
                }
                const double u = std::uniform_real_distribution<double>(0.0, 1.0)(dec.synth_rng);
                if (depth < (int32_t) dec.synth.size() && u < dec.synth[depth] &&
                    !specee_token_is_eog(step.ctx.model, dec.nodes[c].token)) {
                    child = c;
                    t     = dec.nodes[c].token;
                }
                break;
            }
        } else if (replay >= 0) {
            t = specee_sampler_sample_impl(smpl, lg, n_vocab); // the bonus token, where the replay stops
            for (int32_t c : dec.nodes[cur].children) {
                if (n_acc < replay && dec.nodes[c].row >= 0) {
                    child = c;
                    t     = dec.nodes[c].token;
                    break;
                }
            }
        } else if (greedy || points_only(dec, cur)) {
            t = specee_sampler_sample_impl(smpl, lg, n_vocab); // the (penalised) argmax, or plain decoding's draw
            for (int32_t c : dec.nodes[cur].children) {
                if (dec.nodes[c].row >= 0 && dec.nodes[c].token == t) {
                    child = c;
                    break;
                }
            }
        } else {
            t = accept_sampled(dec, smpl, n_vocab, cur, lg, p, q, child);
        }
        specee_sampler_accept_impl(smpl, t);
        emitted.push_back(t);
        n_acc += child >= 0;
        if (child < 0 || (int32_t) emitted.size() >= n_max || specee_token_is_eog(step.ctx.model, t)) {
            break;
        }
        path.push_back(child);
        cur = child;
    }
    return n_acc;
}

const float * specee_tree_pass_logits(void * user, int32_t node) {
    const specee_tree_pass_rows & pr = *(const specee_tree_pass_rows *) user;
    return pr.logits + (size_t) pr.dec->nodes[node].row * pr.n_vocab;
}

void specee_tree_keep(specee_tree_decoder & dec, specee_step step, int32_t n, const std::vector<int32_t> & emitted,
                      const std::vector<int32_t> & path, const float * feats, int32_t row0) {
    specee_context &           ctx = step.ctx;
    const std::vector<int32_t> cells(ctx.cells.begin() + row0, ctx.cells.begin() + row0 + n);
    std::vector<uint8_t>       keep(n, 0);
    keep[0] = 1;
    for (int32_t ni : path) {
        keep[dec.nodes[ni].row] = 1;
    }
    for (int32_t r = 0; r < n; ++r) {
        if (!keep[r]) {
            ctx.kv.free_cell(cells[r]);
        }
    }
    for (size_t j = 0; j < path.size(); ++j) {
        ctx.kv.move_cell(cells[dec.nodes[path[j]].row], cells[j + 1]);
    }

    if (!step.head) {
        return; // a drafter without a head (n-gram lookup) keeps nothing else
    }
    specee_draft_head & head = *step.head;
    specee_draft_drop_tree(head);
    for (size_t j = 0; j < emitted.size(); ++j) {
        const int32_t row  = j == 0 ? 0 : dec.nodes[path[j - 1]].row;
        const float * feat = feats ? feats + j * (size_t) head.n_feat : specee_context_feature(ctx, row0 + row);
        specee_draft_add_pair(head, feat, emitted[j], step.root_pos + (int32_t) j);
    }
}

int32_t specee_tree_verified_child(const specee_tree_decoder & dec, int32_t parent, int32_t token) {
    for (int32_t k : dec.nodes[parent].children) {
        if (dec.nodes[k].row >= 0 && dec.nodes[k].token == token) {
            return k;
        }
    }
    return -1;
}

// ---- set-up ------------------------------------------------------------------------------------------

void specee_tree_init(specee_tree_decoder & dec, bool dynamic, const specee_eagle_params & params) {
    dec.dynamic    = dynamic;
    dec.params     = params;
    dec.n_replayed = 0;
    dec.max_expand = 0;
    if (!dynamic) {
        dec.shape     = specee_tree_parse_choices(params.choices);
        dec.max_nodes = (int32_t) dec.shape.parent.size() - 1;
        for (int32_t k : dec.shape.n_children) {
            dec.max_expand += k > 0;
        }
        return;
    }
    // the sizes were checked with the options (specee_generator_check_values) and resolved to >= 1 by the generator
    dec.max_nodes  = params.total_tokens;
    dec.max_expand = params.topk * (params.depth - 1);
}
