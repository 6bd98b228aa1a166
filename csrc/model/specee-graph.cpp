// specee-graph.cpp: the forward pass of every family (specee-arch.cpp) as a plain loop over a range of layers, every
// intermediate named "<name>-<layer>" so tools can read it
#include "specee-graph.h"

#include "specee-kernels.h"
#include "specee-kv-cache.h"
#include "specee-model.h"

#include <algorithm>
#include <cmath>

static void name_il(ggml_tensor * t, const char * name, int il) {
    if (il >= 0) {
        ggml_format_name(t, "%s-%d", name, il);
    } else if (il == SPECEE_IL_EAGLE) {
        ggml_format_name(t, "eagle_%s", name);
    } else {
        ggml_set_name(t, name);
    }
}

static ggml_tensor * build_norm(ggml_context * ctx0, ggml_tensor * x, ggml_tensor * w, float eps) {
    return ggml_mul(ctx0, ggml_rms_norm(ctx0, x, eps), w);
}

// the RoPE type of layer il: the family's for the target's layers; GGML's normal one for the draft head, whose Q/K rows
// are permuted to it whatever the target (convert/draft_head.py, as llama.cpp's converter does for llama)
static int rope_type_of(const specee_model & model, int il) {
    return il == SPECEE_IL_EAGLE ? GGML_ROPE_TYPE_NORMAL : model.hparams.rope_type;
}

// w x [n_out, n_tokens] for a matrix of the model w [n_in, n_out], plus s alpha / r B (A x) for each active LoRA
// adapter that adapts w (s the user's scale; alpha 0: s alone): the one place adapters apply (specee-lora.h); w x by
// this runtime's kernels where they apply (specee-kernels.h; products of one input given one `shared` quantize it once)
static ggml_tensor * build_mm(ggml_context * ctx0, const specee_graph_mm & mm, ggml_tensor * w, ggml_tensor * cur,
                              specee_mm_shared * shared = nullptr) {
    const specee_lora_set * lora = mm.lora;
    ggml_tensor *           out  = specee_mul_mat(ctx0, w, cur, mm.kernels, shared);
    if (!lora) {
        return out;
    }
    for (const specee_lora_active & act : *lora) {
        const auto it = act.adapter->weights.find(w);
        if (it == act.adapter->weights.end() || act.scale == 0.0f) {
            continue;
        }
        const specee_lora_weight & lw    = it->second;
        const float                rank  = (float) lw.b->ne[0];
        const float                alpha = act.adapter->alpha;
        const float                scale = alpha > 0.0f ? act.scale * alpha / rank : act.scale;
        ggml_tensor * ab = ggml_mul_mat(ctx0, lw.b, ggml_mul_mat(ctx0, lw.a, cur)); // [n_out, n_tokens]
        out              = ggml_add(ctx0, out, ggml_scale(ctx0, ab, scale));
    }
    return out;
}

// a projection of a normed input: w x (+ b) [rows, n_tokens]
static ggml_tensor * build_proj(ggml_context * ctx0, const specee_graph_mm & mm, ggml_tensor * w, ggml_tensor * b,
                                ggml_tensor * cur, specee_mm_shared * shared = nullptr) {
    ggml_tensor * out = build_mm(ctx0, mm, w, cur, shared);
    return b ? ggml_add(ctx0, out, b) : out;
}

// rows [first, first + n_head * head) of a fused projection wx [n_rows, n_tokens], as [head, n_head, n_tokens]
static ggml_tensor * fused_rows(ggml_context * ctx0, ggml_tensor * wx, int64_t head, int64_t n_head, int64_t first) {
    return ggml_view_3d(ctx0, wx, head, n_head, wx->ne[1], ggml_row_size(wx->type, head), wx->nb[1],
                        ggml_row_size(wx->type, first));
}

// the RoPE frequency factors of the target's layers in a context of n_ctx cells: Llama 3's, or LongRoPE's long ones
// when the context is longer than the one the model was trained on and its short ones otherwise, as llama.cpp picks
// them (NULL: none)
static ggml_tensor * rope_factors(const specee_model & model, uint32_t n_ctx) {
    if (model.rope_long) {
        return n_ctx > model.hparams.n_ctx_orig ? model.rope_long : model.rope_short;
    }
    return model.rope_freqs;
}

