"""The wheel's tag: the package holds no Python extension module (the C library is loaded with
ctypes, the PyTorch extension is built on the user's machine), so one wheel serves every
Python 3 on its platform: ``py3-none-<platform>`` rather than the building interpreter's
``cp3X-cp3X``. Everything else is in ``pyproject.toml``."""

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel


class AnyPython3Wheel(bdist_wheel):
    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(cmdclass={"bdist_wheel": AnyPython3Wheel})
