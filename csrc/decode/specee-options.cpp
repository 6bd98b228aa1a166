// specee-options.cpp: what a generation takes and reports, named once.
//
// Owns the option table of specee_generator_params (one name per setting, its type, what it accepts, its flags, its
// help) and the context-option table of specee_context_options (the model, context and placement flags, with
// llama.cpp's spellings), and the context options' defaults and what they make of the model's and the context's
// parameters; the mode table (what each mode does and which settings it reads), llama.cpp's speculation types, and
// the exit-KV names. A value held to its row, and the text form every frontend sets the tables with, are
// specee-option-values.cpp's; the stats' field names are specee-stats.cpp's.
#include "specee-grammar-limits.h"
#include "specee-impl.h"
#include "specee-options.h"
#include "specee.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <string>

// ---- the modes ----------------------------------------------------------------------------------------

static const specee_mode_info MODES[] = {
    // name, help, needs_head, tree, exits, lossless, shared_pass, greedy_only, reads
    {"auto",
     "draft with a draft model (-md), else early-exit with a draft head and exit predictors at temperature 0 (SpecEE's way with its merged files), eagle2 "
     "with a draft head where it can beat plain decoding here, else ngram (which drafts only where lookup pays)",
     false, false, false, true, true, nullptr,
     SPECEE_READS_EAGLE1_TREE | SPECEE_READS_EAGLE2_TREE | SPECEE_READS_EXIT | SPECEE_READS_NGRAM | SPECEE_READS_DRAFT},
    {"plain", "one token per pass of the model", false, false, false, true, true, nullptr, 0},
    {"eagle", "EAGLE-1: the draft head drafts a static tree, one pass verifies it", true, true, false, true, true,
     nullptr, SPECEE_READS_EAGLE1_TREE},
    {"eagle2", "EAGLE-2: a dynamic tree, grown where the draft head is confident", true, true, false, true, true,
     nullptr, SPECEE_READS_EAGLE2_TREE},
    {"early-exit", "SpecEE: a token's pass stops at a checked layer when its predictor fires", true, false, true,
     false, false, "early exit decodes greedily (the exit layer's argmax): use temperature 0, or another mode",
     SPECEE_READS_EXIT},
    {"tree-exit", "SpecEE inside the EAGLE tree: the verification pass stops at a checked layer", true, true, true,
     false, false,
     "tree exit decodes greedily (the exit layer's argmax along the tree): use temperature 0, or mode eagle2 / eagle "
     "for sampling",
     SPECEE_READS_EAGLE1_TREE | SPECEE_READS_EAGLE2_TREE | SPECEE_READS_EXIT},
    {"ngram", "n-gram lookup: drafts copied from the prompt and the output so far, verified in one pass (no draft head)",
     false, true, false, true, true, nullptr, SPECEE_READS_NGRAM},
    {"ngram+eagle2",
     "hybrid trees: n-gram lookup's drafts grafted onto EAGLE-2's tree, verified in one pass; lookup alone (the head "
     "skipped) where it is confident",
     true, true, false, true, false, nullptr, SPECEE_READS_EAGLE2_TREE | SPECEE_READS_NGRAM},
    {"draft",
     "a draft model (-md, llama.cpp's speculative decoding) drafts a chain greedily, one pass verifies it (the target's "
     "draws as plain decoding's: with a seed, plain decoding's tokens)",
     false, true, false, true, true, nullptr, SPECEE_READS_DRAFT},
};
static const int32_t N_MODES = (int32_t) (sizeof(MODES) / sizeof(MODES[0]));

// option "mode" reads the table: its names, their comma-separated text and its help (made before OPTIONS below)
static const char * MODE_NAMES[N_MODES];

static std::string mode_text(bool help) {
    std::string s = help ? "decoding: " : "";
    for (int32_t i = 0; i < N_MODES; ++i) {
        MODE_NAMES[i] = MODES[i].name;
        s += (i ? (help ? "; " : ",") : "") + std::string(MODES[i].name);
        if (help) {
            s += std::string(i == SPECEE_MODE_AUTO ? " (default)" : "") + ": " + MODES[i].help +
                 (MODES[i].greedy_only ? " (greedy only, lossy)" : "");
        }
    }
    return s;
}

