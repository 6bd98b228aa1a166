// specee-rpc-client.cpp: the peer check and the token relay of specee-rpc-client.h, over plain sockets.
#include "specee-rpc-client.h"

#include "specee-impl.h"
#include "specee-rpc-proto.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

// ---- sockets with deadlines

struct fd_guard {
    int fd = -1;
    ~fd_guard() {
        if (fd >= 0) {
            close(fd);
        }
    }
};

static bool wait_for(int fd, short events, int timeout_ms) {
    pollfd pfd = { fd, events, 0 };
    int    r;
    do {
        r = poll(&pfd, 1, timeout_ms);
    } while (r < 0 && errno == EINTR);
    return r > 0;
}

// a connected socket to host:port within the timeout, or -1 with `err` set
static int connect_to(const std::string & host, int port, std::string & err) {
    addrinfo hints = {}, *res = nullptr;
    hints.ai_family   = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res) {
        err = "cannot resolve the host";
        return -1;
    }
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    int r = connect(fd, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    int       soerr = 0;
    socklen_t len   = sizeof(soerr);
    if (r < 0 && errno == EINPROGRESS) {
        if (!wait_for(fd, POLLOUT, SPECEE_RPC_CLIENT_TIMEOUT_MS)) {
            close(fd);
            err = specee_format("no connection within %d s", SPECEE_RPC_CLIENT_TIMEOUT_MS / 1000);
            return -1;
        }
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len);
        r = soerr ? -1 : 0;
        errno = soerr;
    }
    if (r < 0) {
        err = strerror(errno);
        close(fd);
        return -1;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    return fd;
}

static bool send_all(int fd, const void * p, size_t n) {
    while (n > 0) {
        const ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k <= 0) {
            if (k < 0 && errno == EINTR) {
                continue;
            }
            return false;
        }
        p = (const char *) p + k;
        n -= (size_t) k;
    }
    return true;
}

// n bytes, the whole of them within the timeout; "" or what went wrong
static std::string recv_all(int fd, void * p, size_t n) {
    const auto deadline = specee_clock::now() + std::chrono::milliseconds(SPECEE_RPC_CLIENT_TIMEOUT_MS);
    while (n > 0) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - specee_clock::now());
        if (left.count() <= 0 || !wait_for(fd, POLLIN, (int) left.count())) {
            return specee_format("no reply within %d s", SPECEE_RPC_CLIENT_TIMEOUT_MS / 1000);
        }
        const ssize_t k = recv(fd, p, n, 0);
        if (k <= 0) {
            if (k < 0 && errno == EINTR) {
                continue;
            }
            return k == 0 ? "it closed the connection" : strerror(errno);
        }
        p = (char *) p + k;
        n -= (size_t) k;
    }
    return "";
}

// one request and its reply, which must be exactly `rsp_size` bytes; "" or what went wrong
static std::string call(int fd, uint8_t cmd, const void * req, uint64_t req_size, void * rsp, uint64_t rsp_size) {
    if (!send_all(fd, &cmd, 1) || !send_all(fd, &req_size, 8) || (req_size && !send_all(fd, req, req_size))) {
        return "sending failed";
    }
    uint64_t got = 0;
    std::string e = recv_all(fd, &got, 8);
    if (!e.empty()) {
        return e;
    }
    if (got != rsp_size) {
        return specee_format("a malformed reply (%llu bytes where %llu were expected)", (unsigned long long) got,
                             (unsigned long long) rsp_size);
    }
    return recv_all(fd, rsp, rsp_size);
}

static std::string authenticate(int fd, const std::string & token) {
    uint8_t ok = 0;
    std::string e = call(fd, SPECEE_RPC_AUTH, token.data(), token.size(), &ok, 1);
    return !e.empty() ? "the token was not accepted: " + e : ok != 1 ? "the token was refused" : "";
}

// ---- the check

