// specee-batch.h: a batch (struct specee_batch, specee.h) before it is evaluated: its checks, its tokens' positions
// and which of them get logits (as llama.cpp's llama-batch validates a batch and fills in what it leaves out). The
// context (specee-context.cpp) copies a checked batch in and places it in the KV cache.
//
// Contract: nothing here changes the cache; positions left out continue each sequence after its highest cached
// position, and a position past INT32_MAX is an error, never a wrap.
#pragma once

#include "specee.h"

#include <cstdint>
#include <vector>

struct specee_kv_cache;

// a batch that can be evaluated: 1..n_batch tokens in the vocabulary [0, n_vocab), non-negative positions, sequence
// ids in [0, SPECEE_MAX_SEQ); throws with the first reason it is not
void    specee_batch_check(const specee_batch * batch, uint32_t n_batch, int32_t n_vocab);
// the position of the first of n tokens that continue the cache's sequence s (-1: kv.seq_cur); throws when the last of
// them would pass INT32_MAX
int32_t specee_batch_next_pos(const specee_kv_cache & kv, int32_t n, int32_t s = -1);
// the positions of a batch's tokens [n_tokens]: given, or each sequence's continuing after its last cached position
void    specee_batch_positions(const specee_kv_cache & kv, const specee_batch * batch, std::vector<int32_t> & pos);
// whether token i gets logits: batch->output[i] != 0, or (no output flags) when it is the last token
bool    specee_batch_output(const specee_batch * batch, int32_t i);