static const std::string MODE_CHOICES = mode_text(false);
// option "grammar_type" reads the grammar's table of names (specee-grammar-limits.cpp): "none,gbnf,..." and, for
// messages, "none, gbnf, ... or regex"
static std::string names_text(const char * const * names, int32_t n, bool words) {
    std::string s;
    for (int32_t i = 0; i < n; ++i) {
        s += (i == 0 ? "" : !words ? "," : i + 1 == n ? " or " : ", ") + std::string(names[i]);
    }
    return s;
}

static const std::string GRAMMAR_TYPE_CHOICES = names_text(specee_grammar_type_names, SPECEE_N_GRAMMAR_TYPES, false);
static const std::string GRAMMAR_TYPE_EXPECT  = names_text(specee_grammar_type_names, SPECEE_N_GRAMMAR_TYPES, true);
static const std::string MODE_HELP    = mode_text(true);
static const char * const EXIT_KV_NAMES[] = {"mask", "fill"};
extern "C" const struct specee_mode_info * specee_mode_row(int32_t mode) {
    return mode >= 0 && mode < N_MODES ? &MODES[mode] : nullptr;
}

const specee_mode_info & specee_mode_row_impl(int32_t mode) {
    if (mode < 0 || mode >= N_MODES) {
        specee_fail("unknown mode %d", mode);
    }
    return MODES[mode];
}

extern "C" const char * specee_mode_name(int32_t mode) {
    return mode >= 0 && mode < N_MODES ? MODES[mode].name : "?";
}

extern "C" int32_t specee_mode_by_name(const char * name) {
    for (int32_t i = 0; name && i < N_MODES; ++i) {
        if (strcmp(name, MODES[i].name) == 0) {
            return i;
        }
    }
    return -1;
}

// ---- llama.cpp's speculation types (--spec-type): the mode that serves each here ----------------------------

static const specee_spec_type SPEC_TYPES[] = {
    {"draft-simple", SPECEE_MODE_DRAFT},  {"ngram-simple", SPECEE_MODE_NGRAM}, {"ngram-map-k", SPECEE_MODE_NGRAM},
    {"ngram-map-k4v", SPECEE_MODE_NGRAM}, {"ngram-mod", SPECEE_MODE_NGRAM},    {"ngram-cache", SPECEE_MODE_NGRAM},
};

extern "C" const struct specee_spec_type * specee_spec_type_row(int32_t i) {
    return i >= 0 && i < (int32_t) (sizeof(SPEC_TYPES) / sizeof(SPEC_TYPES[0])) ? &SPEC_TYPES[i] : nullptr;
}

// ---- the option table ---------------------------------------------------------------------------------

#define OFF(f) offsetof(specee_generator_params, f)

