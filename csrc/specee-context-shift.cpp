// specee-context-shift.cpp: context shift of a generator's sequence (specee-context-shift.h): positions
// [n_keep, n_keep + n_discard) dropped from the cache, the cells after them moved down by n_discard with their K
// turned by RoPE by -n_discard (specee_build_k_shift_graph), and what the mode keeps of the sequence brought along:
// the draft model's tokens (its cache from n_keep on is dropped: the next draft evaluates those again), n-gram
// lookup's index (made again from the shifted tokens). The slots call it (specee-slots.cpp).
#include "specee-context-shift.h"
#include "specee-context.h"
#include "specee-generate.h"
#include "specee-impl.h"
#include "specee-model.h"
#include "specee-options.h"
#include "specee-slots.h"

#include <algorithm>
#include <mutex>

#include <vector>

// every layer's cached K turned by delta[c] positions in cell c
static void shift_k(specee_context & ctx, const std::vector<int32_t> & delta) {
    specee_graph_io io;
    ggml_cgraph *   gf = specee_build_k_shift_graph(specee_graph_begin(ctx), *ctx.model, ctx.kv, io, ctx.graph_size);
    specee_graph_alloc(ctx, gf, "the context shift");
    ggml_backend_tensor_set(io.inp_pos, delta.data(), 0, delta.size() * sizeof(int32_t));
    specee_graph_compute(ctx, gf, 1);
}

// whether a mode's state survives a shift (a draft head's own cache and the exits' records do not)
bool specee_generator_can_shift(const specee_generator & g) {
    const specee_mode_info & mi = specee_mode_row_impl(g.mode);
    return !mi.needs_head && !mi.exits && g.queue.empty();
}

bool specee_generator_shift(specee_generator & g, int32_t n_keep, int32_t n_discard) {
    specee_context &  ctx = *g.ctx;
    specee_kv_cache & kv  = ctx.kv;
    const int32_t     p1  = n_keep + n_discard;
    const int32_t     seq = g.seq;
    if (!specee_generator_can_shift(g) || n_keep < 0 || n_discard <= 0 || p1 > g.root_pos) {
        return false;
    }
    for (uint32_t c = 0; c < kv.size; ++c) { // a cell another sequence shares (a shared prompt) cannot move for one
        if (kv.pos[c] >= p1 && kv.has_seq((int32_t) c, seq) && (kv.seq[c] & ~(specee_seq_set(1) << seq)) != 0) {
            return false;
        }
    }
    kv.seq_remove(seq, n_keep, p1);
    std::vector<int32_t> delta(kv.size, 0);
    for (uint32_t c = 0; c < kv.size; ++c) {
        if (kv.pos[c] >= p1 && kv.has_seq((int32_t) c, seq)) {
            kv.pos[c] -= n_discard;
            delta[c] = -n_discard;
        }
    }
    shift_k(ctx, delta);
    g.root_pos -= n_discard;
    if (!g.draft.tokens.empty()) {
        g.draft.tokens.erase(g.draft.tokens.begin() + n_keep, g.draft.tokens.begin() + p1);
    }
    if (ctx.draft) {
        ctx.draft->kv.seq_remove(seq, n_keep, -1);
    }
    if (specee_mode_row_impl(g.mode).reads & SPECEE_READS_NGRAM) {
        std::vector<int32_t> t = g.lookup.tokens;
        t.erase(t.begin() + n_keep, t.begin() + p1);
        specee_lookup_reset(g.lookup, t.data(), (int32_t) t.size() - 1, t.back());
    }
    return true;
}

// ---- the slots ---------------------------------------------------------------------------------------

// llama.cpp's context shift of the full slots: n_keep tokens kept (< 0: the prompt), half of the rest dropped
void specee_slots_shift_full(specee_slots & s) {
    for (specee_slot & sl : s.slots) {
        if (sl.state != SLOT_DECODE || !sl.full) {
            continue;
        }
        specee_generator & g      = *sl.gen;
        const int32_t      n_keep = std::min(s.n_keep < 0 ? (int32_t) sl.prompt.size() : s.n_keep, s.n_ctx_slot - 4);
        const int32_t      n_left = g.root_pos - n_keep;
        sl.full                   = false;
        if (specee_generator_shift(g, n_keep, std::clamp(n_left / 2, 0, std::max(0, n_left - 1)))) {
            sl.n_shifted++;
            continue;
        }
        sl.finish = SPECEE_FINISH_CONTEXT; // a cell shared with another slot: it ends as without a shift
        sl.state  = SLOT_DONE;
        specee_slots_commit_doc(s, sl);
    }
}

extern "C" int32_t specee_slots_set_context_shift(specee_slots * s, bool enable, int32_t n_keep) {
    std::lock_guard<std::recursive_mutex> lock(s->ctx->mutex);
    s->ctx_shift = enable;
    s->n_keep    = n_keep;
    return 0;
}

extern "C" int32_t specee_slots_n_shifted(const specee_slots * s, int32_t slot) {
    return slot >= 0 && slot < (int32_t) s->slots.size() ? s->slots[slot].n_shifted : 0;
}
