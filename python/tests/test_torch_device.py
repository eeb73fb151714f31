"""cudalloc_torch's memory functions act on PyTorch's current device, as ``torch.cuda``'s do
(no torch, no GPU and no library needed: a fake torch module and a fake library stand in)."""

import json
import os
import pathlib
import sys
import types
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if not os.environ.get("CUDALLOC_TEST_INSTALLED"):  # else: the package pip installed
    sys.path.insert(0, str(ROOT / "python"))

import cudalloc_torch  # noqa: E402


class FakeLib:
    """Stands in for libcudalloc_capi.so: remembers which device each call was for."""

    def __init__(self):
        self.devices = []

    def _json(self, device, buf, size):
        self.devices.append(device)
        text = json.dumps({"device": device}).encode()
        buf.raw = text + b"\0" * (size - len(text))
        return len(text)

    cudalloc_stats_json = _json
    cudalloc_snapshot_json = _json

    def cudalloc_reset_peak_stats(self, device):
        self.devices.append(device)
        return 0

    def cudalloc_set_memory_fraction(self, fraction, device):
        self.devices.append(device)
        return 0

    def cudalloc_empty_cache(self, device):
        self.devices.append(device)
        return 0

    def cudalloc_record_stream(self, ptr, device, stream):
        self.devices.append(device)
        return 0


def fake_torch(initialized, current):
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(
        is_initialized=lambda: initialized, current_device=lambda: current
    )
    return torch


class CurrentDeviceTest(unittest.TestCase):
    def setUp(self):
        self.saved = (sys.modules.get("torch"), cudalloc_torch._lib, cudalloc_torch._lib_path)
        self.lib = FakeLib()
        cudalloc_torch._lib, cudalloc_torch._lib_path = self.lib, "fake"

    def tearDown(self):
        torch, cudalloc_torch._lib, cudalloc_torch._lib_path = self.saved
        if torch is None:
            sys.modules.pop("torch", None)
        else:
            sys.modules["torch"] = torch

    def calls(self):
        cudalloc_torch.memory_stats()
        self.assertEqual(cudalloc_torch.snapshot(), {"device": self.lib.devices[-1]})
        cudalloc_torch.stats()
        cudalloc_torch.reset_peak_memory_stats()
        cudalloc_torch.set_memory_fraction(0.5)
        return self.lib.devices

    def test_after_set_device_the_functions_act_on_that_device(self):
        sys.modules["torch"] = fake_torch(initialized=True, current=3)
        self.assertEqual(self.calls(), [3] * 5)

    def test_before_cuda_is_initialised_device_0_and_cuda_is_left_alone(self):
        torch = fake_torch(initialized=False, current=3)
        torch.cuda.current_device = lambda: self.fail("current_device would initialise CUDA")
        sys.modules["torch"] = torch
        self.assertEqual(self.calls(), [0] * 5)

    def test_without_torch_device_0(self):
        sys.modules.pop("torch", None)
        self.assertEqual(self.calls(), [0] * 5)
        self.assertNotIn("torch", sys.modules, "torch was imported")

    def test_devices_are_taken_as_torch_cuda_takes_them(self):
        sys.modules["torch"] = fake_torch(initialized=True, current=3)
        device = types.SimpleNamespace  # stands in for torch.device: .type and .index
        cases = [
            (2, 2),
            ("cuda:1", 1),
            ("cuda", 3),
            (device(type="cuda", index=4), 4),
            (device(type="cuda", index=None), 3),
        ]
        for given, want in cases:
            self.assertEqual(cudalloc_torch.current_device(given), want, given)
        for bad in ["cpu", "cuda:x", device(type="cpu", index=0), 1.5, True]:
            with self.assertRaises(ValueError, msg=repr(bad)):
                cudalloc_torch.current_device(bad)
        cudalloc_torch.memory_stats("cuda:1")
        self.assertEqual(self.lib.devices, [1])

    def test_a_device_given_wins(self):
        sys.modules["torch"] = fake_torch(initialized=True, current=3)
        cudalloc_torch.memory_stats(1)
        cudalloc_torch.set_memory_fraction(0.5, device=2)
        self.assertEqual(self.lib.devices, [1, 2])

    def test_empty_cache_takes_a_device_as_the_others(self):
        sys.modules["torch"] = fake_torch(initialized=True, current=3)
        cudalloc_torch.empty_cache("cuda:1")
        cudalloc_torch.empty_cache(types.SimpleNamespace(type="cuda", index=2))
        self.assertEqual(self.lib.devices, [1, 2])

    def test_record_stream_refuses_a_stream_of_another_device(self):
        tensor = types.SimpleNamespace(
            device=types.SimpleNamespace(type="cuda", index=0),
            untyped_storage=lambda: types.SimpleNamespace(data_ptr=lambda: 4096),
        )
        same = types.SimpleNamespace(device=tensor.device, cuda_stream=7)
        other = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda", index=1), cuda_stream=9)
        cudalloc_torch.record_stream(tensor, same)
        self.assertEqual(self.lib.devices, [0])
        with self.assertRaisesRegex(cudalloc_torch.CudallocError, "the stream is on"):
            cudalloc_torch.record_stream(tensor, other)
        self.assertEqual(self.lib.devices, [0], "nothing reached the library")


if __name__ == "__main__":
    unittest.main()