static const specee_option_row OPTIONS[] = { // after MODE_CHOICES, MODE_HELP and GRAMMAR_TYPE_*: made from them
    {{"mode", SPECEE_OPTION_CHOICE, MODE_CHOICES.c_str(), MODE_CHOICES.c_str(), MODE_HELP.c_str(), "--mode", "MODE"},
     OFF(mode), 0, MODE_NAMES, N_MODES, 0, 0},
    {{"temp", SPECEE_OPTION_FLOAT, nullptr, "a number", "temperature (default: 0.80, <= 0 = greedy)",
      "--temp,--temperature", "N"},
     OFF(sampling.temp), 0, nullptr, 0, -INFINITY, INFINITY},
    {{"top_k", SPECEE_OPTION_INT, nullptr, "an integer", "top-k sampling (default: 40, 0 = off)", "--top-k,--top_k",
      "N"},
     OFF(sampling.top_k), 0, nullptr, 0, INT_MIN, INT_MAX},
    {{"top_p", SPECEE_OPTION_FLOAT, nullptr, "a number in (0, 1]", "top-p sampling, in (0, 1] (default: 0.95, 1.0 = off)",
      "--top-p,--top_p", "N"},
     OFF(sampling.top_p), 0, nullptr, 0, 0, 1, 0, NAN, SPECEE_OPEN_LO},
    {{"min_p", SPECEE_OPTION_FLOAT, nullptr, "a number in [0, 1]", "min-p sampling, in [0, 1] (default: 0.05, 0.0 = off)",
      "--min-p,--min_p", "N"},
     OFF(sampling.min_p), 0, nullptr, 0, 0, 1},
    {{"repeat_penalty", SPECEE_OPTION_FLOAT, nullptr, "a finite number > 0", "penalise repeated tokens (default: 1.00 = off)",
      "--repeat-penalty", "N"},
     OFF(sampling.repeat_penalty), 0, nullptr, 0, 0, INFINITY, 0, NAN, SPECEE_OPEN_LO | SPECEE_OPEN_HI},
    {{"repeat_last_n", SPECEE_OPTION_INT, nullptr, "an integer >= -1",
      "tokens the penalty looks back over (default: 64, 0 = off, -1 = the context size)", "--repeat-last-n", "N"},
     OFF(sampling.repeat_last_n), 0, nullptr, 0, -1, INT_MAX},
    {{"seed", SPECEE_OPTION_INT, nullptr, "an unsigned 32-bit integer or -1", "RNG seed (default: -1 = a random seed)",
      "-s,--seed", "SEED"},
     OFF(sampling.seed), 0, nullptr, 0, -1, 4294967295.0},
    {{"ignore_eos", SPECEE_OPTION_BOOL, nullptr, "true or false",
      "never generate an end-of-generation token (its logit is -inf), so a run goes on to the token limit or a full "
      "context", "--ignore-eos"},
     OFF(ignore_eos), 0, nullptr, 0, 0, 0},
    {{"logit_bias", SPECEE_OPTION_TEXT, nullptr, "comma-separated TOKEN(+|-)BIAS like 15043+1,2-inf",
      "added to tokens' logits on every draw from the model's logits, e.g. 15043+1,2-inf (-inf bans a token; "
      "default: none)", "-l,--logit-bias", "TOKEN_ID(+/-)BIAS"},
     OFF(logit_bias), 0, nullptr, 0, 0, 0},
    {{"eagle.choices", SPECEE_OPTION_TEXT, nullptr, "a choices list like [[0], [1], [0, 0]] or mc_sim_7b_63",
      "EAGLE-1 tree: child-rank paths \"[[0], [1], [0, 0], ...]\" or the preset mc_sim_7b_63 (TensorRT-LLM's GPU "
      "default; default here: from the cost of a verification pass, [[0], [1], [0, 0]] where the CPU's layer "
      "matrices batch cheaply (Q4_0 repacked by ggml, Q4_K under the kernels), else [[0]]); implies mode eagle under "
      "auto",
      "--eagle-choices,--eagle_choices", "CHOICES"},
     OFF(eagle.choices), 0, nullptr, 0, 0, 0},
    {{"eagle.total_tokens", SPECEE_OPTION_INT, nullptr, "an integer >= 1",
      "EAGLE-2: draft tokens verified per step (default: 3 where the CPU's layer matrices batch cheaply, e.g. "
      "Q4_0, Q4_K, else 1)", "--eagle-total-tokens", "N"},
     OFF(eagle.total_tokens), 0, nullptr, 0, 1, INT_MAX, 0, 0},
    {{"eagle.depth", SPECEE_OPTION_INT, nullptr, "an integer in [1, 64]",
      "EAGLE-2: most draft tokens on one path (default: 2 where the CPU's layer matrices batch cheaply, else 1)",
      "--eagle-depth", "N"},
     OFF(eagle.depth), 0, nullptr, 0, 1, 64, 0, 0},
    {{"eagle.topk", SPECEE_OPTION_INT, nullptr, "an integer in [1, 256]",
      "EAGLE-2: children per expanded node and nodes expanded per depth (default: 2 where the CPU's layer matrices "
      "batch cheaply, else 1)", "--eagle-topk,--eagle_dynamic_tree_max_top_k", "N"},
     OFF(eagle.topk), 0, nullptr, 0, 1, 256, 0, 0},
    {{"eagle.replay", SPECEE_OPTION_LIST, nullptr, "comma-separated counts like 3,2,4,1",
      "EAGLE for cost benchmarks: step i accepts COUNTS[i mod n] drafted tokens along the tree's best path whatever the "
      "target says (every pass, draft and check still runs; the output text is meaningless)",
      "--eagle-replay", "COUNTS"},
     OFF(eagle.replay), OFF(eagle.n_replay), nullptr, 0, 0, INT32_MAX},
    {{"exit.threshold", SPECEE_OPTION_FLOAT, nullptr, "a number in [0, 1]",
      "early exit: a predictor fires above it (default: the file's specee.exit.threshold, SpecEE's 0.5)",
      "--exit-threshold", "N"},
     OFF(exit.threshold), 0, nullptr, 0, 0, 1, 0, -1},
    {{"exit.layers", SPECEE_OPTION_LIST, nullptr, "comma-separated layer numbers like 16,20,24",
      "early exit: the static set of checked layers (block indices), e.g. 16,20,24 (default: the file's)",
      "--exit-layers", "LAYERS"},
     OFF(exit.layers), OFF(exit.n_layers), nullptr, 0, 0, INT32_MAX},
    {{"exit.dynamic", SPECEE_OPTION_BOOL, nullptr, "true or false",
      "early exit: also check e-2, e, e+2 around each of the last 5 exit layers (default: on)", "--exit-dynamic"},
     OFF(exit.dynamic), 0, nullptr, 0, 0, 0},
    {{"exit.kv", SPECEE_OPTION_CHOICE, "mask,fill", "mask or fill",
      "early exit: the skipped layers' cache for an exited token: mask (nothing, later tokens do not see it there; "
      "SpecEE's; default) or fill (K/V from the exit layer's output)", "--exit-kv", "KV"},
     OFF(exit.kv), 0, EXIT_KV_NAMES, 2, 0, 0},
    {{"exit.replay", SPECEE_OPTION_LIST, nullptr, "comma-separated layer numbers",
      "early exit for benchmarks: token i (tree-exit: step i) exits after block LAYERS[i mod n] whatever the "
      "predictors say (cost only: the tokens are the exit layers' argmax)", "--exit-replay", "LAYERS"},
     OFF(exit.replay), OFF(exit.n_replay), nullptr, 0, 0, INT32_MAX},
    {{"ngram.n_min", SPECEE_OPTION_INT, nullptr, "an integer in [1, 16]",
      "n-gram lookup: the shortest match of the sequence's last tokens drafted from (default: 2)",
      "--ngram-n-min", "N"},
     OFF(ngram.n_min), 0, nullptr, 0, 1, 16},
    {{"ngram.n_max", SPECEE_OPTION_INT, nullptr, "an integer in [1, 16]",
      "n-gram lookup: the longest match, tried first (default: 4)", "--ngram-n-max", "N"},
     OFF(ngram.n_max), 0, nullptr, 0, 1, 16},
    {{"ngram.draft_max", SPECEE_OPTION_INT, nullptr, "an integer in [1, 64]",
      "n-gram lookup: most tokens drafted per step; how many are drafted adapts to their acceptance on the sequence "
      "and this machine's cost of a pass (default: 8)", "--ngram-draft-max,--spec-ngram-mod-n-max", "N"},
     OFF(ngram.draft_max), 0, nullptr, 0, 1, 64},
    {{"ngram.branches", SPECEE_OPTION_INT, nullptr, "an integer in [1, 8]",
      "n-gram lookup: continuations of the match verified as the root's children, the most frequent one drafted as a "
      "chain (default: 1)", "--ngram-branches", "N"},
     OFF(ngram.branches), 0, nullptr, 0, 1, 8},
    {{"ngram.adaptive", SPECEE_OPTION_BOOL, nullptr, "true or false",
      "n-gram lookup: choose how far to draft from the drafts' acceptance on the sequence and this machine's pass "
      "cost (default: on; off: draft_max tokens wherever the sequence's end was seen before)", "--ngram-adaptive"},
     OFF(ngram.adaptive), 0, nullptr, 0, 0, 0},
    {{"draft.n_max", SPECEE_OPTION_INT, nullptr, "an integer in [1, 64]",
      "draft model: most tokens drafted per step (default: 3)",
      "--draft-n-max,--draft-max,--draft,--draft-n,--spec-draft-n-max", "N"},
     OFF(draft.n_max), 0, nullptr, 0, 1, SPECEE_MAX_DRAFT},
    {{"draft.n_min", SPECEE_OPTION_INT, nullptr, "an integer in [0, 64]",
      "draft model: a shorter chain is not verified, a plain step instead (default: 0)",
      "--draft-n-min,--draft-min,--spec-draft-n-min", "N"},
     OFF(draft.n_min), 0, nullptr, 0, 0, SPECEE_MAX_DRAFT},
    {{"draft.p_min", SPECEE_OPTION_FLOAT, nullptr, "a number in [0, 1]",
      "draft model: drafting stops where its top token's probability is below this (default: 0)",
      "--draft-p-min,--spec-draft-p-min", "P"},
     OFF(draft.p_min), 0, nullptr, 0, 0, 1},
    {{"draft.synth_rates", SPECEE_OPTION_FLOATS, nullptr, "comma-separated non-increasing numbers in [0, 1]",
      "draft model, benchmarks only: drafted token i of a step is accepted with probability P_i whatever the target "
      "says (one per draft.n_max; seeded by the sampler's seed; the output is not the model's)",
      "--draft-synth-rates,--spec-synth-rates", "P0,P1,..."},
     OFF(draft.synth_rates), OFF(draft.n_synth_rates), nullptr, 0, 0, 1, SPECEE_MAX_DRAFT},
    {{"exit.check", SPECEE_OPTION_BOOL, nullptr, "true or false",
      "early exit: check every exit: the exited token's skipped layers run with the next token's pass and a token "
      "the full model disagrees with is taken back, so greedy output equals plain decoding (tokens come out once "
      "checked; default: off, it costs more than it saves on a CPU: docs/early-exit.md)", "--exit-check"},
     OFF(exit.check), 0, nullptr, 0, 0, 0},
    {{"grammar_type", SPECEE_OPTION_CHOICE, GRAMMAR_TYPE_CHOICES.c_str(), GRAMMAR_TYPE_EXPECT.c_str(),
      "structured output: what the grammar's text is (default: none; --grammar and --grammar-file give gbnf unless "
      "this says lark or regex, --json-schema and --json-schema-file json_schema): docs/structured-output.md",
      "--grammar-type", "TYPE"},
     OFF(grammar_type), 0, specee_grammar_type_names, SPECEE_N_GRAMMAR_TYPES, 0, 0},
    {{"jump_forward", SPECEE_OPTION_BOOL, nullptr, "true or false",
      "structured output: tokens the grammar forces (keys, quotes, braces) are verified together in the next pass "
      "instead of one pass each (plain decoding; in the drafters' modes where their drafts reach no further); the "
      "output is what it would be without (default: on)", "--jump-forward"},
     OFF(jump_forward), 0, nullptr, 0, 0, 0},
    {{"grammar_overlap", SPECEE_OPTION_BOOL, nullptr, "true or false",
      "structured output: the grammar's mask for the position a pass computes depends only on the tokens before it, "
      "so it is computed on a worker thread while the pass runs (default: on; off: after the pass, to measure it)",
      "--grammar-overlap"},
     OFF(grammar_overlap), 0, nullptr, 0, 0, 0},
};

