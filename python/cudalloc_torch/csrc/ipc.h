// How a CUDA tensor's pages travel to another process (torch.multiprocessing) on cudalloc's
// PyTorch backend: plain POSIX C++ (no torch, no CUDA), so that python/tests/test_ipc.py
// compiles and checks it on a machine without either.
//
// cudalloc exports an allocation's pages as file descriptors (cudalloc_share in the C ABI), and
// PyTorch's handle for a shared tensor is bytes alone. So the sending process keeps the
// descriptors and serves them on a Unix socket of the abstract namespace (Registry); the
// handle (Wire) names the socket, a random key for the allocation and the page sizes; the
// receiving process connects, sends the key, and gets the descriptors back by SCM_RIGHTS
// (fetch). Only a process of the same user is served (SO_PEERCRED), and only with the key.
// Closing the sender's descriptors lets the pages go only where nothing else holds them: a
// receiver's mapping, or a copy a child forked without exec inherited, keeps them.
//
// Invariants:
//   - The registry owns every descriptor it holds: each is closed exactly once, when the
//     allocation it describes is freed (forget), its pages are about to go (forget_all, before
//     cudalloc_sleep), or adding it failed. A request is answered with copies, made under the
//     lock and closed after sending.
//   - A key is served while its allocation lives; a key not (or no longer) held is answered
//     with kUnknown, never with another allocation's descriptors. An allocation has one key.
//   - The server thread starts at the first add and runs until the process exits (or, after a
//     lasting accept failure, until the next add starts another); each request runs on a
//     thread of its own.

#pragma once

#include <fcntl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace cudalloc_torch::ipc {

inline constexpr char kMagic[] = "cudalloc-ipc/1";  // the handle's first bytes, '\0' included
inline constexpr uint64_t kUnknown = ~uint64_t{0};  // the server's answer to a key it lacks
inline constexpr uint64_t kFailed = kUnknown - 1;   // ... when it could not copy the descriptors
inline constexpr size_t kFdsPerMessage = 200;       // under SCM_MAX_FD (253)
inline constexpr int kTimeoutSeconds = 30;          // the client's wait, and the server's sends
inline constexpr int kKeySeconds = 2;               // the server's wait for a client's key

inline std::string errno_text(const std::string& what) {
  return what + ": " + std::strerror(errno);
}

// What a handle says: the socket, the key, and what cudalloc_open_shared needs.
struct Wire {
  std::string socket;  // abstract socket name, without its leading '\0'
  uint64_t key = 0;
  int32_t device = 0;
  uint64_t segment = 0, offset = 0, size = 0;
  std::vector<uint64_t> page_sizes;  // one per descriptor, in order
};

namespace detail {
template <class T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}
template <class T>
T take(const std::string& in, size_t& at) {
  if (in.size() - at < sizeof(T)) {
    throw std::runtime_error("a cudalloc tensor handle ends early (" +
                             std::to_string(in.size()) + " bytes)");
  }
  T v;
  std::memcpy(&v, in.data() + at, sizeof v);
  at += sizeof v;
  return v;
}
}  // namespace detail

inline std::string encode(const Wire& w) {
  std::string out(kMagic, sizeof kMagic);
  detail::put<uint64_t>(out, w.key);
  detail::put<int32_t>(out, w.device);
  detail::put<uint64_t>(out, w.segment);
  detail::put<uint64_t>(out, w.offset);
  detail::put<uint64_t>(out, w.size);
  detail::put<uint32_t>(out, static_cast<uint32_t>(w.socket.size()));
  out += w.socket;
  detail::put<uint64_t>(out, w.page_sizes.size());
  for (uint64_t s : w.page_sizes) {
    detail::put<uint64_t>(out, s);
  }
  return out;
}

// Whether `handle` is one of ours (PyTorch's own allocator writes other handles).
inline bool is_ours(const std::string& handle) {
  return handle.size() >= sizeof kMagic && std::memcmp(handle.data(), kMagic, sizeof kMagic) == 0;
}