// a per-head RMS norm (qwen3; named normed_name) of x [head, n_head, n_tokens], and RoPE (with frequency factors
// `factors`, NULL: none)
static ggml_tensor * build_rope(ggml_context * ctx0, const specee_model & model, specee_graph_io & io, ggml_tensor * x,
                                ggml_tensor * norm, ggml_tensor * factors, const char * normed_name, int il) {
    const specee_hparams & hp = model.hparams;
    if (norm) {
        x = build_norm(ctx0, x, norm, hp.f_norm_rms_eps);
        name_il(x, normed_name, il);
    }
    const float attn_factor = il == SPECEE_IL_EAGLE ? 1.0f : hp.rope_attn_factor; // the head: a plain Llama layer's
    const bool  swa         = hp.is_swa(il); // sliding-window layers turn at their own base and scale (gemma)
    const float base        = swa ? hp.rope_freq_base_swa : hp.rope_freq_base;
    const float scale       = swa ? hp.rope_freq_scale_swa : hp.rope_freq_scale;
    x = ggml_rope_ext(ctx0, x, io.inp_pos, factors, hp.n_rot, rope_type_of(model, il), hp.n_ctx_orig, base, scale,
                      hp.rope_ext_factor, attn_factor, 32.0f, 1.0f);
    return x;
}

struct qkv_cur {
    ggml_tensor * q = nullptr; // [head_k, n_head, n_tokens] after RoPE (when asked for)
    ggml_tensor * k = nullptr; // [head_k, n_head_kv, n_tokens] after RoPE (contiguous: RoPE's output)
    ggml_tensor * v = nullptr; // [n_embd_v_gqa, n_tokens]
};

// Q (want_q), K and V of one layer for a normed input [n_embd, n_tokens]: the projections (separate, with their biases,
// or one fused matrix), the per-head norms and RoPE, as the layer's family has them
static qkv_cur build_qkv(ggml_context * ctx0, const specee_model & model, const specee_layer & layer,
                         specee_graph_io & io, ggml_tensor * cur, ggml_tensor * factors, int64_t n_tokens, int il,
                         bool want_q, const specee_graph_mm & mm) {
    const specee_hparams & hp     = model.hparams;
    const int64_t          head_k = hp.n_embd_head_k;
    qkv_cur                out;
    ggml_tensor *          Q = nullptr;
    ggml_tensor *          K;
    ggml_tensor *          V;
    if (layer.wqkv) {
        ggml_tensor * wx = build_mm(ctx0, mm, layer.wqkv, cur); // [n_q + n_k + n_v, n_tokens]
        name_il(wx, "wqkv", il);
        const int64_t n_q = head_k * hp.n_head;
        Q = want_q ? fused_rows(ctx0, wx, head_k, hp.n_head, 0) : nullptr;
        K = fused_rows(ctx0, wx, head_k, hp.n_head_kv, n_q);
        V = ggml_cont(ctx0, ggml_view_2d(ctx0, wx, hp.n_embd_v_gqa(), n_tokens, wx->nb[1],
                                         ggml_row_size(wx->type, n_q + hp.n_embd_k_gqa())));
    } else {
        specee_mm_shared shared; // cur quantized once for Q, K and V
        if (want_q) {
            Q = build_proj(ctx0, mm, layer.wq, layer.bq, cur, &shared); // [head_k * n_head, n_tokens]
            Q = ggml_reshape_3d(ctx0, Q, head_k, hp.n_head, n_tokens);
        }
        K = build_proj(ctx0, mm, layer.wk, layer.bk, cur, &shared); // [n_embd_k_gqa, n_tokens]
        K = ggml_reshape_3d(ctx0, K, head_k, hp.n_head_kv, n_tokens);
        V = build_proj(ctx0, mm, layer.wv, layer.bv, cur, &shared); // [n_embd_v_gqa, n_tokens]
    }
    if (Q) {
        name_il(Q, "Qcur", il);
        out.q = build_rope(ctx0, model, io, Q, layer.q_norm, factors, "Qcur_normed", il);
        name_il(out.q, "Qcur_rope", il);
    }
    name_il(K, "Kcur", il);
    name_il(V, "Vcur", il);
    out.k = build_rope(ctx0, model, io, K, layer.k_norm, factors, "Kcur_normed", il);
    name_il(out.k, "Kcur_rope", il);
    out.v = V;
    return out;
}

