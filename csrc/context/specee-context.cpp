// specee-context.cpp: a context over a model: backends, scheduler, the graph runner, KV cache, batch
// evaluation by layer ranges. Elsewhere: a batch's checks and positions (specee-batch.cpp), the parameters and the
// memory check (specee-context-params.cpp), named intermediates (specee-capture.cpp).
#include "specee-context.h"

#include "specee-batch.h"
#include "specee-graph.h"
#include "specee-impl.h"
#include "specee-model.h"

#include "ggml-cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>

specee_context::~specee_context() {
    if (graph_ctx) {
        ggml_free(graph_ctx);
    }
    if (sched) {
        ggml_backend_sched_free(sched);
    }
    for (ggml_backend_buffer_t b : state_bufs) {
        ggml_backend_buffer_free(b);
    }
    if (state_ctx) {
        ggml_free(state_ctx);
    }
    for (ggml_backend_t b : backends) {
        ggml_backend_free(b);
    }
    if (threadpool) {
        ggml_threadpool_free(threadpool);
    }
    if (threadpool_batch) {
        ggml_threadpool_free(threadpool_batch);
    }
}

// ---- the graph runner ----------------------------------------------------------------------------------

ggml_context * specee_graph_begin(specee_context & ctx) {
    ctx.reuse_key.clear(); // the memory of the last graph is reused now
    ctx.reuse_gf = nullptr;
    if (ctx.graph_ctx) {
        ggml_free(ctx.graph_ctx);
    }
    ggml_init_params ip = {ctx.graph_meta.size(), ctx.graph_meta.data(), /*no_alloc =*/true};
    ctx.graph_ctx       = ggml_init(ip);
    return ctx.graph_ctx;
}

void specee_graph_alloc(specee_context & ctx, ggml_cgraph * gf, const char * what) {
    ggml_backend_sched_reset(ctx.sched);
    if (!ggml_backend_sched_alloc_graph(ctx.sched, gf)) {
        specee_fail("cannot allocate the compute graph of %s", what);
    }
}

void specee_graph_reserve(specee_context & ctx, ggml_cgraph * gf, const char * what) {
    ggml_backend_sched_reset(ctx.sched);
    if (!ggml_backend_sched_reserve(ctx.sched, gf)) {
        specee_fail("cannot reserve compute buffers for %s (out of memory on a device?)", what);
    }
}

// One token decodes on the n_threads pool, a batch on the n_threads_batch pool; the CPU backend plans the graph
// for its own thread count, so that must follow the pool (otherwise work is split for the wrong count).
void specee_graph_compute(specee_context & ctx, ggml_cgraph * gf, int32_t n_tokens) {
    const bool batch = n_tokens > 1 && ctx.threadpool_batch;
    ggml_backend_cpu_set_threadpool(ctx.backend_cpu, batch ? ctx.threadpool_batch : ctx.threadpool);
    ggml_backend_cpu_set_n_threads(ctx.backend_cpu, batch ? ctx.cparams.n_threads_batch : ctx.cparams.n_threads);
    ctx.captured.clear();
    ctx.captured_shape.clear();
    if (ggml_backend_sched_graph_compute(ctx.sched, gf) != GGML_STATUS_SUCCESS) {
        specee_fail("graph computation failed");
    }
}

// ---- evaluation ------------------------------------------------------------------------------------

static const int32_t KV_PAD = 256;

// Masks of a batch over cells [0, n_kv): one per group of layers whose cached cells' validity and sliding window
// (gemma's sliding layers) are the same. Every pass over the target's layers builds its masks here: prompts, single
// tokens, EAGLE's tree and lookup chains' verification (ctx.tree_mask), several sequences (the server's slots).
static void build_masks(const specee_context & ctx, int32_t n_kv, int32_t l0, int32_t l1,
                        std::vector<std::vector<ggml_fp16_t>> & masks, std::vector<int32_t> & mask_of_layer) {
    const specee_kv_cache &           kv = ctx.kv;
    const specee_hparams &            hp = ctx.model->hparams;
    std::vector<std::vector<uint8_t>> columns; // per group: the cells' validity, then whether the layers slide
    mask_of_layer.assign(l1 - l0, 0);
    for (int32_t il = l0; il < l1; ++il) {
        std::vector<uint8_t> col(n_kv + 1, 0);
        for (int32_t c = 0; c < n_kv; ++c) {
            col[c] = kv.pos[c] >= 0 && kv.is_valid(c, il);
        }
        col[n_kv]     = hp.is_swa(il);
        const auto it = std::find(columns.begin(), columns.end(), col);
        mask_of_layer[il - l0] = (int32_t) (it - columns.begin());
        if (it == columns.end()) {
            columns.push_back(std::move(col));
        }
    }
    masks.resize(columns.size());
    const uint8_t * tree = ctx.tree_mask.empty() ? nullptr : ctx.tree_mask.data();
    for (size_t g = 0; g < columns.size(); ++g) {
        specee_build_mask(kv, ctx.cells, ctx.pos, ctx.seqs, tree, columns[g], n_kv, masks[g],
                          columns[g][n_kv] ? hp.n_swa : 0);
    }
}

