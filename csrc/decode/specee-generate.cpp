// specee-generate.cpp: the one decoding loop shared by the CLI, the Python API and the tools.
//
// The policy lives here once: which mode `auto` means for a model, what each mode needs, the sampler chain with
// ignore-EOS, the prompt (with the longest cached prefix kept), and one pass per call of next() in plain decoding,
// one draft-and-verify step of the mode's drafter in eagle / eagle2 / ngram / ngram+eagle2 (specee-drafter.h), one
// layer-range walk in early exit (specee-early-exit.cpp), one draft-and-verify step whose pass may exit early in
// tree-exit (specee-tree-exit.cpp).
// The decoders share the generator's draft head, so its cache of pairs outlives a change of parameters
// (specee_generator_set_params) and prompt-prefix reuse covers the head too.
#include "specee-context.h"
#include "specee-draft-head.h"
#include "specee-draft-model.h"
#include "specee-drafter.h"
#include "specee-early-exit.h"
#include "specee-generate.h"
#include "specee-grammar.h"
#include "specee-hybrid.h"
#include "specee-impl.h"
#include "specee-model.h"
#include "specee-pass-cost.h"
#include "specee-option-values.h"
#include "specee-options.h"
#include "specee-sampling.h"
#include "specee-speculative.h"
#include "specee-stats.h"
#include "specee-tree-exit.h"
#include "specee.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

// ---- the sequence a generator decodes

specee_seq_scope::specee_seq_scope(specee_generator & g) : kv(g.ctx->kv), saved(g.ctx->kv.seq_cur) {
    kv.seq_cur = g.seq;
}

specee_seq_scope::~specee_seq_scope() { kv.seq_cur = saved; }

// ---- modes and parameters ---------------------------------------------------------------------------

// The default tree where the caller gives none, from what a verification pass costs on the model's layers
// (docs/speculative.md). Where the CPU's layer matrices are repacked (ggml's interleaved layouts, e.g.
// Q4_0 or Q8_0 on AVX2), its matmul takes rows in groups of 4: a pass of 4 tokens costs about what a pass
// of 2 does (1.74 vs 1.78 single passes on the 7B-shaped Q4_0 file), so three draft tokens come at the price
// of one. Elsewhere the smallest tree, one draft token: with F16 an extra token costs about 0.65 of a plain step
// on SmolLM2-135M; in this runtime's eight-row layouts (Q4_0, Q4_1, the K-quants under the kernels) a pass of 2
// costs 1.0-1.2 single passes and one of 4 1.2-1.7, and the shipped head's second level is accepted too rarely to
// pay for them (greedy, 6 MT-Bench prompts, 2026-11-29: one draft token 1.10x plain, 1.49 tokens a step; a chain of
// two 0.92x, 2/2 0.85x, 5/3/2 0.68x on Q4_1; on Q4_0 one 0.92x, three 0.68x).
static const char * const CHOICES_ONE   = "[[0]]";
static const char * const CHOICES_THREE = "[[0], [1], [0, 0]]";

static specee_eagle_params resolve_eagle(const specee_model & m, const specee_eagle_params & p) {
    const bool          three = m.cpu_layers_batched;
    specee_eagle_params r     = p;
    if (!p.choices[0]) {
        snprintf(r.choices, sizeof(r.choices), "%s", three ? CHOICES_THREE : CHOICES_ONE);
    }
    r.total_tokens            = p.total_tokens > 0 ? p.total_tokens : three ? 3 : 1;
    r.depth                   = p.depth > 0 ? p.depth : three ? 2 : 1;
    r.topk                    = p.topk > 0 ? p.topk : three ? 2 : 1;
    return r;
}

// ---- what `auto` picks

// The acceptance assumed for a head whose file does not give its own (specee.eagle.acceptance): about what EAGLE's
// published 7B heads accept per position (docs/speculative.md).
static const double ACCEPTANCE_UNKNOWN = 0.7;

// The estimate EAGLE-2 must reach for `auto` to take it: it leaves out what a verification step costs beyond a timed
// pass of its size (the tree's mask and the rows kept, the head's pairs) and the timing's noise: on SmolLM2 Q4_1 with
// the shipped head (issue 45, 2026-11-29) it said 1.00x where bench.modes measured 0.91x, and two contexts timed a
// pass of 2 at 1.14 and 1.56
static const double EAGLE_TAKEN_FROM = 1.1;

