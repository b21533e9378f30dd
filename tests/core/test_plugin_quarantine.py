"""Quarantine that holds: whatever a plugin does at import or in a hook, the host carries on.

Installed plugins are simulated for real: each test writes a module and its
``.dist-info`` (METADATA + entry_points.txt) into a directory on
``sys.path``, so discovery goes through the real entry-point machinery
in-process. Every test is time-bounded: the host's per-call limit is set to
two seconds (generous for a loaded machine, short for a hang), and each test
asserts the host finished within :data:`BOUND`, so a regression that hangs
fails instead of stalling the suite. Hanging plugin code waits on an event
that the test releases at the end, so no thread outlives its test.
"""

from __future__ import annotations

import _thread
import os
import shutil
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from mlx_loom.errors import PolicyError
from mlx_loom.host import PluginHost, PluginPolicy, hookimpl, resolve_model
from mlx_loom.host._bounded import DEFAULT_TIMEOUT, TIMEOUT_ENV, timeout_from_env
from mlx_loom.loader import build_model
from mlx_loom.plugin import Implementation, Kernel, ModelType

from .toyfamily import ToyConfig, ToyPlugin, build_toy, write_toy_checkpoint

LIMIT = 2.0  # seconds the host waits for one plugin call in these tests (hangs cost this)
BOUND = 15.0  # seconds any one test's host may take, hangs included

RELEASE = threading.Event()  # set at teardown: hanging plugin code then returns


@pytest.fixture(autouse=True)
def _release_hanging_plugins():
    RELEASE.clear()
    yield
    RELEASE.set()


@contextmanager
def within(seconds: float = BOUND):
    start = time.monotonic()
    yield
    elapsed = time.monotonic() - start
    assert elapsed < seconds, f"took {elapsed:.1f} s (bound {seconds} s)"


GOOD = """
from mlx_loom.plugin import GENERATE, PLUGIN_API_VERSION, Family, Graph, ModelType, hookimpl
from toyfamily_support import ToyConfig, build_toy

FAMILY = Family(
    name="{name}",
    model_types=(ModelType("{name}_lm", ToyConfig, ("vocab_size", "hidden_size")),),
    graphs=(Graph("{name}.lm", factory=build_toy),),
    loader="{name}.hf",
    capabilities=frozenset({{GENERATE}}),
)

{extra}

@hookimpl
def loom_plugin_api_version():
    return PLUGIN_API_VERSION


@hookimpl
def loom_families():
    return [FAMILY]
"""


class Site:
    """A directory on sys.path holding "installed" plugin distributions."""

    def __init__(self, root: Path) -> None:
        self.root = root
        shutil.copy(Path(__file__).with_name("toyfamily.py"), root / "toyfamily_support.py")

    def install(
        self, name: str, *, extra: str = "", dist: str | None = None, version: str = "1.0"
    ) -> None:
        dist = dist or f"loomq-{name}"
        module = f"loomq_{name}_{dist.replace('-', '_')}"
        (self.root / f"{module}.py").write_text(GOOD.format(name=name, extra=extra))
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[mlx_loom]\n{name} = {module}\n")

    def host(self, *names: str, **kwargs) -> PluginHost:
        kwargs.setdefault("timeout", LIMIT)
        with within():
            return PluginHost(policy=PluginPolicy.allow(*names), **kwargs)


