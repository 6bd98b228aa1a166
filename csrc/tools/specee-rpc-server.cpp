// specee-rpc-server: this machine's CPU as a ggml RPC device for another process or machine (`specee-cli --rpc
// HOST:PORT`, llama.cpp's --rpc too), on ggml's own RPC server. The protocol has no authentication: it binds
// 127.0.0.1 unless told otherwise, and warns when it is told otherwise.
#include "ggml-backend.h"

#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include <unistd.h>

struct server_params {
    std::string host      = "127.0.0.1";
    int         port      = 50052;
    int         n_threads = std::max(1, (int) std::thread::hardware_concurrency());
    std::string cache_dir;
    int         timeout_s = 0; // 0: until stopped
};

static void print_usage(const char * argv0) {
    const server_params d;
    printf("usage: %s [options]\n\n", argv0);
    printf("Serves this machine's CPU as a ggml RPC device: layers placed on it by `specee-cli --rpc HOST:PORT -ngl N`\n");
    printf("(or upstream llama.cpp's --rpc) run here. The protocol has no authentication: whoever reaches the port can\n");
    printf("use it, so it listens on 127.0.0.1 unless -H says otherwise.\n\noptions:\n");
    printf("  -h, --help               print this help and exit\n");
    printf("  -H, --host HOST          address to listen on (default: %s; anything else is reachable from other\n",
           d.host.c_str());
    printf("                           machines: use it on a trusted network only)\n");
    printf("  -p, --port PORT          port (default: %d)\n", d.port);
    printf("  -t, --threads N          CPU threads for the graphs it computes (default: %d)\n", d.n_threads);
    printf("  -c, --cache DIR          keep received weights in DIR, so a later load of the same file sends hashes only\n");
    printf("      --timeout SECONDS    stop after this long (default: 0 = until stopped)\n");
}

static bool parse_int(const char * s, int lo, int hi, int & out) {
    errno    = 0;
    char * e = nullptr;
    long   v = strtol(s, &e, 10);
    if (!*s || *e || errno == ERANGE || v < lo || v > hi) {
        return false;
    }
    out = (int) v;
    return true;
}

int main(int argc, char ** argv) {
    server_params p;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "-h" || arg == "--help") {
            print_usage(argv[0]);
            return 0;
        }
        const bool known = arg == "-H" || arg == "--host" || arg == "-p" || arg == "--port" || arg == "-t" ||
                           arg == "--threads" || arg == "-c" || arg == "--cache" || arg == "--timeout";
        if (!known) {
            fprintf(stderr, "error: unknown argument: %s (see --help)\n", arg.c_str());
            return 1;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "error: %s needs a value\n", arg.c_str());
            return 1;
        }
        const char * v  = argv[++i];
        bool         ok = true;
        if (arg == "-H" || arg == "--host") {
            p.host = v;
            ok     = !p.host.empty();
        } else if (arg == "-p" || arg == "--port") {
            ok = parse_int(v, 1, 65535, p.port);
        } else if (arg == "-t" || arg == "--threads") {
            ok = parse_int(v, 1, 1024, p.n_threads);
        } else if (arg == "-c" || arg == "--cache") {
            p.cache_dir = v;
            ok          = !p.cache_dir.empty();
        } else {
            ok = parse_int(v, 0, INT_MAX, p.timeout_s);
        }
        if (!ok) {
            fprintf(stderr, "error: invalid value for %s: '%s' (see --help)\n", arg.c_str(), v);
            return 1;
        }
    }
    if (p.host != "127.0.0.1" && p.host != "localhost" && p.host != "::1") {
        fprintf(stderr, "warning: listening on %s: the ggml RPC protocol has no authentication, so anyone who can reach "
                        "%s:%d can run graphs and read or write memory on this machine; use it on a trusted network "
                        "only\n", p.host.c_str(), p.host.c_str(), p.port);
    }
    ggml_backend_reg_t rpc   = ggml_backend_reg_by_name("RPC");
    auto               start = rpc ? (void (*)(const char *, const char *, size_t, size_t, ggml_backend_dev_t *))
                                         ggml_backend_reg_get_proc_address(rpc, "ggml_backend_rpc_start_server")
                                   : nullptr;
    ggml_backend_dev_t cpu   = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!start || !cpu) {
        fprintf(stderr, "error: this build of ggml has no RPC backend (ggml/install.sh builds it in; the prebuilt "
                        "wheel has none)\n");
        return 1;
    }
    if (p.timeout_s > 0) {
        signal(SIGALRM, SIG_DFL);
        alarm((unsigned) p.timeout_s); // a bounded run: the alarm ends the process
    }
    const std::string endpoint = p.host + ":" + std::to_string(p.port);
    fflush(stdout);
    start(endpoint.c_str(), p.cache_dir.empty() ? nullptr : p.cache_dir.c_str(), (size_t) p.n_threads, 1, &cpu);
    fprintf(stderr, "error: the RPC server on %s stopped (is the port in use?)\n", endpoint.c_str());
    return 1;
}
