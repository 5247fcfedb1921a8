// resp: a pipelined RESP2 (Redis protocol) connector on ConnectorBase
// (docs/design/storage-engine.md#backend-resp).
//
// Key = the native key string verbatim, value = the raw bytes; SET/GET/EXISTS/DEL, no TTL,
// no prefix. Each worker holds one TCP connection and pipelines up to pipeline_depth
// commands per round trip. GET payloads are received straight into the caller's buffer.
#pragma once

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <climits>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "connector_base.h"

namespace lmcache {
namespace storage {
namespace redis {

struct RespOptions {
  std::string host;
  int port = 6379;
  std::string username;
  std::string password;
  int db = 0;
  int pipeline_depth = 16;
  double socket_timeout_s = 10.0;
};

// Thrown for anything that leaves the byte stream in an unknown state; the connection is
// reset and the tile fails.
struct ConnectionError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class FdRegistry {
 public:
  void add(int fd) {
    std::lock_guard<std::mutex> lock(mu_);
    fds_.insert(fd);
  }
  void remove(int fd) {
    std::lock_guard<std::mutex> lock(mu_);
    fds_.erase(fd);
  }
  void shutdown_all() {
    std::lock_guard<std::mutex> lock(mu_);
    for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
  }

 private:
  std::mutex mu_;
  std::set<int> fds_;
};

class RespSocket {
 public:
  RespSocket(const RespOptions& opts, FdRegistry& registry) : opts_(opts), registry_(registry) {}
  RespSocket(const RespSocket&) = delete;
  RespSocket& operator=(const RespSocket&) = delete;
  ~RespSocket() { reset(); }

  bool connected() const { return fd_ >= 0; }

  void reset() {
    if (fd_ >= 0) {
      registry_.remove(fd_);
      ::close(fd_);
    }
    fd_ = -1;
    rpos_ = rlen_ = 0;
  }

  void connect() {
    reset();
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const std::string port = std::to_string(opts_.port);
    int rc = ::getaddrinfo(opts_.host.c_str(), port.c_str(), &hints, &res);
    if (rc != 0)
      throw std::runtime_error("cannot resolve " + opts_.host + ": " + ::gai_strerror(rc));
    std::string last_error = "no address";
    for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
      int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
      if (fd < 0) continue;
      if (connect_with_timeout(fd, ai->ai_addr, ai->ai_addrlen, last_error)) {
        int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        timeval tv{};
        tv.tv_sec = static_cast<time_t>(opts_.socket_timeout_s);
        tv.tv_usec = static_cast<suseconds_t>((opts_.socket_timeout_s - tv.tv_sec) * 1e6);
        ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
        fd_ = fd;
        registry_.add(fd);
        break;
      }
      ::close(fd);
    }
    ::freeaddrinfo(res);
    if (fd_ < 0)
      throw std::runtime_error("cannot connect to redis at " + opts_.host + ":" + port + ": " +
                               last_error);
    if (!opts_.password.empty()) {
      std::vector<std::string> cmd = {"AUTH"};
      if (!opts_.username.empty()) cmd.push_back(opts_.username);
      cmd.push_back(opts_.password);
      simple_command(cmd, "AUTH");
    }
    if (opts_.db != 0) simple_command({"SELECT", std::to_string(opts_.db)}, "SELECT");
  }

  // ---- writing ---------------------------------------------------------------------------
  void writev_all(std::vector<iovec>& iov) {
    size_t idx = 0;
    while (idx < iov.size()) {
      const int cnt = static_cast<int>(std::min<size_t>(iov.size() - idx, IOV_MAX));
      msghdr msg{};
      msg.msg_iov = &iov[idx];
      msg.msg_iovlen = cnt;
      ssize_t n = ::sendmsg(fd_, &msg, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EINTR) continue;
        fail_io("send");
      }
      size_t left = static_cast<size_t>(n);
      while (idx < iov.size() && left >= iov[idx].iov_len) {
        left -= iov[idx].iov_len;
        ++idx;
      }
      if (left > 0) {
        iov[idx].iov_base = static_cast<char*>(iov[idx].iov_base) + left;
        iov[idx].iov_len -= left;
      }
    }
  }

  // ---- reading ---------------------------------------------------------------------------
  std::string read_line() {
    std::string line;
    while (true) {
      if (rpos_ == rlen_) fill();
      char* start = rbuf_ + rpos_;
      char* nl = static_cast<char*>(std::memchr(start, '\n', rlen_ - rpos_));
      if (nl == nullptr) {
        line.append(start, rlen_ - rpos_);
        rpos_ = rlen_;
        if (line.size() > 1 << 20) throw ConnectionError("redis reply line too long");
        continue;
      }
      line.append(start, nl - start);
      rpos_ = static_cast<size_t>(nl - rbuf_) + 1;
      if (line.empty() || line.back() != '\r') throw ConnectionError("malformed redis reply");
      line.pop_back();
      return line;
    }
  }

