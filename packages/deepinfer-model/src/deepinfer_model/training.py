"""Training mode for the real model: quantisation-aware, with straight-through gradients.

The inference model holds its weights in the checkpoint formats (FP8 e4m3 32x32 blocks, FP4
e2m1 experts, an FP8 Engram table), which autograd cannot train. `enable_training_(module)`
gives every such weight container an fp32 `master` parameter; while it is set, the container
computes from the master with the checkpoint's rounding simulated on the fly, and the gradient
passes through each rounding unchanged (the straight-through estimator):

- `FP8Linear`: activations quantised per 32 to FP8 e4m3 (UE8M0 scales) and the master rounded
  to FP8 32x32 blocks, as `ops.fp8_linear` computes;
- routed experts (`MoE`): the same activation rounding and the master rounded to FP4 e2m1 per
  32, then the reference's clamped SwiGLU with the routing weight before W2;
- the Engram table: each gathered row rounded to FP8 per 32 as the checkpoint stores it;
- the KV fake-quantisation the model always applies (FP8 window KV, FP4 compressed KV and index
  keys/queries) passes gradients the same way (`straight_through`).

Everything else (norms, mHC, attention, compressors, the router) is the inference code itself,
run over whole sequences from an empty cache, with the plain float parameters made trainable.
Not differentiable by nature: the indexer's top-k and candidate-block choices and the router's
expert choice (their scores still get gradients where they weight something: the routing
weights do, the indexer's scores do not, so a training script fits the indexer with its own
loss through `Attention.observer`). The router biases are not trained by gradient either (V4.1
balances experts without an auxiliary loss; see `balance_router_bias_`).

`training_values(module)` returns every checkpoint tensor's float value (masters for the
quantised weights), ready for `tiny_checkpoint.checkpoint_tensors`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from deepinfer_kernels import quant
from torch import nn

from .layers.engram import EngramTable
from .layers.linear import FP4Weight, FP8Linear
from .layers.rounding import straight_through, unquantized

__all__ = [
    "balance_router_bias_",
    "enable_training_",
    "straight_through",
    "training_values",
    "unquantized",
]


def _containers(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every quantised-weight container under `module`."""

    for name, mod in module.named_modules():
        if isinstance(mod, (FP8Linear, FP4Weight, EngramTable)):
            yield name, mod


def _logical_weight(mod: nn.Module) -> torch.Tensor:
    """The fp32 [out, in] value a container's checkpoint weight stands for."""

    if isinstance(mod, FP8Linear):
        return quant.dequantize_fp8_blocks(mod.weight, mod.scale, torch.float32)
    if isinstance(mod, FP4Weight):
        order = quant.fp4_checkpoint_order if mod.fragment_order else (lambda w: w)
        return quant.dequantize_fp4(order(mod.weight), mod.scale, torch.float32)
    return quant.act_dequant_fp8(mod.weight, mod.scale, torch.float32)


def _plain(name: str, p: torch.Tensor) -> bool:
    return p.dtype in (torch.float32, torch.bfloat16, torch.float16) and not name.endswith(
        ".master"
    )


@torch.no_grad()
def enable_training_(
    module: nn.Module, values: dict[str, torch.Tensor] | None = None, prefix: str = ""
) -> list[nn.Parameter]:
    """Put `module` (a `Model` or part of one, e.g. `model.mtp`) in training mode.

    Every quantised-weight container gets an fp32 `master` [out, in] (from `values`, keyed by
    checkpoint name `prefix + name + ".weight"`, else the value its current weight stands
    for); plain float parameters become trainable (overwritten from `values` where given),
    except the router biases (`balance_router_bias_`). Returns the trainable parameters."""
    values = values or {}
    trainable: list[nn.Parameter] = []
    containers = dict(_containers(module))
    for name, mod in containers.items():
        key = f"{prefix}{name}.weight"
        start = values[key] if key in values else _logical_weight(mod)
        dev = mod.weight.device
        mod.master = nn.Parameter(start.detach().to(dev, torch.float32).clone())
        trainable.append(mod.master)
    quantised = {f"{n}.{leaf}" for n in containers for leaf in ("weight", "scale")}
    for name, p in module.named_parameters():
        if name in quantised or not _plain(name, p):
            continue
        if f"{prefix}{name}" in values:
            p.copy_(values[f"{prefix}{name}"].to(p.device, p.dtype))
        if name.rsplit(".", 1)[-1] in ("bias", "bias_vl") and ".gate." in f".{name}":
            continue
        p.requires_grad_(True)
        trainable.append(p)
    return trainable


def training_values(module: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every checkpoint tensor of `module` as a float value (masters for quantised weights,
    the parameters themselves otherwise; no scales), keyed by checkpoint name with `prefix`."""
    containers = dict(_containers(module))
    out: dict[str, torch.Tensor] = {}
    quantised = {f"{n}.{leaf}" for n in containers for leaf in ("weight", "scale")}
    for name, mod in containers.items():
        w = mod.master if mod.master is not None else _logical_weight(mod)
        out[f"{prefix}{name}.weight"] = w.detach()
    for name, p in module.named_parameters():
        if name not in quantised and _plain(name, p):
            out[f"{prefix}{name}"] = p.detach()
    return out


@torch.no_grad()
def balance_router_bias_(gate: nn.Module, ids: torch.Tensor, rate: float) -> None:
    """V4.1's auxiliary-loss-free balancing: move each expert's selection bias by `rate`
    toward equal load, from the expert ids [T, k] this gate chose in a step (over-used experts
    down, under-used up)."""
    n = gate.bias.shape[0]
    load = torch.bincount(ids.flatten(), minlength=n).float()
    gate.bias.add_(rate * torch.sign(load.mean() - load))