// EAGLE-2 with its default tree: the expected tokens per step (1 + a + ... + a^depth, a chain's, for the head's
// acceptance a) over a step's cost (one verification pass of the tree, timed here once, and a draft per level).
// Returns the expected speedup over plain decoding, NAN when the pass could not be timed; says why in `why`.
static double eagle_speedup(specee_context & ctx, std::string & why) {
    const specee_model &      m    = *ctx.model;
    const specee_eagle_params tree = resolve_eagle(m, specee_eagle_params{});
    const double              a    = m.eagle.acceptance >= 0.0f ? m.eagle.acceptance : ACCEPTANCE_UNKNOWN;
    const double              pass = specee_context_pass_cost(ctx, tree.total_tokens + 1);
    const double              draft = specee_drafter_head_cost(m);
    double                    tokens = 1.0, ak = 1.0;
    for (int32_t k = 0; k < tree.depth; ++k) {
        ak *= a;
        tokens += ak;
    }
    const double speedup = tokens / (pass + tree.depth * draft);
    why = specee_format("the draft head's acceptance %.2f (%s) makes EAGLE-2's default tree (%d draft token%s) "
                        "%.2f tokens per step for %.2f single-token passes here (a pass of %d tokens costs %.2f, a "
                        "draft %.2f): %.2fx plain", a, m.eagle.acceptance >= 0.0f ? "its file's" : "assumed: the file "
                        "gives none", tree.total_tokens, tree.total_tokens == 1 ? "" : "s", tokens,
                        pass + tree.depth * draft, tree.total_tokens + 1, pass, draft, speedup);
    why += specee_format(", taken from %.2fx", EAGLE_TAKEN_FROM);
    return speedup;
}

// settings of a mode the caller gave: EAGLE-2's tree; early exit's, n-gram lookup's and a draft model's are the rows
// of their group in the options table that differ from the defaults
static bool eagle2_tree_given(const specee_generator_params & p) {
    return p.eagle.total_tokens > 0 || p.eagle.depth > 0 || p.eagle.topk > 0;
}

// a setting as the options table writes it (a number outside its row's range reads as the default's mark does:
// exit.threshold -1 or -0.5)
static std::string option_text(const specee_generator_params & p, const char * name) {
    const int32_t n = -specee_generator_params_get(&p, name, nullptr, 0); // the length with its NUL
    std::string   s(n, '\0');
    specee_generator_params_get(&p, name, s.data(), n);
    s.resize(n - 1);
    return s;
}

// whether p gives a setting of a group of the table's rows ("exit."): one whose text differs from the default's
static bool settings_given(const specee_generator_params & p, const char * group) {
    static const specee_generator_params d = specee_generator_default_params();
    for (int32_t i = 0; const specee_option * o = specee_generator_option(i); ++i) {
        if (strncmp(o->name, group, strlen(group)) == 0 && option_text(p, o->name) != option_text(d, o->name)) {
            return true;
        }
    }
    return false;
}

static bool exit_settings_given(const specee_generator_params & p) {
    return settings_given(p, "exit.");
}

static bool draft_settings_given(const specee_generator_params & p) {
    return settings_given(p, "draft.");
}

static bool ngram_settings_given(const specee_generator_params & p) {
    return settings_given(p, "ngram.");
}

// auto: plain decoding under a grammar with jump-forward (it batches what the grammar forces; drafting on top measured
// slower), early exit for a draft head with exit predictors at temperature 0 (SpecEE's merged files), EAGLE-2 for a
// draft head that can beat plain decoding here, n-gram lookup otherwise: early exit unless its predictors' file says
// they cannot (specee.exit.speedup < 1), EAGLE-2 where eagle_speedup says >= 1. Lookup in place of plain decoding,
// as it never loses by more than its bookkeeping: it drafts only where its acceptance observed on the sequence and
// this machine's pass cost say a draft pays (specee-lookup.h), else its step is a plain step. Settings for a mode (a
// tree, exit settings, n-gram settings) choose it as before.
static int32_t resolve_auto(specee_context & ctx, const specee_generator_params & p, std::string & why) {
    const specee_model & m        = *ctx.model;
    const bool           has_head = m.eagle.version > 0;
    const bool           dyn_set  = eagle2_tree_given(p);
    const bool           exit_set = exit_settings_given(p);
    const char *         lookup   = "auto: ngram: drafts from lookup where its acceptance and the pass cost pay, "
                                    "else plain steps";
    if (ngram_settings_given(p)) {
        return SPECEE_MODE_NGRAM;
    }
    if (m.draft || draft_settings_given(p)) {
        return SPECEE_MODE_DRAFT; // a draft model was loaded to draft (as llama.cpp's -md); settings without one: refused
    }
    if (p.grammar && p.grammar_type != SPECEE_GRAMMAR_NONE && p.jump_forward && !exit_set && !p.eagle.choices[0] &&
        !dyn_set) {
        // measured (bench.grammar --modes, issue 48): jump-forward leaves the drafters little to add, and their steps
        // cost more: eagle2 and ngram with it ran 0.86-0.99x plain decoding with it on three schemas
        why = "auto: plain: under a grammar jump-forward verifies the tokens it forces in one pass; drafting on top of it "
              "measured slower (docs/structured-output.md)";
        return SPECEE_MODE_PLAIN;
    }
    if (!has_head) {
        why = specee_format("%s (no draft head)", lookup);
        return SPECEE_MODE_NGRAM;
    }
    if (m.exit.n_pred > 0 && p.sampling.temp <= 0.0f) {
        if (exit_set || m.exit.speedup < 0.0f || m.exit.speedup >= 1.0f) {
            return SPECEE_MODE_EARLY_EXIT; // SpecEE's behaviour for its merged files
        }
        why = specee_format("not early exit: its predictors expect %.2fx plain (specee.exit.speedup); ",
                            m.exit.speedup);
    }
    if (p.eagle.choices[0] || dyn_set) {
        const int32_t mode = p.eagle.choices[0] && !dyn_set ? SPECEE_MODE_EAGLE : SPECEE_MODE_EAGLE2;
        why = why.empty() ? "" : specee_format("auto: %s: %sa tree is given", specee_mode_name(mode), why.c_str());
        return mode;
    }
    std::string  eagle;
    const double speedup = eagle_speedup(ctx, eagle);
    const bool   spec    = !(speedup < EAGLE_TAKEN_FROM); // NAN (no room to time a pass): as before
    why = spec ? specee_format("auto: eagle2: %s%s", why.c_str(), eagle.c_str())
               : specee_format("%s (not eagle2: %s%s)", lookup, why.c_str(), eagle.c_str());
    return spec ? SPECEE_MODE_EAGLE2 : SPECEE_MODE_NGRAM;
}