// K [head_k, n_head_kv, n_tokens] and V [n_embd_v_gqa, n_tokens] of one layer written into the batch's cache cells
// (caches [n_embd_k_gqa / n_embd_v_gqa, kv_size])
static void build_kv_store(ggml_context * ctx0, ggml_cgraph * gf, const specee_hparams & hp, ggml_tensor * k_cache,
                           ggml_tensor * v_cache, specee_graph_io & io, const qkv_cur & qkv, int64_t n_tokens, int il) {
    ggml_tensor * k_store = ggml_set_rows(ctx0, k_cache, ggml_reshape_2d(ctx0, qkv.k, hp.n_embd_k_gqa(), n_tokens),
                                          io.inp_kv_idxs);
    name_il(k_store, "k_store", il);
    ggml_tensor * v_store = ggml_set_rows(ctx0, v_cache, qkv.v, io.inp_kv_idxs);
    name_il(v_store, "v_store", il);
    ggml_build_forward_expand(gf, k_store);
    ggml_build_forward_expand(gf, v_store);
}

// a cache's cells [0, n_kv) in the order io.inp_kv_order gives, in the cache's type (the values exactly)
static ggml_tensor * build_kv_gather(ggml_context * ctx0, ggml_tensor * cache, const specee_graph_params & gp,
                                     specee_graph_io & io, int il, const char * name) {
    ggml_tensor * cells = ggml_view_2d(ctx0, cache, cache->ne[0], gp.n_kv, cache->nb[1], 0);
    ggml_tensor * cur   = ggml_get_rows(ctx0, cells, io.inp_kv_order); // [row, n_kv] F32
    if (cur->type != cache->type) {
        cur = ggml_cast(ctx0, cur, cache->type);
    }
    name_il(cur, name, il);
    return cur;
}

// self-attention of one layer: writes this batch's K/V into the cache cells, attends over [0, n_kv); RoPE with the
// frequency factors `factors`
static ggml_tensor * build_attn(ggml_context * ctx0, ggml_cgraph * gf, const specee_model & model,
                                const specee_layer & layer, ggml_tensor * k_cache, ggml_tensor * v_cache,
                                const specee_graph_params & gp, specee_graph_io & io, ggml_tensor * cur,
                                ggml_tensor * mask, ggml_tensor * factors, int il) {
    const specee_hparams & hp       = model.hparams;
    const int64_t          n_tokens = gp.n_tokens;
    const int64_t          head_k   = hp.n_embd_head_k;
    const int64_t          head_v   = hp.n_embd_head_v;

    const qkv_cur qkv = build_qkv(ctx0, model, layer, io, cur, factors, n_tokens, il, /*want_q =*/true, gp.mm);
    build_kv_store(ctx0, gf, hp, k_cache, v_cache, io, qkv, n_tokens, il);

    // attend over cells [0, n_kv): views of the cache as [head, n_kv, n_head_kv] (or of its cells gathered in order)
    ggml_tensor * q = ggml_permute(ctx0, qkv.q, 0, 2, 1, 3); // [head_k, n_tokens, n_head]
    if (gp.kv_order) {
        k_cache = build_kv_gather(ctx0, k_cache, gp, io, il, "k_ordered");
        v_cache = build_kv_gather(ctx0, v_cache, gp, io, il, "v_ordered");
    }
    ggml_tensor * k = ggml_view_3d(ctx0, k_cache, head_k, gp.n_kv, hp.n_head_kv, k_cache->nb[1],
                                   ggml_row_size(k_cache->type, head_k), 0);
    ggml_tensor * v = ggml_view_3d(ctx0, v_cache, head_v, gp.n_kv, hp.n_head_kv, v_cache->nb[1],
                                   ggml_row_size(v_cache->type, head_v), 0);
    // the target's layers: the family's query scale and soft-capping (gemma); the head: a plain Llama layer's
    const bool    head    = il == SPECEE_IL_EAGLE;
    const float   scale   = head ? 1.0f / sqrtf((float) head_k) : hp.attn_scale;
    ggml_tensor * kqv     = ggml_flash_attn_ext(ctx0, q, k, v, mask, scale, 0.0f, head ? 0.0f : hp.attn_softcap);
    ggml_flash_attn_ext_set_prec(kqv, GGML_PREC_F32);
    name_il(kqv, "kqv", il);                                          // [head_v, n_head, n_tokens]
    cur = ggml_reshape_2d(ctx0, kqv, head_v * hp.n_head, n_tokens); // [head_v * n_head, n_tokens]

    cur = build_mm(ctx0, gp.mm, layer.wo, cur); // [n_embd, n_tokens]
    name_il(cur, "attn_out", il);
    return cur;
}

