// llama-cli: text generation and chat with the SpecEE runtime, a drop-in for upstream llama.cpp's
// llama-cli (the prompt-completion tool, now llama-completion upstream) over specee.h only.
//
// Same flags, same output: the prompt is echoed, the generated text streams to stdout, and at the end
// the timing lines of llama_perf_context_print go to stderr, which evaluation scripts parse.
//
//   completion     tokenize the prompt, prefill it in -b chunks, then sample and decode one token at a
//                  time until an end-of-generation token, -n tokens, or a full context
//   conversation   with a chat template, in a terminal (or with -cnv): each user line is added to the
//                  conversation, the whole conversation is rendered again, and only the new suffix of
//                  the rendering is evaluated, so the KV cache keeps every earlier turn
#include "specee.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

// ---- options -----------------------------------------------------------------------------------

enum cnv_mode { CNV_AUTO, CNV_ON, CNV_OFF };

struct cli_params {
    std::string model;
    std::string prompt;
    std::string system_prompt;
    std::string chat_template;
    int         n_predict      = -1;
    int         n_ctx          = 0;
    int         n_batch        = 2048;
    int         n_ubatch       = 512;
    int         n_threads      = std::max(1, (int) std::thread::hardware_concurrency());
    uint32_t    seed           = SPECEE_DEFAULT_SEED;
    float       temp           = 0.8f;
    int         top_k          = 40;
    float       top_p          = 0.95f;
    float       min_p          = 0.05f;
    float       repeat_penalty = 1.0f;
    int         repeat_last_n  = 64;
    int         n_gpu_layers   = -1; // accepted, never used: this runtime computes on the CPU
    bool        escape         = true;
    bool        special        = false;
    cnv_mode    conversation   = CNV_AUTO;
    bool        single_turn    = false;
    bool        verbose_prompt = false;
    bool        display_prompt = true;
    bool        ignore_eos     = false;
    std::string cache_type_v   = "auto"; // auto: f32 under speculative decoding (lossless), else f16
    // speculative decoding with the EAGLE head
    std::string spec           = "auto"; // auto: eagle2 when the model has a head (or --draft-head), else none
    std::string draft_head;
    std::string eagle_choices;           // static tree (implies eagle under auto)
    int         eagle_total_tokens = -1; // dynamic tree settings, -1: the runtime's defaults
    int         eagle_depth        = -1;
    int         eagle_topk         = -1;
    // SpecEE early exit
    int         early_exit         = -1; // -1 auto: on when the model has a head and exit predictors and decoding is greedy
    float       exit_threshold     = -1.0f; // < 0: the model's specee.exit.threshold
    std::vector<int32_t> exit_layers;       // empty: the model's specee.exit.layers
    std::string exit_kv            = "mask";
};

static void print_usage(const char * argv0) {
    const cli_params d;
    printf("usage: %s [options]\n\n", argv0);
    printf("Generates text with the SpecEE runtime, like llama.cpp's llama-cli: the prompt is echoed, the\n");
    printf("continuation streams to stdout, and timing lines in llama_perf_context_print's format go to stderr.\n");
    printf("Sampling chain: repetition penalty -> top-k -> top-p -> min-p -> temperature -> seeded draw.\n\n");
    printf("options:\n");
    printf("  -h,    --help                    print this help and exit\n");
    printf("  -m,    --model FNAME             GGUF model (default: $SPECEE_DEFAULT_MODEL, which the\n");
    printf("                                   specee-cli console script sets to the embedded SmolLM2)\n");
    printf("  -p,    --prompt PROMPT           prompt to start generation with; for a system message use -sys\n");
    printf("  -f,    --file FNAME              a file containing the prompt (one trailing newline dropped)\n");
    printf("  -sys,  --system-prompt PROMPT    system message for conversation mode\n");
    printf("  -e,    --escape                  process escapes (\\n, \\r, \\t, \\', \\\", \\\\, \\xNN) in the\n");
    printf("                                   prompt and in conversation input (default: on)\n");
    printf("         --no-escape               do not process escapes\n");
    printf("  -n,    --n-predict N             tokens to predict (default: %d, -1 = until end of generation or\n",
           d.n_predict);
    printf("                                   a full context, -2 = until a full context)\n");
    printf("  -c,    --ctx-size N              context size in tokens (default: %d, 0 = the model's)\n", d.n_ctx);
    printf("  -b,    --batch-size N            logical batch: prompt tokens per evaluation call (default: %d)\n",
           d.n_batch);
    printf("  -ub,   --ubatch-size N           physical batch: most tokens in one graph (default: %d)\n",
           d.n_ubatch);
    printf("  -t,    --threads N               threads (default: %d)\n", d.n_threads);
    printf("  -s,    --seed SEED               RNG seed (default: %u = a random seed)\n", SPECEE_DEFAULT_SEED);
    printf("         --temp N                  temperature (default: %.2f, <= 0 = greedy)\n", (double) d.temp);
    printf("         --top-k, --top_k N        top-k sampling (default: %d, 0 = off)\n", d.top_k);
    printf("         --top-p, --top_p N        top-p sampling, in (0, 1] (default: %.2f, 1.0 = off)\n",
           (double) d.top_p);
    printf("         --min-p, --min_p N        min-p sampling, in [0, 1] (default: %.2f, 0.0 = off)\n",
           (double) d.min_p);
    printf("         --repeat-penalty N        penalise repeated tokens (default: %.2f, 1.0 = off)\n",
           (double) d.repeat_penalty);
    printf("         --repeat-last-n N         tokens the penalty looks back over (default: %d, 0 = off,\n",
           d.repeat_last_n);
    printf("                                   -1 = the context size)\n");
    printf("  -ngl,  --gpu-layers, --n-gpu-layers N\n");
    printf("                                   accepted for compatibility; this runtime computes on the CPU,\n");
    printf("                                   so the value is ignored (with a warning)\n");
    printf("  -fa,   --flash-attn [on|off|auto]\n");
    printf("                                   accepted for compatibility; attention is always computed with\n");
    printf("                                   ggml's flash attention here (off is ignored with a warning)\n");
    printf("  -cnv,  --conversation            conversation mode: the chat template formats each turn and\n");
    printf("                                   user lines are read from stdin after a '> ' prompt (default:\n");
    printf("                                   on when the model has a chat template and stdin and stdout\n");
    printf("                                   are terminals)\n");
    printf("  -no-cnv, --no-conversation       plain completion of the prompt\n");
    printf("  -st,   --single-turn             conversation mode: answer one turn (the -p prompt, or else the\n");
    printf("                                   first line read), then exit\n");
    printf("         --chat-template NAME      chat template instead of the model's: chatml, smollm2, llama2,\n");
    printf("                                   vicuna, llama3, zephyr, or a Jinja template text that contains\n");
    printf("                                   the markers of one of them\n");
    printf("  -sp,   --special                 print special tokens of the output as text\n");
    printf("         --verbose-prompt          print the prompt's tokens to stderr before generating\n");
    printf("         --no-display-prompt       do not echo the prompt\n");
    printf("         --ignore-eos              never generate an end-of-generation token (its logit is -inf), so\n");
    printf("                                   a run goes on to -n tokens or a full context\n");
    printf("  -ctv,  --cache-type-v TYPE       V cache type: f16, f32 or auto (default: f32 under speculative\n");
    printf("                                   decoding, else f16); with f32 a token's logits do not depend on the\n");
    printf("                                   batch it is evaluated in, so speculative output is bit-identical to\n");
    printf("                                   plain output (with f16 a near-tie can flip)\n");
    printf("\nspeculative decoding (EAGLE draft head, lossless: greedy output = plain output, sampling keeps the\n");
    printf("distribution; the perf lines add the mean accepted tokens per step):\n");
    printf("         --spec MODE               none, eagle (EAGLE-1 static tree), eagle2 (EAGLE-2 dynamic tree) or\n");
    printf("                                   auto (default): eagle2 when the model has a head or --draft-head is\n");
    printf("                                   given (eagle when only --eagle-choices is), else none\n");
    printf("         --draft-head FNAME        EAGLE head GGUF of its own (eagle.* tensors, e.g. from `python -m\n");
    printf("                                   specee.convert merge --head-only`), used instead of the model's;\n");
    printf("                                   'default' = $SPECEE_DEFAULT_DRAFT_HEAD, which the specee-cli\n");
    printf("                                   console script sets to the shipped head + exit predictors for\n");
    printf("                                   the embedded SmolLM2\n");
    printf("         --eagle-choices, --eagle_choices CHOICES\n");
    printf("                                   EAGLE-1 tree: child-rank paths \"[[0], [1], [0, 0], ...]\" or the preset\n");
    printf("                                   mc_sim_7b_63 (TensorRT-LLM's GPU default; default here: [[0]], the\n");
    printf("                                   fastest on a CPU)\n");
    printf("         --eagle-total-tokens N    EAGLE-2: draft tokens verified per step (default: %d)\n",
           specee_spec_default_params().total_tokens);
    printf("         --eagle-depth N           EAGLE-2: most draft tokens on one path (default: %d)\n",
           specee_spec_default_params().depth);
    printf("         --eagle-topk, --eagle_dynamic_tree_max_top_k N\n");
    printf("                                   EAGLE-2: children per expanded node and nodes expanded per depth\n");
    printf("                                   (default: %d)\n", specee_spec_default_params().top_k);
    printf("         --eagle_use_dynamic_tree  TensorRT-LLM's spelling of --spec eagle2\n");
    printf("\nearly exit (SpecEE: per-layer predictors stop a token's pass early when the EAGLE head's candidates\n");
    printf("agree; greedy only, lossy; the perf lines add the exit ratio, mean exit layer and a histogram):\n");
    printf("         --early-exit              on (default: on when the model, or --draft-head, has exit predictors\n");
    printf("                                   and an EAGLE head and --temp is 0)\n");
    printf("         --no-early-exit           off (plain or speculative decoding)\n");
    printf("         --exit-threshold F        a predictor fires above F (default: the file's, SpecEE's 0.5)\n");
    printf("         --exit-layers LAYERS      the static set of checked layers, e.g. 16,20,24 (default: the file's)\n");
    printf("         --exit-kv POLICY          the skipped layers' cache for an exited token: mask (nothing, later\n");
    printf("                                   tokens do not see it there; SpecEE's; default) or fill (K/V from the\n");
    printf("                                   exit layer's output)\n");
}

