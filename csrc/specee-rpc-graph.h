// specee-rpc-graph.h: what specee-rpc-server believes of a client's message before ggml sees it: tensors (type,
// shape, strides, the buffer they lie in and their bounds inside it) and whole graphs (node ids, sources, cycles and
// depth, and each node's op with the inputs and shapes it needs). Every check is overflow-safe; a failure is a
// sentence for the server's log, never an abort.
#pragma once

#include "specee-rpc-proto.h"

#include "ggml-backend.h"

#include <cstdint>
#include <map>
#include <string>

// a buffer this server handed to one connection: the client knows it by `id` and addresses it from `vbase` (a made
// up base, so clients never learn this process's addresses); `base` is where it really is
struct specee_rpc_buffer {
    ggml_backend_buffer_t buf   = nullptr;
    uint8_t *             base  = nullptr;
    uint64_t              vbase = 0;
    uint64_t              size  = 0;
};
using specee_rpc_buffers = std::map<uint64_t, specee_rpc_buffer>;

// a checked tensor: where its bytes really are and how many bytes its shape and strides reach (its extent)
struct specee_rpc_region {
    const specee_rpc_buffer * buffer = nullptr;
    uint8_t *                 data   = nullptr;
    uint64_t                  extent = 0;
};

// checks a tensor's type, shape and strides, and, when it names a buffer (required when `need_buffer`), that the
// buffer is one of `buffers` and the tensor's whole extent lies inside it; on failure sets `why` and returns false
bool specee_rpc_check_tensor(const specee_rpc_buffers & buffers, const specee_rpc_tensor & t, bool need_buffer,
                             specee_rpc_region & out, std::string & why);

// [offset, offset + size) inside a checked tensor's extent (overflow-safe)
bool specee_rpc_range_ok(const specee_rpc_region & r, uint64_t offset, uint64_t size);

// builds the graph of a GRAPH_COMPUTE payload in `ctx` (sized by specee_rpc_graph_mem_size) after checking all of it:
// | device (u32) | n_nodes (u32) | node ids (u64 each) | n_tensors (u32) | tensors |. Node ids must name tensors of
// the message; every tensor lies in one of `buffers`; sources are linked by id without recursion; cycles and chains
// deeper than max_depth are refused; each node's op must be one this server runs (the ops of the Llama family, see
// the table in the .cpp) with the sources, types and shapes it needs, and `dev` must support it.
ggml_cgraph * specee_rpc_graph_build(ggml_context * ctx, const uint8_t * payload, size_t size,
                                     const specee_rpc_buffers & buffers, ggml_backend_dev_t dev, std::string & why);

// the context memory specee_rpc_graph_build needs for a payload of `size` bytes (0 when the header is short)
size_t specee_rpc_graph_mem_size(const uint8_t * payload, size_t size);

constexpr uint32_t SPECEE_RPC_MAX_DEPTH = 1u << 16; // the longest chain of sources a graph may have
