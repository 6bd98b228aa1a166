// specee-llg.h: llguidance's C ABI, as far as this runtime uses it, and the loading of its library.
//
// The declarations below are this project's own, of the few entry points of llguidance's stable C ABI it uses (its
// matcher API, 1.x); the structs it passes are zero-filled beyond what is set, and the tokenizer's is sized by
// struct_size (the library reads no more). The library (its PyPI wheel's shared library) is loaded once per process
// with dlopen: specee_grammar_set_library, else $SPECEE_LLGUIDANCE, else the path found when this was built; in a
// process without Python (the CLI) libpython is loaded first ($SPECEE_LIBPYTHON, else the build's), only to satisfy
// its links. Used by specee-grammar.cpp (the matcher) and specee-grammar-compile.cpp (compiling it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

struct llg_tokenizer;
struct llg_matcher;

struct llg_parser_limits {
    size_t   max_items_in_row;
    uint64_t initial_lexer_fuel;
    uint64_t step_lexer_fuel;
    size_t   step_max_items;
    size_t   max_lexer_states;
    size_t   max_grammar_size;
    bool     precompute_large_lexemes;
    bool     verbose_errors;
};

struct llg_constraint_init {
    const llg_tokenizer * tokenizer;
    uint32_t              log_buffer_level;
    uint32_t              log_stderr_level;
    bool                  ff_tokens_ok;
    bool                  backtrack_ok;
    llg_parser_limits     limits;
    char                  reserve[256]; // fields a later library may add: left zero
};

typedef size_t (*llg_tokenize_fn)(const void * user, const uint8_t * bytes, size_t n_bytes, uint32_t * out,
                                  size_t n_out);

struct llg_tokenizer_init_v2 {
    size_t              struct_size;
    uint32_t            vocab_size;
    uint32_t            tok_eos;
    const uint32_t *    token_lens;
    const uint8_t *     token_bytes;
    const char *        tokenizer_json;
    bool                tokenize_assumes_string;
    llg_tokenize_fn     tokenize_fn;
    bool                use_approximate_greedy_tokenize_fn;
    const void *        tokenize_user_data;
    const char * const * slices;
    const uint32_t *    tok_eos_extra;
    uint32_t            tok_eos_extra_count;
};

struct llg_api {
    void (*constraint_init_set_defaults)(llg_constraint_init *, const llg_tokenizer *);
    llg_tokenizer * (*new_tokenizer_v2)(const llg_tokenizer_init_v2 *, char *, size_t);
    void (*free_tokenizer)(llg_tokenizer *);
    llg_matcher * (*new_matcher)(const llg_constraint_init *, const char *, const char *);
    void (*free_matcher)(llg_matcher *);
    const char * (*matcher_get_error)(llg_matcher *);
    bool (*matcher_is_error)(const llg_matcher *);
    size_t (*matcher_get_mask_byte_size)(const llg_matcher *);
    int32_t (*matcher_compute_mask_into)(llg_matcher *, uint32_t *, size_t);
    int32_t (*matcher_consume_token)(llg_matcher *, uint32_t);
    int32_t (*matcher_consume_tokens)(llg_matcher *, const uint32_t *, size_t);
    int32_t (*matcher_rollback)(llg_matcher *, size_t);
    int32_t (*matcher_reset)(llg_matcher *);
    bool (*matcher_is_accepting)(llg_matcher *);
    bool (*matcher_is_stopped)(const llg_matcher *);
    int32_t (*matcher_compute_ff_tokens)(llg_matcher *, uint32_t *, size_t);
    int32_t (*matcher_validate_tokens)(llg_matcher *, const uint32_t *, size_t);
    llg_matcher * (*clone_matcher)(const llg_matcher *);
};

// the library's entry points, loaded on first use; throws specee_error when it cannot be loaded
const llg_api & specee_llg();
// the engine's message as one short line of this project's: its first line, cut to 200 characters; a panic's text
// (a backtrace) is not repeated
std::string specee_llg_message(const char * e);
