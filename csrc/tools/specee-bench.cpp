// specee-bench: prompt-processing and text-generation speed of the SpecEE runtime, measured the way
// llama.cpp's llama-bench measures it (same flags, same tests, same output fields), over specee.h only.
//
//   pp N: one batch of N random tokens into an empty KV cache
//   tg N: N single-token evaluations starting from an empty KV cache (no prefill)
//
// Each test runs once to warm up, then -r times; the table reports mean ± sd tokens/s.
#include "specee-cli-args.h"
#include "specee-openmp.h"
#include "specee.h"

#include <algorithm>
#include <array>
#include <tuple>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

// ---- options -----------------------------------------------------------------------------------

// The model, context and placement flags are the library's context options (specee_context_option), each value
// checked by its table; those that llama-bench sweeps take comma lists, every combination measured.
static const char * const SWEPT[] = {"model", "n_threads", "type_v", "n_gpu_layers", "offload_order"};
static const char * const FIXED[] = {"n_batch", "n_ubatch", "rpc_servers", "flash_attn", "kernels"};

struct bench_params {
    specee_context_options   ctx = specee_context_options_default(); // the fixed context options
    std::vector<std::string> models;
    std::vector<int>         n_threads = {0}; // 0: the CPUs this process may use
    std::vector<std::string> type_v    = {"f16"}; // llama-bench's, so its default table compares like for like
    std::vector<int>         n_gpu_layers  = {-1};
    std::vector<std::string> offload_order = {"auto"};
    std::vector<int>         n_prompt  = {512};
    std::vector<int>         n_gen     = {128};
    std::vector<int>         n_depth   = {0};
    int                      reps      = 5;
    std::string              output    = "md";
    bool                     warmup    = true;
};

static const specee_option * context_option(const std::string & name) {
    for (int32_t i = 0; const specee_option * o = specee_context_option(i); ++i) {
        if (name == o->name) {
            return o;
        }
    }
    return nullptr;
}

// the option whose flags include `arg`, among `names`
template <size_t N> static const specee_option * option_of_flag(const std::string & arg, const char * const (&names)[N]) {
    for (const char * name : names) {
        const specee_option * o = context_option(name);
        std::stringstream     ss(o->flags);
        for (std::string f; std::getline(ss, f, ',');) {
            if (f == arg) {
                return o;
            }
        }
    }
    return nullptr;
}

static void print_option(const specee_option & o, const char * note) {
    std::string       head = "  ";
    std::stringstream flags(o.flags);
    for (std::string f; std::getline(flags, f, ',');) {
        head += (head.size() > 2 ? ", " : "") + f;
    }
    print_help_line(head + " <" + (o.hint ? o.hint : o.name) + ">", std::string(o.help) + note);
}

static void print_usage(const char * argv0, const bench_params & d) {
    printf("usage: %s [options]\n\n", argv0);
    printf("Measures prompt processing (pp) and text generation (tg) speed of the SpecEE runtime\n");
    printf("like llama-bench: pp N = one batch of N random tokens into an empty KV cache, tg N = N\n");
    printf("single-token evaluations, both after -d tokens already in the KV cache (not timed). Attention is\n");
    printf("flash attention, the K cache F16.\n\n");
    printf("options:\n");
    printf("  -h, --help\n");
    for (const char * name : SWEPT) {
        print_option(*context_option(name), strcmp(name, "type_v") == 0
                                                 ? "; a comma list: every value measured. specee-bench's default: f16, "
                                                   "llama-bench's, so that their tables compare like for like"
                                                 : "; a comma list: every value measured");
    }
    for (const char * name : FIXED) {
        print_option(*context_option(name), strcmp(name, "flash_attn") == 0 ? "; off is an error" : "");
    }
    printf("  -p, --n-prompt <n>               prompt tokens, comma list, 0 skips pp (default: %d)\n", d.n_prompt[0]);
    printf("  -n, --n-gen <n>                  generated tokens, comma list, 0 skips tg (default: %d)\n", d.n_gen[0]);
    printf("  -d, --n-depth <n>                tokens in the KV cache before each test, comma list (default: 0)\n");
    printf("  -r, --repetitions <n>            timed runs of each test (default: %d)\n", d.reps);
    printf("  -o, --output <md|json|jsonl|csv> output format printed to stdout (default: %s)\n", d.output.c_str());
    printf("  --no-warmup                      skip the warm-up run of each test\n");
    printf("(-m defaults to $SPECEE_DEFAULT_MODEL, which the specee-bench console script sets to the embedded SmolLM2)\n");
}

