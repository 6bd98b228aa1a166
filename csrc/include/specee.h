// specee.h: the public C API of the SpecEE runtime, whole (as llama.cpp's llama.h), one section per concept: model,
// vocabulary, context and evaluation, n-gram cache, KV cache, embeddings, sampling, draft head and exit predictors,
// generation, grammars, parallel slots (their context shift and caches), generation options, context options, LoRA
// adapters, chat templates. Internal (C++) declarations live in the headers beside their .cpp files.
//
// Used by the command-line tools, the Python bindings and the tests. Every function that can fail
// returns NULL or a negative value and leaves a message in specee_last_error().
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct specee_model   specee_model;
typedef struct specee_context specee_context;
typedef struct specee_lora    specee_lora;

struct specee_context_options;

// the message of the last failed call on this thread ("" when none)
const char * specee_last_error(void);

// silence ggml's and the loader's informational logging (errors still reach specee_last_error)
void specee_log_set_verbose(bool verbose);

// ---- model -------------------------------------------------------------------------------------

// Where layers go (-ngl): the model's layers, and its output (output norm, lm_head, draft head), are placed on the
// devices other than the CPU (GPUs, ggml RPC servers) and the CPU. With n_gpu_layers = N:
//   SPECEE_OFFLOAD_LAST  (llama.cpp's -ngl): the last N - 1 layers and the output, as upstream counts them;
//   SPECEE_OFFLOAD_FIRST (SpecEE's): the first N layers and the output, so that an early exit skips the layers on
//                        the CPU, and the draft head and the exit layers' lm_head run on the device.
// Each layer's KV cache lives with its layer. The token embeddings stay on the CPU.
enum specee_offload_order {
    SPECEE_OFFLOAD_AUTO  = 0, // first when the model (or its draft head file) has exit predictors, else last
    SPECEE_OFFLOAD_FIRST = 1,
    SPECEE_OFFLOAD_LAST  = 2,
};

struct specee_model_params {
    bool          use_mmap;       // map the weights from the file (default); false reads them into memory
    int32_t       n_gpu_layers;   // layers (counting the output as one) on the devices; -1: all (default); 0: none
    int32_t       offload_order;  // enum specee_offload_order
    const char *  devices;        // comma-separated device names to use (specee_device_info); NULL: all but the CPU
    const char *  rpc_servers;    // comma-separated HOST:PORT of ggml RPC servers, added as devices; NULL: none
    const float * tensor_split;   // [n_tensor_split] share of the offloaded layers per device; NULL: by free memory
    int32_t       n_tensor_split;
    const char *  draft_head;     // a draft head file, as specee_model_load_eagle; NULL: the model file's own
    const char *  draft_model;    // a draft model (mode draft, specee_draft_params), NULL: none; its layers:
                                  // n_gpu_layers_draft
    int32_t       n_gpu_layers_draft;
    int32_t       kernels;        // the contexts' matmul kernels, as specee_context_params.kernels: where they take Q4_K
                                  // (auto on AVX2, portable), its matrices stay in the file's layout (the same bits for
                                  // any batch); off: ggml repacks them (its GEMM, faster prefill; a token's logits then
                                  // depend on its batch, as upstream's)
};

struct specee_model_params specee_model_default_params(void);

specee_model * specee_model_load(const char * path, struct specee_model_params params);
void           specee_model_free(specee_model * model);
// where the weights went, one line per device: "RPC0 (127.0.0.1:50052): layers 0-15, output; 120.3 MiB"
const char *   specee_model_placement(const specee_model * model);

// Devices: ggml RPC servers (comma-separated HOST:PORT) are added to the device registry; 0, or -1 with the server
// that cannot be reached in specee_last_error()
int32_t specee_rpc_add_servers(const char * servers);
int32_t specee_device_count(void);
// name ("CPU", "RPC0", "CUDA0"), description and memory of device i; false past the end
bool    specee_device_info(int32_t i, const char ** name, const char ** description, size_t * free, size_t * total);

int32_t  specee_model_n_layer    (const specee_model * model);
int32_t  specee_model_n_embd     (const specee_model * model);
int32_t  specee_model_n_ff       (const specee_model * model);
int32_t  specee_model_n_head     (const specee_model * model);
int32_t  specee_model_n_head_kv  (const specee_model * model);
int32_t  specee_model_n_vocab    (const specee_model * model);
int32_t  specee_model_n_ctx_train(const specee_model * model);
uint64_t specee_model_n_params   (const specee_model * model);
uint64_t specee_model_size       (const specee_model * model); // bytes of weight data
// short description, e.g. "llama 135M Q4_1"
const char * specee_model_desc(const specee_model * model);

// GGUF metadata as strings: arrays are summarised ("[string x 49152]") unless short
int32_t      specee_model_meta_count(const specee_model * model);
const char * specee_model_meta_key  (const specee_model * model, int32_t i);
const char * specee_model_meta_value(const specee_model * model, int32_t i);

// the GGUF tensor-name formats this runtime reads ("blk.%d.attn_q.weight", ...), NULL past the end
const char * specee_arch_tensor_name(int32_t i);
// the same for the EAGLE draft head's tensors ("eagle.fc.weight", ...)
const char * specee_arch_eagle_tensor_name(int32_t i);
// the model families this runtime runs, one row of their table each: "NAME ROPE TENSORS" (NAME: general.architecture,
// ROPE: normal or neox, TENSORS: the formats of the tensors each layer has, comma separated), NULL past the end
const char * specee_arch_family_row(int32_t i);

// EAGLE-1 or EAGLE-3 draft head (specee.eagle.version): read from the model file when it has eagle.* tensors (a merged file), or from a draft head
// file (eagle.* tensors and specee.eagle.* keys, e.g. `python -m specee.convert merge --draft-head-only`), which
// replaces the model's head; exit predictors (blk.N.pred.*, specee.exit.* keys) in that file replace the model's
// too (`merge --draft-head-only --eagle ... --predictors ...` writes such a file); what was replaced is noted in
// specee_model_placement. Shapes are checked against the model. Not while a generator uses the model. Returns 0,
// or -1 with specee_last_error().
int32_t specee_model_load_eagle(specee_model * model, const char * path);
bool    specee_model_has_eagle(const specee_model * model);
// rows of the head's lm_head: the model's vocabulary, or its reduced draft vocabulary; 0 without a head
int32_t specee_model_eagle_n_vocab(const specee_model * model);
// the target token of each row of a reduced draft vocabulary [specee_model_eagle_n_vocab], NULL when the head
// uses the model's lm_head
const int32_t * specee_model_eagle_draft_vocab(const specee_model * model);
// the head's version: 1 (EAGLE-1), 3 (EAGLE-3), 0 without a head
int32_t specee_model_eagle_version(const specee_model * model);
// the width of the target feature a committed pair takes: n_embd (EAGLE-1: the final-norm output), 3 n_embd
// (EAGLE-3: the outputs of its feature layers); 0 without a head
int32_t specee_model_eagle_n_feature(const specee_model * model);
// EAGLE-3: the target layers whose outputs form the feature, low to high (0-based; the output of layer i is the
// input of layer i + 1); writes up to n_max, returns how many (3; 0 for other heads)
int32_t specee_model_eagle_feature_layers(const specee_model * model, int32_t * out, int32_t n_max);

// ---- vocabulary (tokenizer.ggml.* metadata) ---------------------------------------------------

// token ids of special tokens, -1 when the model has none
int32_t specee_token_bos(const specee_model * model);
int32_t specee_token_eos(const specee_model * model);
int32_t specee_token_eot(const specee_model * model);
// end of generation (eos, eot, and other tokens marked as such)
bool    specee_token_is_eog(const specee_model * model, int32_t token);
// the end-of-generation token ids, up to n_max of them written to out; returns how many there are
int32_t specee_token_eog_ids(const specee_model * model, int32_t * out, int32_t n_max);
// the token's text as stored in the vocabulary
const char * specee_token_text(const specee_model * model, int32_t token);

// Text to token ids. Writes at most n_max ids and returns their count, or -(count needed) when n_max is
// too small, or INT32_MIN on error (specee_last_error). add_special: BOS/EOS as the vocabulary asks;
// parse_special: "<|im_start|>"-like text becomes the special token instead of plain text.
// text_len < 0: text is NUL-terminated.
int32_t specee_tokenize(const specee_model * model, const char * text, int32_t text_len, int32_t * tokens,
                        int32_t n_max, bool add_special, bool parse_special);

