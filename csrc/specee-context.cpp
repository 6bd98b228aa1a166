// specee-context.cpp: a context over a model: backends, scheduler, KV cache, batch evaluation by layer ranges
#include "specee-context.h"
#include "specee-graph.h"
#include "specee-impl.h"
#include "specee-kv-cache.h"
#include "specee-model.h"
#include "specee.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <thread>

struct specee_context {
    specee_model *               model = nullptr;
    specee_context_params        cparams{};
    specee_kv_cache              kv;
    ggml_backend_t               backend_cpu = nullptr;
    ggml_threadpool_t            threadpool  = nullptr;
    ggml_threadpool_t            threadpool_batch = nullptr;
    ggml_backend_sched_t         sched       = nullptr;
    std::vector<uint8_t>         graph_meta; // memory for graph and tensor metadata
    int32_t                      graph_size  = 0;

    // the last batch
    int32_t              n_tokens   = 0;
    int32_t              layer_done = 0; // layers [0, layer_done) evaluated for it
    std::vector<int32_t> tokens, pos, cells;
    std::vector<uint8_t> tree_mask; // [n_tokens * n_tokens] or empty: causal
    std::vector<int32_t> out_ids;

    // results of the last batch
    std::vector<float>              hidden;        // [n_tokens * n_embd] after layer_done - 1
    std::vector<std::vector<float>> hidden_layers; // [n_layer][n_tokens * n_embd] when kept
    std::vector<float>              norm;          // [n_tokens * n_embd]
    std::vector<float>              logits;        // [n_outputs * n_vocab]
    int32_t                         n_outputs = 0;

    ~specee_context() {
        if (sched) {
            ggml_backend_sched_free(sched);
        }
        if (backend_cpu) {
            ggml_backend_free(backend_cpu);
        }
        if (threadpool) {
            ggml_threadpool_free(threadpool);
        }
        if (threadpool_batch) {
            ggml_threadpool_free(threadpool_batch);
        }
    }
};

// ---- masks -----------------------------------------------------------------------------------------

// Fill one [n_tokens][n_kv] F16 mask per group of layers with the same cell validity.
// Token i sees a cached cell when it is valid in the layer and pos[cell] <= pos[i]; it sees batch
// token j by the tree mask (or pos[j] <= pos[i] when causal).
// One token decodes on the n_threads pool, a batch on the n_threads_batch pool; the CPU backend plans the graph
// for its own thread count, so that must follow the pool (otherwise work is split for the wrong count).
static void specee_context_use_threads(specee_context & ctx, int32_t n_tokens) {
    const bool batch = n_tokens > 1 && ctx.threadpool_batch;
    ggml_backend_cpu_set_threadpool(ctx.backend_cpu, batch ? ctx.threadpool_batch : ctx.threadpool);
    ggml_backend_cpu_set_n_threads(ctx.backend_cpu, batch ? ctx.cparams.n_threads_batch : ctx.cparams.n_threads);
}

static void build_masks(const specee_context & ctx, int32_t n_kv, int32_t l0, int32_t l1,
                        std::vector<std::vector<ggml_fp16_t>> & masks, std::vector<int32_t> & mask_of_layer) {
    const specee_kv_cache & kv = ctx.kv;
    const int32_t           n  = ctx.n_tokens;

    std::vector<int32_t> batch_index(n_kv, -1);
    for (int32_t j = 0; j < n; ++j) {
        batch_index[ctx.cells[j]] = j;
    }

    // cached cells visible in a layer: group layers with equal columns
    std::vector<std::vector<uint8_t>> columns;
    mask_of_layer.assign(l1 - l0, 0);
    for (int32_t il = l0; il < l1; ++il) {
        std::vector<uint8_t> col(n_kv, 0);
        for (int32_t c = 0; c < n_kv; ++c) {
            col[c] = batch_index[c] < 0 && kv.pos[c] >= 0 && kv.is_valid(c, il);
        }
        int32_t g = -1;
        for (size_t k = 0; k < columns.size(); ++k) {
            if (columns[k] == col) {
                g = (int32_t) k;
                break;
            }
        }
        if (g < 0) {
            g = (int32_t) columns.size();
            columns.push_back(std::move(col));
        }
        mask_of_layer[il - l0] = g;
    }

    const ggml_fp16_t zero    = ggml_fp32_to_fp16(0.0f);
    const ggml_fp16_t neg_inf = ggml_fp32_to_fp16(-INFINITY);
    masks.assign(columns.size(), std::vector<ggml_fp16_t>((size_t) n_kv * n, neg_inf));
    for (size_t g = 0; g < columns.size(); ++g) {
        for (int32_t i = 0; i < n; ++i) {
            ggml_fp16_t * row = masks[g].data() + (size_t) i * n_kv;
            for (int32_t c = 0; c < n_kv; ++c) {
                const int32_t j = batch_index[c];
                bool          see;
                if (j >= 0) {
                    see = ctx.tree_mask.empty() ? ctx.pos[j] <= ctx.pos[i] : ctx.tree_mask[(size_t) i * n + j] != 0;
                } else {
                    see = columns[g][c] && kv.pos[c] <= ctx.pos[i];
                }
                if (see) {
                    row[c] = zero;
                }
            }
        }
    }
}

