// specee-tree-exit.cpp: tree exit, SpecEE's early exit inside an EAGLE tree's verification pass (greedy, lossy by
// design; mode tree-exit).
//
// One step drafts a tree as EAGLE does (specee-speculative.cpp: EAGLE-2's dynamic tree, or EAGLE-1's static one), and
// keeps, for every node the head expands, the head's top n_cand tokens there: its candidates, as single-token early
// exit takes them (specee-early-exit.cpp; what both share, the predictors' features, the schedule and what follows an
// exit, is specee-exit.cpp's). The verified leaves, which EAGLE never expands, are expanded too (one more
// head pass over them, drawing no children): every verified row has candidates, so a pass that exits at a leaf still
// ends with the target's own token there, as a full pass does. (Without it a step whose walk reaches a leaf would end
// one token short; on the 7B-shaped file's default tree, where the deepest accepted node is always a leaf, that cost
// 0.6 tokens a step for a head pass worth ~0.05 of one: docs/early-exit.md.) The target then verifies root + tree
// layer range by layer range, over early exit's schedule (the static set, plus e-2, e, e+2 around the last exits). At
// a scheduled layer s:
//
//   features   for every verified row, SpecEE's 12 features of the row's hidden state after layer s:
//              c = lm_head[cand] . final_norm(h_s), p = softmax(c), p - p_prev, with p_prev the row's p at the
//              previous checked layer (at its first check, p itself)
//   path       from the root, the verified child whose token is the node's best candidate (its largest c), while
//              there is one; under a replayed acceptance (eagle.replay) the replay's path instead: the first verified
//              child, as many times as the replay says
//   fire       layer s's predictor on every row of the path: the pass fires when each of them is > threshold
//   check      the full logits at layer s (final norm + lm_head) of the path's rows, then the greedy walk over them
//              exactly as a verification pass's walk (specee_tree_walk): the target's argmax at each node, to the
//              child that drafted it, and the argmax where no child did. The pass exits iff every emitted token is
//              among the candidates of the node it was drawn at. A walk that leaves the scored path (a near-tie
//              between the host's candidate logits and the graph's) gets the rows it reaches computed as it reaches
//              them.
//
// A check that fails goes on to the next scheduled layer; past the last one the pass runs every layer and the step is
// EAGLE's own. A replayed exit layer (exit.replay) ends the pass there whatever the predictors and candidates say.
// After an exit the accepted rows' K/V in the skipped layers follow exit.kv as single-token exits do: `mask` leaves
// them invalid (later tokens do not see them there), `fill` computes them from the exit layer's output. The draft
// head's pairs take the exit layer's final-norm output as the feature (EAGLE-3: its feature layers past the exit
// layer are the exit layer's output).
//
// Stats (specee_generator_stats): per step n_steps, n_drafted, n_accepted as EAGLE; n_exits (passes that stopped
// early), n_layers_run (layers the pass ran), n_checks (scheduled layers checked), n_fired (checks whose whole path
// fired), n_rejected (fired, but a token was not a candidate); t_verify_ms the pass's layers, t_check_ms the features
// and predictors, t_exit_ms the exit layers' lm_head, t_fill_ms the filled K/V.
#include "specee-tree-exit.h"

#include "specee-context.h"
#include "specee-draft-head.h"
#include "specee-impl.h"
#include "specee-model.h"
#include "specee-sampling.h"

#include <algorithm>
#include <memory>
#include <vector>

// the rows of these nodes
static std::vector<int32_t> rows_of(const specee_tree_decoder & dec, const std::vector<int32_t> & nodes) {
    std::vector<int32_t> rows;
    for (int32_t ni : nodes) {
        rows.push_back(dec.nodes[ni].row);
    }
    return rows;
}

// ---- the exit layer's logits, computed for the rows a walk needs ---------------------------------------------

struct exit_rows {
    specee_context *            ctx   = nullptr;
    const specee_tree_decoder * dec   = nullptr;
    int32_t                     layer = -1; // the exit layer (its output is in the context's state)
    std::vector<int32_t>        slot;       // [nodes] where a node's rows are in logits / norm, -1: not computed
    std::vector<float>          logits;     // [slots][n_vocab]
    std::vector<float>          norm;       // [slots][n_embd]
};

// the final norm and lm_head at the exit layer for these nodes' rows, in one graph
static void compute_exit_rows(exit_rows & er, const std::vector<int32_t> & nodes) {
    const int32_t first = (int32_t) (er.logits.size() / er.ctx->model->hparams.n_vocab);
    exit_layer_logits(*er.ctx, er.layer, rows_of(*er.dec, nodes), er.norm, er.logits);
    for (size_t i = 0; i < nodes.size(); ++i) {
        er.slot[nodes[i]] = first + (int32_t) i;
    }
}

