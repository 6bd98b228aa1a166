// specee-stats.cpp: the names of a generation's stats fields (specee_generator_stats), a field's value by index, and
// the figures derived from the counts (mean accepted tokens, exit ratio, mean layers run)
#include "specee-options.h"
#include "specee-stats.h"
#include "specee.h"

#include <cstddef>

struct stat_def {
    const char * name;
    size_t       offset;
    char         type; // 'i' int32, 'l' int64, 'd' double
};

#define STAT(f, t) {#f, offsetof(specee_generator_stats, f), t}

static const stat_def STATS[] = {
    STAT(n_prompt, 'i'),   STAT(n_reused, 'i'),    STAT(t_prompt_ms, 'd'),  STAT(n_tokens, 'i'),
    STAT(n_decoded, 'i'),  STAT(n_steps, 'i'),     STAT(t_decode_ms, 'd'),  STAT(t_sample_ms, 'd'),
    STAT(n_drafted, 'i'),  STAT(n_accepted, 'i'),  STAT(t_draft_ms, 'd'),   STAT(t_verify_ms, 'd'),
    STAT(n_cache_drafted, 'i'), STAT(n_cache_accepted, 'i'),
    STAT(n_exits, 'i'),    STAT(n_layers_run, 'l'), STAT(n_checks, 'i'),    STAT(n_fired, 'i'),
    STAT(n_rejected, 'i'), STAT(t_layers_ms, 'd'), STAT(t_check_ms, 'd'),   STAT(t_exit_ms, 'd'),
    STAT(t_head_ms, 'd'),  STAT(t_fill_ms, 'd'),   STAT(n_verified, 'i'),   STAT(n_rollbacks, 'i'),
    STAT(n_discarded, 'i'), STAT(t_mask_ms, 'd'),   STAT(n_grammar_dropped, 'i'), STAT(n_grammar_masked, 'i'),
    STAT(mean_accepted_tokens, 'd'), STAT(exit_ratio, 'd'), STAT(mean_layers_run, 'd'),
};

#undef STAT

extern "C" const char * specee_generator_stat_name(int32_t i) {
    return i >= 0 && i < (int32_t) (sizeof(STATS) / sizeof(STATS[0])) ? STATS[i].name : nullptr;
}

extern "C" double specee_generator_stat_value(const struct specee_generator_stats * st, int32_t i) {
    if (!st || !specee_generator_stat_name(i)) {
        return 0.0;
    }
    const char * f = (const char *) st + STATS[i].offset;
    return STATS[i].type == 'i' ? *(const int32_t *) f : STATS[i].type == 'l' ? (double) *(const int64_t *) f
                                                                              : *(const double *) f;
}

void specee_generator_stats_derive(specee_generator_stats & st, int32_t mode) {
    const bool   tree  = specee_mode_row_impl(mode).tree;
    const bool   exit  = specee_mode_row_impl(mode).exits;
    const double steps = st.n_steps > 0 ? st.n_steps : 0.0;
    st.mean_accepted_tokens = tree && steps > 0 ? st.n_decoded / steps : 0.0;
    st.exit_ratio           = exit && steps > 0 ? st.n_exits / steps : 0.0;
    st.mean_layers_run      = exit && steps > 0 ? (double) st.n_layers_run / steps : 0.0;
}