static int32_t resolve_mode(specee_context & ctx, const specee_generator_params & p, std::string & why) {
    why.clear();
    return p.mode == SPECEE_MODE_AUTO ? resolve_auto(ctx, p, why) : p.mode;
}

// settings that the chosen mode would ignore are errors, so a typo in a command line does not go unnoticed
static void check_params(const specee_model & m, const specee_generator_params & p, int32_t mode) {
    specee_generator_check_values(p);
    const specee_mode_info & mi       = specee_mode_row_impl(mode);
    const bool               dyn_set  = eagle2_tree_given(p);
    const bool               exit_set = exit_settings_given(p);
    if (mi.needs_head && m.eagle.version <= 0) {
        specee_fail("mode %s needs an EAGLE draft head: the model has none (merge one with python -m specee.convert "
                    "merge, or load one with --draft-head / Model(draft_head=...))", mi.name);
    }
    if (mi.greedy_only && p.sampling.temp > 0.0f) {
        specee_fail("%s", mi.greedy_only);
    }
    const uint32_t both = SPECEE_READS_EAGLE1_TREE | SPECEE_READS_EAGLE2_TREE;
    if ((mi.reads & both) == both && p.eagle.choices[0] && dyn_set) {
        specee_fail("%s takes one tree: eagle choices (EAGLE-1) or eagle total_tokens, depth and topk (EAGLE-2), not "
                    "both", mi.name);
    }
    if (p.eagle.choices[0] && !(mi.reads & SPECEE_READS_EAGLE1_TREE)) {
        specee_fail("eagle choices set the EAGLE-1 tree, but the mode is %s (use mode eagle)", mi.name);
    }
    if (dyn_set && !(mi.reads & SPECEE_READS_EAGLE2_TREE)) {
        specee_fail("eagle total_tokens, depth and topk set the EAGLE-2 tree, but the mode is %s (use mode eagle2)",
                    mi.name);
    }
    if (p.exit.check && p.exit.kv != SPECEE_EXIT_KV_MASK) {
        specee_fail("checked exits run an exited token's skipped layers with the next pass, so they hold its real K/V: "
                    "exit kv (fill) does not apply with exit check");
    }
    if (p.ngram.n_min > p.ngram.n_max) {
        specee_fail("n-gram lookup: n_min (%d) must be at most n_max (%d)", p.ngram.n_min, p.ngram.n_max);
    }
    if (p.grammar && p.grammar_type == SPECEE_GRAMMAR_NONE) {
        specee_fail("a grammar's text without its type (grammar_type)");
    }
    if (!p.grammar && p.grammar_type != SPECEE_GRAMMAR_NONE) {
        specee_fail("grammar_type %s without a grammar (--grammar, --grammar-file, --json-schema or --json-schema-file; "
                    "Python: grammar= or json_schema=)", specee_grammar_type_name(p.grammar_type));
    }
    if (p.grammar && (mi.exits && (mi.tree || p.exit.check))) {
        specee_fail("a grammar does not go with %s: its rejected steps take tokens back that the grammar has "
                    "advanced over (use early-exit without exit check, eagle2, ngram or plain)",
                    mi.tree ? "tree exit" : "checked exits (exit check)");
    }
    if ((mi.reads & SPECEE_READS_DRAFT) && !m.draft) {
        specee_fail("mode %s needs a draft model: load one with -md FILE (Python: Model(draft_model=...))", mi.name);
    }
    if (p.draft.n_min > p.draft.n_max) {
        specee_fail("draft model: min (%d) must be at most max (%d)", p.draft.n_min, p.draft.n_max);
    }
    if (p.draft.n_synth_rates > 0 && p.draft.n_synth_rates != p.draft.n_max) {
        specee_fail("draft synth_rates: one rate per drafted token: %d rates for draft max %d", p.draft.n_synth_rates,
                    p.draft.n_max);
    }
    if (draft_settings_given(p) && !(mi.reads & SPECEE_READS_DRAFT)) {
        specee_fail("draft model settings are given, but the mode is %s (use mode draft)", mi.name);
    }
    if (ngram_settings_given(p) && !(mi.reads & SPECEE_READS_NGRAM)) {
        specee_fail("n-gram settings are given, but the mode is %s (use mode ngram)", mi.name);
    }
    if (exit_set && !(mi.reads & SPECEE_READS_EXIT)) {
        specee_fail("exit settings are given, but the mode is %s (early exit: mode early-exit or tree-exit, or auto "
                    "with a draft head and exit predictors at temperature 0)", mi.name);
    }
}