inline Wire decode(const std::string& handle) {
  if (!is_ours(handle)) {
    throw std::runtime_error(
        "the CUDA tensor was shared by a process not on cudalloc's PyTorch backend (its handle "
        "is not cudalloc's); run both processes on the same allocator");
  }
  size_t at = sizeof kMagic;
  Wire w;
  w.key = detail::take<uint64_t>(handle, at);
  w.device = detail::take<int32_t>(handle, at);
  w.segment = detail::take<uint64_t>(handle, at);
  w.offset = detail::take<uint64_t>(handle, at);
  w.size = detail::take<uint64_t>(handle, at);
  const uint32_t name = detail::take<uint32_t>(handle, at);
  if (handle.size() - at < name || name >= sizeof(sockaddr_un::sun_path)) {
    throw std::runtime_error("a cudalloc tensor handle has a bad socket name length " +
                             std::to_string(name));
  }
  w.socket.assign(handle, at, name);
  at += name;
  const uint64_t pages = detail::take<uint64_t>(handle, at);
  if (pages > (handle.size() - at) / sizeof(uint64_t)) {
    throw std::runtime_error("a cudalloc tensor handle names " + std::to_string(pages) +
                             " pages but holds fewer");
  }
  for (uint64_t i = 0; i < pages; ++i) {
    w.page_sizes.push_back(detail::take<uint64_t>(handle, at));
  }
  return w;
}

// The address of abstract socket `name` and its length.
inline std::pair<sockaddr_un, socklen_t> address(const std::string& name) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path + 1, name.data(), name.size());  // sun_path[0] = '\0': abstract
  return {a, static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size())};
}

inline void set_timeouts(int fd) {
  timeval t{kTimeoutSeconds, 0};
  (void)setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &t, sizeof t);
  (void)setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &t, sizeof t);
}

