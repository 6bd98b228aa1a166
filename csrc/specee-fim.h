// specee-fim.h: the public C API of a vocabulary's fill-in-the-middle (FIM) tokens (beside specee.h; specee-vocab.cpp
// implements it). Code models mark the prefix, suffix and middle of a fill-in-the-middle prompt with tokens of their
// own; where a file names them in its metadata they are taken from there, else from their text in the vocabulary.
// specee-server's /infill (llama.cpp's layout) and Model.fim_tokens read them here, nowhere else.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct specee_model specee_model;

// The FIM tokens, in the order of the table in specee-vocab.cpp (its keys and texts)
enum specee_fim {
    SPECEE_FIM_PRE = 0, // before the prefix
    SPECEE_FIM_SUF = 1, // before the suffix
    SPECEE_FIM_MID = 2, // after both: the model writes the middle
    SPECEE_FIM_PAD = 3, // padding (ends generation)
    SPECEE_FIM_REP = 4, // before a repository's name (ends generation)
    SPECEE_FIM_SEP = 5, // before each file of a repository (ends generation)
    SPECEE_FIM_COUNT = 6,
};

// the kind's name ("pre", "suf", "mid", "pad", "rep", "sep"), NULL out of range
const char * specee_fim_name(int32_t kind);
// the kind's token id in the model's vocabulary, -1 when it has none (or kind is out of range)
int32_t specee_token_fim(const specee_model * model, int32_t kind);

#ifdef __cplusplus
}
#endif