// SwiGLU (GeGLU: gelu_tanh, gemma) feed-forward of a normed input [n_embd, n_tokens]; without ffn_gate, ffn_up holds
// the gate rows, then the up rows (phi3)
static ggml_tensor * build_ffn(ggml_context * ctx0, const specee_graph_mm & mm, const specee_layer & layer,
                               ggml_tensor * cur, int il, int act = SPECEE_FFN_SILU) {
    if (layer.ffn_gate) {
        specee_mm_shared shared; // cur quantized once for gate and up
        ggml_tensor *    gate = build_mm(ctx0, mm, layer.ffn_gate, cur, &shared); // [n_ff, n_tokens]
        name_il(gate, "ffn_gate", il);
        ggml_tensor * up = build_mm(ctx0, mm, layer.ffn_up, cur, &shared); // [n_ff, n_tokens]
        name_il(up, "ffn_up", il);
        cur = act == SPECEE_FFN_GELU ? ggml_geglu_split(ctx0, gate, up) : ggml_swiglu_split(ctx0, gate, up);
    } else {
        ggml_tensor * gate_up = build_mm(ctx0, mm, layer.ffn_up, cur); // [2 n_ff, n_tokens]
        name_il(gate_up, "ffn_up", il);
        cur = ggml_swiglu(ctx0, gate_up); // silu(first half) * second half
    }
    name_il(cur, "ffn_swiglu", il);
    cur = build_mm(ctx0, mm, layer.ffn_down, cur); // [n_embd, n_tokens]
    name_il(cur, "ffn_out", il);
    return cur;
}

// a graph input: a new tensor [ne0, ne1] of `type` (ne1 1: [ne0]), named, marked as an input
static ggml_tensor * new_input(ggml_context * ctx0, const char * name, ggml_type type, int64_t ne0, int64_t ne1 = 1) {
    ggml_tensor * t = ggml_new_tensor_2d(ctx0, type, ne0, ne1);
    ggml_set_name(t, name);
    ggml_set_input(t);
    return t;
}

// the inputs of a layer range: token embeddings (layer_begin == 0) or the hidden state of the previous range, and
// the positions, cache cells and masks
static ggml_tensor * build_inputs(ggml_context * ctx0, const specee_model & model, const specee_graph_params & gp,
                                  specee_graph_io & io) {
    const specee_hparams & hp = model.hparams;
    ggml_tensor *          inpL;
    if (gp.layer_begin == 0) {
        io.inp_tokens = new_input(ctx0, "inp_tokens", GGML_TYPE_I32, gp.n_tokens);
        inpL = ggml_get_rows(ctx0, model.tok_embd, io.inp_tokens); // [n_embd, n_tokens]
        ggml_set_name(inpL, "inp_embd");
        if (hp.embd_scale) {
            inpL = ggml_scale(ctx0, inpL, sqrtf((float) hp.n_embd));
            ggml_set_name(inpL, "inp_scaled");
        }
    } else {
        inpL = ggml_view_2d(ctx0, gp.state_in, hp.n_embd, gp.n_tokens, gp.state_in->nb[1], 0); // [n_embd, n_tokens]
        ggml_set_name(inpL, "inp_hidden");
    }
    io.inp_pos     = new_input(ctx0, "inp_pos", GGML_TYPE_I32, gp.n_tokens);
    io.inp_kv_idxs = new_input(ctx0, "inp_kv_idxs", GGML_TYPE_I64, gp.n_tokens);
    if (gp.kv_order) {
        io.inp_kv_order = new_input(ctx0, "inp_kv_order", GGML_TYPE_I32, gp.n_kv);
    }
    io.inp_masks.resize(gp.n_masks);
    for (int i = 0; i < gp.n_masks; ++i) {
        io.inp_masks[i] = ggml_new_tensor_2d(ctx0, GGML_TYPE_F16, gp.n_kv, gp.n_tokens);
        ggml_format_name(io.inp_masks[i], "kq_mask-%d", i);
        ggml_set_input(io.inp_masks[i]);
    }
    return inpL;
}

// a layer's output kept for reading after the graph: a copy of its own (the allocator reuses the plan of a graph of
// the same shape, and l_out's memory is reused by later layers otherwise)
static ggml_tensor * keep_output(ggml_context * ctx0, ggml_tensor * cur, const char * name, int il) {
    ggml_tensor * keep = ggml_cont(ctx0, cur);
    ggml_format_name(keep, "%s-%d", name, il);
    ggml_set_output(keep);
    return keep;
}

