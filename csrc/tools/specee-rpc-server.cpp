// specee-rpc-server: this machine's CPU as a ggml RPC device for another process or machine (`specee-cli --rpc
// HOST:PORT`, llama.cpp's --rpc too). Only parses flags; the server is csrc/rpc/specee-rpc-server.cpp.
#include "specee-rpc-server.h"
#include "specee-openmp.h"

#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include <unistd.h>

static void print_usage(const char * argv0) {
    const specee_rpc_server_params d;
    printf("usage: %s [options]\n\n", argv0);
    printf("Serves this machine's CPU as a ggml RPC device (protocol 5, as ggml's own rpc-server): layers placed on\n");
    printf("it by `specee-cli --rpc HOST:PORT -ngl N` (or upstream llama.cpp's --rpc) run here. Each connection has\n");
    printf("its own thread and buffers; every message is checked before it is acted on, and one that breaks a rule\n");
    printf("closes its connection (one log line) while the server goes on. Ops outside the Llama family's are refused.\n");
    printf("\noptions:\n");
    printf("  -h, --help               print this help and exit\n");
    printf("  -H, --host HOST          IPv4 address to listen on (default: %s). Any address other than loopback\n",
           d.host.c_str());
    printf("                           (127.x.x.x) is reachable from other machines and needs a token\n");
    printf("  -p, --port PORT          port (default: %d)\n", d.port);
    printf("  -t, --threads N          CPU threads for the graphs it computes (default: all cores)\n");
    printf("  -c, --cache DIR          keep received weights in DIR, so a later load of the same file sends hashes only\n");
    printf("      --cache-max MIB      the most the cache directory may hold, in MiB (default: %llu); weights beyond it,\n",
           (unsigned long long) (d.cache_max >> 20));
    printf("                           or beyond the last GiB of its disk, are not kept\n");
    printf("      --auth-token-file F  a shared secret (the file's first line, 1-256 bytes) every client must send\n");
    printf("                           before any command; the environment variable SPECEE_RPC_TOKEN gives it too.\n");
    printf("                           Clients (specee-cli --rpc, Model(rpc_servers=...)) send SPECEE_RPC_TOKEN. The\n");
    printf("                           token is sent in clear: it keeps others out, it does not hide the traffic.\n");
    printf("                           A wrong token is answered after 0.5 s, one at a time for the whole server\n");
    printf("      --max-memory MIB     buffers, messages, graphs and the kernels' scratch memory held for all clients\n");
    printf("                           together, in MiB (default: 0 = the machine's RAM); a request beyond it gets a\n");
    printf("                           failed allocation\n");
    printf("      --max-clients N      connections served at once (default: %d); more are closed at once\n",
           d.max_clients);
    printf("      --max-buffers N      buffers one connection may hold at once (default: %d); each buffer counts in\n",
           d.max_buffers);
    printf("                           --max-memory at its size rounded up to 64 bytes plus %d bytes\n",
           (int) SPECEE_RPC_BUFFER_OVERHEAD);
    printf("      --max-graph-nodes N  nodes of one graph (default: %u); a node listed twice is refused\n",
           d.max_graph_nodes);
    printf("      --max-graph-cost G   work of one graph, in 2^30 multiply-adds (default: %llu); graphs run in slices\n",
           (unsigned long long) (d.max_graph_cost >> 30));
    printf("                           of bounded work, taking turns with other clients' slices in arrival order\n");
    printf("      --recv-timeout S     the longest wait for the rest of a started message, and for the handshake\n");
    printf("                           after connecting, in seconds (default: %d; between commands: --idle-timeout)\n",
           d.recv_timeout_ms / 1000);
    printf("      --idle-timeout S     close a client that sends no command for this long (default: %d; 0 = no limit,\n",
           d.idle_timeout_ms / 1000);
    printf("                           for a client that stays connected through long pauses, e.g. llama-server --rpc)\n");
    printf("      --timeout SECONDS    stop after this long (default: 0 = until stopped)\n");
}

static bool parse_int(const char * s, long lo, long hi, long & out) {
    errno    = 0;
    char * e = nullptr;
    long   v = strtol(s, &e, 10);
    if (!*s || *e || errno == ERANGE || v < lo || v > hi) {
        return false;
    }
    out = v;
    return true;
}

static bool read_token(const std::string & path, std::string & token) {
    std::ifstream in(path);
    return in && std::getline(in, token) && !token.empty();
}

