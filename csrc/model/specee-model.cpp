// specee-model.cpp: what a loaded model answers: each layer's device, and the C accessors of its sizes, metadata and
// draft head (loading and freeing it: specee-loader.cpp)
#include "specee-model.h"

#include "specee.h"

#include <algorithm>

int32_t specee_model_device_of_layer(const specee_model & m, int32_t il) {
    if (il >= 0 && il < (int32_t) m.layer_device.size()) {
        return m.layer_device[il];
    }
    return m.output_device;
}

// ---- C API ---------------------------------------------------------------------------------------

extern "C" int32_t  specee_model_n_layer(const specee_model * m) { return (int32_t) m->hparams.n_layer; }
extern "C" int32_t  specee_model_n_embd(const specee_model * m) { return (int32_t) m->hparams.n_embd; }
extern "C" int32_t  specee_model_n_ff(const specee_model * m) { return (int32_t) m->hparams.n_ff; }
extern "C" int32_t  specee_model_n_head(const specee_model * m) { return (int32_t) m->hparams.n_head; }
extern "C" int32_t  specee_model_n_head_kv(const specee_model * m) { return (int32_t) m->hparams.n_head_kv; }
extern "C" int32_t  specee_model_n_vocab(const specee_model * m) { return (int32_t) m->hparams.n_vocab; }
extern "C" int32_t  specee_model_n_ctx_train(const specee_model * m) { return (int32_t) m->hparams.n_ctx_train; }
extern "C" uint64_t specee_model_n_params(const specee_model * m) { return m->n_params; }
extern "C" uint64_t specee_model_size(const specee_model * m) { return m->n_bytes; }
extern "C" const char * specee_model_desc(const specee_model * m) { return m->desc.c_str(); }

extern "C" int32_t specee_model_meta_count(const specee_model * m) { return (int32_t) m->meta.size(); }

extern "C" const char * specee_model_meta_key(const specee_model * m, int32_t i) {
    return (i >= 0 && i < (int32_t) m->meta.size()) ? m->meta[i].first.c_str() : nullptr;
}

extern "C" const char * specee_model_meta_value(const specee_model * m, int32_t i) {
    return (i >= 0 && i < (int32_t) m->meta.size()) ? m->meta[i].second.c_str() : nullptr;
}

extern "C" bool specee_model_has_eagle(const specee_model * model) { return model && model->eagle.version > 0; }

extern "C" const int32_t * specee_model_eagle_draft_vocab(const specee_model * model) {
    return specee_model_has_eagle(model) && model->eagle.output ? model->eagle.draft_vocab.data() : nullptr;
}

extern "C" int32_t specee_model_eagle_n_vocab(const specee_model * model) {
    if (!specee_model_has_eagle(model)) {
        return 0;
    }
    return model->eagle.output ? (int32_t) model->eagle.draft_vocab.size() : (int32_t) model->hparams.n_vocab;
}

extern "C" int32_t specee_model_eagle_version(const specee_model * model) {
    return specee_model_has_eagle(model) ? (int32_t) model->eagle.version : 0;
}

extern "C" int32_t specee_model_eagle_n_feature(const specee_model * model) {
    return specee_model_has_eagle(model) ? specee_eagle_n_feat(model->eagle, model->hparams.n_embd) : 0;
}

extern "C" int32_t specee_model_eagle_feature_layers(const specee_model * model, int32_t * out, int32_t n_max) {
    const int32_t n = specee_model_has_eagle(model) ? (int32_t) model->eagle.feature_layers.size() : 0;
    for (int32_t i = 0; out && i < std::min(n, n_max); ++i) {
        out[i] = model->eagle.feature_layers[i];
    }
    return n;
}
