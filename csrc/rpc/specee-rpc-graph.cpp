// specee-rpc-graph.cpp: checks of the tensors and graphs a client of specee-rpc-server sends, before any ggml call
// (see specee-rpc-graph.h). ggml's CPU kernels assume what ggml's op constructors guarantee (matching shapes, row
// strides equal to the element size, index values inside the rows they pick) and abort when it does not hold; a
// graph built by a client is not made by those constructors, so each op the server runs has its constructor's rules
// written out here, and ops outside the table are refused.
#include "specee-rpc-graph.h"

#include "ggml-cpu.h"
#include "ggml.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <map>
#include <unordered_map>
#include <vector>

using u128 = unsigned __int128;

// ---- tensors

static bool fail(std::string & why, const std::string & what) {
    why = what;
    return false;
}

bool specee_rpc_check_tensor(const specee_rpc_buffers & buffers, const specee_rpc_tensor & t, bool need_buffer,
                             specee_rpc_region & out, std::string & why) {
    out = {};
    if (t.type >= GGML_TYPE_COUNT || ggml_blck_size((ggml_type) t.type) <= 0 || ggml_type_size((ggml_type) t.type) == 0) {
        return fail(why, "tensor type " + std::to_string(t.type) + " is not a ggml type");
    }
    const uint64_t blck = (uint64_t) ggml_blck_size((ggml_type) t.type);
    const uint64_t ts   = ggml_type_size((ggml_type) t.type);
    if (t.ne[0] % blck != 0) {
        return fail(why, "tensor row of " + std::to_string(t.ne[0]) + " elements is not whole blocks");
    }
    if (blck > 1 && t.nb[0] != ts) {
        return fail(why, "quantized tensor with a block stride other than the block size");
    }
    // the bytes its shape and strides reach, as ggml_nbytes counts them, and at least its packed size (so a kernel
    // that assumes the tensor contiguous stays inside it too)
    u128 extent = 0, packed = 0;
    if (t.ne[0] && t.ne[1] && t.ne[2] && t.ne[3]) {
        extent = blck == 1 ? (u128) (t.ne[0] - 1) * t.nb[0] + ts : (u128) (t.ne[0] / blck) * ts;
        packed = (u128) (t.ne[0] / blck) * ts;
        for (int i = 1; i < GGML_MAX_DIMS; ++i) {
            extent += (u128) (t.ne[i] - 1) * t.nb[i];
            packed *= t.ne[i];
        }
    }
    if (extent < packed) {
        return fail(why, "tensor strides overlap its elements");
    }
    if (t.buffer == 0) {
        if (need_buffer || t.data != 0) {
            return fail(why, "tensor without a buffer");
        }
        out.extent = (uint64_t) extent; // < 2^100 is not a concern: packed <= extent, both checked below when used
        return extent <= UINT64_MAX || fail(why, "tensor size overflows");
    }
    const uint64_t buffer_id = t.buffer; // a copy: the wire struct is packed, its fields may be misaligned
    const auto     it        = buffers.find(buffer_id);
    if (it == buffers.end()) {
        return fail(why, "buffer id " + std::to_string(t.buffer) + " was not handed out on this connection");
    }
    const specee_rpc_buffer & b = it->second;
    if (t.data < b.vbase || (u128) (t.data - b.vbase) + extent > b.size) {
        return fail(why, "tensor data lies outside its buffer");
    }
    out.buffer = &b;
    out.data   = b.base + (t.data - b.vbase);
    out.extent = (uint64_t) extent;
    return true;
}

bool specee_rpc_range_ok(const specee_rpc_region & r, uint64_t offset, uint64_t size) {
    return offset <= r.extent && size <= r.extent - offset;
}

// ---- the ops this server runs, each with its constructor's rules

static bool rows_dense(const ggml_tensor * t) {
    return (size_t) t->nb[0] == ggml_type_size(t->type);
}

// ggml_is_contiguous ignores the strides of dimensions of size 1, but kernels that index rows by one flat counter
// (row i at i * nb[1]) use them; "flat": dense rows, and dimensions 2 and 3 packed behind dimension 1
static bool flat(const ggml_tensor * t) {
    return rows_dense(t) && (size_t) t->nb[1] >= ggml_row_size(t->type, t->ne[0]) && t->nb[2] == t->nb[1] * t->ne[1] &&
           t->nb[3] == t->nb[2] * t->ne[2];
}

// every stride exactly what ggml's constructors give a new tensor
static bool dense(const ggml_tensor * t) {
    return flat(t) && (size_t) t->nb[1] == ggml_row_size(t->type, t->ne[0]);
}

