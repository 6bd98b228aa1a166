// specee-grammar-compile.h: compiling a grammar for the engine, within a budget, with compiled grammars cached.
//
// Contract. A compile runs on a worker thread of its own (with a large stack) that builds llguidance's matcher, its
// first mask and its first forced tokens (the engine builds its lexer lazily: its errors and its time belong to the
// compile). The caller waits
// at most the limit compile_ms, and while the process grows by no more than compile_mb; past either the compile is
// abandoned (the engine cannot be interrupted: the worker finishes on its own, frees what it made and returns its
// memory to the system) and the caller gets a short error naming the limit. While two abandoned compiles still run,
// a new compile is refused at once, so hostile grammars cannot pile up threads. The engine's own limits (lexer
// states, grammar size, fuel) are set from the same budget, and its verbose errors (parser state, the grammar) off.
//
// Compiled grammars are cached by (vocabulary, type, text), at most cache_entries of them, least recently used
// dropped; a failure is cached as its message, so a repeated hostile grammar costs nothing. A hit is a clone of the
// cached matcher in its start state. What the kept entries hold (a matcher: the bytes its compile left allocated,
// malloc's count across all arenas; the grammar's text and a failure's message) is bounded by cache_mb in all (the
// least recently used dropped first; one larger alone is not kept: its memory goes at the end of its request). Each
// compile ends with malloc_trim, so the engine's scratch memory goes back to the system, not to an arena.
//
// What an abandoned compile reads outlives the model. The engine calls back into the vocabulary's tokenizer (the
// tokenize callback's user data is the vocabulary), and a compile abandoned past its budget may still run when the
// model is freed (Model.close, a server's shutdown or model swap). So the vocabulary is shared (specee-vocab.h): the
// engine's view of it (specee_grammar_vocab) holds a reference of its own, and everything that holds a matcher made
// from it (a grammar, a compile job, a cached matcher) holds that view by shared_ptr; the last of them frees the
// view, its tokenizer and the vocabulary, whenever the model went. Freeing a model never waits for a compile. Once
// its model is gone a view is an orphan: its cached grammars can never be asked for again (a model loaded later gets
// a view of its own) and are dropped by the next compile, with the view once no job or grammar holds it.
#pragma once

#include "specee-llg.h"

#include <cstdint>
#include <memory>
#include <string>

struct specee_vocab;

// A vocabulary as the engine sees it: llguidance's tokenizer (the tokens' bytes, and a callback into the
// vocabulary's own tokenizer with `vocab` as its user data), made once per vocabulary (specee-grammar.cpp)
struct specee_grammar_vocab {
    specee_vocab *  vocab = nullptr; // a reference of its own (specee_vocab_retain)
    llg_tokenizer * tok   = nullptr; // owned
    specee_grammar_vocab()                                         = default;
    specee_grammar_vocab(const specee_grammar_vocab &)             = delete;
    specee_grammar_vocab & operator=(const specee_grammar_vocab &) = delete;
    ~specee_grammar_vocab();
    // its model has freed the vocabulary: only this view keeps it
    bool orphaned() const;
};

// A matcher for `engine_text` of engine kind `kind` ("lark", "json", "regex"), in its start state, for the grammar
// (type, text) as given; the caller owns it (free_matcher) and keeps `vocab` while it does. Throws specee_error
// with a short message of this project's own: "<type>: <what>".
llg_matcher * specee_grammar_compile(const std::shared_ptr<specee_grammar_vocab> & vocab, int32_t type,
                                     const std::string & text, const char * kind, const std::string & engine_text);

// freed memory handed back to the system (glibc's malloc_trim): after a large grammar is freed
void specee_grammar_release_memory();
