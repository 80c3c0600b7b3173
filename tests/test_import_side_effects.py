"""Importing mf's packages changes nothing in the process (issue 53).

torch keeps process-wide hooks in module globals: every optimizer's step hooks,
every module's forward and backward hooks, and the registration hooks. A
library that fills them at import changes every model and optimizer of the
program that imports it, mf's or not. So the test imports every package and
public sub-module in a fresh interpreter (this one has imported them long ago)
and finds those tables as torch leaves them.

mf-fsdp registers its two global optimizer step hooks only when the first
engine is built: they bind an optimizer that was made on an engine's
parameters without ``fully_shard_optimizer`` at its first ``step()``, and no
other hook can see such an optimizer.
"""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = """
import importlib, json
import torch
from torch.nn.modules import module
from torch.optim import optimizer

def tables():
    names = [n for n in vars(module) if n.startswith("_global_") and n.endswith("hooks")]
    found = {n: len(getattr(module, n)) for n in names}
    found["_global_optimizer_pre_hooks"] = len(optimizer._global_optimizer_pre_hooks)
    found["_global_optimizer_post_hooks"] = len(optimizer._global_optimizer_post_hooks)
    return found

before = tables()
for name in %s:
    importlib.import_module(name)
print(json.dumps({"before": before, "after": tables()}))
"""

MODULES = [
    "mf_utils",
    "mf_rng",
    "mf_tp",
    "mf_dtensor",
    "mf_fsdp",
    "mf_fsdp.checkpoint",
    "mf_fsdp.planning",
    "mf_fsdp.optim",
    "mf_fsdp.config",
    "mf_fsdp.fsdp2",
    "mf",
    "mf.models",
]


def test_importing_every_package_registers_no_global_hook() -> None:
    probe = _PROBE % json.dumps(MODULES)
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    tables = json.loads(result.stdout.strip().splitlines()[-1])
    assert tables["before"]["_global_forward_hooks"] == 0, tables["before"]
    changed = {
        name: (tables["before"][name], count)
        for name, count in tables["after"].items()
        if count != tables["before"][name]
    }
    assert not changed, f"importing {MODULES} registered global hooks: {changed}"
