// specee-placement.h: where the weights live: layers on devices (-ngl, offload order, -ts, --device), ggml RPC servers
// as devices, the CPU's matrices repacked
#pragma once

#include "specee.h"

struct specee_model;

#include "ggml-backend.h"

#include <vector>

// registers ggml RPC servers (comma-separated HOST:PORT) as devices and returns theirs; throws when one cannot be
// reached
std::vector<ggml_backend_dev_t> specee_rpc_add(const char * servers);
// Chooses each layer's device and the output's, and copies those weights into their devices' buffers (the CPU's stay
// in the file mapping); the draft head goes with the output. Writes model.placement.
void specee_place_weights(specee_model & m, const specee_model_params & p);
// Copies the matrices on the CPU (the layers', the output's, the draft head's) that one of the CPU backend's extra
// buffer types runs faster into it, repacked (after specee_place_weights); adds a CPU_REPACK line to model.placement.
void specee_repack_weights(specee_model & m, int32_t kernels);
// the draft head's tensors onto the output's device, or repacked on the CPU (a head loaded after the model)
void specee_place_eagle(specee_model & m);
