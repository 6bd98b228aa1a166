// specee-head-weights.h: reading the EAGLE draft head and SpecEE's exit predictors from a GGUF: the model's own file
// or a draft head file loaded next to it (the head's graph and decoding are specee-draft-head.cpp's)
#pragma once

#include "specee-model.h"

#include <string>

// cm has eagle.* tensors
bool specee_has_eagle_tensors(ggml_context * cm);
// The EAGLE head in cm (tensors of the file `path`, metadata in g), shapes checked against the base model's
// hyperparameters
specee_eagle specee_read_eagle(const specee_hparams & hp, ggml_context * cm, const gguf_context * g,
                               const std::string & path);
// SpecEE's exit predictors (blk.N.pred.*, any subset of the layers) and the specee.exit.* settings of a file
specee_exit_cfg specee_read_exit(const specee_hparams & hp, ggml_context * cm, const gguf_context * g,
                                 const std::string & path);

// A draft head file (eagle.* tensors, specee.* keys, optionally exit predictors; other tensors are ignored): its head
// replaces the model's, if it has one; its exit predictors, if it has any, replace the model's. Returns what of the
// model's own it replaced, as one line ("" when nothing).
std::string specee_load_draft_head_file(specee_model & m, const char * path, bool use_mmap);