// The order attention reads cells [0, n_kv) in, when some sequence's cells are not in increasing positions (cells
// freed by one sequence and taken by another): every cell by position (free ones first), so that each sequence's
// cells are summed in position order, as they are for a sequence alone in a fresh cache. Empty when the cells are
// already in order for every sequence (a single sequence's usual case), so nothing is gathered then.
static std::vector<int32_t> attention_order(const specee_context & ctx, int32_t n_kv) {
    const specee_kv_cache & kv = ctx.kv;
    std::vector<int32_t>    pos(n_kv, -1);
    std::vector<uint64_t>   seqs(n_kv, 0);
    for (int32_t c = 0; c < n_kv; ++c) {
        pos[c]  = kv.pos[c];
        seqs[c] = kv.seq[c];
    }
    for (int32_t i = 0; i < ctx.n_tokens; ++i) {
        pos[ctx.cells[i]]  = ctx.pos[i];
        seqs[ctx.cells[i]] = (uint64_t) 1 << (ctx.seqs.empty() ? kv.seq_cur : ctx.seqs[i]);
    }
    std::vector<int32_t> last(SPECEE_KV_MAX_SEQ, -1);
    bool                 sorted = true;
    for (int32_t c = 0; c < n_kv && sorted; ++c) {
        for (int32_t s = 0; s < SPECEE_KV_MAX_SEQ && pos[c] >= 0; ++s) {
            if ((seqs[c] >> s) & 1u) {
                sorted = sorted && pos[c] >= last[s];
                last[s] = pos[c];
            }
        }
    }
    if (sorted) {
        return {};
    }
    std::vector<int32_t> order(n_kv);
    for (int32_t c = 0; c < n_kv; ++c) {
        order[c] = c;
    }
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return pos[a] < pos[b]; });
    return order;
}

// the masks' columns in that order
static void order_masks(std::vector<std::vector<ggml_fp16_t>> & masks, const std::vector<int32_t> & order, int32_t n) {
    const int32_t n_kv = (int32_t) order.size();
    for (std::vector<ggml_fp16_t> & m : masks) {
        const std::vector<ggml_fp16_t> by_cell = m;
        for (int32_t i = 0; i < n; ++i) {
            for (int32_t j = 0; j < n_kv; ++j) {
                m[(size_t) i * n_kv + j] = by_cell[(size_t) i * n_kv + order[j]];
            }
        }
    }
}

// a new batch's results, none computed yet (EAGLE-3: its features zeroed, ctx.n_tokens rows)
static void clear_results(specee_context & ctx) {
    ctx.hidden_layers.clear();
    ctx.norm.clear();
    ctx.features.clear();
    if (ctx.model->eagle.version == 3) {
        ctx.features.assign((size_t) ctx.n_tokens * 3 * ctx.model->hparams.n_embd, 0.0f);
    }
    ctx.logits.clear();
    ctx.n_outputs = 0;
}

// begin a batch: copy it, choose its cells (nothing in the cache changes yet)
static void start_batch(specee_context & ctx, const specee_batch * batch) {
    const int32_t n  = batch->n_tokens;
    ctx.cells        = batch->seq_id ? ctx.kv.find_slots_seq(std::vector<int32_t>(batch->seq_id, batch->seq_id + n))
                                     : ctx.kv.find_slots((uint32_t) n);
    ctx.n_tokens    = n;
    ctx.layer_done  = 0;
    ctx.tokens.assign(batch->token, batch->token + n);
    if (batch->seq_id) {
        ctx.seqs.assign(batch->seq_id, batch->seq_id + n);
    } else {
        ctx.seqs.clear();
    }
    specee_batch_positions(ctx.kv, batch, ctx.pos);
    if (batch->tree_mask) {
        ctx.tree_mask.assign(batch->tree_mask, batch->tree_mask + (size_t) n * n);
    } else {
        ctx.tree_mask.clear();
    }
    ctx.out_ids.clear();
    for (int32_t i = 0; i < n; ++i) {
        if (specee_batch_output(batch, i)) {
            ctx.out_ids.push_back(i);
        }
    }
    clear_results(ctx);
}

