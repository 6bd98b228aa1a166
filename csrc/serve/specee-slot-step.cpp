// specee-slot-step.cpp: a step of the parallel slots (specee-slots.cpp has their requests): one pass of the model
// over every slot's rows.
//
// One call of specee_slots_step is one pass of the model over a batch that holds the next token of every plain
// slot that is decoding and, in the room left (n_chunk tokens at most), the next chunk of the prompts waiting to be
// prefilled, oldest first: a long prompt joins over several passes while the running sequences keep decoding.
// Requests join (specee_slots_submit) and leave (specee_slots_release) between passes.
//
// EAGLE and n-gram lookup requests share the pass too: each drafts its tree on its own sequence before the pass (the
// draft head's, or the lookup's copied chain and branches: the mode's drafter, specee-drafter.h), the tree is a block
// of rows with its own tree mask, and after the pass each walks its block's logits and keeps what it accepted, as a
// step alone does (specee_drafter_finish: both stay lossless). A lookup request's prefill is in the shared
// pass as a plain request's is (the lookup needs only the prompt's tokens). Early-exit and tree-exit
// requests run their sequence alone: each token's pass stops at its own layer, which a shared pass cannot. Their
// prefill, and an EAGLE request's (whose draft head needs the prompt's features), run alone too, after the shared
// pass, with the generator of specee-generate.cpp on the slot's sequence. docs/server.md says why.
#include "specee-context-shift.h"
#include "specee-context.h"
#include "specee-draft-model.h"
#include "specee-drafter.h"
#include "specee-generate.h"
#include "specee-impl.h"
#include "specee-model.h"
#include "specee-options.h"
#include "specee-sampling.h"
#include "specee-slots.h"
#include "specee-speculative.h"
#include "specee.h"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

// ---- one pass -------------------------------------------------------------------------------------

// the most tokens a slot's request may still produce in one step
static int32_t slot_n_max(const specee_slots & s, const specee_slot & sl) {
    int32_t n_max = s.n_ctx_slot - sl.gen->root_pos;
    if (sl.n_predict >= 0) {
        n_max = std::min(n_max, sl.n_predict - sl.n_generated);
    }
    return std::max(n_max, 1);
}

// An EAGLE or n-gram lookup slot whose step joins the shared pass: its tree (drafted before the pass: by the draft
// head, or copied by the lookup) is a block of rows of the batch with its own tree mask; after the pass the slot walks
// it with its rows' logits
struct tree_block {
    int32_t           slot = -1;
    int32_t           row0 = 0; // its first row in the batch (and in the pass's logits: every row has them)
    int32_t           n_max = 1;
    bool              jump  = false; // a plain slot's chain of tokens its grammar forces (jump-forward)
    specee_proposal   p;             // what its drafter proposed (not a jump)
    specee_tree_batch tb;
};


// whether a slot's next step is a draft-and-verify step (EAGLE, n-gram lookup) that can share the pass (an EAGLE
// slot's first token, sampled by its prefill alone, is returned without a pass)
static bool shares_tree(const specee_slot & sl) {
    const specee_generator & g  = *sl.gen;
    const specee_mode_info & mi = specee_mode_row_impl(g.mode);
    return sl.state == SLOT_DECODE && mi.tree && mi.shared_pass && g.started && g.queue.empty();
}

