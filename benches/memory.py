"""Memory study: KV waste and sharing of the paged allocator vs Orca-style contiguous baselines,
replayed on synthetic ShareGPT- and Alpaca-like traces (the study lives in studies/memory_study,
outside the installed package).

    python benches/memory.py            # writes docs/memory.md and docs/memory/*.png
    python benches/memory.py --quick    # the short CI run (see --help for --out, --num-steps)
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "studies"))
from memory_study import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