// EAGLE-3: the outputs of the head's feature layers computed by this range, into ctx.features (token-major, the
// three layers side by side)
static void read_features(specee_context & ctx, const specee_graph_io & io) {
    const int64_t      n_embd = ctx.model->hparams.n_embd;
    const int32_t      n      = ctx.n_tokens;
    std::vector<float> f((size_t) n * n_embd);
    for (size_t k = 0; k < io.features.size(); ++k) {
        if (!io.features[k]) {
            continue;
        }
        ggml_backend_tensor_get(io.features[k], f.data(), 0, f.size() * sizeof(float));
        for (int32_t i = 0; i < n; ++i) {
            std::copy(f.begin() + i * n_embd, f.begin() + (i + 1) * n_embd,
                      ctx.features.begin() + (i * 3 + (int64_t) k) * n_embd);
        }
    }
}

const float * specee_context_feature(const specee_context & ctx, int32_t i) {
    const int64_t n_embd = ctx.model->hparams.n_embd;
    return ctx.model->eagle.version == 3 ? ctx.features.data() + (size_t) i * 3 * n_embd
                                         : ctx.norm.data() + (size_t) i * n_embd;
}

// the main graph of layers [l0, l1) for n tokens over cells [0, n_kv)
static ggml_cgraph * build_layers(specee_context & ctx, specee_graph_params & gp, specee_graph_io & io) {
    gp.state_in  = gp.layer_begin > 0 ? ctx.state[specee_context_backend_of_layer(ctx, gp.layer_begin - 1)] : nullptr;
    gp.state_out = ctx.state[specee_context_backend_of_layer(ctx, gp.layer_end - 1)];
    gp.mm        = {&ctx.lora, ctx.cparams.kernels};
    return specee_build_graph(specee_graph_begin(ctx), *ctx.model, ctx.kv, gp, io, ctx.graph_size);
}

// one past the highest cell that holds a sequence of the batch (a batch without sequence ids: kv.seq_cur's) or
// one of the batch's own cells
static int32_t kv_span(const specee_context & ctx) {
    const specee_kv_cache & kv   = ctx.kv;
    specee_seq_set          mine = 0;
    if (ctx.seqs.empty()) {
        mine = (specee_seq_set) 1 << kv.seq_cur;
    }
    for (int32_t s : ctx.seqs) {
        mine |= (specee_seq_set) 1 << s;
    }
    int32_t n_kv = 0;
    for (int32_t c = (int32_t) kv.n_kv(); c > 0; --c) {
        if (kv.pos[c - 1] >= 0 && (kv.seq[c - 1] & mine) != 0) {
            n_kv = c;
            break;
        }
    }
    for (int32_t c : ctx.cells) {
        n_kv = std::max(n_kv, c + 1);
    }
    return n_kv;
}

