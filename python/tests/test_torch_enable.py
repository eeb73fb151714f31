"""Tests of cudalloc_torch.enable's config handling (no torch and no GPU needed).

The library reads ``CUDALLOC_CONF`` once per process, so each case runs in a fresh Python
process. They need ``libcudalloc_capi.so`` (``$CUDALLOC_LIB``, else the newer of
``debug`` and ``release`` in cargo's target directory, ``$CARGO_TARGET_DIR`` or ``target``),
which ``cargo test --workspace`` (CI's first step) or ``cargo build -p cudalloc-capi`` builds;
without it they are skipped, saying so.
"""

import os
import pathlib
import subprocess
import sys
import textwrap
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Cargo's target directory: $CARGO_TARGET_DIR when set (relative to the root), else target/.
TARGET = ROOT / os.environ.get("CARGO_TARGET_DIR", "target")
BUILT = [TARGET / kind / "libcudalloc_capi.so" for kind in ("debug", "release")]
# With CUDALLOC_TEST_INSTALLED set, the tests run against the package pip installed (its own
# library, unless $CUDALLOC_LIB names one) instead of this repository's python/ folder.
INSTALLED = bool(os.environ.get("CUDALLOC_TEST_INSTALLED"))


def _installed_library():
    import cudalloc_torch

    return cudalloc_torch.installed_library()


# $CUDALLOC_LIB when set, else the installed package's or the newer of the two builds.
LIB = pathlib.Path(os.environ.get("CUDALLOC_LIB") or _installed_library()) if INSTALLED else next(
    (pathlib.Path(p) for p in [os.environ.get("CUDALLOC_LIB")] if p),
    max((p for p in BUILT if p.exists()), key=lambda p: p.stat().st_mtime, default=None),
)


def run(script):
    """Runs ``script`` with cudalloc_torch importable and the library found; returns stdout."""
    env = dict(os.environ, CUDALLOC_LIB=str(LIB))
    if not INSTALLED:
        env["PYTHONPATH"] = str(ROOT / "python")
    env.pop("CUDALLOC_CONF", None)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0:
        raise AssertionError(f"exit {out.returncode}: {out.stderr}")
    return out.stdout


@unittest.skipIf(LIB is None, "libcudalloc_capi.so is not built (cargo build -p cudalloc-capi)")
class EnableConfig(unittest.TestCase):
    def test_a_conf_after_the_library_read_its_config_is_refused(self):
        out = run(
            """
            import cudalloc_torch as c
            try:
                c.device_count()  # reads the config (none), with or without a GPU
            except c.CudallocError:
                pass
            try:
                c.enable(conf="policy:torch")
                print("accepted")
            except c.CudallocError as e:
                print("refused:", e)
            """
        )
        self.assertIn("refused: cudalloc already read its config", out)
        self.assertIn("'policy:torch' would not take effect", out)

    def test_a_bad_conf_is_named_and_a_second_conf_is_refused(self):
        out = run(
            """
            import cudalloc_torch as c
            for conf in ["policy:bogus", "policy:torch"]:
                try:
                    c.enable(conf=conf)
                    print("accepted")
                except c.CudallocError as e:
                    print("refused:", e)
            """
        )
        first, second = out.splitlines()
        self.assertIn("bogus", first)
        self.assertIn("(CUDALLOC_CONF='policy:bogus')", second)


if __name__ == "__main__":
    unittest.main()
