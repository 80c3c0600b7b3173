"""Grouped expert weights equal the per-expert modules they replace, on both compute paths.

Where to start: ``test_grouped_equals_per_expert_modules`` draws experts, rows per
expert (zeros included) and sizes with hypothesis, runs :class:`mf_tp.GroupedExperts`
and one :class:`mf_tp.ExpertMLP` per expert block on the same weights, and compares the
output and every gradient in fp32 to 1e-6, on the grouped kernel and on the loop.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mf_tp
import mf_utils
from mf_tp import grouped_experts
from mf_tp.grouped_experts import RowGroups, convert_per_expert_state_dict, grouped_linear

TOL = {"rtol": 1e-6, "atol": 1e-6}


def _experts(num: int, hidden: int, ffn: int, seed: int) -> tuple[mf_tp.GroupedExperts, list]:
    torch.manual_seed(seed)
    singles = [mf_tp.ExpertMLP(hidden, ffn) for _ in range(num)]
    for single in singles:  # biases drawn too: zero biases would hide a misplaced bias row
        with torch.no_grad():
            single.fc.bias.normal_()
            single.out.bias.normal_()
    grouped = mf_tp.GroupedExperts(num, hidden, ffn)
    grouped.load_initial_weights([dict(s.named_parameters()) for s in singles])
    return grouped, singles


def _run(grouped, singles, counts, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), grouped.hidden_size, generator=gen)
    upstream = torch.randn(x.shape, generator=gen)
    x_grouped, x_single = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = grouped(x_grouped, counts)
    (out * upstream).sum().backward()
    blocks = x_single.split(counts)
    expected = torch.cat([s(b) for s, b in zip(singles, blocks, strict=True)])
    (expected * upstream).sum().backward()
    torch.testing.assert_close(out, expected, **TOL, msg="output")
    torch.testing.assert_close(x_grouped.grad, x_single.grad, **TOL, msg="input grad")
    for name, entry in grouped_experts.GROUPED_EXPERT_PARAMETERS.items():
        got = grouped.get_parameter(name).grad
        want = torch.stack([s.get_parameter(entry).grad for s in singles])
        torch.testing.assert_close(got, want, **TOL, msg=f"{name} grad")


@settings(max_examples=25)
@given(
    num=st.integers(1, 6),
    hidden=st.sampled_from([4, 8, 12]),
    ffn=st.sampled_from([4, 8, 16]),
    counts_seed=st.integers(0, 2**16),
    path=st.sampled_from(["grouped_mm", "loop"]),
)
def test_grouped_equals_per_expert_modules(
    num: int, hidden: int, ffn: int, counts_seed: int, path: str
) -> None:
    gen = torch.Generator().manual_seed(counts_seed)
    counts = torch.randint(0, 5, (num,), generator=gen).tolist()
    grouped, singles = _experts(num, hidden, ffn, counts_seed)
    with mock.patch.object(grouped_experts, "grouped_mm_path", return_value=path):
        _run(grouped, singles, counts, counts_seed)


def test_the_cpu_takes_the_grouped_kernel_where_torch_has_it() -> None:
    x, w = torch.randn(6, 8), torch.randn(3, 16, 8)
    expected = "grouped_mm" if hasattr(torch, "_grouped_mm") else "loop"
    assert grouped_experts.grouped_mm_path(x, w) == expected
    assert grouped_experts.grouped_mm_path(x.bfloat16(), w.bfloat16()) == expected
    # float64, and rows whose stride is no multiple of 16 bytes, take the exact loop.
    assert grouped_experts.grouped_mm_path(x.double(), w.double()) == "loop"
    assert grouped_experts.grouped_mm_path(torch.randn(6, 6), torch.randn(3, 16, 6)) == "loop"


def test_float64_experts_run_on_the_loop() -> None:
    grouped, singles = _experts(3, 4, 6, seed=3)
    grouped.double()
    for single in singles:
        single.double()
    out = grouped(torch.ones(5, 4, dtype=torch.float64), [2, 0, 3])
    expected = torch.cat(
        [singles[0](torch.ones(2, 4).double()), singles[2](torch.ones(3, 4).double())]
    )
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_parameters_carry_the_expert_mark_and_grouped_shapes() -> None:
    layer = mf_tp.GroupedExperts(4, 8, 16, device="meta")
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes == {
        "fc_weight": (4, 16, 8),
        "fc_bias": (4, 16),
        "out_weight": (4, 8, 16),
        "out_bias": (4, 8),
    }
    assert all(mf_utils.is_expert_parallel_parameter(p) for p in layer.parameters())


def test_bad_sizes_and_rows_raise_one_line() -> None:
    with pytest.raises(ValueError, match="GroupedExperts: num_experts must be a positive int"):
        mf_tp.GroupedExperts(0, 4, 4)
    groups = RowGroups.of([1, 2], torch.device("cpu"))
    with pytest.raises(ValueError, match=r"rows per group \[1, 2\] must have one count per group"):
        grouped_linear(torch.zeros(4, 2), torch.zeros(2, 3, 2), None, groups)
    with pytest.raises(ValueError, match="expected 2 experts' weights, got 1"):
        mf_tp.GroupedExperts(2, 4, 4).load_initial_weights([{}])


def test_per_expert_checkpoints_convert_to_grouped_entries() -> None:
    grouped, singles = _experts(3, 4, 8, seed=5)
    old = {"head.weight": torch.ones(2)}
    for index, single in enumerate(singles):
        for name, value in single.state_dict().items():
            old[f"blocks.0.moe.experts.{index}.{name}"] = value
    new = convert_per_expert_state_dict(old)
    assert set(new) == {"head.weight"} | {f"blocks.0.moe.experts.{n}" for n in grouped.state_dict()}
    for name, value in grouped.state_dict().items():
        assert torch.equal(new[f"blocks.0.moe.experts.{name}"], value), name
    del old["blocks.0.moe.experts.1.out.bias"]
    with pytest.raises(ValueError, match=r"blocks\.0\.moe\.experts\.<i> has entries"):
        convert_per_expert_state_dict(old)


def test_a_per_expert_checkpoint_is_refused_then_loads_converted() -> None:
    torch.manual_seed(0)
    layer = mf_tp.MoELayer(8, 16, 4, 2)
    old = {"router.weight": layer.router.weight.detach().clone()}
    for name, value in layer.experts.state_dict().items():
        entry = grouped_experts.GROUPED_EXPERT_PARAMETERS[name]
        for index in range(4):
            old[f"experts.{index}.{entry}"] = value[index]
    with pytest.raises(ValueError, match=r"convert the checkpoint with mf_tp\.convert_per_expert"):
        layer.load_state_dict(old)
    layer.load_state_dict(convert_per_expert_state_dict(old), strict=True)


def test_a_summed_output_backpropagates_on_the_grouped_kernel() -> None:
    """``out.sum().backward()`` hands the kernel an expanded gradient, which it refuses."""
    grouped, singles = _experts(2, 8, 16, seed=1)
    x = torch.randn(5, 8, requires_grad=True)
    grouped(x, [2, 3]).sum().backward()
    x_single = x.detach().clone().requires_grad_(True)
    _loop = torch.cat([singles[0](x_single[:2]), singles[1](x_single[2:])])
    _loop.sum().backward()
    torch.testing.assert_close(x.grad, x_single.grad, **TOL)
