// specee-rpc-server.cpp: the RPC device server (see specee-rpc-server.h): sockets and timeouts, the memory budget,
// the handshake (AUTH when a token is set, then HELLO) and one handler per command. Handlers never trust a size, an
// id or an address from the client: buffer ids are looked up in the connection's own table, tensors are checked by
// specee-rpc-graph.cpp, payloads are received straight into the buffer region they were checked against (nothing is
// allocated for a declared size), and GRAPH_COMPUTE's message grows only as its bytes arrive, inside the budget.
// Graphs run in slices of bounded work, one slice per turn, turns taken in arrival order (a ticket lock), so one
// client's graph holds the others for at most one slice.
#include "specee-rpc-server.h"

#include "specee-rpc-graph.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <arpa/inet.h>
#include <malloc.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>
#include <vector>

namespace fs = std::filesystem;

// ---- the state all connections share

// turns on the CPU backend in the order they were asked for (a std::mutex lets the thread that just released it take
// it again at once, so one connection's slices could follow each other while another waits)
struct fair_lock {
    std::mutex              m;
    std::condition_variable cv;
    uint64_t                next = 0, serving = 0;

    void lock() {
        std::unique_lock<std::mutex> l(m);
        const uint64_t               mine = next++;
        cv.wait(l, [&] { return serving == mine; });
    }
    void unlock() {
        {
            std::lock_guard<std::mutex> l(m);
            ++serving;
        }
        cv.notify_all();
    }
};

struct server_state {
    specee_rpc_server_params   p;
    specee_rpc_graph_limits    limits;
    ggml_backend_dev_t         dev     = nullptr;
    ggml_backend_t             backend = nullptr;
    ggml_backend_buffer_type_t buft    = nullptr;
    fair_lock                  compute_turns; // one slice at a time on the CPU backend (its threads are the -t ones)
    std::mutex                 mem_mutex;
    uint64_t                   mem_used = 0;
    std::atomic<int>           n_clients{0};
    std::mutex                 cache_mutex;   // the cache directory's bytes, counted at start and as files are added
    uint64_t                   cache_used = 0;
    bool                       cache_full_logged = false;
    std::mutex                 wrong_token_mutex; // wrong tokens are answered one at a time, each after a delay
};

static bool mem_reserve(server_state & s, uint64_t n) {
    std::lock_guard<std::mutex> lock(s.mem_mutex);
    if (n > s.p.max_memory - s.mem_used) {
        return false;
    }
    s.mem_used += n;
    return true;
}

static void mem_release(server_state & s, uint64_t n) {
    std::lock_guard<std::mutex> lock(s.mem_mutex);
    s.mem_used -= std::min(n, s.mem_used);
}

static uint64_t mem_free(server_state & s) {
    std::lock_guard<std::mutex> lock(s.mem_mutex);
    return s.p.max_memory - s.mem_used;
}

// ---- one connection

constexpr uint64_t VBASE_STEP    = 1ull << 40; // buffer i's made-up base is i * 2^40; a buffer is below 1 TiB
constexpr uint64_t MAX_BUFFER_ID = (1ull << 23) - 1;
constexpr size_t   MAX_GRAPH_MSG = 256u << 20;
constexpr size_t   RECV_CHUNK    = 1u << 20;
constexpr uint64_t ZEROED_BELOW  = 32u << 20;

struct connection {
    server_state &       s;
    int                  fd;
    std::string          peer;
    specee_rpc_buffers   buffers;
    uint64_t             next_id = 1;
    std::unique_ptr<specee_rpc_graph> graph; // the last graph (GRAPH_RECOMPUTE runs it again)
    std::vector<ggml_cplan>           plans; // one per slice of it, sharing `work`
    std::unique_ptr<uint8_t[]>        work;  // the CPU kernels' scratch memory for the largest slice
    uint64_t                          graph_counted = 0; // its memory and its scratch, counted in the budget
    std::string                       why;       // what the client broke, for the log line

