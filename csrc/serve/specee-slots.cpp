// specee-slots.cpp: continuous batching: requests on parallel slots of one context, each slot a sequence of the KV
// cache, stepped together (the step: specee-slot-step.cpp). Requests join (specee_slots_submit) and leave
// (specee_slots_release) between passes; a slot's tokens are kept for reading until then.
//
// Each slot owns a generator (sampler, draft head, stats) bound to its sequence (slot i: sequence i + 1; sequence 0
// is the single-sequence API's). A slot's cells stay after its request for the next one (a chat's next turn
// prefills only its new tokens): a request goes to the free slot whose cache holds the longest prefix of its
// prompt. Every slot may use n_ctx / n_slots cells, so the running slots never run out (unless the cache is shared
// whole, llama.cpp's --kv-unified: specee-slot-cache.cpp).
#include "specee-context.h"
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

// ---- requests ---------------------------------------------------------------------------------------

static specee_slot & slot_at(specee_slots & s, int32_t i) {
    if (i < 0 || i >= (int32_t) s.slots.size()) {
        specee_fail("slot %d is out of range [0, %d)", i, (int32_t) s.slots.size());
    }
    return s.slots[i];
}

// the free slot whose cache holds the longest prefix of the prompt (the least recently used of equals), -1: none
int32_t specee_slots_choose_impl(specee_slots & s, const int32_t * tokens, int32_t n, int32_t & cached) {
    int32_t best = -1;
    cached       = -1;
    for (int32_t i = 0; i < (int32_t) s.slots.size(); ++i) {
        specee_slot & sl = s.slots[i];
        if (sl.state != SLOT_FREE) {
            continue;
        }
        specee_seq_scope seq(*sl.gen);
        const int32_t    k = specee_cached_prefix(s.ctx->kv, tokens, n);
        if (k > cached || (k == cached && sl.order < s.slots[best].order)) {
            best   = i;
            cached = k;
        }
    }
    return best;
}

// A longer prefix of the prompt that another slot's sequence holds (a shared system prompt, a conversation moved to
// another slot) becomes the slot's too: its cells are shared (a cell belongs to several sequences), not evaluated
// again. Returns the prefix the slot now holds.
static int32_t share_prefix(specee_slots & s, int32_t id, const int32_t * tokens, int32_t n, int32_t cached) {
    specee_kv_cache & kv    = s.ctx->kv;
    int32_t           from  = -1;
    int32_t           best  = cached;
    const int32_t     saved = kv.seq_cur;
    for (int32_t j = 0; j < (int32_t) s.slots.size(); ++j) {
        if (j == id) {
            continue;
        }
        kv.seq_cur      = s.slots[j].gen->seq;
        const int32_t k = specee_cached_prefix(kv, tokens, n);
        if (k > best) {
            best = k;
            from = s.slots[j].gen->seq;
        }
    }
    kv.seq_cur = saved;
    if (from < 0) {
        return cached;
    }
    const int32_t seq = s.slots[id].gen->seq;
    kv.seq_remove(seq, 0, -1);
    kv.seq_copy(from, seq, 0, best);
    return best;
}