// specee_node_logits for the walk: a node's row's logits at the exit layer, computed when first needed
static const float * exit_logits_of(void * user, int32_t node) {
    exit_rows & er = *(exit_rows *) user;
    if (er.slot[node] < 0) {
        compute_exit_rows(er, {node});
    }
    return er.logits.data() + (size_t) er.slot[node] * er.ctx->model->hparams.n_vocab;
}

// the exit layer's final-norm output of these nodes' rows [nodes][n_embd] (computed: nodes the walk visited)
static std::vector<float> norms_of(const exit_rows & er, const std::vector<int32_t> & nodes) {
    const int64_t      n_embd = er.ctx->model->hparams.n_embd;
    std::vector<float> norm;
    for (int32_t ni : nodes) {
        const float * nrm = er.norm.data() + (size_t) er.slot[ni] * n_embd;
        norm.insert(norm.end(), nrm, nrm + n_embd);
    }
    return norm;
}

// ---- the checks at a layer ----------------------------------------------------------------------------------

// The nodes the checks score (see the top of the file): from the root, the verified child that the node's best
// candidate (or, replayed, the first verified child) names; at most n_max nodes
static std::vector<int32_t> scored_path(const specee_tree_decoder & dec, const exit_checks & ec, int32_t n_cand,
                                        int32_t replay, int32_t n_max) {
    std::vector<int32_t> path = {0};
    for (int32_t cur = 0; (int32_t) path.size() < n_max;) {
        const draft_node &         nd   = dec.nodes[cur];
        const std::vector<float> & feat = ec.feat[nd.row];
        int32_t                    next = -1;
        for (int32_t c : nd.children) {
            if (dec.nodes[c].row < 0) {
                continue;
            }
            if (replay >= 0) {
                next = (int32_t) path.size() <= replay ? c : -1;
                break;
            }
            if (!feat.empty()) {
                const int32_t best = (int32_t) (std::max_element(feat.begin(), feat.begin() + n_cand) - feat.begin());
                if (dec.nodes[c].token == nd.cand[best]) {
                    next = c;
                    break;
                }
            }
        }
        if (next < 0) {
            break;
        }
        path.push_back(next);
        cur = next;
    }
    return path;
}

// every emitted token is among the candidates of the node it was drawn at (the root for the first, path[j - 1] for
// token j)
static bool tokens_are_candidates(const specee_tree_decoder & dec, const std::vector<int32_t> & emitted,
                                  const std::vector<int32_t> & path) {
    for (size_t j = 0; j < emitted.size(); ++j) {
        const std::vector<int32_t> & cand = dec.nodes[j == 0 ? 0 : path[j - 1]].cand;
        if (std::find(cand.begin(), cand.end(), emitted[j]) == cand.end()) {
            return false;
        }
    }
    return true;
}

// ---- the step --------------------------------------------------------------------------------------------

// what one step decided
struct step_result {
    int32_t              exited = -1; // the exit layer, -1: every layer ran
    int32_t              n_acc  = 0;
    std::vector<int32_t> emitted, path;
    bool                 rolled_back = false; // checked exits: a waiting token was wrong, this step's tree is gone
};

// The walk at the exit layer il: accepted when every emitted token is a candidate (or the exit is replayed); a
// rejected walk leaves the sampler and the replay's counter as they were. On acceptance the skipped layers' cache
// follows the KV policy and both caches keep the accepted rows; feats receives the head's features of the emitted
// tokens' rows.
static bool try_exit(specee_tree_decoder & tree, const specee_exit_decoder & exit, specee_step step, int32_t il,
                     bool forced, const std::vector<int32_t> & scored, int32_t n, int32_t n_max, step_result & res,
                     std::vector<float> & feats) {
    specee_sampler &         smpl = step.smpl;
    specee_generator_stats & st   = step.stats;
    specee_context &         ctx  = step.ctx;
    auto                     t0   = specee_clock::now();
    exit_rows                er;
    er.ctx   = &ctx;
    er.dec   = &tree;
    er.layer = il;
    er.slot.assign(tree.nodes.size(), -1);
    compute_exit_rows(er, scored);

    specee_sampler_params sp = specee_sampler_default_params();
    sp.seed                  = 0; // only its history is used
    std::unique_ptr<specee_sampler, void (*)(specee_sampler *)> saved(specee_sampler_init_impl(sp),
                                                                      specee_sampler_free);
    specee_sampler_copy_history(*saved, smpl);
    const size_t n_replayed = tree.n_replayed;
    res.emitted.clear();
    res.path.clear();
    res.n_acc = specee_tree_walk(tree, step, n_max, exit_logits_of, &er, res.emitted, res.path);
    st.t_exit_ms += specee_ms_since(t0);
    if (!forced && !tokens_are_candidates(tree, res.emitted, res.path)) {
        specee_sampler_copy_history(smpl, *saved);
        tree.n_replayed = n_replayed;
        return false;
    }

    std::vector<int32_t> kept = {0}, draw_nodes = {0};
    for (int32_t ni : res.path) {
        kept.push_back(tree.nodes[ni].row);
        draw_nodes.push_back(ni);
    }
    draw_nodes.resize(res.emitted.size());
    if (exit.params.kv == SPECEE_EXIT_KV_FILL) {
        t0 = specee_clock::now();
        exit_fill_skipped(ctx, il, kept);
        st.t_fill_ms += specee_ms_since(t0);
    }
    t0    = specee_clock::now();
    feats = exit_head_features(ctx, il, rows_of(tree, draw_nodes), norms_of(er, draw_nodes));
    specee_tree_keep(tree, step, n, res.emitted, res.path, feats.data());
    st.t_sample_ms += specee_ms_since(t0);
    res.exited = il;
    return true;
}