// the lm_head's logits [n_vocab, rows] of normed rows, soft-capped where the model's are (gemma)
static ggml_tensor * build_lm_head(ggml_context * ctx0, const specee_model & model, const specee_graph_mm & mm,
                                   ggml_tensor * cur) {
    cur              = build_mm(ctx0, mm, model.output, cur);
    const float  cap = model.hparams.final_softcap;
    if (cap > 0.0f) {
        cur = ggml_scale(ctx0, ggml_tanh(ctx0, ggml_scale(ctx0, cur, 1.0f / cap)), cap);
    }
    return cur;
}

// the final norm, and the lm_head for the output rows
static ggml_tensor * build_output(ggml_context * ctx0, const specee_model & model, const specee_graph_params & gp,
                                  specee_graph_io & io, ggml_tensor * cur) {
    cur = build_norm(ctx0, cur, model.output_norm, model.hparams.f_norm_rms_eps); // [n_embd, n_tokens]
    ggml_set_name(cur, "result_norm");
    ggml_set_output(cur);
    io.result_norm = cur;
    if (gp.n_outputs > 0) {
        if (gp.n_outputs < gp.n_tokens) {
            io.inp_out_ids = new_input(ctx0, "inp_out_ids", GGML_TYPE_I32, gp.n_outputs);
            cur = ggml_get_rows(ctx0, cur, io.inp_out_ids); // [n_embd, n_outputs]
        }
        cur = build_lm_head(ctx0, model, gp.mm, cur); // [n_vocab, n_outputs]
        ggml_set_name(cur, "result_output");
        ggml_set_output(cur);
        io.result_output = cur;
    }
    return cur;
}

ggml_cgraph * specee_build_graph(ggml_context * ctx0, const specee_model & model, const specee_kv_cache & kv,
                                 const specee_graph_params & gp, specee_graph_io & io, int32_t graph_size) {
    const specee_hparams & hp = model.hparams;
    ggml_cgraph *          gf = ggml_new_graph_custom(ctx0, graph_size, false);

    // ---- inputs
    ggml_tensor * inpL = build_inputs(ctx0, model, gp, io);

    // ---- layers
    io.l_out.clear();
    io.features.assign(gp.feature_layers.size(), nullptr);
    for (int il = gp.layer_begin; il < gp.layer_end; ++il) {
        const specee_layer & layer = model.layers[il];
        ggml_tensor *        inpSA = inpL;

        ggml_tensor * cur = build_norm(ctx0, inpL, layer.attn_norm, hp.f_norm_rms_eps);
        name_il(cur, "attn_norm", il);

        ggml_tensor * mask = io.inp_masks[gp.mask_of_layer[il - gp.layer_begin]];
        cur = build_attn(ctx0, gf, model, layer, kv.k[il], kv.v[il], gp, io, cur, mask, rope_factors(model, kv.size),
                         il);

        if (layer.attn_post_norm) {
            cur = build_norm(ctx0, cur, layer.attn_post_norm, hp.f_norm_rms_eps);
            name_il(cur, "attn_post_norm", il);
        }
        ggml_tensor * ffn_inp = ggml_add(ctx0, cur, inpSA);
        name_il(ffn_inp, "ffn_inp", il);

        cur = build_norm(ctx0, ffn_inp, layer.ffn_norm, hp.f_norm_rms_eps);
        name_il(cur, "ffn_norm", il);

        cur = build_ffn(ctx0, gp.mm, layer, cur, il, hp.ffn_act);
        if (layer.ffn_post_norm) {
            cur = build_norm(ctx0, cur, layer.ffn_post_norm, hp.f_norm_rms_eps);
            name_il(cur, "ffn_post_norm", il);
        }

        cur = ggml_add(ctx0, cur, ffn_inp);
        name_il(cur, "l_out", il);
        if (gp.hidden_all) {
            io.l_out.push_back(keep_output(ctx0, cur, "l_out_kept", il));
        }
        ggml_tensor * feature = nullptr; // EAGLE-3: the outputs of its feature layers, for every token
        for (size_t k = 0; k < gp.feature_layers.size(); ++k) {
            if (gp.feature_layers[k] == il) {
                feature        = feature ? feature : keep_output(ctx0, cur, "eagle3_feature", il);
                io.features[k] = feature;
            }
        }
        inpL = cur;
    }

    // the last layer's output stays on its device for the next range
    ggml_tensor * state = ggml_cpy(ctx0, inpL, ggml_view_2d(ctx0, gp.state_out, hp.n_embd, gp.n_tokens,
                                                            gp.state_out->nb[1], 0));
    ggml_set_name(state, "state_out");
    ggml_build_forward_expand(gf, state);

    // ---- final norm and lm_head
    ggml_tensor * cur = gp.final_norm ? build_output(ctx0, model, gp, io, inpL) : inpL;
    ggml_build_forward_expand(gf, cur);
    for (ggml_tensor * t : io.l_out) {
        ggml_build_forward_expand(gf, t);
    }
    for (ggml_tensor * t : io.features) {
        if (t) {
            ggml_build_forward_expand(gf, t);
        }
    }
    return gf;
}

