"""mf-fsdp shards models nobody in this repo wrote: Hugging Face Llama, GPT-2 and Mixtral.

Each model is a tiny random configuration built in code (no download), wrapped as a
user would wrap it: the HF model itself, its decoder layer as the FSDP unit. What
this adds over the tests of ``mf.models``: HF's own forward signatures (keyword
inputs, ``ModelOutput`` results, a KV cache), GPT-2's transposed ``Conv1D`` weights
(dim 0 is the input width, so nothing may assume ``nn.Linear``), its tied
embedding / head, Mixtral's 3-D expert tensors ``(experts, rows, cols)`` inside the
unit, HF's activation checkpointing, ``generate`` and ``model.config``.

Tolerances:
- fp32 parity, 1e-5 relative: the ranks' gradients are summed in another order
  than one backward over the global batch, a rounding-level difference (measured:
  losses 5e-8, parameters bit-equal); any scaling or layout error shows up at O(1)
  with SGD at lr 0.5.
- bf16 compute against the fp32 run: losses within 1e-3 relative and every
  parameter within 10% of its fp32 update, ||p_bf16 - p_fp32|| <= 0.1 ||p_fp32 -
  p_init||. bf16 keeps 8 mantissa bits (2**-9 relative rounding per operation) on
  the compute weights, activations and local gradients, so the runs differ well
  above fp32 rounding (measured: losses 5e-5, updates 1.4% for Llama and GPT-2 and
  4.8% for Mixtral, whose bf16 router sends a few tokens to other experts). Not the
  looser 5e-2 on losses alone: at this initialisation the loss stays near log(128)
  and a step moves it by 0.2% to 0.6%, so 5e-2 would pass a model that never
  trains; a missing or mis-scaled update moves the parameters by 100% of an update.

Meta-device construction: modules without ``reset_parameters()`` (HF's RMSNorm,
GPT-2's Conv1D, Mixtral's experts and router) are initialised through the model's
``_init_weights(module)``, and meta buffers are materialised with them (the
rotary embedding's non-persistent ``inv_freq``, which no state dict restores).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
)
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

import mf_fsdp
from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.fsdp._helpers import (
    assert_losses_close,
    assert_matches_reference,
    full_params,
    global_batch_run,
    make_optimizer,
    optimizer_step,
)

# The ranks import this module (their functions are its), and so transformers' models:
# seconds of CPU per rank, which the forkserver pays once instead.
preload_in_ranks(__name__)

WORLD = 2
VOCAB, BATCH, SEQ = 128, 2, 16
STEPS = 3
RTOL, ATOL = 1e-5, 1e-6
BF16_LOSS_RTOL = 1e-3
BF16_UPDATE_FRACTION = 0.1
TIMEOUT = 60.0
NAMES = ["llama", "gpt2", "mixtral"]
# No bos / eos / pad id: greedy generation then always runs max_new_tokens steps, so
# every rank makes the same number of forwards (ZeRO-3 gathers in each).
_NO_SPECIAL_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def _config(name: str) -> PretrainedConfig:
    if name == "llama":
        return LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            attn_implementation="eager",
            **_NO_SPECIAL_TOKENS,
        )
    if name == "gpt2":
        return GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,  # GPT-2 defaults to dropout 0.1: no randomness in these runs
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            attn_implementation="eager",
            **_NO_SPECIAL_TOKENS,
        )
    # Three experts at world 2: a 3-D expert tensor's rows are whole experts (8192
    # elements), so the row-aligned layout splits the unit unevenly (at world 2 every
    # expert lands on rank 0, the attention and norms on rank 1: empty pieces on both).
    return MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_local_experts=3,
        num_experts_per_tok=2,
        attn_implementation="eager",
        **_NO_SPECIAL_TOKENS,
    )


_CLASSES: dict[str, tuple[type[nn.Module], type[nn.Module]]] = {
    "llama": (LlamaForCausalLM, LlamaDecoderLayer),
    "gpt2": (GPT2LMHeadModel, GPT2Block),
    "mixtral": (MixtralForCausalLM, MixtralDecoderLayer),
}


def make_model(name: str, seed: int = 0) -> nn.Module:
    """The same tiny HF model on every rank for a given seed."""
    torch.manual_seed(seed)
    return _CLASSES[name][0](_config(name))


def unit_class(name: str) -> type[nn.Module]:
    return _CLASSES[name][1]


def batch(step: int, rank: int) -> torch.Tensor:
    """Rank- and step-dependent tokens (HF shifts the labels itself)."""
    g = torch.Generator().manual_seed(1000 * step + 100 * rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss


def reference_run(name: str, world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process over every rank's batch, losses averaged: losses and final parameters."""
    module = make_model(name)
    opt = make_optimizer("sgd", module.parameters())
    return global_batch_run(
        module, opt, STEPS, world, lambda m, step, rank: lm_loss(m, batch(step, rank))
    )


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int) -> list[float]:
    """STEPS steps on this rank's batches; the mean loss over ranks of each step."""
    losses = []
    for step in range(STEPS):
        losses.append(optimizer_step(lm_loss(model, batch(step, rank)), opt, world))
    return losses


