// specee-capture.cpp: named intermediates: the graph's nodes a caller names (specee_set_capture; the names are those
// of specee-graph.cpp, "attn_norm-3"), copied to the host by the scheduler's eval callback as each is computed and
// read after the evaluation (specee_get_capture). The context holds the names and the copies (specee-context.h).
#include "specee-context.h"

#include "specee-impl.h"

#include <algorithm>
#include <mutex>

// the scheduler's eval callback: asks for the captured names, then copies each one as it is computed
static bool capture_callback(ggml_tensor * t, bool ask, void * user_data) {
    specee_context & ctx  = *(specee_context *) user_data;
    const char *     name = ggml_get_name(t);
    const bool       want = std::find(ctx.capture_names.begin(), ctx.capture_names.end(), name) != ctx.capture_names.end();
    if (ask || !want) {
        return want || !ask;
    }
    const int64_t      ne0  = t->ne[0];
    const int64_t      rows = ggml_nelements(t) / ne0;
    std::vector<float> data((size_t) ggml_nelements(t));
    if (t->type == GGML_TYPE_F32 && ggml_is_contiguous(t)) {
        ggml_backend_tensor_get(t, data.data(), 0, data.size() * sizeof(float));
    } else if (t->type == GGML_TYPE_F16 && ggml_is_contiguous(t)) {
        std::vector<ggml_fp16_t> h(data.size());
        ggml_backend_tensor_get(t, h.data(), 0, h.size() * sizeof(ggml_fp16_t));
        ggml_fp16_to_fp32_row(h.data(), data.data(), (int64_t) h.size());
    } else {
        return true; // not a float tensor: not captured
    }
    ctx.captured[name]       = std::move(data);
    ctx.captured_shape[name] = {ne0, rows};
    return true;
}

// ---- C API -----------------------------------------------------------------------------------------

extern "C" int32_t specee_set_capture(specee_context * ctx, const char * const * names, int32_t n) {
    std::lock_guard<std::recursive_mutex> lock(ctx->mutex);
    return specee_guard<int32_t>(-1, [&] {
        if (n < 0 || (n > 0 && !names)) {
            specee_fail("specee_set_capture: bad list of names");
        }
        ctx->capture_names.assign(names, names + n);
        ctx->captured.clear();
        ctx->captured_shape.clear();
        if (n > 0) {
            ggml_backend_sched_set_eval_callback(ctx->sched, capture_callback, ctx);
        } else {
            ggml_backend_sched_set_eval_callback(ctx->sched, nullptr, nullptr);
        }
        return 0;
    });
}

extern "C" const float * specee_get_capture(const specee_context * ctx, const char * name, int64_t * ne0,
                                            int64_t * n_rows) {
    const auto it = ctx->captured.find(name ? name : "");
    if (it == ctx->captured.end()) {
        specee_set_error(specee_format("'%s' was not captured by the last evaluation (specee_set_capture names the "
                                       "nodes to keep; see specee-graph.cpp for the names)", name ? name : ""));
        return nullptr;
    }
    const auto & shape = ctx->captured_shape.at(it->first);
    if (ne0) {
        *ne0 = shape.first;
    }
    if (n_rows) {
        *n_rows = shape.second;
    }
    return it->second.data();
}
