"""A plugin's own cache kinds: registered through a hook or its Family, restored by PromptCache."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_loom import PromptCache
from mlx_loom.errors import CacheError
from mlx_loom.host import PluginHost, resolve_model
from mlx_loom.loader import build_model
from mlx_loom.plugin import (
    GENERATE,
    PLUGIN_API_VERSION,
    Family,
    Graph,
    ModelType,
    hookimpl,
)

from .toyfamily import ToyConfig, ToyLM, ToyPlugin, write_toy_checkpoint


class TallyCache:
    """A cache kind of the plugin's own: counts the tokens it has seen."""

    kind = "TallyCache"

    def __init__(self, seen: int = 0) -> None:
        self.seen = seen

    @property
    def offset(self) -> int:
        return self.seen

    @property
    def state(self) -> list[mx.array]:
        return [mx.array([self.seen])]

    @property
    def meta_state(self) -> list[str]:
        return ["tally"]

    @classmethod
    def from_state(cls, state, meta_state) -> TallyCache:
        return cls(int(state[0].item()))

    def is_trimmable(self) -> bool:
        return False


class TallyLM(ToyLM):
    def make_cache(self) -> list:
        return [TallyCache()]


def build_tally(ctx) -> TallyLM:
    cfg = ctx.family_config
    return TallyLM(cfg.vocab_size, cfg.hidden_size)


class HookPlugin(ToyPlugin):
    def __init__(self, kinds=(TallyCache,)) -> None:
        super().__init__(factory=build_tally)
        self.kinds = list(kinds)

    @hookimpl
    def loom_cache_kinds(self):
        return self.kinds


class FamilyPlugin:
    FAMILY = Family(
        name="tally",
        model_types=(ModelType("toy_lm", ToyConfig, ("vocab_size", "hidden_size")),),
        graphs=(Graph("tally.lm", factory=build_tally),),
        loader="tally.hf",
        capabilities=frozenset({GENERATE}),
        cache_kinds=(TallyCache,),
    )

    @hookimpl
    def loom_plugin_api_version(self):
        return PLUGIN_API_VERSION

    @hookimpl
    def loom_families(self):
        return [self.FAMILY]


def model_of(plugin, tmp_path):
    host = PluginHost(plugins=[("tally", plugin)], entry_points=False)
    return build_model(resolve_model(write_toy_checkpoint(tmp_path / "ckpt"), host=host))


@pytest.mark.parametrize("plugin", [HookPlugin(), FamilyPlugin()], ids=["hook", "family"])
def test_a_registered_cache_kind_round_trips_through_prompt_cache_files(plugin, tmp_path):
    model = model_of(plugin, tmp_path)
    assert model.binding.cache_kinds["TallyCache"] is TallyCache
    cache = PromptCache(model)
    cache.cache[0].seen = 3
    cache.record([1, 2, 3])
    cache.save(tmp_path / "turn.safetensors")
    restored = PromptCache.load(tmp_path / "turn.safetensors", model)
    assert (restored.cache[0].seen, restored.tokens) == (3, [1, 2, 3])


def test_an_unregistered_cache_kind_cannot_be_saved(tmp_path):
    model = model_of(HookPlugin(kinds=()), tmp_path)
    with pytest.raises(CacheError, match="TallyCache, which is not a registered cache kind"):
        PromptCache(model).save(tmp_path / "turn.safetensors")


def test_a_file_naming_a_kind_this_registry_lacks_is_refused_on_load(tmp_path):
    saved_by = model_of(HookPlugin(), tmp_path / "a")
    cache = PromptCache(saved_by)
    cache.save(tmp_path / "turn.safetensors")
    without = model_of(HookPlugin(kinds=()), tmp_path / "a")  # same directory, no kind
    with pytest.raises(CacheError, match="names cache kind 'TallyCache', which is not registered"):
        PromptCache.load(tmp_path / "turn.safetensors", without)


def test_a_plugin_claiming_a_core_cache_kind_is_quarantined():
    class Impostor(TallyCache):
        kind = "KVCache"

    host = PluginHost(plugins=[("tally", HookPlugin(kinds=(Impostor,)))], entry_points=False)
    record = host.record("tally")
    assert record.status == "quarantined"
    assert "Cache kind 'KVCache' is claimed by both" in record.reason


def test_two_plugins_registering_one_cache_kind_are_both_quarantined():
    other = HookPlugin()
    other.impl_id, other.model_type = "other.lm", "other_lm"
    other.profile_list = []
    host = PluginHost(plugins=[("tally", HookPlugin()), ("other", other)], entry_points=False)
    assert host.record("tally").status == host.record("other").status == "quarantined"
    assert "cache kind 'TallyCache' is also registered by other" in host.record("tally").reason


def test_a_cache_kind_hook_returning_a_non_class_is_quarantined():
    host = PluginHost(plugins=[("tally", HookPlugin(kinds=("TallyCache",)))], entry_points=False)
    assert "loom_cache_kinds returned a str; expected type" in host.record("tally").reason
