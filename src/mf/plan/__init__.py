"""``mf-plan``: will a model fit on N GPUs, and how should it be sharded? Answered before a run.

The room owns the planner: it builds mf's real engine for the planned run on the
meta device at the planned world size (torch's fake process group stands in for
the cluster) and reads what each rank would hold, so padding, buckets and the
gathered units are the engine's own, not a formula's. It imports mf-train's setup
(the mesh, the model sources, the sharding call) and never the reverse: mf-train
does not know the planner exists. Its modules, one job each::

    devices      named accelerators: memory, peak FLOP/s, link bandwidths
    inputs       the command line of mf-plan and its checks (one line per mistake)
    meta_model   the planned model on the meta device: a preset, or a folder's config.json
    fake_world   torch's fake process group of N ranks, for the length of a plan
    model_state  the engine built at world N: parameter, gradient and optimizer bytes per rank
    activations  one micro-batch's forward and backward on fake tensors under MemTracker
    phases       bytes per rank after the wrap, at the forward and backward peaks, at the step
    wire         the step's collectives per rank, from the engine's buckets, against the minimum
    step_time    an estimate of a step from the device's figures and the engine's overlap
    search       the mf-train configurations that fit, best first (``--search``)
    report       the plan as a table for people and as JSON for tools
    search_report  --search's answer: a table and ready mf-train command lines
    cli          ``mf-plan``: inputs -> plan -> report, exit 2 on bad input
"""

from mf.plan.activations import Activations, plan_activations
from mf.plan.model_state import OPTIMIZER_STATES, ModelState, plan_model_state
from mf.plan.phases import PhaseBytes, plan_phases

__all__ = [
    "OPTIMIZER_STATES",
    "Activations",
    "ModelState",
    "PhaseBytes",
    "plan_activations",
    "plan_model_state",
    "plan_phases",
]