static void eval_range(specee_context & ctx, int32_t l0, int32_t l1, uint32_t flags) {
    const specee_hparams & hp   = ctx.model->hparams;
    const int32_t          n    = ctx.n_tokens;
    const bool             last = l1 == (int32_t) hp.n_layer;

    // cells attended to: up to the highest cell of the batch's sequences and this batch's cells, padded (as
    // llama.cpp pads them) so that graphs of consecutive tokens have the same shape; the padding and other
    // sequences' cells below it are masked, and other sequences' cells above it are left out (another slot's cached
    // prompt high in the cache does not widen a request's attention)
    int32_t n_kv = kv_span(ctx);
    n_kv = std::min((n_kv + KV_PAD - 1) / KV_PAD * KV_PAD, (int32_t) ctx.kv.size);

    specee_graph_params gp;
    gp.n_tokens    = n;
    gp.n_kv        = n_kv;
    gp.layer_begin = l0;
    gp.layer_end   = l1;
    gp.hidden_all  = (flags & SPECEE_EVAL_HIDDEN_ALL) != 0;
    gp.final_norm  = last;
    gp.n_outputs   = last && !(flags & SPECEE_EVAL_NO_LOGITS) ? (int32_t) ctx.out_ids.size() : 0;
    if (ctx.model->eagle.version == 3) {
        gp.feature_layers = ctx.model->eagle.feature_layers;
    }

    std::vector<std::vector<ggml_fp16_t>> masks;
    build_masks(ctx, n_kv, l0, l1, masks, gp.mask_of_layer);
    gp.n_masks = (int32_t) masks.size();
    const std::vector<int32_t> order = attention_order(ctx, n_kv);
    gp.kv_order                      = !order.empty();
    if (gp.kv_order) {
        order_masks(masks, order, n);
    }

    std::vector<int32_t> key = {n, n_kv, l0, l1, gp.hidden_all, gp.final_norm, gp.n_outputs, gp.n_masks, gp.kv_order};
    key.insert(key.end(), gp.mask_of_layer.begin(), gp.mask_of_layer.end());
    key.insert(key.end(), gp.feature_layers.begin(), gp.feature_layers.end());
    specee_graph_io & io = ctx.reuse_io;
    ggml_cgraph *     gf = ctx.reuse_gf;
    if (key != ctx.reuse_key || !gf) {
        io = specee_graph_io();
        gf = build_layers(ctx, gp, io);
        specee_graph_alloc(ctx, gf, "the model's layers");
        ctx.reuse_key = key;
        ctx.reuse_gf  = gf;
    }

    // ---- inputs
    if (io.inp_tokens) {
        ggml_backend_tensor_set(io.inp_tokens, ctx.tokens.data(), 0, n * sizeof(int32_t));
    }
    ggml_backend_tensor_set(io.inp_pos, ctx.pos.data(), 0, n * sizeof(int32_t));
    std::vector<int64_t> idxs(ctx.cells.begin(), ctx.cells.end());
    ggml_backend_tensor_set(io.inp_kv_idxs, idxs.data(), 0, n * sizeof(int64_t));
    for (size_t g = 0; g < masks.size(); ++g) {
        ggml_backend_tensor_set(io.inp_masks[g], masks[g].data(), 0, masks[g].size() * sizeof(ggml_fp16_t));
    }
    if (io.inp_kv_order) {
        ggml_backend_tensor_set(io.inp_kv_order, order.data(), 0, n_kv * sizeof(int32_t));
    }
    if (io.inp_out_ids) {
        ggml_backend_tensor_set(io.inp_out_ids, ctx.out_ids.data(), 0, ctx.out_ids.size() * sizeof(int32_t));
    }

    specee_graph_compute(ctx, gf, n);

    // ---- outputs (the last layer's output stays in ctx.state until read)
    const size_t n_hidden = (size_t) n * hp.n_embd;
    ctx.hidden_read       = false;
    if (gp.hidden_all) {
        ctx.hidden_layers.resize(hp.n_layer);
        for (int32_t il = l0; il < l1; ++il) {
            std::vector<float> & h = ctx.hidden_layers[il];
            h.resize(n_hidden);
            ggml_backend_tensor_get(io.l_out[il - l0], h.data(), 0, n_hidden * sizeof(float));
        }
    }
    read_features(ctx, io);
    if (io.result_norm) {
        ctx.norm.resize(n_hidden);
        ggml_backend_tensor_get(io.result_norm, ctx.norm.data(), 0, n_hidden * sizeof(float));
    }
    if (io.result_output) {
        ctx.n_outputs = gp.n_outputs;
        ctx.logits.resize((size_t) gp.n_outputs * hp.n_vocab);
        ggml_backend_tensor_get(io.result_output, ctx.logits.data(), 0, ctx.logits.size() * sizeof(float));
    }
}

const std::vector<float> & specee_context_hidden(specee_context & ctx) {
    if (!ctx.hidden_read && ctx.layer_done > 0) {
        ggml_tensor * st = ctx.state[specee_context_backend_of_layer(ctx, ctx.layer_done - 1)];
        ctx.hidden.resize((size_t) ctx.n_tokens * ctx.model->hparams.n_embd);
        ggml_backend_tensor_get(st, ctx.hidden.data(), 0, ctx.hidden.size() * sizeof(float));
        ctx.hidden_read = true;
    }
    return ctx.hidden;
}

void specee_eval_layers_impl(specee_context & ctx, const specee_batch * batch, int32_t l0, int32_t l1, uint32_t flags) {
    const int32_t n_layer = (int32_t) ctx.model->hparams.n_layer;
    if (l0 < 0 || l1 > n_layer || l0 >= l1) {
        specee_fail("invalid layer range [%d, %d) for a model of %d layers", l0, l1, n_layer);
    }
    specee_batch_check(batch, ctx.cparams.n_batch, (int32_t) ctx.model->hparams.n_vocab);
    if (l0 == 0) {
        start_batch(ctx, batch);
    } else if (ctx.n_tokens != batch->n_tokens || ctx.layer_done != l0 ||
               !std::equal(ctx.tokens.begin(), ctx.tokens.end(), batch->token)) {
        specee_fail("invalid layer range: layer_begin=%d must continue the last batch, which has %d layers done",
                    l0, ctx.layer_done);
    }

    const bool first = l0 == 0;
    try {
        eval_range(ctx, l0, l1, flags);
    } catch (...) {
        if (first) {
            ctx.n_tokens = 0; // the cache was not touched: the cells were never occupied
            ctx.cells.clear();
            ctx.seqs.clear();
        }
        throw;
    }
    if (first) {
        for (int32_t i = 0; i < ctx.n_tokens; ++i) {
            ctx.kv.occupy(ctx.cells[i], ctx.pos[i], ctx.tokens[i], ctx.seqs.empty() ? -1 : ctx.seqs[i]);
        }
    }
    for (int32_t c : ctx.cells) {
        for (int32_t il = l0; il < l1; ++il) {
            ctx.kv.set_valid(c, il);
        }
    }
    ctx.layer_done = l1;
}

