"""C++ test cases of a header of the PyTorch backend (``cudalloc_torch/csrc``) that needs no torch
and no CUDA: each case is a program (a prelude, the case's body, an epilogue) compiled with the
system's C++ compiler, warnings as errors, and run; it passes when it exits 0 printing
``fails 0``. A machine without ``c++`` fails the case, naming why. Used by ``test_routes.py``
and ``test_ipc.py``."""

import os
import shutil
import subprocess
import tempfile

CSRC = os.path.join(os.path.dirname(__file__), "..", "cudalloc_torch", "csrc")


def add_cases(cls, header, prelude, cases, epilogue, timeout=120):
    """Gives ``cls`` (a ``unittest.TestCase``) a ``test_<name>`` for each case of ``cases``
    (name -> body), which builds ``prelude + body + epilogue`` against ``csrc/`` and runs it."""

    def run_case(self, name, body):
        cxx = shutil.which("c++") or shutil.which("g++")
        self.assertIsNotNone(cxx, f"no C++ compiler (c++ or g++) to build csrc/{header} with")
        with tempfile.TemporaryDirectory() as d:
            src, exe = os.path.join(d, f"{name}.cpp"), os.path.join(d, name)
            with open(src, "w") as f:
                f.write(prelude + body + epilogue)
            build = subprocess.run(
                [cxx, "-std=c++17", "-Wall", "-Wextra", "-Werror", "-pthread", "-I", CSRC, src,
                 "-o", exe], capture_output=True, text=True)
            self.assertEqual(build.returncode, 0, build.stderr[-3000:])
            run = subprocess.run([exe], capture_output=True, text=True, timeout=timeout)
            self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
            self.assertIn("fails 0", run.stdout)

    for name, body in cases.items():
        setattr(cls, f"test_{name}", lambda self, n=name, b=body: run_case(self, n, b))