static bool parse_int_list(const std::string & s, int min_value, std::vector<int> & out) {
    out.clear();
    std::stringstream ss(s);
    std::string       item;
    while (std::getline(ss, item, ',')) {
        char * end = nullptr;
        long   v   = std::strtol(item.c_str(), &end, 10);
        if (item.empty() || *end != '\0' || v < min_value || v > (1 << 24)) {
            return false;
        }
        out.push_back((int) v);
    }
    return !out.empty();
}

// a swept option's comma list, each value set by the table on a copy of the fixed options; false when one is refused
static bool parse_swept(const specee_option & o, const std::string & val, bench_params & params) {
    const std::string name = o.name;
    if (name == "model") {
        params.models.clear();
    } else if (name == "n_threads") {
        params.n_threads.clear();
    } else if (name == "type_v") {
        params.type_v.clear();
    } else if (name == "n_gpu_layers") {
        params.n_gpu_layers.clear();
    } else {
        params.offload_order.clear();
    }
    std::stringstream ss(val);
    for (std::string item; std::getline(ss, item, ',');) {
        specee_context_options c = params.ctx;
        if (item.empty() || specee_context_options_set(&c, o.name, item.c_str()) != 0) {
            return false;
        }
        if (name == "model") {
            params.models.push_back(item);
        } else if (name == "n_threads") {
            params.n_threads.push_back(c.n_threads);
        } else if (name == "type_v") {
            params.type_v.push_back(item);
        } else if (name == "n_gpu_layers") {
            params.n_gpu_layers.push_back(c.n_gpu_layers);
        } else {
            params.offload_order.push_back(item);
        }
    }
    return !val.empty() && val.back() != ',';
}

// returns false with a message on stderr when the command line is malformed
static bool parse_args(int argc, char ** argv, bench_params & params, bool & help) {
    for (int i = 1; i < argc; i++) {
        const std::string arg = argv[i];
        if (arg == "-h" || arg == "--help") {
            help = true;
            return true;
        }
        if (arg == "--no-warmup") {
            params.warmup = false;
            continue;
        }
        const specee_option * swept = option_of_flag(arg, SWEPT);
        const specee_option * fixed = option_of_flag(arg, FIXED);
        const bool takes_value = swept || fixed || arg == "-p" || arg == "--n-prompt" || arg == "-n" ||
                                 arg == "--n-gen" || arg == "-r" || arg == "--repetitions" || arg == "-o" ||
                                 arg == "--output" || arg == "-d" || arg == "--n-depth";
        if (!takes_value) {
            fprintf(stderr, "error: unknown argument: %s (see --help)\n", arg.c_str());
            return false;
        }
        if (++i >= argc) {
            fprintf(stderr, "error: %s needs a value\n", arg.c_str());
            return false;
        }
        const std::string val = argv[i];
        std::vector<int>  ints;
        bool              ok = true;
        if (swept) {
            ok = parse_swept(*swept, val, params);
        } else if (fixed) {
            if (strcmp(fixed->name, "flash_attn") == 0 && (val == "off" || val == "0")) {
                fprintf(stderr, "error: %s %s: this runtime always uses flash attention\n", arg.c_str(), val.c_str());
                return false;
            }
            ok = specee_context_options_set(&params.ctx, fixed->name, val == "1" ? "on" : val.c_str()) == 0;
        } else if (arg == "-p" || arg == "--n-prompt") {
            ok = parse_int_list(val, 0, params.n_prompt);
        } else if (arg == "-n" || arg == "--n-gen") {
            ok = parse_int_list(val, 0, params.n_gen);
        } else if (arg == "-d" || arg == "--n-depth") {
            ok = parse_int_list(val, 0, params.n_depth);
        } else if (arg == "-r" || arg == "--repetitions") {
            ok = parse_int_list(val, 1, ints) && ints.size() == 1;
            params.reps = ok ? ints[0] : 0;
        } else {
            params.output = val;
            ok = val == "md" || val == "json" || val == "jsonl" || val == "csv";
        }
        if (!ok) {
            fprintf(stderr, "error: invalid value for %s: '%s' (see --help)\n", arg.c_str(), val.c_str());
            return false;
        }
    }
    return true;
}