    connection(server_state & st, int f, std::string name) : s(st), fd(f), peer(std::move(name)) {}
    ~connection() {
        drop_graph();
        for (auto & [id, b] : buffers) {
            ggml_backend_buffer_free(b.buf);
            mem_release(s, specee_rpc_buffer_cost(b.size));
        }
        close(fd);
    }
    void drop_graph() {
        graph.reset();
        plans.clear();
        work.reset();
        mem_release(s, graph_counted);
        graph_counted = 0;
    }
    bool refuse(const std::string & what) {
        why = what;
        return false;
    }
};

// waits for `fd` to be readable (timeout_ms < 0: as long as it takes)
static bool wait_readable(int fd, int timeout_ms) {
    pollfd pfd = { fd, POLLIN, 0 };
    for (;;) {
        const int r = poll(&pfd, 1, timeout_ms);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        return r > 0;
    }
}

// exactly n bytes, each wait for more at most the receive timeout (the first wait: `first_wait_ms`, and what its
// timing out means: `first_late`)
static bool recv_all(connection & c, void * dst, size_t n, int first_wait_ms,
                     const char * first_late = "timed out waiting for a message") {
    uint8_t * p    = (uint8_t *) dst;
    int       wait = first_wait_ms;
    while (n > 0) {
        if (!wait_readable(c.fd, wait)) {
            return c.refuse(p == (uint8_t *) dst ? first_late : "timed out waiting for the rest of a message");
        }
        const ssize_t got = recv(c.fd, p, n, 0);
        if (got <= 0) {
            if (got < 0 && (errno == EINTR || errno == EAGAIN)) {
                continue;
            }
            return c.refuse(got == 0 ? "" : "receive failed"); // "": the client closed, nothing to log
        }
        p += got;
        n -= (size_t) got;
        wait = c.s.p.recv_timeout_ms;
    }
    return true;
}

static bool recv_all(connection & c, void * dst, size_t n) {
    return recv_all(c, dst, n, c.s.p.recv_timeout_ms);
}

static bool send_all(connection & c, const void * src, size_t n) {
    const uint8_t * p = (const uint8_t *) src;
    while (n > 0) {
        const ssize_t sent = send(c.fd, p, n, MSG_NOSIGNAL);
        if (sent <= 0) {
            if (sent < 0 && errno == EINTR) {
                continue;
            }
            return c.refuse("send failed or timed out");
        }
        p += sent;
        n -= (size_t) sent;
    }
    return true;
}

// a reply: | size | payload |
static bool reply(connection & c, const void * msg, uint64_t size) {
    return send_all(c, &size, sizeof(size)) && (size == 0 || send_all(c, msg, size));
}

// a fixed-size request payload: the declared size must be the struct's
template <typename T> static bool recv_req(connection & c, uint64_t size, T & req) {
    if (size != sizeof(T)) {
        return c.refuse("payload of " + std::to_string(size) + " bytes where " + std::to_string(sizeof(T)) +
                        " are expected");
    }
    return recv_all(c, &req, sizeof(T));
}

static bool check(connection & c, const specee_rpc_tensor & t, bool need_buffer, specee_rpc_region & r) {
    return specee_rpc_check_tensor(c.buffers, t, need_buffer, r, c.why);
}

// ---- buffers

static bool cmd_alloc_buffer(connection & c, uint64_t size) {
    specee_rpc_alloc_buffer_req req;
    if (!recv_req(c, size, req)) {
        return false;
    }
    if (req.device != 0) {
        return c.refuse("no such device");
    }
    specee_rpc_alloc_buffer_rsp rsp = { 0, 0 };
    // a request over the budget (or of 0 bytes, which ggml's client never sends) gets the reply of a failed
    // allocation (buffer 0), as upstream gives
    // (each buffer counted at its real cost, specee_rpc_buffer_cost; at most --max-buffers at once per connection)
    if (req.size > 0 && req.size < VBASE_STEP && c.next_id <= MAX_BUFFER_ID &&
        c.buffers.size() < (size_t) c.s.p.max_buffers && mem_reserve(c.s, specee_rpc_buffer_cost(req.size))) {
        ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(c.s.buft, req.size);
        if (buf && ggml_backend_buffer_get_size(buf) == req.size) {
            // no client reads what another left in freed memory: small buffers come from the heap and are cleared;
            // large ones (above glibc's largest mmap threshold) are fresh pages from the kernel, zero without RSS
            if (req.size <= ZEROED_BELOW) {
                memset(ggml_backend_buffer_get_base(buf), 0, req.size);
            }
            const uint64_t id = c.next_id++;
            c.buffers[id]     = { buf, (uint8_t *) ggml_backend_buffer_get_base(buf), id * VBASE_STEP, req.size };
            rsp               = { id, req.size };
        } else {
            if (buf) {
                ggml_backend_buffer_free(buf);
            }
            mem_release(c.s, specee_rpc_buffer_cost(req.size));
        }
    }
    return reply(c, &rsp, sizeof(rsp));
}

