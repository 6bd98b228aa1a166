// specee-kv-cache.h: the KV cache: cells with positions and per-layer validity
#pragma once

#include "ggml-backend.h"
#include "ggml.h"

#include <cstdint>
#include <vector>

struct specee_hparams;

struct specee_kv_cache {
    uint32_t size    = 0;
    uint32_t n_layer = 0;

    std::vector<int32_t> pos;   // [size] position held by each cell, -1 when free
    std::vector<uint8_t> valid; // [size * n_layer] cell c holds real K/V in layer il: valid[c * n_layer + il]
    uint32_t             used = 0;

    std::vector<ggml_tensor *> k; // per layer [n_embd_k_gqa, size] F16
    std::vector<ggml_tensor *> v; // per layer [n_embd_v_gqa, size] F16 or F32 (not transposed: flash attention)

    ggml_context *        ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr;

    ~specee_kv_cache();

    void init(const specee_hparams & hp, uint32_t n_ctx, ggml_backend_buffer_type_t buft,
              ggml_type type_v = GGML_TYPE_F16);

    // lowest free cells for n tokens; throws "context overflow" when there are too few
    std::vector<int32_t> find_slots(uint32_t n) const;
    // cells [0, n_kv) cover every used cell
    uint32_t n_kv() const;
    int32_t  pos_max() const;

    bool is_valid(int32_t cell, int32_t il) const { return valid[(size_t) cell * n_layer + il] != 0; }
    void set_valid(int32_t cell, int32_t il) { valid[(size_t) cell * n_layer + il] = 1; }
    void occupy(int32_t cell, int32_t p);
    void free_cell(int32_t cell);
    void clear();
    // move a used cell's K/V (every layer), position and validity into the free cell dst
    void move_cell(int32_t src, int32_t dst);
};
