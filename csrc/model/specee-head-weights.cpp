// specee-head-weights.cpp: reading the EAGLE draft head (eagle.*, specee.eagle.*) and SpecEE's exit predictors
// (blk.N.pred.*, specee.exit.*) from a GGUF, with their shapes checked against the base model: from the model's own
// file, or from a draft head file (`python -m specee.convert merge --draft-head-only`) that replaces them.
#include "specee-head-weights.h"

#include "specee-arch.h"
#include "specee-gguf.h"
#include "specee-impl.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

bool specee_has_eagle_tensors(ggml_context * cm) {
    for (ggml_tensor * t = ggml_get_first_tensor(cm); t; t = ggml_get_next_tensor(cm, t)) {
        if (strncmp(ggml_get_name(t), "eagle.", 6) == 0) {
            return true;
        }
    }
    return false;
}

static bool has_pred_tensors(ggml_context * cm) {
    for (ggml_tensor * t = ggml_get_first_tensor(cm); t; t = ggml_get_next_tensor(cm, t)) {
        if (strstr(ggml_get_name(t), ".pred.")) {
            return true;
        }
    }
    return false;
}

// ---- the EAGLE head ------------------------------------------------------------------------------

// the head's tensors (its feed-forward size from the file), shapes checked; throws naming the misfit. EAGLE-3's
// attention reads 2 n_embd inputs and its fc fuses 3 n_embd; it has its own norms and lm_head and no fc bias.
static void read_eagle_tensors(specee_eagle & e, const specee_hparams & hp, ggml_context * cm, const gguf_context * g,
                               const std::string & path) {
    const bool    v3     = e.version == 3;
    const int64_t n_embd = hp.n_embd;
    const int64_t n_in   = v3 ? 2 * n_embd : n_embd; // the attention's input width
    const int64_t n_q    = (int64_t) hp.n_embd_head_k * hp.n_head;
    const int64_t n_out  = (int64_t) hp.n_embd_head_v * hp.n_head;
    ggml_tensor * gate   = ggml_get_tensor(cm, specee_tensor_name(SPECEE_TENSOR_EAGLE_FFN_GATE).c_str());
    e.n_ff               = gate ? (uint32_t) gate->ne[1] : 0;
    specee_gguf_get_int(g, SPECEE_KEY_EAGLE_FEED_FORWARD_LENGTH, e.n_ff, 1, SPECEE_MAX_FF, false);
    const int64_t n_ff = e.n_ff;

    auto tensor = [&](specee_tensor which, std::vector<int64_t> shape, bool required = true) {
        return specee_gguf_tensor(cm, path, which, -1, std::move(shape), required);
    };
    auto refuse = [&](specee_tensor which, const char * why) {
        if (ggml_get_tensor(cm, specee_tensor_name(which).c_str())) {
            specee_fail("'%s' %s", specee_tensor_name(which).c_str(), why);
        }
    };
    specee_layer & l = e.layer;
    e.tok_embd = tensor(SPECEE_TENSOR_EAGLE_TOKEN_EMBD, {n_embd, (int64_t) hp.n_vocab}, false);
    e.fc       = tensor(SPECEE_TENSOR_EAGLE_FC, {(v3 ? 3 : 2) * n_embd, n_embd});
    l.wq       = tensor(SPECEE_TENSOR_EAGLE_ATTN_Q, {n_in, n_q});
    l.wk       = tensor(SPECEE_TENSOR_EAGLE_ATTN_K, {n_in, (int64_t) hp.n_embd_k_gqa()});
    l.wv       = tensor(SPECEE_TENSOR_EAGLE_ATTN_V, {n_in, (int64_t) hp.n_embd_v_gqa()});
    l.wo       = tensor(SPECEE_TENSOR_EAGLE_ATTN_OUTPUT, {n_out, n_embd});
    l.ffn_norm = tensor(SPECEE_TENSOR_EAGLE_FFN_NORM, {n_embd});
    l.ffn_gate = tensor(SPECEE_TENSOR_EAGLE_FFN_GATE, {n_embd, n_ff});
    l.ffn_up   = tensor(SPECEE_TENSOR_EAGLE_FFN_UP, {n_embd, n_ff});
    l.ffn_down = tensor(SPECEE_TENSOR_EAGLE_FFN_DOWN, {n_ff, n_embd});
    ggml_tensor * out = ggml_get_tensor(cm, specee_tensor_name(SPECEE_TENSOR_EAGLE_OUTPUT).c_str());
    e.output          = tensor(SPECEE_TENSOR_EAGLE_OUTPUT, {n_embd, out ? out->ne[1] : 0}, v3);
    if (v3) {
        refuse(SPECEE_TENSOR_EAGLE_FC_BIAS, "is an EAGLE-1 tensor: an EAGLE-3 head's fc has no bias");
        l.attn_norm   = tensor(SPECEE_TENSOR_EAGLE_ATTN_NORM, {n_embd});
        e.hidden_norm = tensor(SPECEE_TENSOR_EAGLE_HIDDEN_NORM, {n_embd});
        e.output_norm = tensor(SPECEE_TENSOR_EAGLE_OUTPUT_NORM, {n_embd});
    } else {
        e.fc_b = tensor(SPECEE_TENSOR_EAGLE_FC_BIAS, {n_embd});
        for (specee_tensor t : {SPECEE_TENSOR_EAGLE_ATTN_NORM, SPECEE_TENSOR_EAGLE_HIDDEN_NORM,
                                SPECEE_TENSOR_EAGLE_OUTPUT_NORM}) {
            refuse(t, "is an EAGLE-3 tensor, but the head is EAGLE-1 (specee.eagle.version 1)");
        }
    }
}

