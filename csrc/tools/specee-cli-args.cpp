// specee-cli-args.cpp: llama-cli's command line: every flag once in one table, which --help prints and the parser
// reads; values are checked here, the decoding settings again by the library's generator
#include "specee-cli-args.h"

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

static bool parse_float(const std::string & s, float & out) {
    errno      = 0;
    char * end = nullptr;
    float  v   = std::strtof(s.c_str(), &end);
    if (s.empty() || *end != '\0' || errno == ERANGE || std::isnan(v)) {
        return false;
    }
    out = v;
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

// The generation flags, one per option of the library's table (specee.h, specee_generator_option): "--" and the
// option's name with '-' for '.' and '_' ("exit.kv" -> --exit-kv), plus llama.cpp's and EAGLE's spellings. A bool
// option that is off by default is a flag that turns it on, one that is on by default "--no-..." that turns it off.
static std::vector<std::string> generation_flag_names(const std::string & name) {
    static const std::vector<std::pair<std::string, std::vector<std::string>>> ALIASES = {
        {"seed", {"-s"}}, {"top_k", {"--top_k"}}, {"top_p", {"--top_p"}}, {"min_p", {"--min_p"}},
        {"eagle.choices", {"--eagle_choices"}}, {"eagle.topk", {"--eagle_dynamic_tree_max_top_k"}}};
    std::string flag = "--" + name;
    std::replace(flag.begin(), flag.end(), '.', '-');
    std::replace(flag.begin(), flag.end(), '_', '-');
    std::vector<std::string> names = {flag};
    for (const auto & [option, aliases] : ALIASES) {
        if (option == name) {
            names.insert(name == "seed" ? names.begin() : names.end(), aliases.begin(), aliases.end());
        }
    }
    return names;
}

static void add_generation_options(std::vector<cli_option> & opts, cli_params & p) {
    const specee_generator_params d = specee_generator_default_params();
    for (int32_t i = 0; const specee_option * o = specee_generator_option(i); ++i) {
        std::vector<std::string> names = generation_flag_names(o->name);
        const std::string        name  = o->name;
        std::string              value = name.substr(name.rfind('.') + 1);
        std::transform(value.begin(), value.end(), value.begin(), ::toupper);
        value = o->type == SPECEE_OPTION_INT || o->type == SPECEE_OPTION_FLOAT ? (name == "seed" ? "SEED" : "N")
                : o->type == SPECEE_OPTION_LIST ? (name == "eagle.replay" ? "COUNTS" : "LAYERS")
                                                                                : value;
        auto set = [&p, name](const std::string & v) { return specee_generator_params_set(&p.gen, name.c_str(), v.c_str()) == 0; };
        if (o->type == SPECEE_OPTION_BOOL) {
            char on[8];
            specee_generator_params_get(&d, o->name, on, sizeof(on));
            const bool by_default = std::string(on) == "true";
            if (by_default) {
                names[0].insert(2, "no-");
            }
            const std::string help = by_default ? std::string("turn off: ") + o->help : o->help;
            opts.push_back({names, "", help, o->expect, [set, by_default](const std::string &) { return set(by_default ? "false" : "true"); }});
            continue;
        }
        opts.push_back({names, value, o->help, o->expect, set});
    }
}

// every flag once: names, placeholder, help, accepted values and what it sets
static std::vector<cli_option> make_options(cli_params & p) {
    const cli_params d;
    auto             s = [](std::string & field) { return [&field](const std::string & v) { field = v; return true; }; };
    auto             i = [](int & field, long lo) { return [&field, lo](const std::string & v) { return parse_int(v, field, lo); }; };
    auto             flag = [](std::function<void()> f) { return [f](const std::string &) { f(); return true; }; };
    auto             one_of = [](std::string & field, std::vector<std::string> ok) {
        return [&field, ok](const std::string & v) { field = v; return std::find(ok.begin(), ok.end(), v) != ok.end(); };
    };
    std::vector<cli_option> opts = {
        {{"-h", "--help"}, "", "print this help and exit", "", nullptr},
        {{"-m", "--model"}, "FNAME", "GGUF model (default: $SPECEE_DEFAULT_MODEL, which the specee-cli console script sets to the embedded SmolLM2)", "", s(p.model)},
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
        {{"-c", "--ctx-size"}, "N", "context size in tokens (default: 0 = the model's training context, at most " + std::to_string(SPECEE_DEFAULT_N_CTX) + "; more only when asked for)", "an integer >= 0", i(p.n_ctx, 0)},
        {{"-b", "--batch-size"}, "N", "logical batch: prompt tokens per evaluation call (default: " + std::to_string(d.n_batch) + ")", "an integer >= 1", i(p.n_batch, 1)},
        {{"-ub", "--ubatch-size"}, "N", "physical batch: most tokens in one graph (default: " + std::to_string(d.n_ubatch) + ")", "an integer >= 1", i(p.n_ubatch, 1)},
        {{"-t", "--threads"}, "N", "threads (default: " + std::to_string(d.n_threads) + ", <= 0: all cores; at most " + std::to_string(specee_max_threads()) + ", 4 per core)", "an integer",
         [&p, d](const std::string & v) {
             const bool ok = parse_int(v, p.n_threads);
             p.n_threads   = ok && p.n_threads <= 0 ? d.n_threads : p.n_threads;
             if (ok && p.n_threads > specee_max_threads()) {
                 fprintf(stderr, "warning: -t %d is more than %d threads (4 per hardware thread, at most 512): using %d\n",
                         p.n_threads, specee_max_threads(), specee_max_threads());
                 p.n_threads = specee_max_threads();
             }
             return ok;
         }},
        {{"-cnv", "--conversation"}, "", "conversation mode: the chat template formats each turn and user lines are read from stdin after a '> ' prompt (default: on when the model has a chat template and stdin and stdout are terminals)", "", flag([&p] { p.conversation = CNV_ON; })},
        {{"-no-cnv", "--no-conversation"}, "", "plain completion of the prompt", "", flag([&p] { p.conversation = CNV_OFF; })},
        {{"-st", "--single-turn"}, "", "conversation mode: answer one turn (the -p prompt, or else the first line read), then exit", "", flag([&p] { p.single_turn = true; })},
        {{"--chat-template"}, "NAME", "chat template instead of the model's: chatml, smollm2, llama2, vicuna, llama3, zephyr, or a Jinja template text with the markers of one of them", "a known template",
         [&p](const std::string & v) {
             p.chat_template = v;
             return specee_chat_template_resolve(nullptr, v.c_str()) != nullptr;
         }},
        {{"-sp", "--special"}, "", "print special tokens of the output as text", "", flag([&p] { p.special = true; })},
        {{"--verbose-prompt"}, "", "print the prompt's tokens to stderr before generating", "", flag([&p] { p.verbose_prompt = true; })},
        {{"--no-display-prompt"}, "", "do not echo the prompt", "", flag([&p] { p.display_prompt = false; })},
        {{"-ctv", "--cache-type-v"}, "TYPE", "V cache type: f32 (default: a token's logits do not depend on the batch it is evaluated in, so speculative output is bit-identical to plain output) or f16 (half the memory; then a near-tie can flip between a verification pass and plain decoding)", "f16 or f32", one_of(p.cache_type_v, {"f16", "f32"})},
        {{"-ngl", "--gpu-layers", "--n-gpu-layers"}, "N", "layers on the devices other than the CPU (GPUs, --rpc servers), counting the output as one, as llama.cpp counts (default: -1 = all; without such a device everything stays on the CPU)", "an integer >= -1", i(p.n_gpu_layers, -1)},
        {{"--offload-order"}, "ORDER", "which layers -ngl offloads: first (SpecEE's: the first layers, the output and the draft head, so an early exit skips the layers left on the CPU), last (llama.cpp's) or auto (default: first when there are exit predictors, else last)", "first, last or auto", one_of(p.offload_order, {"auto", "first", "last"})},
        {{"-ts", "--tensor-split"}, "SPLIT", "the share of the offloaded layers each device gets, e.g. 3,1 (default: by free memory)", "comma-separated numbers >= 0",
         [&p](const std::string & v) {
             p.tensor_split.clear();
             std::stringstream ss(v);
             std::string       x;
             float             f = 0.0f;
             while (std::getline(ss, x, ',')) {
                 if (!parse_float(x, f) || f < 0.0f) {
                     return false;
                 }
                 p.tensor_split.push_back(f);
             }
             return !p.tensor_split.empty();
         }},
        {{"-dev", "--device"}, "LIST", "comma-separated devices to offload to (default: every GPU and --rpc server; see --list-devices)", "", s(p.devices)},
        {{"--list-devices"}, "", "print the devices (after adding the --rpc servers) and exit", "", flag([&p] { p.list_devices = true; })},
        {{"--rpc"}, "SERVERS", "comma-separated HOST:PORT of ggml RPC servers (specee-rpc-server, or llama.cpp's rpc-server) to offload layers to; each must answer a check within 5 s first; a server's token comes from the environment variable SPECEE_RPC_TOKEN", "", s(p.rpc_servers)},
        {{"-fa", "--flash-attn"}, "on|off|auto", "accepted for compatibility; attention is always computed with ggml's flash attention here (off is ignored with a warning)", "on, off or auto",
         [](const std::string & v) {
             if (v == "off") {
                 fprintf(stderr, "warning: -fa off is ignored: attention is always flash attention here\n");
             }
             return v == "on" || v == "off" || v == "auto";
         }},
        {{"--draft-head"}, "FNAME", "a draft head file (a GGUF with an EAGLE head and optionally exit predictors, e.g. from `python -m specee.convert merge --draft-head-only`), used instead of the model's own head and predictors (the load says what it replaced); 'default' = $SPECEE_DEFAULT_DRAFT_HEAD, which the specee-cli console script sets to the shipped head + exit predictors for the embedded SmolLM2", "a file name or 'default'",
         [&p](const std::string & v) {
             p.draft_head = v;
             return !v.empty();
         }},
    };
    add_generation_options(opts, p);
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
        head += o.value.empty() ? "" : " " + o.value;
        printf("%s", head.c_str());
        // the help wrapped at 110 columns from column 36
        size_t col = head.size();
        if (col >= 35) {
            printf("\n");
            col = 0;
        }
        printf("%*s", (int) (36 - col), "");
        col = 36;
        std::istringstream words(o.help);
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
    if (help) {
        print_usage(argv[0], opts);
    }
    return true;
}
