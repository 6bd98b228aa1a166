// specee-draft-head.cpp: the EAGLE draft head's cache of pairs and their evaluation
#include "specee-draft-head.h"

#include "specee-context.h"
#include "specee-graph.h"
#include "specee-impl.h"
#include "specee-model.h"

#include <algorithm>
#include <cmath>

// the graph of the head over n pairs attending to cells [0, n_kv), their features gp.n_feat wide
static ggml_cgraph * build_head(specee_draft_head & h, specee_graph_params & gp, specee_graph_io & io) {
    gp.mm.kernels = h.ctx->cparams.kernels;
    if (h.model->eagle.version == 3) {
        return specee_build_eagle3_graph(specee_graph_begin(*h.ctx), *h.model, h.kv, gp, io, h.ctx->graph_size);
    }
    return specee_build_eagle_graph(specee_graph_begin(*h.ctx), *h.model, h.kv, gp, io, h.ctx->graph_size);
}

void specee_draft_head_init(specee_draft_head & h, specee_context & ctx, uint32_t extra_cells) {
    const specee_model & m = *ctx.model;
    if (m.eagle.version == 0) {
        specee_fail("this mode needs an EAGLE draft head: merge one into the model (python -m specee.convert merge) "
                    "or load one of its own (--draft-head, Model(draft_head=...))");
    }
    h.ctx      = &ctx;
    h.model    = &m;
    h.n_embd   = (int32_t) m.hparams.n_embd;
    h.n_vocab  = (int32_t) m.hparams.n_vocab;
    h.n_dvocab = m.eagle.output ? (int32_t) m.eagle.draft_vocab.size() : h.n_vocab;
    h.n_feat   = specee_eagle_n_feat(m.eagle, m.hparams.n_embd);

    specee_hparams hp = m.hparams;
    hp.n_layer        = 1;
    const int32_t  b  = specee_context_backend_of_layer(ctx, (int32_t) m.hparams.n_layer);
    h.kv.init(hp, ctx.cparams.n_ctx + extra_cells + 1, {ggml_backend_get_default_buffer_type(ctx.backends[b])},
              GGML_TYPE_F16);
    h.kv_tree.assign(h.kv.size, 0);

    // the worst case: a batch of n_batch pairs over the whole cache, every row an output, for each input width
    for (int32_t n_feat : {h.n_feat, h.n_embd}) {
        specee_graph_params gp;
        gp.n_tokens  = (int32_t) ctx.cparams.n_batch;
        gp.n_kv      = (int32_t) h.kv.size;
        gp.n_outputs = gp.n_tokens;
        gp.n_feat    = n_feat;
        specee_graph_io io;
        specee_graph_reserve(ctx, build_head(h, gp, io), "the draft head");
        if (h.n_feat == h.n_embd) {
            break;
        }
    }
}

void specee_draft_add_pair(specee_draft_head & h, const float * feat, int32_t token, int32_t pos) {
    h.pend_feat.insert(h.pend_feat.end(), feat, feat + h.n_feat);
    h.pend_tok.push_back(token);
    h.pend_pos.push_back(pos);
    if ((int32_t) h.pair_tok.size() <= pos) {
        h.pair_tok.resize(pos + 1, -1);
    }
    h.pair_tok[pos] = token;
}