// after the pass (n_pass rows, pass_ms): the slot's walk over its block and what it keeps, as a step alone does
// (specee_drafter_finish)
static void finish_tree(specee_slots & s, const tree_block & tbk, int32_t n_pass, double pass_ms) {
    specee_context &     ctx     = *s.ctx;
    const int32_t        n_layer = (int32_t) ctx.model->hparams.n_layer;
    const int32_t        n_vocab = (int32_t) ctx.model->hparams.n_vocab;
    specee_slot &        sl      = s.slots[tbk.slot];
    specee_generator &   g       = *sl.gen;
    specee_seq_scope     seq(g);
    const int32_t        n  = (int32_t) tbk.tb.tok.size();
    const auto           t0 = specee_clock::now();
    // the block's logits: the pass's rows row0.. (every row has them)
    const float *        logits = ctx.logits.data() + (size_t) tbk.row0 * n_vocab;
    std::vector<int32_t> emitted(tbk.n_max);
    const double         m0 = specee_sampler_mask_ms(*g.smpl);
    if (tbk.jump) {
        emitted.resize(specee_jump_forward_finish(g, n, logits, tbk.row0, tbk.n_max, emitted.data()));
    } else {
        const specee_verified v = {n, logits, tbk.row0, n_pass, pass_ms};
        emitted.resize(specee_drafter_finish(*specee_generator_drafter(g), {g.tree, g.lookup, g.draft}, specee_generator_step(g),
                                             tbk.p, v, tbk.n_max, emitted.data()));
        g.stats.t_sample_ms += specee_ms_since(t0); // (jump-forward's finish adds its own)
    }
    g.stats.t_mask_ms += specee_sampler_mask_ms(*g.smpl) - m0;
    g.stats.t_verify_ms += pass_ms;
    g.stats.t_decode_ms += pass_ms + specee_ms_since(t0);
    g.stats.n_decoded += (int32_t) emitted.size();
    g.stats.n_tokens += (int32_t) emitted.size();
    for (size_t i = 0; i < emitted.size() && sl.state != SLOT_DONE; ++i) {
        // a chain's token i was drawn at its row i (log-probabilities as a plain step gives them)
        specee_slot_emit(s, sl, emitted[i], n_layer, tbk.jump ? logits + i * (size_t) n_vocab : nullptr);
    }
}

// The batch of a shared pass, gathered slot by slot: the plain slots' tokens, the trees' blocks, the prompt
// chunks, in that order (the logits' rows follow it)
struct shared_batch {
    std::vector<int32_t>    tok, pos, seq;
    std::vector<int8_t>     out;
    std::vector<int32_t>    decoding;           // plain slots with a token in the batch
    std::vector<tree_block> trees;              // EAGLE and n-gram lookup slots' trees
    std::vector<int32_t>    prefilling, taken;  // slots with a prompt chunk, and its length

    void add(int32_t t, int32_t p, int32_t s, bool logits) {
        tok.push_back(t);
        pos.push_back(p);
        seq.push_back(s);
        out.push_back(logits);
    }
    // a tree block's rows, on its slot's sequence, after the rows so far
    void add_block(tree_block && tbk, int32_t s) {
        tbk.row0 = (int32_t) tok.size();
        for (size_t r = 0; r < tbk.tb.tok.size(); ++r) {
            add(tbk.tb.tok[r], tbk.tb.pos[r], s, true);
        }
        trees.push_back(std::move(tbk));
    }
};

// every plain decoding slot's next token; then, as tree blocks after them, the slots whose grammar forces tokens next
// (jump-forward: the root and the forced chain, in the room the batch has left)
static void gather_decoding(specee_slots & s, shared_batch & sb) {
    auto plain = [](const specee_slot & sl) { return sl.state == SLOT_DECODE && !sl.alone && !shares_tree(sl); };
    int32_t room = (int32_t) s.ctx->cparams.n_batch - (int32_t) std::count_if(s.slots.begin(), s.slots.end(), plain);
    std::vector<tree_block> jumps;
    for (int32_t i = 0; i < (int32_t) s.slots.size(); ++i) {
        specee_slot & sl = s.slots[i];
        if (!plain(sl)) {
            continue;
        }
        specee_generator &         g     = *sl.gen;
        const int32_t              n_max = slot_n_max(s, sl);
        // (a request that reports the sampler's probabilities takes each token from a draw: no forced chain)
        const std::vector<int32_t> nodes =
            sl.post_sampling ? std::vector<int32_t>{} : specee_jump_forward_draft(g, std::min(room, n_max - 1));
        if (nodes.empty()) {
            sb.add(g.root, g.root_pos, g.seq, true);
            sb.decoding.push_back(i);
            continue;
        }
        room -= (int32_t) nodes.size();
        jumps.push_back({i, 0, n_max, true, {}, specee_tree_verify_batch(g.tree, g.root, g.root_pos, nodes)});
    }
    for (tree_block & tbk : jumps) {
        sb.add_block(std::move(tbk), s.slots[tbk.slot].gen->seq);
    }
}

