// specee-kv-cache.cpp: cell bookkeeping, the K/V tensors of every layer, attention masks
#include "specee-kv-cache.h"

#include "specee-hparams.h"
#include "specee-impl.h"

#include <algorithm>
#include <cmath>

specee_kv_cache::~specee_kv_cache() {
    for (ggml_backend_buffer_t b : bufs) {
        ggml_backend_buffer_free(b);
    }
    for (ggml_context * c : ctxs) {
        ggml_free(c);
    }
}

void specee_kv_cache::init(const specee_hparams & hp, uint32_t n_ctx,
                           const std::vector<ggml_backend_buffer_type_t> & buft, ggml_type type_v) {
    size    = n_ctx;
    n_layer = hp.n_layer;
    pos.assign(size, -1);
    tok.assign(size, -1);
    seq.assign(size, 0);
    valid.assign((size_t) size * n_layer, 0);
    used    = 0;
    seq_cur = 0;

    std::vector<ggml_backend_buffer_type_t> types;
    for (uint32_t il = 0; il < n_layer; ++il) {
        if (std::find(types.begin(), types.end(), buft[il]) == types.end()) {
            types.push_back(buft[il]);
        }
    }
    k.resize(n_layer);
    v.resize(n_layer);
    for (ggml_backend_buffer_type_t t : types) {
        ggml_init_params ip = {/*mem_size =*/2 * n_layer * ggml_tensor_overhead(), /*mem_buffer =*/nullptr,
                               /*no_alloc =*/true};
        ggml_context *   c  = ggml_init(ip);
        ctxs.push_back(c);
        for (uint32_t il = 0; il < n_layer; ++il) {
            if (buft[il] != t) {
                continue;
            }
            k[il] = ggml_new_tensor_2d(c, GGML_TYPE_F16, hp.n_embd_k_gqa(), size);
            v[il] = ggml_new_tensor_2d(c, type_v, hp.n_embd_v_gqa(), size);
            ggml_format_name(k[il], "cache_k_l%u", il);
            ggml_format_name(v[il], "cache_v_l%u", il);
        }
        ggml_backend_buffer_t b = ggml_backend_alloc_ctx_tensors_from_buft(c, t);
        if (!b) {
            specee_fail("cannot allocate the KV cache (%u cells) in %s", size, ggml_backend_buft_name(t));
        }
        // zeros, so masked cells never feed NaN into attention
        ggml_backend_buffer_clear(b, 0);
        bufs.push_back(b);
    }
}