// want >= 0: that slot (its own cached prefix), SPECEE_SLOTS_BUSY while it holds a request
static int32_t submit_impl(specee_slots & s, const int32_t * tokens, int32_t n, const specee_generator_params & p,
                           int32_t n_predict, int32_t n_probs, int32_t want = -1) {
    specee_context & ctx     = *s.ctx;
    const int32_t    n_vocab = (int32_t) ctx.model->hparams.n_vocab;
    if (!tokens || n <= 0) {
        specee_fail("empty prompt: nothing to generate from");
    }
    if (n >= s.n_ctx_slot) {
        specee_fail("the prompt has %d tokens, more than fit a slot's context of %d (n_ctx %u over %d slots; one more "
                    "cell is needed to decode)", n, s.n_ctx_slot, ctx.cparams.n_ctx, (int32_t) s.slots.size());
    }
    for (int32_t i = 0; i < n; ++i) {
        if (tokens[i] < 0 || tokens[i] >= n_vocab) {
            specee_fail("token id %d at index %d is out of range [0, %d)", tokens[i], i, n_vocab);
        }
    }
    if (n_probs > SPECEE_MAX_PROBS) {
        specee_fail("n_probs=%d: at most %d alternatives per token", n_probs, SPECEE_MAX_PROBS);
    }
    int32_t       cached = 0;
    int32_t       id     = want;
    if (want < 0) {
        id = specee_slots_choose_impl(s, tokens, n, cached);
    } else if (slot_at(s, want).state != SLOT_FREE) {
        return SPECEE_SLOTS_BUSY;
    } else {
        specee_seq_scope seq(*s.slots[want].gen);
        cached = specee_cached_prefix(s.ctx->kv, tokens, n);
    }
    if (id < 0) {
        return SPECEE_SLOTS_BUSY;
    }
    specee_slot &      sl = s.slots[id];
    specee_generator & g  = *sl.gen;
    specee_generator_set_params_impl(g, p);
    if (p.mode == SPECEE_MODE_AUTO && n_probs >= 0 && specee_mode_row_impl(g.mode).tree) {
        // log-probabilities come from a plain step's logits: auto decodes such a request plainly (as the server does)
        specee_generator_params q = p;
        q.mode                    = SPECEE_MODE_PLAIN;
        specee_generator_set_params_impl(g, q);
        g.why = "auto: plain decoding (log-probabilities were asked for)";
    }
    g.stats     = specee_generator_stats{};
    g.started   = false;
    const specee_mode_info & mi = specee_mode_row_impl(g.mode);
    if ((mi.reads & SPECEE_READS_NGRAM) && mi.shared_pass) {
        // its chains are weighed in the shared pass: the pass costs of batches of every slot's draft rows
        specee_seq_scope seq(g);
        specee_lookup_time_passes(g.lookup, ctx, std::min((int32_t) ctx.cparams.n_batch,
                                                          (int32_t) s.slots.size() * (g.params.ngram.draft_max + 1)));
    }
    // a mode with a draft head or exits: its prefill (and decoding, unless shared) alone; n-gram lookup needs
    // nothing of the prompt but its tokens, so its prefill too is in the shared pass
    sl.alone    = (mi.tree && mi.needs_head) || mi.exits;
    if (n_probs >= 0 && (mi.tree || mi.exits)) {
        specee_fail("log-probabilities need mode plain, not %s: a speculative step's tokens come from drafts and "
                    "verification passes", specee_mode_name(g.mode));
    }
    sl.n_probs = std::min(n_probs, n_vocab);
    sl.out_probs.clear();
    sl.post_sampling = false;
    sl.prompt.assign(tokens, tokens + n);
    specee_ngram_cache_doc_begin(ctx.ngram_cache, g.doc, tokens, n);
    sl.n_predict   = n_predict;
    sl.n_generated = 0;
    sl.out.clear();
    sl.out_layers.clear();
    sl.finish = SPECEE_FINISH_NONE;
    sl.error.clear();
    sl.order = ++s.clock;
    sl.n_past = 0;
    sl.full = false, sl.n_shifted = 0;
    if (!sl.alone) {
        // keep the cached prefix, and evaluate at least the last two tokens (as specee_generator_start does)
        const auto       t0 = specee_clock::now();
        cached              = share_prefix(s, id, tokens, n, cached);
        specee_seq_scope seq(g);
        const int32_t    e = std::min(cached, std::max(n - 2, 0));
        ctx.kv.remove(e, -1);
        specee_sampler_reset_impl(*g.smpl);
        for (int32_t i = 0; i < n; ++i) {
            specee_sampler_accept_impl(*g.smpl, tokens[i]);
        }
        sl.n_past          = e;
        g.stats.n_reused   = e;
        g.stats.t_prompt_ms += specee_ms_since(t0);
    }
    if (s.unified) { // the running slots share the whole cache: the idle slots' caches make room for them
        for (specee_slot & o : s.slots) {
            if (&o != &sl && o.state == SLOT_FREE) {
                ctx.kv.seq_remove(o.gen->seq, 0, -1);
            }
        }
    }
    sl.state = SLOT_PREFILL;
    s.totals.n_requests++;
    return id;
}

// the request's prompt and output into the context's cross-request cache, where it ends (once; whatever its mode;
// nothing with the cache off)
void specee_slots_commit_doc(specee_slots & s, specee_slot & sl) {
    specee_ngram_cache_doc_end(s.ctx->ngram_cache, sl.gen->doc);
}

// a token the slot's request produced (logits: its step's, for log-probabilities; NULL in a speculative step): kept
// for reading, or the end of the request
void specee_slot_emit(specee_slots & s, specee_slot & sl, int32_t t, int32_t layers, const float * logits) {
    specee_generator & g = *sl.gen;
    specee_ngram_cache_doc_append(g.doc, &t, 1);
    if (!g.params.ignore_eos && specee_token_is_eog(s.ctx->model, t)) {
        sl.finish = SPECEE_FINISH_STOP;
    } else {
        sl.out.push_back(t);
        sl.out_layers.push_back(layers);
        if (sl.n_probs >= 0 && logits && sl.post_sampling) { // t is the sampler's last draw (no jump-forward)
            specee_sampler_drawn_logprobs(*g.smpl, t, sl.n_probs, sl.out_probs);
        } else if (sl.n_probs >= 0 && logits) {
            specee_logprobs(logits, (int32_t) s.ctx->model->hparams.n_vocab, t, sl.n_probs, sl.out_probs);
        }
        sl.n_generated++;
        s.totals.n_tokens++;
        if (sl.n_predict >= 0 && sl.n_generated >= sl.n_predict) {
            sl.finish = SPECEE_FINISH_LENGTH;
        } else if (g.root_pos >= s.n_ctx_slot) { // the next token's cell would pass the slot's share
            sl.full   = s.ctx_shift && specee_generator_can_shift(g);
            sl.finish = sl.full ? SPECEE_FINISH_NONE : SPECEE_FINISH_CONTEXT;
        }
    }
    if (sl.finish != SPECEE_FINISH_NONE) {
        sl.state = SLOT_DONE;
        specee_slots_commit_doc(s, sl);
    }
}