// The pass a slot's draft rows join, as far as it is gathered: the rows before them and the slot's root, yielding a
// token each for a plain slot, at least one for a tree (counted one) and the root (prompt chunks, gathered after the
// trees, are not counted: the rule errs on the side of drafting less)
static specee_pass_share share_so_far(const shared_batch & sb) {
    specee_pass_share share;
    share.n_rows   = (int32_t) sb.tok.size() + 1;
    share.n_tokens = (double) (sb.decoding.size() + sb.trees.size() + 1);
    return share;
}

// EAGLE slots' trees, each drafted on its slot's sequence, as long as the batch has room for its root and a draft
// token, and n-gram lookup slots' (as long as it has room for the root: a lookup slot has no step alone); `stepped`
// marks the slots taken (a draft that fails ends its request)
static void gather_trees(specee_slots & s, shared_batch & sb, std::vector<uint8_t> & stepped) {
    specee_context & ctx = *s.ctx;
    for (int32_t i = 0; i < (int32_t) s.slots.size(); ++i) {
        specee_slot &      sl   = s.slots[i];
        const int32_t      room = (int32_t) ctx.cparams.n_batch - (int32_t) sb.tok.size();
        specee_generator & g    = *sl.gen;
        if (!shares_tree(sl) || room < (specee_mode_row_impl(g.mode).needs_head ? 2 : 1)) {
            continue;
        }
        specee_seq_scope scope(g);
        tree_block       tbk;
        tbk.slot             = i;
        tbk.row0             = (int32_t) sb.tok.size();
        tbk.n_max            = slot_n_max(s, sl);
        const int32_t n_free = (int32_t) ctx.cparams.n_ctx - (int32_t) ctx.kv.used - (int32_t) sb.tok.size();
        const int32_t budget = std::min({room - 1, tbk.n_max - 1, n_free - 1});
        const auto    t0     = specee_clock::now();
        stepped[i]           = 1;
        try {
            tbk.p  = specee_generator_drafter(g)->propose({g.tree, g.lookup, g.draft}, specee_generator_step(g),
                                                          std::max(budget, 0), share_so_far(sb));
            const std::vector<int32_t> nodes =
                specee_drafter_with_forced({g.tree, g.lookup, g.draft}, specee_generator_step(g), tbk.p,
                                           specee_jump_forward_tokens(g, budget), budget);
            tbk.tb = specee_tree_verify_batch(g.tree, g.root, g.root_pos, nodes);
        } catch (const std::exception & e) {
            specee_slot_fail(sl, e.what());
            continue;
        }
        g.stats.t_draft_ms += specee_ms_since(t0);
        g.stats.t_decode_ms += specee_ms_since(t0);
        sb.add_block(std::move(tbk), g.seq);
    }
}

// prompts in the order they came, n_chunk tokens at most (and what is left of the batch)
static void gather_prompts(specee_slots & s, shared_batch & sb) {
    std::vector<int32_t> waiting;
    for (int32_t i = 0; i < (int32_t) s.slots.size(); ++i) {
        if (s.slots[i].state == SLOT_PREFILL && !s.slots[i].alone) {
            waiting.push_back(i);
        }
    }
    std::sort(waiting.begin(), waiting.end(),
              [&](int32_t a, int32_t b) { return s.slots[a].order < s.slots[b].order; });
    int32_t budget = std::min(s.n_chunk, (int32_t) s.ctx->cparams.n_batch - (int32_t) sb.tok.size());
    for (int32_t i : waiting) {
        if (budget <= 0) {
            break;
        }
        specee_slot & sl = s.slots[i];
        const int32_t n  = (int32_t) sl.prompt.size();
        const int32_t k  = std::min(budget, n - sl.n_past);
        for (int32_t j = sl.n_past; j < sl.n_past + k; ++j) {
            sb.add(sl.prompt[j], j, sl.gen->seq, j == n - 1);
        }
        sb.prefilling.push_back(i);
        sb.taken.push_back(k);
        budget -= k;
    }
}

