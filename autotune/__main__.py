"""``python -m dspark_kernels.autotune``: sweep the Triton ops' launch configs on this GPU (see :mod:`.tune`)."""

import sys

from .tune import main

if __name__ == "__main__":
    sys.exit(main())