// ---- evaluation ------------------------------------------------------------------------------------

static void check_batch(const specee_context & ctx, const specee_batch * batch) {
    if (!batch || batch->n_tokens <= 0 || !batch->token) {
        specee_fail("empty batch: nothing to evaluate");
    }
    if ((uint32_t) batch->n_tokens > ctx.cparams.n_batch) {
        specee_fail("batch of %d tokens exceeds n_batch=%u", batch->n_tokens, ctx.cparams.n_batch);
    }
    const int32_t n_vocab = (int32_t) ctx.model->hparams.n_vocab;
    for (int32_t i = 0; i < batch->n_tokens; ++i) {
        if (batch->token[i] < 0 || batch->token[i] >= n_vocab) {
            specee_fail("token id %d at index %d is out of range [0, %d)", batch->token[i], i, n_vocab);
        }
        if (batch->pos && batch->pos[i] < 0) {
            specee_fail("negative position %d at index %d", batch->pos[i], i);
        }
    }
}

// begin a batch: copy it, choose its cells (nothing in the cache changes yet)
static void start_batch(specee_context & ctx, const specee_batch * batch) {
    const int32_t n = batch->n_tokens;
    ctx.cells       = ctx.kv.find_slots((uint32_t) n);
    ctx.n_tokens    = n;
    ctx.layer_done  = 0;
    ctx.tokens.assign(batch->token, batch->token + n);
    ctx.pos.resize(n);
    const int32_t p0 = ctx.kv.pos_max() + 1;
    for (int32_t i = 0; i < n; ++i) {
        ctx.pos[i] = batch->pos ? batch->pos[i] : p0 + i;
    }
    if (batch->tree_mask) {
        ctx.tree_mask.assign(batch->tree_mask, batch->tree_mask + (size_t) n * n);
    } else {
        ctx.tree_mask.clear();
    }
    ctx.out_ids.clear();
    for (int32_t i = 0; i < n; ++i) {
        if (batch->output ? batch->output[i] != 0 : i == n - 1) {
            ctx.out_ids.push_back(i);
        }
    }
    ctx.hidden_layers.clear();
    ctx.norm.clear();
    ctx.logits.clear();
    ctx.n_outputs = 0;
}

