// specee-lora.h: LoRA adapters, as llama.cpp has them (--lora, --lora-scaled). Part of the public API (specee.h
// includes it).
//
// An adapter is a GGUF file (general.type "adapter", adapter.type "lora", general.architecture the model's,
// adapter.lora.alpha) holding, for some of the model's matrices W "<name>.weight" [n_in, n_out], the pair
// "<name>.weight.lora_a" [n_in, r] and "<name>.weight.lora_b" [r, n_out] (GGML's order; python -m specee.convert lora
// writes one from a PEFT folder). With adapters (a_i, s_i) active on a context, every projection of the model's
// layers and its lm_head computes
//     y = W x + sum_i s_i * alpha_i / r_i * B_i (A_i x)        (alpha_i 0: s_i alone, as llama.cpp)
// (one helper in specee-graph.cpp). The draft head, a draft model and the exit predictors are not adapted (llama.cpp
// applies an adapter to the model it was loaded for only); an early exit's lm_head is the model's, so it is.
//
// Where the adapter's tensors live: with the weight they adapt (a device's buffer for an offloaded layer, an RPC
// server's for a layer there), or the CPU's plain buffer for a weight on the CPU (also when the weight was repacked).
//
// The KV cache: cells hold K/V computed under the set active when they were written, so changing a context's set
// clears its KV cache (every sequence; setting the same set again keeps it): no prompt cached under one set is reused
// under another, as llama.cpp's server clears a slot's cache when the slot's LoRA set changes. Sequences decoded
// together share the context's one set: a caller with requests under different sets runs them one set at a time (the
// server's engine does).
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct specee_model;
struct specee_context;
struct specee_context_options;
typedef struct specee_lora specee_lora;

// the most adapters active on a context at once
#define SPECEE_LORA_MAX 8

// Loads the adapter at path for `model`: NULL with specee_last_error() when the file is not a LoRA adapter, is for
// another architecture, names a matrix the model lacks, or has pairs of the wrong shapes or ranks. Free it with
// specee_lora_free after the contexts that use it are freed or no longer use it.
specee_lora * specee_lora_init(struct specee_model * model, const char * path);
void          specee_lora_free(specee_lora * adapter);

// The adapters the context options name (lora's files at scale 1, then lora_scaled's), loaded for `model` into
// adapters[0..n) with the scales to apply first (0 each with lora_init_without_apply): n, or -1 with
// specee_last_error() and none left loaded (a file that does not load, more than n_max).
int32_t specee_lora_init_from_options(struct specee_model * model, const struct specee_context_options * o,
                                      specee_lora ** adapters, float * scales, int32_t n_max);

float        specee_lora_alpha(const specee_lora * adapter);     // adapter.lora.alpha (0: none given)
int32_t      specee_lora_n_weights(const specee_lora * adapter); // the model matrices it adapts
const char * specee_lora_path(const specee_lora * adapter);

// Makes adapters[0..n) with scales[0..n) (finite) the context's active set, replacing the previous one (n = 0: none).
// Every adapter must be loaded for the context's model; at most SPECEE_LORA_MAX, no adapter twice. 0, or -1 with
// specee_last_error() (the set is left as it was). A set other than the current one clears the KV cache.
int32_t specee_context_set_lora(struct specee_context * ctx, specee_lora * const * adapters, const float * scales,
                                int32_t n);
// the number of active adapters, and (i < n) the i-th with its scale in *scale
int32_t       specee_context_n_lora(const struct specee_context * ctx);
specee_lora * specee_context_lora(const struct specee_context * ctx, int32_t i, float * scale);

#ifdef __cplusplus
}
#endif

#ifdef __cplusplus
#include <string>
#include <vector>

// The LoRA adapters of the context option lora ("FNAME,...", scale 1 each) or, scaled, lora_scaled ("FNAME:SCALE,...",
// the scale after the last ':', finite) appended to files and scales (NULL: only checked); false when malformed (an
// empty name or scale); the context-option table checks the options with it
bool specee_lora_list_parse(const char * text, bool scaled, std::vector<std::string> * files = nullptr,
                            std::vector<float> * scales = nullptr);
#endif
