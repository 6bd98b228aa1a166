// specee-slot-cache.h: the public C API of the parallel slots' caches (beside specee.h; specee-slot-cache.cpp
// implements it): the cache shared whole (unified), a slot's cache (its cells: tokens, positions, K/V) written to a
// file or to memory, read back into a slot, or erased, the slot a prompt's cached prefix chooses, and an embedding
// between the slots' passes. Every call locks the context, as specee.h's slot calls do.
#pragma once

#include "specee.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// unified != 0 (llama.cpp's --kv-unified): every slot may use the whole cache (n_ctx cells, not n_ctx / n_slots);
// a request's submit drops the idle slots' caches, and a pass the running requests together overflow fails (-1,
// "context overflow", as specee.h's calls do) instead of never running out. Only before the first request. Returns
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

#ifdef __cplusplus
}
#endif
