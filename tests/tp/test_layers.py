"""Tensor-parallel layers reproduce the single-process torch model built from their weights.

Each TP=2 model is built with CPU initialisation and ``keep_master_weight_for_test``;
the reference is plain torch (``nn.Linear``, ``nn.Embedding``, ``F.cross_entropy``)
loaded with those full master weights. Both are trained for a few steps (SGD, then
Adam) on the same data and compared every step: outputs, loss, every gradient
(the TP gradient against the matching shard of the reference gradient) and the
parameters. Tolerance: rtol 1e-5 (fp32, only the summation order differs), and an
absolute slack of 1e-5 times the tensor's largest entry for entries that are
sums of cancelling terms.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import mf_rng
import mf_tp
from mf_tp.init import initialize_affine_weight_cpu, initialize_affine_weight_on_device
from tests._multiprocess import run_on_ranks

RTOL, ATOL = 1e-5, 1e-6
S, B, H, FFN, V = 4, 2, 8, 12, 16
STEPS = 3


def _init(tensor: torch.Tensor) -> torch.Tensor:
    # Small weights keep activations O(1), so fp32 rounding stays far below rtol.
    return torch.nn.init.normal_(tensor, std=0.2)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    # An entry that is a sum of cancelling terms carries the rounding of those terms, so
    # the absolute slack is 1e-5 of the tensor's largest entry (floor ATOL).
    atol = max(ATOL, RTOL * float(expected.detach().abs().max())) if expected.numel() else ATOL
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=atol, msg=lambda m: f"{what}: {m}")


def _shard(full: torch.Tensor, dim: int | None, rank: int, world: int) -> torch.Tensor:
    return full if dim is None else full.chunk(world, dim=dim)[rank]


def _reduce_sequence_parallel_grads(params: list[torch.nn.Parameter]) -> None:
    """All-reduce grads of replicated params that only saw this rank's sequence rows."""
    for param in params:
        if getattr(param, "sequence_parallel", False) and param.grad is not None:
            dist.all_reduce(param.grad)


def _optimizers(tp_params, ref_params, kind: str):
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
        "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    }[kind]
    return make(tp_params), make(ref_params)


def _mlp_parity(rank: int, world: int, sequence_parallel: bool, optimizer: str) -> None:
    config = mf_tp.ModelParallelConfig(
        tensor_model_parallel_size=world,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
    )
    torch.manual_seed(7)  # CPU init draws the full masters from the default generator
    fc1 = mf_tp.ColumnParallelLinear(
        H, FFN, config=config, init_method=_init, keep_master_weight_for_test=True
    )
    fc2 = mf_tp.RowParallelLinear(
        FFN,
        H,
        config=config,
        init_method=_init,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
        keep_master_weight_for_test=True,
    )
    ref1, ref2 = torch.nn.Linear(H, FFN), torch.nn.Linear(FFN, H)
    with torch.no_grad():
        for ref, tp in ((ref1, fc1), (ref2, fc2)):
            ref.weight.copy_(tp.master_weight)
            ref.bias.zero_()
    # (tp param, reference param, partition dim of the TP shard)
    pairs = [
        (fc1.weight, ref1.weight, 0),
        (fc1.bias, ref1.bias, 0),
        (fc2.weight, ref2.weight, 1),
        (fc2.bias, ref2.bias, None),
    ]
    opt_tp, opt_ref = _optimizers([p for p, _, _ in pairs], [q for _, q, _ in pairs], optimizer)
    gen = torch.Generator().manual_seed(11)
    for step in range(STEPS):
        x = torch.randn(S, B, H, generator=gen)
        target = torch.randn(S, B, H, generator=gen)
        x_ref = x.clone().requires_grad_(True)
        out_ref = ref2(F.gelu(ref1(x_ref)))
        loss_ref = ((out_ref - target) ** 2).sum()
        loss_ref.backward()

        x_tp = _shard(x, 0 if sequence_parallel else None, rank, world).requires_grad_(True)
        out_tp, _ = fc2(F.gelu(fc1(x_tp)[0]))
        my_target = _shard(target, 0 if sequence_parallel else None, rank, world)
        loss_tp = ((out_tp - my_target) ** 2).sum()
        loss_tp.backward()
        if sequence_parallel:
            _reduce_sequence_parallel_grads([fc2.bias])
            loss_tp = loss_tp.detach().clone()
            dist.all_reduce(loss_tp)

        tag = f"MLP sp={sequence_parallel} {optimizer} step {step}"
        _close(out_tp, _shard(out_ref, 0 if sequence_parallel else None, rank, world), tag)
        _close(loss_tp, loss_ref, f"{tag}: loss")
        _close(x_tp.grad, _shard(x_ref.grad, 0 if sequence_parallel else None, rank, world), tag)
        for index, (tp, ref, dim) in enumerate(pairs):
            _close(tp.grad, _shard(ref.grad, dim, rank, world), f"{tag}: grad of param {index}")
        opt_tp.step(), opt_ref.step()
        opt_tp.zero_grad(), opt_ref.zero_grad()
        for index, (tp, ref, dim) in enumerate(pairs):
            _close(tp.detach(), _shard(ref.detach(), dim, rank, world), f"{tag}: param {index}")


