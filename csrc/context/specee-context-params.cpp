// specee-context-params.cpp: a context's parameters before anything is allocated: their defaults, their resolution
// (0: the default; thread counts capped; n_ctx within int32 positions) and the memory check of the sizes they ask for
// against what the host and the devices have free (where each layer's KV cache lives: its backend); the limits they
// are held to (threads, the host's memory).
#include "specee-context-params.h"

#include "specee-impl.h"
#include "specee-model.h"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <thread>
#include <sched.h>
#include <unistd.h>

// ---- limits: threads, memory --------------------------------------------------------------------------

// The CPUs this process may run on (its affinity mask, as taskset or a container sets it), at most 512. More threads
// than that wait on each other: every operation of a graph ends at a barrier, and a thread that is not running makes
// the others wait a scheduler slice there (SmolLM2 at -t 4 on 2 CPUs decoded at 0.27x of -t 2, upstream llama.cpp
// too; docs/benchmarks.md, "Threads").
extern "C" int32_t specee_max_threads(void) {
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
        return std::min(512, std::max(1, CPU_COUNT(&set)));
    }
#endif
    return (int32_t) std::min(512u, std::max(1u, std::thread::hardware_concurrency()));
}

// bytes of memory the system can still give: MemAvailable (Linux), within the cgroup's limit when there is one;
// elsewhere the free physical pages; 0 when unknown
static uint64_t host_available_bytes() {
    uint64_t avail = 0;
    if (FILE * f = fopen("/proc/meminfo", "r")) {
        char               line[256];
        unsigned long long kb = 0;
        while (fgets(line, sizeof(line), f)) {
            if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
                avail = (uint64_t) kb * 1024;
                break;
            }
        }
        fclose(f);
    }
#ifdef _SC_AVPHYS_PAGES
    if (avail == 0) {
        const long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
        avail            = pages > 0 && page > 0 ? (uint64_t) pages * (uint64_t) page : 0;
    }
#endif
    unsigned long long max = 0, cur = 0;
    FILE *             fm  = fopen("/sys/fs/cgroup/memory.max", "r"); // cgroup v2; "max" when unlimited
    FILE *             fc  = fopen("/sys/fs/cgroup/memory.current", "r");
    if (fm && fc && fscanf(fm, "%llu", &max) == 1 && fscanf(fc, "%llu", &cur) == 1 && max > cur) {
        avail = avail ? std::min<uint64_t>(avail, max - cur) : max - cur;
    }
    if (fm) {
        fclose(fm);
    }
    if (fc) {
        fclose(fc);
    }
    return avail;
}

int32_t specee_backend_of_layer(const specee_model & model, int32_t n_backends, int32_t il) {
    const int32_t dev = specee_model_device_of_layer(model, il);
    return dev < 0 ? n_backends - 1 : dev;
}

// The compute buffers are estimated from the worst-case graph: n_batch tokens' attention mask over the whole context
// (in the graph and on the host), their activations and logits.
void specee_context_check_memory(const specee_model & model, const std::vector<ggml_backend_t> & backends,
                                 ggml_backend_t backend_cpu, uint32_t n_ctx, uint32_t n_batch, ggml_type type_v) {
    const specee_hparams & hp = model.hparams;
    std::vector<uint64_t>  kv(backends.size(), 0);
    for (uint32_t il = 0; il < hp.n_layer; ++il) {
        kv[specee_backend_of_layer(model, (int32_t) backends.size(), (int32_t) il)] +=
            (uint64_t) n_ctx * (ggml_row_size(GGML_TYPE_F16, hp.n_embd_k_gqa()) + ggml_row_size(type_v, hp.n_embd_v_gqa()));
    }
    const uint64_t n_kv    = ((uint64_t) n_ctx + 255) / 256 * 256;
    const uint64_t compute = (uint64_t) n_batch * (n_kv * 2 * sizeof(ggml_fp16_t) +
                                                   ((uint64_t) hp.n_vocab + 3ull * hp.n_ff + 8ull * hp.n_embd) * 4) +
                             (uint64_t) n_ctx * (hp.n_layer + 8);
    for (size_t b = 0; b < backends.size(); ++b) {
        const bool cpu  = backends[b] == backend_cpu;
        uint64_t   need = kv[b] + (cpu ? compute : 0);
        uint64_t   avail;
        if (cpu) {
            avail = host_available_bytes();
        } else {
            size_t free = 0, total = 0;
            ggml_backend_dev_memory(ggml_backend_get_device(backends[b]), &free, &total);
            avail = free;
        }
        if (avail > 0 && need > avail) {
            specee_fail("KV cache of %.0f MiB for n_ctx=%u (and %.0f MiB of compute buffers for n_batch=%u) exceeds "
                        "the available memory of %s, %.0f MiB: use a smaller context (-c, n_ctx)",
                        kv[b] / 1048576.0, n_ctx, (cpu ? compute : 0) / 1048576.0, n_batch,
                        ggml_backend_name(backends[b]), avail / 1048576.0);
        }
    }
}

// ---- the parameters ----------------------------------------------------------------------------------

extern "C" struct specee_context_params specee_context_default_params(void) {
    specee_context_params p;
    p.n_ctx           = 0;
    p.n_batch         = 512;
    p.n_threads       = specee_max_threads();
    p.n_threads_batch = p.n_threads;
    p.type_v          = SPECEE_KV_F32;
    p.ngram_cache     = SPECEE_DEFAULT_NGRAM_CACHE;
    p.kernels         = 0; // auto
    return p;
}

specee_context_params specee_context_params_resolve(const specee_model & model, specee_context_params params) {
    if (params.n_ctx == 0) {
        params.n_ctx = std::min<uint32_t>(model.hparams.n_ctx_train, SPECEE_DEFAULT_N_CTX);
    }
    if (params.n_ctx > INT32_MAX) {
        specee_fail("n_ctx=%u is too large: a context holds at most %d positions", params.n_ctx, INT32_MAX);
    }
    if (params.n_batch == 0) {
        params.n_batch = 512;
    }
    params.n_batch = std::min(params.n_batch, params.n_ctx);
    if (params.n_threads <= 0) {
        params.n_threads = specee_context_default_params().n_threads;
    }
    if (params.n_threads_batch <= 0) {
        params.n_threads_batch = params.n_threads;
    }
    const int32_t cpus = specee_max_threads(); // the frontends warn (the CLI, Model)
    params.n_threads       = std::min(params.n_threads, cpus);
    params.n_threads_batch = std::min(params.n_threads_batch, cpus);
    if (params.ngram_cache < 0) {
        specee_fail("ngram_cache=%d: the tokens the n-gram cache keeps must be >= 0 (0: off)", params.ngram_cache);
    }
    if (params.kernels < 0 || params.kernels > 2) {
        specee_fail("unknown kernels mode %d (0: auto, 1: portable, 2: off)", params.kernels);
    }
    if (params.type_v != SPECEE_KV_F16 && params.type_v != SPECEE_KV_F32) {
        specee_fail("unknown V cache type %d (0: f16, 1: f32)", params.type_v);
    }
    return params;
}