static bool is_float(const ggml_tensor * t) {
    return t->type == GGML_TYPE_F32 || t->type == GGML_TYPE_F16 || t->type == GGML_TYPE_BF16;
}

// what ggml's CPU backend has kernels for, read from its type traits (not a list of types that drifts from them):
// a matrix product of `type` needs a dot product and a conversion of the other side to the dot product's type
static bool cpu_dots(ggml_type type) {
    const ggml_type_traits_cpu * tr = ggml_get_type_traits_cpu(type);
    return tr->vec_dot != nullptr && ggml_get_type_traits_cpu(tr->vec_dot_type)->from_float != nullptr;
}

// a row of F32 values written as `type` (SET_ROWS' destination)
static bool cpu_writes(ggml_type type) {
    return ggml_get_type_traits_cpu(type)->from_float != nullptr;
}

// a row of `type` read as F32 values (GET_ROWS' source, FLASH_ATTN_EXT's V)
static bool reads_as_f32(ggml_type type) {
    return type == GGML_TYPE_F32 || ggml_get_type_traits(type)->to_float != nullptr;
}

// the rows of a tensor indexed by row (GET_ROWS' source, SET_ROWS' destination) neither overlap nor repeat: each
// dimension of more than one element steps past everything the dimensions below it reach (a zero or short stride
// would make rows share bytes, and kernels read a whole row from each start)
static bool rows_apart(const ggml_tensor * t) {
    if (!rows_dense(t)) {
        return false;
    }
    u128 reach = ggml_row_size(t->type, t->ne[0]);
    for (int d = 1; d < GGML_MAX_DIMS; ++d) {
        if (t->ne[d] > 1 && (u128) t->nb[d] < reach) {
            return false;
        }
        reach += (u128) (t->ne[d] - 1) * t->nb[d];
    }
    return true;
}

static bool strides_grow(const ggml_tensor * t) {
    return t->nb[0] <= t->nb[1] && t->nb[1] <= t->nb[2] && t->nb[2] <= t->nb[3];
}

static float op_param_f32(const ggml_tensor * t, int i) {
    float f;
    memcpy(&f, (const char *) t->op_params + 4 * i, sizeof(f));
    return f;
}

static bool check_mul_mat(const ggml_tensor * t, const ggml_tensor * a, const ggml_tensor * b) {
    // the second source is F32 (converted to the dot product's type) or already of that type, and not quantized
    const ggml_type dot_type = ggml_get_type_traits_cpu(a->type)->vec_dot_type;
    const bool      b_ok     = b->type == GGML_TYPE_F32 || (b->type == dot_type && !ggml_is_quantized(b->type));
    return cpu_dots(a->type) && b_ok && a->ne[0] == b->ne[0] && b->ne[2] % a->ne[2] == 0 &&
           b->ne[3] % a->ne[3] == 0 && t->ne[0] == a->ne[1] &&
           t->ne[1] == b->ne[1] && t->ne[2] == b->ne[2] && t->ne[3] == b->ne[3] && t->type == GGML_TYPE_F32 &&
           rows_dense(a) && rows_dense(b) && rows_dense(t) && strides_grow(t);
}

static bool check_rope(const ggml_tensor * t, const ggml_tensor * a, const ggml_tensor * pos, const ggml_tensor * freq) {
    const int32_t n_dims = t->op_params[1], mode = t->op_params[2];
    bool          ok     = pos && pos->type == GGML_TYPE_I32 && dense(pos) && pos->ne[0] >= a->ne[2];
    ok = ok && (mode == 0 || mode == GGML_ROPE_TYPE_NEOX) && n_dims > 0 && n_dims % 2 == 0 && n_dims <= a->ne[0];
    ok = ok && (a->type == GGML_TYPE_F32 || a->type == GGML_TYPE_F16) && t->type == a->type;
    ok = ok && ggml_are_same_shape(a, t) && rows_dense(a) && rows_dense(t);
    return ok && (!freq || (freq->type == GGML_TYPE_F32 && dense(freq) && freq->ne[0] >= n_dims / 2));
}

