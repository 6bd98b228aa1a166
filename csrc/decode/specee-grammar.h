// specee-grammar.h: structured output: a grammar's matcher over the model's vocabulary (llguidance).
//
// Contract. A grammar (GBNF, Lark, JSON Schema or a regular expression) is compiled for the model's vocabulary
// into a matcher that says, at each step, which tokens may come next (a bitmask), and advances on each token
// generated. The sampler holds one (specee-sampling.cpp): every draw from the target's logits is masked, and every
// token it accepts after the first draw advances it. So the modes that draw from the target's logits node by node
// (plain, eagle, eagle2, ngram: specee_tree_walk) emit exactly the tokens plain decoding under the same grammar
// emits, and an early exit's token is the masked argmax of its layer.
//
// The engine is llguidance (docs/structured-output.md): its PyPI wheel's shared library exports its C API (llg_*),
// which this file loads with dlopen, so the CLI, Python and the server share it without a Rust toolchain. Where the
// library lives: specee_grammar_set_library, else $SPECEE_LLGUIDANCE, else the path found when this was built.
// The wheel's library is a Python extension: in a process without Python (the CLI) libpython is loaded first
// ($SPECEE_LIBPYTHON, else the build's), only to satisfy its links; Python is never initialised.
#pragma once

#include "specee.h"

#include <cstdint>
#include <string>
#include <vector>

struct specee_grammar;

// Compiles `text` of the given enum specee_grammar_type for the model's vocabulary; throws specee_error with the
// engine's message when the grammar is malformed or the engine cannot be loaded.
specee_grammar * specee_grammar_init_impl(const specee_model & model, int32_t type, const char * text);
void             specee_grammar_free_impl(specee_grammar * g);
// the type and text it was compiled from
int32_t              specee_grammar_type_of(const specee_grammar & g);
const std::string &  specee_grammar_text(const specee_grammar & g);

// The tokens allowed next: bit t % 32 of word t / 32 (computed once per state). An end-of-generation token is
// allowed exactly when the grammar accepts the text so far.
const uint32_t * specee_grammar_mask_impl(specee_grammar & g);
bool             specee_grammar_allows(specee_grammar & g, int32_t token);
// Masks off the critical path: starts computing the current state's mask on the grammar's worker thread (when
// overlap is on, the default), for the caller to run the model's pass meanwhile: the mask for the position a pass
// computes depends only on the tokens before it. Every other function here waits for the worker first, so a caller
// never sees the matcher in use; the wait is mask time.
void             specee_grammar_prefetch(specee_grammar & g);
void             specee_grammar_set_overlap(specee_grammar & g, bool on);
// milliseconds the caller's thread spent on masks since the grammar was made: computing them (no overlap, or no
// prefetch) or waiting for the worker
double           specee_grammar_mask_ms(const specee_grammar & g);
// How many of tokens[0..n) the grammar allows one after another from its state (which stays as it is): llguidance's
// check of a token sequence, without masks; an end-of-generation token counts where the text before it is complete.
// For drafts: a drafted token it refuses can never be drawn (specee_tree_filter).
int32_t          specee_grammar_valid_prefix(specee_grammar & g, const int32_t * tokens, int32_t n);
// Advance on a generated token; throws when the grammar does not allow it. End-of-generation tokens end the text.
void             specee_grammar_accept_impl(specee_grammar & g, int32_t token);
// Take back the last n accepted tokens; back to the start
void             specee_grammar_rollback_impl(specee_grammar & g, int32_t n);
void             specee_grammar_reset_impl(specee_grammar & g);
// the grammar allows nothing but the end (a complete JSON value, say)
bool             specee_grammar_done(specee_grammar & g);
// tokens the grammar forces next, whatever the model says (a key, a closing brace), up to n_max
std::vector<int32_t> specee_grammar_forced(specee_grammar & g, int32_t n_max);
// tokens accepted since the start
int32_t          specee_grammar_n_accepted(const specee_grammar & g);
