"""Launchers: how a kernel named by (source file, name expression) runs.

`CupyLauncher` compiles with NVRTC through `cupy.RawModule` (once per process and kernel; CuPy
also caches on disk) and launches on torch's current CUDA stream. `EmulatorLauncher` builds
the same sources as host C++ against cuda/emu/cuda_emu.h and runs them on CPU tensors: slow,
but it lets CI check the kernels' results without a GPU.

Arguments are numpy scalars whose dtype is the C parameter's type: np.uint64 for pointers,
np.int64 for long long, np.int32 for int, np.float32 for float.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from pagedkv.kernels import sources

logger = logging.getLogger("pagedkv.kernels")


def pointer(tensor: torch.Tensor) -> np.uint64:
    return np.uint64(tensor.data_ptr())


class CupyLauncher:
    """Runs kernels on the GPU through CuPy, on torch's current stream."""

    def __init__(self, device: torch.device | None = None):
        import cupy  # noqa: F401  (fail early with ImportError when CuPy is missing)

        self.device = torch.device(device or "cuda")
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def _function(source: str, expression: str):
        import cupy

        # CuPy's disk cache keys on the source text and options, not on included headers: the
        # digest of every source file makes a changed header a new key.
        include, key = f"-I{sources.cuda_source_dir()}", f"-DPAGEDKV_SOURCES={sources.digest()}"
        options = (*sources.COMPILE_OPTIONS, include, key)
        module = cupy.RawModule(code=sources.read_source(source), options=options, name_expressions=[expression])
        logger.info("compiled %s", expression)
        return module.get_function(expression)

    def launch(self, source: str, expression: str, grid, block, shared_bytes: int, args) -> None:
        import cupy

        function = self._function(source, expression)
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(self.device).cuda_stream)
        with cupy.cuda.Device(self.device.index or 0), stream:
            function(tuple(grid), tuple(block), tuple(args), shared_mem=shared_bytes)


_CTYPES = {np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.int64): ctypes.c_int64,
           np.dtype(np.int32): ctypes.c_int32, np.dtype(np.float32): ctypes.c_float}


class EmulatorLauncher:
    """Runs kernels on the CPU (CPU tensors) through the CUDA emulator; needs g++ >= 11."""

    num_sms = 4  # what the automatic split-K choice assumes

    def __init__(self, build_dir: str | Path | None = None, compiler: str = "g++"):
        self.build_dir = Path(build_dir or Path(tempfile.gettempdir()) / "pagedkv-emulator")
        self.compiler = compiler
        self._libraries: dict[frozenset, ctypes.CDLL] = {}
        self._expressions: set[tuple[str, str]] = set()

    def prepare(self, kernels: list[tuple[str, str]]) -> None:
        """Builds one library for many kernels at once (a build takes seconds)."""
        self._expressions.update(kernels)
        self._library()

    def _library(self) -> ctypes.CDLL:
        key = frozenset(self._expressions)
        if key not in self._libraries:
            self._libraries[key] = self._build(sorted(key))
        return self._libraries[key]

    def _build(self, kernels: list[tuple[str, str]]) -> ctypes.CDLL:
        cuda_dir = sources.cuda_source_dir()
        files = sorted({source for source, _ in kernels})
        lines = [f'#include "{name}"' for name in files] + ['#include "emu/harness.h"', ""]
        lines.append('extern "C" int emu_launch(const char* kernel_name, unsigned gx, unsigned gy, unsigned gz,')
        lines.append("    unsigned bx, unsigned by, unsigned bz, unsigned long shared_bytes, void** args) {")
        lines.append("  const std::string name(kernel_name);")
        lines.append("  const dim3 grid{gx, gy, gz}, block{bx, by, bz};")
        for _, expression in kernels:
            lines.append(f'  if (name == "{expression}") {{')
            lines.append(f"    return emu::launch_kernel(&{expression}, grid, block, shared_bytes, args) ? 0 : 2;")
            lines.append("  }")
        lines += ["  return -1;", "}", ""]
        program = "\n".join(lines)
        flags = ["-std=c++20", "-O2", "-fno-strict-aliasing", "-shared", "-fPIC", "-pthread", "-w", "-U_FORTIFY_SOURCE", "-DPAGEDKV_EMULATION"]
        digest = hashlib.sha256((program + " ".join(flags) + sources.digest()).encode()).hexdigest()
        self.build_dir.mkdir(parents=True, exist_ok=True)
        library = self.build_dir / f"emu-{digest[:16]}.so"
        if not library.exists():
            cpp = library.with_suffix(".cpp")
            cpp.write_text(program)
            # The kernels type-pun through 16-byte vectors as CUDA code does: no strict aliasing.
            command = [self.compiler, *flags, f"-I{cuda_dir}", str(cpp), "-o", str(library) + ".tmp"]
            logger.info("building the kernel emulator: %s", " ".join(command))
            subprocess.run(command, check=True, capture_output=True, text=True)
            Path(str(library) + ".tmp").rename(library)
        loaded = ctypes.CDLL(str(library))
        loaded.emu_launch.restype = ctypes.c_int
        return loaded

    def launch(self, source: str, expression: str, grid, block, shared_bytes: int, args) -> None:
        if (source, expression) not in self._expressions:
            self._expressions.add((source, expression))
        values = [_CTYPES[np.asarray(arg).dtype](arg.item()) for arg in args]
        pointers = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        status = self._library().emu_launch(expression.encode(), *grid, *block, ctypes.c_ulong(shared_bytes), pointers)
        if status == 2:
            raise RuntimeError(f"{expression}: the threads of a CTA deadlocked at barriers (divergent __syncthreads or shuffles)")
        if status != 0:
            raise RuntimeError(f"the emulator library has no kernel {expression}")