void specee_generator_set_params_impl(specee_generator & g, const specee_generator_params & params) {
    specee_seq_scope              seq(g); // auto may time a pass, on the generator's sequence
    const specee_model &          m    = *g.ctx->model;
    std::string                   why;
    const int32_t                 mode = resolve_mode(*g.ctx, params, why);
    check_params(m, params, mode);
    const specee_generator_params & p = params;

    std::unique_ptr<specee_sampler, void (*)(specee_sampler *)> smpl(specee_sampler_init_impl(p.sampling),
                                                                     specee_sampler_free);
    if (p.ignore_eos) {
        std::vector<int32_t> eog(specee_token_eog_ids(&m, nullptr, 0));
        specee_token_eog_ids(&m, eog.data(), (int32_t) eog.size());
        for (int32_t t : eog) {
            specee_sampler_set_logit_bias_impl(*smpl, t, -INFINITY);
        }
    }
    for (const auto & [token, bias] : specee_parse_logit_bias(p.logit_bias)) {
        if (token >= (int32_t) m.hparams.n_vocab) {
            specee_fail("logit_bias: token %d is not in the vocabulary (%d tokens)", token, (int32_t) m.hparams.n_vocab);
        }
        specee_sampler_set_logit_bias_impl(*smpl, token, bias);
    }
    // the grammar: the sampler's own, kept (with its state) when the text is the same
    if (p.grammar) {
        specee_grammar * old = g.smpl ? specee_sampler_grammar(*g.smpl) : nullptr;
        if (old && specee_grammar_type_of(*old) == p.grammar_type && specee_grammar_text(*old) == p.grammar) {
            specee_sampler_set_grammar(*smpl, specee_sampler_take_grammar(*g.smpl));
        } else {
            specee_sampler_set_grammar(*smpl, specee_grammar_init_impl(m, p.grammar_type, p.grammar));
        }
        specee_grammar_set_overlap(*specee_sampler_grammar(*smpl), p.grammar_overlap);
    }
    specee_tree_decoder      tree;
    specee_exit_decoder      exit;
    const specee_mode_info & mi = specee_mode_row_impl(mode);
    if (mi.tree) {
        // a mode that reads both trees (tree exit): EAGLE-2's dynamic tree unless choices give EAGLE-1's
        const bool dynamic = (mi.reads & SPECEE_READS_EAGLE2_TREE) &&
                             !((mi.reads & SPECEE_READS_EAGLE1_TREE) && p.eagle.choices[0]);
        specee_tree_init(tree, dynamic, resolve_eagle(m, p.eagle));
        if (tree.max_nodes + 1 > (int32_t) g.ctx->cparams.n_batch) {
            specee_fail("the draft tree has %d tokens, more than fit in one verification batch (n_batch = %u, root "
                        "included)", tree.max_nodes, g.ctx->cparams.n_batch);
        }
    }
    if (mi.reads & SPECEE_READS_DRAFT) {
        const std::string synth = specee_draft_init(tree, g.draft, p, specee_sampler_seed(*smpl));
        why += std::string(why.empty() || synth.empty() ? "" : "\n") + synth;
        g.started = g.started && g.mode == mode; // the draft model's sequence is made by start
    }
    if (mi.exits && !mi.tree) {
        specee_exit_init(exit, m, p.exit);
    }
    if (mi.exits && mi.tree) {
        specee_tree_exit_init(tree, exit, m, p.exit);
    }
    const bool same_lookup = g.mode == mode && memcmp(&g.params.ngram, &p.ngram, sizeof(p.ngram)) == 0;
    if ((mi.reads & SPECEE_READS_NGRAM) && !same_lookup) {
        specee_lookup_init(g.lookup, p.ngram, *g.ctx);
        g.started = false; // the lookup's index is made by start
    }
    if (mi.reads & SPECEE_READS_NGRAM) {
        why += std::string(why.empty() ? "" : "\n") + specee_lookup_describe(g.lookup);
    }
    if ((mi.reads & SPECEE_READS_NGRAM) && mi.needs_head) { // lookup beside the head: hybrid trees
        why += "\n" + specee_hybrid_describe(g.lookup);
    }
    if (mi.tree && p.eagle.n_replay > 0) {
        why += std::string(why.empty() ? "" : "\n") +
               "eagle: replayed acceptance (--eagle-replay): each step accepts the given number of drafted tokens "
               "whatever the model says; the output text is meaningless (cost benchmarks only)";
    }
    // the draft head: kept when its cache is large enough for the tree, so its pairs stay
    if (mi.needs_head) {
        const uint32_t extra = (uint32_t) tree.max_expand;
        if (!g.head || g.head->kv.size < g.ctx->cparams.n_ctx + extra + 1) {
            auto h = std::make_unique<specee_draft_head>();
            specee_draft_head_init(*h, *g.ctx, extra);
            g.head = std::move(h);
            g.started = false; // a new head has no pairs: start again
        }
        if (!specee_mode_row_impl(g.mode).needs_head) {
            g.started = false; // decoding without the head formed no pairs: start again
        }
    }
    if (g.smpl) {
        specee_sampler_copy_history(*smpl, *g.smpl); // a generation in progress goes on with the new settings
    }
    g.params = p;
    // the text lives with the sampler's grammar (the caller's is only borrowed)
    g.params.grammar      = specee_sampler_grammar(*smpl) ? specee_grammar_text(*specee_sampler_grammar(*smpl)).c_str() : nullptr;
    g.params.grammar_type = g.params.grammar ? p.grammar_type : SPECEE_GRAMMAR_NONE;
    g.mode   = mode;
    g.why    = why;
    g.smpl   = std::move(smpl);
    g.tree   = std::move(tree);
    g.exit   = std::move(exit);
}