// Checked exits: the rows an exited pass keeps (the root and the accepted path) wait, unchecked, for their skipped
// layers (specee-exit-check.h); kept row j sits in the batch's cell j after specee_tree_keep, at root_pos + j, paired
// in the head with feats[j] and followed by emitted[j]
static void wait_kept_rows(checked_pass & cp, const specee_tree_decoder & tree, const step_result & res,
                           int32_t root_pos, const std::vector<float> & feats, int32_t n_feat,
                           const std::vector<int32_t> & history) {
    checked_pass_stop(cp);
    for (size_t j = 0; j < res.emitted.size(); ++j) {
        const int32_t      row = j == 0 ? 0 : tree.nodes[res.path[j - 1]].row;
        std::vector<float> f(feats.begin() + (int64_t) j * n_feat, feats.begin() + (int64_t) (j + 1) * n_feat);
        checked_pass_wait(cp, row, cp.ctx->cells[j], root_pos + (int32_t) j, f, res.emitted[j], history);
    }
}

// the checks of a pass over the verified tree: row r's candidates are those of the node verified there (the root's
// for row 0)
static void begin_checks(exit_checks & ec, const specee_tree_decoder & tree, int32_t n) {
    std::vector<int32_t> row_node(n, 0);
    for (int32_t ni = 1; ni < (int32_t) tree.nodes.size(); ++ni) {
        if (tree.nodes[ni].row >= 0) {
            row_node[tree.nodes[ni].row] = ni;
        }
    }
    std::vector<std::vector<int32_t>> cand;
    for (int32_t ni : row_node) {
        cand.push_back(tree.nodes[ni].cand);
    }
    exit_checks_begin(ec, std::move(cand));
}

// The verification pass, layer range by layer range over the schedule, until a check exits; then the rest of it. With
// checked exits the waiting tokens join the pass (rows after the tree's), an exit makes the kept rows wait too, and a
// pass that reaches the last layer checks the waiting tokens first (their tokens, or a rollback's, go to `out`).
static void verify_with_exits(specee_tree_decoder & tree, specee_exit_decoder & exit, specee_step step,
                              const specee_batch & b, int32_t n_max, step_result & res,
                              std::vector<std::pair<int32_t, int32_t>> & out) {
    specee_generator_stats & st      = step.stats;
    specee_context &         ctx     = step.ctx;
    const specee_model &     m       = *step.ctx.model;
    const int32_t            n_layer = (int32_t) m.hparams.n_layer;
    const int32_t            n       = b.n_tokens;
    const bool               check   = exit.params.check;
    exit_checks              ec;
    begin_checks(ec, tree, n);
    checked_pass cp;
    checked_pass_begin(cp, exit.chain, ctx, n, b.token, b.pos, b.tree_mask, b.output);
    const int32_t replay = tree.params.n_replay > 0 ?
                               tree.params.replay[tree.n_replayed % (size_t) tree.params.n_replay] : -1;
    int32_t       forced = -1;
    for (int32_t s : exit_pass_schedule(exit, m, forced)) {
        auto t0 = specee_clock::now();
        checked_pass_run(cp, s + 1, 0);
        st.t_verify_ms += specee_ms_since(t0);

        t0 = specee_clock::now();
        exit_checks_features(ec, ctx);
        const std::vector<int32_t> scored = scored_path(tree, ec, (int32_t) m.exit.n_cand, replay, n_max);
        const bool                 fire   = exit_layer_fires(exit, m, s, forced, ec, rows_of(tree, scored), st);
        st.t_check_ms += specee_ms_since(t0);
        if (!fire) {
            continue;
        }
        const std::vector<int32_t> history = check ? specee_sampler_history(step.smpl) : std::vector<int32_t>();
        std::vector<float>         feats;
        if (try_exit(tree, exit, step, s, s == forced, scored, n, n_max, res, feats)) {
            if (check) {
                wait_kept_rows(cp, tree, res, step.root_pos, feats, step.head->n_feat, history);
            }
            return;
        }
        st.n_rejected += 1;
    }
    auto t0 = specee_clock::now();
    checked_pass_run(cp, n_layer, 0);
    st.t_verify_ms += specee_ms_since(t0);
    if (!checked_pass_check(cp, step, out)) {
        res.rolled_back = true; // the tree followed a wrong token: the check took it back
        return;
    }

    t0 = specee_clock::now();
    res.emitted.clear(); // a rejected check's walk left its tokens
    res.path.clear();
    specee_tree_pass_rows rows = {&tree, ctx.logits.data(), (int32_t) step.ctx.model->hparams.n_vocab}; // a full pass: the step is EAGLE's
    res.n_acc = specee_tree_walk(tree, step, n_max, specee_tree_pass_logits, &rows, res.emitted, res.path);
    specee_tree_keep(tree, step, n, res.emitted, res.path, nullptr);
    st.t_sample_ms += specee_ms_since(t0);
}