static specee_rpc_buffer * find_buffer(connection & c, uint64_t id) {
    auto it = c.buffers.find(id);
    return it == c.buffers.end() ? nullptr : &it->second;
}

static bool cmd_buffer(connection & c, uint8_t cmd, uint64_t size) {
    if (cmd == SPECEE_RPC_BUFFER_CLEAR) {
        specee_rpc_buffer_clear_req req;
        if (!recv_req(c, size, req)) {
            return false;
        }
        specee_rpc_buffer * b = find_buffer(c, req.buffer);
        if (!b) {
            return c.refuse("BUFFER_CLEAR of a buffer not handed out on this connection");
        }
        memset(b->base, req.value, b->size);
        return reply(c, nullptr, 0);
    }
    uint64_t id;
    if (!recv_req(c, size, id)) {
        return false;
    }
    specee_rpc_buffer * b = find_buffer(c, id);
    if (!b) {
        return c.refuse("a buffer id not handed out on this connection");
    }
    if (cmd == SPECEE_RPC_BUFFER_GET_BASE) {
        return reply(c, &b->vbase, sizeof(b->vbase));
    }
    c.drop_graph(); // FREE_BUFFER: the last graph may point into it
    ggml_backend_buffer_free(b->buf);
    mem_release(c.s, specee_rpc_buffer_cost(b->size));
    c.buffers.erase(id);
    return reply(c, nullptr, 0);
}

// ---- the weight cache (--cache): files named by hash, written whole under a temporary name and renamed; at most
// --cache-max bytes in the directory, and never the last GiB of its file system

constexpr uint64_t CACHE_DISK_RESERVE = 1ull << 30;

static uint64_t cache_dir_bytes(const std::string & dir) {
    uint64_t        n = 0;
    std::error_code ec;
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
        std::error_code e2;
        if (it->is_regular_file(e2)) {
            const uintmax_t k = it->file_size(e2);
            n += e2 ? 0 : (uint64_t) k;
        }
    }
    return n;
}

static void cache_store(server_state & s, const uint8_t * data, uint64_t n) {
    char name[17];
    snprintf(name, sizeof(name), "%016" PRIx64, specee_rpc_fnv(SPECEE_RPC_FNV_START, data, n));
    const fs::path              path = fs::path(s.p.cache_dir) / name;
    std::lock_guard<std::mutex> lock(s.cache_mutex);
    std::error_code             ec;
    if (fs::exists(path, ec)) {
        return;
    }
    const fs::space_info space = fs::space(s.p.cache_dir, ec);
    if (n > s.p.cache_max - std::min(s.cache_used, s.p.cache_max) || ec || space.available < n + CACHE_DISK_RESERVE) {
        if (!s.cache_full_logged) {
            fprintf(stderr, "specee-rpc-server: the cache %s is full (--cache-max %" PRIu64 " MiB, or its disk): "
                            "weights received from now on are not kept\n", s.p.cache_dir.c_str(),
                    s.p.cache_max >> 20);
            s.cache_full_logged = true;
        }
        return;
    }
    const fs::path tmp = fs::path(s.p.cache_dir) / (std::string(name) + ".tmp");
    {
        std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
        if (!out.write((const char *) data, (std::streamsize) n) || !out.flush()) {
            out.close();
            fs::remove(tmp, ec);
            return;
        }
    }
    fs::rename(tmp, path, ec);
    if (ec) {
        fs::remove(tmp, ec);
        return;
    }
    s.cache_used += n;
}

