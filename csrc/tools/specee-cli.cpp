// llama-cli: text generation and chat with the SpecEE runtime, a drop-in for upstream llama.cpp's llama-cli (the
// prompt-completion tool, llama-completion upstream) over specee.h only.
//
// Same flags, same output: the prompt is echoed, the generated text streams to stdout, and at the end the timing
// lines of llama_perf_context_print go to stderr, which evaluation scripts parse. The decoding itself (mode, draft
// trees, early exit, sampling, prompt-prefix reuse) is the library's generator; this file holds the flags, the
// conversation, the streaming output and the timing lines.
//
//   completion     the prompt, then tokens until an end-of-generation token, -n tokens, or a full context
//   conversation   with a chat template, in a terminal (or with -cnv): the conversation is rendered again at every
//                  user line and the generator keeps the part the KV cache already holds; Ctrl-C stops a reply,
//                  a second Ctrl-C (or Ctrl-D) at the prompt ends the conversation
#include "specee-cli-args.h"
#include "specee-openmp.h"
#include "specee.h"

#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

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
            case '\'': case '"': case '?': case '\\': out += c; break;
            case 'x':
                if (i + 2 < s.size() && isxdigit((unsigned char) s[i + 1]) && isxdigit((unsigned char) s[i + 2])) {
                    out += (char) std::stoi(s.substr(i + 1, 2), nullptr, 16);
                    i += 2;
                    break;
                }
                out += "\\x";
                break;
            default: out += '\\'; out += c;
        }
    }
    return out;
}

// prints token pieces as they come, holding back an incomplete UTF-8 sequence until it completes
struct text_stream {
    std::string pending;

    void write(const std::string & piece) {
        pending += piece;
        size_t n = pending.size();
        for (size_t back = 1; back <= 3 && back <= pending.size(); ++back) {
            const unsigned char c = (unsigned char) pending[pending.size() - back];
            if ((c & 0xC0) == 0x80) {
                continue; // a continuation byte: look further back for the lead byte
            }
            const size_t len = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 1;
            n                = len > back ? pending.size() - back : pending.size();
            break;
        }
        fwrite(pending.data(), 1, n, stdout);
        fflush(stdout);
        pending.erase(0, n);
    }
    void flush() {
        fwrite(pending.data(), 1, pending.size(), stdout);
        pending.clear();
        fflush(stdout);
    }
};

static std::string token_piece(const specee_model * model, int32_t token, bool special) {
    std::string buf(64, '\0');
    int32_t     n = specee_token_to_piece(model, token, &buf[0], (int32_t) buf.size(), special);
    if (n < 0 && n != INT32_MIN) {
        buf.resize(-n);
        n = specee_token_to_piece(model, token, &buf[0], (int32_t) buf.size(), special);
    }
    return n >= 0 ? buf.substr(0, n) : std::string();
}

// text to tokens (BOS as the vocabulary asks when add_special); false with specee_last_error()
static bool tokenize(const specee_model * model, const std::string & text, bool add_special,
                     std::vector<int32_t> & out) {
    out.resize(text.size() + 8);
    int32_t n = specee_tokenize(model, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(),
                                add_special, true);
    if (n < 0 && n != INT32_MIN) {
        out.resize(-n);
        n = specee_tokenize(model, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), add_special,
                            true);
    }
    out.resize(std::max(n, 0));
    return n >= 0;
}

// ---- the session: generation, Ctrl-C, timing lines ----------------------------------------------

static volatile sig_atomic_t g_interrupts = 0; // Ctrl-C presses not handled yet

static void on_sigint(int) { g_interrupts = g_interrupts + 1; }

struct session {
    cli_params           params;
    specee_model *       model = nullptr;
    specee_context *     ctx   = nullptr;
    specee_generator *   gen   = nullptr;
    std::vector<specee_lora *> lora; // --lora / --lora-scaled, in order
    std::vector<int32_t> hist; // decoded tokens per layers-run count (early exit; the prompt's token not counted)
    double               t_load_ms = 0.0;
    std::chrono::steady_clock::time_point t_start;
    text_stream          out;