static bool parse_int(const std::string & s, int & out) {
    errno      = 0;
    char * end = nullptr;
    long   v   = std::strtol(s.c_str(), &end, 10);
    if (s.empty() || *end != '\0' || errno == ERANGE || v < INT_MIN || v > INT_MAX) {
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

// a 32-bit seed; -1 (as upstream, which reads it with stoul) is the "random" seed 0xFFFFFFFF
static bool parse_seed(const std::string & s, uint32_t & out) {
    if (s == "-1") {
        out = SPECEE_DEFAULT_SEED;
        return true;
    }
    errno                      = 0;
    char *                   end = nullptr;
    const unsigned long long v   = std::strtoull(s.c_str(), &end, 10);
    if (s.empty() || s[0] == '-' || *end != '\0' || errno == ERANGE || v > UINT32_MAX) {
        return false;
    }
    out = (uint32_t) v;
    return true;
}

static bool read_text_file(const std::string & path, std::string & out) {
    std::ifstream f(path, std::ios::binary);
    if (!f) {
        return false;
    }
    std::ostringstream ss;
    ss << f.rdbuf();
    out = ss.str();
    return true;
}

// returns false with a message on stderr when the command line is malformed
static bool parse_args(int argc, char ** argv, cli_params & p, bool & help) {
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        // flags without a value
        if (arg == "-h" || arg == "--help") {
            help = true;
            return true;
        } else if (arg == "-e" || arg == "--escape") {
            p.escape = true;
        } else if (arg == "--no-escape") {
            p.escape = false;
        } else if (arg == "-cnv" || arg == "--conversation") {
            p.conversation = CNV_ON;
        } else if (arg == "-no-cnv" || arg == "--no-conversation") {
            p.conversation = CNV_OFF;
        } else if (arg == "-st" || arg == "--single-turn") {
            p.single_turn = true;
        } else if (arg == "-sp" || arg == "--special") {
            p.special = true;
        } else if (arg == "--verbose-prompt") {
            p.verbose_prompt = true;
        } else if (arg == "--ignore-eos") {
            p.ignore_eos = true;
        } else if (arg == "--no-display-prompt") {
            p.display_prompt = false;
        } else if (arg == "-fa" || arg == "--flash-attn") {
            // upstream takes on/off/auto (older builds: no value); flash attention is the only path here
            if (i + 1 < argc) {
                const std::string v = argv[i + 1];
                if (v == "on" || v == "off" || v == "auto" || v == "1" || v == "0") {
                    ++i;
                    if (v == "off" || v == "0") {
                        fprintf(stderr, "warning: %s off is ignored: attention is always flash attention here\n",
                                arg.c_str());
                    }
                }
            }
        } else if (arg == "--eagle_use_dynamic_tree" || arg == "--eagle-use-dynamic-tree") {
            p.spec = "eagle2";
        } else if (arg == "--early-exit") {
            p.early_exit = 1;
        } else if (arg == "--no-early-exit") {
            p.early_exit = 0;
        } else {
            // flags with a value
            static const char * const with_value[] = {
                "-m", "--model", "-p", "--prompt", "-f", "--file", "-sys", "--system-prompt", "-n", "--n-predict",
                "-c", "--ctx-size", "-b", "--batch-size", "-ub", "--ubatch-size", "-t", "--threads", "-s", "--seed",
                "--temp", "--top-k", "--top_k", "--top-p", "--top_p", "--min-p", "--min_p", "--repeat-penalty",
                "--repeat-last-n", "-ngl", "--gpu-layers", "--n-gpu-layers", "--chat-template", "-ctv",
                "--cache-type-v", "--spec", "--draft-head", "--eagle-choices", "--eagle_choices",
                "--eagle-total-tokens", "--eagle-depth", "--eagle-topk", "--eagle_dynamic_tree_max_top_k",
                "--exit-threshold", "--exit-layers", "--exit-kv"};
            bool known = false;
            for (const char * f : with_value) {
                known = known || arg == f;
            }
            if (!known) {
                fprintf(stderr, "error: unknown argument: %s (see --help)\n", arg.c_str());
                return false;
            }
            if (i + 1 >= argc) {
                fprintf(stderr, "error: %s needs a value (see --help)\n", arg.c_str());
                return false;
            }
            const std::string val = argv[++i];
            bool              ok  = true;
            const char *      what = "a number";
            if (arg == "-m" || arg == "--model") {
                p.model = val;
            } else if (arg == "-p" || arg == "--prompt") {
                p.prompt = val;
            } else if (arg == "-f" || arg == "--file") {
                if (!read_text_file(val, p.prompt)) {
                    fprintf(stderr, "error: cannot read the prompt file '%s': %s\n", val.c_str(), strerror(errno));
                    return false;
                }
                if (!p.prompt.empty() && p.prompt.back() == '\n') {
                    p.prompt.pop_back();
                }
            } else if (arg == "-sys" || arg == "--system-prompt") {
                p.system_prompt = val;
            } else if (arg == "--chat-template") {
                p.chat_template = val;
            } else if (arg == "-ctv" || arg == "--cache-type-v") {
                what = "f16, f32 or auto";
                ok   = val == "f16" || val == "f32" || val == "auto";
                p.cache_type_v = val;
            } else if (arg == "--spec") {
                what = "none, eagle, eagle2 or auto";
                ok   = val == "none" || val == "eagle" || val == "eagle2" || val == "auto";
                p.spec = val;
            } else if (arg == "--draft-head") {
                p.draft_head = val;
            } else if (arg == "--exit-threshold") {
                what = "a number in [0, 1]";
                ok   = parse_float(val, p.exit_threshold) && p.exit_threshold >= 0.0f && p.exit_threshold <= 1.0f;
            } else if (arg == "--exit-layers") {
                what = "comma-separated layer numbers like 16,20,24";
                p.exit_layers.clear();
                size_t i = 0;
                ok       = !val.empty();
                while (ok && i <= val.size()) {
                    const size_t j = std::min(val.find(',', i), val.size());
                    int          l = -1;
                    ok             = parse_int(val.substr(i, j - i), l) && l >= 0;
                    p.exit_layers.push_back(l);
                    i = j + 1;
                }
            } else if (arg == "--exit-kv") {
                what = "mask or fill";
                ok   = val == "mask" || val == "fill";
                p.exit_kv = val;
            } else if (arg == "--eagle-choices" || arg == "--eagle_choices") {
                what = "a choices list like [[0], [1], [0, 0]] or the preset mc_sim_7b_63";
                ok   = specee_spec_check_choices(val.c_str()) >= 0;
                if (!ok) {
                    fprintf(stderr, "error: %s\n", specee_last_error());
                    return false;
                }
                p.eagle_choices = val;
            } else if (arg == "--eagle-total-tokens") {
                what = "an integer >= 1";
                ok   = parse_int(val, p.eagle_total_tokens) && p.eagle_total_tokens >= 1;
            } else if (arg == "--eagle-depth") {
                what = "an integer >= 1";
                ok   = parse_int(val, p.eagle_depth) && p.eagle_depth >= 1;
            } else if (arg == "--eagle-topk" || arg == "--eagle_dynamic_tree_max_top_k") {
                what = "an integer >= 1";
                ok   = parse_int(val, p.eagle_topk) && p.eagle_topk >= 1;
            } else if (arg == "-n" || arg == "--n-predict") {
                what = "an integer >= -2";
                ok   = parse_int(val, p.n_predict) && p.n_predict >= -2;
            } else if (arg == "-c" || arg == "--ctx-size") {
                what = "an integer >= 0";
                ok   = parse_int(val, p.n_ctx) && p.n_ctx >= 0;
            } else if (arg == "-b" || arg == "--batch-size") {
                what = "an integer >= 1";
                ok   = parse_int(val, p.n_batch) && p.n_batch >= 1;
            } else if (arg == "-ub" || arg == "--ubatch-size") {
                what = "an integer >= 1";
                ok   = parse_int(val, p.n_ubatch) && p.n_ubatch >= 1;
            } else if (arg == "-t" || arg == "--threads") {
                what = "an integer (<= 0 = all cores)";
                ok   = parse_int(val, p.n_threads);
                if (ok && p.n_threads <= 0) {
                    p.n_threads = cli_params().n_threads;
                }
            } else if (arg == "-s" || arg == "--seed") {
                what = "an unsigned 32-bit integer";
                ok   = parse_seed(val, p.seed);
            } else if (arg == "--temp") {
                ok = parse_float(val, p.temp);
            } else if (arg == "--top-k" || arg == "--top_k") {
                what = "an integer";
                ok   = parse_int(val, p.top_k);
            } else if (arg == "--top-p" || arg == "--top_p") {
                what = "a number in (0, 1]";
                ok   = parse_float(val, p.top_p) && p.top_p > 0.0f && p.top_p <= 1.0f;
            } else if (arg == "--min-p" || arg == "--min_p") {
                what = "a number in [0, 1]";
                ok   = parse_float(val, p.min_p) && p.min_p >= 0.0f && p.min_p <= 1.0f;
            } else if (arg == "--repeat-penalty") {
                what = "a finite number > 0";
                ok   = parse_float(val, p.repeat_penalty) && p.repeat_penalty > 0.0f && std::isfinite(p.repeat_penalty);
            } else if (arg == "--repeat-last-n") {
                what = "an integer >= -1";
                ok   = parse_int(val, p.repeat_last_n) && p.repeat_last_n >= -1;
            } else { // -ngl
                what = "an integer";
                ok   = parse_int(val, p.n_gpu_layers);
            }
            if (!ok) {
                fprintf(stderr, "error: invalid value for %s: '%s' (expected %s)\n", arg.c_str(), val.c_str(), what);
                return false;
            }
        }
    }
    return true;
}

// ---- text helpers ------------------------------------------------------------------------------

// the escapes upstream's llama-cli processes: \n \r \t \' \" \\ \a \b \f \v \? \xNN; others stay as written
static std::string process_escapes(const std::string & s) {
    std::string out;
    for (size_t i = 0; i < s.size(); ++i) {
        if (s[i] != '\\' || i + 1 >= s.size()) {
            out += s[i];
            continue;
        }
        const char c = s[++i];
        switch (c) {
            case 'n': out += '\n'; break;
            case 'r': out += '\r'; break;
            case 't': out += '\t'; break;
            case 'a': out += '\a'; break;
            case 'b': out += '\b'; break;
            case 'f': out += '\f'; break;
            case 'v': out += '\v'; break;
            case '\'': out += '\''; break;
            case '"': out += '"'; break;
            case '?': out += '?'; break;
            case '\\': out += '\\'; break;
            case 'x': {
                int    v = 0, n = 0;
                size_t j = i + 1;
                for (; j < s.size() && n < 2 && isxdigit((unsigned char) s[j]); ++j, ++n) {
                    v = v * 16 + (isdigit((unsigned char) s[j]) ? s[j] - '0' : (tolower(s[j]) - 'a' + 10));
                }
                if (n == 2) {
                    out += (char) v;
                    i = j - 1;
                } else {
                    out += "\\x";
                }
                break;
            }
            default:
                out += '\\';
                out += c;
        }
    }
    return out;
}

// length of the prefix of s that ends on a whole UTF-8 sequence (an incomplete tail is held back)
static size_t utf8_complete_prefix(const std::string & s) {
    size_t n = s.size();
    // look back at most 3 bytes for the lead byte of an unfinished sequence
    for (size_t back = 1; back <= 3 && back <= n; ++back) {
        const unsigned char c = (unsigned char) s[n - back];
        if ((c & 0xC0) == 0x80) {
            continue; // continuation byte
        }
        size_t len = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 1;
        return len > back ? n - back : n;
    }
    return n;
}

// prints token pieces as they come, holding back an incomplete UTF-8 sequence until it completes
struct text_stream {
    std::string pending;

    void write(const std::string & piece) {
        pending += piece;
        const size_t n = utf8_complete_prefix(pending);
        if (n > 0) {
            fwrite(pending.data(), 1, n, stdout);
            fflush(stdout);
            pending.erase(0, n);
        }
    }
    void flush() {
        if (!pending.empty()) {
            fwrite(pending.data(), 1, pending.size(), stdout);
            pending.clear();
        }
        fflush(stdout);
    }
};

static std::string token_piece(const specee_model * model, int32_t token, bool special) {
    char    buf[128];
    int32_t n = specee_token_to_piece(model, token, buf, sizeof(buf), special);
    if (n >= 0) {
        return std::string(buf, n);
    }
    if (n == INT32_MIN) {
        return std::string();
    }
    std::string big(-n, '\0');
    n = specee_token_to_piece(model, token, &big[0], (int32_t) big.size(), special);
    return n >= 0 ? big.substr(0, n) : std::string();
}

// text to tokens; false with specee_last_error() on failure
static bool tokenize(const specee_model * model, const std::string & text, bool add_special, bool parse_special,
                     std::vector<int32_t> & out) {
    out.resize(text.size() + 8);
    int32_t n = specee_tokenize(model, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(),
                                add_special, parse_special);
    if (n == INT32_MIN) {
        return false;
    }
    if (n < 0) {
        out.resize(-n);
        n = specee_tokenize(model, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), add_special,
                            parse_special);
        if (n < 0) {
            return false;
        }
    }
    out.resize(n);
    return true;
}

