"""Only here to declare the C extension; all metadata lives in pyproject.toml."""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kvrt.ipc._atomic", ["ipc/_atomic.c"], extra_compile_args=["-O2", "-std=c11"]),
        # XXH3_128bits comes from the xxhash package at import (dlsym): no xxhash header needed
        Extension("kvrt.runtime.cache._cache_core", ["runtime/cache/_cache_core.c"], libraries=["dl"],
                  extra_compile_args=["-O2", "-std=c11"]),
    ]
)
