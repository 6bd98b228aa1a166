// specee-lora.h: LoRA adapters, as llama.cpp has them (--lora, --lora-scaled); their public C API is specee.h's LoRA
// section.
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

#include <string>
#include <vector>

// The LoRA adapters of the context option lora ("FNAME,...", scale 1 each) or, scaled, lora_scaled ("FNAME:SCALE,...",
// the scale after the last ':', finite) appended to files and scales (NULL: only checked); false when malformed (an
// empty name or scale); the context-option table checks the options with it
bool specee_lora_list_parse(const char * text, bool scaled, std::vector<std::string> * files = nullptr,
                            std::vector<float> * scales = nullptr);