  // Reads exactly n bytes into dst (or discards them when dst is null).
  void read_exact(char* dst, size_t n) {
    size_t buffered = std::min(n, rlen_ - rpos_);
    if (dst != nullptr) std::memcpy(dst, rbuf_ + rpos_, buffered);
    rpos_ += buffered;
    size_t done = buffered;
    while (done < n) {
      if (dst == nullptr || n - done < sizeof(rbuf_) / 2) {
        fill();
        size_t take = std::min(n - done, rlen_ - rpos_);
        if (dst != nullptr) std::memcpy(dst + done, rbuf_ + rpos_, take);
        rpos_ += take;
        done += take;
      } else {  // large payload: receive straight into the destination
        ssize_t got = ::recv(fd_, dst + done, n - done, 0);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) fail_io("recv");
        done += static_cast<size_t>(got);
      }
    }
  }

  void expect_crlf() {
    char crlf[2];
    read_exact(crlf, 2);
    if (crlf[0] != '\r' || crlf[1] != '\n') throw ConnectionError("malformed redis bulk string");
  }

  static long long parse_int(const std::string& s, size_t from) {
    if (from >= s.size()) throw ConnectionError("malformed redis integer");
    char* end = nullptr;
    long long v = std::strtoll(s.c_str() + from, &end, 10);
    if (end == nullptr || *end != '\0') throw ConnectionError("malformed redis integer: " + s);
    return v;
  }

  static void append_bulk_header(std::string& out, size_t len) {
    out += '$';
    out += std::to_string(len);
    out += "\r\n";
  }

  static std::string encode(const std::vector<std::string>& args) {
    std::string out = "*" + std::to_string(args.size()) + "\r\n";
    for (const auto& a : args) {
      append_bulk_header(out, a.size());
      out += a;
      out += "\r\n";
    }
    return out;
  }

 private:
  void simple_command(const std::vector<std::string>& args, const char* what) {
    std::string cmd = encode(args);
    std::vector<iovec> iov = {{cmd.data(), cmd.size()}};
    writev_all(iov);
    std::string reply = read_line();
    if (reply.empty() || reply[0] != '+') {
      reset();
      throw std::runtime_error(std::string(what) + " failed: " + reply);
    }
  }

  bool connect_with_timeout(int fd, const sockaddr* addr, socklen_t len, std::string& err) {
    int flags = ::fcntl(fd, F_GETFL, 0);
    ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
    int rc = ::connect(fd, addr, len);
    if (rc != 0 && errno != EINPROGRESS) {
      err = std::strerror(errno);
      return false;
    }
    if (rc != 0) {
      pollfd p{fd, POLLOUT, 0};
      int ready = ::poll(&p, 1, static_cast<int>(opts_.socket_timeout_s * 1000));
      if (ready <= 0) {
        err = ready == 0 ? "connect timed out" : std::strerror(errno);
        return false;
      }
      int so_error = 0;
      socklen_t sl = sizeof(so_error);
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &sl);
      if (so_error != 0) {
        err = std::strerror(so_error);
        return false;
      }
    }
    ::fcntl(fd, F_SETFL, flags);
    return true;
  }

  void fill() {
    if (rpos_ == rlen_) rpos_ = rlen_ = 0;
    while (true) {
      ssize_t got = ::recv(fd_, rbuf_ + rlen_, sizeof(rbuf_) - rlen_, 0);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) fail_io("recv");
      if (got == 0) {
        reset();
        throw ConnectionError("redis closed the connection");
      }
      rlen_ += static_cast<size_t>(got);
      return;
    }
  }

  [[noreturn]] void fail_io(const char* what) {
    int err = errno;
    reset();
    throw ConnectionError(std::string("redis ") + what + " failed: " +
                          (err == EAGAIN || err == EWOULDBLOCK ? "timed out" : std::strerror(err)));
  }

  const RespOptions& opts_;
  FdRegistry& registry_;
  int fd_ = -1;
  char rbuf_[64 * 1024];
  size_t rpos_ = 0;
  size_t rlen_ = 0;
};

struct RespConnection {
  std::unique_ptr<RespSocket> sock;
  std::chrono::steady_clock::time_point next_attempt{};
  std::chrono::milliseconds backoff{50};
  std::string last_error;
};