// ---- the loop -----------------------------------------------------------------------------------------

int32_t specee_generator_start_impl(specee_generator & g, const int32_t * tokens, int32_t n) {
    specee_context &     ctx     = *g.ctx;
    const specee_model & m       = *ctx.model;
    const int32_t        n_vocab = (int32_t) m.hparams.n_vocab;
    if (!tokens || n <= 0) {
        specee_fail("empty prompt: nothing to generate from");
    }
    if (n >= (int32_t) ctx.cparams.n_ctx) {
        specee_fail("the prompt has %d tokens, which does not fit the context of %u (one more cell is needed to "
                    "decode)", n, ctx.cparams.n_ctx);
    }
    for (int32_t i = 0; i < n; ++i) {
        if (tokens[i] < 0 || tokens[i] >= n_vocab) {
            specee_fail("token id %d at index %d is out of range [0, %d)", tokens[i], i, n_vocab);
        }
    }
    const auto t0 = specee_clock::now();

    // Keep the cached prefix, and evaluate at least the last two tokens: a batch of one token can take other
    // kernels than a batch of several (F16 matrix products do), so a one-token tail would not give the logits a
    // fresh run gives; from two tokens on the rows agree bit for bit (measured on F16, Q8_0, Q4_0, Q4_1). With a
    // draft head, only as far as its pairs agree (the pair at e - 1 needs the feature of position e - 1, which is
    // not kept).
    int32_t e = std::min(specee_cached_prefix(ctx.kv, tokens, n), std::max(n - 2, 0));
    const bool pairs = g.head && specee_mode_row_impl(g.mode).needs_head;
    if (pairs) {
        e = std::min(e, specee_draft_matching_prefix(*g.head, tokens, n));
    }
    ctx.kv.remove(e, -1);
    if (g.head) {
        specee_draft_truncate(*g.head, e);
    }
    g.started = false;
    g.queue.clear();
    g.exit.chain.pending.clear(); // a checked chain of the last generation is gone with its cells

    specee_batch b = {n - e, tokens + e, nullptr, nullptr, nullptr};
    specee_eval_impl(ctx, &b);

    specee_sampler & smpl = *g.smpl;
    specee_sampler_reset_impl(smpl);
    for (int32_t i = 0; i < n; ++i) {
        specee_sampler_accept_impl(smpl, tokens[i]);
    }
    const int32_t t = specee_sampler_sample_impl(smpl, ctx.logits.data() + (size_t) (ctx.n_outputs - 1) * n_vocab,
                                                 n_vocab);
    specee_sampler_accept_impl(smpl, t);
    if (pairs) {
        for (int32_t i = e; i < n; ++i) {
            specee_draft_add_pair(*g.head, specee_context_feature(ctx, i - e), i + 1 < n ? tokens[i + 1] : t, i);
        }
    }
    if (specee_mode_row_impl(g.mode).reads & SPECEE_READS_NGRAM) {
        specee_lookup_reset(g.lookup, tokens, n, t);
    }
    if (specee_mode_row_impl(g.mode).reads & SPECEE_READS_DRAFT) {
        specee_draft_seq_reset(g.draft, tokens, n, t);
        g.tree.synth_rng.seed(specee_sampler_seed(smpl));
    }
    g.root     = t;
    g.root_pos = n;
    g.queue    = {{t, (int32_t) m.hparams.n_layer}};
    g.started  = true;
    g.stats.n_prompt += n - e;
    g.stats.n_reused += e;
    g.stats.t_prompt_ms += specee_ms_since(t0);
    return e;
}

