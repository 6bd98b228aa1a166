// specee-kv-cache.h: the KV cache: cells with positions, tokens and per-layer validity; attention masks
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
    std::vector<int32_t> tok;   // [size] token held by each cell (prefix reuse), -1 when free
    std::vector<uint8_t> valid; // [size * n_layer] cell c holds real K/V in layer il: valid[c * n_layer + il]
    uint32_t             used = 0;

    std::vector<ggml_tensor *> k; // per layer [n_embd_k_gqa, size] F16
    std::vector<ggml_tensor *> v; // per layer [n_embd_v_gqa, size] F16 or F32 (not transposed: flash attention)

    std::vector<ggml_context *>        ctxs; // one per buffer type in use
    std::vector<ggml_backend_buffer_t> bufs;

    ~specee_kv_cache();

    // layer il's K/V in buffer type buft[il] (the layer's device)
    void init(const specee_hparams & hp, uint32_t n_ctx, const std::vector<ggml_backend_buffer_type_t> & buft,
              ggml_type type_v);
    size_t nbytes() const;

    // lowest free cells for n tokens; throws "context overflow" when there are too few
    std::vector<int32_t> find_slots(uint32_t n) const;
    // cells [0, n_kv) cover every used cell
    uint32_t n_kv() const;
    int32_t  pos_max() const;
    // the cell holding position p, -1 when none
    int32_t  cell_of(int32_t p) const;

    bool is_valid(int32_t cell, int32_t il) const { return valid[(size_t) cell * n_layer + il] != 0; }
    bool is_valid_all(int32_t cell) const;
    void set_valid(int32_t cell, int32_t il) { valid[(size_t) cell * n_layer + il] = 1; }
    void occupy(int32_t cell, int32_t p, int32_t token);
    void free_cell(int32_t cell);
    // free every cell whose position is in [p0, p1) (p1 < 0: to the end); returns how many
    int32_t remove(int32_t p0, int32_t p1);
    void clear();
    // move a used cell's K/V (every layer), position, token and validity into the free cell dst
    void move_cell(int32_t src, int32_t dst);
};

// An attention mask [n_tokens][n_kv] (F16: 0 or -inf) for a batch whose tokens sit in cells[i] at positions
// pos[i]: token i sees batch token j when tree_mask[i * n_tokens + j] (NULL: when pos[j] <= pos[i]), and any
// other cell c when cached[c] and kv.pos[c] <= pos[i].
void specee_build_mask(const specee_kv_cache & kv, const std::vector<int32_t> & cells, const std::vector<int32_t> & pos,
                       const uint8_t * tree_mask, const std::vector<uint8_t> & cached, int32_t n_kv,
                       std::vector<ggml_fp16_t> & mask);