static void eval_range(specee_context & ctx, int32_t l0, int32_t l1, uint32_t flags) {
    const specee_model &   model = *ctx.model;
    const specee_hparams & hp    = model.hparams;
    const int32_t          n     = ctx.n_tokens;
    const bool             last  = l1 == (int32_t) hp.n_layer;

    // cells attended to: every used cell and this batch's cells
    int32_t n_kv = (int32_t) ctx.kv.n_kv();
    for (int32_t c : ctx.cells) {
        n_kv = std::max(n_kv, c + 1);
    }

    specee_graph_params gp;
    gp.n_tokens    = n;
    gp.n_kv        = n_kv;
    gp.layer_begin = l0;
    gp.layer_end   = l1;
    gp.hidden_all  = (flags & SPECEE_EVAL_HIDDEN_ALL) != 0;
    gp.final_norm  = last;
    gp.n_outputs   = last && !(flags & SPECEE_EVAL_NO_LOGITS) ? (int32_t) ctx.out_ids.size() : 0;

    std::vector<std::vector<ggml_fp16_t>> masks;
    build_masks(ctx, n_kv, l0, l1, masks, gp.mask_of_layer);
    gp.n_masks = (int32_t) masks.size();

    ggml_init_params ip = {ctx.graph_meta.size(), ctx.graph_meta.data(), /*no_alloc =*/true};
    ggml_context *   ctx0 = ggml_init(ip);
    std::unique_ptr<ggml_context, void (*)(ggml_context *)> ctx0_guard(ctx0, ggml_free);
    specee_graph_io io;
    ggml_cgraph *   gf = specee_build_graph(ctx0, model, ctx.kv, gp, io, ctx.graph_size);

    ggml_backend_sched_reset(ctx.sched);
    if (!ggml_backend_sched_alloc_graph(ctx.sched, gf)) {
        specee_fail("cannot allocate the compute graph (%d tokens, %d cells)", n, n_kv);
    }

    // ---- inputs
    if (io.inp_tokens) {
        ggml_backend_tensor_set(io.inp_tokens, ctx.tokens.data(), 0, n * sizeof(int32_t));
    } else {
        ggml_backend_tensor_set(io.inp_embd, ctx.hidden.data(), 0, ctx.hidden.size() * sizeof(float));
    }
    ggml_backend_tensor_set(io.inp_pos, ctx.pos.data(), 0, n * sizeof(int32_t));
    std::vector<int64_t> idxs(ctx.cells.begin(), ctx.cells.end());
    ggml_backend_tensor_set(io.inp_kv_idxs, idxs.data(), 0, n * sizeof(int64_t));
    for (size_t g = 0; g < masks.size(); ++g) {
        ggml_backend_tensor_set(io.inp_masks[g], masks[g].data(), 0, masks[g].size() * sizeof(ggml_fp16_t));
    }
    if (io.inp_out_ids) {
        ggml_backend_tensor_set(io.inp_out_ids, ctx.out_ids.data(), 0, ctx.out_ids.size() * sizeof(int32_t));
    }

    specee_context_use_threads(ctx, n);
    if (ggml_backend_sched_graph_compute(ctx.sched, gf) != GGML_STATUS_SUCCESS) {
        specee_fail("graph computation failed");
    }

    // ---- outputs
    const size_t n_hidden = (size_t) n * hp.n_embd;
    ctx.hidden.resize(n_hidden);
    ggml_backend_tensor_get(io.l_out.back(), ctx.hidden.data(), 0, n_hidden * sizeof(float));
    if (gp.hidden_all) {
        ctx.hidden_layers.resize(hp.n_layer);
        for (int32_t il = l0; il < l1; ++il) {
            std::vector<float> & h = ctx.hidden_layers[il];
            h.resize(n_hidden);
            ggml_backend_tensor_get(io.l_out[il - l0], h.data(), 0, n_hidden * sizeof(float));
        }
    }
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

static int32_t eval_layers_impl(specee_context & ctx, const specee_batch * batch, int32_t l0, int32_t l1,
                                uint32_t flags) {
    const int32_t n_layer = (int32_t) ctx.model->hparams.n_layer;
    if (l0 < 0 || l1 > n_layer || l0 >= l1) {
        specee_fail("invalid layer range [%d, %d) for a model of %d layers", l0, l1, n_layer);
    }
    check_batch(ctx, batch);
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
        }
        throw;
    }
    if (first) {
        for (int32_t i = 0; i < ctx.n_tokens; ++i) {
            ctx.kv.occupy(ctx.cells[i], ctx.pos[i]);
        }
    }
    for (int32_t c : ctx.cells) {
        for (int32_t il = l0; il < l1; ++il) {
            ctx.kv.set_valid(c, il);
        }
    }
    ctx.layer_done = l1;
    return 0;
}

// ---- C API -----------------------------------------------------------------------------------------

extern "C" struct specee_context_params specee_context_default_params(void) {
    specee_context_params p;
    p.n_ctx           = 0;
    p.n_batch         = 512;
    p.n_threads       = (int32_t) std::max(1u, std::thread::hardware_concurrency());
    p.n_threads_batch = p.n_threads;
    p.type_v          = SPECEE_KV_F16;
    return p;
}

