"""The MLX install and device ``loom explain`` names, the wired limit generation runs in
on Metal (sized as mlx-lm sizes it, restored after), and a native extension that does not
load becoming a reason, never a crash."""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import pytest

import mlx_loom.cpu
from mlx_loom import device
from mlx_loom.cpu import native
from mlx_loom.cli.main import main
from mlx_loom.cpu.path import resolve_cpu_path
from mlx_loom.errors import KernelUnavailable

GB = 1024**3
#: mx.device_info() of each backend, as MLX 0.32.4 reports them (Metal's keys are mlx-lm's).
METAL = {
    "device_name": "Apple M2",
    "memory_size": 32 * GB,
    "max_recommended_working_set_size": 22 * GB,
}
CUDA = {"device_name": "NVIDIA H100", "architecture": "sm_90", "total_memory": 80 * GB}
CPU = {"device_name": "AMD EPYC", "architecture": "x86_64"}


# --- the wired limit as data -------------------------------------------------------------


def test_metal_wires_its_recommended_working_set_for_a_model_that_fits():
    assert device.wired_plan(METAL, 4 * GB) == device.WiredPlan(22 * GB)


def test_a_model_near_the_working_set_is_wired_with_a_warning():
    plan = device.wired_plan(METAL, 21 * GB)
    assert plan.limit == 22 * GB
    assert plan.warning is not None and "recommended working set" in plan.warning


@pytest.mark.parametrize("info", [CUDA, CPU], ids=["cuda", "cpu"])
def test_devices_without_a_recommended_working_set_wire_nothing(info):
    assert device.wired_plan(info, 4 * GB) == device.WiredPlan(None)


# --- the wired limit as a context --------------------------------------------------------


@pytest.fixture
def fake_metal(monkeypatch):
    """mx.device_info() as Metal's, and mx.set_wired_limit recording each call."""
    calls: list[int] = []
    limit = {"now": 0}

    def set_wired_limit(n: int) -> int:
        calls.append(n)
        old, limit["now"] = limit["now"], n
        return old

    monkeypatch.setattr(device.mx, "device_info", lambda: METAL)
    monkeypatch.setattr(device.mx, "set_wired_limit", set_wired_limit)
    return calls


class _Tiny:
    def parameters(self):
        return {"w": mx.zeros((4, 4))}


def test_generation_wires_the_working_set_and_restores_the_old_limit(fake_metal):
    with device.wired_limit(_Tiny()):
        assert fake_metal == [22 * GB]
    assert fake_metal == [22 * GB, 0]


def test_two_engine_threads_share_one_limit_restored_when_the_last_leaves(fake_metal):
    outer = device.wired_limit(_Tiny())
    inner = device.wired_limit(_Tiny())
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)
    assert fake_metal == [22 * GB]  # one engine still generates: the limit stays
    inner.__exit__(None, None, None)
    assert fake_metal == [22 * GB, 0]


def test_on_this_cpu_the_wired_limit_is_never_touched(monkeypatch):
    monkeypatch.setattr(device.mx, "set_wired_limit", lambda n: pytest.fail("wired on a CPU"))
    with device.wired_limit(_Tiny()):
        pass


# --- what loom explain reports -----------------------------------------------------------


def test_the_report_names_the_backend_package_device_and_memory():
    got = device.report(CPU)
    assert got.backend == "cpu" and got.device == "cpu: AMD EPYC"
    assert any(p.startswith("mlx-cpu ") for p in got.packages)
    assert got.memory_bytes is not None and got.memory_bytes > 0  # the system's memory
    assert got.working_set_bytes is None and got.problem is None


def test_device_memory_is_read_from_each_backends_own_key():
    assert device.report(CUDA).memory_bytes == 80 * GB
    metal = device.report(METAL)
    assert (metal.memory_bytes, metal.working_set_bytes) == (32 * GB, 22 * GB)


def test_two_mlx_backends_installed_side_by_side_is_a_problem_with_a_fix(monkeypatch):
    monkeypatch.setattr(
        device, "installed_backend_packages", lambda: ("mlx-cpu 0.32.4", "mlx-cuda-12 0.32.4")
    )
    problem = device.report(CPU).problem
    assert problem is not None
    assert "mlx-cpu and mlx-cuda-12" in problem and "pip uninstall" in problem


# --- a native extension that does not load -----------------------------------------------


@pytest.fixture
def native_fails_to_import(monkeypatch):
    """``from . import _native`` raises, as a build against another libmlx would."""
    native._load.cache_clear()
    monkeypatch.delattr(mlx_loom.cpu, "_native", raising=False)
    monkeypatch.setitem(sys.modules, "mlx_loom.cpu._native", None)
    yield
    native._load.cache_clear()


@pytest.mark.parametrize(
    ("built", "says"), [(True, "do not load against the installed MLX"), (False, "not built")]
)
def test_an_extension_that_does_not_import_is_a_reason_and_cpu_native_refuses_with_it(
    native_fails_to_import, monkeypatch, built, says
):
    monkeypatch.setattr(native, "_built", lambda: built)
    why = native.unavailable_reason()
    assert why is not None and says in why
    with pytest.raises(KernelUnavailable) as refused:
        resolve_cpu_path("cpu", cpu_kernels="cpu-native")
    assert says in str(refused.value)
    # The CPU default then says why it is not the native set (never silently another).
    path = resolve_cpu_path("cpu")
    assert path.kernel_set == "cpu-ops" and says in path.kernel_set_reason


def test_loom_explain_names_the_backend_device_memory_and_native_kernels(capsys):
    assert main(["explain", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "mlx backend            cpu  (mlx-cpu " in out
    assert "device                 cpu: " in out
    assert "(system memory)" in out
    assert "native cpu kernels     " in out
    line = next(row for row in out.splitlines() if row.startswith("native cpu kernels"))
    if native.unavailable_reason() is None:  # the instruction sets its kernels use
        assert line.endswith(native.describe_available()) and "int8 products on " in line
    assert main(["explain", "tiny", "--json"]) == 0
    mlx = json.loads(capsys.readouterr().out)["mlx"]
    assert mlx["backend"] == "cpu" and mlx["problem"] is None
    assert mlx["memory_bytes"] > 0 and mlx["working_set_bytes"] is None


def test_loom_explain_shows_why_the_native_kernels_do_not_load(native_fails_to_import, capsys):
    assert main(["explain", "tiny", "--cpu-kernels", "cpu-ops"]) == 0
    out = capsys.readouterr().out
    line = next(row for row in out.splitlines() if row.startswith("native cpu kernels"))
    assert "native CPU kernels" in line and "available" not in line