// EAGLE-3: the three target layers whose outputs form the feature
static void read_feature_layers(specee_eagle & e, const specee_hparams & hp, const gguf_context * g,
                                const std::string & path) {
    const int64_t id = gguf_find_key(g, SPECEE_KEY_EAGLE_FEATURE_LAYERS);
    if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(g, id) != GGUF_TYPE_INT32 ||
        gguf_get_arr_n(g, id) != 3) {
        specee_fail("the EAGLE-3 head in %s has no %s (an int32 array of the 3 target layers whose outputs form "
                    "its feature)", path.c_str(), SPECEE_KEY_EAGLE_FEATURE_LAYERS);
    }
    const int32_t * v = (const int32_t *) gguf_get_arr_data(g, id);
    e.feature_layers.assign(v, v + 3);
    for (int32_t il : e.feature_layers) {
        if (il < 0 || il >= (int32_t) hp.n_layer) {
            specee_fail("the EAGLE-3 head in %s: %s lists layer %d but the model has layers 0..%u", path.c_str(),
                        SPECEE_KEY_EAGLE_FEATURE_LAYERS, il, hp.n_layer - 1);
        }
    }
}

// a reduced draft vocabulary: eagle.output's rows are the target tokens listed in draft_vocab
static void read_draft_vocab(specee_eagle & e, const specee_hparams & hp, const gguf_context * g,
                             const std::string & path) {
    const int64_t id = gguf_find_key(g, SPECEE_KEY_EAGLE_DRAFT_VOCAB);
    if (!e.output) {
        if (id >= 0) {
            specee_fail("the EAGLE head in %s has %s but no eagle.output.weight", path.c_str(),
                        SPECEE_KEY_EAGLE_DRAFT_VOCAB);
        }
        return;
    }
    if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY ||
        (gguf_get_arr_type(g, id) != GGUF_TYPE_INT32 && gguf_get_arr_type(g, id) != GGUF_TYPE_UINT32)) {
        specee_fail("the EAGLE head in %s has eagle.output.weight but no int32 array %s (its rows' target ids)",
                    path.c_str(), SPECEE_KEY_EAGLE_DRAFT_VOCAB);
    }
    const size_t    n   = gguf_get_arr_n(g, id);
    const int32_t * ids = (const int32_t *) gguf_get_arr_data(g, id);
    if ((int64_t) n != e.output->ne[1]) {
        specee_fail("the EAGLE head in %s: %s lists %zu tokens but eagle.output.weight has %lld rows", path.c_str(),
                    SPECEE_KEY_EAGLE_DRAFT_VOCAB, n, (long long) e.output->ne[1]);
    }
    e.draft_vocab.assign(ids, ids + n);
    for (int32_t t : e.draft_vocab) {
        if (t < 0 || t >= (int32_t) hp.n_vocab) {
            specee_fail("the EAGLE head in %s: %s holds token id %d outside the vocabulary [0, %u)", path.c_str(),
                        SPECEE_KEY_EAGLE_DRAFT_VOCAB, t, hp.n_vocab);
        }
    }
}