// a slot's request ends with an error (the slot's failure, not the pass's)
void specee_slot_fail(specee_slot & sl, const char * what) {
    sl.error  = what;
    sl.finish = SPECEE_FINISH_ERROR;
    sl.state  = SLOT_DONE;
}

// ---- C API -------------------------------------------------------------------------------------------

extern "C" specee_slots * specee_slots_init(specee_context * ctx, int32_t n_slots, int32_t n_chunk) {
    if (!ctx) {
        specee_set_error("no context");
        return nullptr;
    }
    std::lock_guard<std::recursive_mutex> lock(ctx->mutex);
    return specee_guard<specee_slots *>(nullptr, [&] {
        if (n_slots < 1 || n_slots > SPECEE_MAX_SEQ - 2) {
            specee_fail("n_slots=%d: a context serves 1 to %d slots", n_slots, SPECEE_MAX_SEQ - 2);
        }
        auto s        = std::make_unique<specee_slots>();
        s->ctx        = ctx;
        s->n_ctx_slot = (int32_t) (ctx->cparams.n_ctx / (uint32_t) n_slots);
        s->n_chunk    = n_chunk > 0 ? std::min(n_chunk, (int32_t) ctx->cparams.n_batch) : (int32_t) ctx->cparams.n_batch;
        if (s->n_ctx_slot < 2) {
            specee_fail("n_ctx=%u over %d slots leaves %d cells a slot: too few", ctx->cparams.n_ctx, n_slots,
                        s->n_ctx_slot);
        }
        // the slots share out every cell of the cache: what the context's own generator kept of its last prompt
        // (sequence 0, reused as a prefix by its next call) goes, so a slot's n_ctx_slot cells are really free
        ctx->kv.seq_remove(0, 0, -1);
        specee_generator_params p = specee_generator_default_params();
        p.mode                    = SPECEE_MODE_PLAIN;
        s->slots.resize(n_slots);
        for (int32_t i = 0; i < n_slots; ++i) {
            s->slots[i].gen.reset(new specee_generator());
            s->slots[i].gen->ctx = ctx;
            s->slots[i].gen->seq = i + 1;
            specee_generator_set_params_impl(*s->slots[i].gen, p);
        }
        return s.release();
    });
}

extern "C" void specee_slots_free(specee_slots * s) {
    if (!s) {
        return;
    }
    std::lock_guard<std::recursive_mutex> lock(s->ctx->mutex);
    for (specee_slot & sl : s->slots) {
        s->ctx->kv.seq_remove(sl.gen->seq, 0, -1);
    }
    delete s;
}

extern "C" int32_t specee_slots_n_slots(const specee_slots * s) { return (int32_t) s->slots.size(); }
extern "C" int32_t specee_slots_n_ctx_slot(const specee_slots * s) { return s->n_ctx_slot; }

extern "C" int32_t specee_slots_submit(specee_slots * s, const int32_t * tokens, int32_t n_tokens,
                                       struct specee_generator_params params, int32_t n_predict, int32_t n_probs) {
    std::lock_guard<std::recursive_mutex> lock(s->ctx->mutex);
    const int32_t r = specee_guard<int32_t>(
        -1, [&] { return submit_impl(*s, tokens, n_tokens, params, n_predict, n_probs); });
    if (r == SPECEE_SLOTS_BUSY) {
        specee_set_error(specee_format("all %d slots are busy", (int32_t) s->slots.size()));
    }
    return r;
}

extern "C" int32_t specee_slots_submit_to(specee_slots * s, int32_t slot, const int32_t * tokens, int32_t n_tokens,
                                          struct specee_generator_params params, int32_t n_predict, int32_t n_probs) {
    std::lock_guard<std::recursive_mutex> lock(s->ctx->mutex);
    const int32_t r = specee_guard<int32_t>(-1, [&] {
        slot_at(*s, slot); // in range
        return submit_impl(*s, tokens, n_tokens, params, n_predict, n_probs, slot);
    });
    if (r == SPECEE_SLOTS_BUSY) {
        specee_set_error(specee_format("slot %d is busy", slot));
    }
    return r;
}