// ---- tests -------------------------------------------------------------------------------------

struct bench_result {
    std::string           model_filename;
    std::string           model_type;
    uint64_t              model_size     = 0;
    uint64_t              model_n_params = 0;
    int                   n_batch        = 0;
    int                   n_threads      = 0;
    int                   n_prompt       = 0;
    int                   n_gen          = 0;
    int                   n_depth        = 0;
    std::string           type_v;
    int                   n_gpu_layers   = -1;
    std::string           offload_order;
    std::string           backends       = "CPU";
    std::string           test_time;
    std::vector<uint64_t> samples_ns;

    std::vector<double> samples_ts() const {
        std::vector<double> ts;
        for (uint64_t ns : samples_ns) {
            ts.push_back(1e9 * (n_prompt + n_gen) / (double) ns);
        }
        return ts;
    }
};

template <typename T> static double mean(const std::vector<T> & v) {
    double sum = 0.0;
    for (T x : v) {
        sum += (double) x;
    }
    return v.empty() ? 0.0 : sum / (double) v.size();
}

// sample standard deviation, as llama-bench reports it
template <typename T> static double stddev(const std::vector<T> & v) {
    if (v.size() <= 1) {
        return 0.0;
    }
    const double m  = mean(v);
    double       sq = 0.0;
    for (T x : v) {
        sq += ((double) x - m) * ((double) x - m);
    }
    return std::sqrt(sq / (double) (v.size() - 1));
}

// a plain causal batch continuing the cache, logits for the last token only
static bool eval_tokens(specee_context * ctx, const int32_t * tokens, int n_tokens) {
    specee_batch batch = {};
    batch.n_tokens     = n_tokens;
    batch.token        = tokens;
    if (specee_eval(ctx, &batch) != 0) {
        fprintf(stderr, "error: evaluation failed: %s\n", specee_last_error());
        return false;
    }
    return true;
}

static bool run_prompt(specee_context * ctx, int n_prompt, int n_vocab, std::mt19937 & rng) {
    std::uniform_int_distribution<int32_t> dist(0, n_vocab - 1);
    std::vector<int32_t>                   tokens(n_prompt);
    for (int32_t & t : tokens) {
        t = dist(rng);
    }
    return eval_tokens(ctx, tokens.data(), n_prompt);
}

static bool run_gen(specee_context * ctx, int n_gen, int n_vocab, std::mt19937 & rng) {
    std::uniform_int_distribution<int32_t> dist(0, n_vocab - 1);
    for (int i = 0; i < n_gen; i++) {
        const int32_t token = dist(rng);
        if (!eval_tokens(ctx, &token, 1)) {
            return false;
        }
    }
    return true;
}

// the cache holding n_depth tokens (not timed), as llama-bench's -d
static bool fill_depth(specee_context * ctx, int n_depth, int n_vocab, std::mt19937 & rng) {
    specee_kv_clear(ctx);
    const int n_batch = (int) specee_n_batch(ctx);
    for (int i = 0; i < n_depth; i += n_batch) {
        if (!run_prompt(ctx, std::min(n_batch, n_depth - i), n_vocab, rng)) {
            return false;
        }
    }
    return true;
}

