"""Host policy: which installed plugins may load.

The policy is decided before a plugin is imported, so a blocked plugin's code
never runs. It comes from the host (``PluginPolicy.allow(...)``) or from the
``MLX_LOOM_PLUGINS`` environment variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict

from ..errors import PolicyError

POLICY_ENV = "MLX_LOOM_PLUGINS"


class PluginPolicy(BaseModel):
    """Which plugins a host lets load: all, an allow-list, a deny-list, or none."""

    model_config = ConfigDict(frozen=True)

    mode: Literal["all", "allow", "deny", "none"] = "all"
    names: frozenset[str] = frozenset()

    @classmethod
    def allow(cls, *names: str) -> PluginPolicy:
        return cls(mode="allow", names=frozenset(names))

    @classmethod
    def deny(cls, *names: str) -> PluginPolicy:
        return cls(mode="deny", names=frozenset(names))

    @classmethod
    def none(cls) -> PluginPolicy:
        return cls(mode="none")

    @classmethod
    def parse(cls, value: str) -> PluginPolicy:
        """Parse the ``MLX_LOOM_PLUGINS`` syntax.

        ``"a,b"`` allows only a and b; ``"-a,-b"`` denies a and b; ``""``
        allows none; ``"*"`` allows all.
        """
        items = [v.strip() for v in value.split(",") if v.strip()]
        if not items:
            return cls.none()
        if items == ["*"]:
            return cls()
        denied = [i for i in items if i.startswith("-")]
        if denied and len(denied) != len(items):
            raise PolicyError(
                f"{POLICY_ENV}={value!r} mixes allowed and denied (-name) plugins.",
                fix="Use either a list of names to allow, or a list of -names to deny.",
            )
        if denied:
            return cls.deny(*(d[1:] for d in denied))
        return cls.allow(*items)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PluginPolicy:
        env = os.environ if environ is None else environ
        if POLICY_ENV not in env:
            return cls()
        return cls.parse(env[POLICY_ENV])

    def permits(self, name: str) -> bool:
        if self.mode == "all":
            return True
        if self.mode == "none":
            return False
        if self.mode == "allow":
            return name in self.names
        return name not in self.names

    def describe(self) -> str:
        if self.mode in ("all", "none"):
            return self.mode
        return f"{self.mode} {', '.join(sorted(self.names))}"
