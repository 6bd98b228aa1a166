// specee-cli-args.cpp: llama-cli's command line: every flag once in one table, which --help prints and the parser
// reads; values are checked here, the decoding settings again by the library's generator
#include "specee-cli-args.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>

#include <sys/stat.h>

struct cli_option {
    std::vector<std::string>                  names;
    std::string                               value; // the value's placeholder, "" for a flag
    std::string                               help;
    std::string                               expect; // what a value must be, for the error message
    std::function<bool(const std::string &)>  set;
};

static bool parse_int(const std::string & s, int & out, long lo = INT_MIN) {
    errno      = 0;
    char * end = nullptr;
    long   v   = std::strtol(s.c_str(), &end, 10);
    if (s.empty() || *end != '\0' || errno == ERANGE || v < lo || v > INT_MAX) {
        return false;
    }
    out = (int) v;
    return true;
}

// why the last value was refused, when its setter knows better than the library's last error
static std::string g_why;

// a prompt file: at most MAX_PROMPT_FILE bytes (a pipe or a device like /dev/stdin is read up to that too);
// false with the reason in `why`
static const size_t MAX_PROMPT_FILE = 64u << 20;

static bool read_text_file(const std::string & path, std::string & out, std::string & why) {
    struct stat st;
    if (stat(path.c_str(), &st) != 0) {
        why = strerror(errno);
        return false;
    }
    if (S_ISDIR(st.st_mode)) {
        why = "it is a directory";
        return false;
    }
    std::ifstream f(path, std::ios::binary);
    if (!f) {
        why = strerror(errno);
        return false;
    }
    out.clear();
    char buf[1 << 16];
    while (f.read(buf, sizeof(buf)) || f.gcount() > 0) {
        out.append(buf, (size_t) f.gcount());
        if (out.size() > MAX_PROMPT_FILE) {
            why = "it is larger than " + std::to_string(MAX_PROMPT_FILE >> 20) + " MiB";
            return false;
        }
    }
    if (f.bad()) {
        why = "read error";
        return false;
    }
    return true;
}

static std::string str(float v) {
    char b[32];
    snprintf(b, sizeof(b), "%.2f", (double) v);
    return b;
}

// The flags of a library table, one per option (specee.h: the generation options, specee_generator_option, and the
// context options, specee_context_option): the spellings on the option's row (llama.cpp's and EAGLE's, with this
// project's). A bool option that is off by default is a flag that turns it on, one that is on by default "--no-..."
// that turns it off.
static std::vector<std::string> flag_names(const specee_option & o) {
    std::vector<std::string> names;
    std::stringstream        ss(o.flags);
    for (std::string f; std::getline(ss, f, ',');) {
        names.push_back(f);
    }
    return names;
}

// `set(name, value)` sets option `name` from text (0 on success); `on_by_default(name)`: a bool option's default
static void add_table_options(std::vector<cli_option> & opts, const specee_option * (*option)(int32_t),
                              std::function<int32_t(const char *, const char *)> set,
                              std::function<bool(const char *)> on_by_default) {
    for (int32_t i = 0; const specee_option * o = option(i); ++i) {
        std::vector<std::string> names = flag_names(*o);
        const std::string        name  = o->name;
        // "" is the library's "the default": on a command line an empty value is refused
        auto setter = [set, name](const std::string & v) { return !v.empty() && set(name.c_str(), v.c_str()) == 0; };
        if (o->type == SPECEE_OPTION_BOOL) {
            const bool by_default = on_by_default(o->name);
            if (by_default) {
                names[0].insert(2, "no-");
            }
            const std::string help = by_default ? std::string("turn off: ") + o->help : o->help;
            opts.push_back({names, "", help, o->expect,
                            [setter, by_default](const std::string &) { return setter(by_default ? "false" : "true"); }});
            continue;
        }
        opts.push_back({names, o->hint, o->help, o->expect, setter}); // a value's placeholder: the row's
    }
}

