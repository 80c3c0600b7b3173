"""mf_rng: model-parallel RNG state tracking and activation recomputation, on any device.

- :mod:`mf_rng.device_state`: get, set and seed a device's default generator
  (CPU or accelerator; graph-safe where the generator supports it).
- :mod:`mf_rng.tracker`: :class:`RNGStatesTracker`, named states entered with
  ``fork(name)``; the inference no-op tracker; the tracker-name getters.
- :mod:`mf_rng.default_tracker`: the process-wide tracker and its swap context.
- :mod:`mf_rng.seeding`: :func:`model_parallel_cuda_manual_seed` and the
  registry of process groups that supply the default ranks.
- :mod:`mf_rng.checkpoint`: :func:`checkpoint` and :class:`CheckpointWithoutOutput`.
"""

from mf_rng.checkpoint import CheckpointWithoutOutput, checkpoint
from mf_rng.default_tracker import (
    get_all_rng_states,
    get_cuda_rng_tracker,
    get_rng_tracker,
    initialize_rng_tracker,
    use_rng_tracker,
)
from mf_rng.device_state import RNGState, get_rng_state, set_rng_state, supports_graph_safe_rng
from mf_rng.seeding import (
    ParallelAxis,
    model_parallel_cuda_manual_seed,
    model_parallel_manual_seed,
    register_model_parallel_group,
    registered_model_parallel_rank,
)
from mf_rng.tracker import (
    CudaRNGStatesTracker,
    InferenceRNGStatesTracker,
    RNGStatesTracker,
    RNGTracker,
    get_context_parallel_rng_tracker_name,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    get_model_and_context_parallel_rng_tracker_name,
    get_model_parallel_rng_tracker_name,
)

__all__ = [
    "CheckpointWithoutOutput",
    "CudaRNGStatesTracker",
    "InferenceRNGStatesTracker",
    "ParallelAxis",
    "RNGState",
    "RNGStatesTracker",
    "RNGTracker",
    "checkpoint",
    "get_all_rng_states",
    "get_context_parallel_rng_tracker_name",
    "get_cuda_rng_tracker",
    "get_data_parallel_rng_tracker_name",
    "get_expert_parallel_rng_tracker_name",
    "get_model_and_context_parallel_rng_tracker_name",
    "get_model_parallel_rng_tracker_name",
    "get_rng_state",
    "get_rng_tracker",
    "initialize_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "model_parallel_manual_seed",
    "register_model_parallel_group",
    "registered_model_parallel_rank",
    "set_rng_state",
    "supports_graph_safe_rng",
    "use_rng_tracker",
]