def wrap(name: str, module: nn.Module, strategy: int = 3, **options):
    opt = make_optimizer("sgd", module.parameters())
    return mf_fsdp.fully_shard(
        module, opt, fsdp_unit_modules=[unit_class(name)], zero_dp_strategy=strategy, **options
    )


# ---------------------------------------------------------------------- ranks
def _rank_zero_parity(rank: int, world: int, name: str) -> None:
    ref_losses, ref_params = reference_run(name, world)
    for strategy in (0, 1, 2, 3):
        model, opt = wrap(name, make_model(name), strategy)
        losses = train(model, opt, rank, world)
        params = full_params(model)
        assert params.keys() == ref_params.keys(), f"z{strategy}"
        assert_matches_reference(
            losses, params, ref_losses, ref_params, f"{name} z{strategy}", RTOL, ATOL
        )


def _rank_activation_checkpointing(rank: int, world: int, name: str) -> None:
    ref_losses, ref_params = reference_run(name, world)
    module = make_model(name)
    module.activation_checkpointing_enable()  # gradient_checkpointing_enable's new name
    first_unit = next(m for m in module.modules() if isinstance(m, unit_class(name)))
    calls = []
    # HF checkpoints the layer's forward, not its __call__: the unit's hooks run once,
    # the hooks of a module inside the layer run again in the recompute.
    inner = next(first_unit.children())
    inner.register_forward_pre_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    model, opt = wrap(name, module, 3)
    losses = train(model, opt, rank, world)
    assert len(calls) == 2 * STEPS, f"{name}: the layer ran {len(calls)} times, not recomputed"
    assert_matches_reference(
        losses, full_params(model), ref_losses, ref_params, f"{name} recompute", RTOL, ATOL
    )


def _rank_bf16(rank: int, world: int, name: str) -> None:
    ref_losses, ref_params = reference_run(name, world)
    initial = {n: p.detach().clone() for n, p in make_model(name).named_parameters()}
    policy = mf_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model, opt = wrap(name, make_model(name), 3, mixed_precision_policy=policy)
    out = model(input_ids=batch(0, rank), use_cache=False)
    assert out.logits.dtype == torch.bfloat16, f"{name}: computed in {out.logits.dtype}"
    losses = train(model, opt, rank, world)
    assert_losses_close(losses, ref_losses, f"{name} bf16 losses against fp32", BF16_LOSS_RTOL)
    params = full_params(model)
    assert params.keys() == ref_params.keys()
    for p_name, p in params.items():
        assert p.dtype == torch.float32, f"{name} {p_name}: main weights in {p.dtype}"
        off = (p - ref_params[p_name]).norm().item()
        update = (ref_params[p_name] - initial[p_name]).norm().item()
        assert off <= BF16_UPDATE_FRACTION * update, (
            f"{name} {p_name}: bf16 is {off:.3g} from fp32, the fp32 update is {update:.3g}"
        )


def _rank_meta_init(rank: int, world: int, name: str) -> None:
    plain = make_model(name)
    expected = lm_loss(plain, batch(0, rank)).item()
    full = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    with torch.device("meta"):
        module = _CLASSES[name][0](_config(name))
    # The model's own initialiser after each module's reset_parameters, said once.
    says = rf"{type(module).__name__}._init_weights\(module\)"
    with pytest.warns(UserWarning, match=says):
        model, _ = wrap(name, module, 3, init_model_with_meta_device=True)
    model.load_state_dict(full)
    assert_matches_reference(
        [lm_loss(model, batch(0, rank)).item()],
        full_params(model),
        [expected],
        dict(plain.named_parameters()),
        f"{name} meta init",
        RTOL,
        ATOL,
    )


