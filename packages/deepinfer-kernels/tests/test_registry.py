"""The op registry: selection by tier order and capability, overrides and their errors, supports()
fallbacks, settings parsing, the report, and lazy imports (no triton on import)."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch
from deepinfer_kernels import REGISTRY, TIERS, Implementation, KernelSettings, OpRegistry
from deepinfer_kernels.settings import parse_bool, parse_overrides

# A throwaway module the test registries point their targets at.
_mod = types.ModuleType("_registry_test_targets")
_mod.calls = []


def _make(tag):
    def fn(*args, **kwargs):
        _mod.calls.append(tag)
        return tag

    return fn


for _tag in ("vendor", "tilelang", "triton", "ref"):
    setattr(_mod, f"impl_{_tag}", _make(_tag))
_mod.refuse_small = lambda x, *a, **k: "too small" if x.shape[0] < 4 else None
_mod.refuse_all = lambda x, *a, **k: "never"
sys.modules["_registry_test_targets"] = _mod
T = "_registry_test_targets"


def _registry(*impls: Implementation) -> OpRegistry:
    reg = OpRegistry()
    reg.declare("op", "test op")
    reg.declare("other", "second op")
    for impl in impls:
        reg.register(impl)
    return reg


def _forcing(reg: OpRegistry, **overrides: str):
    """`reg.configured` with these per-op overrides."""
    return reg.configured(KernelSettings(overrides=overrides))


def _impl(tier, **kw):
    return Implementation("op", tier, f"{T}:impl_{tier}", **kw)


def test_first_capable_tier_in_tier_order_wins():
    reg = _registry(_impl("ref"), _impl("triton"), _impl("tilelang"))
    assert [i.tier for i in reg.implementations("op")] == ["tilelang", "triton", "ref"]
    assert reg.call("op", torch.zeros(1)) == "tilelang"


def test_device_filter():
    reg = _registry(_impl("ref"), _impl("triton", devices=("cuda",)))
    assert reg.resolve("op", torch.zeros(1)).tier == "ref"
    assert reg.static_reason(reg.implementations("op")[0], "cpu", None) == "runs on cuda, not cpu"


def test_capability_filter():
    reg = _registry(_impl("ref"), _impl("triton", devices=("cuda",), min_capability=(9, 0)))
    triton = reg.implementations("op")[0]
    assert reg.static_reason(triton, "cuda", (8, 0)) == "needs compute capability >= 9.0"
    assert reg.static_reason(triton, "cuda", (9, 0)) is None
    assert reg.static_reason(triton, "cuda", (10, 0)) is None


def test_requires_filter_does_not_import():
    reg = _registry(_impl("ref"), _impl("vendor", requires=("surely_not_installed_mod_xyz",)))
    vendor = reg.implementations("op")[0]
    assert reg.static_reason(vendor, "cpu", None) == "surely_not_installed_mod_xyz is not installed"
    assert reg.call("op", torch.zeros(1)) == "ref"


def test_supports_fallback_per_call():
    reg = _registry(_impl("ref"), _impl("triton", supports=f"{T}:refuse_small"))
    assert reg.call("op", torch.zeros(8)) == "triton"
    assert reg.call("op", torch.zeros(2)) == "ref"


def test_no_tier_left_lists_the_reasons():
    reg = _registry(_impl("triton", supports=f"{T}:refuse_all"))
    with pytest.raises(NotImplementedError, match="triton: never"):
        reg.call("op", torch.zeros(1))
    reg = _registry(_impl("triton", devices=("cuda",)))
    with pytest.raises(NotImplementedError, match="triton: runs on cuda, not cpu"):
        reg.call("op", torch.zeros(1))


def test_tiers_lists_the_statically_capable_tiers_best_first():
    reg = _registry(_impl("ref"), _impl("triton", devices=("cuda",)), _impl("tilelang"))
    assert reg.tiers("op", "cpu") == ["tilelang", "ref"]
    with _forcing(reg, op="ref"):
        assert reg.tiers("op", torch.device("cpu")) == ["ref"]
    assert reg.tiers("op", "cpu") == ["tilelang", "ref"]


def test_override_selects_a_lower_tier():
    reg = _registry(_impl("ref"), _impl("triton"))
    with _forcing(reg, op="ref"):
        assert reg.call("op", torch.zeros(1)) == "ref"
        assert reg.static_reason(reg.implementations("op")[0], "cpu", None) == (
            "DEEPINFER_KERNELS selects ref"
        )


def test_override_of_unavailable_tier_is_not_silently_replaced():
    reg = _registry(_impl("ref"), _impl("triton", devices=("cuda",)))
    with _forcing(reg, op="triton"), pytest.raises(NotImplementedError, match="runs on cuda"):
        reg.call("op", torch.zeros(1))


def test_bad_override_names_list_the_choices():
    reg = _registry(_impl("ref"), _impl("triton"))
    with pytest.raises(ValueError, match="unknown op 'nope'; ops are op, other"):
        reg.check(KernelSettings(overrides={"nope": "ref"}))
    with pytest.raises(ValueError, match="has no 'vendor' implementation; it has triton, ref"):
        reg.check(KernelSettings(overrides={"op": "vendor"}))
    with pytest.raises(ValueError, match="is not one of " + ", ".join(TIERS)):
        parse_overrides("op=cutlass")
    with pytest.raises(ValueError, match="not of the form op=tier"):
        parse_overrides("op")


def test_parse_overrides_and_bools():
    assert parse_overrides(" fp8_linear=ref , moe_experts=triton,") == {
        "fp8_linear": "ref",
        "moe_experts": "triton",
    }
    assert parse_bool("X", "1") and parse_bool("X", "On") and not parse_bool("X", "")
    with pytest.raises(ValueError, match="DEEPINFER_BATCH_INVARIANT='maybe'"):
        parse_bool("DEEPINFER_BATCH_INVARIANT", "maybe")
    with pytest.raises(ValueError, match="kernels: 'a' is not of the form"):
        parse_overrides("a", "kernels")


def test_registration_errors():
    reg = _registry(_impl("ref"))
    with pytest.raises(ValueError, match="declared twice"):
        reg.declare("op", "again")
    with pytest.raises(ValueError, match="already has a 'ref'"):
        reg.register(_impl("ref"))
    with pytest.raises(ValueError, match="not declared"):
        reg.register(Implementation("ghost", "ref", f"{T}:impl_ref"))
    with pytest.raises(ValueError, match="tier 'gpu' is not one of"):
        Implementation("op", "gpu", f"{T}:impl_ref")
    with pytest.raises(KeyError, match="unknown op 'ghost'"):
        reg.implementations("ghost")


def test_target_is_imported_only_when_chosen():
    reg = _registry(_impl("ref"))
    reg.register(Implementation("other", "ref", "surely_missing_module_abc:fn"))
    assert reg.call("op", torch.zeros(1)) == "ref"  # the missing module was never imported
    with pytest.raises(ModuleNotFoundError):
        reg.call("other", torch.zeros(1))


def test_real_registry_resolves_ref_on_cpu():
    from deepinfer_kernels import ops  # noqa: F401

    for op in ("fp8_linear", "fp8_gemm", "moe_gate", "moe_experts", "act_quant_fp8"):
        impls = REGISTRY.implementations(op)
        assert {"ref", "triton"} <= {i.tier for i in impls}
        assert REGISTRY.tiers(op, "cpu") == ["ref"]
    for op in ("moe_gate", "act_quant_fp8"):  # the planned ops: test_routes.py
        assert REGISTRY.resolve(op, torch.zeros(1)).tier == "ref"


def _python(code: str, env: dict[str, str] | None = None) -> str:
    import os

    run_env = dict(os.environ)
    run_env.update(env or {})
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=run_env, check=False
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_importing_never_imports_triton_or_tilelang():
    code = (
        "import sys, torch\n"
        "import deepinfer_kernels\n"
        "from deepinfer_kernels import ops, quant\n"
        "from deepinfer_kernels.__main__ import report\n"
        "report()\n"
        "w, s = quant.quantize_fp8_blocks(torch.randn(32, 32))\n"
        "ops.fp8_linear(torch.randn(2, 32), w, s)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('triton', 'tilelang', 'deep_gemm', 'tile_kernels', 'torch_npu')))\n"
    )
    assert _python(code).strip() == "[]"


def test_report_and_override_argument():
    out = _python(
        "import runpy, sys; sys.argv = ['x', '--kernels', 'fp8_linear=ref']; "
        "runpy.run_module('deepinfer_kernels', run_name='__main__')"
    )
    assert "fp8_linear" in out and "-> ref" in out
    assert "plans on an H200" in out and "wo_b [5120, 8192]" in out and "T=8192" in out
    bad = subprocess.run(
        [sys.executable, "-m", "deepinfer_kernels", "--kernels", "fp8_linaer=ref"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode != 0 and "unknown op 'fp8_linaer'; ops are" in bad.stderr


def test_the_environment_is_not_read():
    """The package takes its settings as arguments: DEEPINFER_* variables change nothing."""
    out = _python(
        "from deepinfer_kernels import REGISTRY; print(REGISTRY.settings)",
        {"DEEPINFER_KERNELS": "fp8_linear=ref", "DEEPINFER_BATCH_INVARIANT": "1"},
    )
    assert "overrides={}" in out and "batch_invariant=False" in out


def test_triton_supports_checks_name_the_reason():
    """The GPU tiers' supports() refuse what their kernels do not handle; the call falls to ref."""
    from deepinfer_kernels.ops import moe as moe_ops

    x = torch.zeros(2, 64)
    h200 = ((9, 0), ("cuda", "triton", "ref"))
    f32_s3 = (torch.float8_e8m0fnu, torch.float32, torch.float8_e8m0fnu)
    plans, passed = moe_ops.plan(
        2, 2, 4, 128, 128, torch.bfloat16, f32_s3, True, False, False, *h200
    )
    assert [p.tier for p in plans] == ["ref"]
    assert "triton: s3 is torch.float32, the Triton experts read float8_e8m0fnu scales" in passed
    assert moe_ops.moe_gate_gpu_supports(x, torch.zeros(2048, 64)) == "2048 experts > 1024"
    assert moe_ops.moe_gate_gpu_supports(x, torch.zeros(384, 64)) == "input on cpu"