    ~session() {
        specee_generator_free(gen);
        specee_context_free(ctx);
        for (specee_lora * a : lora) {
            specee_lora_free(a);
        }
        specee_model_free(model);
    }
};

enum gen_stop { STOP_EOG, STOP_LIMIT, STOP_CONTEXT, STOP_INTERRUPT, STOP_ERROR };

static void print_prompt_tokens(const session & s, const std::string & prompt, const int32_t * tokens, size_t n) {
    fprintf(stderr, "main: prompt: '%s'\nmain: number of tokens in prompt = %zu\n", prompt.c_str(), n);
    for (size_t i = 0; i < n; ++i) {
        fprintf(stderr, "%6d -> '%s'\n", tokens[i], token_piece(s.model, tokens[i], true).c_str());
    }
    fprintf(stderr, "\n");
}

// Generates after `tokens` (the whole sequence so far), printing each piece; `text` gets the reply without special
// tokens. The generator keeps what the cache already holds of `tokens`; --verbose-prompt shows the rest.
static gen_stop generate(session & s, const std::vector<int32_t> & tokens, const std::string & prompt,
                         std::string & text) {
    const int32_t reused = specee_generator_start(s.gen, tokens.data(), (int32_t) tokens.size());
    if (reused < 0) {
        fprintf(stderr, "\nerror: %s\n", specee_last_error());
        return STOP_ERROR;
    }
    if (s.params.verbose_prompt) {
        print_prompt_tokens(s, prompt, tokens.data() + reused, tokens.size() - reused);
    }
    const int n_predict = s.params.n_predict;
    int32_t   buf[256], run[256];
    bool      first = true; // the first token comes from the prompt's pass, not from a decoding step
    for (int n = 0; n_predict < 0 || n < n_predict; first = false) {
        if (g_interrupts > 0) {
            return STOP_INTERRUPT;
        }
        const int32_t k = specee_generator_next(s.gen, buf, run, n_predict < 0 ? 256 : std::min(256, n_predict - n));
        if (k < 0) {
            fprintf(stderr, "\nerror: %s\n", specee_last_error());
            return STOP_ERROR;
        }
        if (k == 0) {
            fprintf(stderr, "\n\nllama-cli: context full (n_ctx = %u) => stopping\n", specee_n_ctx(s.ctx));
            return STOP_CONTEXT;
        }
        for (int32_t j = 0; j < k; ++j, ++n) {
            s.hist[run[j] - 1] += first ? 0 : 1;
            const bool eog = specee_token_is_eog(s.model, buf[j]);
            s.out.write(token_piece(s.model, buf[j], s.params.special));
            if (eog) {
                return STOP_EOG;
            }
            text += token_piece(s.model, buf[j], false);
        }
    }
    return STOP_LIMIT;
}