// Moves `n` bytes at `p` by `step` (a send or a receive of at most the bytes it is given),
// again after EINTR; false on an error or once the peer has closed.
template <class Step>
bool move_all(char* p, size_t n, Step step) {
  while (n > 0) {
    const ssize_t k = step(p, n);
    if (k < 0 && errno == EINTR) {
      continue;
    }
    if (k <= 0) {
      return false;
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

inline bool write_all(int fd, const void* data, size_t n) {
  char* p = const_cast<char*>(static_cast<const char*>(data));  // only read by send
  return move_all(p, n, [fd](char* q, size_t k) { return ::send(fd, q, k, MSG_NOSIGNAL); });
}

inline bool read_all(int fd, void* data, size_t n) {
  return move_all(static_cast<char*>(data), n,
                  [fd](char* q, size_t k) { return ::recv(fd, q, k, 0); });
}

// A message of one byte of data with room for `n` descriptors (SCM_RIGHTS).
struct FdMessage {
  explicit FdMessage(size_t n) : control(CMSG_SPACE(sizeof(int) * n)) {
    m.msg_iov = &io;
    m.msg_iovlen = 1;
    m.msg_control = control.data();
    m.msg_controllen = control.size();
  }
  FdMessage(const FdMessage&) = delete;
  FdMessage& operator=(const FdMessage&) = delete;

  char byte = 0;
  iovec io{&byte, 1};
  std::vector<char> control;
  msghdr m{};
};

// Sends `fds` in messages of at most kFdsPerMessage descriptors, one byte of data each.
inline bool send_fds(int conn, const std::vector<int>& fds) {
  for (size_t at = 0; at < fds.size(); at += kFdsPerMessage) {
    const size_t n = std::min(kFdsPerMessage, fds.size() - at);
    FdMessage msg(n);
    msghdr& m = msg.m;
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * n);
    std::memcpy(CMSG_DATA(c), fds.data() + at, sizeof(int) * n);
    ssize_t s;
    do {
      s = ::sendmsg(conn, &m, MSG_NOSIGNAL);
    } while (s < 0 && errno == EINTR);
    if (s != 1) {
      return false;
    }
  }
  return true;
}

// A random 64-bit number from the kernel (getrandom); throws when none can be had.
inline uint64_t random64() {
  uint64_t v = 0;
  size_t got = 0;
  while (got < sizeof v) {
    const ssize_t r = ::getrandom(reinterpret_cast<char*>(&v) + got, sizeof v - got, 0);
    if (r < 0 && errno == EINTR) {
      continue;
    }
    if (r <= 0) {
      throw std::runtime_error(errno_text("cudalloc: getrandom for a shared tensor's key"));
    }
    got += static_cast<size_t>(r);
  }
  return v;
}

// Whether anything was ever shared: until then, freeing costs one atomic load here.
inline std::atomic<bool> shared_any{false};

// The descriptors the sending process holds for its shared allocations (one key and one handle
// per allocation, so that sending a tensor again, or a view of it, gives PyTorch's receivers
// the handle they already opened), and the socket that serves them.
class Registry {
 public:
  // The handle of the allocation at `ptr` if it is held.
  std::optional<std::string> handle_of(const void* ptr) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = by_ptr_.find(ptr);
    if (it == by_ptr_.end()) {
      return std::nullopt;
    }
    return by_key_.at(it->second).handle;
  }

  // Takes `fds` (closed here from now on, also when this throws) for the allocation at `ptr`
  // and returns its handle: `w` with its key and the socket filled in, or the handle it holds
  // already (another thread shared it meanwhile: `fds` are closed). Starts the server on
  // first use.
  std::string add(const void* ptr, std::vector<int> fds, Wire w) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto it = by_ptr_.find(ptr); it != by_ptr_.end()) {
      close_all(fds);
      return by_key_.at(it->second).handle;
    }
    try {
      start();
      do {
        w.key = random64();
      } while (w.key == kUnknown || w.key == kFailed || by_key_.count(w.key) != 0);
    } catch (...) {
      close_all(fds);
      throw;
    }
    for (int fd : fds) {
      (void)::fcntl(fd, F_SETFD, FD_CLOEXEC);  // not into children a program starts
    }
    w.socket = name_;
    std::string handle = encode(w);
    by_key_.emplace(w.key, Entry{std::move(fds), handle});
    by_ptr_.emplace(ptr, w.key);
    shared_any.store(true, std::memory_order_release);
    return handle;
  }

  // The allocation at `ptr` is freed (or its pages are about to go): closes its descriptors.
  void forget(const void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = by_ptr_.find(ptr);
    if (it == by_ptr_.end()) {
      return;
    }
    auto k = by_key_.find(it->second);
    close_all(k->second.fds);
    by_key_.erase(k);
    by_ptr_.erase(it);
  }

  // Every allocation's descriptors are closed (their pages are about to go: cudalloc_sleep).
  void forget_all() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [key, e] : by_key_) {
      close_all(e.fds);
    }
    by_key_.clear();
    by_ptr_.clear();
  }

  // The abstract socket's name (empty while no server runs).
  std::string socket() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return name_;
  }

  // Allocations held (for tests).
  size_t size() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return by_key_.size();
  }

 private:
  struct Entry {
    std::vector<int> fds;
    std::string handle;
  };

  static void close_all(const std::vector<int>& fds) {
    for (int fd : fds) {
      ::close(fd);
    }
  }

  // Called with mutex_ held.
  void start() {
    if (listener_ >= 0) {
      return;
    }
    char tail[17];
    std::snprintf(tail, sizeof tail, "%016llx", static_cast<unsigned long long>(random64()));
    const std::string name = "cudalloc-ipc-" + std::to_string(::getpid()) + "-" + tail;
    const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) {
      throw std::runtime_error(errno_text("cudalloc: socket for sharing CUDA tensors"));
    }
    auto [a, len] = address(name);
    if (::bind(s, reinterpret_cast<sockaddr*>(&a), len) != 0 || ::listen(s, 64) != 0) {
      const std::string e = errno_text("cudalloc: bind or listen on @" + name);
      ::close(s);
      throw std::runtime_error(e);
    }
    try {
      std::thread([this, s] { serve(s); }).detach();
    } catch (const std::exception& e) {
      ::close(s);
      throw std::runtime_error(std::string("cudalloc: the thread serving shared tensors: ") +
                               e.what());
    }
    listener_ = s;
    name_ = name;
  }

  // The server's loop: each request is answered on a thread of its own, so that a client that
  // stalls holds up no other. On a lasting failure the socket is closed and the next add
  // starts another (handles made before name the old one, which then refuses connections).
  void serve(int s) {
    for (;;) {
      const int conn = ::accept4(s, nullptr, nullptr, SOCK_CLOEXEC);
      if (conn >= 0) {
        try {
          std::thread([this, conn] {
            answer(conn);
            ::close(conn);
          }).detach();
        } catch (...) {
          ::close(conn);
        }
        continue;
      }
      if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) {
        continue;
      }
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      std::lock_guard<std::mutex> lock(mutex_);
      ::close(s);
      if (listener_ == s) {
        listener_ = -1;
        name_.clear();
      }
      return;
    }
  }

  // One request: the key in, the descriptors' count and the descriptors out. The descriptors
  // are copied under the lock and sent without it, so that a free never waits on a client.
  void answer(int conn) {
    timeval key_wait{kKeySeconds, 0};
    (void)setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &key_wait, sizeof key_wait);
    timeval send_wait{kTimeoutSeconds, 0};
    (void)setsockopt(conn, SOL_SOCKET, SO_SNDTIMEO, &send_wait, sizeof send_wait);
    ucred peer{};
    socklen_t n = sizeof peer;
    if (::getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &peer, &n) != 0 || peer.uid != ::getuid()) {
      return;
    }
    uint64_t key;
    if (!read_all(conn, &key, sizeof key)) {
      return;
    }
    std::vector<int> copies;
    uint64_t count = kUnknown;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = by_key_.find(key);
      if (it != by_key_.end()) {
        count = it->second.fds.size();
        for (int fd : it->second.fds) {
          const int c = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
          if (c < 0) {
            count = kFailed;
            break;
          }
          copies.push_back(c);
        }
      }
    }
    if (write_all(conn, &count, sizeof count) && count != kUnknown && count != kFailed) {
      (void)send_fds(conn, copies);
    }
    close_all(copies);
  }

  mutable std::mutex mutex_;
  std::map<uint64_t, Entry> by_key_;
  std::map<const void*, uint64_t> by_ptr_;
  int listener_ = -1;
  std::string name_;
};