@pytest.fixture
def site(tmp_path, monkeypatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    before = set(sys.modules)
    yield Site(root)
    for name in set(sys.modules) - before:
        if name.startswith("loomq_") or name == "toyfamily_support":
            del sys.modules[name]


def quarantined(host: PluginHost, name: str) -> str:
    record = host.record(name)
    assert record is not None and record.status == "quarantined", record
    return record.reason


def test_a_well_behaved_installed_plugin_loads_beside_the_broken_ones(site):
    site.install("good")
    site.install("bad", extra="raise RuntimeError('boom')")
    host = site.host("good", "bad")
    assert host.record("good").status == "loaded"
    assert "import failed: RuntimeError: boom" in quarantined(host, "bad")
    assert set(host.registry.implementations) == {"good.lm"}


@pytest.mark.parametrize(
    "statement, shown",
    [
        ("raise SystemExit(2)", "import failed: SystemExit: 2"),
        ("raise KeyboardInterrupt('from the plugin')", "import failed: KeyboardInterrupt"),
        ("raise GeneratorExit()", "import failed: GeneratorExit"),
        ("import sys; sys.exit('bye')", "import failed: SystemExit: bye"),
    ],
)
def test_base_exceptions_raised_at_import_quarantine_the_plugin(site, statement, shown):
    site.install("good")
    site.install("hostile", extra=statement)
    host = site.host("good", "hostile")
    assert shown in quarantined(host, "hostile")
    assert host.record("good").status == "loaded"


def test_a_plugin_that_hangs_at_import_is_quarantined_after_the_limit(site):
    site.install("good")
    site.install(
        "hangs",
        extra="from tests_release import RELEASE\nRELEASE.wait(60)",
    )
    sys.modules["tests_release"] = sys.modules[__name__]
    try:
        host = site.host("good", "hangs")
    finally:
        del sys.modules["tests_release"]
    reason = quarantined(host, "hangs")
    assert f"import did not return within {LIMIT:g} s" in reason and TIMEOUT_ENV in reason
    assert host.record("good").status == "loaded"


def test_arrays_a_plugin_builds_lazily_at_import_are_usable_afterwards(site):
    site.install("arrays", extra="import mlx.core as mx\nTABLE = mx.arange(4) * 3")
    host = site.host("arrays")
    module = sys.modules[next(m for m in sys.modules if m.startswith("loomq_arrays"))]
    assert host.record("arrays").status == "loaded"
    assert module.TABLE.sum().item() == 18  # evaluated on the import thread, usable here


def test_an_entry_point_name_claimed_by_two_distributions_is_reported_and_neither_loads(site):
    site.install("twin", dist="loomq-twin-a", version="1.0")
    site.install("twin", dist="loomq-twin-b", version="2.0")
    site.install("good")
    host = site.host("twin", "good")
    twins = [r for r in host.records if r.name == "twin"]
    assert sorted((r.distribution, r.status) for r in twins) == [
        ("loomq-twin-a", "quarantined"),
        ("loomq-twin-b", "quarantined"),
    ]
    assert all("claimed by 2 distributions" in r.reason for r in twins)
    assert "loomq-twin-a 1.0; loomq-twin-b 2.0" in twins[0].reason
    assert host.record("good").status == "loaded"


# --- hooks -----------------------------------------------------------------------


class Hostile(ToyPlugin):
    """A toy plugin one of whose hooks misbehaves as ``how`` says."""

    def __init__(self, hook: str, how) -> None:
        super().__init__(model_type="hostile_lm", impl_id="hostile.lm")
        self.profile_list = []
        self.hook, self.how = hook, how

    def _maybe(self, hook, normal):
        return self.how() if hook == self.hook else normal()

    @hookimpl
    def loom_plugin_api_version(self):
        return self._maybe("loom_plugin_api_version", lambda: self.api_version)

    @hookimpl
    def loom_model_types(self):
        return self._maybe("loom_model_types", super().loom_model_types)

    @hookimpl
    def loom_implementations(self):
        return self._maybe("loom_implementations", super().loom_implementations)


def host_with(hostile) -> PluginHost:
    with within():
        return PluginHost(
            plugins=[("hostile", hostile), ("toy", ToyPlugin())], entry_points=False, timeout=LIMIT
        )


def raising(exc):
    def go():
        raise exc

    return go


@pytest.mark.parametrize("hook", ["loom_plugin_api_version", "loom_implementations"])
@pytest.mark.parametrize(
    "exc", [RuntimeError("boom"), SystemExit(1), KeyboardInterrupt(), GeneratorExit()]
)
def test_anything_a_hook_raises_quarantines_only_that_plugin(hook, exc):
    host = host_with(Hostile(hook, raising(exc)))
    assert f"{hook} raised {type(exc).__name__}" in quarantined(host, "hostile")
    assert host.record("toy").status == "loaded"
    assert set(host.registry.implementations) == {"toy.lm.v1"}


def test_a_hook_that_hangs_is_quarantined_after_the_limit():
    host = host_with(Hostile("loom_implementations", lambda: RELEASE.wait(60)))
    assert f"loom_implementations did not return within {LIMIT:g} s" in quarantined(host, "hostile")
    assert host.record("toy").status == "loaded"


@pytest.mark.parametrize("answer", [1.0, None, "one", "1", "1.0.0", object()])
def test_an_api_version_that_is_not_major_minor_quarantines_the_plugin(answer):
    host = host_with(Hostile("loom_plugin_api_version", lambda: answer))
    assert "'MAJOR.MINOR' string" in quarantined(host, "hostile")


@pytest.mark.parametrize(
    "interrupt",
    [lambda: os.kill(os.getpid(), signal.SIGINT), _thread.interrupt_main],
    ids=["sigint", "interrupt_main"],
)
def test_a_users_ctrl_c_while_the_host_waits_still_stops_the_program(interrupt):
    hanging = Hostile("loom_implementations", lambda: RELEASE.wait(60))
    threading.Timer(0.2, interrupt).start()
    with within(), pytest.raises(KeyboardInterrupt):
        PluginHost(plugins=[("hostile", hanging)], entry_points=False, timeout=30)


# --- registrations type-checked at the boundary -----------------------------------


@pytest.mark.parametrize(
    "hook, make, field",
    [
        (
            "loom_model_types",
            lambda: [ModelType(name=123, schema=ToyConfig, fingerprint_fields=())],
            "ModelType.name",
        ),
        (
            "loom_implementations",
            lambda: [
                Implementation(id=None, graph="g", loader="l", model_types={"m"}, factory=build_toy)
            ],
            "Implementation.id",
        ),
        (
            "loom_implementations",
            lambda: [
                Implementation(
                    id="hostile.lm", graph="g", loader="l", model_types={"m"}, factory="build"
                )
            ],
            "Implementation.factory",
        ),
        ("loom_model_types", lambda: [Kernel("k", "vulkan", fn=print)], "backend 'vulkan'"),
    ],
)
def test_a_wrongly_typed_registration_quarantines_the_plugin_naming_the_field(hook, make, field):
    host = host_with(Hostile(hook, make))
    reason = quarantined(host, "hostile")
    assert f"{hook} raised RegistrationError" in reason and field in reason


def test_a_forged_registration_is_caught_at_the_boundary():
    def forged():
        (impl,) = ToyPlugin(model_type="hostile_lm", impl_id="hostile.lm").loom_implementations()
        object.__setattr__(impl, "loader", "   ")  # bypasses the constructor's checks
        return [impl]

    reason = quarantined(host_with(Hostile("loom_implementations", forged)), "hostile")
    assert "Implementation.loader must be a non-blank string" in reason


def test_a_hook_returning_an_unexpected_type_of_item_quarantines_the_plugin():
    host = host_with(Hostile("loom_implementations", lambda: ["hostile.lm"]))
    assert "loom_implementations returned a str; expected Implementation" in quarantined(
        host, "hostile"
    )


def test_models_of_other_plugins_still_build_when_one_is_quarantined(tmp_path):
    host = host_with(Hostile("loom_implementations", raising(SystemExit(1))))
    model = build_model(resolve_model(write_toy_checkpoint(tmp_path / "toy"), host=host))
    assert model.implementation.id == "toy.lm.v1"


# --- the limit itself -------------------------------------------------------------


def test_the_limit_defaults_and_is_tuned_by_the_environment():
    assert timeout_from_env({}) == DEFAULT_TIMEOUT
    assert timeout_from_env({TIMEOUT_ENV: "2.5"}) == 2.5


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf", "nan"])
def test_a_limit_that_is_not_a_positive_number_is_a_usage_error(value):
    with pytest.raises(PolicyError, match=TIMEOUT_ENV):
        timeout_from_env({TIMEOUT_ENV: value})
