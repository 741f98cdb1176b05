"""The compiled parts of the package (everything else is in pyproject.toml).

C++17 through CPython's C API alone: building needs Python's headers and a C++ compiler,
nothing from the network, so `pip install --no-build-isolation --no-deps -e .` builds it
offline from what is installed.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "cache_service.index._compiled",
            sources=["cache_service/index/csrc/module.cpp"],
            depends=[
                f"cache_service/index/csrc/{name}.hpp"
                for name in ("chain_keys", "key_table", "trie", "walk")
            ],
            language="c++",
            extra_compile_args=["-std=c++17", "-O2"],
        ),
        Extension(
            "cache_service._native",
            sources=["cache_service/csrc/native.cpp"],
            depends=[
                "cache_service/csrc/blake2b.hpp",
                "cache_service/csrc/match_wire.hpp",
                "cache_service/csrc/msgpack_scan.hpp",
            ],
            language="c++",
            extra_compile_args=["-std=c++17", "-O3"],
        ),
        Extension(
            "workers.cache._walk",
            sources=["workers/cache/csrc/walk.cpp"],
            language="c++",
            extra_compile_args=["-std=c++17", "-O2"],
        ),
    ]
)
