"""Compiling the kernels with NVRTC directly (ctypes), without CuPy or a GPU.

CI has no GPU, but PyPI's `nvidia-cuda-nvrtc` wheel (a torch dependency) carries NVRTC, so
every kernel instantiation is compiled to a CUBIN for real architectures: a kernel that does
not compile, or does not fit the hardware's limits, fails CI.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pagedkv.errors import PagedKVError
from pagedkv.kernels import sources


class KernelCompileError(PagedKVError):
    """NVRTC rejected a kernel source; the message carries the compiler log."""


def find_nvrtc() -> Path:
    """libnvrtc from the nvidia-cuda-nvrtc wheel (cu13 or cu12 layout) or the system."""
    roots = [Path(p) for p in sys.path if p and Path(p, "nvidia").is_dir()]
    patterns = ["nvidia/cu13/lib/libnvrtc.so.*", "nvidia/cuda_nvrtc/lib/libnvrtc.so.*"]
    for root in roots:
        for pattern in patterns:
            for candidate in sorted(glob.glob(str(root / pattern))):
                if "builtins" not in candidate and "alt" not in candidate:
                    return Path(candidate)
    for directory in os.environ.get("LD_LIBRARY_PATH", "").split(":") + ["/usr/local/cuda/lib64"]:
        for candidate in sorted(glob.glob(os.path.join(directory, "libnvrtc.so*"))):
            return Path(candidate)
    raise FileNotFoundError("libnvrtc not found: install nvidia-cuda-nvrtc (it comes with torch's CUDA wheels)")


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    library = ctypes.CDLL(str(find_nvrtc()))
    library.nvrtcGetErrorString.restype = ctypes.c_char_p
    return library


def nvrtc_version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(_library().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _check(status: int, what: str) -> None:
    if status != 0:
        raise KernelCompileError(f"{what} failed: {_library().nvrtcGetErrorString(status).decode()}")


def compile_to_cubin(source: str, name: str, name_expressions: list[str], options: list[str]) -> dict[str, str]:
    """Compiles `source` with every template instantiation in `name_expressions`.

    Returns each expression's lowered (mangled) name; raises KernelCompileError with the log.
    The CUBIN itself is discarded: this is a build check.
    """
    nvrtc = _library()
    program = ctypes.c_void_p()
    _check(
        nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        for expression in name_expressions:
            _check(nvrtc.nvrtcAddNameExpression(program, expression.encode()), f"adding {expression}")
        encoded = [option.encode() for option in options]
        status = nvrtc.nvrtcCompileProgram(program, len(encoded), (ctypes.c_char_p * len(encoded))(*encoded))
        if status != 0:
            raise KernelCompileError(f"{name} ({' '.join(options)}) failed to compile:\n{_log(program)}")
        size = ctypes.c_size_t()
        _check(nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        if size.value == 0:
            raise KernelCompileError(f"{name}: NVRTC produced an empty CUBIN for {options}")
        lowered = {}
        for expression in name_expressions:
            mangled = ctypes.c_char_p()
            _check(nvrtc.nvrtcGetLoweredName(program, expression.encode(), ctypes.byref(mangled)), "lowered name")
            lowered[expression] = mangled.value.decode()
        return lowered
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


def compile_instantiations(instantiations: dict[str, list[str]], arch: str) -> dict[str, str]:
    """Compiles each source's template instantiations for `arch` (e.g. "sm_90"), two programs at a
    time, the big attention source cut into programs of 80; returns every expression's lowered name."""
    options = [f"--gpu-architecture={arch}", f"-I{sources.cuda_source_dir()}", *sources.COMPILE_OPTIONS]
    chunks = [(source, expressions[begin : begin + 80])
              for source, expressions in instantiations.items() for begin in range(0, len(expressions), 80)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = pool.map(lambda chunk: compile_to_cubin(sources.read_source(chunk[0]), chunk[0], chunk[1], options),
                           chunks)
        return {expression: name for result in results for expression, name in result.items()}


def compile_key(arch: str) -> str:
    """What a whole compile for `arch` vouches for: these sources (headers included), this NVRTC,
    these options and instantiations."""
    facts = [sources.digest(), list(nvrtc_version()), arch, list(sources.COMPILE_OPTIONS),
             sorted(e for expressions in sources.all_instantiations().values() for e in expressions)]
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:16]


def _log(program) -> str:
    nvrtc = _library()
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    buffer = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, buffer)
    return buffer.value.decode(errors="replace")