// Tokens already in the cache, continued at layer l0 from hidden states the caller kept: a new batch of the cells'
// tokens at their positions (sequence kv.seq_cur; tree_mask [n * n] as a batch's, NULL: causal by position), whose
// rows start from hidden[i] (the output of layer l0 - 1). The cells must hold their tokens' K/V in layers [0, l0);
// every row gets logits at the last layer. Further ranges continue it as any batch (specee_eval_layers_impl with
// ctx.tokens).
void specee_eval_resume_impl(specee_context & ctx, const std::vector<int32_t> & cells, const float * hidden, int32_t l0,
                             int32_t l1, uint32_t flags, const uint8_t * tree_mask) {
    const specee_hparams & hp = ctx.model->hparams;
    const int32_t          n  = (int32_t) cells.size();
    if (l0 <= 0 || l1 > (int32_t) hp.n_layer || l0 >= l1) {
        specee_fail("resume: invalid layer range [%d, %d) for a model of %u layers", l0, l1, hp.n_layer);
    }
    if (n <= 0 || (uint32_t) n > ctx.cparams.n_batch) {
        specee_fail("resume: %d tokens (1..n_batch=%u)", n, ctx.cparams.n_batch);
    }
    for (int32_t c : cells) {
        if (c < 0 || (uint32_t) c >= ctx.kv.size || ctx.kv.pos[c] < 0 || !ctx.kv.has_seq(c, ctx.kv.seq_cur)) {
            specee_fail("resume: cell %d holds no token of sequence %d", c, ctx.kv.seq_cur);
        }
        for (int32_t il = 0; il < l0; ++il) {
            if (!ctx.kv.is_valid(c, il)) {
                specee_fail("resume: cell %d has no K/V in layer %d, below layer %d", c, il, l0);
            }
        }
    }
    ctx.cells      = cells;
    ctx.n_tokens   = n;
    ctx.layer_done = l0;
    ctx.tokens.resize(n);
    ctx.pos.resize(n);
    ctx.out_ids.resize(n);
    for (int32_t i = 0; i < n; ++i) {
        ctx.tokens[i]  = ctx.kv.tok[cells[i]];
        ctx.pos[i]     = ctx.kv.pos[cells[i]];
        ctx.out_ids[i] = i;
    }
    ctx.seqs.clear();
    if (tree_mask) {
        ctx.tree_mask.assign(tree_mask, tree_mask + (size_t) n * n);
    } else {
        ctx.tree_mask.clear();
    }
    clear_results(ctx);
    ggml_tensor * state_in = ctx.state[specee_context_backend_of_layer(ctx, l0 - 1)];
    ggml_backend_tensor_set(state_in, hidden, 0, (size_t) n * hp.n_embd * sizeof(float));
    eval_range(ctx, l0, l1, flags);
    for (int32_t c : ctx.cells) {
        for (int32_t il = l0; il < l1; ++il) {
            ctx.kv.set_valid(c, il);
        }
    }
    ctx.layer_done = l1;
}

// all layers; plain causal batches longer than n_batch go through in chunks whose results are joined
void specee_eval_impl(specee_context & ctx, const specee_batch * batch) {
    const int32_t n_layer = (int32_t) ctx.model->hparams.n_layer;
    const int32_t n_batch = (int32_t) ctx.cparams.n_batch;
    if (!batch || batch->n_tokens <= n_batch || batch->tree_mask) {
        specee_eval_layers_impl(ctx, batch, 0, n_layer, 0);
        return;
    }
    const int32_t n = batch->n_tokens;
    if ((uint32_t) n > ctx.kv.size - ctx.kv.used) {
        ctx.kv.find_slots((uint32_t) n); // throws the context-overflow error before anything is written
    }
    std::vector<int32_t> pos, cells;
    std::vector<int8_t>  out(n);
    specee_batch_positions(ctx.kv, batch, pos);
    for (int32_t i = 0; i < n; ++i) {
        out[i] = specee_batch_output(batch, i);
    }
    std::vector<float> logits, norm, hidden, features;
    int32_t            n_outputs = 0;
    for (int32_t i0 = 0; i0 < n; i0 += n_batch) {
        specee_batch chunk = {std::min(n_batch, n - i0), batch->token + i0, pos.data() + i0, nullptr, out.data() + i0,
                              batch->seq_id ? batch->seq_id + i0 : nullptr};
        specee_eval_layers_impl(ctx, &chunk, 0, n_layer, 0);
        const std::vector<float> & h = specee_context_hidden(ctx);
        logits.insert(logits.end(), ctx.logits.begin(), ctx.logits.end());
        norm.insert(norm.end(), ctx.norm.begin(), ctx.norm.end());
        features.insert(features.end(), ctx.features.begin(), ctx.features.end());
        hidden.insert(hidden.end(), h.begin(), h.end());
        cells.insert(cells.end(), ctx.cells.begin(), ctx.cells.end());
        n_outputs += ctx.n_outputs;
    }
    ctx.n_tokens = n;
    ctx.tokens.assign(batch->token, batch->token + n);
    if (batch->seq_id) {
        ctx.seqs.assign(batch->seq_id, batch->seq_id + n);
    }
    ctx.pos         = pos;
    ctx.cells       = cells;
    ctx.logits      = std::move(logits);
    ctx.norm        = std::move(norm);
    ctx.features    = std::move(features);
    ctx.hidden      = std::move(hidden);
    ctx.hidden_read = true;
    ctx.n_outputs   = n_outputs;
}