// same fields, widths and precision as upstream; rates of nothing print 0
static void perf_print(const session & s) {
    const specee_generator_stats st = specee_generator_get_stats(s.gen);
    const double t_total = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s.t_start).count();
    const int    n_decoded = st.n_decoded;
    auto         line = [](const char * what, double ms, int n, const char * unit) {
        fprintf(stderr, "llama_perf_context_print: %16s = %10.2f ms / %5d %s (%8.2f ms per token, %8.2f tokens per second)\n",
                what, ms, n, unit, n > 0 ? ms / n : 0.0, ms > 0 ? 1e3 * n / ms : 0.0);
    };
    fprintf(stderr, "llama_perf_sampler_print:    sampling time = %10.2f ms / %5d runs   (%8.2f ms per token, %8.2f "
                    "tokens per second)\n",
            st.t_sample_ms, st.n_tokens, st.n_tokens > 0 ? st.t_sample_ms / st.n_tokens : 0.0,
            st.t_sample_ms > 0 ? 1e3 * st.n_tokens / st.t_sample_ms : 0.0);
    fprintf(stderr, "llama_perf_context_print:        load time = %10.2f ms\n", s.t_load_ms);
    line("prompt eval time", st.t_prompt_ms, st.n_prompt, "tokens");
    line("eval time", st.t_decode_ms, n_decoded, "runs  ");
    fprintf(stderr, "llama_perf_context_print:       total time = %10.2f ms / %5d tokens\n", t_total,
            st.n_prompt + n_decoded);
    const specee_mode_info * mi = specee_mode_row(specee_generator_mode(s.gen));
    // a tree mode that exits prints both: its steps are EAGLE's, and their passes exit as early exit's tokens do
    // (counted per pass)
    if (mi->tree) {
        fprintf(stderr, "llama_perf_context_print:      speculative = %5d steps, %6.2f mean accepted tokens per step (%d "
                        "of %d draft tokens accepted; draft %.2f ms, verify %.2f ms)\n",
                st.n_steps, st.mean_accepted_tokens, st.n_accepted, st.n_drafted, st.t_draft_ms, st.t_verify_ms);
    }
    if (mi->exits) {
        const int32_t L = specee_model_n_layer(s.model);
        fprintf(stderr, "llama_perf_context_print:       early exit = %5d %s, exit ratio %.3f, mean layers run %.2f of "
                        "%d (%d exits, %d checks, %d fired, %d not a candidate; head %.2f ms, checks %.2f ms, exit "
                        "lm_head %.2f ms)\n",
                st.n_steps, mi->tree ? "passes" : "tokens", st.exit_ratio, st.mean_layers_run, L, st.n_exits,
                st.n_checks, st.n_fired, st.n_rejected, st.t_head_ms, st.t_check_ms, st.t_exit_ms);
        if (st.n_verified + st.n_rollbacks > 0) {
            fprintf(stderr, "llama_perf_context_print:   checked exits = %5d agreed with the full model, %d rolled back "
                            "(%d tokens taken back)\n",
                    st.n_verified, st.n_rollbacks, st.n_discarded);
        }
        std::string hist;
        for (int32_t l = 0; l < L; ++l) {
            hist += s.hist[l] > 0 ? " " + std::to_string(l + 1) + ":" + std::to_string(s.hist[l]) : "";
        }
        fprintf(stderr, "llama_perf_context_print: exit histogram = layers run:tokens%s\n", hist.c_str());
    }
}

static void echo_tokens(session & s, const std::vector<int32_t> & tokens, size_t from) {
    for (size_t i = from; i < tokens.size(); ++i) {
        s.out.write(token_piece(s.model, tokens[i], s.params.special));
    }
    s.out.flush();
}


// ---- completion and conversation ------------------------------------------------------------------

static int run_completion(session & s) {
    std::vector<int32_t> tokens;
    if (!tokenize(s.model, s.params.prompt, true, tokens)) {
        fprintf(stderr, "error: cannot tokenize the prompt: %s\n", specee_last_error());
        return 1;
    }
    if (tokens.empty()) {
        fprintf(stderr, "error: input is empty (the model adds no BOS token to an empty prompt)\n");
        return 1;
    }
    if (s.params.display_prompt) {
        echo_tokens(s, tokens, 0);
    }
    if (s.params.n_predict == 0) {
        if (s.params.verbose_prompt) {
            print_prompt_tokens(s, s.params.prompt, tokens.data(), tokens.size());
        }
        return 0;
    }
    std::string    text;
    const gen_stop stop = generate(s, tokens, s.params.prompt, text);
    s.out.flush();
    if (stop == STOP_EOG) {
        printf(" [end of text]\n");
    }
    return stop == STOP_ERROR ? 1 : stop == STOP_INTERRUPT ? 130 : 0;
}

struct conversation {
    std::string              tmpl;
    std::vector<std::string> roles, contents;