class RespConnector : public connector::ConnectorBase<RespConnection> {
 public:
  RespConnector(RespOptions opts, int num_workers)
      : connector::ConnectorBase<RespConnection>(num_workers), opts_(validate(std::move(opts))) {
    start_workers();
  }
  ~RespConnector() override { close(); }

 protected:
  RespConnection create_connection() override {
    auto sock = std::make_unique<RespSocket>(opts_, registry_);
    sock->connect();
    RespConnection conn;
    conn.sock = std::move(sock);
    return conn;
  }

  // The single-key forms (used by nothing here but required by the framework) go through
  // the pipelined batch paths with a window of one.
  bool do_single_get(RespConnection& c, const std::string& key, void* buf, size_t len,
                     size_t) override {
    uint8_t found = 0;
    get_window(c, &key, &buf, &len, &found, 1);
    return found != 0;
  }
  void do_single_set(RespConnection& c, const std::string& key, const void* buf, size_t len,
                     size_t) override {
    void* p = const_cast<void*>(buf);
    set_window(c, &key, &p, &len, 1);
  }
  bool do_single_exists(RespConnection& c, const std::string& key) override {
    uint8_t r = 0;
    int_window(c, "EXISTS", &key, &r, 1);
    return r != 0;
  }
  bool do_single_delete(RespConnection& c, const std::string& key) override {
    uint8_t r = 0;
    int_window(c, "DEL", &key, &r, 1);
    return r != 0;
  }

  void do_batch_get(RespConnection& c, const connector::Request& req) override {
    for_windows(req, [&](size_t i, size_t n) {
      get_window(c, &req.keys[i], const_cast<void* const*>(&req.buf_ptrs[i]), &req.buf_lens[i],
                 &req.batch->per_key_results[req.start_idx + i], n);
    });
  }
  void do_batch_set(RespConnection& c, const connector::Request& req) override {
    for_windows(req, [&](size_t i, size_t n) {
      set_window(c, &req.keys[i], const_cast<void* const*>(&req.buf_ptrs[i]), &req.buf_lens[i],
                 n);
    });
  }
  void do_batch_exists(RespConnection& c, const connector::Request& req) override {
    for_windows(req, [&](size_t i, size_t n) {
      int_window(c, "EXISTS", &req.keys[i], &req.batch->per_key_results[req.start_idx + i], n);
    });
  }
  void do_batch_delete(RespConnection& c, const connector::Request& req) override {
    for_windows(req, [&](size_t i, size_t n) {
      int_window(c, "DEL", &req.keys[i], &req.batch->per_key_results[req.start_idx + i], n);
    });
  }

  void shutdown_connections() override { registry_.shutdown_all(); }

 private:
  static RespOptions validate(RespOptions o) {
    if (o.host.empty()) throw std::invalid_argument("host must be a non-empty string");
    if (o.port <= 0 || o.port > 65535) throw std::invalid_argument("port must be a positive integer");
    if (o.pipeline_depth <= 0) throw std::invalid_argument("pipeline_depth must be a positive integer");
    if (!(o.socket_timeout_s > 0)) throw std::invalid_argument("socket_timeout_s must be positive");
    return o;
  }

  // A window ends after pipeline_depth commands or once its values reach kWindowBytes
  // (always at least one key). Pipelining pays off for small values, where round trips
  // dominate; for large ones redis-server 7 got slower with deep windows (lmcache bench l2,
  // 32 x 1 MiB: depth 16 moved about half the bytes per second of depth 1 or 4).
  static constexpr size_t kWindowBytes = size_t{1} << 20;

  template <typename F>
  void for_windows(const connector::Request& req, F fn) {
    const size_t depth = static_cast<size_t>(opts_.pipeline_depth);
    const size_t total = req.keys.size();
    const bool sized = req.buf_lens.size() == total;
    size_t i = 0;
    while (i < total) {
      size_t n = 0;
      size_t bytes = 0;
      while (i + n < total && n < depth && (n == 0 || bytes < kWindowBytes)) {
        if (sized) bytes += req.buf_lens[i + n];
        ++n;
      }
      fn(i, n);
      i += n;
    }
  }

  // Reconnects after a lost connection, with backoff (50 ms doubling to 5 s) so a dead
  // server fails tiles at once instead of making each one wait for a connect timeout.
  RespSocket& ensure(RespConnection& c) {
    if (!c.sock) c.sock = std::make_unique<RespSocket>(opts_, registry_);
    if (c.sock->connected()) return *c.sock;
    const auto now = std::chrono::steady_clock::now();
    if (now < c.next_attempt)
      throw std::runtime_error("redis unavailable (reconnect pending): " + c.last_error);
    try {
      c.sock->connect();
    } catch (const std::exception& e) {
      c.last_error = e.what();
      c.next_attempt = now + c.backoff;
      c.backoff = std::min<std::chrono::milliseconds>(c.backoff * 2, std::chrono::seconds(5));
      throw;
    }
    c.backoff = std::chrono::milliseconds(50);
    return *c.sock;
  }