def _rank_contract(rank: int, world: int, name: str) -> None:
    plain = make_model(name)
    full = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    module = make_model(name, seed=1)  # other weights, replaced by the load below
    config = module.config
    model, _ = wrap(name, module, 3)
    # Attribute transparency: HF's own attributes answer through the wrapper.
    assert model.config is config
    assert model.get_input_embeddings() is module.get_input_embeddings()
    # Full plain tensors load into the shards (each rank keeps its rows).
    model.load_state_dict(full)
    expected = lm_loss(plain, batch(0, rank)).item()
    torch.testing.assert_close(lm_loss(model, batch(0, rank)).item(), expected, rtol=RTOL, atol=0)
    # torch's DSD sees the module's FQNs (no ``module.`` prefix), tied names included.
    sharded = get_model_state_dict(model)
    assert sorted(sharded) == sorted(full), (sorted(sharded), sorted(full))
    gathered = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert sorted(gathered) == sorted(full)
    for key, value in full.items():
        torch.testing.assert_close(gathered[key], value, rtol=0, atol=0, msg=key)


def _rank_generate(rank: int, world: int, name: str) -> None:
    g = torch.Generator().manual_seed(7 + rank)  # each rank its own prompt
    prompt = torch.randint(0, VOCAB, (2, 8), generator=g)
    plain = make_model(name).eval()
    options = {"do_sample": False, "max_new_tokens": 6}
    expected = plain.generate(prompt, **options)
    model, _ = wrap(name, make_model(name), 3)
    model.eval()
    out = model.generate(prompt, **options)
    assert out.shape == (2, 8 + 6), out.shape
    assert torch.equal(out, expected), (out, expected)
    # Each of generate's forwards released what it gathered: only shards are left.
    for p_name, p in model.named_parameters():
        assert isinstance(p, DTensor), f"{name} {p_name} left gathered after generate"


# ---------------------------------------------------------------------- tests
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", NAMES)
def test_zero_parity_with_one_process(name: str) -> None:
    run_on_ranks(_rank_zero_parity, WORLD, name, timeout=TIMEOUT)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", NAMES)
def test_activation_checkpointing_zero3(name: str) -> None:
    run_on_ranks(_rank_activation_checkpointing, WORLD, name, timeout=TIMEOUT)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", NAMES)
def test_bf16_compute_close_to_fp32(name: str) -> None:
    run_on_ranks(_rank_bf16, WORLD, name, timeout=TIMEOUT)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", NAMES)
def test_meta_device_init_then_full_state_dict(name: str) -> None:
    run_on_ranks(_rank_meta_init, WORLD, name, timeout=TIMEOUT)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", NAMES)
def test_config_state_dict_and_full_load(name: str) -> None:
    run_on_ranks(_rank_contract, WORLD, name, timeout=TIMEOUT)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", NAMES)
def test_greedy_generate_zero3(name: str) -> None:
    run_on_ranks(_rank_generate, WORLD, name, timeout=TIMEOUT)


def _rank_compile(rank: int, world: int, name: str) -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    ref_losses, _ = reference_run(name, world)
    for per_unit in (False, True):
        model, opt = wrap(name, make_model(name), 3)
        counter = CompileCounterWithBackend("inductor")
        if per_unit:  # torchtitan's way: each decoder layer compiled whole, the wrapper eager
            for layer in model.module.model.layers:
                layer.compile(backend=counter, fullgraph=True)
            step_fn = model
        else:
            step_fn = torch.compile(model, backend=counter)
        losses = train(step_fn, opt, rank, world)
        # Inductor fuses and reorders float ops: its own noise, well above fp32 rounding.
        label = "per unit" if per_unit else "whole model"
        torch.testing.assert_close(
            torch.tensor(losses),
            torch.tensor(ref_losses),
            rtol=1e-4,
            atol=1e-5,
            msg=lambda m, label=label: f"{label}: {m}",
        )
        frames = counter.frame_count
        assert frames > 0, f"{label}: nothing was compiled"
        train(step_fn, opt, rank, world)
        assert counter.frame_count == frames, f"{label}: recompiled after {frames} frames"


