"""How the PyTorch backend carries a shared CUDA tensor's page descriptors between processes
(``csrc/ipc.h``), compiled with the system's C++ compiler and run: no torch and no GPU needed.
Each case is a small C++ program; the descriptors are of memory files (``memfd_create``) whose
bytes say which page they are, and a forked child plays the receiving process. The test fails
if the header does not compile (with warnings as errors) or a check fails."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(__file__))
from cxx_cases import add_cases  # noqa: E402


PRELUDE = r"""
#include "ipc.h"
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <cstdio>
using namespace cudalloc_torch::ipc;
int fails = 0;
#define CHECK(c) \
  do { if (!(c)) { std::printf("FAILED line %d: %s\n", __LINE__, #c); ++fails; } } while (0)
// A memory file holding the number i.
int page(uint64_t i) {
  int fd = memfd_create("page", MFD_CLOEXEC);
  if (fd < 0 || pwrite(fd, &i, sizeof i, 0) != sizeof i) { std::perror("memfd"); _exit(2); }
  return fd;
}
std::vector<int> pages(size_t n) {
  std::vector<int> v;
  for (size_t i = 0; i < n; ++i) v.push_back(page(i));
  return v;
}
// In a forked child: 0 if fetching `handle` gives n descriptors holding 0..n-1, 3 if it throws
// a message containing `error` (when given), 1 otherwise.
int child(const std::string& handle, size_t n, const char* error = nullptr) {
  pid_t pid = fork();
  if (pid == 0) {
    try {
      std::vector<int> fds = fetch(decode(handle));
      if (error != nullptr || fds.size() != n) _exit(1);
      for (size_t i = 0; i < n; ++i) {
        uint64_t v = ~0ull;
        if (pread(fds[i], &v, sizeof v, 0) != sizeof v || v != i) _exit(1);
      }
      _exit(0);
    } catch (const std::exception& e) {
      std::printf("child: %s\n", e.what());
      std::fflush(stdout);
      _exit(error != nullptr && std::string(e.what()).find(error) != std::string::npos ? 3 : 1);
    }
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 100;
}
Wire wire(size_t n) {
  Wire w;
  w.device = 0;
  w.segment = 7;
  w.offset = 4096;
  w.size = 12345;
  w.page_sizes.assign(n, 2 << 20);
  return w;
}
// Shares n pages for `ptr`: its handle.
std::string share(const void* ptr, size_t n) { return registry().add(ptr, pages(n), wire(n)); }
bool closed(int fd) { return fcntl(fd, F_GETFD) == -1 && errno == EBADF; }
int main() {
  std::setvbuf(stdout, nullptr, _IONBF, 0);
"""
EPILOGUE = r"""
  std::printf("fails %d\n", fails);
  return fails != 0;
}
"""

CASES = {
    "a_child_gets_the_pages_and_a_freed_allocation_is_no_longer_served": r"""
  int x = 0;
  std::vector<int> fds = pages(3);
  const std::string h = registry().add(&x, fds, wire(3));
  CHECK(registry().handle_of(&x) == std::optional<std::string>(h));
  CHECK(decode(h).socket == registry().socket() && decode(h).page_sizes.size() == 3);
  for (int fd : fds) CHECK((fcntl(fd, F_GETFD) & FD_CLOEXEC) != 0);
  CHECK(child(h, 3) == 0);
  CHECK(child(h, 3) == 0);   // a second receiver
  registry().forget(&x);
  CHECK(registry().size() == 0 && !registry().handle_of(&x).has_value());
  for (int fd : fds) CHECK(closed(fd));
  CHECK(child(h, 3, "no longer holds") == 3);
  // Shared by two threads at once: the second add keeps the first handle and closes its own.
  std::vector<int> again = pages(1), twice = pages(1);
  const std::string first = registry().add(&x, again, wire(1));
  CHECK(registry().add(&x, twice, wire(1)) == first);
  CHECK(closed(twice[0]) && !closed(again[0]) && registry().size() == 1);
  registry().forget(&x);
  CHECK(closed(again[0]) && registry().size() == 0);
""",
    "hundreds_of_pages_travel_in_several_messages": r"""
  int x = 0;
  CHECK(child(share(&x, 450), 450) == 0);
  forget(&x);
  CHECK(registry().size() == 0);
""",
    "forgetting_one_allocation_or_all_closes_theirs_only": r"""
  int x = 0, y = 0, z = 0;
  std::vector<int> a = pages(2), c = pages(1);
  const std::string ha = registry().add(&x, a, wire(2)), hc = registry().add(&y, c, wire(1));
  CHECK(decode(ha).key != decode(hc).key);
  registry().forget(&x);
  for (int fd : a) CHECK(closed(fd));
  CHECK(!closed(c[0]) && registry().size() == 1);
  CHECK(child(hc, 1) == 0);
  CHECK(child(ha, 2, "no longer holds") == 3);
  std::vector<int> b = pages(1);
  registry().add(&z, b, wire(1));
  registry().forget_all();
  CHECK(closed(b[0]) && closed(c[0]) && registry().size() == 0);
  CHECK(child(hc, 1, "no longer holds") == 3);
""",
    "a_client_that_stalls_holds_up_no_other": r"""
  int x = 0;
  const std::string h = share(&x, 2);
  int stalled = socket(AF_UNIX, SOCK_STREAM, 0);
  auto [a, len] = address(registry().socket());
  CHECK(connect(stalled, reinterpret_cast<sockaddr*>(&a), len) == 0);  // and sends nothing
  // Answered while the stalled request still waits for its key (a server answering one
  // request at a time would make this one wait kKeySeconds first).
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(child(h, 2) == 0);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(kKeySeconds * 750));
  close(stalled);
  registry().forget(&x);
""",
    "a_handle_round_trips_and_foreign_or_cut_handles_are_refused": r"""
  Wire w;
  w.socket = "cudalloc-ipc-1-2";
  w.key = 99; w.device = 3; w.segment = 5; w.offset = 6; w.size = 7;
  w.page_sizes = {2 << 20, 40 << 20};
  const std::string h = encode(w);
  const Wire d = decode(h);
  CHECK(d.socket == w.socket && d.key == 99 && d.device == 3 && d.segment == 5);
  CHECK(d.offset == 6 && d.size == 7 && d.page_sizes == w.page_sizes);
  CHECK(!is_ours(std::string(64, 'r')));
  auto refused = [](const std::string& s, const char* why) {
    try { decode(s); } catch (const std::exception& e) {
      return std::string(e.what()).find(why) != std::string::npos;
    }
    return false;
  };
  CHECK(refused(std::string(64, 'r'), "not on cudalloc"));
  CHECK(refused(h.substr(0, h.size() - 3), "pages but holds fewer"));
  CHECK(refused(h.substr(0, 20), "ends early"));
""",
    "a_sender_that_is_gone_is_named": r"""
  Wire w = wire(1);
  w.socket = "cudalloc-ipc-nobody-listens-here";
  CHECK(child(encode(w), 1, "cannot be reached") == 3);
""",
}


class IpcTransport(unittest.TestCase):
    pass


add_cases(IpcTransport, "ipc.h", PRELUDE, CASES, EPILOGUE, timeout=120)

if __name__ == "__main__":
    unittest.main()
