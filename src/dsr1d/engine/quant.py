"""Weight-only int8 and int4 linears on torch's CPU kernels (bf16 activations).

int8: per-output-channel symmetric scales, ``aten._weight_int8pack_mm`` (weights ``[N, K]``
int8, scales ``[N]``). int4: group-wise asymmetric, packed for this CPU at load time by
``aten._convert_weight_to_int4pack_for_cpu`` and run by ``aten._weight_int4pack_mm_for_cpu``,
which dequantises ``w = (q - 8) * scale + zero``. Only bf16 activations take the vectorised
path on x86, so both keep activations in bf16.
"""

from __future__ import annotations

import torch
from torch import nn

INT4_GROUP = 32


class Int8Linear(nn.Module):
    """``nn.Linear`` with int8 weights and per-output-channel scales."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        # Round the scale to bf16 first: the kernel uses the bf16 scale, so q must match it.
        scale = (weight.abs().amax(dim=1).clamp(min=1e-8) / 127).to(torch.bfloat16).float()
        q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("scales", scale.to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None
                             else linear.bias.detach().to(torch.bfloat16))
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """``nn.Linear`` with group-wise int4 weights, packed for this CPU."""

    def __init__(self, linear: nn.Linear, group: int = INT4_GROUP) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        n, k = weight.shape
        if k % group:
            raise ValueError(f"in_features {k} is not a multiple of the int4 group {group}")
        grouped = weight.reshape(n, k // group, group)
        low, high = grouped.amin(dim=2), grouped.amax(dim=2)
        scale = ((high - low) / 15).clamp(min=1e-8)
        q = torch.round((grouped - low[..., None]) / scale[..., None]).clamp(0, 15)
        zero = low + 8 * scale
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.reshape(n, k).to(torch.int32).contiguous(), 1)
        scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("qweight", packed)
        self.register_buffer("scale_zero", scale_zero.to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None
                             else linear.bias.detach().to(torch.bfloat16))
        self.group = group
        self.out_features, self.in_features = n, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.qweight, self.group,
                                                        self.scale_zero)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def quantize(model: nn.Module, kind: str, group: int = INT4_GROUP) -> int:
    """Replace every ``nn.Linear`` in ``model`` in place; returns how many were replaced."""
    make = {"int8": Int8Linear, "int4": lambda lin: Int4Linear(lin, group)}[kind]
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name in names:
        # Only names are kept, so each bf16 weight is freed as soon as it is replaced: the peak
        # stays near the bf16 model, not bf16 + quantised copies of everything.
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(getattr(parent, child)))
    return len(names)