// The bytes of one token (may be a partial UTF-8 sequence: callers streaming text keep the tail until it
// completes). Returns the length, or -(length needed) when len is too small. special: render control
// tokens as their text. INT32_MIN on error (bad id, no vocabulary).
int32_t specee_token_to_piece(const specee_model * model, int32_t token, char * buf, int32_t len, bool special);

// Token ids to text (with SentencePiece's leading-space handling). Same return convention.
int32_t specee_detokenize(const specee_model * model, const int32_t * tokens, int32_t n_tokens, char * text,
                          int32_t text_len_max, bool remove_special, bool unparse_special);

// Fill-in-the-middle (FIM) tokens: code models mark the prefix, suffix and middle of a fill-in-the-middle prompt with
// tokens of their own; where a file names them in its metadata they are taken from there, else from their text in
// the vocabulary. specee-server's /infill (llama.cpp's layout) and Model.fim_tokens read them here, nowhere else.
enum specee_fim {
    SPECEE_FIM_PRE = 0, // before the prefix
    SPECEE_FIM_SUF = 1, // before the suffix
    SPECEE_FIM_MID = 2, // after both: the model writes the middle
    SPECEE_FIM_PAD = 3, // padding (ends generation)
    SPECEE_FIM_REP = 4, // before a repository's name (ends generation)
    SPECEE_FIM_SEP = 5, // before each file of a repository (ends generation)
    SPECEE_FIM_COUNT = 6,
};

// the kind's name ("pre", "suf", "mid", "pad", "rep", "sep"), NULL out of range
const char * specee_fim_name(int32_t kind);
// the kind's token id in the model's vocabulary, -1 when it has none (or kind is out of range)
int32_t specee_token_fim(const specee_model * model, int32_t kind);

// ---- context and evaluation --------------------------------------------------------------------

struct specee_context_params {
    uint32_t n_ctx;           // KV cache cells; 0 = the model's training context, at most SPECEE_DEFAULT_N_CTX
    uint32_t n_batch;         // most tokens in one graph; longer plain batches are split
    int32_t  n_threads;       // threads for single-token decode (<= 0: specee_max_threads(); more: clamped to it, warned)
    int32_t  n_threads_batch; // threads for batches of more than one token (<= 0: n_threads; clamped likewise)
    int32_t  type_v;          // V cache: SPECEE_KV_F32 (default), with which attention accumulates in F32 on one
                              // kernel path for every batch shape, so a token's logits do not depend on the batch
                              // it is in (speculative == plain, bit for bit), or SPECEE_KV_F16 (half the memory)
    int32_t  ngram_cache;     // tokens of earlier requests kept for n-gram lookup's drafts (the context's cross-request
                              // cache: the oldest requests evicted), 0: off
    int32_t  kernels;         // matmul kernels for Q4_1, Q8_0 and K-quant weights on the CPU: 0 auto, 1 portable, 2 off
                              // (specee-kernels.h)
};

enum specee_kv_type { SPECEE_KV_F16 = 0, SPECEE_KV_F32 = 1 };

// the default context's cap (llama.cpp's default -c): a file's training context can be far larger, or corrupt
#define SPECEE_DEFAULT_N_CTX 4096u
// the default cross-request n-gram cache: tokens kept (a few MiB with its index)
#define SPECEE_DEFAULT_NGRAM_CACHE 65536

struct specee_context_params specee_context_default_params(void);
// the most threads a context uses: the CPUs this process may run on (its affinity mask), at most 512
int32_t specee_max_threads(void);

// NULL with specee_last_error() on bad parameters, or when the KV cache and compute buffers of n_ctx cells and
// n_batch tokens would not fit in the available memory (checked before anything is allocated)
specee_context * specee_context_init(specee_model * model, struct specee_context_params params);
void             specee_context_free(specee_context * ctx);

// A pass of n_tokens (2..n_batch) tokens costs `cost` >= 1 single passes here: what n-gram lookup and `auto` would
// time once per context (an earlier measurement, a test of their rules); it holds for the context's life (lookup's
// observed passes do not replace it). 0, or -1 with specee_last_error().
int32_t specee_context_set_pass_cost(specee_context * ctx, int32_t n_tokens, double cost);

uint32_t specee_n_ctx(const specee_context * ctx);
uint32_t specee_n_batch(const specee_context * ctx);
int32_t  specee_n_threads(const specee_context * ctx);
// bytes of the KV cache (every layer, on every device)
size_t   specee_kv_nbytes(const specee_context * ctx);

struct specee_batch {
    int32_t         n_tokens;
    const int32_t * token;     // [n_tokens] token ids
    const int32_t * pos;       // [n_tokens] positions (>= 0), or NULL: continue after the highest cached position
                               // of each token's sequence (an error when that passes INT32_MAX)
    const uint8_t * tree_mask; // [n_tokens * n_tokens] or NULL (causal): tree_mask[i*n_tokens + j] != 0 when
                               // token i attends to batch token j; cached cells are seen when their pos <= pos[i]
    const int8_t *  output;    // [n_tokens] which tokens get logits, or NULL: the last one only
    const int32_t * seq_id;    // [n_tokens] the sequence of each token, 0..SPECEE_MAX_SEQ-1, or NULL: all in sequence
                               // 0. A token sees only its own sequence's cells and batch tokens (the tree mask too
                               // applies within a sequence).
};

// the most sequences one context holds
#define SPECEE_MAX_SEQ 64

enum specee_eval_flag {
    SPECEE_EVAL_HIDDEN_ALL = 1 << 0, // keep the hidden state after every evaluated layer
    SPECEE_EVAL_NO_LOGITS  = 1 << 1, // stop at the final norm: no lm_head
};

// Evaluate layers [layer_begin, layer_end) of a batch.
// layer_begin == 0 starts the batch: its tokens take KV cells, and the embeddings are the input.
// layer_begin > 0 continues the batch of the previous call from the hidden state it left (same batch).
// When layer_end == n_layer the final norm runs, and the lm_head for the output tokens.
// A cell's K/V are valid only in the layers that were evaluated for it; attention in other layers masks it.
// Returns 0, or a negative value with specee_last_error() set (the cache is left as it was).
int32_t specee_eval_layers(specee_context * ctx, const struct specee_batch * batch, int32_t layer_begin,
                           int32_t layer_end, uint32_t flags);

// all layers; plain causal batches longer than n_batch are split
int32_t specee_eval(specee_context * ctx, const struct specee_batch * batch);

int32_t       specee_n_outputs(const specee_context * ctx);
const float * specee_get_logits(const specee_context * ctx); // [n_outputs][n_vocab]
// hidden state after layer il of the last batch [n_tokens][n_embd]; il = -1: after the last evaluated
// layer. Other layers need SPECEE_EVAL_HIDDEN_ALL. NULL when not available (nothing evaluated, il not in
// -1..n_layer-1, the layer not kept).
const float * specee_get_hidden(const specee_context * ctx, int32_t il);
// final-norm output of the last batch [n_tokens][n_embd] (the lm_head input, EAGLE's feature)
const float * specee_get_norm(const specee_context * ctx);
// EAGLE-3: the outputs of the head's feature layers for every token of the last batch [n_tokens][3 n_embd] (the
// features its committed pairs take); NULL with specee_last_error() without an EAGLE-3 head or before they were
// computed
const float * specee_get_features(const specee_context * ctx);
int32_t       specee_last_n_tokens(const specee_context * ctx);

// Named intermediates: the next evaluations keep a copy of each graph node with one of these names ("l_out-12",
// "attn_norm-3", "ffn_out-0", "result_norm"; every node is named, see specee-graph.cpp); n = 0 stops. Each
// captured node is read when computed, which splits the graph there: capturing costs time.
int32_t       specee_set_capture(specee_context * ctx, const char * const * names, int32_t n);
// the captured node of the last evaluation as floats, rows of ne0 values (*n_rows rows); NULL when the last
// evaluation did not compute it
const float * specee_get_capture(const specee_context * ctx, const char * name, int64_t * ne0, int64_t * n_rows);

// ---- the cross-request n-gram cache (context option ngram_cache) -------------------------------------

struct specee_ngram_cache_info {
    int64_t capacity;  // most tokens kept (0: off)
    int64_t n_tokens;  // tokens kept (earlier requests' prompts and outputs)
    int64_t n_entries; // n-gram positions in its index (at most 4 per token)
    int64_t n_docs;    // requests kept
    int64_t n_added;   // requests added since the context was made
};
struct specee_ngram_cache_info specee_ngram_cache_get_info(const specee_context * ctx);
// drop every kept request
void                           specee_ngram_cache_clear(specee_context * ctx);