    // the tokens of the conversation rendered with its template (the library's rule: BOS once)
    bool tokens(const specee_model * model, bool add_ass, std::vector<int32_t> & out) const {
        std::vector<specee_chat_message> msgs;
        for (size_t i = 0; i < roles.size(); ++i) {
            msgs.push_back({roles[i].c_str(), contents[i].c_str()});
        }
        int32_t n = specee_chat_tokenize(model, tmpl.c_str(), msgs.data(), (int32_t) msgs.size(), add_ass, nullptr, 0);
        out.resize(n == INT32_MIN ? 0 : std::abs(n));
        n = specee_chat_tokenize(model, tmpl.c_str(), msgs.data(), (int32_t) msgs.size(), add_ass, out.data(),
                                 (int32_t) out.size());
        return n != INT32_MIN;
    }
};

// one user turn and the reply; false when the conversation must end (error, full context)
static bool chat_turn(session & s, conversation & conv, const std::string & user, bool echo, int & rc) {
    std::vector<int32_t> tokens, prev;
    const bool           ok = conv.tokens(s.model, false, prev);
    conv.roles.push_back("user");
    conv.contents.push_back(user);
    if (!ok || !conv.tokens(s.model, true, tokens)) {
        fprintf(stderr, "error: cannot render the conversation: %s\n", specee_last_error());
        rc = 1;
        return false;
    }
    if (echo) {
        echo_tokens(s, tokens, prev.size() <= tokens.size() ? prev.size() : 0);
    }
    std::string    reply;
    const gen_stop stop = generate(s, tokens, user, reply);
    s.out.flush();
    conv.roles.push_back("assistant");
    conv.contents.push_back(reply);
    if (stop == STOP_INTERRUPT) {
        g_interrupts = 0; // the first Ctrl-C stops the reply; the conversation goes on
        printf("\n");
    }
    rc = stop == STOP_ERROR ? 1 : 0;
    return stop != STOP_ERROR && stop != STOP_CONTEXT;
}

static int run_conversation(session & s, const std::string & tmpl) {
    conversation conv;
    conv.tmpl = tmpl;
    if (!s.params.system_prompt.empty()) {
        conv.roles.push_back("system");
        conv.contents.push_back(s.params.system_prompt);
    }
    int rc = 0;
    if (!s.params.prompt.empty()) {
        // the prompt pre-starts the conversation as the first user message
        if (!chat_turn(s, conv, s.params.prompt, s.params.display_prompt, rc) || s.params.single_turn) {
            return rc;
        }
    }
    for (;;) {
        printf("\n> ");
        fflush(stdout);
        std::string line;
        if (!std::getline(std::cin, line)) {
            printf(g_interrupts > 0 ? "\n" : "EOF by user\n"); // Ctrl-C at the prompt, or Ctrl-D
            return 0;
        }
        line = s.params.escape ? process_escapes(line) : line;
        if (!line.empty() && line.back() == '\r') {
            line.pop_back();
        }
        if (line.empty()) {
            continue;
        }
        if (!chat_turn(s, conv, line, false, rc) || s.params.single_turn) {
            return rc;
        }
    }
}

// ---- main --------------------------------------------------------------------------------------

// --list-devices, as llama.cpp prints them
static int list_devices(const char * rpc_servers) {
    if (*rpc_servers && specee_rpc_add_servers(rpc_servers) != 0) {
        fprintf(stderr, "error: %s\n", specee_last_error());
        return 1;
    }
    printf("Available devices:\n");
    const char * name = nullptr, * desc = nullptr;
    size_t       free = 0, total = 0;
    for (int32_t i = 0; specee_device_info(i, &name, &desc, &free, &total); ++i) {
        printf("  %s: %s (%zu MiB, %zu MiB free)\n", name, desc, total / 1024 / 1024, free / 1024 / 1024);
    }
    return 0;
}

static const char * env_path(const char * var, const char * what) {
    const char * v = std::getenv(var);
    if (!v || !*v) {
        fprintf(stderr, "error: %s: %s is not set (run the specee-cli console script, or give a file)\n", what, var);
    }
    return v && *v ? v : nullptr;
}