// every flag once: names, placeholder, help, accepted values and what it sets
// the grammar front door's limits by name, as the library's table lists them
static std::string grammar_limit_names() {
    std::string out;
    for (int32_t i = 0; i < specee_grammar_limit_count(); ++i) {
        out += (i ? ", " : "") + std::string(specee_grammar_limit_name(i));
    }
    return out;
}

// the library's --spec-type table in words: "draft-simple as --mode draft; ngram-simple, ... as --mode ngram"
static std::string spec_type_text() {
    std::string out;
    for (int32_t i = 0; const specee_spec_type * st = specee_spec_type_row(i); ++i) {
        const specee_spec_type * next = specee_spec_type_row(i + 1);
        out += st->name;
        if (!next || next->mode != st->mode) {
            out += std::string(" as --mode ") + specee_mode_name(st->mode) + (next ? "; " : "");
        } else {
            out += ", ";
        }
    }
    return out;
}

static std::vector<cli_option> make_options(cli_params & p) {
    auto             s = [](std::string & field) { return [&field](const std::string & v) { field = v; return true; }; };
    auto             i = [](int & field, long lo) { return [&field, lo](const std::string & v) { return parse_int(v, field, lo); }; };
    auto             flag = [](std::function<void()> f) { return [f](const std::string &) { f(); return true; }; };
    std::vector<cli_option> opts = {
        {{"-h", "--help"}, "", "print this help and exit", "", nullptr},
        {{"-p", "--prompt"}, "PROMPT", "prompt to start generation with; for a system message use -sys", "", s(p.prompt)},
        {{"-f", "--file"}, "FNAME", "a file holding the prompt (one trailing newline dropped; at most 64 MiB)", "a readable prompt file",
         [&p](const std::string & v) {
             if (!read_text_file(v, p.prompt, g_why)) {
                 return false;
             }
             if (!p.prompt.empty() && p.prompt.back() == '\n') {
                 p.prompt.pop_back();
             }
             return true;
         }},
        {{"-sys", "--system-prompt"}, "PROMPT", "system message for conversation mode", "", s(p.system_prompt)},
        {{"-e", "--escape"}, "", "process escapes (\\n, \\r, \\t, \\', \\\", \\\\, \\xNN) in the prompt and in conversation input (default: on)", "", flag([&p] { p.escape = true; })},
        {{"--no-escape"}, "", "do not process escapes", "", flag([&p] { p.escape = false; })},
        {{"-n", "--n-predict"}, "N", "tokens to predict (default: -1 = until end of generation or a full context, -2 = until a full context)", "an integer >= -2", i(p.n_predict, -2)},
        {{"-cnv", "--conversation"}, "", "conversation mode: the chat template formats each turn and user lines are read from stdin after a '> ' prompt (default: on when the model has a chat template and stdin and stdout are terminals)", "", flag([&p] { p.conversation = CNV_ON; })},
        {{"-no-cnv", "--no-conversation"}, "", "plain completion of the prompt", "", flag([&p] { p.conversation = CNV_OFF; })},
        {{"-st", "--single-turn"}, "", "conversation mode: answer one turn (the -p prompt, or else the first line read), then exit", "", flag([&p] { p.single_turn = true; })},
        {{"--chat-template"}, "NAME", "chat template instead of the model's: chatml, smollm2, qwen2.5, llama2, vicuna, llama3, zephyr, phi3, gemma, command-r, or a Jinja template text with the markers of one of them", "a known template",
         [&p](const std::string & v) {
             p.chat_template = v;
             return specee_chat_template_resolve(nullptr, v.c_str()) != nullptr;
         }},
        {{"-sp", "--special"}, "", "print special tokens of the output as text", "", flag([&p] { p.special = true; })},
        {{"--verbose-prompt"}, "", "print the prompt's tokens to stderr before generating", "", flag([&p] { p.verbose_prompt = true; })},
        {{"--no-display-prompt"}, "", "do not echo the prompt", "", flag([&p] { p.display_prompt = false; })},
        {{"--list-devices"}, "", "print the devices (after adding the --rpc servers) and exit", "", flag([&p] { p.list_devices = true; })},
        {{"--grammar"}, "GRAMMAR", "constrain the output to a GBNF grammar (llama.cpp's grammars/ form; Lark or a regular expression with --grammar-type lark / regex): docs/structured-output.md", "a grammar",
         [&p](const std::string & v) { p.grammar = v; p.grammar_is_schema = false; return true; }},
        {{"--grammar-file"}, "FNAME", "as --grammar, read from a file", "a readable grammar file",
         [&p](const std::string & v) { p.grammar_is_schema = false; return read_text_file(v, p.grammar, g_why); }},
        {{"-j", "--json-schema"}, "SCHEMA", "constrain the output to JSON that validates against a JSON Schema, e.g. {} for any JSON value", "a JSON Schema",
         [&p](const std::string & v) { p.grammar = v; p.grammar_is_schema = true; return true; }},
        {{"-jf", "--json-schema-file"}, "FNAME", "as --json-schema, read from a file", "a readable JSON Schema file",
         [&p](const std::string & v) { p.grammar_is_schema = true; return read_text_file(v, p.grammar, g_why); }},
        {{"--grammar-limit"}, "NAME=VALUE", "change one of the grammar front door's limits for this run (" + grammar_limit_names() + ": docs/structured-output.md); repeatable", "NAME=INTEGER",
         [](const std::string & v) {
             const size_t eq = v.find('=');
             char *       end = nullptr;
             errno               = 0;
             const long long n   = eq == std::string::npos ? 0 : strtoll(v.c_str() + eq + 1, &end, 10);
             if (eq == std::string::npos || eq == 0 || eq + 1 == v.size() || errno != 0 || *end != '\0') {
                 return false;
             }
             return specee_grammar_set_limit(v.substr(0, eq).c_str(), (int64_t) n) == 0;
         }},
        {{"--spec-type"}, "TYPE", "llama.cpp's speculation types, each as the mode that serves it here: " + spec_type_text() + " (--mode draft needs a draft model, -md)", "one of those types",
         [&p](const std::string & v) {
             for (int32_t i = 0; const specee_spec_type * st = specee_spec_type_row(i); ++i) {
                 if (v == st->name) {
                     return specee_generator_params_set(&p.gen, "mode", specee_mode_name(st->mode)) == 0;
                 }
             }
             g_why = "this runtime's --spec-type takes " + spec_type_text();
             return false;
         }},
    };
    auto on = [](int32_t (*get)(const char *, char *, int32_t)) {
        return [get](const char * name) {
            char v[8];
            get(name, v, sizeof(v));
            return std::string(v) == "true";
        };
    };
    add_table_options(
        opts, specee_context_option,
        [&p](const char * name, const char * v) {
            if (strcmp(name, "flash_attn") == 0 && strcmp(v, "off") == 0) {
                fprintf(stderr, "warning: -fa off is ignored: attention is always flash attention here\n");
            }
            return specee_context_options_set(&p.ctx, name, v);
        },
        on(+[](const char * name, char * buf, int32_t len) {
            const specee_context_options d = specee_context_options_default();
            return specee_context_options_get(&d, name, buf, len);
        }));
    add_table_options(
        opts, specee_generator_option,
        [&p](const char * name, const char * v) { return specee_generator_params_set(&p.gen, name, v); },
        on(+[](const char * name, char * buf, int32_t len) {
            const specee_generator_params d = specee_generator_default_params();
            return specee_generator_params_get(&d, name, buf, len);
        }));
    return opts;
}