// ---- KV cache ----------------------------------------------------------------------------------

void    specee_kv_clear  (specee_context * ctx);
int32_t specee_kv_n_used (const specee_context * ctx);
int32_t specee_kv_pos_max(const specee_context * ctx); // -1 when empty
// drop the cells whose position is in [p0, p1); p1 < 0 means to the end; returns cells removed
int32_t specee_kv_remove (specee_context * ctx, int32_t p0, int32_t p1);
// cells given to the tokens of the last batch [specee_last_n_tokens]
const int32_t * specee_kv_batch_cells(const specee_context * ctx);
// drop the listed cells (e.g. the rejected branches of a verified tree); returns cells removed
int32_t specee_kv_remove_cells(specee_context * ctx, const int32_t * cells, int32_t n);
// position held by a cell, -1 when free
int32_t specee_kv_cell_pos(const specee_context * ctx, int32_t cell);
// whether a cell holds real K/V in layer il
bool    specee_kv_cell_valid(const specee_context * ctx, int32_t cell, int32_t il);

// Several sequences share one cache: each cell belongs to one or more sequences (several after a copy: a shared
// prefix is stored once). The calls above without a sequence act on sequence 0 (and specee_kv_clear on all).
// take sequence seq out of its cells with positions in [p0, p1) (p1 < 0: to the end; seq < 0: every sequence); a
// cell no other sequence shares is freed. Returns the cells it left, or -1 for a bad sequence id.
int32_t specee_kv_seq_remove(specee_context * ctx, int32_t seq, int32_t p0, int32_t p1);
// sequence dst shares sequence src's cells with positions in [p0, p1) (no K/V is copied); returns how many, or -1
int32_t specee_kv_seq_copy(specee_context * ctx, int32_t src, int32_t dst, int32_t p0, int32_t p1);
// the highest position of sequence seq, -1 when it has none
int32_t specee_kv_seq_pos_max(const specee_context * ctx, int32_t seq);
// cells sequence seq owns (shared cells counted for each owner)
int32_t specee_kv_seq_n_cells(const specee_context * ctx, int32_t seq);
// whether a cell belongs to sequence seq
bool    specee_kv_cell_has_seq(const specee_context * ctx, int32_t cell, int32_t seq);

// ---- embeddings and pooling ----------------------------------------------------------------------
//
// How a text's final-norm rows become its embedding or reranking score is a pooling, one row of one table that every
// frontend reads (Model.embed, specee-server's --pooling and /rerank); specee_embed and specee_slots_embed pool as it
// says.

// The poolings, numbered as llama.cpp numbers them (the GGUF key {arch}.pooling_type holds this number)
enum specee_pooling {
    SPECEE_POOLING_MODEL = -1, // the model's own: its file's {arch}.pooling_type, else mean
    SPECEE_POOLING_NONE  = 0,  // every token's final-norm row: [n_tokens][n_embd] per text
    SPECEE_POOLING_MEAN  = 1,  // the rows' mean: [n_embd]
    SPECEE_POOLING_CLS   = 2,  // the first token's row: [n_embd]
    SPECEE_POOLING_LAST  = 3,  // the last token's row: [n_embd]
    SPECEE_POOLING_RANK  = 4,  // relevance scores: the last token's row through the file's classifier head (cls:
                               // tanh(W h + b), then cls.output: [labels]; Qwen3: a softmax over them), else that
                               // row's first element [1]
};

struct specee_pooling_info {
    const char * name;       // "mean": Model.embed(pooling=...), specee-server's --pooling
    const char * help;       // one line: what a text gives
    bool         normalized; // what it gives is scaled to unit length when normalizing is asked for (none and rank:
                             // never, as llama.cpp)
};

// pooling p's row (p >= 0), NULL past the end
const struct specee_pooling_info * specee_pooling_row(int32_t pooling);
// the pooling of a name, -1 when unknown
int32_t specee_pooling_by_name(const char * name);
// the model's own pooling: its file's {arch}.pooling_type, else SPECEE_POOLING_MEAN
int32_t specee_model_pooling(const specee_model * model);
// the floats one text of n_tokens tokens gives with a pooling (SPECEE_POOLING_MODEL: the model's); -1 when unknown
int32_t specee_pooling_n_out(const specee_model * model, int32_t pooling, int32_t n_tokens);

// Embeddings of n_seqs texts' token ids (tokens: the texts one after another, n_tokens[i] ids each) into out: each
// text's specee_pooling_n_out floats, one text after another; a pooled vector is unit length when normalize (the
// pooling's row says which are). Each text is evaluated alone, on a sequence of its own at positions 0.., and its
// cells are removed afterwards: the cache's other sequences stay (sequence 0's cells make room when too few cells
// are free). Returns 0, or -1 with specee_last_error() (an empty text, one longer than the context, a bad token id
// or pooling; "text i: " before the message when n_seqs > 1).
int32_t specee_embed(specee_context * ctx, const int32_t * tokens, const int32_t * n_tokens, int32_t n_seqs,
                     int32_t pooling, bool normalize, float * out);

// ---- sampling ----------------------------------------------------------------------------------

typedef struct specee_sampler specee_sampler;

struct specee_sampler_params {
    float    temp;           // <= 0: greedy
    int32_t  top_k;          // <= 0: off
    float    top_p;          // in (0, 1]; 1: off
    float    min_p;          // <= 0: off
    float    repeat_penalty; // 1: off
    int32_t  repeat_last_n;  // tokens of history the penalty looks at (0: off, -1: the context)
    uint32_t seed;           // SPECEE_DEFAULT_SEED: random
};

#define SPECEE_DEFAULT_SEED 0xFFFFFFFFu

struct specee_sampler_params specee_sampler_default_params(void);
specee_sampler * specee_sampler_init(struct specee_sampler_params params);
void             specee_sampler_free(specee_sampler * smpl);
// pick a token from one row of logits [n_vocab] (penalties use the accepted history)
int32_t specee_sampler_sample(specee_sampler * smpl, const float * logits, int32_t n_vocab);
// add `bias` to a token's logit before the chain, on every draw from the target's logits (plain, speculative
// verification, early exit; not the draft head's proposals); -INFINITY bans the token (--ignore-eos).
// Setting a token again replaces its bias. 0, or -1 on error (token < 0; a token beyond the logits fails the draw)
int32_t specee_sampler_set_logit_bias(specee_sampler * smpl, int32_t token, float bias);
// add a token to the history (prompt tokens too, for the repetition penalty)
void    specee_sampler_accept(specee_sampler * smpl, int32_t token);
void    specee_sampler_reset(specee_sampler * smpl);
// the distribution specee_sampler_sample draws from for these logits (penalties from the history, top-k,
// top-p, min-p, temperature; greedy: 1 at the argmax), written to probs [n_vocab]; 0, or -1 on error
int32_t specee_sampler_probs(specee_sampler * smpl, const float * logits, int32_t n_vocab, float * probs);

// ---- EAGLE draft head and SpecEE exit predictors --------------------------------------------------

// the names of the predictor tensors ("blk.%d.pred.up.weight", ...), NULL past the end
const char * specee_arch_pred_tensor_name(int32_t i);
// the GGUF keys this runtime reads, as NAME=VALUE ("KEY_BLOCK_COUNT={arch}.block_count"), NULL past the end
const char * specee_arch_key(int32_t i);
// the tokenizer.ggml.pre names of the BPE pre-tokenizers this runtime has (a file naming another one is refused at
// load), NULL past the end
const char * specee_vocab_pre_name(int32_t i);

// n_rows rows of n_per_row floats as ggml type `type` into dst, as llama-quantize makes them; imatrix: NULL or
// n_per_row importance weights (llama-quantize --imatrix): the bytes written (dst NULL: the bytes it needs), or -1
// (a type that needs an importance matrix given none, rows that are not whole blocks of the type)
int64_t specee_quantize(int32_t type, const float * src, void * dst, int64_t n_rows, int64_t n_per_row,
                        const float * imatrix);

int32_t      specee_model_exit_n_pred(const specee_model * model); // layers with a predictor
bool         specee_model_exit_has_pred(const specee_model * model, int32_t layer);
// the file's static set of checked layers (specee.exit.layers, block indices) into out [n_max]; returns its size
int32_t      specee_model_exit_layers(const specee_model * model, int32_t * out, int32_t n_max);
float        specee_model_exit_threshold(const specee_model * model);   // specee.exit.threshold (0.5)
int32_t      specee_model_exit_n_candidates(const specee_model * model); // specee.exit.n_candidates (4)