// one test (pp or tg) after n_depth cached tokens: a warm-up run, then reps timed runs
static bool run_test(specee_context * ctx, const bench_params & params, bench_result & r, int n_vocab) {
    std::mt19937 rng(1234); // fixed seed: every run of the tool evaluates the same tokens
    if (params.warmup) {
        // like llama-bench: the whole prompt for pp, a single token for tg
        if (!fill_depth(ctx, r.n_depth, n_vocab, rng) ||
            !(r.n_prompt > 0 ? run_prompt(ctx, r.n_prompt, n_vocab, rng) : run_gen(ctx, 1, n_vocab, rng))) {
            return false;
        }
    }
    for (int i = 0; i < params.reps; i++) {
        if (!fill_depth(ctx, r.n_depth, n_vocab, rng)) {
            return false;
        }
        const auto t0 = std::chrono::steady_clock::now();
        if (!(r.n_prompt > 0 ? run_prompt(ctx, r.n_prompt, n_vocab, rng) : run_gen(ctx, r.n_gen, n_vocab, rng))) {
            return false;
        }
        const auto t1 = std::chrono::steady_clock::now();
        r.samples_ns.push_back((uint64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count());
    }
    return true;
}

// ---- output ------------------------------------------------------------------------------------

static std::string json_escape(const std::string & s) {
    std::string out;
    for (char c : s) {
        if (c == '"' || c == '\\') {
            out += '\\';
            out += c;
        } else if ((unsigned char) c < 0x20) {
            char buf[8];
            snprintf(buf, sizeof(buf), "\\u%04x", c);
            out += buf;
        } else {
            out += c;
        }
    }
    return out;
}

template <typename T> static std::string join(const std::vector<T> & v, const char * sep) {
    std::ostringstream ss;
    for (size_t i = 0; i < v.size(); i++) {
        ss << (i ? sep : "") << v[i];
    }
    return ss.str();
}

static std::string json_fields(const bench_result & r, const char * sep) {
    char buf[1024];
    snprintf(buf, sizeof(buf),
             "\"build_commit\": \"specee\",%s\"backends\": \"%s\",%s\"n_gpu_layers\": %d,%s\"offload_order\": \"%s\",%s"
             "\"model_filename\": \"%s\",%s"
             "\"model_type\": \"%s\",%s\"model_size\": %llu,%s\"model_n_params\": %llu,%s\"n_batch\": %d,%s"
             "\"n_threads\": %d,%s\"type_k\": \"f16\",%s\"type_v\": \"%s\",%s\"flash_attn\": 1,%s"
             "\"n_prompt\": %d,%s\"n_gen\": %d,%s\"n_depth\": %d,%s\"test_time\": \"%s\",%s",
             sep, r.backends.c_str(), sep, r.n_gpu_layers, sep, r.offload_order.c_str(), sep,
             json_escape(r.model_filename).c_str(), sep, json_escape(r.model_type).c_str(), sep,
             (unsigned long long) r.model_size, sep, (unsigned long long) r.model_n_params, sep, r.n_batch, sep,
             r.n_threads, sep, sep, r.type_v.c_str(), sep, sep, r.n_prompt, sep, r.n_gen, sep, r.n_depth, sep,
             r.test_time.c_str(), sep);
    std::string s = buf;
    snprintf(buf, sizeof(buf), "\"avg_ns\": %llu,%s\"stddev_ns\": %llu,%s\"avg_ts\": %f,%s\"stddev_ts\": %f,%s",
             (unsigned long long) std::llround(mean(r.samples_ns)), sep,
             (unsigned long long) std::llround(stddev(r.samples_ns)), sep, mean(r.samples_ts()), sep,
             stddev(r.samples_ts()), sep);
    s += buf;
    s += "\"samples_ns\": [ " + join(r.samples_ns, ", ") + " ]," + sep;
    s += "\"samples_ts\": [ " + join(r.samples_ts(), ", ") + " ]";
    return s;
}

static void print_header(const std::string & fmt) {
    if (fmt == "md") {
        printf("| %-30s | %10s | %10s | %-10s | %4s | %7s | %6s | %15s | %20s |\n", "model", "size", "params",
               "backend", "ngl", "threads", "type_v", "test", "t/s");
        printf("| %s | %s: | %s: | %s | %s: | %s: | %s | %s: | %s: |\n", std::string(30, '-').c_str(),
               std::string(9, '-').c_str(), std::string(9, '-').c_str(), std::string(10, '-').c_str(),
               std::string(3, '-').c_str(), std::string(6, '-').c_str(), std::string(6, '-').c_str(),
               std::string(14, '-').c_str(), std::string(19, '-').c_str());
    } else if (fmt == "json") {
        printf("[\n");
    } else if (fmt == "csv") {
        printf("model_filename,model_type,model_size,model_n_params,n_batch,n_threads,type_v,n_prompt,n_gen,n_depth,"
               "test_time,avg_ns,stddev_ns,avg_ts,stddev_ts\n");
    }
}

static void print_result(const std::string & fmt, const bench_result & r, bool first) {
    if (fmt == "md") {
        char size[32], params[32], test[48], ts[64];
        snprintf(size, sizeof(size), "%.2f MiB", r.model_size / 1024.0 / 1024.0);
        snprintf(params, sizeof(params), "%.2f M", r.model_n_params / 1e6);
        int n = snprintf(test, sizeof(test), r.n_prompt > 0 ? "pp%d" : "tg%d", r.n_prompt > 0 ? r.n_prompt : r.n_gen);
        if (r.n_depth > 0) {
            snprintf(test + n, sizeof(test) - n, " @ d%d", r.n_depth);
        }
        snprintf(ts, sizeof(ts), "%.2f ± %.2f", mean(r.samples_ts()), stddev(r.samples_ts()));
        // the width of the t/s column counts the 2-byte '±' as one character
        const std::string ngl = r.backends == "CPU" ? "0" : r.n_gpu_layers < 0 ? "all" : std::to_string(r.n_gpu_layers) +
                                                          (r.offload_order == "first" ? "f" : r.offload_order == "last" ? "l" : "");
        printf("| %-30s | %10s | %10s | %-10s | %4s | %7d | %6s | %15s | %21s |\n", r.model_type.c_str(), size, params,
               r.backends.c_str(), ngl.c_str(), r.n_threads, r.type_v.c_str(), test, ts);
    } else if (fmt == "json") {
        printf("%s  {\n    %s\n  }", first ? "" : ",\n", json_fields(r, "\n    ").c_str());
    } else if (fmt == "jsonl") {
        printf("{%s}\n", json_fields(r, " ").c_str());
    } else {
        printf("\"%s\",\"%s\",%llu,%llu,%d,%d,%s,%d,%d,%d,\"%s\",%llu,%llu,%f,%f\n", r.model_filename.c_str(),
               r.model_type.c_str(), (unsigned long long) r.model_size, (unsigned long long) r.model_n_params,
               r.n_batch, r.n_threads, r.type_v.c_str(), r.n_prompt, r.n_gen, r.n_depth, r.test_time.c_str(),
               (unsigned long long) std::llround(mean(r.samples_ns)),
               (unsigned long long) std::llround(stddev(r.samples_ns)), mean(r.samples_ts()), stddev(r.samples_ts()));
    }
    fflush(stdout);
}

// ---- main --------------------------------------------------------------------------------------

// every (model, -ngl, offload order): a model load each
static std::vector<std::tuple<std::string, int, std::string>> placements(const bench_params & params) {
    std::vector<std::tuple<std::string, int, std::string>> out;
    for (const std::string & m : params.models) {
        for (int ngl : params.n_gpu_layers) {
            for (const std::string & o : params.offload_order) {
                out.emplace_back(m, ngl, o);
            }
        }
    }
    return out;
}

// "RPC0+CPU" from the placement's lines ("NAME (...): ...")
static std::string backends_of(const std::string & placement) {
    std::string       out;
    std::stringstream ss(placement);
    std::string       line;
    while (std::getline(ss, line)) {
        const size_t end = line.find_first_of(" :");
        if (line.rfind("note", 0) != 0 && line.rfind("offload order", 0) != 0 && end != std::string::npos) {
            out = line.substr(0, end) + (out.empty() ? "" : "+" + out);
        }
    }
    return out.empty() ? "CPU" : out;
}

// every (threads, V cache type) pair, llama-bench's instance order
static std::vector<std::pair<int, std::string>> combos(const bench_params & params) {
    std::vector<std::pair<int, std::string>> out;
    for (const std::string & t : params.type_v) {
        for (int n : params.n_threads) {
            out.emplace_back(n, t);
        }
    }
    return out;
}

// the tests {n_prompt, n_gen, n_depth}, in llama-bench's order: every pp, then every tg, each at every depth
static std::vector<std::array<int, 3>> tests_of(const bench_params & params) {
    std::vector<std::array<int, 3>> tests;
    for (int p : params.n_prompt) {
        for (int d : params.n_depth) {
            if (p > 0) {
                tests.push_back({p, 0, d});
            }
        }
    }
    for (int n : params.n_gen) {
        for (int d : params.n_depth) {
            if (n > 0) {
                tests.push_back({0, n, d});
            }
        }
    }
    return tests;
}

// one model's rows: a context for every (threads, V cache type), every test in each; false on an error (printed)
static bool bench_model(specee_model * model, const std::string & path, int ngl, const std::string & order,
                        const bench_params & params, int n_ctx, bool & first) {
    const std::string backends = backends_of(specee_model_placement(model));
    for (const auto & [n_threads, type_v] : combos(params)) {
        specee_context_options o = params.ctx;
        specee_context_options_set(&o, "type_v", type_v.c_str()); // checked when parsed
        o.n_threads                   = n_threads;
        specee_context_params cparams = specee_context_options_context_params(&o);
        cparams.n_ctx                 = (uint32_t) n_ctx;
        cparams.n_batch               = std::min(cparams.n_batch, (uint32_t) n_ctx);
        specee_context * ctx          = specee_context_init(model, cparams);
        if (ctx == nullptr) {
            fprintf(stderr, "error: failed to create a context for '%s': %s\n", path.c_str(), specee_last_error());
            return false;
        }
        for (const auto & test : tests_of(params)) {
            bench_result r;
            r.model_filename = path;
            r.model_type     = specee_model_desc(model);
            r.model_size     = specee_model_size(model);
            r.model_n_params = specee_model_n_params(model);
            r.n_batch        = (int) cparams.n_batch;
            r.n_threads      = cparams.n_threads;
            r.n_prompt       = test[0];
            r.n_gen          = test[1];
            r.n_depth        = test[2];
            r.type_v         = type_v;
            r.n_gpu_layers   = ngl;
            r.offload_order  = order;
            r.backends       = backends;
            char         buf[64];
            const time_t now = std::time(nullptr);
            std::strftime(buf, sizeof(buf), "%FT%TZ", std::gmtime(&now));
            r.test_time = buf;
            if (!run_test(ctx, params, r, specee_model_n_vocab(model))) {
                specee_context_free(ctx);
                return false;
            }
            print_result(params.output, r, first);
            first = false;
        }
        specee_context_free(ctx);
    }
    return true;
}

int main(int argc, char ** argv) {
    specee_openmp_setup(argv);
    bench_params params;
    bool         help = false;
    if (!parse_args(argc, argv, params, help)) {
        return 1;
    }
    if (help) {
        print_usage(argv[0], bench_params());
        return 0;
    }
    if (params.models.empty()) {
        const char * def = std::getenv("SPECEE_DEFAULT_MODEL");
        if (def == nullptr || *def == '\0') {
            fprintf(stderr, "error: no model given (-m) and SPECEE_DEFAULT_MODEL is not set\n");
            return 1;
        }
        params.models.push_back(def);
    }
    specee_log_set_verbose(false);

    const int max_prompt = *std::max_element(params.n_prompt.begin(), params.n_prompt.end());
    const int max_gen    = *std::max_element(params.n_gen.begin(), params.n_gen.end());
    const int max_depth  = *std::max_element(params.n_depth.begin(), params.n_depth.end());
    const int n_ctx      = std::max(256, (max_depth + max_prompt + max_gen + 255) / 256 * 256);

    print_header(params.output);
    bool first = true;
    for (const auto & [path, ngl, order] : placements(params)) {
        specee_context_options o = params.ctx;
        o.n_gpu_layers           = ngl;
        specee_context_options_set(&o, "offload_order", order.c_str()); // checked when parsed
        specee_model * model = specee_model_load(path.c_str(), specee_context_options_model_params(&o));
        if (model == nullptr) {
            fprintf(stderr, "error: failed to load model '%s': %s\n", path.c_str(), specee_last_error());
            return 1;
        }
        const bool ok = bench_model(model, path, ngl, order, params, n_ctx, first);
        specee_model_free(model);
        if (!ok) {
            return 1;
        }
    }
    if (params.output == "json") {
        printf("\n]\n");
    }
    return 0;
}
