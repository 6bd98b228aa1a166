// specee-kv-cache.h: the KV cache: cells with positions, tokens, owning sequences and per-layer validity; attention
// masks
#pragma once

#include "ggml-backend.h"
#include "ggml.h"

#include <cstdint>
#include <vector>

struct specee_hparams;

// the most sequences one cache holds (a cell's owners are a bitset)
#define SPECEE_KV_MAX_SEQ 64

typedef uint64_t specee_seq_set;

struct specee_kv_cache {
    uint32_t size    = 0;
    uint32_t n_layer = 0;

    std::vector<int32_t> pos;   // [size] position held by each cell, -1 when free
    std::vector<int32_t> tok;   // [size] token held by each cell (prefix reuse), -1 when free
    // [size] the sequences a cell belongs to (several when they share a prefix: specee_kv_cache::seq_copy); a used
    // cell has at least one
    std::vector<specee_seq_set> seq;
    std::vector<uint8_t> valid; // [size * n_layer] cell c holds real K/V in layer il: valid[c * n_layer + il]
    uint32_t             used = 0;
    // The sequence that the single-sequence operations below act on (pos_max, cell_of, remove, occupy) and that a
    // batch without sequence ids belongs to: 0 unless a caller that serves several sequences sets it (a
    // generator on sequence s sets it to s for each of its calls).
    int32_t              seq_cur = 0;

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
    // free cells for tokens of sequences seqs[i], each above the last cell of its sequence where there is one (so a
    // sequence's cells stay in position order and attention needs no reordering), else the lowest free; throws as
    // find_slots
    std::vector<int32_t> find_slots_seq(const std::vector<int32_t> & seqs) const;
    // cells [0, n_kv) cover every used cell (of every sequence)
    uint32_t n_kv() const;
    // the highest position of sequence s (-1: seq_cur), -1 when it has none
    int32_t  pos_max(int32_t s = -1) const;
    // the cell of sequence seq_cur holding position p, -1 when none
    int32_t  cell_of(int32_t p) const;
    bool     has_seq(int32_t cell, int32_t s) const { return (seq[cell] >> s) & 1u; }

    bool is_valid(int32_t cell, int32_t il) const { return valid[(size_t) cell * n_layer + il] != 0; }
    bool is_valid_all(int32_t cell) const;
    void set_valid(int32_t cell, int32_t il) { valid[(size_t) cell * n_layer + il] = 1; }
    // the cell now holds token at position p for sequence s (-1: seq_cur), no layer valid yet
    void occupy(int32_t cell, int32_t p, int32_t token, int32_t s = -1);
    void free_cell(int32_t cell);
    // take sequence seq_cur out of every cell whose position is in [p0, p1) (p1 < 0: to the end), freeing the
    // cells no other sequence shares; returns how many cells it left
    int32_t remove(int32_t p0, int32_t p1);
    // the same for sequence s (s < 0: every sequence)
    int32_t seq_remove(int32_t s, int32_t p0, int32_t p1);
    // sequence dst also owns sequence src's cells with positions in [p0, p1) (a shared prefix: no K/V copied);
    // returns how many
    int32_t seq_copy(int32_t src, int32_t dst, int32_t p0, int32_t p1);
    // cells sequence s owns
    int32_t seq_n_cells(int32_t s) const;
    void clear();
    // move a used cell's K/V (every layer), position, token and validity into the free cell dst
    void move_cell(int32_t src, int32_t dst);
};

// An attention mask [n_tokens][n_kv] (F16: 0 or -inf) for a batch whose tokens sit in cells[i] at positions
// pos[i] of sequences seqs[i] (empty: every token of kv.seq_cur): token i sees batch token j of its own sequence
// when tree_mask[i * n_tokens + j] (NULL: when pos[j] <= pos[i]), and any other cell c of its sequence when
// cached[c] and kv.pos[c] <= pos[i]; with a sliding window n_swa > 0, only what lies in the last n_swa positions
// (pos[i] - n_swa, pos[i]] (batch tokens, tree drafts and cached cells alike).
void specee_build_mask(const specee_kv_cache & kv, const std::vector<int32_t> & cells, const std::vector<int32_t> & pos,
                       const std::vector<int32_t> & seqs, const uint8_t * tree_mask,
                       const std::vector<uint8_t> & cached, int32_t n_kv, std::vector<ggml_fp16_t> & mask,
                       uint32_t n_swa = 0);

// leading tokens whose cells (of sequence kv.seq_cur) hold them at positions 0.. with every layer valid
int32_t specee_cached_prefix(const specee_kv_cache & kv, const int32_t * tokens, int32_t n);
