// specee-grammar-limits.h: the grammar front door's limits, and the screen that holds a grammar's text to them.
//
// Contract. The grammar engine (llguidance) compiles in native code that overflows its stack on deep `$ref` chains
// and long chains of rules, stalls for seconds on tens of thousands of alternatives, and expands huge repetition
// bounds into memory. Every grammar, from every frontend (the CLI, Python, the server), passes this screen before the
// engine sees it: its size, nesting depth, rules, alternatives, `$ref`s and repetition bounds are counted by one
// linear scan of its text (no recursion, no allocation per token), and the first limit it passes is refused with a
// short message naming the limit. The limits live in one table (LIMITS in the .cpp), read by name by every frontend
// (`specee_grammar_limit`; Python: specee.grammar.limits()); the compile's own budget (time, memory) and the cache
// of compiled grammars read theirs from the same table (specee-grammar.cpp).
#pragma once

#include "specee.h"

#include <stdint.h>

// the grammar types' names, by enum specee_grammar_type ("none", "gbnf", "json_schema", "lark", "regex"): what
// messages and the option grammar_type call them (specee-grammar-limits.cpp)
constexpr int32_t SPECEE_N_GRAMMAR_TYPES = SPECEE_GRAMMAR_REGEX + 1;
extern const char * const specee_grammar_type_names[SPECEE_N_GRAMMAR_TYPES];

// the limit of that name (a row of the table); throws on an unknown name
int64_t specee_grammar_limit_of(const char * name);
// Refuses (throws specee_error) the text of a grammar of enum specee_grammar_type that passes a limit, before any
// engine sees it. A text within the limits may still be malformed: the engine judges that.
void specee_grammar_screen(int32_t type, const char * text);
