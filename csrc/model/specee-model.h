// specee-model.h: a loaded model (a llama or another family of specee-arch.cpp's table): its hyperparameters, weights, draft head, exit predictors, vocabulary and
// where each weight lives. Loading it is specee-loader.cpp's; the draft head and predictors are read by
// specee-head-weights.cpp, placed and repacked by specee-placement.cpp.
#pragma once

#include "specee-gguf.h"
#include "specee-hparams.h"
#include "specee.h"

#include "ggml-backend.h"
#include "ggml.h"

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

// A layer's weights; which of them a layer has is its family's (specee-arch.cpp), NULL the others.
struct specee_layer {
    ggml_tensor * attn_norm = nullptr; // [n_embd]
    ggml_tensor * wq        = nullptr; // [n_embd, n_embd_head_k * n_head]
    ggml_tensor * wk        = nullptr; // [n_embd, n_embd_k_gqa]
    ggml_tensor * wv        = nullptr; // [n_embd, n_embd_v_gqa]
    ggml_tensor * wqkv      = nullptr; // [n_embd, n_embd_head_k * n_head + n_embd_k_gqa + n_embd_v_gqa] (phi3)
    ggml_tensor * bq        = nullptr; // [n_embd_head_k * n_head] (qwen2)
    ggml_tensor * bk        = nullptr; // [n_embd_k_gqa]
    ggml_tensor * bv        = nullptr; // [n_embd_v_gqa]
    ggml_tensor * q_norm    = nullptr; // [n_embd_head_k] (qwen3)
    ggml_tensor * k_norm    = nullptr; // [n_embd_head_k]
    ggml_tensor * wo        = nullptr; // [n_embd_head_v * n_head, n_embd]
    ggml_tensor * ffn_norm  = nullptr; // [n_embd]
    ggml_tensor * ffn_gate  = nullptr; // [n_embd, n_ff] (NULL: ffn_up holds the gate rows too)
    ggml_tensor * ffn_up    = nullptr; // [n_embd, n_ff] or [n_embd, 2 n_ff]: gate rows, then up rows (phi3)
    ggml_tensor * ffn_down  = nullptr; // [n_ff, n_embd]
    ggml_tensor * attn_post_norm = nullptr; // [n_embd] (gemma: the attention's output normed before the residual)
    ggml_tensor * ffn_post_norm  = nullptr; // [n_embd] (the FFN's)
};

// the slots of the weights a layer has (those not NULL), and of those the matrices (only matrix products read them)
inline std::vector<ggml_tensor **> specee_layer_weights(specee_layer & l, bool matrices_only = false) {
    std::vector<ggml_tensor **> all = {&l.attn_norm, &l.wq, &l.wk, &l.wv, &l.wqkv, &l.bq, &l.bk, &l.bv, &l.q_norm,
                                       &l.k_norm, &l.wo, &l.ffn_norm, &l.ffn_gate, &l.ffn_up, &l.ffn_down,
                                       &l.attn_post_norm, &l.ffn_post_norm};
    std::vector<ggml_tensor **> out;
    for (ggml_tensor ** t : all) {
        if (*t && (!matrices_only || ggml_n_dims(*t) == 2)) {
            out.push_back(t);
        }
    }
    return out;
}

// EAGLE draft head.
// EAGLE-1 (version 1): x = fc(concat(embed(t), f)) + fc_b, then one decoder layer without its input norm
// (layer.attn_norm is unused), no final norm; logits through the base lm_head or, with a reduced draft
// vocabulary, through `output` whose rows are the target tokens draft_vocab[i]. f: the target's final-norm output.
// EAGLE-3 (version 3): the feature is the target's hidden states after the three feature_layers [3 n_embd], fused
// by fc (no bias), or the head's own output [n_embd] (draft steps, no fc); the decoder layer's attention reads
// concat(attn_norm(embed(t)), hidden_norm(x)) [2 n_embd], the residual is x; then output(output_norm(.)).
struct specee_eagle {
    uint32_t      version  = 0; // 0: the model has no head; 1: EAGLE-1; 3: EAGLE-3
    uint32_t      n_ff     = 0;
    ggml_tensor * tok_embd = nullptr; // [n_embd, n_vocab] or NULL: the base model's token_embd
    ggml_tensor * fc       = nullptr; // EAGLE-1 [2 n_embd, n_embd] (embedding first, then feature); EAGLE-3
                                      // [3 n_embd, n_embd] (the feature layers low to high)
    ggml_tensor * fc_b     = nullptr; // [n_embd] (EAGLE-1)
    specee_layer  layer;              // wq, wk, wv, wo, ffn_norm, ffn_gate/up/down (n_ff); EAGLE-3: attn_norm (the
                                      // embedding's norm), wq/wk/wv [2 n_embd, ...]
    ggml_tensor * hidden_norm = nullptr; // [n_embd] (EAGLE-3)
    ggml_tensor * output_norm = nullptr; // [n_embd] (EAGLE-3)
    ggml_tensor * output   = nullptr; // [n_embd, n_draft_vocab] or NULL (EAGLE-1 only): the base model's output
    std::vector<int32_t> draft_vocab; // target id of each row of output
    float         acceptance = -1.0f; // held-out acceptance of the first drafted token (specee.eagle.acceptance), -1: unknown
    std::vector<int32_t> feature_layers; // EAGLE-3: the 3 target layers whose outputs form the feature, low to high
    std::string   source;             // the file it was read from
};

