// specee-gbnf.h: llama.cpp's GBNF read as llguidance's Lark (specee-gbnf.cpp), what GBNF grammars are compiled
// through (specee-grammar.cpp)
#pragma once

#include <string>

// llama.cpp's GBNF as llguidance's Lark; throws with the line of a syntax error, a rule used but not defined, or no
// root
std::string specee_gbnf_to_lark(const std::string & gbnf);
