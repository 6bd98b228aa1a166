// specee-placement.h: layers on devices (-ngl, offload order, -ts, --device) and ggml RPC servers as devices
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
// the draft head's tensors onto the output's device (a head loaded after the model)
void specee_place_eagle(specee_model & m);