// ---- tensors

static bool cmd_set_tensor(connection & c, uint64_t size) {
    if (size < SPECEE_RPC_SET_TENSOR_HEAD) {
        return c.refuse("SET_TENSOR shorter than its header");
    }
    specee_rpc_tensor t;
    uint64_t          offset;
    specee_rpc_region r;
    if (!recv_all(c, &t, sizeof(t)) || !recv_all(c, &offset, sizeof(offset)) || !check(c, t, true, r)) {
        return false;
    }
    const uint64_t n = size - SPECEE_RPC_SET_TENSOR_HEAD;
    if (!specee_rpc_range_ok(r, offset, n)) {
        return c.refuse("SET_TENSOR of " + std::to_string(n) + " bytes at offset " + std::to_string(offset) +
                        " outside the tensor");
    }
    // straight into the checked region, a chunk at a time: memory is spent only as bytes arrive
    for (uint64_t done = 0; done < n;) {
        const size_t k = (size_t) std::min<uint64_t>(n - done, RECV_CHUNK);
        if (!recv_all(c, r.data + offset + done, k)) {
            return false;
        }
        done += k;
    }
    if (!c.s.p.cache_dir.empty() && n > SPECEE_RPC_HASH_THRESHOLD) {
        cache_store(c.s, r.data + offset, n);
    }
    return true;
}

static bool cmd_set_tensor_hash(connection & c, uint64_t size) {
    specee_rpc_set_tensor_hash_req req;
    if (!recv_req(c, size, req)) {
        return false;
    }
    uint8_t ok = 0;
    if (!c.s.p.cache_dir.empty()) {
        char name[17];
        snprintf(name, sizeof(name), "%016" PRIx64, req.hash);
        const fs::path  path = fs::path(c.s.p.cache_dir) / name;
        std::error_code ec;
        const uintmax_t n = fs::file_size(path, ec);
        if (!ec) {
            specee_rpc_region r;
            if (!check(c, req.tensor, true, r)) {
                return false;
            }
            if (!specee_rpc_range_ok(r, req.offset, n)) {
                return c.refuse("SET_TENSOR_HASH of cached data that does not fit the tensor");
            }
            std::ifstream in(path, std::ios::binary);
            ok = in.read((char *) r.data + req.offset, (std::streamsize) n) ? 1 : 0;
        }
    }
    return reply(c, &ok, sizeof(ok));
}

static bool cmd_get_tensor(connection & c, uint64_t size) {
    specee_rpc_get_tensor_req req;
    specee_rpc_region         r;
    if (!recv_req(c, size, req) || !check(c, req.tensor, true, r)) {
        return false;
    }
    if (!specee_rpc_range_ok(r, req.offset, req.size)) {
        return c.refuse("GET_TENSOR outside the tensor");
    }
    return reply(c, r.data + req.offset, req.size);
}

static bool cmd_memset_tensor(connection & c, uint64_t size) {
    specee_rpc_memset_tensor_req req;
    specee_rpc_region            r;
    if (!recv_req(c, size, req) || !check(c, req.tensor, true, r)) {
        return false;
    }
    if (!specee_rpc_range_ok(r, req.offset, req.size)) {
        return c.refuse("MEMSET_TENSOR outside the tensor");
    }
    memset(r.data + req.offset, req.value, req.size);
    return reply(c, nullptr, 0);
}

static bool cmd_copy_tensor(connection & c, uint64_t size) {
    specee_rpc_copy_tensor_req req;
    specee_rpc_region          src, dst;
    if (!recv_req(c, size, req) || !check(c, req.src, true, src) || !check(c, req.dst, true, dst)) {
        return false;
    }
    if (!specee_rpc_range_ok(dst, 0, src.extent)) {
        return c.refuse("COPY_TENSOR into a tensor smaller than its source");
    }
    memmove(dst.data, src.data, src.extent);
    const uint8_t ok = 1;
    return reply(c, &ok, sizeof(ok));
}