def _lm_parity(rank: int, world: int, sequence_parallel: bool, optimizer: str) -> None:
    config = mf_tp.ModelParallelConfig(
        tensor_model_parallel_size=world,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
    )
    torch.manual_seed(3)
    embedding = mf_tp.VocabParallelEmbedding(
        V,
        H,
        init_method=_init,
        config=config,
        reduce_scatter_embeddings=sequence_parallel,
    )
    gathered = [torch.empty_like(embedding.weight) for _ in range(world)]
    dist.all_gather(gathered, embedding.weight.detach())
    master_embedding = torch.cat(gathered)
    head = mf_tp.ColumnParallelLinear(
        H,
        V,
        config=config,
        init_method=_init,
        bias=False,
        keep_master_weight_for_test=True,
    )
    ref_embedding = torch.nn.Embedding(V, H, _weight=master_embedding.clone())
    ref_head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        ref_head.weight.copy_(head.master_weight)
    pairs = [(embedding.weight, ref_embedding.weight), (head.weight, ref_head.weight)]
    opt_tp, opt_ref = _optimizers([p for p, _ in pairs], [q for _, q in pairs], optimizer)
    gen = torch.Generator().manual_seed(5)
    for step in range(STEPS):
        ids = torch.randint(0, V, (B, S), generator=gen)
        # Targets on both sides of the shard boundary V/2, and the extremes.
        target = torch.randint(0, V, (B, S), generator=gen)
        target[0, :4] = torch.tensor([0, V // world - 1, V // world, V - 1])
        hidden_ref = ref_embedding(ids)  # [B, S, H]
        if sequence_parallel:
            hidden_ref = hidden_ref.transpose(0, 1)  # [S, B, H]
            target_layout = target.t()
        else:
            target_layout = target
        logits_ref = ref_head(hidden_ref)
        loss_ref = F.cross_entropy(
            logits_ref.reshape(-1, V), target_layout.reshape(-1), label_smoothing=0.1
        )
        loss_ref.backward()

        hidden = embedding(ids)  # [B, S, H] or [S/t, B, H]
        logits, _ = head(hidden)  # [..., V/t]
        loss = mf_tp.vocab_parallel_cross_entropy(logits, target_layout, 0.1).mean()
        loss.backward()

        tag = f"LM sp={sequence_parallel} {optimizer} step {step}"
        _close(logits, _shard(logits_ref, -1, rank, world), f"{tag}: logits")
        _close(loss, loss_ref, f"{tag}: loss")
        for index, (tp, ref) in enumerate(pairs):
            _close(tp.grad, _shard(ref.grad, 0, rank, world), f"{tag}: grad of param {index}")
        opt_tp.step(), opt_ref.step()
        opt_tp.zero_grad(), opt_ref.zero_grad()
        for index, (tp, ref) in enumerate(pairs):
            _close(tp.detach(), _shard(ref.detach(), 0, rank, world), f"{tag}: param {index}")


def _gradient_accumulation_and_frozen(rank: int, world: int) -> None:
    config = mf_tp.ModelParallelConfig(
        tensor_model_parallel_size=world, use_cpu_initialization=True
    )
    fused_config = mf_tp.ModelParallelConfig(
        tensor_model_parallel_size=world,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=True,
    )
    torch.manual_seed(1)
    plain = mf_tp.ColumnParallelLinear(H, FFN, config=config, init_method=_init)
    torch.manual_seed(1)
    fused = mf_tp.ColumnParallelLinear(H, FFN, config=fused_config, init_method=_init)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(2))
    plain(x)[0].square().sum().backward()
    fused.weight.main_grad = torch.zeros(fused.weight.shape, dtype=torch.float64)
    for _ in range(2):
        fused(x)[0].square().sum().backward()
    assert fused.weight.grad is None
    _close(fused.weight.main_grad.float(), 2 * plain.weight.grad, "main_grad accumulates")
    # With the hook flag present, a zero dummy grad lets the caller's hooks fire.
    fused.weight.grad_added_to_main_grad = False
    fused(x)[0].square().sum().backward()
    assert fused.weight.grad_added_to_main_grad
    assert torch.count_nonzero(fused.weight.grad) == 0
    del fused.weight.main_grad
    with pytest.raises(RuntimeError, match="needs weight.main_grad"):
        fused(x)[0].sum().backward()

    # Frozen weight: the input gradient is unchanged, the weight gets none.
    x_a, x_b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    plain(x_a)[0].square().sum().backward()
    plain.weight.requires_grad_(False)
    plain.weight.grad = None
    plain(x_b)[0].square().sum().backward()
    assert plain.weight.grad is None
    _close(x_b.grad, x_a.grad, "frozen-weight input gradient")
    assert plain.bias.grad is not None  # only the weight is frozen

    # Frozen weight under sequence parallelism: the input is gathered, its grad reduce-scattered.
    sp = mf_tp.ModelParallelConfig(
        tensor_model_parallel_size=world, sequence_parallel=True, use_cpu_initialization=True
    )
    torch.manual_seed(4)
    column = mf_tp.ColumnParallelLinear(H, FFN, config=sp, init_method=_init)
    x_rows = x.chunk(world, dim=0)[rank]
    x_a, x_b = x_rows.clone().requires_grad_(True), x_rows.clone().requires_grad_(True)
    out_a, _ = column(x_a)
    out_a.square().sum().backward()
    column.weight.requires_grad_(False)
    out_b, _ = column(x_b)
    out_b.square().sum().backward()
    _close(out_b, out_a.detach(), "frozen-weight SP output")
    _close(x_b.grad, x_a.grad, "frozen-weight SP input gradient")

    # Row layer scattering a full input itself, and a column layer gathering its output.
    torch.manual_seed(6)
    row = mf_tp.RowParallelLinear(
        FFN,
        H,
        config=config,
        init_method=_init,
        bias=True,
        input_is_parallel=False,
        skip_bias_add=True,
        keep_master_weight_for_test=True,
    )
    column = mf_tp.ColumnParallelLinear(
        H,
        FFN,
        config=config,
        init_method=_init,
        gather_output=True,
        keep_master_weight_for_test=True,
    )
    z = torch.randn(S, B, FFN, generator=torch.Generator().manual_seed(8), requires_grad=True)
    z_ref = z.detach().clone().requires_grad_(True)
    out, out_bias = row(z)
    assert out_bias is row.bias
    full, _ = column(out)
    assert full.shape == (S, B, FFN)
    full_ref = (z_ref @ row.master_weight.t()) @ column.master_weight.t()
    _close(full, full_ref, "scatter-input row -> gathered-output column")
    full.square().sum().backward()
    full_ref.square().sum().backward()
    _close(z.grad, z_ref.grad, "scatter-input row: input gradient")
    sharded, _ = column(out.detach(), runtime_gather_output=False)
    _close(sharded, full_ref.detach().chunk(world, dim=-1)[rank], "runtime_gather_output=False")

    # Deferred weight gradient: output gradients go to the buffer, no weight gradient.
    weight = torch.randn(FFN // world, H, requires_grad=True)
    buffer: list[torch.Tensor] = []
    out = mf_tp.linear_with_grad_accumulation_and_async_allreduce(
        x, weight, None, False, True, False, grad_output_buffer=buffer
    )
    out.backward(torch.ones_like(out))
    assert weight.grad is None
    assert len(buffer) == 1
    assert torch.equal(buffer[0], torch.ones_like(out))
    with pytest.warns(DeprecationWarning, match="async_grad_allreduce is deprecated"):
        mf_tp.linear_with_grad_accumulation_and_async_allreduce(
            x, weight, None, False, False, False, async_grad_allreduce=True
        )
    with pytest.raises(ValueError, match="allreduce_dgrad and sequence_parallel are exclusive"):
        mf_tp.linear_with_grad_accumulation_and_async_allreduce(x, weight, None, False, True, True)


def _initialisation(rank: int, world: int) -> None:
    """CPU and on-device init give the TP=1 full weight at TP=2, stride included.

    The tracker is seeded for the CPU (``device="cpu"``), which also seeds the CPU
    generator the CPU path draws from, so this holds on a machine with a GPU too.
    """
    seed, out_size, in_size = 123, 8, 6
    for stride in (1, 2):
        for use_cpu in (True, False):
            mf_rng.model_parallel_cuda_manual_seed(seed, force_reset_rng=True, device="cpu")
            config = mf_tp.ModelParallelConfig(
                tensor_model_parallel_size=world, use_cpu_initialization=use_cpu
            )
            layer = mf_tp.ColumnParallelLinear(
                in_size,
                out_size,
                config=config,
                init_method=_init,
                stride=stride,
                keep_master_weight_for_test=True,
            )
            # The TP=1 weight from the same seed, drawn without any group.
            mf_rng.model_parallel_cuda_manual_seed(seed, force_reset_rng=True, device="cpu")
            full = torch.empty(out_size, in_size)
            if use_cpu:
                initialize_affine_weight_cpu(
                    full,
                    out_size,
                    in_size,
                    out_size,
                    0,
                    _init,
                    stride,
                    rank=0,
                    world_size=1,
                )
            else:
                initialize_affine_weight_on_device(
                    full,
                    out_size,
                    in_size,
                    out_size,
                    0,
                    _init,
                    stride,
                    rank=0,
                    world_size=1,
                )
            tag = f"init stride={stride} cpu={use_cpu}"
            torch.testing.assert_close(layer.master_weight, full, rtol=0, atol=0, msg=tag)
            pieces = full.split(out_size // world // stride)
            torch.testing.assert_close(
                layer.weight.detach(), torch.cat(pieces[rank::world]), rtol=0, atol=0, msg=tag
            )
            assert layer.weight.tensor_model_parallel
            assert layer.weight.partition_stride == stride
    # Right after seeding, both paths draw the same numbers on the CPU.
    mf_rng.model_parallel_cuda_manual_seed(seed, force_reset_rng=True, device="cpu")
    a = torch.empty(4, 4)
    initialize_affine_weight_cpu(a, 4, 4, 4, 0, _init, rank=0, world_size=1)
    mf_rng.model_parallel_cuda_manual_seed(seed, force_reset_rng=True, device="cpu")
    b = torch.empty(4, 4)
    initialize_affine_weight_on_device(b, 4, 4, 4, 0, _init, rank=0, world_size=1)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # A weight on a device type the tracker does not fork for (here "meta") is refused.
    with pytest.raises(ValueError, match="seed it for the weight's device"):
        initialize_affine_weight_on_device(
            torch.empty(4, 4, device="meta"), 4, 4, 4, 0, _init, rank=0, world_size=1
        )


def _bad_input(rank: int, world: int) -> None:
    config = mf_tp.ModelParallelConfig(tensor_model_parallel_size=world)
    init = torch.nn.init.normal_
    with pytest.raises(ValueError, match=r"output_size=15 must be a positive int divisible"):
        mf_tp.ColumnParallelLinear(8, 15, config=config, init_method=init)
    with pytest.raises(ValueError, match=r"input_size=9 must be a positive int divisible"):
        mf_tp.RowParallelLinear(
            9,
            8,
            config=config,
            init_method=init,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=False,
        )
    with pytest.raises(ValueError, match=r"num_embeddings=7 must be a positive int divisible"):
        mf_tp.VocabParallelEmbedding(7, 4, init_method=init, config=config)
    column = mf_tp.ColumnParallelLinear(8, 4, config=config, init_method=init)
    with pytest.raises(ValueError, match=r"input_ must have last dim 8, got shape \(2, 5\)"):
        column(torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"weight must have shape \(2, 8\)"):
        column(torch.zeros(2, 8), weight=torch.zeros(4, 8))
    row = mf_tp.RowParallelLinear(
        8,
        4,
        config=config,
        init_method=init,
        bias=False,
        input_is_parallel=True,
        skip_bias_add=False,
    )
    with pytest.raises(ValueError, match=r"input_ must have last dim 4, got shape \(2, 8\)"):
        row(torch.zeros(2, 8))
    sp = mf_tp.ModelParallelConfig(tensor_model_parallel_size=world, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel needs input_is_parallel=True"):
        mf_tp.RowParallelLinear(
            8,
            4,
            config=sp,
            init_method=init,
            bias=False,
            input_is_parallel=False,
            skip_bias_add=False,
        )
    with pytest.raises(ValueError, match="gather_output cannot be combined"):
        mf_tp.ColumnParallelLinear(8, 4, config=sp, init_method=init, gather_output=True)(
            torch.zeros(2, 1, 8)
        )
    weightless = mf_tp.ColumnParallelLinear(
        8, 4, config=config, init_method=init, skip_weight_param_allocation=True
    )
    with pytest.raises(RuntimeError, match="skip_weight_param_allocation=True, so weight must"):
        weightless(torch.zeros(2, 8))
    assert weightless(torch.ones(2, 8), weight=torch.ones(2, 8))[0].shape == (2, 2)
    # Expert layers leave their communication to the caller (explicit expert comm).
    expert = mf_tp.ColumnParallelLinear(
        8, 4, config=config, init_method=init, gather_output=True, is_expert=True
    )
    assert expert(torch.ones(2, 8))[0].shape == (2, 4 // world)
    uninitialised = mf_tp.ColumnParallelLinear(
        8, 4, config=dataclasses.replace(config, perform_initialization=False), init_method=init
    )
    assert uninitialised.weight.partition_dim == 0
    embedding = mf_tp.VocabParallelEmbedding(8, 4, init_method=init, config=config)
    with pytest.raises(ValueError, match=r"input_ must lie in \[0, 8\), got values in \[0, 8\]"):
        embedding(torch.tensor([0, 8]))
    logits = torch.zeros(3, 4)
    with pytest.raises(ValueError, match=r"target must lie in \[0, 8\), got values in \[-100, 1\]"):
        mf_tp.vocab_parallel_cross_entropy(logits, torch.tensor([0, 1, -100]))


def _rank_layers(rank: int, world: int) -> None:
    mf_tp.initialize_model_parallel(world)
    try:
        for sequence_parallel in (False, True):
            for optimizer in ("sgd", "adam"):
                _mlp_parity(rank, world, sequence_parallel, optimizer)
                _lm_parity(rank, world, sequence_parallel, optimizer)
        _gradient_accumulation_and_frozen(rank, world)
        _initialisation(rank, world)
        _bad_input(rank, world)
    finally:
        mf_tp.destroy_model_parallel()


@pytest.mark.multiprocess
def test_tp2_layers_match_single_process_model() -> None:
    run_on_ranks(_rank_layers, 2, timeout=180)
