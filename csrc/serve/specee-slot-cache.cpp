// specee-slot-cache.cpp: the slots' caches beyond a pass: shared whole (unified) or shared out, and a slot's cache
// written to a file or to memory (the same bytes: the server's host-memory prompt cache keeps them), read back into
// a slot, or erased (specee.h says the layout). Only a free slot's cache is touched: a slot holding a
// request changes its cells every pass. Restore reads and checks all the bytes first, so bad bytes change nothing;
// the restored cells are the slot's own (a prefix another slot shares stays that slot's), and its next request reuses
// them as any cached prefix. The prompt cache also asks which slot a prompt would take (specee_slots_choose). An
// embedding between passes makes room in the cache by dropping free slots' cached prompts.
#include "specee-context.h"
#include "specee-embed.h"
#include "specee-impl.h"
#include "specee-kv-cache.h"
#include "specee-model.h"
#include "specee.h"
#include "specee-slots.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

static const char     SLOT_FILE_MAGIC[4] = {'S', 'P', 'K', 'V'};
static const uint32_t SLOT_FILE_VERSION  = 1;

// what one layer's K and V row of a cell are
struct slot_file_layer {
    uint32_t k_bytes = 0;
    uint32_t v_bytes = 0;
    int32_t  k_type  = -1;
    int32_t  v_type  = -1;
};

// a slot's cells in position order, as the file holds them
struct slot_file {
    std::vector<slot_file_layer>      layers;
    std::vector<int32_t>              tok, pos;
    std::vector<uint8_t>              valid; // [n_cells * n_layer]
    std::vector<std::vector<uint8_t>> k, v;  // per layer: [n_cells * row bytes]
};

using file_ptr = std::unique_ptr<FILE, int (*)(FILE *)>;

static std::vector<slot_file_layer> layers_of(const specee_kv_cache & kv) {
    std::vector<slot_file_layer> out(kv.n_layer);
    for (uint32_t il = 0; il < kv.n_layer; ++il) {
        out[il] = {(uint32_t) kv.k[il]->nb[1], (uint32_t) kv.v[il]->nb[1], (int32_t) kv.k[il]->type,
                   (int32_t) kv.v[il]->type};
    }
    return out;
}

static specee_slot & free_slot(specee_slots & s, int32_t slot) {
    if (slot < 0 || slot >= (int32_t) s.slots.size()) {
        specee_fail("slot %d is out of range [0, %d)", slot, (int32_t) s.slots.size());
    }
    if (s.slots[slot].state != SLOT_FREE) {
        specee_fail("slot %d holds a request: its cache can be saved, restored or erased once it is done", slot);
    }
    return s.slots[slot];
}

// the cells of sequence seq, in position order
static std::vector<int32_t> cells_of(const specee_kv_cache & kv, int32_t seq) {
    std::vector<int32_t> cells;
    for (uint32_t c = 0; c < kv.size; ++c) {
        if (kv.pos[c] >= 0 && kv.has_seq((int32_t) c, seq)) {
            cells.push_back((int32_t) c);
        }
    }
    std::sort(cells.begin(), cells.end(), [&](int32_t a, int32_t b) { return kv.pos[a] < kv.pos[b]; });
    return cells;
}

// ---- save ---------------------------------------------------------------------------------------------

static slot_file read_cells(const specee_kv_cache & kv, int32_t seq) {
    slot_file                  f;
    const std::vector<int32_t> cells = cells_of(kv, seq);
    const size_t               n     = cells.size();
    f.layers                         = layers_of(kv);
    f.k.resize(kv.n_layer);
    f.v.resize(kv.n_layer);
    for (int32_t c : cells) {
        f.tok.push_back(kv.tok[c]);
        f.pos.push_back(kv.pos[c]);
        for (uint32_t il = 0; il < kv.n_layer; ++il) {
            f.valid.push_back(kv.is_valid(c, (int32_t) il) ? 1 : 0);
        }
    }
    for (uint32_t il = 0; il < kv.n_layer; ++il) {
        const slot_file_layer & l = f.layers[il];
        f.k[il].resize(n * l.k_bytes);
        f.v[il].resize(n * l.v_bytes);
        for (size_t i = 0; i < n; ++i) {
            ggml_backend_tensor_get(kv.k[il], f.k[il].data() + i * l.k_bytes, (size_t) cells[i] * l.k_bytes, l.k_bytes);
            ggml_backend_tensor_get(kv.v[il], f.v[il].data() + i * l.v_bytes, (size_t) cells[i] * l.v_bytes, l.v_bytes);
        }
    }
    return f;
}