// ---- EAGLE draft heads -------------------------------------------------------------------------------

// the inputs of a head's batch of pairs: tokens, features [n_feat, n_tokens], positions, cache cells, the mask
static void build_eagle_inputs(ggml_context * ctx0, const specee_graph_params & gp, int64_t n_feat,
                               specee_graph_io & io) {
    io.inp_tokens  = new_input(ctx0, "eagle_inp_tokens", GGML_TYPE_I32, gp.n_tokens);
    io.inp_embd    = new_input(ctx0, "eagle_inp_feature", GGML_TYPE_F32, n_feat, gp.n_tokens);
    io.inp_pos     = new_input(ctx0, "eagle_inp_pos", GGML_TYPE_I32, gp.n_tokens);
    io.inp_kv_idxs = new_input(ctx0, "eagle_inp_kv_idxs", GGML_TYPE_I64, gp.n_tokens);
    io.inp_masks.assign(1, new_input(ctx0, "eagle_kq_mask", GGML_TYPE_F16, gp.n_kv, gp.n_tokens));
}

// a head's logits for the output rows: output(norm(rows)) (norm_w NULL: no norm, EAGLE-1)
static ggml_tensor * build_eagle_logits(ggml_context * ctx0, const specee_model & model, const specee_graph_params & gp,
                                        specee_graph_io & io, ggml_tensor * cur, ggml_tensor * norm_w) {
    const specee_eagle & eagle = model.eagle;
    if (gp.n_outputs < gp.n_tokens) {
        io.inp_out_ids = new_input(ctx0, "eagle_inp_out_ids", GGML_TYPE_I32, gp.n_outputs);
        cur = ggml_get_rows(ctx0, cur, io.inp_out_ids); // [n_embd, n_outputs]
    }
    if (norm_w) {
        cur = build_norm(ctx0, cur, norm_w, model.hparams.f_norm_rms_eps);
        name_il(cur, "output_norm", SPECEE_IL_EAGLE);
    }
    cur = specee_mul_mat(ctx0, eagle.output ? eagle.output : model.output, cur, gp.mm.kernels); // [n_draft_vocab, n_outputs]
    name_il(cur, "logits", SPECEE_IL_EAGLE);
    ggml_set_output(cur);
    io.result_output = cur;
    return cur;
}

// the head layer's MLP half: post-attention norm, SwiGLU, residual; the head's output (eagle_out)
static ggml_tensor * build_eagle_mlp(ggml_context * ctx0, const specee_model & model, const specee_graph_mm & mm,
                                     ggml_tensor * attn_out,
                                     ggml_tensor * residual, specee_graph_io & io) {
    const int     il      = SPECEE_IL_EAGLE;
    ggml_tensor * ffn_inp = ggml_add(ctx0, attn_out, residual);
    name_il(ffn_inp, "ffn_inp", il);
    ggml_tensor * cur = build_norm(ctx0, ffn_inp, model.eagle.layer.ffn_norm, model.hparams.f_norm_rms_eps);
    name_il(cur, "ffn_norm", il);
    cur = build_ffn(ctx0, {nullptr, mm.kernels}, model.eagle.layer, cur, il);
    cur = ggml_add(ctx0, cur, ffn_inp); // [n_embd, n_tokens]: the next feature of the draft
    name_il(cur, "out", il);
    ggml_set_output(cur);
    io.l_out.assign(1, cur);
    return cur;
}

