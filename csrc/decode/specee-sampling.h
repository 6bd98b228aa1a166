// specee-sampling.h: the sampler's internals for the decoding loops (they throw specee_error instead of returning -1)
#pragma once

#include "specee.h"

#include <cstdint>
#include <utility>
#include <vector>

struct specee_grammar;
struct specee_sampler;

// The distribution the sampler draws from for one row of logits, as (token, p > 0) pairs: the chain's
// transforms (repetition penalty when `penalty`, top-k, top-p, min-p, temperature); greedy: the argmax, p = 1.
void   specee_sampler_dist(specee_sampler & s, const float * logits, int32_t n_vocab, bool penalty,
                           std::vector<std::pair<int32_t, float>> & out);
// a token's log-probability under a row of logits (log-softmax), then the n_top most likely tokens' (most likely first,
// equal logits by id, so the order is the same every time), appended to out
void   specee_logprobs(const float * logits, int32_t n_vocab, int32_t t, int32_t n_top,
                       std::vector<specee_token_logprob> & out);
// llama.cpp's post_sampling_probs: the distribution the sampler's last draw took t from, after its chain (top-k,
// top-p, min-p, temperature): t's log-probability, then the n_top most likely of the tokens kept (most likely first,
// equal ones by id), padded with token -1 (log-probability -inf) where fewer were kept; a greedy draw, or a token the
// grammar left alone: t, certain. Call it before the sampler's next draw.
void   specee_sampler_drawn_logprobs(const specee_sampler & s, int32_t t, int32_t n_top,
                                     std::vector<specee_token_logprob> & out);
// indices of the k largest of x[0..n), largest first; equal values by lower index (deterministic)
std::vector<int32_t> specee_top_k(const float * x, int32_t n, int32_t k);
// the next uniform in [0, 1) of the sampler's seeded generator
double specee_sampler_uniform(specee_sampler & s);
bool   specee_sampler_greedy(const specee_sampler & s);

specee_sampler * specee_sampler_init_impl(const specee_sampler_params & params);
// the next token from one row of the target's logits [n_vocab] (logit biases and penalties applied)
int32_t          specee_sampler_sample_impl(specee_sampler & s, const float * logits, int32_t n_vocab);
void             specee_sampler_accept_impl(specee_sampler & s, int32_t token);
void             specee_sampler_reset_impl(specee_sampler & s);
void             specee_sampler_set_logit_bias_impl(specee_sampler & s, int32_t token, float bias);
// the seed in use (the params' seed, or the random one drawn for SPECEE_DEFAULT_SEED)
uint32_t         specee_sampler_seed(const specee_sampler & s);
// dst's history (repetition penalties) becomes src's
void             specee_sampler_copy_history(specee_sampler & dst, const specee_sampler & src);
// the accepted tokens the penalties look back over, and putting such a record back (checked exits draw again from an
// earlier point)
std::vector<int32_t> specee_sampler_history(const specee_sampler & s);
void                 specee_sampler_set_history(specee_sampler & s, const std::vector<int32_t> & history);

// The sampler's grammar (specee-grammar.h; owned, NULL: none). Every draw from the target's logits keeps only the
// tokens it allows (after the logit biases and penalties; when it allows nothing but the end, the draw is its
// end-of-generation token even under ignore-EOS). Tokens accepted after a reset advance it from the first draw on:
// those accepted before are the prompt's. The history's copy and record (above) leave it alone.
void             specee_sampler_set_grammar(specee_sampler & s, specee_grammar * g);
specee_grammar * specee_sampler_take_grammar(specee_sampler & s); // the caller owns it then
specee_grammar * specee_sampler_grammar(const specee_sampler & s);
// the grammar's next mask on its worker while the caller runs a pass (specee_grammar_prefetch), and the milliseconds
// the decoding thread has spent on its masks; without a grammar nothing, and 0
void             specee_sampler_prefetch(specee_sampler & s);
double           specee_sampler_mask_ms(const specee_sampler & s);