specee_eagle specee_read_eagle(const specee_hparams & hp, ggml_context * cm, const gguf_context * g,
                               const std::string & path) {
    specee_eagle e;
    e.source  = path;
    e.version = 1;
    specee_gguf_get_int(g, SPECEE_KEY_EAGLE_VERSION, e.version, 0, UINT32_MAX, false);
    if (e.version != 1 && e.version != 3) {
        specee_fail("the EAGLE head in %s is version %u; this runtime runs EAGLE-1 and EAGLE-3 heads (%s = 1 or 3)",
                    path.c_str(), e.version, SPECEE_KEY_EAGLE_VERSION);
    }
    try {
        read_eagle_tensors(e, hp, cm, g, path);
    } catch (const specee_error & err) {
        specee_fail("the EAGLE-%u head in %s does not fit the model (n_embd %u, %u heads / %u KV heads, vocab %u): %s",
                    e.version, path.c_str(), hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_vocab, err.what());
    }
    read_draft_vocab(e, hp, g, path);
    if (!specee_gguf_get_f32_in(g, SPECEE_KEY_EAGLE_ACCEPTANCE, e.acceptance, -1e-6f, 1.0f + 1e-6f)) {
        e.acceptance = -1.0f;
    }
    if (e.version == 3) {
        read_feature_layers(e, hp, g, path);
    }
    return e;
}

// ---- the exit predictors -------------------------------------------------------------------------

// each layer's predictor (the hidden size from its up matrix); a predictor beyond the layers is refused
static void read_predictors(specee_exit_cfg & x, const specee_hparams & hp, ggml_context * cm,
                            const std::string & path) {
    for (uint32_t il = 0; il < hp.n_layer; ++il) {
        specee_predictor &  p     = x.pred[il];
        const ggml_tensor * probe = ggml_get_tensor(cm, specee_tensor_name(SPECEE_TENSOR_PRED_UP, (int) il).c_str());
        if (!probe) {
            continue;
        }
        const int64_t n_hidden = probe->ne[1];
        p.up     = specee_gguf_tensor(cm, path, SPECEE_TENSOR_PRED_UP, il, {3 * (int64_t) x.n_cand, n_hidden});
        p.up_b   = specee_gguf_tensor(cm, path, SPECEE_TENSOR_PRED_UP_BIAS, il, {n_hidden});
        p.down   = specee_gguf_tensor(cm, path, SPECEE_TENSOR_PRED_DOWN, il, {n_hidden, 1});
        p.down_b = specee_gguf_tensor(cm, path, SPECEE_TENSOR_PRED_DOWN_BIAS, il, {1});
        x.n_pred += 1;
    }
    for (ggml_tensor * t = ggml_get_first_tensor(cm); t; t = ggml_get_next_tensor(cm, t)) {
        int il = -1;
        if (strstr(ggml_get_name(t), ".pred.") && sscanf(ggml_get_name(t), "blk.%d.", &il) == 1 &&
            (il < 0 || il >= (int) hp.n_layer)) {
            specee_fail("'%s' has an exit predictor for layer %d but the model has %u layers", path.c_str(), il,
                        hp.n_layer);
        }
    }
}

// specee.exit.layers and specee.exit.threshold, when the file has them
static void read_exit_settings(specee_exit_cfg & x, const specee_hparams & hp, const gguf_context * g,
                               const std::string & path) {
    const int64_t kid = gguf_find_key(g, SPECEE_KEY_EXIT_LAYERS);
    if (kid >= 0) {
        if (gguf_get_kv_type(g, kid) != GGUF_TYPE_ARRAY || gguf_get_arr_type(g, kid) != GGUF_TYPE_INT32) {
            specee_fail("%s in %s is not an int32 array", SPECEE_KEY_EXIT_LAYERS, path.c_str());
        }
        const auto * v = (const int32_t *) gguf_get_arr_data(g, kid);
        for (size_t i = 0; i < gguf_get_arr_n(g, kid); ++i) {
            if (v[i] < 0 || v[i] >= (int32_t) hp.n_layer || !x.pred[v[i]].up) {
                specee_fail("%s in %s lists layer %d, which has no predictor (blk.%d.pred.*)", SPECEE_KEY_EXIT_LAYERS,
                            path.c_str(), v[i], v[i]);
            }
            x.layers.push_back(v[i]);
        }
    }
    const int64_t tid = gguf_find_key(g, SPECEE_KEY_EXIT_THRESHOLD);
    if (tid >= 0) {
        if (gguf_get_kv_type(g, tid) != GGUF_TYPE_FLOAT32) {
            specee_fail("%s in %s is not a float32", SPECEE_KEY_EXIT_THRESHOLD, path.c_str());
        }
        x.threshold = gguf_get_val_f32(g, tid);
        if (!(x.threshold >= 0.0f && x.threshold <= 1.0f)) { // NaN fails too, as the CLI's --exit-threshold refuses it
            specee_fail("%s = %g in %s: expected a number in [0, 1]", SPECEE_KEY_EXIT_THRESHOLD, (double) x.threshold,
                        path.c_str());
        }
    }
    if (!specee_gguf_get_f32_in(g, SPECEE_KEY_EXIT_SPEEDUP, x.speedup, 0.0f, 1e3f)) {
        x.speedup = -1.0f;
    }
}