// One step; the tokens it puts out go to `out` (token, layers its pass ran): the walk's, and with checked exits the
// checked waiting tokens before them, or nothing while the step's own tokens wait
static void tree_exit_step(specee_tree_decoder & tree, specee_exit_decoder & exit, specee_step step, int32_t n_max,
                           std::vector<std::pair<int32_t, int32_t>> & out) {
    specee_generator_stats & st      = step.stats;
    specee_context &         ctx     = step.ctx;
    const int32_t            n_layer = (int32_t) step.ctx.model->hparams.n_layer;
    const int32_t            n_free  = (int32_t) ctx.cparams.n_ctx - (int32_t) ctx.kv.used;
    const int32_t budget = std::min({tree.max_nodes, n_free - 1, (int32_t) ctx.cparams.n_batch - 1, n_max - 1});

    // ---- draft (each expanded node keeps its candidates)
    auto                       t0    = specee_clock::now();
    const std::vector<int32_t> nodes = specee_tree_draft(tree, step, budget);
    st.t_draft_ms += specee_ms_since(t0);

    // ---- verify, checking the scheduled layers
    const specee_tree_batch tb = specee_tree_verify_batch(tree, step.root, step.root_pos, nodes);
    const specee_batch      b  = tb.view();
    step_result             res;
    verify_with_exits(tree, exit, step, b, n_max, res, out);

    const int32_t layers_run = res.exited >= 0 ? res.exited + 1 : n_layer;
    st.n_drafted += b.n_tokens - 1;
    exit_count_pass(exit, res.exited, n_layer, st); // a rolled-back pass ran every layer (exited < 0)
    if (res.rolled_back) {
        return; // root and root_pos follow the full model's token
    }
    step.root = res.emitted.back();
    step.root_pos += (int32_t) res.emitted.size();
    st.n_accepted += res.n_acc;
    if (res.exited >= 0 && exit.params.check) {
        if (specee_token_is_eog(step.ctx.model, step.root)) {
            specee_exit_chain_flush(exit.chain, step, out); // nothing follows it
        }
        return; // the step's tokens wait for their check
    }
    for (int32_t t : res.emitted) {
        out.emplace_back(t, layers_run);
    }
}

int32_t specee_tree_exit_step(specee_tree_decoder & tree, specee_exit_decoder & exit, specee_step step,
                              int32_t * out, int32_t n_max, int32_t & layers_run) {
    std::vector<std::pair<int32_t, int32_t>> done;
    tree_exit_step(tree, exit, step, n_max, done);
    layers_run = done.empty() ? (int32_t) step.ctx.model->hparams.n_layer : done.back().second;
    for (size_t i = 0; i < done.size(); ++i) {
        out[i] = done[i].first;
    }
    return (int32_t) done.size();
}

int32_t specee_tree_exit_step_checked(specee_tree_decoder & tree, specee_exit_decoder & exit, specee_step step,
                                      int32_t n_max, std::vector<std::pair<int32_t, int32_t>> & out) {
    const size_t out0 = out.size();
    tree_exit_step(tree, exit, step, n_max, out);
    return (int32_t) (out.size() - out0);
}

void specee_tree_exit_init(specee_tree_decoder & tree, specee_exit_decoder & exit, const specee_model & model,
                           const specee_exit_params & params) {
    const bool predicts = params.n_replay == 0 && !(params.threshold >= 1.0f);
    if (predicts && model.exit.n_pred == 0) {
        specee_fail("tree exit needs exit predictors (blk.N.pred.*): merge them into the model with python -m "
                    "specee.convert merge --predictors, or load a draft head file that has them (--draft-head)");
    }
    specee_exit_init(exit, model, params);
    tree.n_cand = std::max<int32_t>(1, (int32_t) model.exit.n_cand);
    tree.max_expand += tree.max_nodes; // the verified leaves are expanded too (specee_tree_draft)
}