// -m and --draft-head default: the files the specee-cli console script names; false with a message
static bool resolve_default_files(cli_params & p) {
    if (!p.ctx.model[0]) {
        const char * def = env_path("SPECEE_DEFAULT_MODEL", "no model given (-m FNAME)");
        if (!def || specee_context_options_set(&p.ctx, "model", def) != 0) {
            return false;
        }
    }
    if (strcmp(p.ctx.draft_head, "default") == 0) {
        const char * def = env_path("SPECEE_DEFAULT_DRAFT_HEAD", "--draft-head default");
        if (!def || specee_context_options_set(&p.ctx, "draft_head", def) != 0) {
            return false;
        }
    }
    return true;
}

// the model where the placement flags put it; its placement on stderr
static bool load_model(session & s) {
    const specee_context_options & o      = s.params.ctx;
    const auto                     t_load = std::chrono::steady_clock::now();
    s.model = specee_model_load(o.model, specee_context_options_model_params(&o));
    if (!s.model) {
        fprintf(stderr, "error: failed to load the model '%s'%s%s: %s\n", o.model,
                o.draft_head[0] ? " with the draft head " : "", o.draft_head, specee_last_error());
        return false;
    }
    s.t_load_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_load).count();
    for (const char * line = specee_model_placement(s.model); *line;) {
        const char * end = strchr(line, '\n');
        fprintf(stderr, "load: %.*s\n", (int) (end ? end - line : strlen(line)), line);
        line = end ? end + 1 : line + strlen(line);
    }
    return true;
}

// the context (KV cache) and the generator (mode, trees and exit settings are checked there)
static bool init_context(session & s) {
    cli_params &          p  = s.params;
    specee_context_params cp = specee_context_options_context_params(&p.ctx);
    cp.n_ctx                 = cp.n_ctx > 0 ? std::max(cp.n_ctx, 8u) : 0; // llama-cli's smallest context
    s.ctx                    = specee_context_init(s.model, cp);
    if (!s.ctx) {
        fprintf(stderr, "error: cannot create the context: %s\n", specee_last_error());
        return false;
    }
    std::vector<float> scales(SPECEE_LORA_MAX);
    s.lora.resize(SPECEE_LORA_MAX);
    const int32_t n_lora =
        specee_lora_init_from_options(s.model, &p.ctx, s.lora.data(), scales.data(), SPECEE_LORA_MAX);
    s.lora.resize(std::max(n_lora, 0));
    if (n_lora < 0 || specee_context_set_lora(s.ctx, s.lora.data(), scales.data(), n_lora) != 0) {
        fprintf(stderr, "error: LoRA adapters: %s\n", specee_last_error());
        return false;
    }
    for (int32_t i = 0; i < n_lora; ++i) {
        fprintf(stderr, "load: LoRA adapter %d: %s (scale %g, alpha %g, %d matrices)\n", i, specee_lora_path(s.lora[i]),
                (double) scales[i], (double) specee_lora_alpha(s.lora[i]), specee_lora_n_weights(s.lora[i]));
    }
    fprintf(stderr, "load: KV cache: size = %.2f MiB (%u cells, %d layers, K f16, V %s)\n",
            specee_kv_nbytes(s.ctx) / 1048576.0, specee_n_ctx(s.ctx), specee_model_n_layer(s.model),
            cp.type_v == SPECEE_KV_F16 ? "f16" : "f32");
    specee_sampler_params & sp = p.gen.sampling;
    sp.repeat_last_n           = sp.repeat_last_n < 0 ? (int32_t) specee_n_ctx(s.ctx) : sp.repeat_last_n;
    s.gen                      = specee_generator_init(s.ctx, p.gen);
    if (!s.gen) {
        fprintf(stderr, "error: %s\n", specee_last_error());
        return false;
    }
    s.hist.assign(specee_model_n_layer(s.model), 0);
    return true;
}

