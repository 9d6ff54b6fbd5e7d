"""Compiles every CUDA kernel instantiation with NVRTC for sm_90 (no GPU needed) and, when all
compile, writes tests/kernels/compiled_kernels.json: the key of what compiled (sources with their
headers, NVRTC version, options, instantiations). While the key holds, CI's compile test compiles
one instantiation per source instead of all of them (~6 minutes on 2 cores). Run it after changing
anything under cuda/ or the instantiation lists, and commit the record with the change:

    python scripts/compile_kernels.py
"""

import json
import sys
import time
from pathlib import Path

from pagedkv.kernels import nvrtc, sources

RECORD = Path(__file__).resolve().parents[1] / "tests" / "kernels" / "compiled_kernels.json"
ARCH = "sm_90"


def main() -> int:
    instantiations = sources.all_instantiations()
    count = sum(len(expressions) for expressions in instantiations.values())
    print(f"compiling {count} instantiations of {len(instantiations)} sources for {ARCH} "
          f"(NVRTC {'.'.join(map(str, nvrtc.nvrtc_version()))})...", flush=True)
    started = time.perf_counter()
    lowered = nvrtc.compile_instantiations(instantiations, ARCH)
    missing = [e for expressions in instantiations.values() for e in expressions if not lowered.get(e)]
    if missing:
        print(f"{len(missing)} instantiations produced no kernel, e.g. {missing[0]}", file=sys.stderr)
        return 1
    RECORD.write_text(json.dumps({ARCH: nvrtc.compile_key(ARCH)}, indent=1) + "\n")
    print(f"all compiled in {time.perf_counter() - started:.0f} s; wrote {RECORD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