// INIT_TENSOR (the CPU's buffers need no per-tensor set-up) and GET_ALLOC_SIZE (the CPU's size: the tensor's bytes)
static bool cmd_tensor_info(connection & c, uint8_t cmd, uint64_t size) {
    specee_rpc_region r;
    if (cmd == SPECEE_RPC_INIT_TENSOR) {
        specee_rpc_tensor t;
        return recv_req(c, size, t) && check(c, t, false, r) && reply(c, nullptr, 0);
    }
    specee_rpc_get_alloc_size_req req;
    if (!recv_req(c, size, req) || !check(c, req.tensor, false, r)) {
        return false;
    }
    if (req.device != 0) {
        return c.refuse("no such device");
    }
    const uint64_t n = r.extent;
    return reply(c, &n, sizeof(n));
}

// ---- graphs

// the graph's row indices checked (again: they may have changed since the last run), then its slices run, one per
// turn on the CPU backend
static bool compute(connection & c) {
    if (!specee_rpc_graph_indices_ok(*c.graph, c.why)) {
        return false;
    }
    for (size_t i = 0; i < c.graph->slices.size(); ++i) {
        c.s.compute_turns.lock();
        const ggml_status st = ggml_graph_compute(c.graph->slices[i], &c.plans[i]);
        c.s.compute_turns.unlock();
        if (st != GGML_STATUS_SUCCESS) {
            return c.refuse(std::string("graph compute failed: ") + ggml_status_to_string(st));
        }
    }
    return true;
}

static bool cmd_graph_compute(connection & c, uint64_t size) {
    if (size > MAX_GRAPH_MSG || !mem_reserve(c.s, size)) {
        return c.refuse("GRAPH_COMPUTE of " + std::to_string(size) + " bytes is over the server's limit");
    }
    std::vector<uint8_t> msg;
    bool                 ok = true;
    while (ok && msg.size() < size) { // grown as the bytes arrive
        const size_t k = (size_t) std::min<uint64_t>(size - msg.size(), RECV_CHUNK);
        msg.resize(msg.size() + k);
        ok = recv_all(c, msg.data() + msg.size() - k, k);
    }
    c.drop_graph();
    // the tensors' memory is known from the header, the slices' after the check: each counted before it is kept
    const size_t mem = ok ? specee_rpc_graph_mem_size(msg.data(), msg.size()) : 0;
    if (ok && (mem == 0 || !mem_reserve(c.s, mem))) {
        ok = c.refuse(mem == 0 ? "graph message sizes do not add up" : "graph over the memory budget");
    }
    if (ok) {
        c.graph_counted = mem;
        c.graph = specee_rpc_graph_build(msg.data(), msg.size(), c.buffers, c.s.dev, c.s.limits, c.why);
        if (c.graph) {
            // the slices' graphs, and the scratch memory of the CPU kernels (converted inputs of MUL_MAT, per-thread
            // rows of FLASH_ATTN_EXT): this connection's own, counted and freed with the graph (ggml's CPU backend
            // would keep its largest ever, outside the budget)
            size_t work = 0;
            for (ggml_cgraph * slice : c.graph->slices) {
                c.plans.push_back(ggml_graph_plan(slice, c.s.p.n_threads, nullptr));
                work = std::max(work, c.plans.back().work_size);
            }
            const uint64_t more = (c.graph->mem_size() > mem ? c.graph->mem_size() - mem : 0) + work;
            ok = mem_reserve(c.s, more) || c.refuse("graph over the memory budget (with the kernels' scratch memory)");
            c.graph_counted += ok ? more : 0;
            if (ok && work > 0) {
                c.work.reset(new (std::nothrow) uint8_t[work]);
                ok = c.work != nullptr || c.refuse("no memory for the graph's scratch");
            }
            for (ggml_cplan & plan : c.plans) {
                plan.work_data = c.work.get();
            }
        }
        ok = ok && c.graph != nullptr && compute(c);
    }
    mem_release(c.s, size);
    if (!ok) {
        c.drop_graph();
    }
    return ok;
}