static bool check_flash_attn(const ggml_tensor * t, const ggml_tensor * const * s) {
    const ggml_tensor *q = s[0], *k = s[1], *v = s[2], *mask = s[3], *sinks = s[4];
    if (!k || !v) {
        return false;
    }
    // K by the CPU's dot product of its type (Q converted to the dot product's type), V read as F32 (F32 itself, or
    // by its type's conversion)
    bool ok = q->type == GGML_TYPE_F32 && t->type == GGML_TYPE_F32 && rows_dense(q) && rows_dense(k) && rows_dense(v);
    ok = ok && cpu_dots(k->type) && reads_as_f32(v->type);
    // the precision the kernel switches on (ggml_flash_attn_ext_set_prec; another value aborts)
    ok = ok && (t->op_params[3] == GGML_PREC_DEFAULT || t->op_params[3] == GGML_PREC_F32);
    ok = ok && q->ne[0] == k->ne[0] && k->ne[1] == v->ne[1] && k->ne[2] == v->ne[2] && k->ne[3] == v->ne[3];
    ok = ok && q->ne[2] % k->ne[2] == 0 && q->ne[3] % k->ne[3] == 0;
    ok = ok && t->ne[0] == v->ne[0] && t->ne[1] == q->ne[2] && t->ne[2] == q->ne[1] && t->ne[3] == q->ne[3];
    ok = ok && dense(t); // the kernel writes its rows by index, not by stride
    if (mask) {
        ok = ok && dense(mask) && (mask->type == GGML_TYPE_F16 || mask->type == GGML_TYPE_F32) &&
             mask->ne[0] >= k->ne[1] && mask->ne[1] >= q->ne[1] && q->ne[2] % mask->ne[2] == 0 &&
             q->ne[3] % mask->ne[3] == 0;
    }
    return ok && (!sinks || (sinks->type == GGML_TYPE_F32 && dense(sinks) && sinks->ne[0] >= q->ne[2]));
}

static bool check_concat(const ggml_tensor * t, const ggml_tensor * a, const ggml_tensor * b) {
    const int32_t dim = t->op_params[0];
    if (dim < 0 || dim >= GGML_MAX_DIMS || a->type != b->type || a->type != t->type || !is_float(a)) {
        return false;
    }
    for (int i = 0; i < GGML_MAX_DIMS; ++i) {
        const int64_t want = i == dim ? a->ne[i] + b->ne[i] : a->ne[i];
        if (t->ne[i] != want || (i != dim && b->ne[i] != a->ne[i])) {
            return false;
        }
    }
    return true;
}

static bool check_glu(const ggml_tensor * t, const ggml_tensor * a, const ggml_tensor * b) {
    const int32_t op = t->op_params[0];
    bool ok = op >= 0 && op < GGML_GLU_OP_COUNT && a->type == GGML_TYPE_F32 && t->type == GGML_TYPE_F32 &&
              flat(a) && flat(t) && ggml_nrows(a) == ggml_nrows(t);
    if (b) {
        return ok && b->type == a->type && flat(b) && ggml_are_same_shape(a, b) &&
               ggml_are_same_shape(a, t);
    }
    return ok && a->ne[0] == 2 * t->ne[0] && a->ne[1] == t->ne[1] && a->ne[2] == t->ne[2] && a->ne[3] == t->ne[3];
}

static bool check_soft_max(const ggml_tensor * t, const ggml_tensor * a, const ggml_tensor * mask,
                           const ggml_tensor * sinks) {
    bool ok = a->type == GGML_TYPE_F32 && t->type == GGML_TYPE_F32 && dense(a) &&
              dense(t) && ggml_are_same_shape(a, t);
    if (mask) {
        ok = ok && (mask->type == GGML_TYPE_F16 || mask->type == GGML_TYPE_F32) && dense(mask) &&
             mask->ne[0] == a->ne[0] && mask->ne[1] >= a->ne[1] && a->ne[2] % mask->ne[2] == 0 &&
             a->ne[3] % mask->ne[3] == 0;
    }
    return ok && (!sinks || (sinks->type == GGML_TYPE_F32 && dense(sinks) && sinks->ne[0] >= a->ne[2]));
}

