"""pagedkv's CUDA kernels (cuda/*.cu): paged attention, cache writes and block copies.

Compiled by NVRTC through CuPy and launched on torch's current stream; see docs/kernels.md.
"""

from pagedkv.kernels.launchers import CupyLauncher, EmulatorLauncher
from pagedkv.kernels.ops import UnsupportedKernelError, copy_blocks, paged_attention, reshape_and_cache, swap_blocks

__all__ = [
    "CupyLauncher",
    "EmulatorLauncher",
    "UnsupportedKernelError",
    "copy_blocks",
    "paged_attention",
    "reshape_and_cache",
    "swap_blocks",
]
