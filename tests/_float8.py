"""The skip every float8 test takes where float8 training cannot run, with the reason why.

The reason is mf's own one-line refusal (``float8_unavailable``): torchao missing, or
no FP8 matmul on the CPU with this torch. CI installs torchao at both ends of the
torch range (the dev group takes ``mf[float8]``), and ``test_float8_extra`` fails if
it is missing there, so these skips cannot hide a broken install.
"""

from __future__ import annotations

import pytest
import torch

from mf.models.float8 import float8_unavailable

CPU_FLOAT8_PROBLEM = float8_unavailable(torch.device("cpu"))
needs_cpu_float8 = pytest.mark.skipif(
    CPU_FLOAT8_PROBLEM is not None, reason=f"float8 on the CPU: {CPU_FLOAT8_PROBLEM}"
)