// the op of node t is one this server runs, with the sources, types and shapes its kernel relies on (index values
// are checked separately, once every tensor is known)
static bool check_op(const ggml_tensor * t) {
    const ggml_tensor * const * s = t->src;
    const ggml_tensor *         a = s[0], *b = s[1];
    switch (t->op) {
        case GGML_OP_NONE:
        case GGML_OP_VIEW:
        case GGML_OP_RESHAPE:
        case GGML_OP_PERMUTE:
        case GGML_OP_TRANSPOSE:
            return true; // nothing computed: the data was placed by the client
        default:
            break;
    }
    if (!a || ggml_is_empty(t)) {
        return false;
    }
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        if (s[i] && ggml_is_empty(s[i])) {
            return false; // broadcasting divides by the sources' sizes
        }
    }
    switch (t->op) {
        case GGML_OP_ADD:
        case GGML_OP_MUL:
            return b && a->type == GGML_TYPE_F32 && b->type == GGML_TYPE_F32 && t->type == GGML_TYPE_F32 &&
                   ggml_can_repeat(b, a) && ggml_are_same_shape(a, t) && rows_dense(a) && rows_dense(b) &&
                   rows_dense(t);
        case GGML_OP_RMS_NORM:
            return a->type == GGML_TYPE_F32 && t->type == GGML_TYPE_F32 && ggml_are_same_shape(a, t) &&
                   rows_dense(a) && rows_dense(t) && op_param_f32(t, 0) >= 0.0f;
        case GGML_OP_SCALE:
            return a->type == GGML_TYPE_F32 && t->type == GGML_TYPE_F32 && ggml_are_same_shape(a, t) &&
                   dense(a) && dense(t);
        case GGML_OP_UNARY:
            return t->op_params[0] >= 0 && t->op_params[0] < GGML_UNARY_OP_COUNT && a->type == GGML_TYPE_F32 &&
                   t->type == GGML_TYPE_F32 && ggml_are_same_shape(a, t) && flat(a) &&
                   flat(t);
        case GGML_OP_MUL_MAT:
            return b && check_mul_mat(t, a, b);
        case GGML_OP_ROPE:
            return check_rope(t, a, b, s[2]);
        case GGML_OP_FLASH_ATTN_EXT:
            return check_flash_attn(t, s);
        case GGML_OP_SOFT_MAX:
            return check_soft_max(t, a, b, s[2]);
        case GGML_OP_CONCAT:
            return b && check_concat(t, a, b);
        case GGML_OP_GLU:
            return check_glu(t, a, b);
        case GGML_OP_CPY:
        case GGML_OP_CONT:
            return is_float(a) && is_float(t) && ggml_nelements(a) == ggml_nelements(t) && (t->op == GGML_OP_CONT || b);
        case GGML_OP_GET_ROWS:
            // rows read whole from each start (the row stride is not used inside a row): the source's rows dense and
            // apart, its type one the CPU converts to F32
            return b && b->type == GGML_TYPE_I32 && reads_as_f32(a->type) &&
                   rows_apart(a) && a->ne[2] == b->ne[1] && a->ne[3] == b->ne[2] && b->ne[3] == 1 &&
                   t->ne[0] == a->ne[0] && t->ne[1] == b->ne[0] && t->ne[2] == b->ne[1] && t->ne[3] == b->ne[2] &&
                   t->type == GGML_TYPE_F32 && rows_apart(t);
        case GGML_OP_SET_ROWS:
            // F32 rows read whole, written by the destination type's conversion from F32
            return b && (b->type == GGML_TYPE_I64 || b->type == GGML_TYPE_I32) && a->type == GGML_TYPE_F32 &&
                   rows_dense(a) && cpu_writes(t->type) &&
                   t->ne[0] == a->ne[0] && t->ne[2] == a->ne[2] && t->ne[3] == a->ne[3] && a->ne[1] == b->ne[0] &&
                   a->ne[2] % b->ne[1] == 0 && a->ne[3] % b->ne[2] == 0 && b->ne[3] == 1 && rows_apart(t);
        default:
            return false;
    }
}

// ---- index values: GET_ROWS and SET_ROWS pick rows by the values of an index tensor, and the kernel aborts on one
// outside the rows; such a tensor must be one the client filled (op NONE), neither an earlier node nor the node itself
// may write over it (nodes run in order; a later node may reuse the memory, as ggml's allocator does), and its values
// are checked before every compute and recompute (specee_rpc_graph_indices_ok)

static bool index_values_ok(const ggml_tensor * idx, int64_t n_rows) {
    for (int64_t i3 = 0; i3 < idx->ne[3]; ++i3) {
        for (int64_t i2 = 0; i2 < idx->ne[2]; ++i2) {
            for (int64_t i1 = 0; i1 < idx->ne[1]; ++i1) {
                for (int64_t i0 = 0; i0 < idx->ne[0]; ++i0) {
                    const char * p = (const char *) idx->data + i0 * idx->nb[0] + i1 * idx->nb[1] + i2 * idx->nb[2] +
                                     i3 * idx->nb[3];
                    int64_t v;
                    if (idx->type == GGML_TYPE_I64) {
                        memcpy(&v, p, sizeof(v));
                    } else {
                        int32_t v32;
                        memcpy(&v32, p, sizeof(v32));
                        v = v32;
                    }
                    if (v < 0 || v >= n_rows) {
                        return false;
                    }
                }
            }
        }
    }
    return true;
}