static specee_context * context_init_impl(specee_model * model, specee_context_params params) {
    if (!model) {
        specee_fail("no model");
    }
    auto ctx    = std::make_unique<specee_context>();
    ctx->model  = model;
    if (params.n_ctx == 0) {
        params.n_ctx = model->hparams.n_ctx_train;
    }
    if (params.n_batch == 0) {
        params.n_batch = 512;
    }
    params.n_batch = std::min(params.n_batch, params.n_ctx);
    if (params.n_threads <= 0) {
        params.n_threads = specee_context_default_params().n_threads;
    }
    if (params.n_threads_batch <= 0) {
        params.n_threads_batch = params.n_threads;
    }
    ctx->cparams = params;

    ctx->backend_cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
    if (!ctx->backend_cpu) {
        specee_fail("cannot initialise the CPU backend");
    }
    ggml_threadpool_params tpp = ggml_threadpool_params_default(params.n_threads);
    ctx->threadpool            = ggml_threadpool_new(&tpp);
    if (params.n_threads_batch != params.n_threads) {
        ggml_threadpool_params tpb = ggml_threadpool_params_default(params.n_threads_batch);
        ctx->threadpool_batch      = ggml_threadpool_new(&tpb);
    }
    ggml_backend_cpu_set_threadpool(ctx->backend_cpu, ctx->threadpool);
    ggml_backend_cpu_set_n_threads(ctx->backend_cpu, params.n_threads);

    if (params.type_v != SPECEE_KV_F16 && params.type_v != SPECEE_KV_F32) {
        specee_fail("unknown V cache type %d (0: f16, 1: f32)", params.type_v);
    }
    ctx->kv.init(model->hparams, params.n_ctx, ggml_backend_get_default_buffer_type(ctx->backend_cpu),
                 params.type_v == SPECEE_KV_F32 ? GGML_TYPE_F32 : GGML_TYPE_F16);

    ctx->graph_size = std::max<int32_t>(2048, (int32_t) model->hparams.n_layer * 48 + 64);
    ctx->graph_meta.resize(ggml_tensor_overhead() * ctx->graph_size +
                           ggml_graph_overhead_custom(ctx->graph_size, false));
    ggml_backend_t backends[1] = {ctx->backend_cpu};
    ctx->sched = ggml_backend_sched_new(backends, nullptr, 1, ctx->graph_size, false, false);
    if (!ctx->sched) {
        specee_fail("cannot create the backend scheduler");
    }
    return ctx.release();
}

extern "C" specee_context * specee_context_init(specee_model * model, struct specee_context_params params) {
    return specee_guard<specee_context *>(nullptr, [&] { return context_init_impl(model, params); });
}

extern "C" void specee_context_free(specee_context * ctx) { delete ctx; }

extern "C" uint32_t specee_n_ctx(const specee_context * ctx) { return ctx->cparams.n_ctx; }
extern "C" uint32_t specee_n_batch(const specee_context * ctx) { return ctx->cparams.n_batch; }

extern "C" int32_t specee_eval_layers(specee_context * ctx, const struct specee_batch * batch, int32_t layer_begin,
                                      int32_t layer_end, uint32_t flags) {
    return specee_guard<int32_t>(-1, [&] { return eval_layers_impl(*ctx, batch, layer_begin, layer_end, flags); });
}

// all layers; plain causal batches longer than n_batch go through in chunks whose results are joined
static int32_t eval_impl(specee_context & ctx, const specee_batch * batch) {
    const int32_t n_layer = (int32_t) ctx.model->hparams.n_layer;
    const int32_t n_batch = (int32_t) ctx.cparams.n_batch;
    if (!batch || batch->n_tokens <= n_batch || batch->tree_mask) {
        return eval_layers_impl(ctx, batch, 0, n_layer, 0);
    }
    const int32_t n = batch->n_tokens;
    if ((uint32_t) n > ctx.kv.size - ctx.kv.used) {
        ctx.kv.find_slots((uint32_t) n); // throws the context-overflow error before anything is written
    }
    const int32_t        p0 = ctx.kv.pos_max() + 1;
    std::vector<int32_t> pos(n), cells;
    std::vector<int8_t>  out(n);
    for (int32_t i = 0; i < n; ++i) {
        pos[i] = batch->pos ? batch->pos[i] : p0 + i;
        out[i] = batch->output ? batch->output[i] : (int8_t) (i == n - 1);
    }
    std::vector<float> logits, norm, hidden;
    int32_t            n_outputs = 0;
    std::vector<int32_t> all_tokens(batch->token, batch->token + n);
    for (int32_t i0 = 0; i0 < n; i0 += n_batch) {
        specee_batch chunk = {std::min(n_batch, n - i0), batch->token + i0, pos.data() + i0, nullptr, out.data() + i0};
        eval_layers_impl(ctx, &chunk, 0, n_layer, 0);
        logits.insert(logits.end(), ctx.logits.begin(), ctx.logits.end());
        norm.insert(norm.end(), ctx.norm.begin(), ctx.norm.end());
        hidden.insert(hidden.end(), ctx.hidden.begin(), ctx.hidden.end());
        cells.insert(cells.end(), ctx.cells.begin(), ctx.cells.end());
        n_outputs += ctx.n_outputs;
    }
    ctx.n_tokens  = n;
    ctx.tokens    = all_tokens;
    ctx.pos       = pos;
    ctx.cells     = cells;
    ctx.logits    = std::move(logits);
    ctx.norm      = std::move(norm);
    ctx.hidden    = std::move(hidden);
    ctx.n_outputs = n_outputs;
    return 0;
}