// with trees, the batch's mask: each tree block its own, every other row causal (rows of other sequences are never
// seen whatever the mask says); empty without trees (causal)
static std::vector<uint8_t> shared_mask(const shared_batch & sb) {
    const int32_t        n_rows = (int32_t) sb.tok.size();
    std::vector<uint8_t> mask;
    if (sb.trees.empty()) {
        return mask;
    }
    std::vector<int32_t> block(n_rows, -1);
    for (size_t k = 0; k < sb.trees.size(); ++k) {
        const tree_block & t = sb.trees[k];
        std::fill(block.begin() + t.row0, block.begin() + t.row0 + (int64_t) t.tb.tok.size(), (int32_t) k);
    }
    mask.assign((size_t) n_rows * n_rows, 0);
    for (int32_t i = 0; i < n_rows; ++i) {
        for (int32_t j = 0; j < n_rows; ++j) {
            const int32_t k = block[i];
            if (k < 0) {
                mask[(size_t) i * n_rows + j] = block[j] < 0 && sb.pos[j] <= sb.pos[i];
                continue;
            }
            const tree_block & t = sb.trees[k];
            const int32_t      m = (int32_t) t.tb.tok.size();
            mask[(size_t) i * n_rows + j] = block[j] == k && t.tb.mask[(size_t) (i - t.row0) * m + j - t.row0];
        }
    }
    return mask;
}

// after the pass: a token from a row's logits for a slot (its next token, or a prefilled prompt's first); false when
// its grammar failed (the engine gave up on it mid-way): that slot ends, the others go on
static bool sample_row(specee_slots & s, specee_slot & sl, int32_t row, int32_t & t) {
    const int32_t n_vocab = (int32_t) s.ctx->model->hparams.n_vocab;
    const float * lg      = s.ctx->logits.data() + (size_t) row * n_vocab;
    try {
        t = specee_sampler_sample_impl(*sl.gen->smpl, lg, n_vocab);
        specee_sampler_accept_impl(*sl.gen->smpl, t);
        return true;
    } catch (const std::exception & e) {
        specee_slot_fail(sl, e.what());
        return false;
    }
}

// The shared pass: every plain decoding slot's next token, every EAGLE and n-gram lookup slot's tree (its own mask;
// the draft runs before the pass) and a chunk of the waiting prompts. `stepped` marks the tree slots it stepped.
static void shared_pass(specee_slots & s, std::vector<uint8_t> & stepped) {
    specee_context & ctx     = *s.ctx;
    const int32_t    n_layer = (int32_t) ctx.model->hparams.n_layer;
    const int32_t    n_vocab = (int32_t) ctx.model->hparams.n_vocab;
    shared_batch     sb;
    gather_decoding(s, sb);
    gather_trees(s, sb, stepped);
    gather_prompts(s, sb);
    if (sb.tok.empty()) {
        return;
    }
    const std::vector<uint8_t> mask = shared_mask(sb);
    for (specee_slot & sl : s.slots) { // the decoding slots' grammars' next masks, while the pass runs
        if (sl.state == SLOT_DECODE) {
            specee_sampler_prefetch(*sl.gen->smpl);
        }
    }

    const auto   t0 = specee_clock::now();
    specee_batch b  = {(int32_t) sb.tok.size(), sb.tok.data(), sb.pos.data(), mask.empty() ? nullptr : mask.data(),
                       sb.out.data(), sb.seq.data()};
    try {
        specee_eval_layers_impl(ctx, &b, 0, n_layer, 0);
    } catch (...) {
        for (const tree_block & tbk : sb.trees) {
            const specee_generator & g = *s.slots[tbk.slot].gen;
            if (g.head && specee_mode_row_impl(g.mode).needs_head) {
                specee_draft_drop_tree(*s.slots[tbk.slot].gen->head); // the trees' draft cells go with the failed pass
            }
        }
        throw;
    }
    const double ms = specee_ms_since(t0);
    s.totals.n_passes++;
    s.totals.n_pass_tokens += (int64_t) sb.tok.size();
    s.totals.t_pass_ms += ms;

    for (const tree_block & tbk : sb.trees) {
        specee_slot & sl = s.slots[tbk.slot];
        try {
            finish_tree(s, tbk, (int32_t) sb.tok.size(), ms);
        } catch (const std::exception & e) {
            specee_slot_fail(sl, e.what());
        }
    }
    int32_t row = 0;
    for (int32_t i : sb.decoding) {
        specee_slot &      sl = s.slots[i];
        specee_generator & g  = *sl.gen;
        const auto         ts = specee_clock::now();
        const double       m0 = specee_sampler_mask_ms(*g.smpl);
        int32_t            t  = -1;
        if (!sample_row(s, sl, row, t)) {
            row++;
            continue;
        }
        g.stats.t_mask_ms += specee_sampler_mask_ms(*g.smpl) - m0;
        g.stats.t_sample_ms += specee_ms_since(ts);
        g.stats.t_decode_ms += ms + specee_ms_since(ts);
        g.stats.n_steps++;
        g.stats.n_decoded++;
        g.stats.n_tokens++;
        g.root = t;
        g.root_pos++;
        specee_slot_emit(s, sl, t, n_layer, ctx.logits.data() + (size_t) row++ * n_vocab);
    }
    for (const tree_block & tbk : sb.trees) {
        row += (int32_t) tbk.tb.tok.size(); // the trees' rows, walked above
    }
    for (size_t k = 0; k < sb.prefilling.size(); ++k) {
        specee_slot &      sl = s.slots[sb.prefilling[k]];
        specee_generator & g  = *sl.gen;
        const int32_t      n  = (int32_t) sl.prompt.size();
        sl.n_past += sb.taken[k];
        g.stats.n_prompt += sb.taken[k];
        g.stats.t_prompt_ms += ms;
        if (sl.n_past < n) {
            continue;
        }
        int32_t t = -1;
        if (!sample_row(s, sl, row, t)) {
            row++;
            continue;
        }
        if (specee_mode_row_impl(g.mode).reads & SPECEE_READS_NGRAM) {
            specee_lookup_reset(g.lookup, sl.prompt.data(), n, t);
        }
        if (specee_mode_row_impl(g.mode).reads & SPECEE_READS_DRAFT) {
            specee_draft_seq_reset(g.draft, sl.prompt.data(), n, t);
        }
        g.root          = t;
        g.root_pos      = n;
        g.started       = true;
        g.stats.n_tokens++;
        sl.state = SLOT_DECODE;
        specee_slot_emit(s, sl, t, n_layer, ctx.logits.data() + (size_t) row++ * n_vocab);
    }
}

