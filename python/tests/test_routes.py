"""The allocation routes of the PyTorch backend (``csrc/routes.h``), compiled with the system's
C++ compiler against a scripted capture state and run: no torch and no GPU needed. Each case
is a small C++ program that prints what it checks; the test fails if the header does not compile
(with warnings as errors) or a check fails. A machine without ``c++`` fails it, naming why."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(__file__))
from cxx_cases import add_cases  # noqa: E402


# A harness: streams are ints, pools pairs of ints; `captures[s]` is stream s's capture id
# (0: not captured), changed by each case as PyTorch and the driver would.
PRELUDE = r"""
#include "routes.h"
#include <cstdio>
#include <map>
#include <thread>
#include <utility>
using Pool = std::pair<unsigned long long, unsigned long long>;
std::map<int, unsigned long long> captures;
unsigned long long capture_of(int s) { return captures.count(s) ? captures[s] : 0; }
int fails = 0;
#define CHECK(c) do { if (!(c)) { std::printf("FAILED line %d: %s\n", __LINE__, #c); ++fails; } } while (0)
// A CUDAGraph's filter: streams in capture `id` (what torch's reads from its CUDAGraph).
std::function<bool(int)> graph_filter(unsigned long long id) {
  return [id](int s) { return id != 0 && capture_of(s) == id; };
}
int main() {
  cudalloc_torch::Routes<int, Pool> routes{capture_of};
  const Pool graph{1, 0}, pool{0, 7};
"""
EPILOGUE = r"""
  std::printf("fails %d\n", fails);
  return fails != 0;
}
"""

CASES = {
    # A capture that succeeds: another thread's call before the capture began keeps its
    # route; the route takes the capture's allocations and ends with endAllocateToPool.
    "another_threads_call_before_the_capture_keeps_the_route": r"""
  unsigned long long id = 0;
  auto filter = [&id](int s) { return id != 0 && capture_of(s) == id; };
  CHECK(routes.begin(0, graph, filter, 5));
  std::thread([&] { routes.prune(); }).join();
  CHECK(routes.size() == 1);
  captures[5] = 42; id = 42;          // cudaStreamBeginCapture on stream 5
  routes.prune();
  CHECK(routes.find(0, 5) == std::optional<Pool>(graph));
  CHECK(!routes.find(0, 6).has_value());
  captures[5] = 0;                     // cudaStreamEndCapture succeeded
  routes.end(0, graph);                // endAllocateToPool
  CHECK(routes.empty() && routes.size() == 0);
""",
    "a_failed_capture_drops_its_route_once_its_stream_leaves_it": r"""
  unsigned long long id = 0;
  auto filter = [&id](int s) { return id != 0 && capture_of(s) == id; };
  CHECK(routes.begin(0, graph, filter, 5));
  captures[5] = 42; id = 42;
  std::thread([&] { routes.prune(); }).join();  // seen captured by any thread: bound
  captures[5] = 0;                     // capture_end threw: no endAllocateToPool
  std::thread([&] { routes.prune(); }).join();  // another thread's next allocation
  CHECK(routes.empty());
  CHECK(!routes.has(0, graph));
  CHECK(routes.begin(0, graph, graph_filter(43), 5));  // the pool can be captured into again
""",
    "a_failed_capture_never_seen_is_dropped_at_its_threads_next_call": r"""
  CHECK(routes.begin(0, graph, graph_filter(0), 5));
  std::thread([&] { routes.prune(); }).join();  // other threads cannot tell: kept
  CHECK(routes.size() == 1);
  routes.prune();                      // the capture thread, after its capture failed
  CHECK(routes.empty());
""",
    "a_mem_pool_route_is_never_pruned": r"""
  const auto me = std::this_thread::get_id();
  CHECK(routes.begin(0, pool, [me](int) { return std::this_thread::get_id() == me; }, 0));
  routes.prune();
  std::thread([&] { routes.prune(); }).join();
  CHECK(routes.find(0, 3) == std::optional<Pool>(pool));
  CHECK(!routes.find(1, 3).has_value());  // another device
  routes.end(0, pool);
  CHECK(routes.empty());
""",
    "a_route_begun_inside_a_capture_ends_with_it": r"""
  captures[5] = 42;
  CHECK(routes.begin(0, pool, [](int) { return true; }, 5));  // use_mem_pool inside a capture
  routes.prune();
  CHECK(routes.size() == 1);
  captures[5] = 0;
  routes.prune();
  CHECK(routes.empty());
""",
    "the_innermost_route_takes_an_allocation_and_a_second_route_to_a_pool_is_refused": r"""
  CHECK(routes.begin(0, pool, [](int) { return true; }, 0));
  captures[5] = 42;
  CHECK(routes.begin(0, graph, graph_filter(42), 5));
  CHECK(!routes.begin(0, graph, graph_filter(42), 5));
  CHECK(routes.size() == 2);
  CHECK(routes.find(0, 5) == std::optional<Pool>(graph));
  CHECK(routes.find(0, 9) == std::optional<Pool>(pool));
""",
    # empty_cache holds back only for a capture's route, not for a use_mem_pool's.
    "only_a_captures_route_is_scoped": r"""
  const auto me = std::this_thread::get_id();
  CHECK(routes.begin(0, pool, [me](int) { return std::this_thread::get_id() == me; }, 0));
  CHECK(!routes.any_scoped());
  CHECK(routes.begin(0, graph, graph_filter(0), 5));  // capture_begin's route, before the capture
  CHECK(routes.any_scoped());
  routes.prune();                      // its capture failed to begin: dropped
  CHECK(!routes.any_scoped() && routes.size() == 1);
  captures[6] = 42;
  std::thread([&] { CHECK(routes.begin(0, Pool{0, 8}, [](int) { return true; }, 6)); }).join();
  CHECK(routes.any_scoped());          // a use_mem_pool begun inside a capture
  captures[6] = 0;
  routes.prune();
  CHECK(!routes.any_scoped() && routes.size() == 1);
""",
    # A capture's route stays scoped behind later routes and across other threads' calls, and
    # stops being so when its capture ends.
    "a_captures_route_behind_a_mem_pool_route_is_scoped_until_its_capture_ends": r"""
  captures[5] = 42;
  CHECK(routes.begin(0, graph, graph_filter(42), 5));
  std::thread([&] { CHECK(routes.begin(0, pool, [](int) { return true; }, 0)); }).join();
  std::thread([&] { routes.prune(); }).join();
  CHECK(routes.any_scoped() && routes.size() == 2);
  captures[5] = 0;                     // the capture ended (endAllocateToPool not yet called)
  std::thread([&] { routes.prune(); }).join();
  CHECK(!routes.any_scoped() && routes.size() == 1);
""",
    "end_ends_only_a_route_of_the_calling_thread": r"""
  // The capture's route was pruned by another thread before endAllocateToPool, and a route to
  // the same pool was begun meanwhile by a third thread: the capture thread's end leaves it.
  std::thread([&] { CHECK(routes.begin(0, graph, [](int) { return true; }, 8)); }).join();
  routes.end(0, graph);
  CHECK(routes.has(0, graph));
  CHECK(routes.begin(0, pool, [](int) { return true; }, 5));
  routes.end(0, pool);
  CHECK(!routes.has(0, pool) && routes.size() == 1);
""",
}


class RoutesRules(unittest.TestCase):
    pass


add_cases(RoutesRules, "routes.h", PRELUDE, CASES, EPILOGUE, timeout=60)

if __name__ == "__main__":
    unittest.main()