bool specee_rpc_graph_indices_ok(const specee_rpc_graph & g, std::string & why) {
    for (const specee_rpc_index_check & c : g.indices) {
        if (!index_values_ok(c.idx, c.n_rows)) {
            return fail(why, "GET_ROWS or SET_ROWS with a row index outside the rows (index tensor '" +
                                 std::string(c.idx->name) + "')");
        }
    }
    return true;
}

static bool computes(const ggml_tensor * t) {
    return t->op != GGML_OP_NONE && t->op != GGML_OP_VIEW && t->op != GGML_OP_RESHAPE && t->op != GGML_OP_PERMUTE &&
           t->op != GGML_OP_TRANSPOSE;
}

// every GET_ROWS / SET_ROWS: indices the client filled, inside the rows, and no node computed before it (nodes run
// in order; later ones may reuse the memory, as ggml's allocator does) writes over them
// a computing node and its sources must lie in buffers; tensors in none may only be view sources (never read)
static bool has_data(const ggml_tensor * t) {
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        if (t->src[i] && !t->src[i]->data) {
            return false;
        }
    }
    return t->data != nullptr;
}

// the bytes written by the nodes computed so far, as disjoint [start, end) ranges (merged as they are added), so
// that each check is a lookup, not a walk over the earlier nodes
struct written_ranges {
    std::map<const uint8_t *, const uint8_t *> by_start;

    void add(const uint8_t * a, const uint8_t * b) {
        if (a == b) {
            return;
        }
        auto it = by_start.upper_bound(a);
        if (it != by_start.begin() && std::prev(it)->second >= a) {
            --it;
        }
        while (it != by_start.end() && it->first <= b) { // merge every range that touches [a, b)
            a  = std::min(a, it->first);
            b  = std::max(b, it->second);
            it = by_start.erase(it);
        }
        by_start[a] = b;
    }
    bool overlaps(const uint8_t * a, const uint8_t * b) const {
        auto it = by_start.lower_bound(b); // the first range starting at or after b cannot overlap
        return a != b && it != by_start.begin() && std::prev(it)->second > a;
    }
};

constexpr int64_t MAX_INDEX_VALUES = 1 << 26; // row indices checked per graph, at most

static bool check_indices(const std::vector<ggml_tensor *> & nodes, const std::vector<specee_rpc_region> & regions,
                          const std::unordered_map<const ggml_tensor *, size_t> & index_of,
                          std::vector<specee_rpc_index_check> & out, std::string & why) {
    written_ranges                         written;
    std::map<const ggml_tensor *, size_t>  listed; // index tensor -> its entry in `out`
    int64_t                                n_values = 0;
    for (const ggml_tensor * t : nodes) {
        if (t->op == GGML_OP_GET_ROWS || t->op == GGML_OP_SET_ROWS) {
            const ggml_tensor * idx    = t->src[1];
            const int64_t       n_rows = t->op == GGML_OP_GET_ROWS ? t->src[0]->ne[1] : t->ne[1];
            if (idx->op != GGML_OP_NONE) {
                return fail(why, std::string(ggml_op_name(t->op)) + " with computed row indices");
            }
            const specee_rpc_region & r = regions[index_of.at(idx)];
            if (written.overlaps(r.data, r.data + r.extent)) {
                return fail(why, "a node writes over the row indices of a later node");
            }
            const specee_rpc_region & w = regions[index_of.at(t)];
            if (r.data < w.data + w.extent && w.data < r.data + r.extent) {
                return fail(why, std::string(ggml_op_name(t->op)) + " whose output overlaps its own row indices");
            }
            auto seen = listed.find(idx);
            if (seen == listed.end()) {
                n_values += ggml_nelements(idx);
                if (n_values > MAX_INDEX_VALUES) {
                    return fail(why, "more row indices than this server checks in one graph");
                }
                listed[idx] = out.size();
                out.push_back({ idx, n_rows });
            } else {
                out[seen->second].n_rows = std::min(out[seen->second].n_rows, n_rows);
            }
        }
        if (computes(t)) {
            const specee_rpc_region & w = regions[index_of.at(t)];
            written.add(w.data, w.data + w.extent);
        }
    }
    return true;
}

// ---- graphs

struct graph_header {
    uint32_t         device    = 0;
    uint32_t         n_nodes   = 0;
    uint32_t         n_tensors = 0;
    const uint8_t *  nodes     = nullptr; // n_nodes u64 ids
    const uint8_t *  tensors   = nullptr; // n_tensors specee_rpc_tensor
};

