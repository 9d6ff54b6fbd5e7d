"""Memory study: KV waste and sharing of the paged allocator vs Orca-style contiguous baselines,
replayed on synthetic ShareGPT- and Alpaca-like traces. Same as `pagedkv bench memory`.

    python benches/memory.py            # writes docs/memory.md and docs/memory/*.png
    python benches/memory.py --quick    # the short CI run (see --help for --out, --num-steps)
"""

import sys

from pagedkv.memory_study import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