// Jump-forward: where the grammar allows one continuation only (a key, a quote, a closing brace), its tokens go as a
// chain of drafts into the root's pass (in plain decoding and in every drafter's mode, as that step's tree), and the walk draws the target's token at each row as a plain step would
// (specee_tree_walk: a drafted token is emitted only where the masked draw gives it, so greedy output is plain
// decoding's under the grammar and sampling keeps its distribution), in one pass instead of one each.
std::vector<int32_t> specee_jump_forward_tokens(specee_generator & g, int32_t budget) {
    specee_grammar * gr = specee_sampler_grammar(*g.smpl);
    if (!g.params.jump_forward || !gr || budget <= 0) {
        return {};
    }
    const auto                 t0     = specee_clock::now();
    const std::vector<int32_t> forced = specee_grammar_forced(*gr, std::min(budget, JUMP_MAX));
    g.stats.t_draft_ms += specee_ms_since(t0);
    return forced;
}

std::vector<int32_t> specee_jump_forward_draft(specee_generator & g, int32_t budget) {
    const std::vector<int32_t> forced = specee_jump_forward_tokens(g, budget);
    return forced.empty() ? forced : specee_tree_chain(g.tree, g.root, forced);
}

int32_t specee_jump_forward_finish(specee_generator & g, int32_t n_rows, const float * logits, int32_t row0,
                                   int32_t n_max, int32_t * out) {
    specee_context &      ctx  = *g.ctx;
    specee_tree_decoder & dec  = g.tree;
    const auto            t0   = specee_clock::now();
    specee_step           step = {ctx, nullptr, *g.smpl, g.root, g.root_pos, g.stats}; // no head: plain decoding
    std::vector<int32_t>  emitted, path;
    specee_tree_pass_rows rows  = {&dec, logits, (int32_t) ctx.model->hparams.n_vocab};
    const int32_t         n_acc = specee_tree_walk(dec, step, n_max, specee_tree_pass_logits, &rows, emitted, path);
    specee_tree_keep(dec, step, n_rows, emitted, path, nullptr, row0);
    g.root = emitted.back();
    g.root_pos += (int32_t) emitted.size();
    g.stats.t_sample_ms += specee_ms_since(t0);
    g.stats.n_steps += 1;
    g.stats.n_drafted += n_rows - 1;
    g.stats.n_accepted += n_acc;
    std::copy(emitted.begin(), emitted.end(), out);
    return (int32_t) emitted.size();
}

// one jump-forward step alone: returns the tokens emitted, 0 when the grammar forces nothing here (a plain step then)
static int32_t jump_forward_step(specee_generator & g, int32_t * out, int32_t n_max) {
    specee_context &           ctx    = *g.ctx;
    const int32_t              n_free = (int32_t) ctx.cparams.n_ctx - (int32_t) ctx.kv.used;
    const int32_t              budget = std::min({n_free - 1, (int32_t) ctx.cparams.n_batch - 1, n_max - 1});
    const std::vector<int32_t> nodes  = specee_jump_forward_draft(g, budget);
    if (nodes.empty()) {
        return 0;
    }
    const auto              t0 = specee_clock::now();
    const specee_tree_batch tb = specee_tree_verify_batch(g.tree, g.root, g.root_pos, nodes);
    const specee_batch      b  = tb.view();
    specee_sampler_prefetch(*g.smpl); // the root row's mask, while the pass runs
    specee_eval_layers_impl(ctx, &b, 0, (int32_t) ctx.model->hparams.n_layer, 0);
    g.stats.t_verify_ms += specee_ms_since(t0);
    return specee_jump_forward_finish(g, b.n_tokens, ctx.logits.data(), 0, n_max, out);
}