// the header of a GRAPH_COMPUTE payload, its sizes checked against the payload's (exactly, no trailing bytes)
static bool parse_header(const uint8_t * p, size_t size, graph_header & h) {
    if (size < 2 * sizeof(uint32_t)) {
        return false;
    }
    memcpy(&h.device, p, 4);
    memcpy(&h.n_nodes, p + 4, 4);
    const u128 after_nodes = 8 + (u128) h.n_nodes * 8;
    if (after_nodes + 4 > size) {
        return false;
    }
    h.nodes = p + 8;
    memcpy(&h.n_tensors, p + (size_t) after_nodes, 4);
    h.tensors = p + (size_t) after_nodes + 4;
    return after_nodes + 4 + (u128) h.n_tensors * sizeof(specee_rpc_tensor) == size;
}

size_t specee_rpc_graph_mem_size(const uint8_t * payload, size_t size) {
    graph_header h;
    if (!parse_header(payload, size, h)) {
        return 0;
    }
    return ggml_tensor_overhead() * ((size_t) h.n_tensors + 1) + 1024;
}

// every tensor of the message made a ggml tensor, its region checked; ids unique and non-zero
static bool make_tensors(ggml_context * ctx, const graph_header & h, const specee_rpc_buffers & buffers,
                         std::vector<ggml_tensor *> & out, std::vector<specee_rpc_region> & regions,
                         std::unordered_map<uint64_t, size_t> & by_id, std::string & why) {
    out.resize(h.n_tensors);
    regions.resize(h.n_tensors);
    for (uint32_t i = 0; i < h.n_tensors; ++i) {
        specee_rpc_tensor rt;
        memcpy(&rt, h.tensors + (size_t) i * sizeof(rt), sizeof(rt));
        const uint64_t id = rt.id; // a copy: the wire struct is packed
        if (id == 0 || !by_id.emplace(id, i).second) {
            return fail(why, "tensor id " + std::to_string(id) + " is zero or repeated");
        }
        if (rt.op >= GGML_OP_COUNT) {
            return fail(why, "unknown op " + std::to_string(rt.op));
        }
        if (!specee_rpc_check_tensor(buffers, rt, false, regions[i], why)) {
            char name[GGML_MAX_NAME + 1] = {};
            memcpy(name, rt.name, GGML_MAX_NAME);
            return fail(why, why + " (tensor '" + name + "', op " + std::to_string(rt.op) + ")");
        }
        ggml_tensor * t = ggml_new_tensor_4d(ctx, (ggml_type) rt.type, rt.ne[0], rt.ne[1], rt.ne[2], rt.ne[3]);
        for (int d = 0; d < GGML_MAX_DIMS; ++d) {
            t->nb[d] = rt.nb[d];
        }
        t->op = (ggml_op) rt.op;
        memcpy(t->op_params, rt.op_params, sizeof(rt.op_params));
        t->flags     = rt.flags;
        t->buffer    = regions[i].buffer ? regions[i].buffer->buf : nullptr;
        t->data      = regions[i].data;
        t->view_offs = (size_t) rt.view_offs;
        char name[GGML_MAX_NAME];
        memcpy(name, rt.name, sizeof(name));
        name[GGML_MAX_NAME - 1] = '\0';
        ggml_set_name(t, name);
        out[i] = t;
    }
    return true;
}

// sources and view sources linked by id (no recursion), then every chain walked with an explicit stack: a cycle or a
// chain deeper than SPECEE_RPC_MAX_DEPTH is refused
static bool link_tensors(const graph_header & h, const std::vector<ggml_tensor *> & ts,
                         const std::unordered_map<uint64_t, size_t> & by_id, std::string & why) {
    std::vector<std::vector<size_t>> deps(ts.size());
    for (uint32_t i = 0; i < h.n_tensors; ++i) {
        specee_rpc_tensor rt;
        memcpy(&rt, h.tensors + (size_t) i * sizeof(rt), sizeof(rt));
        for (int s = 0; s <= GGML_MAX_SRC; ++s) {
            const uint64_t id = s < GGML_MAX_SRC ? rt.src[s] : rt.view_src;
            if (id == 0) {
                continue;
            }
            const auto it = by_id.find(id);
            if (it == by_id.end()) {
                return fail(why, "a source id names no tensor of the graph");
            }
            (s < GGML_MAX_SRC ? ts[i]->src[s] : ts[i]->view_src) = ts[it->second];
            deps[i].push_back(it->second);
        }
    }
    std::vector<uint32_t> depth(ts.size(), 0); // 0: not seen; UINT32_MAX: on the stack
    std::vector<std::pair<size_t, size_t>> stack; // (tensor, next dependency to visit)
    for (size_t root = 0; root < ts.size(); ++root) {
        if (depth[root] != 0) {
            continue;
        }
        stack.push_back({root, 0});
        depth[root] = UINT32_MAX;
        while (!stack.empty()) {
            auto & [i, next] = stack.back();
            if (next < deps[i].size()) {
                const size_t d = deps[i][next++];
                if (depth[d] == UINT32_MAX) {
                    return fail(why, "the graph's sources form a cycle");
                }
                if (depth[d] == 0) {
                    depth[d] = UINT32_MAX;
                    stack.push_back({d, 0});
                }
                continue;
            }
            uint32_t deepest = 0;
            for (size_t d : deps[i]) {
                deepest = std::max(deepest, depth[d]);
            }
            if (deepest + 1 > SPECEE_RPC_MAX_DEPTH) {
                return fail(why, "the graph's chain of sources is deeper than " + std::to_string(SPECEE_RPC_MAX_DEPTH));
            }
            depth[i] = deepest + 1;
            stack.pop_back();
        }
    }
    return true;
}

