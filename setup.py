"""Only here for cffi: setuptools builds the native CPU-Adam extension (zfctl._zfnative) from
native/*.c when a wheel is built or the package is installed. Everything else is pyproject.toml.
"""

from setuptools import setup

setup(cffi_modules=["native/build.py:ffibuilder"])