// the width of the feature a committed pair takes: n_embd (EAGLE-1: the final-norm output), 3 n_embd (EAGLE-3)
inline int32_t specee_eagle_n_feat(const specee_eagle & e, uint32_t n_embd) {
    return (int32_t) (e.version == 3 ? 3 * n_embd : n_embd);
}

// SpecEE exit predictor of one layer: p = sigmoid(down . relu(up . features + up_b) + down_b)
struct specee_predictor {
    ggml_tensor * up     = nullptr; // [3 * n_cand, n_hidden] (features: logits, softmax, softmax - previous)
    ggml_tensor * up_b   = nullptr; // [n_hidden]
    ggml_tensor * down   = nullptr; // [n_hidden, 1]
    ggml_tensor * down_b = nullptr; // [1]
};

struct specee_exit_cfg {
    std::vector<specee_predictor> pred;   // [n_layer]; up == NULL where a layer has none
    int32_t              n_pred    = 0;   // layers with a predictor
    uint32_t             n_cand    = 4;   // EAGLE candidates per token (specee.exit.n_candidates)
    float                threshold = 0.5f; // a predictor fires above this (specee.exit.threshold)
    std::vector<int32_t> layers;          // the static set of checked layers (specee.exit.layers)
    float                speedup   = -1.0f; // simulated speedup over plain (specee.exit.speedup), -1: unknown
};

// A LoRA adapter loaded for a model (specee-lora.h): for each matrix W it adapts (the model's own tensor), the pair
// a [n_in, r], b [r, n_out] in buffers beside W
struct specee_lora_weight {
    ggml_tensor * a = nullptr;
    ggml_tensor * b = nullptr;
};

struct specee_lora {
    const specee_model *                                model = nullptr;
    std::string                                         path;
    float                                               alpha = 0.0f; // 0: the scale alone (llama.cpp's rule)
    std::map<const ggml_tensor *, specee_lora_weight>   weights;
    std::vector<ggml_context *>                         ctxs;
    std::vector<ggml_backend_buffer_t>                  bufs;

    ~specee_lora();
};

struct specee_vocab;

struct specee_model {
    std::string    path;
    specee_hparams hparams;

    ggml_tensor * tok_embd    = nullptr; // [n_embd, n_vocab]
    ggml_tensor * output_norm = nullptr; // [n_embd]
    ggml_tensor * output      = nullptr; // [n_embd, n_vocab] (tok_embd when tied)
    ggml_tensor * rope_freqs  = nullptr; // [n_rot/2] optional per-frequency factors (Llama 3)
    ggml_tensor * rope_long   = nullptr; // [n_rot/2] optional (phi3 LongRoPE): the factors of a context longer than
    ggml_tensor * rope_short  = nullptr; // [n_rot/2]   n_ctx_orig, and of one within it (both or neither)
    ggml_tensor * cls         = nullptr; // [n_embd, n_embd] optional: a reranker's classifier (rank pooling), read
    ggml_tensor * cls_b       = nullptr; // [n_embd]           from the file mapping on the host
    ggml_tensor * cls_out     = nullptr; // [n_embd, n_cls_out] optional
    ggml_tensor * cls_out_b   = nullptr; // [n_cls_out]
    std::vector<specee_layer> layers;
    specee_eagle              eagle; // draft head, from the model file or specee_model_load_eagle
    specee_exit_cfg           exit;  // exit predictors and settings (specee-early-exit.cpp)

    specee_vocab * vocab = nullptr; // tokenizer, from tokenizer.ggml.* (specee-vocab.cpp)

    // placement: the devices other than the CPU that hold weights, in order; each layer's device (an index into
    // devices, -1: the CPU) and the output's (output_norm, output, the draft head; -1: the CPU)
    std::vector<ggml_backend_dev_t> devices;
    std::vector<int32_t>            layer_device;
    int32_t                         output_device = -1;
    std::vector<ggml_context *>        ctx_dev; // the offloaded weights
    std::vector<ggml_backend_buffer_t> buf_dev;
    std::string                        placement; // one line per device (specee_model_placement)

    // GGUF metadata as printable strings
    std::vector<std::pair<std::string, std::string>> meta;
    std::string desc;
    uint64_t    n_params = 0;
    uint64_t    n_bytes  = 0;

    specee_gguf_file file; // the model's GGUF: metadata, and the tensors' data in its mapping
    std::vector<ggml_context *>        ctx_repack; // weights copied into the CPU's repacking buffer types
    std::vector<ggml_backend_buffer_t> buf_repack;
    // the layers on the CPU have their matrices in a layout whose products batch tokens cheaply (ggml's repacked
    // layouts, e.g. Q4_0; Q4_K kept for this runtime's kernels): a pass of 4 costs about what 2 do (the default EAGLE
    // tree, specee-generate.cpp)
    bool cpu_layers_batched = false;
    std::unique_ptr<specee_gguf_file> eagle_file; // a draft head file loaded next to the model
    std::unique_ptr<specee_model>     draft;      // a draft model loaded beside it (specee_model_params.draft_model)

    ~specee_model(); // specee-loader.cpp: frees what loading acquired
};

// the device index (into model.devices) of layer il, -1 for the CPU; il = n_layer: the output's
int32_t specee_model_device_of_layer(const specee_model & model, int32_t il);