specee_exit_cfg specee_read_exit(const specee_hparams & hp, ggml_context * cm, const gguf_context * g,
                                 const std::string & path) {
    specee_exit_cfg x;
    x.pred.resize(hp.n_layer);
    uint32_t n_cand = 4;
    specee_gguf_get_int(g, SPECEE_KEY_EXIT_N_CANDIDATES, n_cand, 0, UINT32_MAX, false);
    if (n_cand < 1 || n_cand > 64) {
        specee_fail("%s = %u in %s: expected 1..64 candidates", SPECEE_KEY_EXIT_N_CANDIDATES, n_cand, path.c_str());
    }
    x.n_cand = n_cand;
    read_predictors(x, hp, cm, path);
    read_exit_settings(x, hp, g, path);
    return x;
}

// ---- a draft head file ---------------------------------------------------------------------------

static std::string n_layers_str(int32_t n) { return specee_format("%d layer%s", n, n == 1 ? "" : "s"); }

// What loading a draft head file replaces of the model's own, as one line ("" when nothing): its head always replaces
// the model's; its exit predictors replace the model's when the file has predictor tensors (file_pred: how many
// layers have one), else the model keeps its own.
static std::string replacement_note(const specee_model & m, const char * path, bool file_has_pred,
                                    int32_t file_pred) {
    const bool    own_head = m.eagle.version > 0;
    const int32_t own_pred = m.exit.n_pred;
    std::string   what;
    if (own_pred > 0 && file_has_pred && file_pred > 0) {
        what = specee_format("replaces the model's %sexit predictors (%s) with the file's (%s)",
                             own_head ? "EAGLE head and its " : "", n_layers_str(own_pred).c_str(),
                             n_layers_str(file_pred).c_str());
    } else if (own_pred > 0 && file_has_pred) {
        what = specee_format("replaces the model's %sexit predictors (%s) with none: the file has none",
                             own_head ? "EAGLE head and its " : "", n_layers_str(own_pred).c_str());
    } else if (own_head && own_pred > 0) {
        what = specee_format("replaces the model's EAGLE head; keeps its exit predictors (%s): the file has none",
                             n_layers_str(own_pred).c_str());
    } else if (own_head) {
        what = "replaces the model's EAGLE head";
    }
    return what.empty() ? what : specee_format("draft head file %s: %s", path, what.c_str());
}

std::string specee_load_draft_head_file(specee_model & m, const char * path, bool use_mmap) {
    if (!path || !*path) {
        specee_fail("no draft head file given");
    }
    auto   f  = std::make_unique<specee_gguf_file>();
    FILE * fp = fopen(path, "rb");
    if (!fp) {
        specee_fail("cannot open the draft head file '%s': %s", path, strerror(errno));
    }
    fclose(fp);
    std::string why;
    f->gguf = specee_gguf_open(path, &f->ctx_meta, why);
    if (!f->gguf) {
        specee_fail("'%s' is not a GGUF file, or a corrupt or truncated one: %s", path, why.c_str());
    }
    if (!specee_has_eagle_tensors(f->ctx_meta)) {
        specee_fail("'%s' holds no EAGLE head (no eagle.* tensors)", path);
    }
    specee_eagle    e         = specee_read_eagle(m.hparams, f->ctx_meta, f->gguf, path);
    const bool      with_exit = has_pred_tensors(f->ctx_meta);
    specee_exit_cfg x;
    if (with_exit) {
        x = specee_read_exit(m.hparams, f->ctx_meta, f->gguf, path);
    }
    specee_gguf_map(*f, path, use_mmap);
    specee_gguf_bind_tensors(*f, path);

    const std::string note = replacement_note(m, path, with_exit, x.n_pred);
    m.eagle                = std::move(e);
    if (with_exit) {
        m.exit = std::move(x); // the file's predictors replace the model file's
    }
    m.eagle_file = std::move(f);
    return note;
}
