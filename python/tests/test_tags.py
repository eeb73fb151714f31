"""cudalloc_torch's tags, sleep and wake through the C library (no torch and no GPU needed):
``with tag(...)`` sets the calling thread's tag in the library and nested blocks restore the
outer one, also when the block raises; another thread does not see it; bad names and lists are
``ValueError`` naming the tag; without a GPU, :func:`sleep`, :func:`wake` and :func:`tag_stats`
raise the library's "no CUDA device" error.

Each case runs in a fresh Python process against ``libcudalloc_capi.so`` (found as in
``test_torch_enable.py``); without it they are skipped, saying so.
"""

import unittest

from test_torch_enable import LIB, run


@unittest.skipIf(LIB is None, "libcudalloc_capi.so is not built (cargo build -p cudalloc-capi)")
class Tags(unittest.TestCase):
    def test_tag_blocks_nest_and_restore_the_outer_tag(self):
        out = run(
            """
            import cudalloc_torch as ct
            lib = ct.load()
            print("before", ct.current_tag(), lib.cudalloc_tag_depth())
            with ct.tag("weights") as t:
                print("outer", t, ct.current_tag(), lib.cudalloc_tag_depth())
                with ct.tag("kv"):
                    print("inner", ct.current_tag(), lib.cudalloc_tag_depth())
                print("restored", ct.current_tag(), lib.cudalloc_tag_depth())
                try:
                    with ct.tag("scratch"):
                        raise KeyError("boom")
                except KeyError:
                    pass
                print("after_raise", ct.current_tag(), lib.cudalloc_tag_depth())
            print("after", ct.current_tag(), lib.cudalloc_tag_depth())
            """
        )
        self.assertEqual(
            out.split("\n")[:6],
            [
                "before None 0",
                "outer weights weights 1",
                "inner kv 2",
                "restored weights 1",
                "after_raise weights 1",
                "after None 0",
            ],
        )

    def test_a_tag_belongs_to_the_thread_that_set_it(self):
        out = run(
            """
            import threading
            import cudalloc_torch as ct
            seen = []
            with ct.tag("weights"):
                t = threading.Thread(target=lambda: seen.append(ct.current_tag()))
                t.start()
                t.join()
                print("here", ct.current_tag(), "there", seen[0])
            """
        )
        self.assertEqual(out.strip(), "here weights there None")

    def test_bad_tags_and_lists_are_value_errors_naming_the_tag(self):
        out = run(
            """
            import cudalloc_torch as ct
            for bad in ["", "a,b", "x" * 300, "tab\\there", 7, "a\\x00b"]:
                try:
                    with ct.tag(bad):
                        print("accepted", bad)
                except ValueError as e:
                    print("refused", str(e)[-60:])
            print("depth", ct.load().cudalloc_tag_depth())
            for tags in [["weights", "a,b"], [3], None, ["tab\\there"], ["x" * 300]]:
                try:
                    ct.sleep(tags)
                except ValueError as e:
                    print("list", str(e)[:40])
            for call in (lambda: ct.wake(["x" * 300]), lambda: ct.sleep(["w"], offload=["a\\nb"])):
                try:
                    call()
                except ValueError as e:
                    print("list", str(e)[:40])
            """
        )
        lines = out.splitlines()
        refused = [l for l in lines if l.startswith("refused")]
        self.assertEqual(len(refused), 6, out)
        self.assertIn("comma", refused[1])
        self.assertIn("255 bytes", refused[2])
        self.assertIn("control", refused[3])
        self.assertIn("control", refused[5])  # a NUL is refused, not cut short
        self.assertIn("depth 0", lines)
        lists = [l for l in lines if l.startswith("list")]
        self.assertEqual(len(lists), 7, out)
        self.assertIn("'a,b'", lists[0])

    def test_without_a_gpu_sleep_wake_and_stats_say_why(self):
        out = run(
            """
            import cudalloc_torch as ct
            try:
                n = ct.device_count()
            except ct.CudallocError:
                n = 0
            if n:
                print("gpu")
            else:
                for call in (lambda: ct.sleep(["weights", "kv"], offload=["weights"]),
                             lambda: ct.wake("weights"),
                             ct.tag_stats,
                             ct.release_host_buffers):
                    try:
                        call()
                        print("ok")
                    except ct.CudallocError as e:
                        print(type(e).__name__, "no CUDA device" in str(e))
            """
        )
        if out.strip() == "gpu":
            self.skipTest("a GPU is present: the no-GPU errors do not apply")
        self.assertEqual(out.split(), ["CudallocError", "True"] * 4, out)


if __name__ == "__main__":
    unittest.main()
