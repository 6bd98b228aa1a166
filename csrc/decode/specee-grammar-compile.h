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
#pragma once

#include "specee-llg.h"

#include <cstdint>
#include <string>

// A matcher for `engine_text` of engine kind `kind` ("lark", "json", "regex"), in its start state, for the grammar
// (type, text) as given; the caller owns it (free_matcher). Throws specee_error with a short message of this
// project's own: "<type>: <what>".
llg_matcher * specee_grammar_compile(const llg_tokenizer * tok, int32_t type, const std::string & text,
                                     const char * kind, const std::string & engine_text);

// freed memory handed back to the system (glibc's malloc_trim): after a large grammar is freed
void specee_grammar_release_memory();