// the settings in llama-cli's words, on stderr
static void print_settings(const session & s, bool cnv, const char * tmpl) {
    const cli_params &            p  = s.params;
    const specee_sampler_params & sp = p.gen.sampling;
    fprintf(stderr, "sampler seed: %u\n", specee_generator_seed(s.gen));
    fprintf(stderr, "sampler params: repeat_last_n = %d, repeat_penalty = %.3f, top_k = %d, top_p = %.3f, min_p = %.3f, "
                    "temp = %.3f\n", sp.repeat_last_n, (double) sp.repeat_penalty, sp.top_k, (double) sp.top_p,
            (double) sp.min_p, (double) sp.temp);
    const specee_mode_info * mi = specee_mode_row(specee_generator_mode(s.gen));
    if (*specee_generator_why(s.gen)) {
        fprintf(stderr, "%s\n", specee_generator_why(s.gen));
    }
    const char * where = mi->tree ? " inside the EAGLE tree" : "";
    if (mi->exits && p.gen.exit.check) {
        fprintf(stderr, "generate: mode %s (SpecEE%s) with checked exits: every exit is checked by the full model, so "
                        "greedy output equals plain decoding\n", mi->name, where);
    } else if (mi->exits) {
        fprintf(stderr, "generate: mode %s (SpecEE%s): lossy, tokens may differ from plain decoding; --exit-check "
                        "for checked exits, --mode eagle2 or --mode plain for lossless output\n", mi->name, where);
    } else if (mi->needs_head) {
        fprintf(stderr, "generate: mode %s (lossless speculative decoding with the EAGLE head)\n", mi->name);
    }
    fprintf(stderr, "generate: n_ctx = %u, n_batch = %d, n_predict = %d, n_keep = 0\n\n", specee_n_ctx(s.ctx), p.ctx.n_batch,
            p.n_predict);
    if (cnv) {
        fprintf(stderr, "== Running in conversation mode (chat template: %s). ==\n", tmpl);
        fprintf(stderr, " - Press Ctrl+C to stop a reply; Ctrl+C again, or Ctrl+D, at the prompt ends the conversation.\n\n");
    }
}

int main(int argc, char ** argv) {
    specee_openmp_setup(argv);
    session      s;
    cli_params & p    = s.params;
    bool         help = false;
    if (!cli_parse(argc, argv, p, help)) {
        return 1;
    }
    if (help) {
        return 0;
    }
    if (p.list_devices) {
        specee_log_set_verbose(false);
        return list_devices(p.ctx.rpc_servers);
    }
    if (!resolve_default_files(p)) {
        return 1;
    }
    if (p.escape) {
        p.prompt        = process_escapes(p.prompt);
        p.system_prompt = process_escapes(p.system_prompt);
    }
    specee_log_set_verbose(false);
    if (!load_model(s) || !init_context(s)) {
        return 1;
    }

    // conversation mode: on by default when there is a chat template and a person at a terminal
    const char * tmpl = specee_chat_template_resolve(s.model, p.chat_template.empty() ? nullptr : p.chat_template.c_str());
    if (!tmpl && (!p.chat_template.empty() || p.conversation == CNV_ON)) {
        fprintf(stderr, "error: %s (--chat-template NAME)\n", specee_last_error());
        return 1;
    }
    const bool cnv = p.conversation == CNV_ON || (p.conversation == CNV_AUTO && tmpl && isatty(STDIN_FILENO) &&
                                                  isatty(STDOUT_FILENO));
    if (cnv && p.conversation == CNV_AUTO) {
        fprintf(stderr, "main: chat template is available, enabling conversation mode (disable it with -no-cnv)\n");
    }
    if (cnv && !p.prompt.empty() && p.system_prompt.empty()) {
        fprintf(stderr, "main: the prompt (-p) pre-starts the conversation as the first user message; use -sys for a "
                        "system message\n");
    }
    print_settings(s, cnv, tmpl);

    struct sigaction sa = {};
    sa.sa_handler       = on_sigint;
    sigaction(SIGINT, &sa, nullptr); // no SA_RESTART: Ctrl-C at the prompt ends the read

    s.t_start    = std::chrono::steady_clock::now();
    const int rc = cnv ? run_conversation(s, tmpl) : run_completion(s);
    s.out.flush();
    if (rc != 1) {
        printf("\n\n");
        fflush(stdout);
        perf_print(s);
    }
    return rc;
}