static bool cmd_graph_recompute(connection & c, uint64_t size) {
    uint32_t device;
    if (!recv_req(c, size, device)) {
        return false;
    }
    if (device != 0 || !c.graph) {
        return c.refuse("GRAPH_RECOMPUTE without a graph");
    }
    return compute(c);
}

// ---- the device

static bool cmd_device(connection & c, uint8_t cmd, uint64_t size) {
    if (cmd == SPECEE_RPC_DEVICE_COUNT) {
        const uint32_t n = 1;
        return size == 0 ? reply(c, &n, sizeof(n)) : c.refuse("DEVICE_COUNT with a payload");
    }
    uint32_t device;
    if (!recv_req(c, size, device)) {
        return false;
    }
    if (device != 0) {
        return c.refuse("no such device");
    }
    if (cmd == SPECEE_RPC_GET_ALIGNMENT) {
        const uint64_t a = ggml_backend_buft_get_alignment(c.s.buft);
        return reply(c, &a, sizeof(a));
    }
    if (cmd == SPECEE_RPC_GET_MAX_SIZE) {
        const uint64_t m = std::min<uint64_t>(ggml_backend_buft_get_max_size(c.s.buft), VBASE_STEP - 1);
        return reply(c, &m, sizeof(m));
    }
    size_t free = 0, total = 0; // GET_DEVICE_MEMORY: the budget, as far as the machine has it
    ggml_backend_dev_memory(c.s.dev, &free, &total);
    specee_rpc_device_memory_rsp rsp = { std::min<uint64_t>(free, mem_free(c.s)),
                                         std::min<uint64_t>(total, c.s.p.max_memory) };
    return reply(c, &rsp, sizeof(rsp));
}

// ---- the handshake and the command loop

static bool handshake(connection & c) {
    uint8_t  cmd;
    uint64_t size;
    if (!c.s.p.token.empty()) {
        if (!recv_all(c, &cmd, 1) || !recv_all(c, &size, sizeof(size))) {
            return false;
        }
        if (cmd != SPECEE_RPC_AUTH || size == 0 || size > SPECEE_RPC_MAX_TOKEN) {
            return c.refuse("no token: this server wants one before any command");
        }
        char got[SPECEE_RPC_MAX_TOKEN];
        if (!recv_all(c, got, size)) {
            return false;
        }
        uint8_t diff = size != c.s.p.token.size(); // compared in full, whatever differs first
        for (size_t i = 0; i < size; ++i) {
            diff |= (uint8_t) (got[i] ^ c.s.p.token[i % c.s.p.token.size()]);
        }
        const uint8_t ok = diff == 0;
        if (!ok) { // answered after a delay, one wrong token at a time for the whole server: guesses stay slow
            std::lock_guard<std::mutex> lock(c.s.wrong_token_mutex);
            std::this_thread::sleep_for(std::chrono::milliseconds(c.s.p.wrong_token_delay_ms));
        }
        if (!reply(c, &ok, 1) || !ok) {
            return c.refuse("wrong token");
        }
    }
    if (!recv_all(c, &cmd, 1) || !recv_all(c, &size, sizeof(size))) {
        return false;
    }
    if (cmd == SPECEE_RPC_AUTH) { // a client with a token, a server without: nothing to check
        char skip[SPECEE_RPC_MAX_TOKEN];
        const uint8_t ok = 1;
        if (size == 0 || size > SPECEE_RPC_MAX_TOKEN || !recv_all(c, skip, size) || !reply(c, &ok, 1) ||
            !recv_all(c, &cmd, 1) || !recv_all(c, &size, sizeof(size))) {
            return c.why.empty() ? c.refuse("bad AUTH message") : false;
        }
    }
    uint8_t caps[SPECEE_RPC_CAPS_SIZE];
    if (cmd != SPECEE_RPC_HELLO || size != sizeof(caps)) {
        return c.refuse("the first command was not HELLO (protocol 5)");
    }
    specee_rpc_hello_rsp rsp = { SPECEE_RPC_PROTO_MAJOR, SPECEE_RPC_PROTO_MINOR, SPECEE_RPC_PROTO_PATCH, 0, {} };
    return recv_all(c, caps, sizeof(caps)) && reply(c, &rsp, sizeof(rsp));
}

