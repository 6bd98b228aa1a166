// specee-hparams.h: a model's hyperparameters (read from its GGUF by specee-loader.cpp) and the bounds a file's
// values must lie in
#pragma once

#include <cstdint>
#include <vector>

struct specee_hparams {
    uint32_t n_vocab       = 0;
    uint32_t n_ctx_train   = 0;
    uint32_t n_embd        = 0;
    uint32_t n_layer       = 0;
    uint32_t n_ff          = 0;
    uint32_t n_head        = 0;
    uint32_t n_head_kv     = 0;
    uint32_t n_embd_head_k = 0;
    uint32_t n_embd_head_v = 0;
    uint32_t n_rot         = 0;
    float    f_norm_rms_eps = 1e-5f;

    // RoPE
    int      rope_type       = 0; // the family's: GGML_ROPE_TYPE_NORMAL (llama) or NEOX (specee-arch.cpp)
    float    rope_freq_base  = 10000.0f;
    float    rope_freq_scale = 1.0f;
    float    rope_ext_factor = 0.0f; // YaRN only
    float    rope_attn_factor = 1.0f; // scales RoPE's cos and sin (phi3 LongRoPE)
    uint32_t n_ctx_orig      = 0;
    // sliding-window layers (gemma) turn with their own base and scale
    float    rope_freq_base_swa  = 10000.0f;
    float    rope_freq_scale_swa = 1.0f;

    // the family's layer (specee-arch.cpp)
    int      ffn_act    = 0;     // specee_ffn_act
    bool     embd_scale = false; // token embeddings times sqrt(n_embd)
    float    attn_scale = 0.0f;  // of Q.K (set at load: 1/sqrt(head size) unless the file or family says otherwise)
    float    attn_softcap  = 0.0f; // attention logits soft-capped: cap * tanh(x / cap) (0: not)
    float    final_softcap = 0.0f; // the same on the output logits
    uint32_t n_swa = 0;            // the sliding window: a token sees the last n_swa positions (itself included)
    std::vector<uint8_t> swa_layers; // [n_layer] layer il slides (empty: none does)

    // embeddings (specee.h's pooling table)
    int32_t  pooling_type = -1;    // the file's {arch}.pooling_type (enum specee_pooling), -1: not given
    uint32_t n_cls_out    = 1;     // rank pooling's scores per text: cls.output's rows (1 without it)
    bool     rank_softmax = false; // rank pooling's scores go through a softmax (llama.cpp's Qwen3 rerankers)

    bool is_swa(int il) const { return n_swa > 0 && il >= 0 && il < (int) swa_layers.size() && swa_layers[il]; }

    uint32_t n_embd_k_gqa() const { return n_embd_head_k * n_head_kv; }
    uint32_t n_embd_v_gqa() const { return n_embd_head_v * n_head_kv; }
};

// Bounds on what a file may declare: far beyond any Llama, they reject corrupt values before anything is sized by
// them and keep the sizes computed from them (head size x heads, ...) inside 32 bits
static constexpr int64_t SPECEE_MAX_LAYERS   = 4096;
static constexpr int64_t SPECEE_MAX_EMBD     = 1 << 20;
static constexpr int64_t SPECEE_MAX_FF       = 1 << 22;
static constexpr int64_t SPECEE_MAX_HEADS    = 4096;
static constexpr int64_t SPECEE_MAX_HEAD_DIM = 1 << 16;
