"""MoE-layer rows of the kernel benchmark: one V4.1 MoE layer at real dimensions (random FP4
experts), the fused kernels against a torch loop over the active experts, and the router gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from bench_common import Rotating, bench_graphs, bench_ms

# One V4.1 MoE layer: hidden, expert intermediate, routed experts, top-k, SwiGLU limit.
MOE_D, MOE_I, MOE_E, MOE_K, MOE_LIMIT = 5120, 2304, 384, 6, 10.0


def moe_layer_weights(g: torch.Generator):
    """Random FP4 experts of one MoE layer on CUDA: (w1, s1, w3, s3, w2, s2), and the bytes one
    expert's three matrices occupy (packed values + UE8M0 scales)."""
    d, i, e = MOE_D, MOE_I, MOE_E

    def fp4(n, kk):
        packed = torch.randint(
            -128, 128, (e, n, kk // 2), device="cuda", generator=g, dtype=torch.int8
        )
        scale = torch.randint(
            118, 123, (e, n, kk // 32), device="cuda", generator=g, dtype=torch.uint8
        )
        return packed, scale.view(torch.float8_e8m0fnu)

    (w1, s1), (w3, s3), (w2, s2) = fp4(i, d), fp4(i, d), fp4(d, i)
    return (w1, s1, w3, s3, w2, s2), 3 * (i * d // 2 + i * d // 32)


def moe_routed_inputs(t: int, n_sets: int, g: torch.Generator):
    """n_sets random routed batches of t tokens: [(x [t, D] bf16, weights [t, k], ids [t, k])]."""
    sets = []
    for _ in range(n_sets):
        x = torch.randn(t, MOE_D, device="cuda", generator=g).bfloat16()
        ids = torch.rand(t, MOE_E, device="cuda", generator=g).topk(MOE_K, dim=-1).indices
        sets.append((x, torch.rand(t, MOE_K, device="cuda", generator=g), ids))
    return sets


def moe_rows(tokens_list, quick):
    from deepinfer_kernels import quant
    from deepinfer_kernels.triton import moe as tmoe

    d, i, e, k, limit = MOE_D, MOE_I, MOE_E, MOE_K, MOE_LIMIT
    g = torch.Generator(device="cuda").manual_seed(0)
    (w1, s1, w3, s3, w2, s2), per_expert_bytes = moe_layer_weights(g)
    rows = []
    for t in tokens_list:
        sets = moe_routed_inputs(t, 8 if t <= 256 else 1, g)
        active = sum(int(torch.unique(s[2]).numel()) for s in sets) / len(sets)
        nbytes = active * per_expert_bytes + 2 * t * d * 2 + t * k * 12
        flops = 6.0 * t * k * d * i

        def base(x, tw, ids):
            y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            for ex in torch.unique(ids).tolist():
                r, c = torch.nonzero(ids == ex, as_tuple=True)
                a = quant.dequantize_fp4(w1[ex], s1[ex], torch.bfloat16)
                b = quant.dequantize_fp4(w3[ex], s3[ex], torch.bfloat16)
                o = quant.dequantize_fp4(w2[ex], s2[ex], torch.bfloat16)
                xe = x[r]
                gte, up = (
                    (xe @ a.t()).float().clamp(max=limit),
                    (xe @ b.t()).float().clamp(-limit, limit),
                )
                h = (F.silu(gte) * up * tw[r, c, None]).bfloat16()
                y.index_add_(0, r, (h @ o.t()).float())
            return y.bfloat16()

        t_torch = (
            bench_ms(Rotating(base, sets), rep_ms=50 if t > 256 else 100)
            if (t <= 256 or not quick)
            else float("nan")
        )
        route_ms = bench_ms(Rotating(lambda x, tw, ids: tmoe.build_routing(tw, ids, e, 16), sets))
        rows.append(
            dict(
                op="moe_routing",
                shape=f"T={t} E=384 k=6",
                ms=route_ms,
                flops=0.0,
                bytes=t * k * 12,
                torch_ms=float("nan"),
                mm_only_ms=float("nan"),
            )
        )
        if t <= 256:
            ms_graph = bench_graphs(
                lambda x, tw, ids: tmoe.moe_experts(x, tw, ids, w1, s1, w3, s3, w2, s2, limit),
                sets,
            )
            rows.append(
                dict(
                    op="moe_experts[graph]",
                    shape=f"T={t} E=384 k=6 D=5120 I=2304",
                    ms=ms_graph,
                    flops=flops,
                    bytes=nbytes,
                    torch_ms=t_torch,
                    mm_only_ms=float("nan"),
                )
            )
        for name, inv in (("auto", False), ("inv", True)):
            fn = Rotating(
                lambda x, tw, ids, inv=inv: tmoe.moe_experts(
                    x, tw, ids, w1, s1, w3, s3, w2, s2, limit, batch_invariant=inv
                ),
                sets,
            )
            rows.append(
                dict(
                    op=f"moe_experts[{name}]",
                    shape=f"T={t} E=384 k=6 D=5120 I=2304",
                    ms=bench_ms(fn),
                    flops=flops,
                    bytes=nbytes,
                    torch_ms=t_torch,
                    mm_only_ms=float("nan"),
                )
            )
    # the gate at one decode and one prefill size
    wg = (torch.randn(e, d, device="cuda", generator=g) * 0.02).bfloat16()
    bias = torch.randn(e, device="cuda", generator=g) * 0.1
    for t in (64, 8192):
        x = torch.randn(t, d, device="cuda", generator=g).bfloat16()
        ms = bench_ms(lambda x=x: tmoe.moe_gate(x, wg, bias, k, 1.5))
        ref_ms = bench_ms(lambda x=x: _torch_gate(x, wg, bias, k, 1.5))
        rows.append(
            dict(
                op="moe_gate",
                shape=f"T={t} E=384 D=5120",
                ms=ms,
                flops=2.0 * t * e * d,
                bytes=e * d * 2 + t * d * 2 + t * k * 12,
                torch_ms=ref_ms,
                mm_only_ms=float("nan"),
            )
        )
    return rows


def _torch_gate(x, wg, bias, k, route_scale):
    s = torch.sqrt(F.softplus(x.float() @ wg.float().t()))
    ids = (s + bias).topk(k, dim=-1).indices
    w = s.gather(-1, ids)
    return w / (w.sum(-1, keepdim=True) + 1e-20) * route_scale, ids
