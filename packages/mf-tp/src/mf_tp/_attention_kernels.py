"""Single-device attention kernels that report the log-sum-exp, and their backward.

Responsibility: exact attention of one block of queries ``q [B, H, Lq, D]``
against one block of keys and values ``k, v [B, Hkv, Lk, D]`` (``Hkv``
divides ``H``: grouped-query attention), with an optional causal mask aligned
at the top-left, returning the output in the input dtype and the natural
log-sum-exp of each query row's scaled scores ``[B, H, Lq]`` (fp32, fp64 for fp64
inputs: :func:`lse_dtype`); and the
backward that returns this block's share of ``dq, dk, dv``.

[Note: block backward with merged statistics] Let a query row attend over
keys split into blocks, each computed on its own, then merged with the
log-sum-exp (``lse = logaddexp`` of the block ``lse``s, ``out`` the
``exp(lse_block - lse)``-weighted sum of block outputs). The gradient of
the whole row, restricted to one block, is exactly what a flash-style
backward of that block returns when handed the merged ``out`` and ``lse``
instead of the block's own: it rebuilds the probabilities as
``exp(score - lse)`` (the row's true softmax on this block's keys) and uses
``rowsum(dout * out)`` of the whole row. So each block's backward is one
kernel call, and the blocks' ``dq`` add up.

| kernel         | device | dtypes             | grouped-query heads |
|----------------|--------|--------------------|---------------------|
| cpu_flash      | cpu    | fp16, bf16, fp32/64 | native             |
| cuda_flash     | cuda   | fp16, bf16, D <= 256 | repeated          |
| cuda_efficient | cuda   | fp16, bf16, fp32   | repeated            |
| math           | any    | any float (fp32 math) | repeated         |

It must not: communicate, or know how the sequence is laid out over ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["AttentionKernel", "BlockResult", "BlockSaved", "kernel_for", "lse_dtype"]

aten = torch.ops.aten
_EFFICIENT_LSE_ALIGN = 32  # the efficient kernel pads its log-sum-exp rows to this


@dataclass(frozen=True, slots=True)
class BlockResult:
    """One block's attention: output ``[B, H, Lq, Dv]``, ``lse [B, H, Lq]``, kernel extras."""

    out: torch.Tensor
    lse: torch.Tensor
    aux: Any = None


@dataclass(frozen=True, slots=True)
class BlockSaved:
    """What one block's backward reads: the gradient of its rows, its inputs, the row statistics.

    ``out`` and ``lse`` are the merged ones of the whole row (see
    [Note: block backward with merged statistics]); ``aux`` the kernel's forward extras.
    """

    dout: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    aux: Any = None


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The log-sum-exp's dtype for inputs of ``dtype``: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, Hkv, L, D] -> [B, heads, L, D]``, each key head serving ``heads / Hkv`` query heads."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _sum_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, H, L, D] -> [B, Hkv, L, D]``: the gradient of :func:`_repeat_heads`."""
    batch, heads, length, dim = grad.shape
    if heads == kv_heads:
        return grad
    return grad.view(batch, kv_heads, heads // kv_heads, length, dim).sum(2)


class AttentionKernel:
    """A device kernel; subclasses implement :meth:`forward` and :meth:`backward`."""

    name = "abstract"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
    ) -> BlockResult:
        """Attention of ``q`` over ``k, v``; see the module docstring for shapes."""
        raise NotImplementedError

    def backward(
        self, saved: BlockSaved, *, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This block's ``(dq, dk, dv)`` given the row's ``out`` and ``lse``.

        See [Note: block backward with merged statistics].
        """
        raise NotImplementedError


class _CPUFlash(AttentionKernel):
    """ATen's CPU flash kernel: returns the log-sum-exp and takes fewer key heads as they are."""

    name = "cpu_flash"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
    ) -> BlockResult:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return BlockResult(out, lse)

    def backward(
        self, saved: BlockSaved, *, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            saved.dout, saved.q, saved.k, saved.v, saved.out, saved.lse, 0.0, causal, scale=scale
        )
        return dq, dk, dv


