// specee-rpc-proto.h: the wire format of ggml's RPC protocol (version 5.0.x, as the pinned libggml-python 0.20.2
// speaks it), plus this project's one addition, the AUTH message. Written here from the protocol's description: a
// request is | command (1 byte) | payload size (u64, little-endian) | payload |, a reply | size (u64) | payload |;
// SET_TENSOR, GRAPH_COMPUTE and GRAPH_RECOMPUTE have no reply. Every struct is packed, as on the wire.
#pragma once

#include "ggml.h"

#include <cstddef>
#include <cstdint>

constexpr uint8_t SPECEE_RPC_PROTO_MAJOR = 5;
constexpr uint8_t SPECEE_RPC_PROTO_MINOR = 0;
constexpr uint8_t SPECEE_RPC_PROTO_PATCH = 0;
constexpr size_t  SPECEE_RPC_CAPS_SIZE   = 24; // transport capabilities exchanged in HELLO (RDMA); always zero here

enum specee_rpc_cmd : uint8_t {
    SPECEE_RPC_ALLOC_BUFFER      = 0,
    SPECEE_RPC_GET_ALIGNMENT     = 1,
    SPECEE_RPC_GET_MAX_SIZE      = 2,
    SPECEE_RPC_BUFFER_GET_BASE   = 3,
    SPECEE_RPC_FREE_BUFFER       = 4,
    SPECEE_RPC_BUFFER_CLEAR      = 5,
    SPECEE_RPC_SET_TENSOR        = 6,
    SPECEE_RPC_SET_TENSOR_HASH   = 7,
    SPECEE_RPC_GET_TENSOR        = 8,
    SPECEE_RPC_COPY_TENSOR       = 9,
    SPECEE_RPC_GRAPH_COMPUTE     = 10,
    SPECEE_RPC_GET_DEVICE_MEMORY = 11,
    SPECEE_RPC_INIT_TENSOR       = 12,
    SPECEE_RPC_GET_ALLOC_SIZE    = 13,
    SPECEE_RPC_HELLO             = 14,
    SPECEE_RPC_DEVICE_COUNT      = 15,
    SPECEE_RPC_GRAPH_RECOMPUTE   = 16,
    SPECEE_RPC_MEMSET_TENSOR     = 17,
    SPECEE_RPC_CMD_COUNT         = 18,
    // this project's: | 0xA0 | size | token bytes |, reply | 1 | ok (u8) |; sent before HELLO when the server has a
    // token. Upstream servers close the connection on it (an unknown command), so a client with a token gets a clear
    // "closed" rather than talking to a server that ignores its secret.
    SPECEE_RPC_AUTH = 0xA0,
};

constexpr size_t SPECEE_RPC_MAX_TOKEN = 256;

#pragma pack(push, 1)
// a tensor as the client describes it: ids are the client's own pointers, `buffer` a buffer id this server handed
// out (or 0), `data` an address inside that buffer as BUFFER_GET_BASE told the client
struct specee_rpc_tensor {
    uint64_t id;
    uint32_t type;
    uint64_t buffer;
    uint32_t ne[GGML_MAX_DIMS];
    uint32_t nb[GGML_MAX_DIMS];
    uint32_t op;
    int32_t  op_params[GGML_MAX_OP_PARAMS / sizeof(int32_t)];
    int32_t  flags;
    uint64_t src[GGML_MAX_SRC];
    uint64_t view_src;
    uint64_t view_offs;
    uint64_t data;
    char     name[GGML_MAX_NAME];
    char     padding[4];
};

struct specee_rpc_hello_rsp {
    uint8_t major, minor, patch, padding;
    uint8_t caps[SPECEE_RPC_CAPS_SIZE];
};
struct specee_rpc_alloc_buffer_req {
    uint32_t device;
    uint64_t size;
};
struct specee_rpc_alloc_buffer_rsp {
    uint64_t buffer;
    uint64_t size;
};
struct specee_rpc_buffer_clear_req {
    uint64_t buffer;
    uint8_t  value;
};
struct specee_rpc_memset_tensor_req {
    specee_rpc_tensor tensor;
    uint64_t          offset;
    uint64_t          size;
    uint8_t           value;
};
struct specee_rpc_set_tensor_hash_req {
    specee_rpc_tensor tensor;
    uint64_t          offset;
    uint64_t          hash;
};
struct specee_rpc_get_tensor_req {
    specee_rpc_tensor tensor;
    uint64_t          offset;
    uint64_t          size;
};
struct specee_rpc_copy_tensor_req {
    specee_rpc_tensor src;
    specee_rpc_tensor dst;
};
struct specee_rpc_get_alloc_size_req {
    uint32_t          device;
    specee_rpc_tensor tensor;
    specee_rpc_tensor srcs[GGML_MAX_SRC];
};
struct specee_rpc_device_memory_rsp {
    uint64_t free;
    uint64_t total;
};
#pragma pack(pop)

static_assert(sizeof(specee_rpc_tensor) == 296, "the wire's tensor is 296 bytes");
static_assert(sizeof(specee_rpc_hello_rsp) == 28, "HELLO's reply is 28 bytes");

// SET_TENSOR's payload starts with the tensor and the offset; the data follows
constexpr size_t SPECEE_RPC_SET_TENSOR_HEAD = sizeof(specee_rpc_tensor) + sizeof(uint64_t);
// SET_TENSOR_HASH: data above this size is offered by hash first; the server keeps such data in its cache
constexpr size_t SPECEE_RPC_HASH_THRESHOLD = 10u << 20;

// FNV-1a over a byte range, continued from `h` (start with SPECEE_RPC_FNV_START): the hash SET_TENSOR_HASH names
constexpr uint64_t SPECEE_RPC_FNV_START = 0xcbf29ce484222325ULL;
inline uint64_t specee_rpc_fnv(uint64_t h, const uint8_t * p, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        h = (h ^ p[i]) * 0x100000001b3ULL;
    }
    return h;
}
