// specee-rpc-graph.h: what specee-rpc-server believes of a client's message before ggml sees it: tensors (type,
// shape, strides, the buffer they lie in and their bounds inside it) and whole graphs (node ids, sources, cycles and
// depth, and each node's op with the inputs and shapes it needs). Every check is overflow-safe; a failure is a
// sentence for the server's log, never an abort.
#pragma once

#include "specee-rpc-proto.h"

#include "ggml-backend.h"

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

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

// what a graph may cost: nodes, repeated nodes (none), and the work of one node and of the whole graph, in
// multiply-adds as specee_rpc_node_cost counts them
struct specee_rpc_graph_limits {
    uint32_t max_nodes     = 1u << 16;
    uint64_t max_cost      = 1ull << 46; // the whole graph
    uint64_t max_node_cost = 1ull << 38; // one node: the longest another connection waits for its turn
    uint64_t slice_cost    = 1ull << 24; // nodes are run in slices of about this much work, one slice per turn
};

// a GET_ROWS / SET_ROWS node's index tensor and the rows its values must stay below; checked before every compute
struct specee_rpc_index_check {
    const ggml_tensor * idx    = nullptr;
    int64_t             n_rows = 0;
};

// a checked graph, ready to run: its tensors and its nodes cut into slices (each a ggml graph), the memory they live
// in (counted in the server's budget by the caller), and the index tensors to check before each run
struct specee_rpc_graph {
    std::vector<uint8_t>                tensor_mem, slice_mem;
    ggml_context *                      tensor_ctx = nullptr;
    ggml_context *                      slice_ctx  = nullptr;
    std::vector<ggml_cgraph *>          slices;
    std::vector<specee_rpc_index_check> indices;
    uint64_t                            cost = 0;

    specee_rpc_graph() = default;
    specee_rpc_graph(const specee_rpc_graph &) = delete;
    specee_rpc_graph & operator=(const specee_rpc_graph &) = delete;
    ~specee_rpc_graph();
    size_t mem_size() const { return tensor_mem.size() + slice_mem.size(); }
};

// builds the graph of a GRAPH_COMPUTE payload after checking all of it: | device (u32) | n_nodes (u32) | node ids (u64
// each) | n_tensors (u32) | tensors |. Node ids must name tensors of the message, each at most once, and there may be
// at most limits.max_nodes; every tensor lies in one of `buffers`; sources are linked by id without recursion; cycles
// and chains deeper than SPECEE_RPC_MAX_DEPTH are refused; each node's op must be one this server runs (the ops of
// the Llama family, see the table in the .cpp) with the sources, types (those ggml's CPU backend has kernels for, read
// from its type traits), shapes and row strides it needs, and `dev` must support it; its cost within the limits.
// `tensor_mem_budget` says whether the tensors' memory (specee_rpc_graph_mem_size) may be taken; the slices' memory is
// known after the check (the caller counts it). nullptr and `why` on failure.
std::unique_ptr<specee_rpc_graph> specee_rpc_graph_build(const uint8_t * payload, size_t size,
                                                         const specee_rpc_buffers & buffers, ggml_backend_dev_t dev,
                                                         const specee_rpc_graph_limits & limits, std::string & why);

// the memory specee_rpc_graph_build takes for the tensors of a payload of `size` bytes (0 when the header is short)
size_t specee_rpc_graph_mem_size(const uint8_t * payload, size_t size);

// the row indices of every GET_ROWS / SET_ROWS of `g` inside their rows, read now (before each compute and recompute:
// SET_TENSOR, COPY_TENSOR or a node run after the reader may have changed them since)
bool specee_rpc_graph_indices_ok(const specee_rpc_graph & g, std::string & why);

// the work of one node, in multiply-adds (MUL_MAT: one per element of the output per element of a row of its first
// source; FLASH_ATTN_EXT: per query row, K's and V's row lengths per key; other ops: the elements they read and write)
uint64_t specee_rpc_node_cost(const ggml_tensor * t);

constexpr uint32_t SPECEE_RPC_MAX_DEPTH = 1u << 16; // the longest chain of sources a graph may have