std::vector<int32_t> specee_draft_eval(specee_draft_head & h, const std::vector<int32_t> & tokens, const float * feats,
                                       const std::vector<int32_t> & pos, const std::vector<std::vector<int32_t>> * anc,
                                       const std::vector<int32_t> & rows, const std::vector<int32_t> * seen_upto) {
    const int32_t        n    = (int32_t) tokens.size();
    const bool           tree = anc != nullptr;
    std::vector<int32_t> cells = h.kv.find_slots((uint32_t) n);
    for (int32_t i = 0; i < n; ++i) {
        h.kv.occupy(cells[i], pos[i], tokens[i]);
        h.kv.set_valid(cells[i], 0);
        h.kv_tree[cells[i]] = tree;
    }
    const int32_t n_kv = (int32_t) h.kv.n_kv();

    // committed pairs are seen causally; tree nodes see themselves (an identity tree mask) and their ancestors
    std::vector<uint8_t> committed(n_kv), identity;
    for (int32_t c = 0; c < n_kv; ++c) {
        committed[c] = !h.kv_tree[c];
    }
    if (tree) {
        identity.assign((size_t) n * n, 0);
        for (int32_t i = 0; i < n; ++i) {
            identity[(size_t) i * n + i] = 1;
        }
    }
    std::vector<ggml_fp16_t> mask;
    specee_build_mask(h.kv, cells, pos, {}, tree ? identity.data() : nullptr, committed, n_kv, mask);
    if (tree) {
        const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f);
        for (int32_t i = 0; i < n; ++i) {
            for (int32_t c : (*anc)[i]) {
                mask[(size_t) i * n_kv + c] = zero;
            }
        }
    }
    if (tree && seen_upto) {
        const ggml_fp16_t hidden = ggml_fp32_to_fp16(-INFINITY);
        for (int32_t i = 0; i < n; ++i) {
            for (int32_t c = 0; c < n_kv; ++c) {
                if (committed[c] && h.kv.pos[c] > (*seen_upto)[i]) {
                    mask[(size_t) i * n_kv + c] = hidden;
                }
            }
        }
    }

    specee_graph_params gp;
    gp.n_tokens  = n;
    gp.n_kv      = n_kv;
    gp.n_outputs = (int32_t) rows.size();
    gp.n_feat    = tree ? h.n_embd : h.n_feat;
    specee_graph_io io;
    ggml_cgraph *   gf = build_head(h, gp, io);
    specee_graph_alloc(*h.ctx, gf, "the draft head");
    ggml_backend_tensor_set(io.inp_tokens, tokens.data(), 0, n * sizeof(int32_t));
    ggml_backend_tensor_set(io.inp_embd, feats, 0, (size_t) n * gp.n_feat * sizeof(float));
    ggml_backend_tensor_set(io.inp_pos, pos.data(), 0, n * sizeof(int32_t));
    std::vector<int64_t> idxs(cells.begin(), cells.end());
    ggml_backend_tensor_set(io.inp_kv_idxs, idxs.data(), 0, n * sizeof(int64_t));
    ggml_backend_tensor_set(io.inp_masks[0], mask.data(), 0, mask.size() * sizeof(ggml_fp16_t));
    if (io.inp_out_ids) {
        ggml_backend_tensor_set(io.inp_out_ids, rows.data(), 0, rows.size() * sizeof(int32_t));
    }
    specee_graph_compute(*h.ctx, gf, n);

    h.out.resize((size_t) n * h.n_embd);
    ggml_backend_tensor_get(io.l_out[0], h.out.data(), 0, h.out.size() * sizeof(float));
    h.logits.resize((size_t) rows.size() * h.n_dvocab);
    if (io.result_output) {
        ggml_backend_tensor_get(io.result_output, h.logits.data(), 0, h.logits.size() * sizeof(float));
    }
    return cells;
}

void specee_draft_commit(specee_draft_head & h) {
    const int32_t      n       = (int32_t) h.pend_tok.size();
    const int32_t      n_batch = (int32_t) h.ctx->cparams.n_batch;
    std::vector<float> last_out, last_logits;
    for (int32_t i0 = 0; i0 < n; i0 += n_batch) {
        const int32_t        m = std::min(n_batch, n - i0);
        std::vector<int32_t> tok(h.pend_tok.begin() + i0, h.pend_tok.begin() + i0 + m);
        std::vector<int32_t> pos(h.pend_pos.begin() + i0, h.pend_pos.begin() + i0 + m);
        const bool           last = i0 + m == n;
        specee_draft_eval(h, tok, h.pend_feat.data() + (size_t) i0 * h.n_feat, pos, nullptr,
                          last ? std::vector<int32_t>{m - 1} : std::vector<int32_t>{});
        if (last) {
            last_out.assign(h.out.end() - h.n_embd, h.out.end());
            last_logits = h.logits;
        }
    }
    h.out    = std::move(last_out);
    h.logits = std::move(last_logits);
    h.pend_tok.clear();
    h.pend_pos.clear();
    h.pend_feat.clear();
}

void specee_draft_truncate(specee_draft_head & h, int32_t p) {
    specee_draft_drop_tree(h);
    h.kv.remove(p, -1);
    size_t keep = 0;
    for (size_t i = 0; i < h.pend_tok.size(); ++i) {
        if (h.pend_pos[i] < p) {
            h.pend_tok[keep] = h.pend_tok[i];
            h.pend_pos[keep] = h.pend_pos[i];
            std::copy(h.pend_feat.begin() + i * h.n_feat, h.pend_feat.begin() + (i + 1) * h.n_feat,
                      h.pend_feat.begin() + keep * h.n_feat);
            keep++;
        }
    }
    h.pend_tok.resize(keep);
    h.pend_pos.resize(keep);
    h.pend_feat.resize(keep * h.n_feat);
    if ((int32_t) h.pair_tok.size() > p) {
        h.pair_tok.resize(std::max(p, 0));
    }
}

