"""`train.precision: auto` on any machine: the CPU-flag logic is fed other CPUs' flags here."""

from __future__ import annotations

import json

import pytest
from conftest import widen_consoles
from typer.testing import CliRunner

from zfctl.cli import app
from zfctl.plan import plan_from_dict, plan_to_dict, precision, resolve_plan
from zfctl.plan.precision import CpuInfo, cpu_native_bf16, read_cpu_info, resolve_precision

# Trimmed real flag lines.
EPYC_AVX2 = "fpu sse sse2 avx f16c fma avx2 bmi2 sha_ni vaes vpclmulqdq"  # this project's CI box
SAPPHIRE_RAPIDS = "sse avx2 avx512f avx512bw avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8"
COOPER_LAKE = "sse avx2 avx512f avx512bw avx512_bf16"
ICE_LAKE = "sse avx2 avx512f avx512bw avx512_vnni"  # AVX-512 but no bf16
GRAVITON3 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp sve i8mm bf16 dgh rng"
GRAVITON2 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop"


def cpu(flags: str | None, machine: str = "x86_64", model: str = "test CPU") -> CpuInfo:
    return CpuInfo(model=model, machine=machine, flags=None if flags is None else frozenset(flags.split()))


@pytest.mark.parametrize(
    "info, native",
    [
        (cpu(EPYC_AVX2), False),
        (cpu(ICE_LAKE), False),
        (cpu(COOPER_LAKE), True),
        (cpu(SAPPHIRE_RAPIDS), True),
        (cpu(GRAVITON3, "aarch64"), True),
        (cpu(GRAVITON2, "aarch64"), False),
        (cpu("bf16 avx2", "x86_64"), False),  # aarch64's flag name means nothing on x86
        (cpu(None), False),  # unknown: the safe choice
    ],
    ids=["epyc-avx2", "ice-lake", "cooper-lake", "sapphire-rapids", "graviton3", "graviton2", "x86-arm-name",
         "unknown"],
)
def test_native_bf16_from_flags(info: CpuInfo, native: bool) -> None:
    got, evidence = cpu_native_bf16(info)
    assert got is native
    assert "test CPU" in evidence
    choice = resolve_precision("auto", device="cpu", cpu=info)
    assert choice.precision == ("bf16" if native else "fp32")
    assert choice.reason.startswith(f"train.precision auto -> {choice.precision} on the CPU: ")


def test_read_cpu_info_parses_x86_and_aarch64(tmp_path) -> None:
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\n"
                   "model name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n")
    info = read_cpu_info(str(x86))
    assert info.model == "AMD EPYC" and info.flags == {"fpu", "avx2", "fma"}
    arm = tmp_path / "arm"
    arm.write_text(f"processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: {GRAVITON3}\nCPU implementer\t: 0x41\n")
    assert "bf16" in read_cpu_info(str(arm)).flags
    assert read_cpu_info(str(tmp_path / "missing")).flags is None


def test_gpu_and_explicit_choices() -> None:
    assert resolve_precision("auto", device="cuda", cuda_bf16=True, cuda_name="H100").precision == "bf16"
    no_bf16 = resolve_precision("auto", device="cuda", cuda_bf16=False, cuda_name="V100")
    assert no_bf16.precision == "fp32" and "V100 has no bf16" in no_bf16.reason
    for explicit in ("bf16", "fp16", "fp32"):  # never second-guessed, whatever the CPU
        assert resolve_precision(explicit, device="cpu", cpu=cpu(EPYC_AVX2)).precision == explicit


@pytest.mark.parametrize("flags, want", [(EPYC_AVX2, "fp32"), (SAPPHIRE_RAPIDS, "bf16")])
def test_hub_model_plan_resolves_auto_and_says_why(monkeypatch: pytest.MonkeyPatch, flags: str, want: str) -> None:
    monkeypatch.setattr(precision, "read_cpu_info", lambda: cpu(flags, model="Fake CPU"))
    notes: list[str] = []
    plan = resolve_plan("someorg/somemodel", "alpaca-sample", overrides=["train.device=cpu"], notes=notes)
    assert plan.train.precision == want
    assert any(n.startswith(f"train.precision auto -> {want}") and "Fake CPU" in n for n in notes)
    # The plan stored in run folders and checkpoints holds the concrete dtype, not 'auto'.
    assert plan_from_dict(plan_to_dict(plan)).train.precision == want


def test_presets_with_explicit_precision_keep_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "read_cpu_info", lambda: cpu(EPYC_AVX2))
    notes: list[str] = []
    assert resolve_plan("llama2-7b", "alpaca", notes=notes).train.precision == "bf16"
    assert resolve_plan("tiny-llama", "alpaca-sample", notes=notes).train.precision == "fp32"
    assert not any("train.precision" in n for n in notes)


def test_zfctl_plan_prints_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "read_cpu_info", lambda: cpu(EPYC_AVX2, model="AMD EPYC"))
    widen_consoles(monkeypatch, 300, err_only=True)
    args = ["plan", "someorg/somemodel", "--data", "alpaca-sample", "--set", "train.device=cpu"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "note: train.precision auto -> fp32 on the CPU: AMD EPYC has no native bf16" in result.output
    result = CliRunner().invoke(app, [*args, "--json"])
    out = json.loads(result.stdout)
    assert out["plan"]["train"]["precision"] == "fp32"
    assert any("auto -> fp32" in n for n in out["notes"])