// the bytes' length for n cells of these layers
static size_t bytes_size(const std::vector<slot_file_layer> & layers, size_t n) {
    size_t size = sizeof(SLOT_FILE_MAGIC) + 3 * sizeof(uint32_t) + layers.size() * sizeof(slot_file_layer);
    size += n * (2 * sizeof(int32_t) + layers.size());
    for (const slot_file_layer & l : layers) {
        size += n * ((size_t) l.k_bytes + l.v_bytes);
    }
    return size;
}

static uint8_t * put(uint8_t * out, const void * data, size_t n) {
    if (n > 0) {
        memcpy(out, data, n);
    }
    return out + n;
}

// the cells as the layout's bytes, into out (bytes_size of them)
static void to_bytes(const slot_file & f, uint8_t * out) {
    const uint32_t head[3] = {SLOT_FILE_VERSION, (uint32_t) f.layers.size(), (uint32_t) f.tok.size()};
    out                    = put(out, SLOT_FILE_MAGIC, sizeof(SLOT_FILE_MAGIC));
    out                    = put(out, head, sizeof(head));
    out                    = put(out, f.layers.data(), f.layers.size() * sizeof(slot_file_layer));
    out                    = put(out, f.tok.data(), f.tok.size() * sizeof(int32_t));
    out                    = put(out, f.pos.data(), f.pos.size() * sizeof(int32_t));
    out                    = put(out, f.valid.data(), f.valid.size());
    for (size_t il = 0; il < f.layers.size(); ++il) {
        out = put(out, f.k[il].data(), f.k[il].size());
        out = put(out, f.v[il].data(), f.v[il].size());
    }
}

static void write_file(const slot_file & f, const char * path) {
    std::vector<uint8_t> bytes(bytes_size(f.layers, f.tok.size()));
    to_bytes(f, bytes.data());
    file_ptr fp(fopen(path, "wb"), fclose);
    if (!fp || fwrite(bytes.data(), 1, bytes.size(), fp.get()) != bytes.size() || fflush(fp.get()) != 0) {
        specee_fail("cannot write the slot file %s: %s", path, strerror(errno));
    }
}

// ---- restore ------------------------------------------------------------------------------------------

// reads n bytes at `at` of the `size` there are, or fails naming `what`
static void get(const uint8_t * bytes, size_t size, size_t & at, void * data, size_t n, const char * what) {
    if (n > size - at) {
        specee_fail("%s is not a slot file of this runtime: it ends early", what);
    }
    if (n > 0) {
        memcpy(data, bytes + at, n);
    }
    at += n;
}

// the cells of saved bytes (`what`: where they came from, for errors), checked against the cache's layers (n_max: the
// most cells a slot may hold)
static slot_file from_bytes(const uint8_t * bytes, size_t size, const specee_kv_cache & kv, uint32_t n_max,
                            const char * what) {
    size_t   at = 0;
    char     magic[4];
    uint32_t head[3];
    get(bytes, size, at, magic, sizeof(magic), what);
    get(bytes, size, at, head, sizeof(head), what);
    if (memcmp(magic, SLOT_FILE_MAGIC, sizeof(magic)) != 0 || head[0] != SLOT_FILE_VERSION) {
        specee_fail("%s is not a slot file of this runtime (version %u)", what, SLOT_FILE_VERSION);
    }
    if (head[1] != kv.n_layer) {
        specee_fail("%s holds %u layers, this model has %u: saved from another model", what, head[1], kv.n_layer);
    }
    if (head[2] > n_max) {
        specee_fail("%s holds %u cells, more than a slot may use here (%u)", what, head[2], n_max);
    }
    const size_t n = head[2];
    slot_file    f;
    f.layers.resize(kv.n_layer);
    get(bytes, size, at, f.layers.data(), f.layers.size() * sizeof(slot_file_layer), what);
    const std::vector<slot_file_layer> want = layers_of(kv);
    for (uint32_t il = 0; il < kv.n_layer; ++il) {
        if (memcmp(&f.layers[il], &want[il], sizeof(slot_file_layer)) != 0) {
            specee_fail("%s: layer %u's K/V rows differ from this context's (another model, or another -ctv)", what,
                        il);
        }
    }
    f.tok.resize(n);
    f.pos.resize(n);
    f.valid.resize(n * kv.n_layer);
    get(bytes, size, at, f.tok.data(), n * sizeof(int32_t), what);
    get(bytes, size, at, f.pos.data(), n * sizeof(int32_t), what);
    get(bytes, size, at, f.valid.data(), f.valid.size(), what);
    f.k.resize(kv.n_layer);
    f.v.resize(kv.n_layer);
    for (uint32_t il = 0; il < kv.n_layer; ++il) {
        f.k[il].resize(n * want[il].k_bytes);
        f.v[il].resize(n * want[il].v_bytes);
        get(bytes, size, at, f.k[il].data(), f.k[il].size(), what);
        get(bytes, size, at, f.v[il].data(), f.v[il].size(), what);
    }
    if (at != size) {
        specee_fail("%s is not a slot file of this runtime: %zu bytes after its cells", what, size - at);
    }
    return f;
}

