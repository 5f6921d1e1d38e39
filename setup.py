"""Only here to declare the C extension; all metadata lives in pyproject.toml."""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("ipc._atomic", ["ipc/_atomic.c"], extra_compile_args=["-O2", "-std=c11"]),
        Extension("runtime._cache_core", ["runtime/_cache_core.c"],  # xxhash.h: Debian libxxhash-dev
                  extra_compile_args=["-O2", "-std=c11"]),
    ]
)