  // Runs fn; a ConnectionError resets the socket (done by RespSocket) and fails the tile.
  void set_window(RespConnection& c, const std::string* keys, void* const* bufs,
                  const size_t* lens, size_t n) {
    RespSocket& s = ensure(c);
    std::vector<std::string> headers(n);
    std::vector<iovec> iov;
    iov.reserve(n * 3);
    static const char kCrlf[] = "\r\n";
    for (size_t i = 0; i < n; ++i) {
      std::string& h = headers[i];
      h = "*3\r\n$3\r\nSET\r\n";
      RespSocket::append_bulk_header(h, keys[i].size());
      h += keys[i];
      h += "\r\n";
      RespSocket::append_bulk_header(h, lens[i]);
      iov.push_back({h.data(), h.size()});
      if (lens[i] > 0) iov.push_back({bufs[i], lens[i]});
      iov.push_back({const_cast<char*>(kCrlf), 2});
    }
    s.writev_all(iov);
    std::string first_error;
    for (size_t i = 0; i < n; ++i) {  // read every reply to stay in sync
      std::string reply = s.read_line();
      if (reply.empty()) throw ConnectionError("empty redis reply");
      if (reply[0] == '-') {
        if (first_error.empty()) first_error = "SET " + keys[i] + ": " + reply.substr(1);
      } else if (reply[0] != '+') {
        s.reset();
        throw ConnectionError("unexpected redis reply to SET: " + reply);
      }
    }
    if (!first_error.empty()) throw std::runtime_error(first_error);
  }

  void get_window(RespConnection& c, const std::string* keys, void* const* bufs,
                  const size_t* lens, uint8_t* results, size_t n) {
    RespSocket& s = ensure(c);
    std::string cmds;
    for (size_t i = 0; i < n; ++i) {
      cmds += "*2\r\n$3\r\nGET\r\n";
      RespSocket::append_bulk_header(cmds, keys[i].size());
      cmds += keys[i];
      cmds += "\r\n";
    }
    std::vector<iovec> iov = {{cmds.data(), cmds.size()}};
    s.writev_all(iov);
    for (size_t i = 0; i < n; ++i) {
      results[i] = 0;
      std::string reply = s.read_line();
      if (reply.empty()) throw ConnectionError("empty redis reply");
      if (reply[0] == '-') continue;  // an error reply is a miss for this key only
      if (reply[0] != '$') {
        s.reset();
        throw ConnectionError("unexpected redis reply to GET: " + reply);
      }
      long long len = RespSocket::parse_int(reply, 1);
      if (len < 0) continue;  // $-1: missing
      if (static_cast<size_t>(len) == lens[i]) {
        s.read_exact(static_cast<char*>(bufs[i]), lens[i]);
        results[i] = 1;
      } else {
        s.read_exact(nullptr, static_cast<size_t>(len));  // wrong size: drain, miss
      }
      s.expect_crlf();
    }
  }

  void int_window(RespConnection& c, const char* cmd, const std::string* keys, uint8_t* results,
                  size_t n) {
    RespSocket& s = ensure(c);
    std::string cmds;
    const std::string name(cmd);
    for (size_t i = 0; i < n; ++i) {
      cmds += "*2\r\n";
      RespSocket::append_bulk_header(cmds, name.size());
      cmds += name;
      cmds += "\r\n";
      RespSocket::append_bulk_header(cmds, keys[i].size());
      cmds += keys[i];
      cmds += "\r\n";
    }
    std::vector<iovec> iov = {{cmds.data(), cmds.size()}};
    s.writev_all(iov);
    std::string first_error;
    for (size_t i = 0; i < n; ++i) {
      std::string reply = s.read_line();
      if (reply.empty()) throw ConnectionError("empty redis reply");
      if (reply[0] == ':') {
        results[i] = RespSocket::parse_int(reply, 1) > 0 ? 1 : 0;
      } else if (reply[0] == '-') {
        results[i] = 0;
        if (first_error.empty()) first_error = name + " " + keys[i] + ": " + reply.substr(1);
      } else {
        s.reset();
        throw ConnectionError("unexpected redis reply to " + name + ": " + reply);
      }
    }
    if (!first_error.empty() && name == "EXISTS") throw std::runtime_error(first_error);
  }

  RespOptions opts_;
  FdRegistry registry_;
};

}  // namespace redis
}  // namespace storage
}  // namespace lmcache