static bool dispatch(connection & c, uint8_t cmd, uint64_t size) {
    switch (cmd) {
        case SPECEE_RPC_ALLOC_BUFFER:      return cmd_alloc_buffer(c, size);
        case SPECEE_RPC_BUFFER_GET_BASE:
        case SPECEE_RPC_FREE_BUFFER:
        case SPECEE_RPC_BUFFER_CLEAR:      return cmd_buffer(c, cmd, size);
        case SPECEE_RPC_SET_TENSOR:        return cmd_set_tensor(c, size);
        case SPECEE_RPC_SET_TENSOR_HASH:   return cmd_set_tensor_hash(c, size);
        case SPECEE_RPC_GET_TENSOR:        return cmd_get_tensor(c, size);
        case SPECEE_RPC_MEMSET_TENSOR:     return cmd_memset_tensor(c, size);
        case SPECEE_RPC_COPY_TENSOR:       return cmd_copy_tensor(c, size);
        case SPECEE_RPC_INIT_TENSOR:
        case SPECEE_RPC_GET_ALLOC_SIZE:    return cmd_tensor_info(c, cmd, size);
        case SPECEE_RPC_GRAPH_COMPUTE:     return cmd_graph_compute(c, size);
        case SPECEE_RPC_GRAPH_RECOMPUTE:   return cmd_graph_recompute(c, size);
        case SPECEE_RPC_DEVICE_COUNT:
        case SPECEE_RPC_GET_ALIGNMENT:
        case SPECEE_RPC_GET_MAX_SIZE:
        case SPECEE_RPC_GET_DEVICE_MEMORY: return cmd_device(c, cmd, size);
        default:                           return c.refuse("unknown command " + std::to_string(cmd));
    }
}

static void serve_connection(server_state & s, int fd, std::string peer) {
    {
        connection c(s, fd, peer);
        timeval tv = { s.p.recv_timeout_ms / 1000, (s.p.recv_timeout_ms % 1000) * 1000 };
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)); // a client that stops reading a reply
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        bool ok = handshake(c);
        while (ok) {
            uint8_t  cmd;
            uint64_t size;
            // between commands a client may idle (as long as --idle-timeout allows); inside one, the receive
            // timeout holds
            const int idle = s.p.idle_timeout_ms > 0 ? s.p.idle_timeout_ms : -1;
            ok = recv_all(c, &cmd, 1, idle, "idle longer than --idle-timeout") && recv_all(c, &size, sizeof(size)) &&
                 dispatch(c, cmd, size);
        }
        if (!c.why.empty()) {
            fprintf(stderr, "specee-rpc-server: %s: refused: %s; connection closed\n", peer.c_str(), c.why.c_str());
        }
    }
    malloc_trim(0); // the connection's buffers go back to the system, not only to this thread's heap arena
    s.n_clients--;
}

// ---- listening

bool specee_rpc_host_is_loopback(const std::string & host) {
    in_addr a;
    return host == "localhost" || (inet_pton(AF_INET, host.c_str(), &a) == 1 && (ntohl(a.s_addr) >> 24) == 127);
}

static int listen_on(const specee_rpc_server_params & p, std::string & err) {
    sockaddr_in addr = {};
    addr.sin_family  = AF_INET;
    addr.sin_port    = htons((uint16_t) p.port);
    const std::string host = p.host == "localhost" ? "127.0.0.1" : p.host;
    if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
        err = "'" + p.host + "' is not an IPv4 address";
        return -1;
    }
    const int fd  = socket(AF_INET, SOCK_STREAM, 0);
    int       one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (fd < 0 || bind(fd, (sockaddr *) &addr, sizeof(addr)) < 0 || listen(fd, 128) < 0) {
        err = "cannot listen on " + p.host + ":" + std::to_string(p.port) + ": " + strerror(errno);
        if (fd >= 0) {
            close(fd);
        }
        return -1;
    }
    return fd;
}