class _CUDAFlash(AttentionKernel):
    """ATen's CUDA flash kernel (fp16/bf16); key heads are repeated to the query heads."""

    name = "cuda_flash"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
    ) -> BlockResult:
        heads = q.shape[1]
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
            aten._scaled_dot_product_flash_attention(
                q, _repeat_heads(k, heads), _repeat_heads(v, heads), 0.0, causal, False, scale=scale
            )
        )
        return BlockResult(out, lse, (cum_q, cum_k, max_q, max_k, seed, offset))

    def backward(
        self, saved: BlockSaved, *, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cum_q, cum_k, max_q, max_k, seed, offset = saved.aux
        heads, kv_heads = saved.q.shape[1], saved.k.shape[1]
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            saved.dout,
            saved.q,
            _repeat_heads(saved.k, heads),
            _repeat_heads(saved.v, heads),
            saved.out,
            saved.lse,
            cum_q,
            cum_k,
            max_q,
            max_k,
            0.0,
            causal,
            seed,
            offset,
            scale=scale,
        )
        return dq, _sum_heads(dk, kv_heads), _sum_heads(dv, kv_heads)


class _CUDAEfficient(AttentionKernel):
    """ATen's memory-efficient CUDA kernel (fp32 too); its lse rows are padded to 32."""

    name = "cuda_efficient"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
    ) -> BlockResult:
        heads = q.shape[1]
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q,
            _repeat_heads(k, heads),
            _repeat_heads(v, heads),
            None,
            True,
            0.0,
            causal,
            scale=scale,
        )
        return BlockResult(out, lse[..., : q.shape[2]], (seed, offset))

    def backward(
        self, saved: BlockSaved, *, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        seed, offset = saved.aux
        heads, kv_heads = saved.q.shape[1], saved.k.shape[1]
        rows = saved.lse.shape[-1]
        padded = -(-rows // _EFFICIENT_LSE_ALIGN) * _EFFICIENT_LSE_ALIGN
        lse = torch.nn.functional.pad(saved.lse, (0, padded - rows))
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            saved.dout,
            saved.q,
            _repeat_heads(saved.k, heads),
            _repeat_heads(saved.v, heads),
            None,
            saved.out,
            lse,
            seed,
            offset,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
        return dq, _sum_heads(dk, kv_heads), _sum_heads(dv, kv_heads)


class _Math(AttentionKernel):
    """Plain tensor ops in fp32 (fp64 stays fp64): any device, any float dtype."""

    name = "math"

    @staticmethod
    def _probabilities(
        q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, lse: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax probabilities ``[B, H, Lq, Lk]`` and the lse they were normalised with."""
        scores = (q @ k.transpose(-1, -2)) * scale
        if causal:
            keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        if lse is None:
            lse = scores.logsumexp(-1)
        return torch.exp(scores - lse.unsqueeze(-1).to(scores.dtype)), lse

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
    ) -> BlockResult:
        dtype, heads = lse_dtype(q.dtype), q.shape[1]
        qf, kf, vf = (t.to(dtype) for t in (q, _repeat_heads(k, heads), _repeat_heads(v, heads)))
        probs, lse = self._probabilities(qf, kf, causal, scale, None)
        return BlockResult((probs @ vf).to(q.dtype), lse)

    def backward(
        self, saved: BlockSaved, *, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = saved.q, saved.k, saved.v
        dtype, heads, kv_heads = lse_dtype(q.dtype), q.shape[1], k.shape[1]
        qf, kf, vf = (t.to(dtype) for t in (q, _repeat_heads(k, heads), _repeat_heads(v, heads)))
        doutf, outf = saved.dout.to(dtype), saved.out.to(dtype)
        probs, _ = self._probabilities(qf, kf, causal, scale, saved.lse)
        dv = probs.transpose(-1, -2) @ doutf
        row_dot = (doutf * outf).sum(-1, keepdim=True)
        dscores = probs * (doutf @ vf.transpose(-1, -2) - row_dot) * scale
        dq = dscores @ kf
        dk = dscores.transpose(-1, -2) @ qf
        return (
            dq.to(q.dtype),
            _sum_heads(dk, kv_heads).to(k.dtype),
            _sum_heads(dv, kv_heads).to(v.dtype),
        )


CPU_FLASH = _CPUFlash()
CUDA_FLASH = _CUDAFlash()
CUDA_EFFICIENT = _CUDAEfficient()
MATH = _Math()
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256


def kernel_for(device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionKernel:
    """The fastest kernel that returns a log-sum-exp for this device, dtype and head size."""
    if device.type == "cpu":
        return CPU_FLASH
    if device.type == "cuda":
        if (
            dtype in _FLASH_DTYPES
            and head_dim <= _FLASH_MAX_HEAD_DIM
            and head_dim % 8 == 0
            and torch.backends.cuda.flash_sdp_enabled()
        ):
            return CUDA_FLASH
        if (
            dtype in (*_FLASH_DTYPES, torch.float32)
            and torch.backends.cuda.mem_efficient_sdp_enabled()
        ):
            return CUDA_EFFICIENT
    return MATH