size_t specee_kv_cache::nbytes() const {
    size_t n = 0;
    for (ggml_backend_buffer_t b : bufs) {
        n += ggml_backend_buffer_get_size(b);
    }
    return n;
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

std::vector<int32_t> specee_kv_cache::find_slots_seq(const std::vector<int32_t> & seqs) const {
    const int32_t        n     = (int32_t) seqs.size();
    std::vector<int32_t> cells = find_slots((uint32_t) n); // checks the room; the fallback cells
    std::vector<int32_t> next(SPECEE_KV_MAX_SEQ, 0);       // where each sequence's next cell is searched from
    for (uint32_t c = 0; c < size; ++c) {
        for (int32_t s = 0; s < SPECEE_KV_MAX_SEQ && pos[c] >= 0; ++s) {
            if (has_seq((int32_t) c, s)) {
                next[s] = (int32_t) c + 1;
            }
        }
    }
    std::vector<uint8_t> taken(size, 0);
    std::vector<int32_t> out(n, -1);
    for (int32_t i = 0; i < n; ++i) {
        int32_t & c = next[seqs[i]];
        while (c < (int32_t) size && (pos[c] >= 0 || taken[c])) {
            ++c;
        }
        if (c < (int32_t) size) {
            out[i]   = c;
            taken[c] = 1;
        }
    }
    size_t k = 0; // no room above: the lowest free cells left
    for (int32_t i = 0; i < n; ++i) {
        while (out[i] < 0 && k < cells.size()) {
            if (!taken[cells[k]]) {
                out[i]          = cells[k];
                taken[cells[k]] = 1;
            }
            ++k;
        }
        if (out[i] < 0) { // the fallback cells were taken above: any free cell
            for (uint32_t c = 0; c < size && out[i] < 0; ++c) {
                if (pos[c] < 0 && !taken[c]) {
                    out[i]  = (int32_t) c;
                    taken[c] = 1;
                }
            }
        }
    }
    return out;
}

uint32_t specee_kv_cache::n_kv() const {
    for (uint32_t c = size; c > 0; --c) {
        if (pos[c - 1] >= 0) {
            return c;
        }
    }
    return 0;
}

int32_t specee_kv_cache::pos_max(int32_t s) const {
    s         = s < 0 ? seq_cur : s;
    int32_t p = -1;
    for (uint32_t c = 0; c < size; ++c) {
        if (pos[c] > p && has_seq((int32_t) c, s)) {
            p = pos[c];
        }
    }
    return p;
}

int32_t specee_kv_cache::cell_of(int32_t p) const {
    for (uint32_t c = 0; c < size; ++c) {
        if (pos[c] == p && has_seq((int32_t) c, seq_cur)) {
            return (int32_t) c;
        }
    }
    return -1;
}

bool specee_kv_cache::is_valid_all(int32_t cell) const {
    const uint8_t * row = valid.data() + (size_t) cell * n_layer;
    return std::all_of(row, row + n_layer, [](uint8_t x) { return x != 0; });
}

void specee_kv_cache::occupy(int32_t cell, int32_t p, int32_t token, int32_t s) {
    if (pos[cell] < 0) {
        used++;
    }
    pos[cell] = p;
    tok[cell] = token;
    seq[cell] = (specee_seq_set) 1 << (s < 0 ? seq_cur : s);
    std::fill(valid.begin() + (size_t) cell * n_layer, valid.begin() + (size_t) (cell + 1) * n_layer, 0);
}

void specee_kv_cache::free_cell(int32_t cell) {
    if (pos[cell] >= 0) {
        used--;
    }
    pos[cell] = -1;
    tok[cell] = -1;
    seq[cell] = 0;
    std::fill(valid.begin() + (size_t) cell * n_layer, valid.begin() + (size_t) (cell + 1) * n_layer, 0);
}

int32_t specee_kv_cache::remove(int32_t p0, int32_t p1) { return seq_remove(seq_cur, p0, p1); }

int32_t specee_kv_cache::seq_remove(int32_t s, int32_t p0, int32_t p1) {
    const specee_seq_set drop    = s < 0 ? ~(specee_seq_set) 0 : (specee_seq_set) 1 << s;
    int32_t              removed = 0;
    for (uint32_t c = 0; c < size; ++c) {
        if (pos[c] >= 0 && (seq[c] & drop) && pos[c] >= p0 && (p1 < 0 || pos[c] < p1)) {
            seq[c] &= ~drop;
            if (seq[c] == 0) {
                free_cell((int32_t) c);
            }
            removed++;
        }
    }
    return removed;
}

int32_t specee_kv_cache::seq_copy(int32_t src, int32_t dst, int32_t p0, int32_t p1) {
    int32_t n = 0;
    for (uint32_t c = 0; c < size; ++c) {
        if (pos[c] >= 0 && has_seq((int32_t) c, src) && pos[c] >= p0 && (p1 < 0 || pos[c] < p1)) {
            seq[c] |= (specee_seq_set) 1 << dst;
            n++;
        }
    }
    return n;
}

int32_t specee_kv_cache::seq_n_cells(int32_t s) const {
    int32_t n = 0;
    for (uint32_t c = 0; c < size; ++c) {
        n += pos[c] >= 0 && has_seq((int32_t) c, s);
    }
    return n;
}

void specee_kv_cache::clear() {
    std::fill(pos.begin(), pos.end(), -1);
    std::fill(tok.begin(), tok.end(), -1);
    std::fill(seq.begin(), seq.end(), 0);
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
    occupy(dst, pos[src], tok[src]);
    seq[dst] = seq[src];
    std::copy(valid.begin() + (size_t) src * n_layer, valid.begin() + (size_t) (src + 1) * n_layer,
              valid.begin() + (size_t) dst * n_layer);
    free_cell(src);
}

void specee_build_mask(const specee_kv_cache & kv, const std::vector<int32_t> & cells, const std::vector<int32_t> & pos,
                       const std::vector<int32_t> & seqs, const uint8_t * tree_mask,
                       const std::vector<uint8_t> & cached, int32_t n_kv, std::vector<ggml_fp16_t> & mask,
                       uint32_t n_swa) {
    const int32_t        n = (int32_t) cells.size();
    const bool           one_seq = seqs.empty();
    std::vector<int32_t> batch_index(n_kv, -1);
    for (int32_t j = 0; j < n; ++j) {
        batch_index[cells[j]] = j;
    }
    const ggml_fp16_t zero    = ggml_fp32_to_fp16(0.0f);
    const ggml_fp16_t neg_inf = ggml_fp32_to_fp16(-INFINITY);
    mask.assign((size_t) n_kv * n, neg_inf);
    for (int32_t i = 0; i < n; ++i) {
        ggml_fp16_t * row = mask.data() + (size_t) i * n_kv;
        const int32_t s   = one_seq ? kv.seq_cur : seqs[i];
        for (int32_t c = 0; c < n_kv; ++c) {
            const int32_t j = batch_index[c];
            bool          see;
            if (j >= 0) {
                see = (one_seq || seqs[j] == s) && (tree_mask ? tree_mask[(size_t) i * n + j] != 0 : pos[j] <= pos[i]);
            } else {
                see = cached[c] && kv.pos[c] >= 0 && kv.pos[c] <= pos[i] && kv.has_seq(c, s);
            }
            if (see && n_swa > 0) { // as llama.cpp's standard window: masked when pos[i] - p >= n_swa
                const int32_t p = j >= 0 ? pos[j] : kv.pos[c];
                see             = (int64_t) pos[i] - p < (int64_t) n_swa;
            }
            if (see) {
                row[c] = zero;
            }
        }
    }
}

// leading tokens whose cells (of sequence kv.seq_cur) hold them at positions 0.. with every layer valid
int32_t specee_cached_prefix(const specee_kv_cache & kv, const int32_t * tokens, int32_t n) {
    std::vector<int32_t> cell_at(n, -1); // only positions of the prompt can be part of its prefix
    for (uint32_t c = 0; c < kv.size; ++c) {
        if (kv.pos[c] >= 0 && kv.pos[c] < n && kv.has_seq((int32_t) c, kv.seq_cur)) {
            cell_at[kv.pos[c]] = (int32_t) c;
        }
    }
    int32_t k = 0;
    while (k < n && cell_at[k] >= 0 && kv.tok[cell_at[k]] == tokens[k] &&
           kv.is_valid_all(cell_at[k])) {
        ++k;
    }
    return k;
}
