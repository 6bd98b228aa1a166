// specee-graph.h: ggml graph builders for the target model's layers and the EAGLE draft head
#pragma once

#include "ggml.h"

#include <cstdint>
#include <vector>

struct specee_model;
struct specee_kv_cache;
struct specee_lora;

// a LoRA adapter active on a context with the user's scale
struct specee_lora_active {
    const specee_lora * adapter = nullptr;
    float               scale   = 1.0f;
};

// the LoRA adapters a graph applies (specee-lora.h): every projection of the model's layers and its lm_head
using specee_lora_set = std::vector<specee_lora_active>;

// how a graph multiplies by the model's weights (build_mm): the active LoRA adapters (NULL or empty: none; the draft
// head's graphs never have any) and the matmul kernels (enum specee_kernels_mode, specee-kernels.h)
struct specee_graph_mm {
    const specee_lora_set * lora    = nullptr;
    int32_t                 kernels = 0;
};

struct specee_graph_params {
    int32_t n_tokens    = 0;
    int32_t n_kv        = 0; // cache cells attended to: [0, n_kv)
    int32_t n_outputs   = 0; // tokens that get logits (0: none)
    int32_t layer_begin = 0;
    int32_t layer_end   = 0;
    bool    hidden_all  = false; // keep every layer's output
    bool    final_norm  = false; // layer_end == n_layer: run the final norm (and the lm_head when n_outputs > 0)
    // EAGLE-3: keep the outputs of these layers (those in [layer_begin, layer_end)) as io.features
    std::vector<int32_t> feature_layers;
    // the draft head: the width of its input features, n_embd or (EAGLE-3's target features) 3 n_embd
    int32_t n_feat = 0;

    // attention reads the cells [0, n_kv) in the order io.inp_kv_order gives (a gathered copy of K and V) instead of
    // in place: several sequences' cells interleave, and attention must sum a sequence's cells in position order to
    // give what that sequence gives alone
    bool kv_order = false;

    // attention masks: layer il uses mask mask_of_layer[il - layer_begin] of n_masks
    int32_t              n_masks = 1;
    std::vector<int32_t> mask_of_layer;

    // the hidden state between layer ranges ([n_embd, n_batch] F32, allocated by the context): layer_begin > 0
    // reads the first n_tokens columns of state_in; the last layer's output is copied into state_out
    ggml_tensor * state_in  = nullptr;
    ggml_tensor * state_out = nullptr;

    // the adapters and kernels of the weights' products
    specee_graph_mm mm;
};

struct specee_graph_io {
    // inputs, set after allocation
    ggml_tensor *              inp_tokens  = nullptr; // I32 [n_tokens]            (layer_begin == 0)
    ggml_tensor *              inp_embd    = nullptr; // F32 [n_embd, n_tokens]    (the draft head's features)
    ggml_tensor *              inp_pos     = nullptr; // I32 [n_tokens]
    ggml_tensor *              inp_kv_idxs = nullptr; // I64 [n_tokens] cache cell of each token
    ggml_tensor *              inp_out_ids = nullptr; // I32 [n_outputs]
    ggml_tensor *              inp_kv_order = nullptr; // I32 [n_kv] the cells in the order attention reads them
    std::vector<ggml_tensor *> inp_masks;             // F16 [n_kv, n_tokens] each

    // outputs
    std::vector<ggml_tensor *> l_out;         // [n_embd, n_tokens] after each evaluated layer (hidden_all)
    std::vector<ggml_tensor *> features;      // [n_embd, n_tokens] after gp.feature_layers[k] (NULL: not in range)
    ggml_tensor *              result_norm   = nullptr; // [n_embd, n_tokens]
    ggml_tensor *              result_output = nullptr; // [n_vocab, n_outputs]
};

// layer index that names a graph's intermediates "eagle_<name>" (the draft head's layer)
#define SPECEE_IL_EAGLE (-2)

ggml_cgraph * specee_build_graph(ggml_context * ctx0, const specee_model & model, const specee_kv_cache & kv,
                                 const specee_graph_params & gp, specee_graph_io & io, int32_t graph_size);

// The EAGLE-1 draft head over a batch of (token, feature) pairs: io.inp_tokens, io.inp_embd (the features
// [n_embd, n_tokens]), io.inp_pos, io.inp_kv_idxs, io.inp_masks[0] over the head's one-layer cache `kv`;
// io.l_out[0] is the head's output feature (eagle_out), io.result_output its logits for the n_outputs
// tokens of io.inp_out_ids (over the draft vocabulary when the head has its own).
ggml_cgraph * specee_build_eagle_graph(ggml_context * ctx0, const specee_model & model, const specee_kv_cache & kv,
                                       const specee_graph_params & gp, specee_graph_io & io, int32_t graph_size);

// The EAGLE-3 draft head over a batch of pairs, as the EAGLE-1 one; io.inp_embd is [gp.n_feat, n_tokens]: the
// target's features (gp.n_feat = 3 n_embd, fused by fc) or the head's own outputs (n_embd, no fc). io.l_out[0] is
// the head's output before its final norm (eagle_out), fed to the next draft step; io.result_output the logits
// output(output_norm(eagle_out)) over the draft vocabulary for the rows io.inp_out_ids.
ggml_cgraph * specee_build_eagle3_graph(ggml_context * ctx0, const specee_model & model, const specee_kv_cache & kv,
                                        const specee_graph_params & gp, specee_graph_io & io, int32_t graph_size);

// SpecEE's exit at a layer: the final norm and the lm_head on a layer's output: one token's (n_rows = 0: the first
// column of `state`) or (n_rows > 0, tree exit) the n_rows columns io.inp_out_ids lists; io.result_norm [n_embd,
// rows], io.result_output [n_vocab, rows]
ggml_cgraph * specee_build_exit_graph(ggml_context * ctx0, const specee_model & model, ggml_tensor * state,
                                      specee_graph_io & io, int32_t graph_size, int32_t n_rows,
                                      const specee_graph_mm & mm);

// Context shift: every cached K of every layer turned by RoPE by its cell's position difference io.inp_pos [kv.size]
// (0: unchanged), in place, as the layers' RoPE turned it (llama.cpp's K-shift); V does not depend on positions
ggml_cgraph * specee_build_k_shift_graph(ggml_context * ctx0, const specee_model & model, const specee_kv_cache & kv,
                                         specee_graph_io & io, int32_t graph_size);

// SpecEE's other KV policy after an exit: the K/V of layers [layer_begin, layer_end) computed from the exit layer's
// output (one token's: the first column of `state`, n_rows = 0; or the n_rows columns io.inp_out_ids lists) at the
// positions io.inp_pos into the cells io.inp_kv_idxs (each layer's attn_norm, K/V projections, RoPE); nothing else
// of those layers runs
ggml_cgraph * specee_build_kv_fill_graph(ggml_context * ctx0, const specee_model & model, const specee_kv_cache & kv,
                                         ggml_tensor * state, int32_t layer_begin, int32_t layer_end,
                                         specee_graph_io & io, int32_t graph_size, int32_t n_rows,
                                         const specee_graph_mm & mm);
