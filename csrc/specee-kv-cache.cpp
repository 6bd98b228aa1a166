// specee-kv-cache.cpp: cell bookkeeping and the K/V tensors of every layer
#include "specee-kv-cache.h"

#include "specee-impl.h"
#include "specee-model.h"

#include <algorithm>

specee_kv_cache::~specee_kv_cache() {
    if (buf) {
        ggml_backend_buffer_free(buf);
    }
    if (ctx) {
        ggml_free(ctx);
    }
}

void specee_kv_cache::init(const specee_hparams & hp, uint32_t n_ctx, ggml_backend_buffer_type_t buft,
                           ggml_type type_v) {
    size    = n_ctx;
    n_layer = hp.n_layer;
    pos.assign(size, -1);
    valid.assign((size_t) size * n_layer, 0);
    used = 0;

    ggml_init_params ip = {/*mem_size =*/2 * n_layer * ggml_tensor_overhead(), /*mem_buffer =*/nullptr,
                           /*no_alloc =*/true};
    ctx = ggml_init(ip);
    k.resize(n_layer);
    v.resize(n_layer);
    for (uint32_t il = 0; il < n_layer; ++il) {
        k[il] = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, hp.n_embd_k_gqa(), size);
        v[il] = ggml_new_tensor_2d(ctx, type_v, hp.n_embd_v_gqa(), size);
        ggml_format_name(k[il], "cache_k_l%u", il);
        ggml_format_name(v[il], "cache_v_l%u", il);
    }
    buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
    if (!buf) {
        specee_fail("cannot allocate the KV cache (%u cells)", size);
    }
    // zeros, so masked cells never feed NaN into attention
    ggml_backend_buffer_clear(buf, 0);
}

std::vector<int32_t> specee_kv_cache::find_slots(uint32_t n) const {
    if (n > size - used) {
        specee_fail("context overflow: the batch needs %u KV cells but only %u of n_ctx=%u are free (%u in use); "
                    "clear or trim the cache, or use a larger context",
                    n, size - used, size, used);
    }
    std::vector<int32_t> cells;
    cells.reserve(n);
    for (uint32_t c = 0; c < size && cells.size() < n; ++c) {
        if (pos[c] < 0) {
            cells.push_back((int32_t) c);
        }
    }
    return cells;
}

uint32_t specee_kv_cache::n_kv() const {
    for (uint32_t c = size; c > 0; --c) {
        if (pos[c - 1] >= 0) {
            return c;
        }
    }
    return 0;
}

int32_t specee_kv_cache::pos_max() const {
    int32_t p = -1;
    for (uint32_t c = 0; c < size; ++c) {
        p = std::max(p, pos[c]);
    }
    return p;
}

void specee_kv_cache::occupy(int32_t cell, int32_t p) {
    if (pos[cell] < 0) {
        used++;
    }
    pos[cell] = p;
    std::fill(valid.begin() + (size_t) cell * n_layer, valid.begin() + (size_t) (cell + 1) * n_layer, 0);
}

void specee_kv_cache::free_cell(int32_t cell) {
    if (pos[cell] >= 0) {
        used--;
    }
    pos[cell] = -1;
    std::fill(valid.begin() + (size_t) cell * n_layer, valid.begin() + (size_t) (cell + 1) * n_layer, 0);
}

void specee_kv_cache::clear() {
    std::fill(pos.begin(), pos.end(), -1);
    std::fill(valid.begin(), valid.end(), 0);
    used = 0;
}

void specee_kv_cache::move_cell(int32_t src, int32_t dst) {
    if (src == dst) {
        return;
    }
    if (pos[src] < 0 || pos[dst] >= 0) {
        specee_fail("cannot move KV cell %d to %d: the source must be used and the destination free", src, dst);
    }
    std::vector<uint8_t> row;
    for (uint32_t il = 0; il < n_layer; ++il) {
        for (ggml_tensor * t : {k[il], v[il]}) {
            const size_t nb = t->nb[1];
            row.resize(nb);
            ggml_backend_tensor_get(t, row.data(), (size_t) src * nb, nb);
            ggml_backend_tensor_set(t, row.data(), (size_t) dst * nb, nb);
        }
    }
    occupy(dst, pos[src]);
    std::copy(valid.begin() + (size_t) src * n_layer, valid.begin() + (size_t) (src + 1) * n_layer,
              valid.begin() + (size_t) dst * n_layer);
    free_cell(src);
}