// At a checked layer the features of the layer's output h [n_embd] for the EAGLE head's candidates cand
// [n_cand] are c = lm_head[cand] . final_norm(h), p = softmax(c) and p - p_prev (p_prev: p at the previously
// checked layer; NULL at the first check, where the third group is p itself, as SpecEE's code has it), in
// that order; the layer's predictor maps them to a probability
// (Linear(3 n_cand, hidden), ReLU, Linear(hidden, 1), sigmoid) and fires above the threshold.
// features [3 n_cand] of h; p_out [n_cand] (NULL: not needed) receives p; 0, or -1 with specee_last_error()
int32_t specee_exit_features(const specee_model * model, const float * h, const int32_t * cand, const float * p_prev,
                             float * feat, float * p_out);
// the layer's predictor on feat [3 n_cand]: a probability, or -1 with specee_last_error()
float   specee_exit_predict(const specee_model * model, int32_t layer, const float * feat);

// The draft head alone over n pairs (tokens[i], features[i] [specee_model_eagle_n_feature]) at positions 0..n-1,
// causal: logits [n][specee_model_eagle_n_vocab] (NULL: not needed) and the head's output features [n][n_embd] (out,
// NULL: not needed). For tests and training's acceptance estimates; it uses a cache of its own.
int32_t specee_draft_head_eval(specee_context * ctx, const int32_t * tokens, const float * features, int32_t n,
                               float * logits, float * out);
// The same, then a chain of n_draft draft steps as the tree decoders run them: step j takes token draft_tokens[j]
// at position n + j with the previous row's output feature (the head's own, [n_embd]: EAGLE-3 skips its fc) and
// sees the pairs and the earlier steps; logits [n + n_draft][n_vocab of the head], out [n + n_draft][n_embd].
int32_t specee_draft_head_eval_steps(specee_context * ctx, const int32_t * tokens, const float * features, int32_t n,
                                     const int32_t * draft_tokens, int32_t n_draft, float * logits, float * out);
// The drafts a tree decoder makes along a known sequence, from many roots at once (tree exit's training data): the n
// pairs as above, then from each root q (roots increasing, 0 <= q < n - depth) a chain of `depth` draft steps as the
// tree decoder runs them from a root there: step k takes tokens[q + k] at position q + k with the previous step's
// output feature (step 1: pair q's) and sees pairs 0..q and the chain's earlier steps only. logits
// [n_roots][depth + 1][n_vocab of the head]: step 0 is pair q's own row.
int32_t specee_draft_head_eval_chains(specee_context * ctx, const int32_t * tokens, const float * features, int32_t n,
                                      const int32_t * roots, int32_t n_roots, int32_t depth, float * logits);

// ---- generation: one decoding loop for every mode ----------------------------------------------------
//
// A generator decodes on a context with a sampler chain and a mode, each described by its row of the mode table
// (specee_mode_row: what it does, what it needs, whether it is lossless): plain; eagle and eagle2 (the draft head's
// tree verified in one pass), ngram (n-gram lookup's drafts) and ngram+eagle2 (both in one tree), all lossless
// (greedy output = plain output, sampling keeps the sampler's distribution); early-exit and tree-exit (SpecEE: a pass
// stops at a checked layer), greedy only, lossy by design; auto, which picks one for the model and this machine.
//
// Usage: specee_generator_start(tokens of the whole sequence so far), then specee_generator_next until it
// returns an end-of-generation token or 0 (context full). start keeps the longest prefix of `tokens` the KV cache
// holds from earlier calls on this context (a conversation's earlier turns, a shared prompt) and evaluates the
// rest. Every call locks the context; a context's generators and evaluations must not interleave a sequence.

enum specee_mode {
    SPECEE_MODE_AUTO = 0, SPECEE_MODE_PLAIN = 1, SPECEE_MODE_EAGLE = 2, SPECEE_MODE_EAGLE2 = 3,
    SPECEE_MODE_EARLY_EXIT = 4, SPECEE_MODE_TREE_EXIT = 5, SPECEE_MODE_NGRAM = 6, SPECEE_MODE_NGRAM_EAGLE2 = 7,
    SPECEE_MODE_DRAFT = 8, // a draft model's chain (specee_draft_params)
};

// the longest choices text, and the most entries in an exit schedule or a replay that the parameters hold
#define SPECEE_MAX_CHOICES     4096
#define SPECEE_MAX_EXIT_LAYERS 256

struct specee_eagle_params {
    // "" or 0: the default tree, chosen from the cost of a verification pass on the model's layers: three draft
    // tokens ([[0], [1], [0, 0]]; eagle2 3/2/2) where the CPU's layer matrices are repacked (e.g. Q4_0), one
    // ([[0]]; 1/1/1) elsewhere (docs/speculative.md)
    char    choices[SPECEE_MAX_CHOICES]; // eagle: "[[0], [1], [0, 0], ...]" (child ranks along each path,
                                         // TensorRT-LLM's --eagle_choices) or the preset "mc_sim_7b_63"
    int32_t total_tokens;                // eagle2: draft tokens verified per step
    int32_t depth;                       // eagle2: most draft tokens on one path
    int32_t topk;                        // eagle2: children per expanded node, and nodes expanded per depth
    int32_t replay[SPECEE_MAX_EXIT_LAYERS]; // cost benchmarks: step i accepts replay[i % n_replay] drafted tokens
    int32_t n_replay;                       // along the tree's best path, whatever the target says (the output is
                                            // meaningless; the passes, drafts and checks all run); 0: off
};

enum specee_exit_kv {
    SPECEE_EXIT_KV_MASK = 0, // nothing: later tokens do not attend to the token in those layers (SpecEE's way)
    SPECEE_EXIT_KV_FILL = 1, // K/V computed from the exit layer's output (each layer's norm, K/V projections)
};

struct specee_exit_params {
    float   threshold;                      // a predictor fires above this; >= 1: never; < 0: the model's
                                            // specee.exit.threshold
    int32_t layers[SPECEE_MAX_EXIT_LAYERS]; // the static schedule (block indices checked)
    int32_t n_layers;                       // 0: the model's specee.exit.layers
    bool    dynamic;                        // also check e-2, e, e+2 around each of the last 5 exit layers
    int32_t kv;                             // enum specee_exit_kv: what the skipped layers' cache holds for an
                                            // exited token
    int32_t replay[SPECEE_MAX_EXIT_LAYERS]; // benchmarks and tests: token i exits after block replay[i % n_replay]
    int32_t n_replay;                       // whatever the predictors say (n_layer - 1 or more: all layers); 0: off
    bool    check;                          // checked exits: an exited token's skipped layers run with the next
                                            // token's pass, and a token the full model disagrees with is taken back
                                            // (lossless; tokens are returned once checked)
};

// n-gram lookup (mode ngram): drafts copied from where the sequence's last n tokens stood before
struct specee_ngram_params {
    int32_t n_min;     // shortest match (tokens)
    int32_t n_max;     // longest match: the longest is tried first
    int32_t draft_max; // most tokens drafted per step (the length adapts to acceptance and pass cost below it)
    int32_t branches;  // continuations of the match verified as children of the root (the best one as a chain)
    bool    adaptive;  // the chain's length from acceptance and pass cost (else draft_max wherever a match is found)
};

// A draft model (llama.cpp's default speculative decoding, -md; mode draft): a second, smaller model with the target's
// vocabulary drafts a chain of tokens greedily, which one pass of the target verifies. Named by
// specee_model_params.draft_model (context option draft_model): loaded with the target, refused unless its
// vocabulary is the target's token for token; each context of the target gets a context of the draft model beside it
// (its own KV cache, the same size), each sequence of the target its sequence there.

// the most tokens a draft model drafts per step, and the most synthetic acceptance rates
#define SPECEE_MAX_DRAFT 64

struct specee_draft_params {
    int32_t n_max; // most tokens drafted per step (llama.cpp's --draft-max / --spec-draft-n-max)
    int32_t n_min; // a chain shorter than this is not verified (a plain step instead; --draft-min)
    float   p_min; // drafting stops where the draft model's top probability falls below this (--draft-p-min)
    // Benchmarks only (llama.cpp's --spec-synth-rates): drafted token i of a step is accepted with the unconditional
    // probability synth_rates[i] (non-increasing, in [0, 1]) whatever the target says, from a generator seeded with
    // the sampler's seed; the output is not the model's. 0 rates: off.
    float   synth_rates[SPECEE_MAX_DRAFT];
    int32_t n_synth_rates;
};