// a speculative slot's own prefill or step, on its sequence
static void alone_step(specee_slots & s, specee_slot & sl) {
    specee_generator & g = *sl.gen;
    specee_seq_scope   seq(g);
    int32_t            n_max = 1;
    if (sl.state == SLOT_PREFILL) {
        specee_generator_start_impl(g, sl.prompt.data(), (int32_t) sl.prompt.size());
        sl.n_past = (int32_t) sl.prompt.size();
        sl.state  = SLOT_DECODE; // next returns the prompt's token without a pass
    } else {
        n_max = slot_n_max(s, sl);
        s.totals.n_passes++;
    }
    std::vector<int32_t> toks(n_max), layers(n_max);
    const int32_t        n = specee_generator_next_impl(g, toks.data(), layers.data(), n_max);
    if (n == 0) {
        sl.finish = SPECEE_FINISH_CONTEXT;
        sl.state  = SLOT_DONE;
    }
    for (int32_t i = 0; i < n && sl.state != SLOT_DONE; ++i) {
        specee_slot_emit(s, sl, toks[i], layers[i]);
    }
}

static int32_t step_impl(specee_slots & s) {
    specee_slots_shift_full(s);
    std::vector<uint8_t> stepped(s.slots.size(), 0);
    shared_pass(s, stepped);
    for (size_t i = 0; i < s.slots.size(); ++i) {
        specee_slot & sl = s.slots[i];
        if (!sl.alone || stepped[i] || (sl.state != SLOT_PREFILL && sl.state != SLOT_DECODE)) {
            continue;
        }
        try {
            alone_step(s, sl);
        } catch (const std::exception & e) {
            specee_slot_fail(sl, e.what());
        }
    }
    int32_t busy = 0;
    for (const specee_slot & sl : s.slots) {
        busy += sl.state == SLOT_PREFILL || sl.state == SLOT_DECODE;
    }
    return busy;
}

// ---- C API -------------------------------------------------------------------------------------------

extern "C" int32_t specee_slots_step(specee_slots * s) {
    std::lock_guard<std::recursive_mutex> lock(s->ctx->mutex);
    return specee_guard<int32_t>(-1, [&] { return step_impl(*s); });
}