ggml_cgraph * specee_build_eagle_graph(ggml_context * ctx0, const specee_model & model, const specee_kv_cache & kv,
                                       const specee_graph_params & gp, specee_graph_io & io, int32_t graph_size) {
    const specee_eagle & eagle = model.eagle;
    const int            il    = SPECEE_IL_EAGLE;
    ggml_cgraph *        gf    = ggml_new_graph_custom(ctx0, graph_size, false);

    // ---- inputs: token t_{i+1} and the target's feature f_i (final-norm output) of each pair
    build_eagle_inputs(ctx0, gp, model.hparams.n_embd, io);
    ggml_tensor * embd = ggml_get_rows(ctx0, eagle.tok_embd ? eagle.tok_embd : model.tok_embd, io.inp_tokens);
    name_il(embd, "inp_embd", il);                                  // [n_embd, n_tokens]
    ggml_tensor * cur = ggml_concat(ctx0, embd, io.inp_embd, 0);    // [2 n_embd, n_tokens]
    name_il(cur, "inp_concat", il);
    cur = ggml_add(ctx0, specee_mul_mat(ctx0, eagle.fc, cur, gp.mm.kernels), eagle.fc_b); // [n_embd, n_tokens]
    name_il(cur, "fc", il);

    // one decoder layer without its input norm
    ggml_tensor * inpSA = cur;
    cur = build_attn(ctx0, gf, model, eagle.layer, kv.k[0], kv.v[0], gp, io, cur, io.inp_masks[0], model.rope_freqs,
                     il);
    cur = build_eagle_mlp(ctx0, model, gp.mm, cur, inpSA, io);

    // logits of the output tokens, no final norm
    if (gp.n_outputs > 0) {
        cur = build_eagle_logits(ctx0, model, gp, io, cur, nullptr);
    }
    ggml_build_forward_expand(gf, io.l_out[0]);
    ggml_build_forward_expand(gf, cur);
    return gf;
}

ggml_cgraph * specee_build_eagle3_graph(ggml_context * ctx0, const specee_model & model, const specee_kv_cache & kv,
                                        const specee_graph_params & gp, specee_graph_io & io, int32_t graph_size) {
    const specee_hparams & hp    = model.hparams;
    const specee_eagle &   eagle = model.eagle;
    const int              il    = SPECEE_IL_EAGLE;
    ggml_cgraph *          gf    = ggml_new_graph_custom(ctx0, graph_size, false);

    // ---- inputs: token t_{i+1} and the feature of each pair: the target's three layers, or the head's own output
    build_eagle_inputs(ctx0, gp, gp.n_feat, io);
    ggml_tensor * embd = ggml_get_rows(ctx0, eagle.tok_embd ? eagle.tok_embd : model.tok_embd, io.inp_tokens);
    name_il(embd, "inp_embd", il); // [n_embd, n_tokens]
    ggml_tensor * hidden = io.inp_embd;
    if (gp.n_feat != (int32_t) hp.n_embd) {
        hidden = specee_mul_mat(ctx0, eagle.fc, hidden, gp.mm.kernels); // [n_embd, n_tokens]
        name_il(hidden, "fc", il);
    }

    // one decoder layer whose attention reads both inputs, each normed; the residual is the un-normed feature
    ggml_tensor * embd_norm = build_norm(ctx0, embd, eagle.layer.attn_norm, hp.f_norm_rms_eps);
    name_il(embd_norm, "attn_norm", il);
    ggml_tensor * hidden_norm = build_norm(ctx0, hidden, eagle.hidden_norm, hp.f_norm_rms_eps);
    name_il(hidden_norm, "hidden_norm", il);
    ggml_tensor * cur = ggml_concat(ctx0, embd_norm, hidden_norm, 0); // [2 n_embd, n_tokens]
    name_il(cur, "inp_concat", il);
    cur = build_attn(ctx0, gf, model, eagle.layer, kv.k[0], kv.v[0], gp, io, cur, io.inp_masks[0], model.rope_freqs,
                     il);
    cur = build_eagle_mlp(ctx0, model, gp.mm, cur, hidden, io);

    // logits of the output tokens: the head's final norm, then its lm_head
    if (gp.n_outputs > 0) {
        cur = build_eagle_logits(ctx0, model, gp, io, cur, eagle.output_norm);
    }
    ggml_build_forward_expand(gf, io.l_out[0]);
    ggml_build_forward_expand(gf, cur);
    return gf;
}

// a layer's output for the rows an exit takes: the first column of `state`, or (n_rows > 0) the columns io.inp_out_ids
// lists [n_embd, max(n_rows, 1)]
static ggml_tensor * exit_rows(ggml_context * ctx0, const specee_hparams & hp, ggml_tensor * state,
                               specee_graph_io & io, int32_t n_rows) {
    if (n_rows <= 0) {
        ggml_tensor * h = ggml_view_2d(ctx0, state, hp.n_embd, 1, state->nb[1], 0);
        ggml_set_name(h, "inp_hidden");
        return h;
    }
    io.inp_out_ids = new_input(ctx0, "inp_out_ids", GGML_TYPE_I32, n_rows);
    ggml_tensor * h = ggml_get_rows(ctx0, state, io.inp_out_ids);
    ggml_set_name(h, "inp_hidden");
    return h;
}