static void print_usage(const char * argv0, const std::vector<cli_option> & opts) {
    printf("usage: %s [options]\n\n", argv0);
    printf("Generates text with the SpecEE runtime, like llama.cpp's llama-cli: the prompt is echoed, the continuation\n");
    printf("streams to stdout, and timing lines in llama_perf_context_print's format go to stderr.\n");
    printf("Sampling chain: repetition penalty -> top-k -> top-p -> min-p -> temperature -> seeded draw.\n");
    printf("Modes (--mode): plain decoding; EAGLE speculative decoding, lossless (greedy output = plain output,\n");
    printf("sampling keeps the distribution); SpecEE early exit, alone or inside the EAGLE tree (tree-exit), greedy and\n");
    printf("lossy. The perf lines add the mean accepted tokens per step and/or the exit ratio, mean layers run and a\n");
    printf("histogram.\n\noptions:\n");
    for (const cli_option & o : opts) {
        std::string head = "  ";
        for (size_t k = 0; k < o.names.size(); ++k) {
            head += (k ? ", " : "") + o.names[k];
        }
        print_help_line(head + (o.value.empty() ? "" : " " + o.value), o.help);
    }
}

void print_help_line(const std::string & head, const std::string & help) {
    printf("%s", head.c_str());
    size_t col = head.size();
    if (col >= 35) {
        printf("\n");
        col = 0;
    }
    printf("%*s", (int) (36 - col), "");
    col = 36;
    std::istringstream words(help);
    std::string        w;
    bool               first = true;
    while (words >> w) {
        if (!first && col + 1 + w.size() > 110) {
            printf("\n%36s", "");
            col   = 36;
            first = true;
        }
        printf("%s%s", first ? "" : " ", w.c_str());
        col += w.size() + (first ? 0 : 1);
        first = false;
    }
    printf("\n");
}

