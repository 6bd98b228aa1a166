// specee-options.h: the mode table's rows and the generation options' checks (specee-options.cpp)
#pragma once

#include "specee.h"


// mode's row of the mode table (specee_mode_info); throws for an unknown mode
const specee_mode_info & specee_mode_row_impl(int32_t mode);
// throws when a value is out of range whatever the model (sampling, mode, trees, exit settings)
void specee_generator_check_values(const specee_generator_params & p);

// ---- public C API beside specee.h ---------------------------------------------------------------------------
extern "C" {
// A row of llama.cpp's speculation types (--spec-type of llama-server and llama-cli) as this runtime takes them: the
// type's name and the mode (enum specee_mode) that serves it. One table that every frontend reads (the CLI's
// --spec-type, specee-server's, the benches: Python's specee.generate.SPEC_TYPES).
struct specee_spec_type {
    const char * name; // "ngram-mod"
    int32_t      mode; // SPECEE_MODE_NGRAM
};
// row i (i >= 0), NULL past the end
const struct specee_spec_type * specee_spec_type_row(int32_t i);
}
