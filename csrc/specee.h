// specee.h: the narrow public C API of the SpecEE runtime.
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

// the message of the last failed call on this thread ("" when none)
const char * specee_last_error(void);

// silence ggml's and the loader's informational logging (errors still reach specee_last_error)
void specee_log_set_verbose(bool verbose);

// ---- model -------------------------------------------------------------------------------------

struct specee_model_params {
    bool use_mmap; // map the weights from the file (default); false reads them into memory
};

struct specee_model_params specee_model_default_params(void);

specee_model * specee_model_load(const char * path, struct specee_model_params params);
void           specee_model_free(specee_model * model);

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

// ---- vocabulary (tokenizer.ggml.* metadata) ---------------------------------------------------

// token ids of special tokens, -1 when the model has none
int32_t specee_token_bos(const specee_model * model);
int32_t specee_token_eos(const specee_model * model);
int32_t specee_token_eot(const specee_model * model);
// end of generation (eos, eot, and other tokens marked as such)
bool    specee_token_is_eog(const specee_model * model, int32_t token);
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

// ---- context and evaluation --------------------------------------------------------------------

struct specee_context_params {
    uint32_t n_ctx;           // KV cache cells; 0 = the model's training context
    uint32_t n_batch;         // most tokens in one graph; longer plain batches are split
    int32_t  n_threads;       // threads for single-token decode
    int32_t  n_threads_batch; // threads for batches of more than one token
};

struct specee_context_params specee_context_default_params(void);

specee_context * specee_context_init(specee_model * model, struct specee_context_params params);
void             specee_context_free(specee_context * ctx);

uint32_t specee_n_ctx(const specee_context * ctx);
uint32_t specee_n_batch(const specee_context * ctx);

struct specee_batch {
    int32_t         n_tokens;
    const int32_t * token;     // [n_tokens] token ids
    const int32_t * pos;       // [n_tokens] positions, or NULL: continue after the highest cached position
    const uint8_t * tree_mask; // [n_tokens * n_tokens] or NULL (causal): tree_mask[i*n_tokens + j] != 0 when
                               // token i attends to batch token j; cached cells are seen when their pos <= pos[i]
    const int8_t *  output;    // [n_tokens] which tokens get logits, or NULL: the last one only
};

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
// layer. Other layers need SPECEE_EVAL_HIDDEN_ALL. NULL when not available.
const float * specee_get_hidden(const specee_context * ctx, int32_t il);
// final-norm output of the last batch [n_tokens][n_embd] (the lm_head input, EAGLE's feature)
const float * specee_get_norm(const specee_context * ctx);
int32_t       specee_last_n_tokens(const specee_context * ctx);

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
// add a token to the history (prompt tokens too, for the repetition penalty)
void    specee_sampler_accept(specee_sampler * smpl, int32_t token);
void    specee_sampler_reset(specee_sampler * smpl);

// ---- chat templates ------------------------------------------------------------------------------

struct specee_chat_message {
    const char * role;    // "system", "user", "assistant"
    const char * content;
};

// Template name for a GGUF's tokenizer.chat_template text (or a name given by the user): "chatml",
// "llama2", "vicuna", ...; NULL when not recognised.
const char * specee_chat_template_detect(const char * tmpl);
// Renders messages with a named template (see specee_chat_template_detect); add_ass: end with the
// assistant's prefix. Returns the length, or -(length needed) when len is too small, or INT32_MIN on error.
int32_t specee_chat_apply_template(const char * name, const struct specee_chat_message * msgs, int32_t n_msgs,
                                   bool add_ass, char * buf, int32_t len);

#ifdef __cplusplus
}
#endif