struct specee_generator_params {
    struct specee_sampler_params sampling;
    bool                         ignore_eos; // end-of-generation tokens get logit -inf on every draw from the
                                             // model's logits (never the draft head's): lossless with EAGLE
    // added to tokens' logits on every draw from the model's logits (never the draft head's, as ignore_eos):
    // "TOKEN(+|-)BIAS,...", llama.cpp's --logit-bias spelling ("15043+1,2-inf": -inf bans a token); "": none
    char                         logit_bias[SPECEE_MAX_CHOICES];
    int32_t                      mode;       // enum specee_mode
    struct specee_eagle_params   eagle;
    struct specee_exit_params    exit;
    struct specee_ngram_params   ngram;
    struct specee_draft_params   draft;
    // structured output (see "grammars" below): enum specee_grammar_type and its text, NULL or SPECEE_GRAMMAR_NONE:
    // none, copied by specee_generator_init, _set_params and specee_slots_submit (only borrowed); jump_forward: forced
    // tokens go as verified drafts into a pass (plain decoding); grammar_overlap: its next mask made while a pass runs
    int32_t                      grammar_type;
    const char *                 grammar;
    bool                         jump_forward;
    bool                         grammar_overlap;
};

// What a generator did since its stats were last reset. The same names in Python (GenerationStats), the CLI's
// timing lines and the evaluations' columns.
struct specee_generator_stats {
    int32_t n_prompt;      // tokens evaluated by start (the reused prefix not counted)
    int32_t n_reused;      // tokens start found in the cache
    double  t_prompt_ms;
    int32_t n_tokens;      // tokens returned by next (the first one of each start comes from the prompt's pass)
    int32_t n_decoded;     // of which produced by decoding steps (every token but the first of each start)
    int32_t n_steps;       // decoding steps after the first token: one per token (plain, early exit) or per
                           // draft-and-verify step (eagle, eagle2, tree-exit)
    double  t_decode_ms;   // in next, after the first token
    double  t_sample_ms;   // sampling and acceptance, inside t_decode_ms
    // eagle, eagle2, tree-exit
    int32_t n_drafted;     // draft tokens verified
    int32_t n_accepted;    // of which accepted
    double  t_draft_ms;    // in the draft head, tree building included
    double  t_verify_ms;   // in the model's verification passes
    // ngram: of n_drafted / n_accepted, the drafts copied from the context's cross-request cache (earlier requests)
    int32_t n_cache_drafted;
    int32_t n_cache_accepted;
    // early-exit (decoding steps only); tree-exit counts per step (verification pass) instead of per token
    int32_t n_exits;       // tokens (tree-exit: passes) that left before the last layer
    int64_t n_layers_run;  // layers evaluated, summed over tokens (tree-exit: passes)
    int32_t n_checks;      // predictor checks (tree-exit: checked layers, each scoring the tree's best path)
    int32_t n_fired;       // checks whose predictor fired (tree-exit: on every row of the path)
    int32_t n_rejected;    // fired, but the layer's argmax was not a candidate (tree-exit: some emitted token)
    double  t_layers_ms;   // in the model's layers
    double  t_check_ms;    // features + predictors
    double  t_exit_ms;     // norm + full lm_head at fired layers
    double  t_head_ms;     // the draft head (candidates)
    double  t_fill_ms;     // K/V of the skipped layers (SPECEE_EXIT_KV_FILL)
    // checked exits (exit.check)
    int32_t n_verified;    // exited tokens the full model agreed with
    int32_t n_rollbacks;   // exited tokens it disagreed with: the sequence went back to the full model's token
    int32_t n_discarded;   // tokens emitted after a wrong exit, taken back by the rollbacks
    double  t_mask_ms;         // in next: a grammar's masks on the decoding thread (computed, or waited for: overlap)
    int32_t n_grammar_dropped; // drafted tokens a grammar refused, dropped (with their subtrees) before verification
    int32_t n_grammar_masked;  // the draft head's candidates a grammar refused, skipped before they entered the tree
    // derived by specee_generator_get_stats (0 where a mode does not count them)
    double  mean_accepted_tokens; // eagle, eagle2, tree-exit: n_decoded / n_steps, tokens per step (1: no draft
                                  // accepted)
    double  exit_ratio;           // early-exit, tree-exit: n_exits / n_steps
    double  mean_layers_run;      // early-exit, tree-exit: n_layers_run / n_steps (SpecEE's "average exit layer")
};

typedef struct specee_generator specee_generator;

// The modes in one table: what each does, which settings it reads. The generator, the slots, the CLI, Python
// (specee.MODES), the server and the evaluations ask it instead of naming modes; adding a mode is a row here and its
// decoder step (specee-generate.cpp).
enum specee_mode_reads { // the settings a mode reads besides sampling (the others are errors with it)
    SPECEE_READS_EAGLE1_TREE = 1 << 0, // eagle.choices
    SPECEE_READS_EAGLE2_TREE = 1 << 1, // eagle.total_tokens, eagle.depth, eagle.topk
    SPECEE_READS_EXIT        = 1 << 2, // exit.*
    SPECEE_READS_NGRAM       = 1 << 3, // ngram.*
    SPECEE_READS_DRAFT       = 1 << 4, // draft.*
};

struct specee_mode_info {
    const char * name;        // "eagle2": option "mode", --mode, the server's "mode"
    const char * help;        // one line: what it does
    bool         needs_head;  // drafts with the EAGLE draft head: refused without one
    bool         tree;        // a step verifies a drafted tree in one pass (stats: mean_accepted_tokens)
    bool         exits;       // a pass may stop at a checked layer (stats: exit_ratio, mean_layers_run)
    bool         lossless;    // greedy output equals plain decoding's, sampling keeps its distribution (a mode that
                              // exits: only with exit.check)
    bool         shared_pass; // specee_slots: its decoding steps join the shared pass (else its sequence runs alone)
    const char * greedy_only; // why it decodes greedily only (refuses temperature > 0), or NULL
    uint32_t     reads;       // enum specee_mode_reads
};

// mode i's row (auto's: it resolves to another when a generator starts), NULL past the end
const struct specee_mode_info * specee_mode_row(int32_t mode);
// "auto", "plain", ... (the names of option "mode"), "?" for an unknown mode
const char * specee_mode_name(int32_t mode);
// the mode of a name, -1 when unknown
int32_t      specee_mode_by_name(const char * name);

struct specee_generator_params specee_generator_default_params(void);
// NULL with specee_last_error() on bad parameters or a mode the model cannot run
specee_generator * specee_generator_init(specee_context * ctx, struct specee_generator_params params);
void               specee_generator_free(specee_generator * gen);
// new parameters, from the next step on (a generation in progress goes on; the draft head's cache is kept for
// prefix reuse); 0, or -1 (nothing changes)
int32_t            specee_generator_set_params(specee_generator * gen, struct specee_generator_params params);
// the sampler's seed (the random one drawn for SPECEE_DEFAULT_SEED)
uint32_t           specee_generator_seed(const specee_generator * gen);
// the mode in use (auto resolved)
int32_t            specee_generator_mode(const specee_generator * gen);
// what mode `auto` chose and why, one line ("auto: plain decoding: ..."); "" when the mode was given, or auto had
// nothing to weigh (no draft head; exit predictors that do not say they lose)
const char *       specee_generator_why(const specee_generator * gen);
// Begin generating after `tokens` (the whole sequence: prompt, or conversation so far); the request before joins the
// context's n-gram cache. Returns how many of them were reused from the KV cache, or -1 with specee_last_error()
// (context overflow: nothing changes).
int32_t specee_generator_start(specee_generator * gen, const int32_t * tokens, int32_t n_tokens);
// The next 1..n_max tokens (more than one when a speculative step accepts drafted tokens; it stops after an
// end-of-generation token). layers_run [n_max] (NULL: not needed) receives the layers each token's pass ran
// (n_layer unless it exited early). Returns their count, 0 when the context is full, or -1 with
// specee_last_error().
int32_t specee_generator_next(specee_generator * gen, int32_t * tokens, int32_t * layers_run, int32_t n_max);
struct specee_generator_stats specee_generator_get_stats(const specee_generator * gen);
void                          specee_generator_reset_stats(specee_generator * gen);
// number of draft tokens of a choices list or preset, or -1 with the reason in specee_last_error()
int32_t specee_eagle_check_choices(const char * choices);

// ---- grammars: structured output ----------------------------------------------------------------------
//
// A grammar constrains what a generator produces (llguidance, docs/structured-output.md): each draw keeps only the
// tokens it allows (its next mask made while the pass runs), each generated token advances it, drafts it refuses are
// dropped before verification, so eagle, eagle2 and ngram give plain decoding's greedy output under it; early exit
// exits only on an allowed token; tree-exit and checked exits refuse it. Malformed grammars: the engine's message.