// false with a message on stderr when the command line is malformed
static bool parse_args(int argc, char ** argv, std::vector<cli_option> & opts, bool & help) {
    for (int a = 1; a < argc; ++a) {
        const std::string arg = argv[a];
        cli_option *      opt = nullptr;
        for (cli_option & o : opts) {
            if (std::find(o.names.begin(), o.names.end(), arg) != o.names.end()) {
                opt = &o;
            }
        }
        if (!opt) {
            fprintf(stderr, "error: unknown argument: %s (see --help)\n", arg.c_str());
            return false;
        }
        if (!opt->set) {
            help = true;
            return true;
        }
        std::string val;
        if (!opt->value.empty()) {
            // upstream's -fa also comes without a value (older builds)
            if (arg == "-fa" || arg == "--flash-attn") {
                if (a + 1 < argc && argv[a + 1][0] != '-') {
                    val = argv[++a];
                } else {
                    val = "on";
                }
            } else if (a + 1 >= argc) {
                fprintf(stderr, "error: %s needs a value (see --help)\n", arg.c_str());
                return false;
            } else {
                val = argv[++a];
            }
        }
        g_why.clear();
        if (!opt->set(val)) {
            const char * why = g_why.empty() ? specee_last_error() : g_why.c_str();
            fprintf(stderr, "error: invalid value for %s: '%s' (expected %s)%s%s\n", arg.c_str(), val.c_str(),
                    opt->expect.c_str(), *why ? ": " : "", why);
            return false;
        }
    }
    return true;
}

bool cli_parse(int argc, char ** argv, cli_params & p, bool & help) {
    std::vector<cli_option> opts = make_options(p);
    if (!parse_args(argc, argv, opts, help)) {
        return false;
    }
    if (!p.grammar.empty() || p.grammar_is_schema) {
        // the text's type, the library's rule (a schema's, else --grammar-type's, gbnf when not given); compiled with
        // the model
        p.gen.grammar_type = specee_grammar_type_of(p.gen.grammar_type, p.grammar_is_schema);
        if (p.gen.grammar_type < 0) {
            fprintf(stderr, "error: %s\n", specee_last_error());
            return false;
        }
        p.gen.grammar = p.grammar.c_str();
    }
    const int32_t cpus = specee_max_threads();
    if (std::max(p.ctx.n_threads, p.ctx.n_threads_batch) > cpus) {
        fprintf(stderr, "warning: -t %d is more threads than the %d CPU%s this process may use: using %d (more "
                "threads than CPUs wait on each other at every step)\n",
                std::max(p.ctx.n_threads, p.ctx.n_threads_batch), cpus, cpus == 1 ? "" : "s", cpus);
    }
    if (help) {
        print_usage(argv[0], opts);
    }
    return true;
}