const specee_drafter * specee_generator_drafter(const specee_generator & g) {
    switch (g.mode) {
        case SPECEE_MODE_EAGLE:
        case SPECEE_MODE_EAGLE2: return &specee_drafter_eagle;
        case SPECEE_MODE_NGRAM: return &specee_drafter_lookup;
        case SPECEE_MODE_NGRAM_EAGLE2: return &specee_drafter_hybrid;
        case SPECEE_MODE_DRAFT: return &specee_drafter_draft;
        default: return nullptr;
    }
}

int32_t specee_generator_next_impl(specee_generator & g, int32_t * out, int32_t * layers_run, int32_t n_max) {
    specee_context &     ctx     = *g.ctx;
    const specee_model & m       = *ctx.model;
    const int32_t        n_layer = (int32_t) m.hparams.n_layer;
    if (!g.started) {
        specee_fail("specee_generator_next: call specee_generator_start first");
    }
    if (!out || n_max <= 0) {
        specee_fail("specee_generator_next: no room for tokens (n_max = %d)", n_max);
    }
    if (!g.queue.empty()) {
        const int32_t n = std::min(n_max, (int32_t) g.queue.size());
        for (int32_t i = 0; i < n; ++i) {
            out[i] = g.queue[i].first;
            if (layers_run) {
                layers_run[i] = g.queue[i].second;
            }
        }
        g.queue.erase(g.queue.begin(), g.queue.begin() + n);
        g.stats.n_tokens += n;
        return n;
    }
    if ((int64_t) ctx.kv.pos_max() + 1 != g.root_pos) {
        specee_fail("the KV cache was changed since this generation started (start again)");
    }
    const auto               t0 = specee_clock::now();
    const double             m0 = specee_sampler_mask_ms(*g.smpl);
    const specee_mode_info & mi = specee_mode_row_impl(g.mode);
    if (mi.exits && g.params.exit.check) {
        // checked exits: steps until a chain is checked (a pass that runs every layer, or a full context)
        std::vector<std::pair<int32_t, int32_t>> done;
        while (done.empty()) {
            if (ctx.kv.used >= ctx.cparams.n_ctx) {
                if (g.exit.chain.pending.empty()) {
                    return 0; // context full
                }
                specee_exit_chain_flush(g.exit.chain, specee_generator_step(g), done);
            } else if (mi.tree) {
                specee_tree_exit_step_checked(g.tree, g.exit, specee_generator_step(g), n_max, done);
            } else {
                specee_exit_step_checked(g.exit, specee_generator_step(g), done);
            }
        }
        g.stats.t_decode_ms += specee_ms_since(t0);
        g.stats.n_decoded += (int32_t) done.size(); // n_tokens counts them as the queue returns them
        g.queue = std::move(done);
        return specee_generator_next_impl(g, out, layers_run, n_max);
    }
    if (ctx.kv.used >= ctx.cparams.n_ctx) {
        return 0; // context full
    }
    int32_t n   = 1;
    int32_t run = n_layer; // the layers each emitted token's pass ran
    switch (g.mode) {
        case SPECEE_MODE_PLAIN: {
            const int32_t n_jump = jump_forward_step(g, out, n_max);
            if (n_jump > 0) {
                n = n_jump;
                break;
            }
            specee_batch b = {1, &g.root, &g.root_pos, nullptr, nullptr};
            specee_sampler_prefetch(*g.smpl); // the next position's mask, while the pass runs
            specee_eval_layers_impl(ctx, &b, 0, n_layer, 0);
            const auto ts = specee_clock::now();
            out[0]        = specee_sampler_sample_impl(*g.smpl, ctx.logits.data(), (int32_t) m.hparams.n_vocab);
            specee_sampler_accept_impl(*g.smpl, out[0]);
            g.stats.t_sample_ms += specee_ms_since(ts);
            g.root = out[0];
            g.root_pos += 1;
            g.stats.n_steps += 1;
            break;
        }
        case SPECEE_MODE_EAGLE:
        case SPECEE_MODE_EAGLE2:
        case SPECEE_MODE_NGRAM:
        case SPECEE_MODE_NGRAM_EAGLE2:
        case SPECEE_MODE_DRAFT:
            // the tokens the grammar forces next go to the drafter's step, which verifies them as its tree where
            // its own drafts reach no further (jump-forward in the speculative modes)
            n = specee_drafter_step(*specee_generator_drafter(g), {g.tree, g.lookup, g.draft},
                                    specee_generator_step(g), out, n_max, specee_jump_forward_tokens(g, n_max - 1));
            break;
        case SPECEE_MODE_TREE_EXIT:
            n = specee_tree_exit_step(g.tree, g.exit, specee_generator_step(g), out, n_max, run);
            break;
        case SPECEE_MODE_EARLY_EXIT: out[0] = specee_exit_step(g.exit, specee_generator_step(g), run); break;
    }
    for (int32_t i = 0; layers_run && i < n; ++i) {
        layers_run[i] = run;
    }
    g.stats.t_mask_ms += specee_sampler_mask_ms(*g.smpl) - m0;
    g.stats.t_decode_ms += specee_ms_since(t0);
    g.stats.n_tokens += n;
    g.stats.n_decoded += n;
    return n;
}