extern "C" int32_t specee_eval(specee_context * ctx, const struct specee_batch * batch) {
    return specee_guard<int32_t>(-1, [&] { return eval_impl(*ctx, batch); });
}

extern "C" int32_t specee_n_outputs(const specee_context * ctx) { return ctx->n_outputs; }
extern "C" const float * specee_get_logits(const specee_context * ctx) { return ctx->logits.data(); }
extern "C" int32_t specee_last_n_tokens(const specee_context * ctx) { return ctx->n_tokens; }

extern "C" const float * specee_get_hidden(const specee_context * ctx, int32_t il) {
    if (il < 0 || il == ctx->layer_done - 1) {
        return ctx->hidden.empty() ? nullptr : ctx->hidden.data();
    }
    if (il >= (int32_t) ctx->hidden_layers.size() || ctx->hidden_layers[il].empty()) {
        specee_set_error(specee_format("the hidden state after layer %d was not kept (use SPECEE_EVAL_HIDDEN_ALL)", il));
        return nullptr;
    }
    return ctx->hidden_layers[il].data();
}

extern "C" const float * specee_get_norm(const specee_context * ctx) {
    return ctx->norm.empty() ? nullptr : ctx->norm.data();
}

extern "C" void specee_kv_clear(specee_context * ctx) {
    ctx->kv.clear();
    ctx->n_tokens = 0;
    ctx->cells.clear();
}

extern "C" int32_t specee_kv_n_used(const specee_context * ctx) { return (int32_t) ctx->kv.used; }
extern "C" int32_t specee_kv_pos_max(const specee_context * ctx) { return ctx->kv.pos_max(); }

extern "C" int32_t specee_kv_remove(specee_context * ctx, int32_t p0, int32_t p1) {
    int32_t removed = 0;
    for (uint32_t c = 0; c < ctx->kv.size; ++c) {
        const int32_t p = ctx->kv.pos[c];
        if (p >= 0 && p >= p0 && (p1 < 0 || p < p1)) {
            ctx->kv.free_cell((int32_t) c);
            removed++;
        }
    }
    return removed;
}

extern "C" const int32_t * specee_kv_batch_cells(const specee_context * ctx) { return ctx->cells.data(); }

extern "C" int32_t specee_kv_remove_cells(specee_context * ctx, const int32_t * cells, int32_t n) {
    int32_t removed = 0;
    for (int32_t i = 0; i < n; ++i) {
        if (cells[i] >= 0 && (uint32_t) cells[i] < ctx->kv.size && ctx->kv.pos[cells[i]] >= 0) {
            ctx->kv.free_cell(cells[i]);
            removed++;
        }
    }
    return removed;
}

extern "C" int32_t specee_kv_cell_pos(const specee_context * ctx, int32_t cell) {
    return (cell >= 0 && (uint32_t) cell < ctx->kv.size) ? ctx->kv.pos[cell] : -1;
}

extern "C" bool specee_kv_cell_valid(const specee_context * ctx, int32_t cell, int32_t il) {
    return cell >= 0 && (uint32_t) cell < ctx->kv.size && il >= 0 && (uint32_t) il < ctx->kv.n_layer &&
           ctx->kv.pos[cell] >= 0 && ctx->kv.is_valid(cell, il);
}

// ---- internals (specee-context.h) -------------------------------------------------------------------

ggml_backend_sched_t specee_context_sched(specee_context & ctx) { return ctx.sched; }

ggml_backend_buffer_type_t specee_context_buft(specee_context & ctx) {
    return ggml_backend_get_default_buffer_type(ctx.backend_cpu);
}

int32_t specee_context_graph_size(const specee_context & ctx) { return ctx.graph_size; }

void specee_context_compute(specee_context & ctx, ggml_cgraph * gf, int32_t n_tokens) {
    specee_context_use_threads(ctx, n_tokens);
    if (ggml_backend_sched_graph_compute(ctx.sched, gf) != GGML_STATUS_SUCCESS) {
        specee_fail("graph computation failed");
    }
}

specee_kv_cache & specee_context_kv(specee_context & ctx) { return ctx.kv; }

const specee_model * specee_context_model(const specee_context & ctx) { return ctx.model; }