#undef OFF

static const int32_t N_OPTIONS = (int32_t) (sizeof(OPTIONS) / sizeof(OPTIONS[0]));

// ---- the context-option table -------------------------------------------------------------------------

static const char * const KV_TYPE_NAMES[]    = {"f16", "f32"};            // by enum specee_kv_type
static const char * const OFFLOAD_NAMES[]    = {"auto", "first", "last"}; // by enum specee_offload_order
static const char * const FLASH_ATTN_NAMES[] = {"on", "off", "auto"};
static const char * const KERNELS_NAMES[]    = {"auto", "portable", "off"}; // by enum specee_kernels_mode

#define OFF(f) offsetof(specee_context_options, f)

static const specee_option_row CONTEXT_OPTIONS[] = {
    {{"model", SPECEE_OPTION_TEXT, nullptr, "a GGUF file", "GGUF model (default: the embedded SmolLM2)", "-m,--model", "FNAME"},
     OFF(model), 0, nullptr, 0, 0, 0},
    {{"draft_head", SPECEE_OPTION_TEXT, nullptr, "a file name or 'default'",
      "a draft head file (a GGUF with an EAGLE head and optionally exit predictors, e.g. from `python -m "
      "specee.convert merge --draft-head-only`), used instead of the model's own head and predictors (the load says "
      "what it replaced); 'default' = the one shipped for the embedded SmolLM2 (head + exit predictors)",
      "--draft-head", "FNAME"},
     OFF(draft_head), 0, nullptr, 0, 0, 0},
    {{"draft_model", SPECEE_OPTION_TEXT, nullptr, "a GGUF file",
      "a draft model (llama.cpp's speculative decoding: mode draft, auto's choice when given) with the model's "
      "vocabulary, loaded beside it with a context of its own (default: none)",
      "-md,--model-draft,--spec-draft-model", "FNAME"},
     OFF(draft_model), 0, nullptr, 0, 0, 0},
    {{"n_gpu_layers_draft", SPECEE_OPTION_INT, nullptr, "an integer >= -1",
      "the draft model's layers on the devices other than the CPU, as -ngl (default: -1 = all)",
      "-ngld,--gpu-layers-draft,--n-gpu-layers-draft,--spec-draft-ngl", "N"},
     OFF(n_gpu_layers_draft), 0, nullptr, 0, -1, INT_MAX},
    {{"n_ctx", SPECEE_OPTION_INT, nullptr, "an integer >= 0",
      "context size in tokens (default: 0 = the model's training context, at most 4096; more only when asked for)",
      "-c,--ctx-size", "N"},
     OFF(n_ctx), 0, nullptr, 0, 0, INT_MAX},
    {{"n_batch", SPECEE_OPTION_INT, nullptr, "an integer >= 1",
      "logical batch: prompt tokens per evaluation call (default: 2048)", "-b,--batch-size", "N"},
     OFF(n_batch), 0, nullptr, 0, 1, INT_MAX},
    {{"n_ubatch", SPECEE_OPTION_INT, nullptr, "an integer >= 1",
      "physical batch: most tokens in one graph (default: 512)", "-ub,--ubatch-size", "N"},
     OFF(n_ubatch), 0, nullptr, 0, 1, INT_MAX},
    {{"n_threads", SPECEE_OPTION_INT, nullptr, "an integer",
      "threads (default: 0 = the CPUs this process may use, also the most: more wait on each other)", "-t,--threads", "N"},
     OFF(n_threads), 0, nullptr, 0, INT_MIN, INT_MAX},
    {{"n_threads_batch", SPECEE_OPTION_INT, nullptr, "an integer",
      "threads for batches of more than one token (default: 0 = --threads)", "-tb,--threads-batch", "N"},
     OFF(n_threads_batch), 0, nullptr, 0, INT_MIN, INT_MAX},
    {{"type_v", SPECEE_OPTION_CHOICE, "f16,f32", "f16 or f32",
      "V cache type: f32 (default: a token's logits do not depend on the batch it is evaluated in, so speculative "
      "output is bit-identical to plain output) or f16 (half the memory; then a near-tie can flip between a "
      "verification pass and plain decoding)",
      "-ctv,--cache-type-v", "TYPE"},
     OFF(type_v), 0, KV_TYPE_NAMES, 2, 0, 0},
    {{"use_mmap", SPECEE_OPTION_BOOL, nullptr, "true or false",
      "map the weights from the file (default: on; off reads them into memory)", "--mmap", nullptr},
     OFF(use_mmap), 0, nullptr, 0, 0, 0},
    {{"n_gpu_layers", SPECEE_OPTION_INT, nullptr, "an integer >= -1",
      "layers on the devices other than the CPU (GPUs, --rpc servers), counting the output as one, as llama.cpp "
      "counts (default: -1 = all; without such a device everything stays on the CPU)",
      "-ngl,--n-gpu-layers,--gpu-layers", "N"},
     OFF(n_gpu_layers), 0, nullptr, 0, -1, INT_MAX},
    {{"offload_order", SPECEE_OPTION_CHOICE, "auto,first,last", "first, last or auto",
      "which layers -ngl offloads: first (SpecEE's: the first layers, the output and the draft head, so an early "
      "exit skips the layers left on the CPU), last (llama.cpp's) or auto (default: first when there are exit "
      "predictors, else last)",
      "--offload-order", "ORDER"},
     OFF(offload_order), 0, OFFLOAD_NAMES, 3, 0, 0},
    {{"devices", SPECEE_OPTION_TEXT, nullptr, "comma-separated device names",
      "comma-separated devices to offload to (default: every GPU and --rpc server; see --list-devices)",
      "-dev,--device", "LIST"},
     OFF(devices), 0, nullptr, 0, 0, 0},
    {{"rpc_servers", SPECEE_OPTION_TEXT, nullptr, "comma-separated HOST:PORT",
      "comma-separated HOST:PORT of ggml RPC servers (specee-rpc-server, or llama.cpp's rpc-server) to offload "
      "layers to; each must answer a check within 5 s first; a server's token comes from the environment variable "
      "SPECEE_RPC_TOKEN",
      "--rpc", "SERVERS"},
     OFF(rpc_servers), 0, nullptr, 0, 0, 0},
    {{"tensor_split", SPECEE_OPTION_FLOATS, nullptr, "comma-separated numbers >= 0",
      "the share of the offloaded layers each device gets, e.g. 3,1 (default: by free memory)", "-ts,--tensor-split", "SPLIT"},
     OFF(tensor_split), OFF(n_tensor_split), nullptr, 0, 0, INFINITY},
    {{"ngram_cache", SPECEE_OPTION_INT, nullptr, "an integer >= 0",
      "tokens of earlier requests (their prompts and outputs) kept for n-gram lookup's drafts, per context: a server's "
      "requests, a reused Model's calls; the oldest requests are evicted (default: 65536; 0: off)",
      "--ngram-cache", "N"},
     OFF(ngram_cache), 0, nullptr, 0, 0, INT_MAX},
    {{"flash_attn", SPECEE_OPTION_CHOICE, "on,off,auto", "on, off or auto",
      "accepted for compatibility; attention is always computed with ggml's flash attention here", "-fa,--flash-attn", "on|off|auto"},
     OFF(flash_attn), 0, FLASH_ATTN_NAMES, 3, 0, 0},
    {{"lora", SPECEE_OPTION_TEXT, nullptr, "comma-separated files", "LoRA adapters at scale 1, comma-separated "
      "(repeatable; GGUF files from `python -m specee.convert lora`)", "--lora", "FNAME", true},
     OFF(lora), 0, nullptr, 0, 0, 0},
    {{"lora_scaled", SPECEE_OPTION_TEXT, nullptr, "comma-separated FNAME:SCALE", "LoRA adapters with their "
      "scales (repeatable; after the --lora ones)", "--lora-scaled", "FNAME:SCALE,...", true},
     OFF(lora_scaled), 0, nullptr, 0, 0, 0},
    {{"lora_init_without_apply", SPECEE_OPTION_BOOL, nullptr, "true or false", "load the LoRA adapters at scale 0, "
      "applied later by POST /lora-adapters (default: off)", "--lora-init-without-apply", nullptr},
     OFF(lora_init_without_apply), 0, nullptr, 0, 0, 0},
    {{"kernels", SPECEE_OPTION_CHOICE, "auto,portable,off", "auto, portable or off",
      "matmul kernels for Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K weights on the CPU, a weight block unpacked once for "
      "all of a pass's tokens, a token's logits the same whatever its batch (ggml's bits; Q4_1, Q4_K: this runtime's "
      "own sums, within rounding of ggml's): auto (default: AVX2 where ggml's build and this CPU have it, else off), "
      "portable (the same arithmetic in plain C, slow: tests) or off (ggml's mul_mat: upstream's bits, and ggml's "
      "repacked Q4_K: faster prefill, a token's logits depending on its batch): docs/kernels.md", "--kernels",
      "MODE"},
     OFF(kernels), 0, KERNELS_NAMES, 3, 0, 0},
};