static std::string check_peer(int fd, const std::string & token) {
    std::string e;
    if (!token.empty() && !(e = authenticate(fd, token)).empty()) {
        return e;
    }
    uint8_t              caps[SPECEE_RPC_CAPS_SIZE] = {};
    specee_rpc_hello_rsp hello;
    if (!(e = call(fd, SPECEE_RPC_HELLO, caps, sizeof(caps), &hello, sizeof(hello))).empty()) {
        return "HELLO: " + e;
    }
    if (hello.major != SPECEE_RPC_PROTO_MAJOR || hello.minor > SPECEE_RPC_PROTO_MINOR) {
        return specee_format("it speaks RPC protocol %d.%d.%d, this build %d.%d.x", hello.major, hello.minor,
                             hello.patch, SPECEE_RPC_PROTO_MAJOR, SPECEE_RPC_PROTO_MINOR);
    }
    uint32_t n_dev = 0, dev = 0;
    if (!(e = call(fd, SPECEE_RPC_DEVICE_COUNT, nullptr, 0, &n_dev, sizeof(n_dev))).empty()) {
        return "DEVICE_COUNT: " + e;
    }
    if (n_dev == 0 || n_dev > 16) {
        return specee_format("it says it has %u devices", n_dev);
    }
    uint64_t align = 0, max_size = 0;
    specee_rpc_device_memory_rsp mem;
    if (!(e = call(fd, SPECEE_RPC_GET_ALIGNMENT, &dev, 4, &align, 8)).empty() ||
        !(e = call(fd, SPECEE_RPC_GET_MAX_SIZE, &dev, 4, &max_size, 8)).empty() ||
        !(e = call(fd, SPECEE_RPC_GET_DEVICE_MEMORY, &dev, 4, &mem, sizeof(mem))).empty()) {
        return e;
    }
    if (align == 0 || (align & (align - 1)) != 0 || align > 4096 || max_size == 0 || mem.free > mem.total) {
        return "its device reports an alignment, size or memory that makes no sense";
    }
    return "";
}

void specee_rpc_check_peer(const std::string & host, int port, const std::string & token) {
    std::string err;
    fd_guard    g;
    g.fd = connect_to(host, port, err);
    if (g.fd < 0) {
        specee_fail("cannot reach the ggml RPC server at %s:%d (%s; is specee-rpc-server running there?)",
                    host.c_str(), port, err.c_str());
    }
    err = check_peer(g.fd, token);
    if (!err.empty()) {
        specee_fail("the RPC server at %s:%d does not answer as a ggml RPC server should: %s", host.c_str(), port,
                    err.c_str());
    }
}

// ---- the relay

static void pump(int a, int b) {
    char buf[1 << 16];
    pollfd pfd[2] = { { a, POLLIN, 0 }, { b, POLLIN, 0 } };
    for (;;) {
        if (poll(pfd, 2, -1) < 0) {
            if (errno == EINTR) {
                continue;
            }
            break;
        }
        bool ok = true;
        for (int i = 0; i < 2 && ok; ++i) {
            if (pfd[i].revents & (POLLIN | POLLHUP | POLLERR)) {
                const ssize_t k = recv(pfd[i].fd, buf, sizeof(buf), 0);
                ok = k > 0 && send_all(pfd[1 - i].fd, buf, (size_t) k);
            }
        }
        if (!ok) {
            break;
        }
    }
    close(a);
    close(b);
}

static void relay_accept(int lfd, std::string host, int port, std::string token) {
    for (;;) {
        const int local = accept(lfd, nullptr, nullptr);
        if (local < 0) {
            if (errno == EINTR || errno == ECONNABORTED) {
                continue;
            }
            return;
        }
        std::string err;
        const int   remote = connect_to(host, port, err);
        if (remote < 0 || !(err = authenticate(remote, token)).empty()) {
            fprintf(stderr, "specee: the RPC server at %s:%d: %s\n", host.c_str(), port, err.c_str());
            if (remote >= 0) {
                close(remote);
            }
            close(local); // ggml's client then fails on this connection
            continue;
        }
        std::thread(pump, local, remote).detach();
    }
}

std::string specee_rpc_relay(const std::string & host, int port, const std::string & token) {
    static std::mutex                         mutex;
    static std::map<std::string, std::string> relays;
    std::lock_guard<std::mutex>               lock(mutex);
    const std::string                         key = host + ":" + std::to_string(port);
    auto                                      it  = relays.find(key);
    if (it != relays.end()) {
        return it->second;
    }
    sockaddr_in addr     = {};
    addr.sin_family      = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len        = sizeof(addr);
    const int lfd        = socket(AF_INET, SOCK_STREAM, 0);
    if (lfd < 0 || bind(lfd, (sockaddr *) &addr, sizeof(addr)) < 0 || listen(lfd, 16) < 0 ||
        getsockname(lfd, (sockaddr *) &addr, &len) < 0) {
        specee_fail("cannot open the local relay for the RPC server at %s: %s", key.c_str(), strerror(errno));
    }
    std::thread(relay_accept, lfd, host, port, token).detach();
    return relays[key] = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
}