extern "C" int32_t specee_slots_n_past(const specee_slots * s, int32_t slot) {
    std::lock_guard<std::recursive_mutex> lock(s->ctx->mutex);
    return slot >= 0 && slot < (int32_t) s->slots.size() ? s->slots[slot].n_past : -1;
}

extern "C" int32_t specee_slots_read(specee_slots * s, int32_t slot, int32_t * tokens, int32_t * layers_run,
                                     specee_token_logprob * probs, int32_t n_max, int32_t * finish) {
    std::lock_guard<std::recursive_mutex> lock(s->ctx->mutex);
    return specee_guard<int32_t>(-1, [&] {
        specee_slot & sl = slot_at(*s, slot);
        if (sl.state == SLOT_FREE) {
            specee_fail("slot %d has no request", slot);
        }
        const int32_t n = std::min<int32_t>(std::max(n_max, 0), (int32_t) sl.out.size());
        if (n > 0 && !tokens) {
            specee_fail("specee_slots_read: no room for tokens");
        }
        std::copy(sl.out.begin(), sl.out.begin() + n, tokens);
        if (layers_run) {
            std::copy(sl.out_layers.begin(), sl.out_layers.begin() + n, layers_run);
        }
        sl.out.erase(sl.out.begin(), sl.out.begin() + n);
        sl.out_layers.erase(sl.out_layers.begin(), sl.out_layers.begin() + n);
        if (sl.n_probs >= 0) {
            const size_t k = (size_t) n * (size_t) (1 + sl.n_probs);
            if (probs) {
                std::copy(sl.out_probs.begin(), sl.out_probs.begin() + k, probs);
            }
            sl.out_probs.erase(sl.out_probs.begin(), sl.out_probs.begin() + k);
        }
        if (finish) {
            *finish = sl.out.empty() ? sl.finish : SPECEE_FINISH_NONE;
        }
        return n;
    });
}

extern "C" const char * specee_slots_error(const specee_slots * s, int32_t slot) {
    return slot >= 0 && slot < (int32_t) s->slots.size() ? s->slots[slot].error.c_str() : "";
}

extern "C" int32_t specee_slots_release(specee_slots * s, int32_t slot) {
    std::lock_guard<std::recursive_mutex> lock(s->ctx->mutex);
    return specee_guard<int32_t>(-1, [&] {
        specee_slot & sl = slot_at(*s, slot);
        if (sl.state == SLOT_PREFILL || sl.state == SLOT_DECODE) {
            s->totals.n_cancelled++;
            specee_slots_commit_doc(*s, sl); // what it said so far
        }
        sl.state = SLOT_FREE;
        sl.out.clear();
        sl.out_layers.clear();
        sl.out_probs.clear();
        sl.order = ++s->clock;
        return 0;
    });
}

extern "C" int32_t specee_slots_n_busy(const specee_slots * s) {
    std::lock_guard<std::recursive_mutex> lock(s->ctx->mutex);
    int32_t n = 0;
    for (const specee_slot & sl : s->slots) {
        n += sl.state != SLOT_FREE;
    }
    return n;
}

extern "C" struct specee_generator_stats specee_slots_stats(const specee_slots * s, int32_t slot) {
    std::lock_guard<std::recursive_mutex> lock(s->ctx->mutex);
    if (slot < 0 || slot >= (int32_t) s->slots.size()) {
        return specee_generator_stats{};
    }
    return specee_generator_get_stats(s->slots[slot].gen.get());
}

extern "C" int32_t specee_slots_n_probs(const specee_slots * s, int32_t slot) {
    return slot >= 0 && slot < (int32_t) s->slots.size() ? s->slots[slot].n_probs : -1;
}

extern "C" int32_t specee_slots_set_post_sampling_probs(specee_slots * s, int32_t slot, bool on) {
    std::lock_guard<std::recursive_mutex> lock(s->ctx->mutex);
    return specee_guard<int32_t>(-1, [&] {
        if (slot < 0 || slot >= (int32_t) s->slots.size() || s->slots[slot].state == SLOT_FREE) {
            specee_fail("no request on slot %d", slot);
        }
        s->slots[slot].post_sampling = on;
        return 0;
    });
}

extern "C" int32_t specee_slots_mode(const specee_slots * s, int32_t slot) {
    return slot >= 0 && slot < (int32_t) s->slots.size() ? s->slots[slot].gen->mode : -1;
}

extern "C" struct specee_slots_totals specee_slots_get_totals(const specee_slots * s) {
    std::lock_guard<std::recursive_mutex> lock(s->ctx->mutex);
    return s->totals;
}