enum specee_grammar_type {
    SPECEE_GRAMMAR_NONE        = 0,
    SPECEE_GRAMMAR_GBNF        = 1, // llama.cpp's GBNF (root ::= ...)
    SPECEE_GRAMMAR_JSON_SCHEMA = 2, // a JSON Schema (as JSON text); output is compact JSON
    SPECEE_GRAMMAR_LARK        = 3, // llguidance's Lark dialect
    SPECEE_GRAMMAR_REGEX       = 4, // a regular expression the whole output matches
};

// The constraint interface every frontend shares (the sampler's; a caller may drive one by hand): compile for a
// model's vocabulary (NULL with specee_last_error() on a malformed grammar), the allowed tokens as a bitmask (bit t %
// 32 of word t / 32; returns the words needed, writes them when n_words is enough), advance on a token (-1: refused),
// take back the last n, the tokens it forces next (up to n_max; their count), how many of n tokens it allows in turn.
typedef struct specee_grammar specee_grammar;
specee_grammar * specee_grammar_init(const specee_model * model, int32_t type, const char * text);
void             specee_grammar_free(specee_grammar * grammar);
int32_t          specee_grammar_mask(specee_grammar * grammar, uint32_t * mask, int32_t n_words);
int32_t          specee_grammar_accept(specee_grammar * grammar, int32_t token);
int32_t          specee_grammar_rollback(specee_grammar * grammar, int32_t n_tokens);
int32_t          specee_grammar_forced_tokens(specee_grammar * grammar, int32_t * tokens, int32_t n_max);
int32_t          specee_grammar_valid_prefix(specee_grammar * grammar, const int32_t * tokens, int32_t n_tokens);
// 0 when the grammar compiles for the model, else -1 with the engine's message in specee_last_error()
int32_t          specee_grammar_check(const specee_model * model, int32_t type, const char * text);
const char *     specee_grammar_type_name(int32_t type); // "none", "gbnf", "json_schema", "lark", "regex"
// The type a structured-output text is compiled as, the one rule every frontend asks: a JSON Schema's (schema) is
// json_schema; a grammar's the type asked for (grammar_type), gbnf when SPECEE_GRAMMAR_NONE. -1 with
// specee_last_error() for a schema asked to be another type, or a grammar asked to be json_schema.
int32_t          specee_grammar_type_of(int32_t asked, bool schema);
// llguidance's library (before the first grammar; Python passes its package's; else $SPECEE_LLGUIDANCE, the build's)
void             specee_grammar_set_library(const char * path);

// The grammar front door's limits: every grammar, from every frontend, is screened against one table of them (size,
// nesting depth, rules, alternatives, `$ref`s, repetition bounds; the compile's time and memory budget, the cache's
// size) before the engine sees it. By row (i in [0, count)): its name, its help, its value by name (-1 with
// specee_last_error() for an unknown name); set_limit changes one for the process (>= 1; -1 with specee_last_error()):
// tests force a budget small
int32_t      specee_grammar_limit_count(void);
const char * specee_grammar_limit_name(int32_t i);
const char * specee_grammar_limit_help(int32_t i);
int64_t      specee_grammar_limit(const char * name);
int32_t      specee_grammar_set_limit(const char * name, int64_t value);

// compiled grammars (and refusals) kept by text: entries, and the compiles they saved; clear drops them all
int32_t specee_grammar_cache_size(void);
int64_t specee_grammar_cache_hits(void);
void    specee_grammar_cache_clear(void);
// compiles abandoned past their budget (a 400 given) that still run on their workers
int32_t specee_grammar_n_abandoned(void);

// ---- parallel slots: continuous batching of several sequences on one context -----------------------------
//
// A slots object serves up to n_slots requests at once on a context, each on a sequence of its own (slot i holds
// sequence i + 1; sequence 0 stays the single-sequence calls'). specee_slots_step is one pass: the next token of
// every plain request that is decoding, the tree of every EAGLE request (eagle, eagle2: drafted before the pass, a
// block of rows with its own tree mask, walked after it) and a chunk (n_chunk tokens at most) of the prompts waiting
// to be prefilled, in one batch; requests join and leave between passes. Early-exit and tree-exit requests (and the
// speculative requests' prefill) run their sequence alone after the shared pass, with the same generator as
// specee_generator_next; every request gives what it gives alone (EAGLE greedy output stays equal to plain; early
// exit exits as it does alone). A slot keeps its cache after a
// request, and a new request goes to the free slot that holds the longest prefix of its prompt. Each slot may use
// n_ctx / n_slots cells. Every call locks the context.

typedef struct specee_slots specee_slots;

enum specee_finish {
    SPECEE_FINISH_NONE    = 0, // still running (or tokens left to read)
    SPECEE_FINISH_STOP    = 1, // an end-of-generation token (not returned)
    SPECEE_FINISH_LENGTH  = 2, // n_predict tokens
    SPECEE_FINISH_CONTEXT = 3, // the slot's share of the context is full
    SPECEE_FINISH_ERROR   = 4, // specee_slots_error says why
};

// specee_slots_submit's answer when every slot holds a request
#define SPECEE_SLOTS_BUSY (-2)

// What the slots did since they were made (the server's /metrics)
struct specee_slots_totals {
    int64_t n_requests;    // requests submitted
    int64_t n_cancelled;   // released before they finished
    int64_t n_tokens;      // tokens generated
    int64_t n_passes;      // passes: shared ones (EAGLE requests' trees among them) and early-exit slots' own steps
    int64_t n_pass_tokens; // tokens evaluated in the shared passes (decoding and prompts)
    double  t_pass_ms;     // in the shared passes
};

// A generated token's log-probability under the model's distribution at its step: the log-softmax of the logits,
// before the sampler's penalties, temperature and truncation (what OpenAI's logprobs give)
struct specee_token_logprob {
    int32_t token;
    float   logprob;
};

// most alternatives a request may ask for per token (specee_slots_submit's n_probs)
#define SPECEE_MAX_PROBS 100

// n_chunk: most prompt tokens in one pass (<= 0: n_batch). NULL with specee_last_error() on bad sizes.
specee_slots * specee_slots_init(specee_context * ctx, int32_t n_slots, int32_t n_chunk);
// frees the slots' sequences too
void           specee_slots_free(specee_slots * slots);
int32_t        specee_slots_n_slots(const specee_slots * slots);
// cells a slot may use: n_ctx / n_slots (a prompt must be shorter)
int32_t        specee_slots_n_ctx_slot(const specee_slots * slots);
// slots holding a request (running, or finished and not yet released)
int32_t        specee_slots_n_busy(const specee_slots * slots);
// A request: generate up to n_predict tokens (< 0: until the slot's context is full) after the prompt's tokens with
// these parameters. Returns its slot, SPECEE_SLOTS_BUSY when every slot holds a request, or -1 with
// specee_last_error() (a bad prompt or parameters; a prompt of n_ctx_slot tokens or more).
// n_probs >= 0: each generated token comes with its log-probability and those of the n_probs most likely tokens at
// its step (specee_slots_read), 0 to SPECEE_MAX_PROBS, in mode plain only (a speculative step's tokens come from
// several passes and drafts); < 0: none (nothing computed).
int32_t specee_slots_submit(specee_slots * slots, const int32_t * tokens, int32_t n_tokens,
                            struct specee_generator_params params, int32_t n_predict, int32_t n_probs);
// specee_slots_submit on slot `slot` (llama.cpp's id_slot) rather than the free slot with the longest cached prefix:
// SPECEE_SLOTS_BUSY while that slot holds a request, -1 with specee_last_error() on a bad slot, prompt or options
int32_t specee_slots_submit_to(specee_slots * slots, int32_t slot, const int32_t * tokens, int32_t n_tokens,
                               struct specee_generator_params params, int32_t n_predict, int32_t n_probs);
// One pass (see above). Returns the slots still running, or -1 with specee_last_error() (a failure of the shared
// pass; a speculative slot's own failure finishes that request with SPECEE_FINISH_ERROR).
int32_t specee_slots_step(specee_slots * slots);
// The slot's tokens generated since the last read, up to n_max (layers_run [n_max] or NULL: layers each token's pass
// ran; probs [n_max * (1 + n_probs)] or NULL, with the request's n_probs >= 0: per token, the token itself then the
// n_probs most likely, most likely first, each with its log-probability); *finish (NULL: not needed) the request's
// enum specee_finish once every token is read. Returns their count, or -1 (no request on the slot).
int32_t specee_slots_read(specee_slots * slots, int32_t slot, int32_t * tokens, int32_t * layers_run,
                          struct specee_token_logprob * probs, int32_t n_max, int32_t * finish);