// ---- timings (llama_perf_context_print's lines) -------------------------------------------------

using clock_type = std::chrono::steady_clock;

static double ms_since(clock_type::time_point t0) {
    return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

struct perf_counters {
    double                 t_load_ms   = 0.0;
    clock_type::time_point t_start;          // after loading: where "total time" starts
    double                 t_p_eval_ms = 0.0; // evaluations of more than one token
    int                    n_p_eval    = 0;
    double                 t_eval_ms   = 0.0; // single-token evaluations
    int                    n_eval      = 0;
    double                 t_sample_ms = 0.0;
    int                    n_sample    = 0;
    const specee_spec *    spec        = nullptr; // speculative decoding: its statistics are printed too
    bool                   early_exit  = false;   // early exit: its statistics instead
    std::vector<int32_t>   exit_hist;             // tokens per exit layer [n_layer]
};

// same fields, widths and precision as upstream (0 tokens print nan/inf there too)
static void perf_print(const perf_counters & pc) {
    const double t_total_ms = ms_since(pc.t_start);
    fprintf(stderr,
            "llama_perf_sampler_print:    sampling time = %10.2f ms / %5d runs   "
            "(%8.2f ms per token, %8.2f tokens per second)\n",
            pc.t_sample_ms, pc.n_sample, pc.t_sample_ms / pc.n_sample, 1e3 / pc.t_sample_ms * pc.n_sample);
    fprintf(stderr, "llama_perf_context_print:        load time = %10.2f ms\n", pc.t_load_ms);
    fprintf(stderr,
            "llama_perf_context_print: prompt eval time = %10.2f ms / %5d tokens "
            "(%8.2f ms per token, %8.2f tokens per second)\n",
            pc.t_p_eval_ms, pc.n_p_eval, pc.t_p_eval_ms / pc.n_p_eval, 1e3 / pc.t_p_eval_ms * pc.n_p_eval);
    fprintf(stderr,
            "llama_perf_context_print:        eval time = %10.2f ms / %5d runs   "
            "(%8.2f ms per token, %8.2f tokens per second)\n",
            pc.t_eval_ms, pc.n_eval, pc.t_eval_ms / pc.n_eval, 1e3 / pc.t_eval_ms * pc.n_eval);
    fprintf(stderr, "llama_perf_context_print:       total time = %10.2f ms / %5d tokens\n", t_total_ms,
            pc.n_p_eval + pc.n_eval);
    if (pc.spec && pc.early_exit) {
        const specee_exit_stats st = specee_spec_get_exit_stats(pc.spec);
        const int32_t           L  = (int32_t) pc.exit_hist.size();
        fprintf(stderr,
                "llama_perf_context_print:       early exit = %5d tokens, exit ratio %.3f, mean exit layer %.2f of %d "
                "(%d checks, %d fired, %d not a candidate; head %.2f ms, checks %.2f ms, exit lm_head %.2f ms)\n",
                st.n_tokens, st.n_tokens > 0 ? (double) st.n_exits / st.n_tokens : 0.0,
                st.n_tokens > 0 ? (double) st.sum_layers / st.n_tokens : 0.0, L, st.n_checks, st.n_fired,
                st.n_rejected, st.t_head_ms, st.t_check_ms, st.t_exit_ms);
        std::string hist;
        for (int32_t il = 0; il < L; ++il) {
            if (pc.exit_hist[il] > 0) {
                char buf[32];
                snprintf(buf, sizeof(buf), " %d:%d", il + 1, pc.exit_hist[il]);
                hist += buf;
            }
        }
        fprintf(stderr, "llama_perf_context_print: exit histogram = layer:tokens%s\n", hist.c_str());
    } else if (pc.spec) {
        // eval time above counts one run per draft-and-verify step
        const specee_spec_stats st = specee_spec_get_stats(pc.spec);
        fprintf(stderr,
                "llama_perf_context_print:      speculative = %5d steps, %6.2f mean accepted tokens per step "
                "(%d of %d draft tokens accepted; draft %.2f ms, verify %.2f ms)\n",
                st.n_steps, st.n_steps > 0 ? (double) st.n_tokens / st.n_steps : 0.0, st.n_accepted, st.n_drafted,
                st.t_draft_ms, st.t_verify_ms);
    }
}

// ---- generation --------------------------------------------------------------------------------

struct session {
    const cli_params & params;
    specee_model *     model = nullptr;
    specee_context *   ctx   = nullptr;
    specee_sampler *   smpl  = nullptr;
    int32_t            n_ctx   = 0;
    int32_t            n_vocab = 0;
    int32_t            n_past  = 0; // tokens in the KV cache
    perf_counters      perf;
    text_stream        out;
    specee_spec *        spec = nullptr; // speculative decoding (and early exit, which drives its head)
    specee_exit_params   exit_params{};
    std::vector<int32_t> spec_input;     // tokens fed but not evaluated yet: the decoder prefills them

    explicit session(const cli_params & p) : params(p) {}
};

// evaluate tokens after the cached ones, in chunks of -b tokens; false with a message on failure
static bool feed(session & s, const std::vector<int32_t> & tokens) {
    if (s.n_past + (int32_t) tokens.size() > s.n_ctx) {
        fprintf(stderr, "\nerror: the input does not fit in the context (%d + %zu tokens > n_ctx = %d)\n", s.n_past,
                tokens.size(), s.n_ctx);
        return false;
    }
    if (s.spec) {
        s.spec_input.insert(s.spec_input.end(), tokens.begin(), tokens.end());
        return true;
    }
    for (size_t i = 0; i < tokens.size(); i += (size_t) s.params.n_batch) {
        const int32_t n  = (int32_t) std::min(tokens.size() - i, (size_t) s.params.n_batch);
        specee_batch  b  = {n, tokens.data() + i, nullptr, nullptr, nullptr};
        const auto    t0 = clock_type::now();
        if (specee_eval(s.ctx, &b) != 0) {
            fprintf(stderr, "\nerror: evaluation failed: %s\n", specee_last_error());
            return false;
        }
        const double dt = ms_since(t0);
        if (n == 1) {
            s.perf.t_eval_ms += dt;
            s.perf.n_eval += 1;
        } else {
            s.perf.t_p_eval_ms += dt;
            s.perf.n_p_eval += n;
        }
        s.n_past += n;
    }
    return true;
}

static int32_t sample(session & s) {
    const auto    t0 = clock_type::now();
    const int32_t id = specee_sampler_sample(s.smpl, specee_get_logits(s.ctx), s.n_vocab);
    if (id >= 0) {
        specee_sampler_accept(s.smpl, id);
    }
    s.perf.t_sample_ms += ms_since(t0);
    s.perf.n_sample += 1;
    return id;
}

enum gen_stop { STOP_EOG, STOP_LIMIT, STOP_CONTEXT, STOP_ERROR };

// prints a generated token; true when it ends generation
static bool emit(session & s, int32_t token, std::string & text) {
    const bool eog = specee_token_is_eog(s.model, token);
    s.out.write(token_piece(s.model, token, s.params.special));
    if (!eog) {
        text += token_piece(s.model, token, false);
    }
    return eog;
}

// Speculative generate(): the decoder prefills the fed tokens and samples the first token, then each step
// returns the accepted draft tokens and one more. Eval time counts one run per step.
static gen_stop generate_spec(session & s, int n_predict, int32_t & last, std::string & text) {
    last = -1;
    if (n_predict == 0) {
        return STOP_LIMIT;
    }
    const auto    t0 = clock_type::now();
    const int32_t first =
        specee_spec_prefill(s.spec, s.smpl, s.spec_input.data(), (int32_t) s.spec_input.size());
    if (first < 0) {
        fprintf(stderr, "\nerror: evaluation failed: %s\n", specee_last_error());
        return STOP_ERROR;
    }
    s.perf.t_p_eval_ms += ms_since(t0);
    s.perf.n_p_eval += (int) s.spec_input.size();
    s.n_past += (int32_t) s.spec_input.size();
    s.spec_input.clear();

    std::vector<int32_t> queue = {first}, buf(256);
    size_t               qi    = 0;
    for (int n = 0; n_predict < 0 || n < n_predict; ++n) {
        if (qi == queue.size()) {
            if (s.n_past + 1 > s.n_ctx) {
                fprintf(stderr, "\n\nllama-cli: context full (n_ctx = %d) => stopping\n", s.n_ctx);
                return STOP_CONTEXT;
            }
            if (s.perf.early_exit) {
                const auto    t1    = clock_type::now();
                int32_t       layer = -1;
                const int32_t t     = specee_spec_step_exit(s.spec, s.smpl, &s.exit_params, &layer);
                if (t < 0) {
                    fprintf(stderr, "\nerror: early-exit step failed: %s\n", specee_last_error());
                    return STOP_ERROR;
                }
                s.perf.t_eval_ms += ms_since(t1);
                s.perf.n_eval += 1;
                s.perf.exit_hist[layer] += 1;
                s.n_past = specee_kv_n_used(s.ctx);
                queue.assign(1, t);
                qi = 0;
                last = queue[qi++];
                s.perf.n_sample += 1;
                if (emit(s, last, text)) {
                    return STOP_EOG;
                }
                continue;
            }
            const int32_t n_max   = n_predict < 0 ? (int32_t) buf.size() : std::min((int32_t) buf.size(), n_predict - n);
            const double  t_acc   = specee_spec_get_stats(s.spec).t_accept_ms;
            const auto    t1      = clock_type::now();
            const int32_t k       = specee_spec_step(s.spec, s.smpl, buf.data(), n_max);
            const double  dt      = ms_since(t1);
            if (k < 0) {
                fprintf(stderr, "\nerror: speculative step failed: %s\n", specee_last_error());
                return STOP_ERROR;
            }
            const double dt_acc = specee_spec_get_stats(s.spec).t_accept_ms - t_acc; // sampling and bookkeeping
            s.perf.t_eval_ms += dt - dt_acc;
            s.perf.t_sample_ms += dt_acc;
            s.perf.n_eval += 1;
            s.n_past = specee_kv_n_used(s.ctx);
            queue.assign(buf.begin(), buf.begin() + k);
            qi = 0;
        }
        last = queue[qi++];
        s.perf.n_sample += 1;
        if (emit(s, last, text)) {
            return STOP_EOG;
        }
    }
    return STOP_LIMIT;
}

// Samples from the logits of the last evaluation and keeps decoding, printing each piece.
// The token that ends generation (end of generation, or the last of -n) is not evaluated: it is left in
// `last` for the caller. `text` collects the generated text (without special tokens).
static gen_stop generate(session & s, int n_predict, int32_t & last, std::string & text) {
    if (s.spec) {
        return generate_spec(s, n_predict, last, text);
    }
    last = -1;
    for (int n = 0; n_predict < 0 || n < n_predict; ++n) {
        if (last >= 0) {
            if (s.n_past + 1 > s.n_ctx) {
                fprintf(stderr, "\n\nllama-cli: context full (n_ctx = %d) => stopping\n", s.n_ctx);
                return STOP_CONTEXT;
            }
            if (!feed(s, {last})) {
                return STOP_ERROR;
            }
        }
        last = sample(s);
        if (last < 0) {
            fprintf(stderr, "\nerror: sampling failed: %s\n", specee_last_error());
            return STOP_ERROR;
        }
        if (emit(s, last, text)) {
            return STOP_EOG;
        }
    }
    return STOP_LIMIT;
}

static void print_prompt_tokens(const session & s, const std::string & prompt, const std::vector<int32_t> & tokens) {
    fprintf(stderr, "main: prompt: '%s'\n", prompt.c_str());
    fprintf(stderr, "main: number of tokens in prompt = %zu\n", tokens.size());
    for (int32_t t : tokens) {
        fprintf(stderr, "%6d -> '%s'\n", t, token_piece(s.model, t, true).c_str());
    }
    fprintf(stderr, "\n");
}

// tokens of the first input: BOS as the vocabulary asks, unless the text already starts with BOS's text
static bool tokenize_first(const session & s, const std::string & text, bool parse_special,
                           std::vector<int32_t> & out) {
    bool          add_special = true;
    const int32_t bos         = specee_token_bos(s.model);
    if (parse_special && bos >= 0) {
        const char * bos_text = specee_token_text(s.model, bos);
        add_special = !(bos_text && *bos_text && text.compare(0, strlen(bos_text), bos_text) == 0);
    }
    return tokenize(s.model, text, add_special, parse_special, out);
}

// the prompt's tokens go into the sampler's history (for the repetition penalty) and are echoed
static void accept_and_echo(session & s, const std::vector<int32_t> & tokens, bool echo) {
    for (int32_t t : tokens) {
        specee_sampler_accept(s.smpl, t);
        if (echo) {
            s.out.write(token_piece(s.model, t, s.params.special));
        }
    }
    s.out.flush();
}

// plain completion of the prompt; returns the exit status
static int run_completion(session & s, const std::string & prompt) {
    std::vector<int32_t> tokens;
    if (!tokenize_first(s, prompt, true, tokens)) {
        fprintf(stderr, "error: cannot tokenize the prompt: %s\n", specee_last_error());
        return 1;
    }
    if (tokens.empty()) {
        const int32_t bos = specee_token_bos(s.model);
        if (bos < 0) {
            fprintf(stderr, "error: input is empty\n");
            return 1;
        }
        tokens.push_back(bos);
    }
    if ((int) tokens.size() > s.n_ctx - 4) {
        fprintf(stderr, "error: prompt is too long (%zu tokens, max %d)\n", tokens.size(), s.n_ctx - 4);
        return 1;
    }
    if (s.params.verbose_prompt) {
        print_prompt_tokens(s, prompt, tokens);
    }
    if (s.params.n_predict == 0) {
        return 0;
    }
    accept_and_echo(s, tokens, s.params.display_prompt);
    if (!feed(s, tokens)) {
        return 1;
    }
    int32_t     last;
    std::string text;
    const int   n_predict = s.params.n_predict < 0 ? -1 : s.params.n_predict;
    gen_stop    stop      = generate(s, n_predict, last, text);
    s.out.flush();
    if (stop == STOP_ERROR) {
        return 1;
    }
    if (stop == STOP_EOG) {
        printf(" [end of text]\n");
    }
    return 0;
}

// ---- conversation ------------------------------------------------------------------------------

struct conversation {
    std::string                       tmpl; // template name
    std::vector<std::string>          roles, contents;

    std::string render(bool add_ass) const {
        std::vector<specee_chat_message> msgs;
        for (size_t i = 0; i < roles.size(); ++i) {
            msgs.push_back({roles[i].c_str(), contents[i].c_str()});
        }
        int32_t n = specee_chat_apply_template(tmpl.c_str(), msgs.data(), (int32_t) msgs.size(), add_ass, nullptr, 0);
        if (n == INT32_MIN) {
            return std::string();
        }
        std::string out(n < 0 ? -n : n, '\0');
        specee_chat_apply_template(tmpl.c_str(), msgs.data(), (int32_t) msgs.size(), add_ass, &out[0],
                                   (int32_t) out.size());
        return out;
    }
    void add(const std::string & role, const std::string & content) {
        roles.push_back(role);
        contents.push_back(content);
    }
};

// Adds a user message and evaluates the part of the rendered conversation the KV cache lacks: the rendering
// of the conversation so far is a prefix of the new one, so only the suffix goes in, after `pending` (the
// tokens the last reply left unevaluated). With an empty cache, or when the rendering is not a prefix, the
// whole conversation goes in (with BOS as the vocabulary asks).
static bool add_user_turn(session & s, conversation & conv, const std::string & user,
                          const std::vector<int32_t> & pending, bool echo) {
    const std::string before = conv.render(false);
    conv.add("user", user);
    const std::string after = conv.render(true);
    if (after.empty()) {
        fprintf(stderr, "error: cannot apply the chat template: %s\n", specee_last_error());
        return false;
    }
    std::vector<int32_t> tokens;
    bool                 ok;
    if (s.n_past > 0 && after.compare(0, before.size(), before) == 0) {
        // the model stopped at its end-of-turn token; a newline the template puts after it was never
        // evaluated, so it goes in front of the new suffix
        std::string suffix = after.substr(before.size());
        if (!before.empty() && before.back() == '\n') {
            suffix = "\n" + suffix;
        }
        ok = tokenize(s.model, suffix, false, true, tokens);
        tokens.insert(tokens.begin(), pending.begin(), pending.end());
    } else {
        specee_kv_clear(s.ctx);
        s.n_past = 0;
        ok       = tokenize_first(s, after, true, tokens);
    }
    if (!ok) {
        fprintf(stderr, "error: cannot tokenize the conversation: %s\n", specee_last_error());
        return false;
    }
    if (s.n_past + (int) tokens.size() > s.n_ctx - 4) {
        fprintf(stderr, "error: prompt is too long (%d tokens, max %d)\n", s.n_past + (int) tokens.size(),
                s.n_ctx - 4);
        return false;
    }
    if (s.params.verbose_prompt) {
        print_prompt_tokens(s, user, tokens);
    }
    specee_sampler_reset(s.smpl);
    accept_and_echo(s, tokens, echo);
    return feed(s, tokens);
}

// Generates the assistant's reply and records it. `pending` gets the tokens the cache lacks for the next
// turn: the end-of-generation token, or the last sampled token plus an end-of-turn token when -n cut it short.
static gen_stop assistant_turn(session & s, conversation & conv, std::vector<int32_t> & pending) {
    int32_t     last;
    std::string text;
    gen_stop    stop = generate(s, s.params.n_predict < 0 ? -1 : s.params.n_predict, last, text);
    s.out.flush();
    pending.clear();
    if (stop == STOP_EOG || stop == STOP_LIMIT) {
        pending.push_back(last);
    }
    if (stop == STOP_LIMIT) {
        const int32_t eot = specee_token_eot(s.model) >= 0 ? specee_token_eot(s.model) : specee_token_eos(s.model);
        if (eot >= 0) {
            pending.push_back(eot);
        }
    }
    conv.add("assistant", text);
    return stop;
}

// reads one line of user input after the "> " prompt; false at end of input
static bool read_user_line(std::string & line) {
    printf("\n> ");
    fflush(stdout);
    if (!std::getline(std::cin, line)) {
        printf("EOF by user\n");
        return false;
    }
    if (!line.empty() && line.back() == '\r') {
        line.pop_back();
    }
    return true;
}

// returns the exit status
static int run_conversation(session & s, const std::string & tmpl) {
    conversation conv;
    conv.tmpl = tmpl;
    if (!s.params.system_prompt.empty()) {
        conv.add("system", s.params.system_prompt);
    }
    std::vector<int32_t> pending;
    if (!s.params.prompt.empty()) {
        // the prompt pre-starts the conversation as the first user message
        if (!add_user_turn(s, conv, s.params.prompt, pending, s.params.display_prompt)) {
            return 1;
        }
        const gen_stop stop = assistant_turn(s, conv, pending);
        if (stop == STOP_ERROR) {
            return 1;
        }
        if (stop == STOP_CONTEXT || s.params.single_turn) {
            return 0;
        }
    }
    std::string line;
    while (read_user_line(line)) {
        if (s.params.escape) {
            line = process_escapes(line);
        }
        if (line.empty()) {
            continue;
        }
        if (!add_user_turn(s, conv, line, pending, false)) {
            return 1;
        }
        const gen_stop stop = assistant_turn(s, conv, pending);
        if (stop == STOP_ERROR) {
            return 1;
        }
        if (stop == STOP_CONTEXT || s.params.single_turn) {
            break;
        }
    }
    return 0;
}

// ---- main --------------------------------------------------------------------------------------

// the model's chat template name, or "" when it has none that this runtime knows
static std::string model_chat_template(const specee_model * model, bool & has_text) {
    has_text = false;
    for (int32_t i = 0; i < specee_model_meta_count(model); ++i) {
        if (strcmp(specee_model_meta_key(model, i), "tokenizer.chat_template") == 0) {
            has_text           = true;
            const char * name  = specee_chat_template_detect(specee_model_meta_value(model, i));
            return name ? name : "";
        }
    }
    return "";
}

int main(int argc, char ** argv) {
    cli_params params;
    bool       help = false;
    if (!parse_args(argc, argv, params, help)) {
        return 1;
    }
    if (help) {
        print_usage(argv[0]);
        return 0;
    }
    if (params.model.empty()) {
        const char * def = std::getenv("SPECEE_DEFAULT_MODEL");
        if (def == nullptr || *def == '\0') {
            fprintf(stderr, "error: no model given (-m FNAME) and SPECEE_DEFAULT_MODEL is not set\n");
            return 1;
        }
        params.model = def;
    }
    if (params.draft_head == "default") {
        const char * def = std::getenv("SPECEE_DEFAULT_DRAFT_HEAD");
        if (def == nullptr || *def == '\0') {
            fprintf(stderr, "error: --draft-head default: SPECEE_DEFAULT_DRAFT_HEAD is not set (run the specee-cli "
                            "console script, or give a head GGUF)\n");
            return 1;
        }
        params.draft_head = def;
    }
    if (params.escape) {
        params.prompt        = process_escapes(params.prompt);
        params.system_prompt = process_escapes(params.system_prompt);
    }
    if (params.n_gpu_layers > 0) {
        fprintf(stderr, "warning: -ngl %d is ignored: this build of SpecEE computes on the CPU only\n",
                params.n_gpu_layers);
    }
    std::string user_template;
    if (!params.chat_template.empty()) {
        const char * name = specee_chat_template_detect(params.chat_template.c_str());
        if (!name) {
            fprintf(stderr,
                    "error: unknown chat template '%s' (use chatml, smollm2, llama2, vicuna, llama3 or zephyr)\n",
                    params.chat_template.c_str());
            return 1;
        }
        user_template = name;
    }
    {
        std::ifstream f(params.model, std::ios::binary);
        if (!f) {
            fprintf(stderr, "error: cannot open the model file '%s': %s\n", params.model.c_str(), strerror(errno));
            return 1;
        }
    }

    specee_log_set_verbose(false);
    session s(params);

    const auto t_load = clock_type::now();
    s.model           = specee_model_load(params.model.c_str(), specee_model_default_params());
    if (!s.model) {
        fprintf(stderr, "error: failed to load the model '%s': %s\n", params.model.c_str(), specee_last_error());
        return 1;
    }
    if (!params.draft_head.empty() && specee_model_load_eagle(s.model, params.draft_head.c_str()) != 0) {
        fprintf(stderr, "error: failed to load the draft head '%s': %s\n", params.draft_head.c_str(),
                specee_last_error());
        specee_model_free(s.model);
        return 1;
    }
    s.perf.t_load_ms = ms_since(t_load);

    // early exit: auto is on with a head and predictors when decoding greedily
    const bool can_exit = specee_model_has_eagle(s.model) && specee_model_exit_n_pred(s.model) > 0;
    const bool exit_opts = params.exit_threshold >= 0.0f || !params.exit_layers.empty() || params.exit_kv != "mask";
    bool       early_exit = params.early_exit == 1 || (params.early_exit == -1 && can_exit && params.temp <= 0.0f);
    const char * exit_err = nullptr;
    if (early_exit && !can_exit) {
        exit_err = "--early-exit needs an EAGLE head and exit predictors (blk.N.pred.*) in the model or --draft-head";
    } else if (early_exit && params.temp > 0.0f) {
        exit_err = "early exit decodes greedily: use --temp 0, or --no-early-exit";
    } else if (early_exit && (params.spec == "eagle" || params.spec == "eagle2")) {
        exit_err = "early exit and --spec eagle/eagle2 are separate modes: add --no-early-exit for a speculative tree";
    } else if (!early_exit && exit_opts) {
        exit_err = can_exit ? "--exit-* settings given but early exit is off (--temp 0, or --early-exit)"
                            : "--exit-* settings given but the model has no exit predictors or EAGLE head";
    }
    for (int32_t l : params.exit_layers) {
        if (!exit_err && (l >= specee_model_n_layer(s.model) - 1 || !specee_model_exit_has_pred(s.model, l))) {
            exit_err = "--exit-layers lists a layer without an exit predictor (or the last layer)";
        }
    }
    if (exit_err) {
        fprintf(stderr, "error: %s\n", exit_err);
        specee_model_free(s.model);
        return 1;
    }

    specee_context_params cp = specee_context_default_params();
    cp.n_ctx                 = params.n_ctx > 0 ? (uint32_t) std::max(params.n_ctx, 8) : 0;
    cp.n_batch               = (uint32_t) std::min(params.n_batch, params.n_ubatch);
    cp.n_threads             = params.n_threads;
    cp.n_threads_batch       = params.n_threads;
    // auto: F32 V when speculative decoding will run (the same rule as --spec auto below), so that a token's
    // logits in a verification batch equal those of plain decoding bit for bit
    const bool spec_likely = !early_exit && (params.spec == "eagle" || params.spec == "eagle2" ||
                                             (params.spec == "auto" && specee_model_has_eagle(s.model)));
    const bool v_f32 = params.cache_type_v == "f32" || (params.cache_type_v == "auto" && spec_likely);
    cp.type_v        = v_f32 ? SPECEE_KV_F32 : SPECEE_KV_F16;
    s.ctx                    = specee_context_init(s.model, cp);
    if (!s.ctx) {
        fprintf(stderr, "error: cannot create the context: %s\n", specee_last_error());
        specee_model_free(s.model);
        return 1;
    }
    s.n_ctx   = (int32_t) specee_n_ctx(s.ctx);
    s.n_vocab = specee_model_n_vocab(s.model);

    specee_sampler_params sp = specee_sampler_default_params();
    sp.temp                  = params.temp;
    sp.top_k                 = params.top_k;
    sp.top_p                 = params.top_p;
    sp.min_p                 = params.min_p;
    sp.repeat_penalty        = params.repeat_penalty;
    sp.repeat_last_n         = params.repeat_last_n < 0 ? s.n_ctx : params.repeat_last_n;
    sp.seed                  = params.seed == SPECEE_DEFAULT_SEED ? std::random_device()() : params.seed;
    s.smpl                   = specee_sampler_init(sp);
    if (!s.smpl) {
        fprintf(stderr, "error: invalid sampling parameters: %s\n", specee_last_error());
        specee_context_free(s.ctx);
        specee_model_free(s.model);
        return 1;
    }
    if (params.ignore_eos) {
        std::vector<int32_t> eog(specee_token_eog_ids(s.model, nullptr, 0));
        specee_token_eog_ids(s.model, eog.data(), (int32_t) eog.size());
        for (int32_t t : eog) {
            specee_sampler_set_logit_bias(s.smpl, t, -INFINITY);
        }
    }

    // speculative decoding: auto is eagle2 with a head (eagle when only a choices list is given)
    const bool  dyn_set = params.eagle_total_tokens > 0 || params.eagle_depth > 0 || params.eagle_topk > 0;
    std::string spec    = params.spec;
    if (early_exit) {
        spec = "eagle2"; // the decoder whose head gives the candidates; its tree is not used
    } else if (spec == "auto") {
        spec = !specee_model_has_eagle(s.model)             ? "none"
               : !params.eagle_choices.empty() && !dyn_set ? "eagle"
                                                            : "eagle2";
    }
    const char * spec_err = nullptr;
    if (spec != "none" && !specee_model_has_eagle(s.model)) {
        spec_err = "speculative decoding needs an EAGLE head: the model has none (give one with --draft-head)";
    } else if (spec == "none" && (!params.eagle_choices.empty() || dyn_set)) {
        spec_err = specee_model_has_eagle(s.model) ? "--eagle-* settings given with --spec none"
                                                   : "--eagle-* settings given but the model has no EAGLE head "
                                                     "(give one with --draft-head)";
    } else if (spec == "eagle" && dyn_set) {
        spec_err = "--eagle-total-tokens, --eagle-depth and --eagle-topk set the EAGLE-2 tree (--spec eagle2)";
    } else if (spec == "eagle2" && !params.eagle_choices.empty()) {
        spec_err = "--eagle-choices sets the EAGLE-1 tree (--spec eagle), not the dynamic EAGLE-2 tree";
    }
    if (spec_err) {
        fprintf(stderr, "error: %s\n", spec_err);
        specee_sampler_free(s.smpl);
        specee_context_free(s.ctx);
        specee_model_free(s.model);
        return 1;
    }
    specee_spec_params spp = specee_spec_default_params();
    if (spec != "none") {
        spp.tree    = spec == "eagle" ? SPECEE_SPEC_TREE_STATIC : SPECEE_SPEC_TREE_DYNAMIC;
        spp.choices = params.eagle_choices.empty() ? nullptr : params.eagle_choices.c_str();
        if (params.eagle_total_tokens > 0) {
            spp.total_tokens = params.eagle_total_tokens;
        }
        if (params.eagle_depth > 0) {
            spp.depth = params.eagle_depth;
        }
        if (params.eagle_topk > 0) {
            spp.top_k = params.eagle_topk;
        }
        s.spec = specee_spec_init(s.ctx, spp);
        if (!s.spec) {
            fprintf(stderr, "error: cannot start speculative decoding: %s\n", specee_last_error());
            specee_sampler_free(s.smpl);
            specee_context_free(s.ctx);
            specee_model_free(s.model);
            return 1;
        }
        s.perf.spec = s.spec;
    }
    if (early_exit) {
        s.exit_params           = specee_exit_default_params();
        s.exit_params.threshold = params.exit_threshold;
        s.exit_params.layers    = params.exit_layers.empty() ? nullptr : params.exit_layers.data();
        s.exit_params.n_layers  = (int32_t) params.exit_layers.size();
        s.exit_params.kv_policy = params.exit_kv == "fill" ? SPECEE_EXIT_KV_FILL : SPECEE_EXIT_KV_MASK;
        s.perf.early_exit       = true;
        s.perf.exit_hist.assign(specee_model_n_layer(s.model), 0);
    }

    // conversation mode: on by default when there is a chat template and a person at a terminal
    bool              has_template_text = false;
    const std::string model_template    = model_chat_template(s.model, has_template_text);
    std::string       tmpl              = !user_template.empty() ? user_template : model_template;
    bool              cnv               = params.conversation == CNV_ON;
    if (params.conversation == CNV_AUTO) {
        cnv = !tmpl.empty() && isatty(STDIN_FILENO) && isatty(STDOUT_FILENO);
        if (cnv) {
            fprintf(stderr, "main: chat template is available, enabling conversation mode (disable it with -no-cnv)\n");
        }
    }
    if (cnv && tmpl.empty()) {
        fprintf(stderr, "warning: %s; using chatml, which may suit this model poorly\n",
                has_template_text ? "the model's chat template is not one this runtime knows"
                                  : "the model has no chat template");
        tmpl = "chatml";
    }
    if (cnv && !params.prompt.empty() && params.system_prompt.empty()) {
        fprintf(stderr, "main: the prompt (-p) pre-starts the conversation as the first user message; "
                        "use -sys for a system message\n");
    }

    fprintf(stderr, "sampler seed: %u\n", sp.seed);
    fprintf(stderr, "sampler params: repeat_last_n = %d, repeat_penalty = %.3f, top_k = %d, top_p = %.3f, "
                    "min_p = %.3f, temp = %.3f\n",
            sp.repeat_last_n, (double) sp.repeat_penalty, sp.top_k, (double) sp.top_p, (double) sp.min_p,
            (double) sp.temp);
    if (spec == "eagle") {
        fprintf(stderr, "speculative: EAGLE-1 tree of %d draft tokens (%s)\n", specee_spec_check_choices(spp.choices),
                spp.choices ? (strlen(spp.choices) > 40 ? "custom choices" : spp.choices) : "[[0]]");
    } else if (spec == "eagle2") {
        fprintf(stderr, "speculative: EAGLE-2 tree, total_tokens = %d, depth = %d, top_k = %d\n", spp.total_tokens,
                spp.depth, spp.top_k);
    }
    fprintf(stderr, "generate: n_ctx = %d, n_batch = %d, n_predict = %d, n_keep = 0\n\n", s.n_ctx, params.n_batch,
            params.n_predict);
    if (cnv) {
        fprintf(stderr, "== Running in conversation mode (chat template: %s). ==\n", tmpl.c_str());
        fprintf(stderr, " - Type a message and press Return; Ctrl+D on an empty line ends the conversation.\n\n");
    }

    s.perf.t_start = clock_type::now();
    const int rc   = cnv ? run_conversation(s, tmpl) : run_completion(s, params.prompt);
    s.out.flush();
    if (rc == 0) {
        printf("\n\n");
        fflush(stdout);
        perf_print(s.perf);
    }

    specee_spec_free(s.spec);
    specee_sampler_free(s.smpl);
    specee_context_free(s.ctx);
    specee_model_free(s.model);
    return rc;
}