@pytest.mark.multiprocess
def test_compiled_llama_trains_like_one_process_without_recompiles() -> None:
    run_on_ranks(_rank_compile, WORLD, "llama", timeout=300)


# ------------------------------------------------------- a Llama whose hooks rename keys
def _hooked_llama(device: str = "cpu", seed: int = 0) -> nn.Module:
    """The tiny Llama with HF-style checkpoint-conversion hooks: the final norm is saved
    as ``model.final_norm.weight`` (an old name) and loads from either name."""
    torch.manual_seed(seed)
    with torch.device(device):
        module = LlamaForCausalLM(_config("llama"))

    def rename_on_save(inner, state_dict, prefix, local_metadata) -> None:
        state_dict[f"{prefix}final_norm.weight"] = state_dict.pop(f"{prefix}norm.weight")

    def rename_on_load(inner, state_dict, prefix, *args) -> None:
        if f"{prefix}final_norm.weight" in state_dict:
            state_dict[f"{prefix}norm.weight"] = state_dict.pop(f"{prefix}final_norm.weight")

    module.model.register_state_dict_post_hook(rename_on_save)
    module.model.register_load_state_dict_pre_hook(rename_on_load)
    return module


def _rank_hooked_llama(rank: int, world: int, root: str) -> None:
    import copy

    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    # FSDP2's meta flow with HF's own init: exactly one process's values. (HF skips
    # modules it has initialised, so one process runs the same flow unwrapped.)
    plain = _hooked_llama("meta").to_empty(device="cpu")
    torch.manual_seed(3)
    plain.init_weights()
    model = mf_fsdp.fully_shard_model(
        _hooked_llama("meta"), fsdp_unit_modules=[unit_class("llama")]
    )
    model.to_empty(device="cpu")
    torch.manual_seed(3)
    model.init_weights()
    for p_name, value in full_params(model).items():
        torch.testing.assert_close(value, plain.get_parameter(p_name), rtol=0, atol=0, msg=p_name)
    keys = list(model.state_dict())
    assert "model.final_norm.weight" in keys
    assert keys == list(plain.state_dict())

    opt = make_optimizer("adam", model.parameters())
    for step in range(3):
        optimizer_step(lm_loss(model, batch(step, rank)), opt, world)
    path = mf_fsdp.save_checkpoint(root, model, opt, step=3)
    options = StateDictOptions(full_state_dict=True)
    saved = {
        k: v.full_tensor() if isinstance(v, DTensor) else v.clone()
        for k, v in model.state_dict().items()
    }
    saved_optim = copy.deepcopy(get_optimizer_state_dict(model, opt, options=options))
    expected = [optimizer_step(lm_loss(model, batch(s, rank)), opt, world) for s in (3, 4)]

    def fresh():
        wrapped = mf_fsdp.fully_shard_model(
            _hooked_llama(seed=9), fsdp_unit_modules=[unit_class("llama")]
        )
        return wrapped, make_optimizer("adam", wrapped.parameters())

    resumed, resumed_opt = fresh()
    mf_fsdp.load_checkpoint(path, resumed, resumed_opt)
    got = [optimizer_step(lm_loss(resumed, batch(s, rank)), resumed_opt, world) for s in (3, 4)]
    assert got == expected, "load_checkpoint"
    through, through_opt = fresh()
    through.load_state_dict(saved)
    set_optimizer_state_dict(through, through_opt, saved_optim, options=options)
    got = [optimizer_step(lm_loss(through, batch(s, rank)), through_opt, world) for s in (3, 4)]
    assert got == expected, "state dict + DSD optimizer state"
    if rank == 0:  # the checkpoint as a full state dict loads into the plain model
        _hooked_llama().load_state_dict(mf_fsdp.checkpoint_to_full_state_dict(path))


@pytest.mark.multiprocess
def test_llama_with_key_renaming_hooks_inits_from_meta_and_resumes(tmp_path) -> None:
    run_on_ranks(_rank_hooked_llama, WORLD, str(tmp_path), timeout=120)