ggml_cgraph * specee_build_exit_graph(ggml_context * ctx0, const specee_model & model, ggml_tensor * state,
                                      specee_graph_io & io, int32_t graph_size, int32_t n_rows,
                                      const specee_graph_mm & mm) {
    const specee_hparams & hp = model.hparams;
    ggml_cgraph *          gf = ggml_new_graph_custom(ctx0, graph_size, false);

    ggml_tensor * h = exit_rows(ctx0, hp, state, io, n_rows); // a layer's output [n_embd, rows]

    ggml_tensor * cur = build_norm(ctx0, h, model.output_norm, hp.f_norm_rms_eps); // [n_embd, rows]
    ggml_set_name(cur, "result_norm");
    ggml_set_output(cur);
    io.result_norm = cur;
    cur            = build_lm_head(ctx0, model, mm, cur); // [n_vocab, rows]
    ggml_set_name(cur, "result_output");
    ggml_set_output(cur);
    io.result_output = cur;
    ggml_build_forward_expand(gf, cur);
    return gf;
}

ggml_cgraph * specee_build_k_shift_graph(ggml_context * ctx0, const specee_model & model, const specee_kv_cache & kv,
                                         specee_graph_io & io, int32_t graph_size) {
    const specee_hparams & hp = model.hparams;
    ggml_cgraph *          gf = ggml_new_graph_custom(ctx0, graph_size, false);
    io.inp_pos                = new_input(ctx0, "inp_pos_shift", GGML_TYPE_I32, kv.size);
    for (int il = 0; il < (int) hp.n_layer; ++il) {
        ggml_tensor * k    = kv.k[il]; // [n_embd_k_gqa, size] as [head_k, n_head_kv, size]
        ggml_tensor * view = ggml_view_3d(ctx0, k, hp.n_embd_head_k, hp.n_head_kv, kv.size,
                                          ggml_row_size(k->type, hp.n_embd_head_k), k->nb[1], 0);
        const bool    swa  = hp.is_swa(il);
        // attn_factor 1: the magnitude was set when K was first turned; a turn by the difference only rotates
        ggml_tensor * cur = ggml_rope_ext_inplace(ctx0, view, io.inp_pos, rope_factors(model, kv.size), hp.n_rot,
                                                  rope_type_of(model, il), hp.n_ctx_orig,
                                                  swa ? hp.rope_freq_base_swa : hp.rope_freq_base,
                                                  swa ? hp.rope_freq_scale_swa : hp.rope_freq_scale,
                                                  hp.rope_ext_factor, 1.0f, 32.0f, 1.0f);
        name_il(cur, "k_shifted", il);
        ggml_build_forward_expand(gf, cur);
    }
    return gf;
}

ggml_cgraph * specee_build_kv_fill_graph(ggml_context * ctx0, const specee_model & model, const specee_kv_cache & kv,
                                         ggml_tensor * state, int32_t layer_begin, int32_t layer_end,
                                         specee_graph_io & io, int32_t graph_size, int32_t n_rows,
                                         const specee_graph_mm & mm) {
    const specee_hparams & hp = model.hparams;
    ggml_cgraph *          gf = ggml_new_graph_custom(ctx0, graph_size, false);
    const int64_t          n  = std::max(n_rows, 1);

    ggml_tensor * h = exit_rows(ctx0, hp, state, io, n_rows); // the exit layer's output [n_embd, n]
    io.inp_pos      = new_input(ctx0, "inp_pos", GGML_TYPE_I32, n);
    io.inp_kv_idxs  = new_input(ctx0, "inp_kv_idxs", GGML_TYPE_I64, n);

    for (int il = layer_begin; il < layer_end; ++il) {
        const specee_layer & layer = model.layers[il];
        ggml_tensor *        cur   = build_norm(ctx0, h, layer.attn_norm, hp.f_norm_rms_eps);
        name_il(cur, "attn_norm", il);
        const qkv_cur qkv = build_qkv(ctx0, model, layer, io, cur, rope_factors(model, kv.size), n, il,
                                      /*want_q =*/false, mm);
        build_kv_store(ctx0, gf, hp, kv.k[il], kv.v[il], io, qkv, n, il);
    }
    return gf;
}
