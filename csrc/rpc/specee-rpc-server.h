// specee-rpc-server.h: this machine's CPU as a ggml RPC device, served by this project's own implementation of ggml's
// RPC protocol (specee-rpc-proto.h): wire-compatible with upstream's client when no token is set, a thread per
// connection, receive timeouts, a memory budget, every message checked before ggml sees it (specee-rpc-graph.h), an
// optional shared secret checked before any command. A message that breaks a rule closes its connection with one
// log line; the server and its other connections live on.
#pragma once

#include <cstdint>
#include <string>

struct specee_rpc_server_params {
    std::string host            = "127.0.0.1"; // IPv4; other than loopback only with a token
    int         port            = 50052;
    int         n_threads       = 1;           // CPU threads for the graphs it computes
    std::string cache_dir;                     // received weights kept here by hash (SET_TENSOR_HASH); "": none
    uint64_t    cache_max       = 10ull << 30; // bytes the cache directory may hold (files written by any process)
    std::string token;                         // the shared secret clients must send first; "": none
    uint64_t    max_memory      = 0;           // bytes of buffers and messages held for all clients; 0: all RAM
    int         max_clients     = 64;          // connections served at once; more are closed at once
    int         max_buffers     = 4096;        // buffers one connection may hold at once
    uint32_t    max_graph_nodes = 1u << 16;    // nodes of one graph
    uint64_t    max_graph_cost  = 1ull << 46;  // multiply-adds of one graph (specee_rpc_node_cost)
    int         recv_timeout_ms = 10000;       // the longest wait for the rest of a message, and for the handshake
    int         idle_timeout_ms = 600000;      // the longest wait for a client's next command; 0: no limit
    int         wrong_token_delay_ms = 500;    // a wrong token is answered after this long, one at a time
};

// what one buffer of `size` bytes counts in the budget: its bytes rounded up to the allocator's 64, and a fixed
// overhead for the allocator's header, ggml's buffer object and the connection's table entry (a 1-byte buffer really
// costs about 300 bytes of heap)
constexpr uint64_t SPECEE_RPC_BUFFER_OVERHEAD = 1024;
inline uint64_t specee_rpc_buffer_cost(uint64_t size) {
    return ((size + 63) & ~(uint64_t) 63) + SPECEE_RPC_BUFFER_OVERHEAD;
}

// true when `host` is an IPv4 loopback address (127.0.0.0/8) or "localhost"
bool specee_rpc_host_is_loopback(const std::string & host);

// serves until the process ends; returns (with a message in `err`) only when it cannot start
void specee_rpc_serve(const specee_rpc_server_params & p, std::string & err);