// ---- creation ---------------------------------------------------------------------------------------

static void reserve_worst_case(specee_context & ctx) {
    const specee_hparams & hp = ctx.model->hparams;
    specee_graph_params    gp;
    gp.n_tokens    = (int32_t) ctx.cparams.n_batch;
    gp.n_kv        = (int32_t) ctx.kv.size;
    gp.layer_begin = 0;
    gp.layer_end   = (int32_t) hp.n_layer;
    gp.final_norm  = true;
    gp.n_outputs   = gp.n_tokens;
    if (ctx.model->eagle.version == 3) {
        gp.feature_layers = ctx.model->eagle.feature_layers;
    }
    gp.n_masks     = 1;
    gp.mask_of_layer.assign(hp.n_layer, 0);
    specee_graph_io io;
    specee_graph_reserve(ctx, build_layers(ctx, gp, io), "a batch of n_batch tokens over the whole context");
}

// the backends: the model's devices, then the CPU with its thread pools
static void init_backends(specee_context & ctx) {
    for (ggml_backend_dev_t dev : ctx.model->devices) {
        ggml_backend_t b = ggml_backend_dev_init(dev, nullptr);
        if (!b) {
            specee_fail("cannot initialise the backend of device %s", ggml_backend_dev_name(dev));
        }
        ctx.backends.push_back(b);
    }
    ctx.backend_cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
    if (!ctx.backend_cpu) {
        specee_fail("cannot initialise the CPU backend");
    }
    ctx.backends.push_back(ctx.backend_cpu);
    ggml_threadpool_params tpp = ggml_threadpool_params_default(ctx.cparams.n_threads);
    ctx.threadpool             = ggml_threadpool_new(&tpp);
    if (ctx.cparams.n_threads_batch != ctx.cparams.n_threads) {
        ggml_threadpool_params tpb = ggml_threadpool_params_default(ctx.cparams.n_threads_batch);
        ctx.threadpool_batch       = ggml_threadpool_new(&tpb);
    }
    ggml_backend_cpu_set_threadpool(ctx.backend_cpu, ctx.threadpool);
    ggml_backend_cpu_set_n_threads(ctx.backend_cpu, ctx.cparams.n_threads);
}

// the hidden state [n_embd, n_batch] on every backend
static void alloc_state(specee_context & ctx) {
    ggml_init_params sp = {ctx.backends.size() * ggml_tensor_overhead(), nullptr, /*no_alloc =*/true};
    ctx.state_ctx       = ggml_init(sp);
    for (size_t b = 0; b < ctx.backends.size(); ++b) {
        ggml_tensor * t = ggml_new_tensor_2d(ctx.state_ctx, GGML_TYPE_F32, ctx.model->hparams.n_embd,
                                             ctx.cparams.n_batch);
        ggml_format_name(t, "state-%zu", b);
        ggml_backend_buffer_t buf =
            ggml_backend_alloc_buffer(ctx.backends[b], ggml_backend_buft_get_alloc_size(
                                                           ggml_backend_get_default_buffer_type(ctx.backends[b]), t));
        if (!buf) {
            specee_fail("cannot allocate the hidden-state buffer on %s", ggml_backend_name(ctx.backends[b]));
        }
        ctx.state_bufs.push_back(buf);
        if (ggml_backend_tensor_alloc(buf, t, ggml_backend_buffer_get_base(buf)) != GGML_STATUS_SUCCESS) {
            specee_fail("cannot place the hidden-state tensor on %s", ggml_backend_name(ctx.backends[b]));
        }
        ctx.state.push_back(t);
    }
}

