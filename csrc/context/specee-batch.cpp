// specee-batch.cpp: a batch's checks, positions and output flags (specee-batch.h)
#include "specee-batch.h"

#include "specee-impl.h"
#include "specee-kv-cache.h"

#include <climits>
#include <map>

void specee_batch_check(const specee_batch * batch, uint32_t n_batch, int32_t n_vocab) {
    if (!batch || batch->n_tokens <= 0 || !batch->token) {
        specee_fail("empty batch: nothing to evaluate");
    }
    if ((uint32_t) batch->n_tokens > n_batch) {
        specee_fail("batch of %d tokens exceeds n_batch=%u", batch->n_tokens, n_batch);
    }
    for (int32_t i = 0; i < batch->n_tokens; ++i) {
        if (batch->token[i] < 0 || batch->token[i] >= n_vocab) {
            specee_fail("token id %d at index %d is out of range [0, %d)", batch->token[i], i, n_vocab);
        }
        if (batch->pos && batch->pos[i] < 0) {
            specee_fail("negative position %d at index %d", batch->pos[i], i);
        }
        if (batch->seq_id && (batch->seq_id[i] < 0 || batch->seq_id[i] >= SPECEE_MAX_SEQ)) {
            specee_fail("sequence id %d at index %d is out of range [0, %d)", batch->seq_id[i], i, SPECEE_MAX_SEQ);
        }
    }
}

int32_t specee_batch_next_pos(const specee_kv_cache & kv, int32_t n, int32_t s) {
    const int64_t p0 = (int64_t) kv.pos_max(s) + 1;
    if (p0 + n - 1 > INT32_MAX) {
        specee_fail("position overflow: %d tokens after position %d pass the largest position, %d (give positions, "
                    "or clear the cache)", n, kv.pos_max(s), INT32_MAX);
    }
    return (int32_t) p0;
}

void specee_batch_positions(const specee_kv_cache & kv, const specee_batch * batch, std::vector<int32_t> & pos) {
    const int32_t n = batch->n_tokens;
    pos.resize(n);
    if (batch->pos) {
        pos.assign(batch->pos, batch->pos + n);
    } else if (!batch->seq_id) {
        const int32_t p0 = specee_batch_next_pos(kv, n);
        for (int32_t i = 0; i < n; ++i) {
            pos[i] = p0 + i;
        }
    } else {
        std::map<int32_t, int32_t> next;
        for (int32_t i = 0; i < n; ++i) {
            const int32_t s  = batch->seq_id[i];
            auto          it = next.find(s);
            if (it == next.end()) {
                int32_t count = 0;
                for (int32_t j = i; j < n; ++j) {
                    count += batch->seq_id[j] == s;
                }
                it = next.emplace(s, specee_batch_next_pos(kv, count, s)).first;
            }
            pos[i] = it->second++;
        }
    }
}

bool specee_batch_output(const specee_batch * batch, int32_t i) {
    return batch->output ? batch->output[i] != 0 : i == batch->n_tokens - 1;
}