static bool init_device(server_state & s, std::string & err) {
    s.dev     = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    s.backend = s.dev ? ggml_backend_dev_init(s.dev, nullptr) : nullptr;
    if (!s.backend) {
        err = "no CPU backend";
        return false;
    }
    ggml_backend_cpu_set_n_threads(s.backend, s.p.n_threads);
    s.buft = ggml_backend_dev_buffer_type(s.dev);
    if (!ggml_backend_buft_is_host(s.buft)) {
        err = "the CPU's buffers are not host memory";
        return false;
    }
    size_t free = 0, total = 0;
    ggml_backend_dev_memory(s.dev, &free, &total);
    if (s.p.max_memory == 0) {
        s.p.max_memory = total;
    }
    s.limits.max_nodes     = s.p.max_graph_nodes;
    s.limits.max_cost      = s.p.max_graph_cost;
    s.limits.max_node_cost = std::min(s.limits.max_node_cost, s.p.max_graph_cost);
    if (!s.p.cache_dir.empty()) {
        std::error_code ec;
        fs::create_directories(s.p.cache_dir, ec);
        if (!fs::is_directory(s.p.cache_dir, ec)) {
            err = "the cache directory " + s.p.cache_dir + " cannot be made";
            return false;
        }
        s.cache_used = cache_dir_bytes(s.p.cache_dir);
    }
    return true;
}

void specee_rpc_serve(const specee_rpc_server_params & p, std::string & err) {
    static server_state s; // lives as long as the process: connection threads are detached
    s.p = p;
    // one heap for all connection threads: with glibc's arena per thread, what a finished connection freed stays
    // spread over arenas that malloc_trim cannot empty while other threads' small blocks sit in their pages (a
    // churn of a million tiny buffers grew the process by megabytes); buffers are allocated rarely, so sharing
    // one arena costs nothing measurable
    mallopt(M_ARENA_MAX, 1);
    if (!init_device(s, err)) {
        return;
    }
    const int lfd = listen_on(p, err);
    if (lfd < 0) {
        return;
    }
    printf("specee-rpc-server: serving %s (%s) on %s:%d: protocol %d.%d.%d, %s, up to %d clients, %.0f MiB budget, "
           "%d s receive timeout, %d s idle timeout\n",
           ggml_backend_dev_name(s.dev), ggml_backend_dev_description(s.dev), p.host.c_str(), p.port,
           SPECEE_RPC_PROTO_MAJOR, SPECEE_RPC_PROTO_MINOR, SPECEE_RPC_PROTO_PATCH,
           p.token.empty() ? "no token" : "token required", p.max_clients, s.p.max_memory / 1048576.0,
           p.recv_timeout_ms / 1000, p.idle_timeout_ms / 1000);
    fflush(stdout);
    for (;;) {
        sockaddr_in peer    = {};
        socklen_t   len     = sizeof(peer);
        const int   fd      = accept(lfd, (sockaddr *) &peer, &len);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE) {
                std::this_thread::sleep_for(std::chrono::milliseconds(errno == EINTR ? 0 : 50));
                continue;
            }
            err = std::string("accept failed: ") + strerror(errno);
            return;
        }
        char ip[INET_ADDRSTRLEN] = "?";
        inet_ntop(AF_INET, &peer.sin_addr, ip, sizeof(ip));
        const std::string name = std::string(ip) + ":" + std::to_string(ntohs(peer.sin_port));
        if (s.n_clients.fetch_add(1) >= p.max_clients) {
            s.n_clients--;
            fprintf(stderr, "specee-rpc-server: %s: refused: %d clients already; connection closed\n", name.c_str(),
                    p.max_clients);
            close(fd);
            continue;
        }
        std::thread(serve_connection, std::ref(s), fd, name).detach();
    }
}
