// specee-pass-cost.cpp: what a pass of n tokens costs on a context, in single-token passes: timed once per context
// (specee_context_pass_cost: `auto` weighs EAGLE-2 with it, n-gram lookup its chain lengths), or given
// (specee_context_set_pass_cost: a test of the rules that read it, an earlier measurement), which then holds.
#include "specee-batch.h"
#include "specee-context.h"
#include "specee-impl.h"
#include "specee-model.h"
#include "specee-pass-cost.h"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

// one pass of n tokens after the cache's last position, every token with logits, removed again; its time in ms
static double one_pass(specee_context & ctx, int32_t n) {
    const int32_t        p0 = specee_batch_next_pos(ctx.kv, n);
    std::vector<int32_t> tok(n, 0), pos(n);
    std::vector<int8_t>  out(n, 1);
    for (int32_t i = 0; i < n; ++i) {
        pos[i] = p0 + i;
    }
    specee_batch b  = {n, tok.data(), pos.data(), nullptr, out.data()};
    const auto   t0 = specee_clock::now();
    specee_eval_layers_impl(ctx, &b, 0, (int32_t) ctx.model->hparams.n_layer, 0);
    const double ms = specee_ms_since(t0);
    ctx.kv.remove(p0, -1);
    return ms;
}

double specee_context_pass_cost_given(const specee_context & ctx, int32_t n) {
    return n >= 1 && n < (int32_t) ctx.pass_given.size() && ctx.pass_given[n] > 0.0 ? ctx.pass_given[n] : NAN;
}

double specee_context_pass_cost_known(const specee_context & ctx, int32_t n) {
    if (n == 1) {
        return 1.0;
    }
    const double given = specee_context_pass_cost_given(ctx, n);
    if (!std::isnan(given)) {
        return given;
    }
    if (n < 1 || n >= (int32_t) ctx.pass_ms.size() || ctx.pass_ms[1] <= 0.0 || ctx.pass_ms[n] <= 0.0) {
        return NAN;
    }
    return ctx.pass_ms[n] / ctx.pass_ms[1];
}

double specee_context_pass_cost(specee_context & ctx, int32_t n) {
    const double given = specee_context_pass_cost_given(ctx, n);
    if (!std::isnan(given)) {
        return given;
    }
    if (n < 1 || (uint32_t) n > ctx.cparams.n_batch || ctx.kv.used + (uint32_t) n > ctx.kv.size ||
        (int64_t) ctx.kv.pos_max() + n > INT32_MAX) { // no room, no positions left
        return NAN;
    }
    ctx.pass_ms.resize(std::max((int32_t) ctx.pass_ms.size(), n + 1), 0.0);
    if (ctx.pass_ms[1] <= 0.0 || ctx.pass_ms[n] <= 0.0) {
        // a warm-up pass of each size not timed before (its graph is built, its weights are read once), then three
        // of each in turn (both see the same load), the fastest kept: a first request pays these passes
        if (ctx.pass_ms[1] <= 0.0) {
            one_pass(ctx, 1);
        }
        one_pass(ctx, n);
        double t1 = INFINITY, tn = INFINITY;
        for (int32_t r = 0; r < 3; ++r) {
            t1 = std::min(t1, one_pass(ctx, 1));
            tn = std::min(tn, one_pass(ctx, n));
        }
        ctx.pass_ms[1] = ctx.pass_ms[1] > 0.0 ? std::min(ctx.pass_ms[1], t1) : t1;
        ctx.pass_ms[n] = tn;
    }
    return ctx.pass_ms[n] / ctx.pass_ms[1];
}

extern "C" int32_t specee_context_set_pass_cost(specee_context * ctx, int32_t n_tokens, double cost) {
    if (!ctx) {
        specee_set_error("no context");
        return -1;
    }
    std::lock_guard<std::recursive_mutex> lock(ctx->mutex);
    return specee_guard<int32_t>(-1, [&] {
        if (n_tokens < 2 || (uint32_t) n_tokens > ctx->cparams.n_batch) {
            specee_fail("a pass cost is set for 2 to n_batch (%u) tokens, not %d", ctx->cparams.n_batch, n_tokens);
        }
        if (!(cost >= 1.0) || !std::isfinite(cost)) {
            specee_fail("a pass of %d tokens costs at least one single pass: %g", n_tokens, cost);
        }
        ctx->pass_given.resize(std::max(ctx->pass_given.size(), (size_t) n_tokens + 1), 0.0);
        ctx->pass_given[n_tokens] = cost;
        return 0;
    });
}

