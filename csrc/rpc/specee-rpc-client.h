// specee-rpc-client.h: what this process does before it hands an RPC server to ggml's client (which aborts on a
// malformed reply and waits forever on a silent peer): the peer is checked with timeouts, and a token is sent for it.
#pragma once

#include <string>

constexpr int SPECEE_RPC_CLIENT_TIMEOUT_MS = 5000; // to connect, and for each reply of the check

// connects to HOST:PORT with a timeout, sends the token (when not empty), then HELLO, DEVICE_COUNT, GET_ALIGNMENT,
// GET_MAX_SIZE and GET_DEVICE_MEMORY, each reply checked for its size and sense; throws a specee_error naming the
// peer and what was wrong
void specee_rpc_check_peer(const std::string & host, int port, const std::string & token);

// a relay on 127.0.0.1 for ggml's client, which cannot send a token: each connection to the returned "127.0.0.1:PORT"
// is forwarded to HOST:PORT after the token was accepted there. Started once per server; lives as long as the process
std::string specee_rpc_relay(const std::string & host, int port, const std::string & token);