#undef OFF

static const int32_t N_CONTEXT_OPTIONS = (int32_t) (sizeof(CONTEXT_OPTIONS) / sizeof(CONTEXT_OPTIONS[0]));
static_assert(SPECEE_MAX_PATH == SPECEE_MAX_CHOICES, "a text option holds SPECEE_MAX_CHOICES bytes");

extern "C" const struct specee_option * specee_generator_option(int32_t i) {
    return i >= 0 && i < N_OPTIONS ? &OPTIONS[i].info : nullptr;
}

extern "C" const struct specee_option * specee_context_option(int32_t i) {
    return i >= 0 && i < N_CONTEXT_OPTIONS ? &CONTEXT_OPTIONS[i].info : nullptr;
}

specee_option_table specee_generator_option_table() { return {OPTIONS, N_OPTIONS}; }

specee_option_table specee_context_option_table() { return {CONTEXT_OPTIONS, N_CONTEXT_OPTIONS}; }

// ---- context options into the model's and the context's parameters ---------------------------------------

extern "C" struct specee_context_options specee_context_options_default(void) {
    specee_context_options o;
    memset(&o, 0, sizeof(o));
    o.n_batch       = 2048;
    o.n_ubatch      = 512;
    o.type_v        = SPECEE_KV_F32;
    o.use_mmap      = true;
    o.n_gpu_layers  = -1;
    o.n_gpu_layers_draft = -1;
    o.offload_order = SPECEE_OFFLOAD_AUTO;
    o.flash_attn    = 2; // auto
    o.ngram_cache   = SPECEE_DEFAULT_NGRAM_CACHE;
    return o;
}