def test_batch_invariant_mode_keeps_overrides_and_restores():
    reg = _registry(_impl("ref"), _impl("triton"))
    with _forcing(reg, op="ref"):
        assert reg.batch_invariant is False
        with reg.batch_invariant_mode():
            assert reg.batch_invariant is True
            assert reg.settings.overrides == {"op": "ref"}
        assert reg.batch_invariant is False and reg.settings.overrides == {"op": "ref"}
    assert reg.settings == KernelSettings()


def test_configured_restores_the_settings_after_a_block_an_error_or_a_refusal():
    reg = _registry(_impl("ref"), _impl("triton"))
    before = reg.settings
    with reg.configured(KernelSettings(overrides={"op": "ref"}, batch_invariant=True)):
        assert reg.settings.overrides == {"op": "ref"} and reg.batch_invariant is True
    assert reg.settings == before
    with pytest.raises(RuntimeError, match="inside"), reg.configured(KernelSettings(overrides={})):
        assert reg.settings.overrides == {}
        raise RuntimeError("inside")
    assert reg.settings == before
    refused = KernelSettings(overrides={"op": "vendor"})
    with pytest.raises(ValueError, match="has no 'vendor' implementation"), reg.configured(refused):
        raise AssertionError("a refused setting must not run the block")
    assert reg.settings == before


def test_report_shows_routing_of_tiers_that_can_run(monkeypatch):
    """A tier that passes the device checks and splits its calls among kernels says how, on its
    own line; one that cannot run here does not."""
    from deepinfer_kernels.__main__ import report

    routed = [i for op in REGISTRY.ops() for i in REGISTRY.implementations(op) if i.routing]
    assert {(i.op, i.tier) for i in routed} >= {("fp8_gemm", "triton"), ("fp8_gemm", "cuda")}
    if not torch.cuda.is_available():  # only the cpu device is reported: no GPU tier can run
        assert not any(line.startswith("      ") for line in report().splitlines())
    monkeypatch.setattr(REGISTRY, "static_reason", lambda impl, dev, cap: None)
    lines = report().splitlines()
    for impl in routed:
        assert f"      {impl.tier}: {impl.routing}" in lines


def test_device_capability_is_none_off_cuda():
    from deepinfer_kernels.registry import device_capability

    assert device_capability(torch.device("cpu")) is None
    assert device_capability(torch.device("meta")) is None