// ---- cost, and the graph cut into slices

static uint64_t sat_mul(uint64_t a, uint64_t b) {
    const u128 p = (u128) a * b;
    return p > UINT64_MAX ? UINT64_MAX : (uint64_t) p;
}

static uint64_t sat_add(uint64_t a, uint64_t b) {
    return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

uint64_t specee_rpc_node_cost(const ggml_tensor * t) {
    if (!computes(t)) {
        return 0;
    }
    if (t->op == GGML_OP_MUL_MAT) {
        return sat_mul((uint64_t) ggml_nelements(t), (uint64_t) t->src[0]->ne[0]);
    }
    if (t->op == GGML_OP_FLASH_ATTN_EXT) {
        const ggml_tensor *q = t->src[0], *k = t->src[1], *v = t->src[2];
        const uint64_t     rows = sat_mul(sat_mul(q->ne[1], q->ne[2]), q->ne[3]);
        return sat_mul(sat_mul(rows, k->ne[1]), (uint64_t) k->ne[0] + v->ne[0]);
    }
    uint64_t n = (uint64_t) ggml_nelements(t);
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        if (t->src[i]) {
            n = sat_add(n, (uint64_t) ggml_nelements(t->src[i]));
        }
    }
    return n;
}

// a node's output either lies apart from each of its sources or starts where the source starts (in place, as ggml's
// allocator places ops it may run in place): kernels copy rows from source to output with memcpy, and a partly
// overlapping pair is undefined behaviour (found by the fuzzer under AddressSanitizer: RMS_NORM)
static bool apart_or_in_place(const ggml_tensor * t, const std::vector<specee_rpc_region> & regions,
                              const std::unordered_map<const ggml_tensor *, size_t> & index_of) {
    const specee_rpc_region & w = regions[index_of.at(t)];
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        if (!t->src[i]) {
            continue;
        }
        const specee_rpc_region & r = regions[index_of.at(t->src[i])];
        const bool overlap = r.data && w.data < r.data + r.extent && r.data < w.data + w.extent;
        if (overlap && r.data != w.data) {
            return false;
        }
    }
    return true;
}

specee_rpc_graph::~specee_rpc_graph() {
    if (slice_ctx) {
        ggml_free(slice_ctx);
    }
    if (tensor_ctx) {
        ggml_free(tensor_ctx);
    }
}

// the nodes cut into runs of about limits.slice_cost each (a node costing more is a run of its own), each run made a
// ggml graph in a context sized for exactly these graphs
static bool make_slices(specee_rpc_graph & g, const std::vector<ggml_tensor *> & nodes,
                        const std::vector<uint64_t> & costs, const specee_rpc_graph_limits & limits) {
    std::vector<std::pair<size_t, size_t>> runs; // [begin, end)
    uint64_t                               acc = 0;
    for (size_t i = 0; i < nodes.size(); ++i) {
        if (runs.empty() || acc >= limits.slice_cost) {
            runs.push_back({ i, i });
            acc = 0;
        }
        runs.back().second = i + 1;
        acc                = sat_add(acc, costs[i]);
    }
    size_t mem = 1024;
    for (const auto & [b, e] : runs) {
        mem += ggml_graph_overhead_custom(e - b, false);
    }
    g.slice_mem.resize(mem);
    g.slice_ctx = ggml_init({ mem, g.slice_mem.data(), true });
    if (!g.slice_ctx) {
        return false;
    }
    for (const auto & [b, e] : runs) {
        ggml_cgraph * graph = ggml_new_graph_custom(g.slice_ctx, e - b, false);
        for (size_t i = b; i < e; ++i) {
            ggml_graph_add_node(graph, nodes[i]);
        }
        g.slices.push_back(graph);
    }
    return true;
}