static specee_context * context_init_impl(specee_model * model, specee_context_params params) {
    if (!model) {
        specee_fail("no model");
    }
    auto ctx     = std::make_unique<specee_context>();
    ctx->model   = model;
    ctx->cparams = specee_context_params_resolve(*model, params);
    specee_ngram_cache_init(ctx->ngram_cache, ctx->cparams.ngram_cache);
    init_backends(*ctx);

    // ---- each layer's KV cache with its layer, the hidden state on every backend
    const specee_hparams &                  hp = model->hparams;
    std::vector<ggml_backend_buffer_type_t> layer_buft(hp.n_layer);
    for (uint32_t il = 0; il < hp.n_layer; ++il) {
        layer_buft[il] = ggml_backend_get_default_buffer_type(ctx->backends[specee_context_backend_of_layer(*ctx, il)]);
    }
    const ggml_type type_v = ctx->cparams.type_v == SPECEE_KV_F32 ? GGML_TYPE_F32 : GGML_TYPE_F16;
    specee_context_check_memory(*model, ctx->backends, ctx->backend_cpu, ctx->cparams.n_ctx, ctx->cparams.n_batch,
                                type_v);
    ctx->kv.init(hp, ctx->cparams.n_ctx, layer_buft, type_v);
    alloc_state(*ctx);

    // ---- the scheduler and the graph runner
    // each active LoRA adapter adds 4 nodes to each of a layer's (at most 7) projections
    ctx->graph_size = std::max<int32_t>(2048, (int32_t) hp.n_layer * (48 + 32 * SPECEE_LORA_MAX) + 64);
    ctx->graph_meta.resize(ggml_tensor_overhead() * ctx->graph_size + ggml_graph_overhead_custom(ctx->graph_size, false));
    ctx->sched = ggml_backend_sched_new(ctx->backends.data(), nullptr, (int) ctx->backends.size(), ctx->graph_size,
                                        false, true);
    if (!ctx->sched) {
        specee_fail("cannot create the backend scheduler");
    }
    ggml_backend_sched_set_eval_callback(ctx->sched, nullptr, nullptr);
    reserve_worst_case(*ctx);
    if (model->draft) { // the draft model's context: the same cells, batch and threads; no cross-request cache
        specee_context_params dp = ctx->cparams;
        dp.ngram_cache           = 0;
        ctx->draft.reset(context_init_impl(model->draft.get(), dp));
    }
    return ctx.release();
}

// ---- C API -----------------------------------------------------------------------------------------

extern "C" specee_context * specee_context_init(specee_model * model, struct specee_context_params params) {
    return specee_guard<specee_context *>(nullptr, [&] { return context_init_impl(model, params); });
}

extern "C" void specee_context_free(specee_context * ctx) { delete ctx; }

extern "C" uint32_t specee_n_ctx(const specee_context * ctx) { return ctx->cparams.n_ctx; }
extern "C" uint32_t specee_n_batch(const specee_context * ctx) { return ctx->cparams.n_batch; }
extern "C" int32_t  specee_n_threads(const specee_context * ctx) { return ctx->cparams.n_threads; }
extern "C" size_t   specee_kv_nbytes(const specee_context * ctx) { return ctx->kv.nbytes(); }

extern "C" int32_t specee_eval_layers(specee_context * ctx, const struct specee_batch * batch, int32_t layer_begin,
                                      int32_t layer_end, uint32_t flags) {
    std::lock_guard<std::recursive_mutex> lock(ctx->mutex);
    return specee_guard<int32_t>(-1, [&] {
        specee_eval_layers_impl(*ctx, batch, layer_begin, layer_end, flags);
        return 0;
    });
}

extern "C" int32_t specee_eval(specee_context * ctx, const struct specee_batch * batch) {
    std::lock_guard<std::recursive_mutex> lock(ctx->mutex);
    return specee_guard<int32_t>(-1, [&] {
        specee_eval_impl(*ctx, batch);
        return 0;
    });
}

extern "C" int32_t specee_n_outputs(const specee_context * ctx) { return ctx->n_outputs; }
extern "C" const float * specee_get_logits(const specee_context * ctx) { return ctx->logits.data(); }
extern "C" int32_t specee_last_n_tokens(const specee_context * ctx) { return ctx->n_tokens; }

extern "C" const float * specee_get_hidden(const specee_context * cctx, int32_t il) {
    specee_context & ctx = const_cast<specee_context &>(*cctx); // reading the state is a lazy copy
    std::lock_guard<std::recursive_mutex> lock(ctx.mutex);
    const int32_t n_layer = (int32_t) ctx.model->hparams.n_layer;
    if (il < -1 || il >= n_layer) {
        specee_set_error(specee_format("layer %d is out of range: -1 (after the last evaluated layer) or 0..%d", il,
                                       n_layer - 1));
        return nullptr;
    }
    if (ctx.layer_done == 0 || ctx.n_tokens == 0) {
        specee_set_error("no hidden state: nothing has been evaluated yet");
        return nullptr;
    }
    if (il < 0 || il == ctx.layer_done - 1) {
        return specee_context_hidden(ctx).data();
    }
    if (il >= (int32_t) ctx.hidden_layers.size() || ctx.hidden_layers[il].empty()) {
        specee_set_error(specee_format("the hidden state after layer %d was not kept (use SPECEE_EVAL_HIDDEN_ALL)", il));
        return nullptr;
    }
    return ctx.hidden_layers[il].data();
}

