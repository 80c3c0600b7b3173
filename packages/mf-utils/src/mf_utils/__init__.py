"""mf_utils: the small shared layer every other mf package stands on.

It holds no parallel state of its own: process groups and meshes are always
passed in by the caller.
"""

from mf_utils.device import get_group_device
from mf_utils.expert_parallel_attributes import (
    is_expert_parallel_parameter,
    set_expert_parallel_attribute,
)
from mf_utils.memory_buffer import (
    GlobalMemoryBuffer,
    default_device,
    get_global_memory_buffer,
    use_global_memory_buffer,
)
from mf_utils.mesh import contains_submesh, get_mesh_names
from mf_utils.modules import create_updated_function_signature, is_submodule
from mf_utils.partition import divide, gather_split_1d_tensor, split_tensor_into_1d_equal_chunks
from mf_utils.tensor_parallel_attributes import (
    TENSOR_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS,
    copy_tensor_model_parallel_attributes,
    get_mcore_tensor_parallel_partition_dim,
    is_mcore_tensor_model_parallel,
    is_mcore_tensor_parallel_duplicated,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from mf_utils.torch_compat import collective_name, ensure_subclass_torch_dispatch
from mf_utils.versions import get_te_version, is_te_min_version, is_torch_min_version

__all__ = [
    "TENSOR_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS",
    "GlobalMemoryBuffer",
    "collective_name",
    "contains_submesh",
    "copy_tensor_model_parallel_attributes",
    "create_updated_function_signature",
    "default_device",
    "divide",
    "ensure_subclass_torch_dispatch",
    "gather_split_1d_tensor",
    "get_global_memory_buffer",
    "get_group_device",
    "get_mcore_tensor_parallel_partition_dim",
    "get_mesh_names",
    "get_te_version",
    "is_expert_parallel_parameter",
    "is_mcore_tensor_model_parallel",
    "is_mcore_tensor_parallel_duplicated",
    "is_submodule",
    "is_te_min_version",
    "is_torch_min_version",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_expert_parallel_attribute",
    "set_tensor_model_parallel_attributes",
    "split_tensor_into_1d_equal_chunks",
    "use_global_memory_buffer",
]