static bool set_option(specee_rpc_server_params & p, long & timeout_s, const std::string & arg, const char * v) {
    long n = 0;
    if (arg == "-H" || arg == "--host") {
        p.host = v;
        return !p.host.empty();
    }
    if (arg == "-c" || arg == "--cache") {
        p.cache_dir = v;
        return !p.cache_dir.empty();
    }
    if (arg == "--auth-token-file") {
        return read_token(v, p.token);
    }
    if (arg == "--max-graph-cost" || arg == "--cache-max") {
        if (!parse_int(v, 1, LONG_MAX >> 30, n)) {
            return false;
        }
        (arg == "--cache-max" ? p.cache_max : p.max_graph_cost) = (uint64_t) n << (arg == "--cache-max" ? 20 : 30);
        return true;
    }
    const bool ok = arg == "-p" || arg == "--port"  ? parse_int(v, 1, 65535, n)
                  : arg == "--max-memory"           ? parse_int(v, 0, LONG_MAX / 1048576, n)
                  : arg == "-t" || arg == "--threads" ? parse_int(v, 1, 1024, n)
                  : arg == "--max-clients"          ? parse_int(v, 1, 4096, n)
                  : arg == "--max-buffers"          ? parse_int(v, 1, 1 << 22, n)
                  : arg == "--max-graph-nodes"      ? parse_int(v, 1, 1 << 24, n)
                  : arg == "--recv-timeout"         ? parse_int(v, 1, 86400, n)
                  : arg == "--idle-timeout"         ? parse_int(v, 0, 86400 * 365, n)
                                                    : parse_int(v, 0, INT_MAX, n);
    if (arg == "-p" || arg == "--port") {
        p.port = (int) n;
    } else if (arg == "--max-memory") {
        p.max_memory = (uint64_t) n << 20;
    } else if (arg == "-t" || arg == "--threads") {
        p.n_threads = (int) n;
    } else if (arg == "--max-clients") {
        p.max_clients = (int) n;
    } else if (arg == "--max-buffers") {
        p.max_buffers = (int) n;
    } else if (arg == "--max-graph-nodes") {
        p.max_graph_nodes = (uint32_t) n;
    } else if (arg == "--recv-timeout") {
        p.recv_timeout_ms = (int) n * 1000;
    } else if (arg == "--idle-timeout") {
        p.idle_timeout_ms = (int) std::min<long>(n * 1000, INT_MAX);
    } else {
        timeout_s = n;
    }
    return ok;
}

int main(int argc, char ** argv) {
    specee_openmp_setup(argv);
    specee_rpc_server_params p;
    p.n_threads    = std::max(1, (int) std::thread::hardware_concurrency());
    long timeout_s = 0;
    if (const char * env = getenv("SPECEE_RPC_TOKEN")) {
        p.token = env;
    }
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "-h" || arg == "--help") {
            print_usage(argv[0]);
            return 0;
        }
        static const char * known[] = { "-H", "--host", "-p", "--port", "-t", "--threads", "-c", "--cache",
                                        "--timeout", "--auth-token-file", "--max-memory", "--max-clients",
                                        "--recv-timeout", "--idle-timeout", "--max-buffers", "--max-graph-nodes",
                                        "--max-graph-cost", "--cache-max" };
        bool is_known = false;
        for (const char * k : known) {
            is_known = is_known || arg == k;
        }
        if (!is_known) {
            fprintf(stderr, "error: unknown argument: %s (see --help)\n", arg.c_str());
            return 1;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "error: %s needs a value\n", arg.c_str());
            return 1;
        }
        const char * v = argv[++i];
        if (!set_option(p, timeout_s, arg, v)) {
            fprintf(stderr, "error: invalid value for %s: '%s' (see --help)\n", arg.c_str(), v);
            return 1;
        }
    }
    if (p.token.size() > 256) {
        fprintf(stderr, "error: the token is longer than 256 bytes\n");
        return 1;
    }
    if (p.token.empty() && !specee_rpc_host_is_loopback(p.host)) {
        fprintf(stderr, "error: listening on %s makes this machine's memory and compute reachable from other "
                        "machines: give a token (--auth-token-file FILE or SPECEE_RPC_TOKEN), or listen on 127.0.0.1\n",
                p.host.c_str());
        return 1;
    }
    // Ctrl-C and kill stop it, also when started from a script's background job (which inherits SIGINT ignored)
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    if (timeout_s > 0) {
        signal(SIGALRM, SIG_DFL);
        alarm((unsigned) timeout_s); // a bounded run: the alarm ends the process
    }
    std::string err;
    specee_rpc_serve(p, err);
    fprintf(stderr, "error: specee-rpc-server: %s\n", err.c_str());
    return 1;
}
