"""Tests of how cudalloc_torch chooses its PyTorch backend (the C++ extension or the pluggable
fallback), with a stand-in for torch: no torch, GPU or compiler needed. What the extension does
on a GPU is checked by ``python/acceptance/run.py`` on the GPU machine.
"""

import ctypes
import re
import os
import pathlib
import sys
import types
import unittest
import warnings

if not os.environ.get("CUDALLOC_TEST_INSTALLED"):  # else: the package pip installed
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import cudalloc_torch  # noqa: E402
from cudalloc_torch import _backend  # noqa: E402

from test_torch_enable import LIB  # noqa: E402


def fake_torch(version, builds=True):
    """A stand-in for torch with what the backend choice touches."""
    made = []

    class Pluggable:
        def __init__(self, path, alloc, free):
            made.append(("pluggable", path, alloc, free))

    class Wrapped:
        def __init__(self, obj):
            made.append(("extension", obj))

    memory = types.SimpleNamespace(CUDAPluggableAllocator=Pluggable, _CUDAAllocator=Wrapped)
    torch = types.SimpleNamespace(__version__=version, cuda=types.SimpleNamespace(memory=memory))
    torch.made = made
    torch.builds = builds
    return torch


class FakeModule:
    def __init__(self):
        self.registered = 0

    def make_allocator(self, addresses):
        return ("allocator over", sorted(addresses))

    def register_device_allocator(self):
        self.registered += 1


class BackendChoice(unittest.TestCase):
    def setUp(self):
        self.real_build = _backend.build

        def build(torch, verbose=False):
            if not torch.builds:
                raise _backend.BuildError("building cudalloc's PyTorch extension failed: g++: not found")
            return FakeModule()

        _backend.build = build
        self.lib = types.SimpleNamespace(**{name: ctypes.CFUNCTYPE(None)(lambda: None) for name in _backend.FUNCTIONS})

    def tearDown(self):
        _backend.build = self.real_build

    def choose(self, torch, backend):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            chosen, _ = cudalloc_torch._make_allocator(torch, self.lib, backend)
        return chosen, [str(w.message) for w in caught]

    def test_a_tested_version_gets_the_extension_without_a_warning(self):
        torch = fake_torch("2.11.0+cu130")
        self.assertEqual(self.choose(torch, "auto"), ("extension", []))
        kind, (label, names) = torch.made[0]
        self.assertEqual(kind, "extension")
        self.assertEqual(names, sorted(_backend.FUNCTIONS))

    def test_an_untested_version_falls_back_and_says_what_is_lost(self):
        chosen, warned = self.choose(fake_torch("2.7.1"), "auto")
        self.assertEqual(chosen, "pluggable")
        self.assertEqual(len(warned), 1)
        self.assertIn("torch 2.7.1 is not a version", warned[0])
        self.assertIn("2.11", warned[0])
        self.assertIn("record_stream", warned[0])
        self.assertIn("OutOfMemoryError", warned[0])

    def test_a_forced_extension_is_tried_on_any_version(self):
        self.assertEqual(self.choose(fake_torch("2.7.1"), "extension")[0], "extension")

    def test_a_failed_build_falls_back_with_the_compiler_message(self):
        chosen, warned = self.choose(fake_torch("2.11.0", builds=False), "auto")
        self.assertEqual(chosen, "pluggable")
        self.assertIn("g++: not found", warned[0])

    def test_a_failed_build_of_a_forced_extension_is_an_error(self):
        with self.assertRaises(cudalloc_torch.CudallocError) as e:
            self.choose(fake_torch("2.11.0", builds=False), "extension")
        self.assertIn("g++: not found", str(e.exception))

    def test_pluggable_never_builds(self):
        _backend.build = None  # calling it would fail
        torch = fake_torch("2.11.0")
        self.assertEqual(self.choose(torch, "pluggable"), ("pluggable", []))
        self.assertEqual(torch.made[0][2:], ("cudalloc_malloc", "cudalloc_free"))


class DeviceAllocatorRegistration(unittest.TestCase):
    """The extension's allocator becomes c10's CUDA allocator too (torch.accelerator's memory
    functions read that one), only once make_allocator made it; a failure is a warning."""

    def setUp(self):
        self.real_build, self.real_made = _backend.build, _backend._made
        self.module = FakeModule()
        _backend.build = lambda torch, verbose=False: self.module
        _backend._made = None
        self.lib = types.SimpleNamespace(**{name: ctypes.CFUNCTYPE(None)(lambda: None) for name in _backend.FUNCTIONS})

    def tearDown(self):
        _backend.build, _backend._made = self.real_build, self.real_made

    def test_registration_needs_the_allocator_made_first(self):
        with self.assertRaises(_backend.BuildError):
            _backend.register_device_allocator()
        _backend.make_allocator(fake_torch("2.11.0"), self.lib)
        _backend.register_device_allocator()
        self.assertEqual(self.module.registered, 1)

    def test_a_failed_registration_warns_and_names_torch_accelerator(self):
        def refuse():
            raise RuntimeError("no register_device_allocator in this build")

        self.module.register_device_allocator = refuse
        _backend.make_allocator(fake_torch("2.11.0"), self.lib)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cudalloc_torch._register_device_allocator()
        self.assertEqual(len(caught), 1)
        self.assertIn("torch.accelerator", str(caught[0].message))
        self.assertIn("no register_device_allocator", str(caught[0].message))


class Versions(unittest.TestCase):
    def test_major_minor(self):
        self.assertEqual(_backend.torch_minor("2.11.0+cu130"), "2.11")
        self.assertEqual(_backend.torch_minor("2.12.0.dev20261101"), "2.12")
        self.assertIsNone(_backend.torch_minor("nightly"))

    def test_the_build_name_carries_the_version_and_the_source(self):
        name = _backend.extension_name(fake_torch("2.11.0+cu130"))
        self.assertRegex(name, r"^cudalloc_backend_2_11_0_cu130_[0-9a-f]{12}$")
        self.assertTrue(name.endswith(_backend.source_hash()))

    def test_every_header_of_the_source_is_in_the_hash(self):
        # A header backend.cpp includes but the hash leaves out would leave a stale build.
        with open(_backend.SOURCE) as f:
            included = set(re.findall(r'#include "([^"]+)"', f.read()))
        self.assertEqual(included, set(_backend.HEADERS))

    def test_an_unknown_backend_is_refused_by_name(self):
        with self.assertRaises(ValueError) as e:
            cudalloc_torch.enable(backend="cuda-graphs")
        self.assertIn("'cuda-graphs'", str(e.exception))


@unittest.skipIf(LIB is None, "libcudalloc_capi.so is not built (cargo build -p cudalloc-capi)")
class LibraryExports(unittest.TestCase):
    def test_the_library_exports_every_function_the_extension_calls(self):
        lib = ctypes.CDLL(str(LIB))
        addresses = _backend.addresses(lib)
        self.assertEqual(set(addresses), set(_backend.FUNCTIONS))
        self.assertTrue(all(addresses.values()))

    def test_the_extension_source_names_the_same_functions(self):
        source = pathlib.Path(_backend.SOURCE).read_text()
        for name in _backend.FUNCTIONS:
            self.assertIn(f'"{name}"', source, name)


if __name__ == "__main__":
    unittest.main()