int32_t specee_draft_matching_prefix(const specee_draft_head & h, const int32_t * tokens, int32_t n) {
    int32_t i = 0;
    while (i < (int32_t) h.pair_tok.size() && i + 1 < n && h.pair_tok[i] == tokens[i + 1]) {
        ++i;
    }
    return i;
}

void specee_draft_drop_tree(specee_draft_head & h) {
    for (uint32_t c = 0; c < h.kv.size; ++c) {
        if (h.kv_tree[c]) {
            h.kv.free_cell((int32_t) c);
            h.kv_tree[c] = 0;
        }
    }
}

int32_t specee_draft_target_id(const specee_draft_head & h, int32_t row) {
    const std::vector<int32_t> & dv = h.model->eagle.draft_vocab;
    return dv.empty() ? row : dv[row];
}

// ---- C API -------------------------------------------------------------------------------------------

// a chain of draft steps after the committed pairs: step j takes draft_tokens[j] at position n + j with the previous
// row's output, sees the pairs and the earlier steps; its logits and output appended to those of the pairs
static void eval_chain(specee_draft_head & h, int32_t n, const int32_t * draft_tokens, int32_t n_draft,
                       std::vector<float> & logits, std::vector<float> & out) {
    std::vector<int32_t> anc;
    for (int32_t j = 0; j < n_draft; ++j) {
        const std::vector<float> prev(out.end() - h.n_embd, out.end());
        const std::vector<std::vector<int32_t>> ancs = {anc};
        const std::vector<int32_t> cells = specee_draft_eval(h, {draft_tokens[j]}, prev.data(), {n + j}, &ancs, {0});
        anc.push_back(cells[0]);
        logits.insert(logits.end(), h.logits.begin(), h.logits.end());
        out.insert(out.end(), h.out.begin(), h.out.end());
    }
}

// the n pairs (tokens[i], features[i]) committed at positions 0..n-1 in batches of n_batch: every pair's output
// appended to out, the logits of the pairs with want_logits[i] to logits (in pair order)
static void eval_pairs(specee_draft_head & h, const int32_t * tokens, const float * features, int32_t n,
                       const std::vector<uint8_t> & want_logits, std::vector<float> & logits,
                       std::vector<float> & out) {
    const int32_t n_batch = (int32_t) h.ctx->cparams.n_batch;
    for (int32_t i0 = 0; i0 < n; i0 += n_batch) {
        const int32_t        m = std::min(n_batch, n - i0);
        std::vector<int32_t> tok(tokens + i0, tokens + i0 + m), pos(m), rows;
        for (int32_t i = 0; i < m; ++i) {
            pos[i] = i0 + i;
            if (want_logits[i0 + i]) {
                rows.push_back(i);
            }
        }
        specee_draft_eval(h, tok, features + (size_t) i0 * h.n_feat, pos, nullptr, rows);
        logits.insert(logits.end(), h.logits.begin(), h.logits.end());
        out.insert(out.end(), h.out.begin(), h.out.end());
    }
}

static void check_tokens(const specee_draft_head & h, const int32_t * tokens, int32_t n) {
    for (int32_t i = 0; i < n; ++i) {
        if (tokens[i] < 0 || tokens[i] >= h.n_vocab) {
            specee_fail("token id %d at index %d is out of range [0, %d)", tokens[i], i, h.n_vocab);
        }
    }
}

extern "C" int32_t specee_draft_head_eval_steps(specee_context * ctx, const int32_t * tokens, const float * features,
                                                int32_t n, const int32_t * draft_tokens, int32_t n_draft,
                                                float * logits, float * out) {
    if (!ctx) {
        specee_set_error("no context");
        return -1;
    }
    std::lock_guard<std::recursive_mutex> lock(ctx->mutex);
    return specee_guard<int32_t>(-1, [&] {
        if (!tokens || !features || n <= 0 || n_draft < 0 || (n_draft > 0 && !draft_tokens)) {
            specee_fail("no pairs to evaluate");
        }
        specee_draft_head h;
        specee_draft_head_init(h, *ctx, (uint32_t) n_draft);
        if (n + n_draft > (int32_t) h.kv.size) {
            specee_fail("%d pairs do not fit the head's cache of %u cells", n + n_draft, h.kv.size);
        }
        check_tokens(h, tokens, n);
        check_tokens(h, draft_tokens, n_draft);
        std::vector<float> all_logits, all_out;
        eval_pairs(h, tokens, features, n, std::vector<uint8_t>(n, 1), all_logits, all_out);
        eval_chain(h, n, draft_tokens, n_draft, all_logits, all_out);
        if (logits) {
            std::copy(all_logits.begin(), all_logits.end(), logits);
        }
        if (out) {
            std::copy(all_out.begin(), all_out.end(), out);
        }
        return 0;
    });
}