// The process's registry (never destroyed: its server threads outlive static destructors).
inline Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

// The allocation at `ptr` is freed: its descriptors, if it was shared, are closed.
inline void forget(const void* ptr) {
  if (shared_any.load(std::memory_order_acquire)) {
    registry().forget(ptr);
  }
}

// Receives up to `want - got.size()` descriptors from one message into `got`; `cut` says
// whether the kernel cut descriptors off (MSG_CTRUNC).
inline bool receive_fds(int s, std::vector<int>& got, size_t want, bool& cut) {
  FdMessage msg(std::min(kFdsPerMessage, want - got.size()));
  msghdr& m = msg.m;
  ssize_t r;
  do {
    r = ::recvmsg(s, &m, MSG_CMSG_CLOEXEC);
  } while (r < 0 && errno == EINTR);
  if (r != 1) {
    return false;
  }
  for (cmsghdr* c = CMSG_FIRSTHDR(&m); c != nullptr; c = CMSG_NXTHDR(&m, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      const size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < k; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
        got.push_back(fd);
      }
    }
  }
  cut = (m.msg_flags & MSG_CTRUNC) != 0;
  return !cut;
}

// In the receiving process: the descriptors of `w`'s allocation, one per page (the caller's to
// close). Throws, naming what failed, when the sender is gone or does not hold the key.
inline std::vector<int> fetch(const Wire& w) {
  const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) {
    throw std::runtime_error(errno_text("cudalloc: socket to open a shared CUDA tensor"));
  }
  std::vector<int> got;
  auto fail = [&](const std::string& why) {
    for (int fd : got) {
      ::close(fd);
    }
    ::close(s);
    throw std::runtime_error("cudalloc: opening a shared CUDA tensor: " + why);
  };
  set_timeouts(s);
  auto [a, len] = address(w.socket);
  if (::connect(s, reinterpret_cast<sockaddr*>(&a), len) != 0) {
    fail(errno_text("the sending process's socket @" + w.socket +
                    " cannot be reached (has it exited?)"));
  }
  uint64_t count = 0;
  if (!write_all(s, &w.key, sizeof w.key) || !read_all(s, &count, sizeof count)) {
    fail(errno_text("no answer from the sending process"));
  }
  if (count == kUnknown) {
    fail("the sending process no longer holds this tensor (freed, or put to sleep, before it "
         "was opened)");
  }
  if (count == kFailed) {
    fail("the sending process could not copy the pages' descriptors (its open-file limit?)");
  }
  if (count != w.page_sizes.size()) {
    fail("the sending process has " + std::to_string(count) + " pages for it, the handle " +
         std::to_string(w.page_sizes.size()));
  }
  while (got.size() < count) {
    bool cut = false;
    if (!receive_fds(s, got, count, cut)) {
      fail(cut ? std::string("the pages' descriptors were cut off (this process's open-file "
                             "limit, RLIMIT_NOFILE?)")
               : errno_text("receiving the pages' descriptors"));
    }
  }
  if (got.size() != count) {
    fail(std::to_string(got.size()) + " descriptors came for " + std::to_string(count) +
         " pages");
  }
  ::close(s);
  return got;
}

}  // namespace cudalloc_torch::ipc