static std::vector<uint8_t> read_file(const char * path) {
    file_ptr fp(fopen(path, "rb"), fclose);
    if (!fp) {
        specee_fail("cannot read the slot file %s: %s", path, strerror(errno));
    }
    std::vector<uint8_t> bytes;
    uint8_t              buf[1 << 16];
    size_t               n;
    while ((n = fread(buf, 1, sizeof(buf), fp.get())) > 0) {
        bytes.insert(bytes.end(), buf, buf + n);
    }
    if (ferror(fp.get())) {
        specee_fail("cannot read the slot file %s: %s", path, strerror(errno));
    }
    return bytes;
}

static void check_cells(const slot_file & f, int32_t n_vocab, int32_t n_ctx_slot, const char * path) {
    for (size_t i = 0; i < f.tok.size(); ++i) {
        if (f.tok[i] < 0 || f.tok[i] >= n_vocab) {
            specee_fail("%s: token id %d at cell %zu is out of range [0, %d)", path, f.tok[i], i, n_vocab);
        }
        if (f.pos[i] < 0 || f.pos[i] >= n_ctx_slot || (i > 0 && f.pos[i] <= f.pos[i - 1])) {
            specee_fail("%s: the positions are not increasing within [0, %d)", path, n_ctx_slot);
        }
    }
}

static int32_t restore_impl(specee_slots & s, int32_t slot, const uint8_t * bytes, size_t size, const char * what) {
    specee_slot &     sl  = free_slot(s, slot);
    specee_kv_cache & kv  = s.ctx->kv;
    const int32_t     seq = sl.gen->seq;
    const slot_file   f   = from_bytes(bytes, size, kv, (uint32_t) s.n_ctx_slot, what);
    check_cells(f, (int32_t) s.ctx->model->hparams.n_vocab, s.n_ctx_slot, what);
    const int32_t n = (int32_t) f.tok.size();
    kv.seq_remove(seq, 0, -1);
    const std::vector<int32_t> cells = kv.find_slots((uint32_t) n); // every slot's share fits: never throws here
    for (int32_t i = 0; i < n; ++i) {
        kv.occupy(cells[i], f.pos[i], f.tok[i], seq);
        for (uint32_t il = 0; il < kv.n_layer; ++il) {
            const slot_file_layer & l = f.layers[il];
            ggml_backend_tensor_set(kv.k[il], f.k[il].data() + (size_t) i * l.k_bytes, (size_t) cells[i] * l.k_bytes,
                                    l.k_bytes);
            ggml_backend_tensor_set(kv.v[il], f.v[il].data() + (size_t) i * l.v_bytes, (size_t) cells[i] * l.v_bytes,
                                    l.v_bytes);
            if (f.valid[(size_t) i * kv.n_layer + il]) {
                kv.set_valid(cells[i], (int32_t) il);
            }
        }
    }
    return n;
}

// ---- C API -------------------------------------------------------------------------------------------

extern "C" int32_t specee_slots_set_unified(specee_slots * s, int32_t unified) {
    std::lock_guard<std::recursive_mutex> lock(s->ctx->mutex);
    return specee_guard<int32_t>(-1, [&] {
        for (const specee_slot & sl : s->slots) {
            if (sl.state != SLOT_FREE) {
                specee_fail("the slots hold requests: the cache is shared out before the first");
            }
        }
        s->unified    = unified != 0;
        s->n_ctx_slot = (int32_t) (s->ctx->cparams.n_ctx / (s->unified ? 1u : (uint32_t) s->slots.size()));
        return s->n_ctx_slot;
    });
}

extern "C" int32_t specee_slots_save(specee_slots * s, int32_t slot, const char * path) {
    std::lock_guard<std::recursive_mutex> lock(s->ctx->mutex);
    return specee_guard<int32_t>(-1, [&] {
        if (!path || !*path) {
            specee_fail("no file to save the slot to");
        }
        const slot_file f = read_cells(s->ctx->kv, free_slot(*s, slot).gen->seq);
        write_file(f, path);
        return (int32_t) f.tok.size();
    });
}

extern "C" int32_t specee_slots_restore(specee_slots * s, int32_t slot, const char * path) {
    std::lock_guard<std::recursive_mutex> lock(s->ctx->mutex);
    return specee_guard<int32_t>(-1, [&] {
        if (!path || !*path) {
            specee_fail("no file to restore the slot from");
        }
        const std::vector<uint8_t> bytes = read_file(path);
        return restore_impl(*s, slot, bytes.data(), bytes.size(), path);
    });
}

