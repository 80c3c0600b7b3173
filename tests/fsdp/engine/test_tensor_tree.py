"""``mf_fsdp.engine._tensor_tree.flatten``: the hooks see tensors inside dataclasses.

Without it a unit whose output (or input) is a ``@dataclass`` of tensors got no
backward hook: its gradients were never reduced and stayed zero, silently
(``test_fsdp2_conformance_state.py::test_structured_input_output`` on ranks).
"""

from __future__ import annotations

import dataclasses

import torch

from mf_fsdp.engine._tensor_tree import flatten


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Outer:
    inner: Pair
    z: torch.Tensor
    tag: str = "t"
    cached: int = dataclasses.field(default=7, init=False)


def test_plain_pytrees_flatten_as_torch_does() -> None:
    a, b = torch.ones(1), torch.zeros(1)
    leaves, rebuild = flatten(((a,), {"k": b}))
    assert leaves[0] is a
    assert leaves[1] is b
    assert rebuild(["p", "q"]) == (("p",), {"k": "q"})


def test_dataclass_fields_are_leaves_and_rebuild_makes_new_instances() -> None:
    x, y, z = torch.ones(1), torch.ones(2), torch.ones(3)
    tree = [Outer(inner=Pair(x, y), z=z), "free"]
    leaves, rebuild = flatten(tree)
    assert [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)] == [x, y, z]
    assert "t" in leaves
    assert "free" in leaves
    new = rebuild([leaf * 2 if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])
    assert isinstance(new[0], Outer)
    assert new[0] is not tree[0]
    assert torch.equal(new[0].inner.x, x * 2)
    assert torch.equal(new[0].z, z * 2)
    assert new[0].cached == 7
    assert new[1] == "free"
    assert tree[0].inner.x is x  # the caller's instances are left alone


def test_a_dataclass_class_is_a_leaf() -> None:
    leaves, rebuild = flatten([Pair])
    assert leaves == [Pair]
    assert rebuild(leaves) == [Pair]
