"""The same bits from the same command on a CPU, so that a resumed run equals the uninterrupted one.

torch's CPU GEMMs run in MKL, which by default picks code paths by the alignment of each buffer and may use fewer
threads than asked while the machine is busy; either changes how a dot product is split, and so its last bits.
`pin_cpu_numerics` asks MKL for conditional numerical reproducibility (MKL_CBWR=AUTO: the fastest code path of this
CPU, whatever the alignment) and for exactly the threads it is given (MKL_DYNAMIC=FALSE). It only sets what the
user has not, and must run before MKL's first call: `import lowbit` does it, so the CLI and torchrun's workers
start with it. torch's own CPU kernels split work by their thread count, which is fixed for a machine (the
number of physical cores, or OMP_NUM_THREADS): the same machine and thread count give the same bits.
"""

from __future__ import annotations

import os

SETTINGS = {"MKL_CBWR": "AUTO", "MKL_DYNAMIC": "FALSE"}


def pin_cpu_numerics() -> dict[str, str]:
    """Set each of SETTINGS the environment does not set already; returns the values in effect."""
    for key, value in SETTINGS.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in SETTINGS}