// ---- C API -------------------------------------------------------------------------------------------

extern "C" struct specee_generator_params specee_generator_default_params(void) {
    specee_generator_params p{};
    p.sampling          = specee_sampler_default_params();
    p.ignore_eos        = false;
    p.mode              = SPECEE_MODE_AUTO;
    p.exit.threshold    = -1.0f;
    p.exit.dynamic      = true;
    p.exit.kv           = SPECEE_EXIT_KV_MASK;
    p.ngram.n_min       = 2;
    p.ngram.n_max       = 4;
    p.ngram.draft_max   = 8;
    p.ngram.branches    = 1;
    p.ngram.adaptive    = true;
    p.draft.n_max       = 3;
    p.draft.n_min       = 0;
    p.draft.p_min       = 0.0f;
    p.grammar_type      = SPECEE_GRAMMAR_NONE;
    p.grammar           = nullptr;
    p.jump_forward      = true;
    p.grammar_overlap   = true;
    return p;
}

extern "C" specee_generator * specee_generator_init(specee_context * ctx, struct specee_generator_params params) {
    if (!ctx) {
        specee_set_error("no context");
        return nullptr;
    }
    std::lock_guard<std::recursive_mutex> lock(ctx->mutex);
    return specee_guard<specee_generator *>(nullptr, [&] {
        auto g = std::make_unique<specee_generator>();
        g->ctx = ctx;
        specee_generator_set_params_impl(*g, params);
        return g.release();
    });
}

extern "C" int32_t specee_generator_set_params(specee_generator * gen, struct specee_generator_params params) {
    std::lock_guard<std::recursive_mutex> lock(gen->ctx->mutex);
    return specee_guard<int32_t>(-1, [&] {
        specee_generator_set_params_impl(*gen, params);
        return 0;
    });
}

extern "C" void specee_generator_free(specee_generator * gen) { delete gen; }

extern "C" int32_t specee_generator_mode(const specee_generator * gen) { return gen->mode; }

extern "C" const char * specee_generator_why(const specee_generator * gen) { return gen->why.c_str(); }

extern "C" uint32_t specee_generator_seed(const specee_generator * gen) { return specee_sampler_seed(*gen->smpl); }

extern "C" int32_t specee_generator_start(specee_generator * gen, const int32_t * tokens, int32_t n_tokens) {
    std::lock_guard<std::recursive_mutex> lock(gen->ctx->mutex);
    return specee_guard<int32_t>(-1, [&] {
        specee_seq_scope seq(*gen);
        specee_ngram_cache_doc_end(gen->ctx->ngram_cache, gen->doc); // the request before joins the cache
        const int32_t e = specee_generator_start_impl(*gen, tokens, n_tokens);
        specee_ngram_cache_doc_begin(gen->ctx->ngram_cache, gen->doc, tokens, n_tokens);
        return e;
    });
}

extern "C" int32_t specee_generator_next(specee_generator * gen, int32_t * tokens, int32_t * layers_run, int32_t n_max) {
    std::lock_guard<std::recursive_mutex> lock(gen->ctx->mutex);
    return specee_guard<int32_t>(-1, [&] {
        specee_seq_scope seq(*gen);
        const int32_t    n = specee_generator_next_impl(*gen, tokens, layers_run, n_max);
        specee_ngram_cache_doc_append(gen->doc, tokens, n);
        return n;
    });
}

extern "C" struct specee_generator_stats specee_generator_get_stats(const specee_generator * gen) {
    specee_generator_stats st = gen->stats;
    specee_generator_stats_derive(st, gen->mode);
    return st;
}

extern "C" void specee_generator_reset_stats(specee_generator * gen) { gen->stats = specee_generator_stats{}; }

// ---- context shift -------------------------------------------------------------------------------------

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