extern "C" struct specee_model_params specee_context_options_model_params(const struct specee_context_options * o) {
    specee_model_params p = specee_model_default_params();
    p.use_mmap            = o->use_mmap;
    p.n_gpu_layers        = o->n_gpu_layers;
    p.offload_order       = o->offload_order;
    p.devices             = o->devices[0] ? o->devices : nullptr;
    p.rpc_servers         = o->rpc_servers[0] ? o->rpc_servers : nullptr;
    p.tensor_split        = o->n_tensor_split > 0 ? o->tensor_split : nullptr;
    p.n_tensor_split      = o->n_tensor_split;
    p.draft_head          = o->draft_head[0] ? o->draft_head : nullptr;
    p.draft_model         = o->draft_model[0] ? o->draft_model : nullptr;
    p.n_gpu_layers_draft  = o->n_gpu_layers_draft;
    p.kernels             = o->kernels;
    return p;
}

extern "C" struct specee_context_params specee_context_options_context_params(const struct specee_context_options * o) {
    specee_context_params p = specee_context_default_params();
    p.n_ctx                 = (uint32_t) std::max(o->n_ctx, 0);
    p.n_batch               = (uint32_t) std::max(1, std::min(o->n_batch, o->n_ubatch));
    p.n_threads             = o->n_threads > 0 ? o->n_threads : specee_max_threads();
    p.n_threads_batch       = o->n_threads_batch > 0 ? o->n_threads_batch : p.n_threads;
    p.type_v                = o->type_v;
    p.ngram_cache           = o->ngram_cache;
    p.kernels               = o->kernels;
    return p;
}
