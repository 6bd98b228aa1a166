// specee-cli-args.h: llama-cli's command line: every flag once (name, value, help, what it sets), parsing, --help
// (its help lines serve specee-bench too)
#pragma once

#include "specee.h"

#include <string>
#include <vector>

enum cnv_mode { CNV_AUTO, CNV_ON, CNV_OFF };

struct cli_params {
    specee_context_options  ctx = specee_context_options_default(); // the model, context and placement flags set it
    std::string             prompt, system_prompt, chat_template;
    int                     n_predict = -1;
    bool        escape = true, special = false, single_turn = false, verbose_prompt = false, display_prompt = true;
    cnv_mode    conversation = CNV_AUTO;
    specee_generator_params gen           = specee_generator_default_params(); // the generation flags set it
    bool                    list_devices  = false;
    // --grammar / --grammar-file (GBNF, or what --grammar-type says) or --json-schema / --json-schema-file; gen.grammar
    // points here once parsed (keep p where it is)
    std::string             grammar;
    bool                    grammar_is_schema = false;
};

// a --help line: the flags and placeholder (head), then the help wrapped at 110 columns from column 36 (specee-bench
// prints its lines with it too)
void print_help_line(const std::string & head, const std::string & help);
// false with a message on stderr when the command line is malformed; help: --help was given (the usage is printed)
bool cli_parse(int argc, char ** argv, cli_params & p, bool & help);