// the n_probs of the slot's request (< 0: none)
int32_t specee_slots_n_probs(const specee_slots * slots, int32_t slot);
// on: the slot's request reports its tokens' probabilities after the sampler's chain (top-k, top-p, min-p,
// temperature: the distribution each token was drawn from, llama.cpp's post_sampling_probs; certain for a greedy
// draw) instead of the model's, with fewer than n_probs alternatives (token -1) where fewer were kept; its grammar's
// forced tokens are then sampled one at a time (no jump-forward). After its submit, before its next step; 0, or -1
// (no request on the slot).
int32_t specee_slots_set_post_sampling_probs(specee_slots * slots, int32_t slot, bool on);
// why the slot's request finished with SPECEE_FINISH_ERROR ("" otherwise)
const char * specee_slots_error(const specee_slots * slots, int32_t slot);
// End the slot's request, finished or not (a client gone): the slot is free at once, its cache kept for reuse
int32_t specee_slots_release(specee_slots * slots, int32_t slot);
// the stats of the slot's current (or last) request, and the mode it runs in
struct specee_generator_stats specee_slots_stats(const specee_slots * slots, int32_t slot);
int32_t                       specee_slots_mode(const specee_slots * slots, int32_t slot);
struct specee_slots_totals    specee_slots_get_totals(const specee_slots * slots);
// prompt tokens of the slot's request in its cache: the prefix reused at its submit, then each prefilled chunk's end
// (the prompt's length once prefilled); -1 for a slot out of range
int32_t                       specee_slots_n_past(const specee_slots * slots, int32_t slot);

// Context shift (llama-server's --context-shift): a request whose generation fills its slot's share of the context
// goes on instead of ending. Its first n_keep tokens stay, half of the rest (after them) is dropped, and the cells
// after the dropped ones move down to close the gap: their cached K turned by RoPE by the position difference (V does
// not depend on positions), as llama.cpp's K-shift does. Off by default, as upstream.
//
// Context shift for the slots' requests from now on: n_keep leading tokens kept (< 0: the whole prompt); a request in
// a mode whose state a shift keeps (plain, ngram, draft; not one with a draft head or exits) shifts, the others end
// with SPECEE_FINISH_CONTEXT as without it. 0, or -1 with specee_last_error().
int32_t specee_slots_set_context_shift(specee_slots * slots, bool enable, int32_t n_keep);
// how often the slot's request was shifted (llama.cpp's `truncated` when > 0)
int32_t specee_slots_n_shifted(const specee_slots * slots, int32_t slot);

// The slots' caches: the cache shared whole (unified), a slot's cache (its cells: tokens, positions, K/V) written to
// a file or to memory, read back into a slot, or erased, the slot a prompt's cached prefix chooses, and an embedding
// between the slots' passes. Every call locks the context.
//
// unified != 0 (llama.cpp's --kv-unified): every slot may use the whole cache (n_ctx cells, not n_ctx / n_slots);
// a request's submit drops the idle slots' caches, and a pass the running requests together overflow fails (-1,
// "context overflow", as the other calls do) instead of never running out. Only before the first request. Returns
// the cells a slot may use now, -1 with specee_last_error()
int32_t specee_slots_set_unified(specee_slots * slots, int32_t unified);
// A slot's cache file (specee_slots_save / specee_slots_restore), little-endian as the machine writes it:
//   "SPKV", u32 version (1), u32 n_layer, u32 n_cells,
//   per layer: u32 K row bytes, u32 V row bytes, i32 K ggml type, i32 V ggml type,
//   i32 token[n_cells], i32 position[n_cells] (0, 1, 2, ... : the slot's cells in position order),
//   u8 valid[n_cells * n_layer] (cell c holds real K/V in layer il; an early exit's skipped layers do not),
//   per layer: K rows [n_cells], then V rows [n_cells].
// Restore checks the file against the context (layers, row sizes and types, positions, token ids, the slot's share of
// the cells) before it changes anything.

// Writes the cells of a free slot to `path`; returns how many (0: an empty cache), -1 with specee_last_error() (the
// slot holds a request, or the file cannot be written)
int32_t specee_slots_save(specee_slots * slots, int32_t slot, const char * path);
// Replaces a free slot's cache with the file's cells; returns how many, -1 with specee_last_error() (the slot holds a
// request, the file cannot be read or does not fit this context)
int32_t specee_slots_restore(specee_slots * slots, int32_t slot, const char * path);
// Drops a free slot's cache; returns the cells it held, -1 with specee_last_error() (the slot holds a request)
int32_t specee_slots_erase(specee_slots * slots, int32_t slot);

// The same bytes as the file's, in memory (llama.cpp's host-memory prompt cache, --cache-ram): writes a free slot's
// cells into `bytes` when `bytes` is not NULL and `size` holds them; returns their length (with bytes NULL: only the
// length, nothing copied), -1 with specee_last_error()
int64_t specee_slots_save_mem(specee_slots * slots, int32_t slot, uint8_t * bytes, int64_t size);
// Replaces a free slot's cache with the cells of bytes specee_slots_save_mem wrote; returns how many, -1 with
// specee_last_error() (the slot holds a request, the bytes are not a saved slot of this context)
int32_t specee_slots_restore_mem(specee_slots * slots, int32_t slot, const uint8_t * bytes, int64_t size);
// The tokens a slot's cache holds, in position order: copies at most n_max into `tokens` (may be NULL), returns how
// many there are; -1 for a slot out of range
int32_t specee_slots_cache_tokens(specee_slots * slots, int32_t slot, int32_t * tokens, int32_t n_max);
// The slot specee_slots_submit would give this prompt now (the free slot whose cache holds its longest prefix), with
// that prefix's length in *cached; SPECEE_SLOTS_BUSY when every slot holds a request
int32_t specee_slots_choose(specee_slots * slots, const int32_t * tokens, int32_t n_tokens, int32_t * cached);

// One text's embedding (not normalised) between the parallel slots' passes, within a slot's share of the context (free
// slots' cached prompts make room); 0, or -1 with specee_last_error()
int32_t specee_slots_embed(specee_slots * slots, const int32_t * tokens, int32_t n_tokens, int32_t pooling,
                           float * out);

// ---- generation options and stats: one table of names for every frontend ------------------------------------
//
// Every setting of specee_generator_params has one name: "mode", "temp", "top_k", "top_p", "min_p",
// "repeat_penalty", "repeat_last_n", "seed", "ignore_eos", "eagle.choices", "eagle.total_tokens", "eagle.depth",
// "eagle.topk", "exit.threshold", "exit.layers", "exit.dynamic", "exit.kv", "exit.replay". The CLI's flags
// (--top-k, --exit-kv, ...), Python's GenerateOptions fields and the evaluations set them through
// specee_generator_params_set, so each value is checked here, once.

enum specee_option_type {
    SPECEE_OPTION_INT    = 0,
    SPECEE_OPTION_FLOAT  = 1,
    SPECEE_OPTION_BOOL   = 2, // "true" / "false" (also 1 / 0, on / off)
    SPECEE_OPTION_CHOICE = 3, // one of `choices`
    SPECEE_OPTION_TEXT   = 4,
    SPECEE_OPTION_LIST   = 5, // comma-separated integers: "16,20,24"
    SPECEE_OPTION_FLOATS = 6, // comma-separated numbers: "3,1"
};

struct specee_option {
    const char * name;    // "exit.kv"
    int32_t      type;    // enum specee_option_type
    const char * choices; // SPECEE_OPTION_CHOICE: the names, comma-separated ("mask,fill"); NULL otherwise
    const char * expect;  // what a value must be ("a number in [0, 1]"), for messages
    const char * help;    // one line, with the default
    const char * flags;   // the command line's spellings, comma-separated ("-c,--ctx-size", "--exit-kv"; llama.cpp's
                          // and EAGLE's among them, this project's for its own options); every row has them
    const char * hint;    // the value's placeholder on a usage line ("FNAME", "N"); NULL for a bool (a switch)
    bool         repeatable; // TEXT: a comma-separated list that setting again extends ("" clears); flags repeat
};