// chains from many roots at once: step k of every chain in one batch; a chain from root q takes tokens[q + k] at
// position q + k with its previous step's output (step 1: pair q's), seeing pairs 0..q and its own earlier steps
// (logits: [chain][depth + 1][n_dvocab]; the chains' cells are dropped after)
static void eval_root_chains(specee_draft_head & h, const int32_t * tokens, const std::vector<float> & pair_out,
                             const std::vector<int32_t> & roots, int32_t depth, float * logits) {
    const int32_t                     m = (int32_t) roots.size();
    std::vector<std::vector<int32_t>> anc(m);
    std::vector<float>                prev((size_t) m * h.n_embd);
    for (int32_t i = 0; i < m; ++i) {
        std::copy_n(pair_out.begin() + (size_t) roots[i] * h.n_embd, h.n_embd, prev.begin() + (size_t) i * h.n_embd);
    }
    std::vector<int32_t> rows(m);
    for (int32_t i = 0; i < m; ++i) {
        rows[i] = i;
    }
    for (int32_t k = 1; k <= depth; ++k) {
        std::vector<int32_t> tok(m), pos(m);
        for (int32_t i = 0; i < m; ++i) {
            tok[i] = tokens[roots[i] + k];
            pos[i] = roots[i] + k;
        }
        const std::vector<int32_t> cells = specee_draft_eval(h, tok, prev.data(), pos, &anc, rows, &roots);
        for (int32_t i = 0; i < m; ++i) {
            anc[i].push_back(cells[i]);
            std::copy_n(h.logits.begin() + (size_t) i * h.n_dvocab, h.n_dvocab,
                        logits + ((size_t) i * (depth + 1) + k) * h.n_dvocab);
        }
        prev = h.out;
    }
    specee_draft_drop_tree(h);
}

extern "C" int32_t specee_draft_head_eval_chains(specee_context * ctx, const int32_t * tokens, const float * features,
                                                 int32_t n, const int32_t * roots, int32_t n_roots, int32_t depth,
                                                 float * logits) {
    if (!ctx) {
        specee_set_error("no context");
        return -1;
    }
    std::lock_guard<std::recursive_mutex> lock(ctx->mutex);
    return specee_guard<int32_t>(-1, [&] {
        if (!tokens || !features || !logits || n <= 0 || depth < 0 || n_roots <= 0 || !roots) {
            specee_fail("no pairs or no roots to evaluate");
        }
        const std::vector<int32_t> root(roots, roots + n_roots);
        for (int32_t i = 0; i < n_roots; ++i) {
            if (root[i] < 0 || root[i] + depth >= n || (i > 0 && root[i] <= root[i - 1])) {
                specee_fail("root %d at index %d: roots must increase and a chain of %d steps needs 0 <= root < %d",
                            root[i], i, depth, n - depth);
            }
        }
        const int32_t     n_batch = (int32_t) ctx->cparams.n_batch;
        const int32_t     n_group = std::min(n_roots, n_batch); // chains evaluated together
        specee_draft_head h;
        specee_draft_head_init(h, *ctx, (uint32_t) (n_group * depth));
        if (n + n_group * depth > (int32_t) h.kv.size) {
            specee_fail("%d pairs and %d chain steps do not fit the head's cache of %u cells", n, n_group * depth,
                        h.kv.size);
        }
        check_tokens(h, tokens, n);
        std::vector<uint8_t> is_root(n, 0);
        for (int32_t q : root) {
            is_root[q] = 1;
        }
        std::vector<float> root_logits, pair_out; // the roots' rows in root order (roots increase)
        eval_pairs(h, tokens, features, n, is_root, root_logits, pair_out);
        for (int32_t i = 0; i < n_roots; ++i) { // step 0 of each chain: its root pair's own row
            std::copy_n(root_logits.begin() + (size_t) i * h.n_dvocab, h.n_dvocab,
                        logits + (size_t) i * (depth + 1) * h.n_dvocab);
        }
        for (int32_t i0 = 0; i0 < n_roots && depth > 0; i0 += n_group) {
            const std::vector<int32_t> group(root.begin() + i0, root.begin() + std::min(n_roots, i0 + n_group));
            eval_root_chains(h, tokens, pair_out, group, depth, logits + (size_t) i0 * (depth + 1) * h.n_dvocab);
        }
        return 0;
    });
}

extern "C" int32_t specee_draft_head_eval(specee_context * ctx, const int32_t * tokens, const float * features,
                                          int32_t n, float * logits, float * out) {
    return specee_draft_head_eval_steps(ctx, tokens, features, n, nullptr, 0, logits, out);
}
