// specee-openmp.cpp: how long an OpenMP thread spins at a barrier before it sleeps, set for every tool. ggml ends
// every operation of a graph at a barrier; libgomp spins there 300,000 rounds by default, and only 1,000 when it has
// more threads than CPUs. On a machine where other jobs run, a spinning thread keeps the thread it waits for off the
// CPU: SmolLM2 at -t 2 beside two busy processes took over 60 s for 32 tokens with the default (upstream llama.cpp
// too), 0.7 s with 1,000 rounds, and the same 0.25 s on an idle machine (docs/benchmarks.md, "Threads").
//
// libgomp reads GOMP_SPINCOUNT once, in its initialiser, which for an executable runs before main; a variable set by
// a pre-initialisation function is lost when the C library's initialiser sets the environment again. So the tool
// runs itself again with the variable set (one exec, before anything is loaded). A value the user set is kept. The
// Python package sets it before it loads the runtime (specee/_ggml.py).
#include "specee-openmp.h"

#include <cstdlib>
#include <unistd.h>

void specee_openmp_setup(char ** argv) {
    if (getenv("GOMP_SPINCOUNT") != nullptr) {
        return;
    }
    setenv("GOMP_SPINCOUNT", "1000", /*overwrite =*/0);
    execv("/proc/self/exe", argv); // returns only on failure: the tool runs on with libgomp's default
}