extern "C" int64_t specee_slots_save_mem(specee_slots * s, int32_t slot, uint8_t * bytes, int64_t size) {
    std::lock_guard<std::recursive_mutex> lock(s->ctx->mutex);
    return specee_guard<int64_t>(-1, [&] {
        const specee_kv_cache & kv   = s->ctx->kv;
        const int32_t           seq  = free_slot(*s, slot).gen->seq;
        const int64_t           need = (int64_t) bytes_size(layers_of(kv), (size_t) kv.seq_n_cells(seq));
        if (bytes != nullptr) {
            if (size < need) {
                specee_fail("specee_slots_save_mem: %lld bytes, the slot needs %lld", (long long) size,
                            (long long) need);
            }
            to_bytes(read_cells(kv, seq), bytes);
        }
        return need;
    });
}

extern "C" int32_t specee_slots_restore_mem(specee_slots * s, int32_t slot, const uint8_t * bytes, int64_t size) {
    std::lock_guard<std::recursive_mutex> lock(s->ctx->mutex);
    return specee_guard<int32_t>(-1, [&] {
        if (!bytes || size < 0) {
            specee_fail("no saved slot to restore");
        }
        return restore_impl(*s, slot, bytes, (size_t) size, "the saved slot");
    });
}

extern "C" int32_t specee_slots_cache_tokens(specee_slots * s, int32_t slot, int32_t * tokens, int32_t n_max) {
    std::lock_guard<std::recursive_mutex> lock(s->ctx->mutex);
    return specee_guard<int32_t>(-1, [&] {
        if (slot < 0 || slot >= (int32_t) s->slots.size()) {
            specee_fail("slot %d is out of range [0, %d)", slot, (int32_t) s->slots.size());
        }
        const specee_kv_cache &    kv    = s->ctx->kv;
        const std::vector<int32_t> cells = cells_of(kv, s->slots[slot].gen->seq);
        for (int32_t i = 0; i < (int32_t) cells.size() && i < n_max && tokens; ++i) {
            tokens[i] = kv.tok[cells[i]];
        }
        return (int32_t) cells.size();
    });
}

extern "C" int32_t specee_slots_erase(specee_slots * s, int32_t slot) {
    std::lock_guard<std::recursive_mutex> lock(s->ctx->mutex);
    return specee_guard<int32_t>(-1, [&] {
        const int32_t seq = free_slot(*s, slot).gen->seq;
        const int32_t n   = s->ctx->kv.seq_n_cells(seq);
        s->ctx->kv.seq_remove(seq, 0, -1);
        return n;
    });
}

extern "C" int32_t specee_slots_choose(specee_slots * s, const int32_t * tokens, int32_t n_tokens, int32_t * cached) {
    std::lock_guard<std::recursive_mutex> lock(s->ctx->mutex);
    int32_t       k    = 0;
    const int32_t best = specee_slots_choose_impl(*s, tokens, std::max(n_tokens, 0), k);
    if (cached) {
        *cached = std::max(k, 0);
    }
    return best < 0 ? SPECEE_SLOTS_BUSY : best;
}

// ---- embeddings between passes: room made in the slots' cache ------------------------------------------

// specee_embed_impl within a slot's share of the context; free slots' cached prompts make room when the free cells
// are too few
static void embed_between_passes(specee_slots & s, const int32_t * tokens, int32_t n, int32_t pooling, float * out) {
    specee_context & ctx = *s.ctx;
    if (!tokens || n <= 0) {
        specee_fail("cannot embed an empty text");
    }
    if (n > s.n_ctx_slot) {
        specee_fail("the text has %d tokens, more than fit a slot's context of %d", n, s.n_ctx_slot);
    }
    for (int32_t i = 0; i < (int32_t) s.slots.size() && (uint32_t) n > ctx.kv.size - ctx.kv.used; ++i) {
        if (s.slots[i].state == SLOT_FREE) {
            ctx.kv.seq_remove(s.slots[i].gen->seq, 0, -1);
        }
    }
    specee_embed_impl(ctx, tokens, n, pooling, out);
}

extern "C" int32_t specee_slots_embed(specee_slots * s, const int32_t * tokens, int32_t n_tokens, int32_t pooling,
                                      float * out) {
    std::lock_guard<std::recursive_mutex> lock(s->ctx->mutex);
    return specee_guard<int32_t>(-1, [&] {
        embed_between_passes(*s, tokens, n_tokens, pooling, out);
        return 0;
    });
}