// the i-th option, NULL past the end
const struct specee_option * specee_generator_option(int32_t i);
// Set an option from text ("" restores its default). 0, or -1 with specee_last_error() naming the option and
// what it takes (p is unchanged then).
int32_t specee_generator_params_set(struct specee_generator_params * p, const char * name, const char * value);
// An option's value as text (the form specee_generator_params_set reads; "" for an unset list or text). Returns
// the length, -(length needed) when len is too small, or INT32_MIN for an unknown name.
int32_t specee_generator_params_get(const struct specee_generator_params * p, const char * name, char * buf,
                                    int32_t len);
// the names of the stats' fields, in order (NULL past the end), and a field's value as a double
const char * specee_generator_stat_name(int32_t i);
double       specee_generator_stat_value(const struct specee_generator_stats * st, int32_t i);

// A row of llama.cpp's speculation types (--spec-type of llama-server and llama-cli) as this runtime takes them: the
// type's name and the mode (enum specee_mode) that serves it. One table that every frontend reads (the CLI's
// --spec-type, specee-server's, the benches: Python's specee.generate.SPEC_TYPES).
struct specee_spec_type {
    const char * name; // "ngram-mod"
    int32_t      mode; // SPECEE_MODE_NGRAM
};
// row i (i >= 0), NULL past the end
const struct specee_spec_type * specee_spec_type_row(int32_t i);

// ---- context options: one table -----------------------------------------------------------------------
//
// What a frontend takes to load a model and make its context, under llama.cpp's flags: the files, the context
// (-c -b -ub -t -tb -ctv) and where the layers go (-ngl --offload-order -dev --rpc -ts). One table
// (specee-options.cpp) names them, and its rows set each value from text and check it once
// (specee-option-values.cpp); the CLI, specee-bench, specee-server and Python's Model(...) read it (the option names
// are Model's keywords).

#define SPECEE_MAX_PATH    4096
#define SPECEE_MAX_DEVICES 16

struct specee_context_options {
    char    model[SPECEE_MAX_PATH];      // "": the frontend's default (the embedded model)
    char    draft_head[SPECEE_MAX_PATH]; // "": the model file's own head and predictors; "default": the frontend's
    char    draft_model[SPECEE_MAX_PATH]; // "": none
    int32_t n_gpu_layers_draft;           // the draft model's n_gpu_layers
    int32_t n_ctx;                       // KV cache cells; 0: the training context, at most SPECEE_DEFAULT_N_CTX
    int32_t n_batch;                     // logical batch: prompt tokens per evaluation call
    int32_t n_ubatch;                    // physical batch: most tokens in one graph (the context's n_batch is the
                                         // smaller of the two)
    int32_t n_threads;                   // <= 0: the CPUs this process may use
    int32_t n_threads_batch;             // <= 0: n_threads
    int32_t type_v;                      // enum specee_kv_type
    bool    use_mmap;
    int32_t n_gpu_layers;                // as specee_model_params
    int32_t offload_order;               // enum specee_offload_order
    char    devices[SPECEE_MAX_CHOICES];     // comma-separated device names; "": every GPU and RPC server
    char    rpc_servers[SPECEE_MAX_CHOICES]; // comma-separated HOST:PORT; "": none
    float   tensor_split[SPECEE_MAX_DEVICES];
    int32_t n_tensor_split;              // 0: by free memory
    int32_t flash_attn;                  // 0 on, 1 off, 2 auto: accepted for llama.cpp's command lines (attention is
                                         // always flash attention here)
    int32_t ngram_cache;                 // as specee_context_params
    char    lora[SPECEE_MAX_PATH];        // LoRA adapters (the LoRA section): "FNAME,..." at scale 1, then
    char    lora_scaled[SPECEE_MAX_PATH]; //   "FNAME:SCALE,..."; setting either again appends; "" clears
    bool    lora_init_without_apply;      // loaded at scale 0, applied later (the server's POST /lora-adapters)
    int32_t kernels;                     // as specee_context_params
};

struct specee_context_options specee_context_options_default(void);
// the i-th context option, NULL past the end
const struct specee_option * specee_context_option(int32_t i);
// as specee_generator_params_set / _get, for the context options
int32_t specee_context_options_set(struct specee_context_options * o, const char * name, const char * value);
int32_t specee_context_options_get(const struct specee_context_options * o, const char * name, char * buf,
                                   int32_t len);
// the model's parameters (their texts point into o: keep it while loading) and the context's (the threads resolved)
struct specee_model_params   specee_context_options_model_params(const struct specee_context_options * o);
struct specee_context_params specee_context_options_context_params(const struct specee_context_options * o);

// ---- LoRA adapters (llama.cpp's --lora, --lora-scaled) ---------------------------------------------------
//
// An adapter is a GGUF file (general.type "adapter", adapter.type "lora", general.architecture the model's,
// adapter.lora.alpha) holding, for some of the model's matrices W "<name>.weight", the pair "<name>.weight.lora_a"
// and "<name>.weight.lora_b" (python -m specee.convert lora writes one from a PEFT folder). With adapters (a_i, s_i)
// active on a context, every projection of the model's layers and its lm_head computes
//     y = W x + sum_i s_i * alpha_i / r_i * B_i (A_i x)        (alpha_i 0: s_i alone, as llama.cpp)
// The draft head, a draft model and the exit predictors are not adapted. Changing a context's set clears its KV cache
// (cells hold K/V computed under the set active when they were written); sequences decoded together share the
// context's one set. The rest of the contract: specee-lora.h.

// the most adapters active on a context at once
#define SPECEE_LORA_MAX 8

// Loads the adapter at path for `model`: NULL with specee_last_error() when the file is not a LoRA adapter, is for
// another architecture, names a matrix the model lacks, or has pairs of the wrong shapes or ranks. Free it with
// specee_lora_free after the contexts that use it are freed or no longer use it.
specee_lora * specee_lora_init(specee_model * model, const char * path);
void          specee_lora_free(specee_lora * adapter);

// The adapters the context options name (lora's files at scale 1, then lora_scaled's), loaded for `model` into
// adapters[0..n) with the scales to apply first (0 each with lora_init_without_apply): n, or -1 with
// specee_last_error() and none left loaded (a file that does not load, more than n_max).
int32_t specee_lora_init_from_options(specee_model * model, const struct specee_context_options * o,
                                      specee_lora ** adapters, float * scales, int32_t n_max);

float        specee_lora_alpha(const specee_lora * adapter);     // adapter.lora.alpha (0: none given)
int32_t      specee_lora_n_weights(const specee_lora * adapter); // the model matrices it adapts
const char * specee_lora_path(const specee_lora * adapter);

// Makes adapters[0..n) with scales[0..n) (finite) the context's active set, replacing the previous one (n = 0: none).
// Every adapter must be loaded for the context's model; at most SPECEE_LORA_MAX, no adapter twice. 0, or -1 with
// specee_last_error() (the set is left as it was). A set other than the current one clears the KV cache.
int32_t specee_context_set_lora(specee_context * ctx, specee_lora * const * adapters, const float * scales,
                                int32_t n);
// the number of active adapters, and (i < n) the i-th with its scale in *scale
int32_t       specee_context_n_lora(const specee_context * ctx);
specee_lora * specee_context_lora(const specee_context * ctx, int32_t i, float * scale);

// ---- chat templates ------------------------------------------------------------------------------

struct specee_chat_message {
    const char * role;    // "system", "user", "assistant"
    const char * content;
};

// Template name for a GGUF's tokenizer.chat_template text (or a name given by the user): "chatml",
// "llama2", "vicuna", ...; NULL when not recognised.
const char * specee_chat_template_detect(const char * tmpl);
// The template to render a model's chats with: `name` when given (a name, or a Jinja text with a known template's
// markers), else the model's own tokenizer.chat_template. NULL with specee_last_error() when that is not known.
const char * specee_chat_template_resolve(const specee_model * model, const char * name);
// The tokens of messages rendered with a template (name as for specee_chat_template_resolve; NULL: the model's), its
// special-token text parsed, BOS as the vocabulary asks (not twice when the template writes it). Returns the count,
// -(count needed) when n_max is too small, or INT32_MIN on error.
int32_t specee_chat_tokenize(const specee_model * model, const char * name, const struct specee_chat_message * msgs,
                             int32_t n_msgs, bool add_ass, int32_t * tokens, int32_t n_max);
// Renders messages with a named template (see specee_chat_template_detect); add_ass: end with the
// assistant's prefix. Returns the length, or -(length needed) when len is too small, or INT32_MIN on error.
int32_t specee_chat_apply_template(const char * name, const struct specee_chat_message * msgs, int32_t n_msgs,
                                   bool add_ass, char * buf, int32_t len);

#ifdef __cplusplus
}
#endif