extern "C" const float * specee_get_norm(const specee_context * ctx) {
    if (ctx->n_tokens == 0) {
        specee_set_error("no final-norm output: nothing has been evaluated yet");
        return nullptr;
    }
    if (ctx->norm.empty()) {
        specee_set_error("no final-norm output: the last evaluation did not run the last layer");
        return nullptr;
    }
    return ctx->norm.data();
}

extern "C" const float * specee_get_features(const specee_context * ctx) {
    if (ctx->model->eagle.version != 3) {
        specee_set_error("no EAGLE-3 features: the model has no EAGLE-3 draft head");
        return nullptr;
    }
    const std::vector<int32_t> & fl = ctx->model->eagle.feature_layers;
    if (ctx->n_tokens == 0 || ctx->layer_done <= *std::max_element(fl.begin(), fl.end())) {
        specee_set_error("no EAGLE-3 features: the last evaluation did not reach every feature layer");
        return nullptr;
    }
    return ctx->features.data();
}

extern "C" void specee_kv_clear(specee_context * ctx) {
    std::lock_guard<std::recursive_mutex> lock(ctx->mutex);
    ctx->kv.clear();
    ctx->n_tokens = 0;
    ctx->cells.clear();
}

extern "C" int32_t specee_kv_n_used(const specee_context * ctx) { return (int32_t) ctx->kv.used; }
extern "C" int32_t specee_kv_pos_max(const specee_context * ctx) { return ctx->kv.pos_max(); }

extern "C" int32_t specee_kv_remove(specee_context * ctx, int32_t p0, int32_t p1) {
    std::lock_guard<std::recursive_mutex> lock(ctx->mutex);
    return ctx->kv.remove(p0, p1);
}

extern "C" const int32_t * specee_kv_batch_cells(const specee_context * ctx) { return ctx->cells.data(); }

extern "C" int32_t specee_kv_remove_cells(specee_context * ctx, const int32_t * cells, int32_t n) {
    std::lock_guard<std::recursive_mutex> lock(ctx->mutex);
    int32_t removed = 0;
    for (int32_t i = 0; i < n; ++i) {
        if (cells[i] >= 0 && (uint32_t) cells[i] < ctx->kv.size && ctx->kv.pos[cells[i]] >= 0) {
            ctx->kv.free_cell(cells[i]);
            removed++;
        }
    }
    return removed;
}

static bool seq_ok(int32_t s) { return s >= 0 && s < SPECEE_MAX_SEQ; }

extern "C" int32_t specee_kv_seq_remove(specee_context * ctx, int32_t seq, int32_t p0, int32_t p1) {
    std::lock_guard<std::recursive_mutex> lock(ctx->mutex);
    if (seq >= SPECEE_MAX_SEQ) {
        specee_set_error(specee_format("sequence id %d is out of range [0, %d)", seq, SPECEE_MAX_SEQ));
        return -1;
    }
    return ctx->kv.seq_remove(seq, p0, p1);
}

extern "C" int32_t specee_kv_seq_copy(specee_context * ctx, int32_t src, int32_t dst, int32_t p0, int32_t p1) {
    std::lock_guard<std::recursive_mutex> lock(ctx->mutex);
    if (!seq_ok(src) || !seq_ok(dst)) {
        specee_set_error(specee_format("sequence ids %d, %d: each must be in [0, %d)", src, dst, SPECEE_MAX_SEQ));
        return -1;
    }
    return ctx->kv.seq_copy(src, dst, p0, p1);
}

extern "C" int32_t specee_kv_seq_pos_max(const specee_context * ctx, int32_t seq) {
    return seq_ok(seq) ? ctx->kv.pos_max(seq) : -1;
}

extern "C" int32_t specee_kv_seq_n_cells(const specee_context * ctx, int32_t seq) {
    return seq_ok(seq) ? ctx->kv.seq_n_cells(seq) : 0;
}

extern "C" bool specee_kv_cell_has_seq(const specee_context * ctx, int32_t cell, int32_t seq) {
    return seq_ok(seq) && cell >= 0 && (uint32_t) cell < ctx->kv.size && ctx->kv.pos[cell] >= 0 &&
           ctx->kv.has_seq(cell, seq);
}

extern "C" int32_t specee_kv_cell_pos(const specee_context * ctx, int32_t cell) {
    return (cell >= 0 && (uint32_t) cell < ctx->kv.size) ? ctx->kv.pos[cell] : -1;
}

extern "C" bool specee_kv_cell_valid(const specee_context * ctx, int32_t cell, int32_t il) {
    return cell >= 0 && (uint32_t) cell < ctx->kv.size && il >= 0 && (uint32_t) il < ctx->kv.n_layer &&
           ctx->kv.pos[cell] >= 0 && ctx->kv.is_valid(cell, il);
}