std::unique_ptr<specee_rpc_graph> specee_rpc_graph_build(const uint8_t * payload, size_t size,
                                                         const specee_rpc_buffers & buffers, ggml_backend_dev_t dev,
                                                         const specee_rpc_graph_limits & limits, std::string & why) {
    graph_header h;
    if (!parse_header(payload, size, h)) {
        fail(why, "graph message sizes do not add up");
        return nullptr;
    }
    if (h.device != 0 || h.n_nodes == 0) {
        fail(why, h.device != 0 ? "no such device" : "a graph without nodes");
        return nullptr;
    }
    if (h.n_nodes > limits.max_nodes) {
        fail(why, "a graph of " + std::to_string(h.n_nodes) + " nodes, more than this server's " +
                      std::to_string(limits.max_nodes) + " (--max-graph-nodes)");
        return nullptr;
    }
    auto g = std::make_unique<specee_rpc_graph>();
    g->tensor_mem.resize(specee_rpc_graph_mem_size(payload, size));
    g->tensor_ctx = ggml_init({ g->tensor_mem.size(), g->tensor_mem.data(), true });
    if (!g->tensor_ctx) {
        fail(why, "no memory for the graph");
        return nullptr;
    }
    std::vector<ggml_tensor *>           ts;
    std::vector<specee_rpc_region>       regions;
    std::unordered_map<uint64_t, size_t> by_id;
    if (!make_tensors(g->tensor_ctx, h, buffers, ts, regions, by_id, why) || !link_tensors(h, ts, by_id, why)) {
        return nullptr;
    }
    std::vector<ggml_tensor *>                      nodes(h.n_nodes);
    std::vector<uint64_t>                           costs(h.n_nodes);
    std::vector<bool>                               listed(ts.size(), false);
    std::unordered_map<const ggml_tensor *, size_t> index_of;
    for (size_t i = 0; i < ts.size(); ++i) {
        index_of[ts[i]] = i;
    }
    for (uint32_t i = 0; i < h.n_nodes; ++i) {
        uint64_t id;
        memcpy(&id, h.nodes + (size_t) i * 8, 8);
        const auto it = by_id.find(id);
        if (it == by_id.end()) {
            fail(why, "graph node " + std::to_string(i) + " (id " + std::to_string(id) + ") names no tensor");
            return nullptr;
        }
        if (listed[it->second]) { // ggml never lists a node twice; a repeat would only run the same work again
            fail(why, "graph node " + std::to_string(i) + " (id " + std::to_string(id) + ") is listed twice");
            return nullptr;
        }
        listed[it->second] = true;
        ggml_tensor * t    = ts[it->second];
        if (computes(t) && !has_data(t)) {
            fail(why, std::string("node ") + std::to_string(i) + " (" + ggml_op_name(t->op) +
                          ") or one of its sources lies in no buffer");
            return nullptr;
        }
        if (!check_op(t) || (computes(t) && !ggml_backend_dev_supports_op(dev, t))) {
            fail(why, std::string("node ") + std::to_string(i) + ": op " + ggml_op_name(t->op) +
                          " with these sources, types, shapes or strides is not one this server runs");
            return nullptr;
        }
        if (computes(t) && !apart_or_in_place(t, regions, index_of)) {
            fail(why, std::string("node ") + std::to_string(i) + " (" + ggml_op_name(t->op) +
                          ") writes over part of one of its sources");
            return nullptr;
        }
        costs[i] = specee_rpc_node_cost(t);
        if (costs[i] > limits.max_node_cost) {
            fail(why, std::string("node ") + std::to_string(i) + " (" + ggml_op_name(t->op) + ") costs " +
                          std::to_string(costs[i]) + " multiply-adds, more than this server runs in one node (" +
                          std::to_string(limits.max_node_cost) + ")");
            return nullptr;
        }
        g->cost  = sat_add(g->cost, costs[i]);
        nodes[i] = t;
    }
    if (g->cost > limits.max_cost) {
        fail(why, "a graph costing " + std::to_string(g->cost) + " multiply-adds, more than this server's " +
                      std::to_string(limits.max_cost) + " (--max-graph-cost)");
        return nullptr;
    }
    if (!check_indices(nodes, regions, index_of, g->indices, why)) {
        return nullptr;
    }
    if (!make_slices(*g, nodes, costs, limits)) {
        fail(why, "no memory for the graph");
        return nullptr;
    }
    return g;
}
