"""Splitting a built model, in one process: what each rank keeps, what is refused, and why.

Splitting runs no collective (only the forward does), so every rank's part
of a model can be made here with a stand-in group that only knows its rank
and size.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

import mlx_loom
from mlx_loom.errors import ImplementationFailed, ParallelRefused
from mlx_loom.host import PluginHost
from mlx_loom.loader import _build_split, _run_factory
from mlx_loom.parallel import ParallelPlan, Reduce, Resize, Split, Units, Vocab
from mlx_loom.parallel.build import RankView, prepare, split_model

from ..core.toyfamily import ToyPlugin, write_toy_checkpoint
from .support import write_quantized


def parts(path, mode: str, size: int, *, record: bool = True):
    """Every rank's ``(module, Parallel)``, each split from its own lazy build.

    ``record=False`` forgets where the weights live, so every slice is cut
    from the lazily loaded tensor instead of read from the file.
    """
    resolved = mlx_loom.resolve_model(path)
    if record:
        return [_build_split(resolved, mode, RankView(rank, size)) for rank in range(size)]
    plan = resolved.binding.implementation.parallel(resolved.family_config)
    out = []
    for rank in range(size):
        module = _run_factory(resolved)
        info, _ = split_model(module, plan, mode, RankView(rank, size), {}, what="m")
        out.append((module, info))
    return out


def whole(path) -> nn.Module:
    return mlx_loom.load(path)[0].module


def test_the_ranks_slices_together_are_the_whole_weights(checkpoints):
    full = whole(checkpoints["llama"])
    (a, _), (b, _) = parts(checkpoints["llama"], "tensor", 2)
    la, lb, lf = a.model.layers[0], b.model.layers[0], full.model.layers[0]
    joined = {
        "q": mx.concatenate([la.self_attn.q_proj.weight, lb.self_attn.q_proj.weight], axis=0),
        "o": mx.concatenate([la.self_attn.o_proj.weight, lb.self_attn.o_proj.weight], axis=1),
        "up": mx.concatenate([la.mlp.up_proj.weight, lb.mlp.up_proj.weight], axis=0),
        "down": mx.concatenate([la.mlp.down_proj.weight, lb.mlp.down_proj.weight], axis=1),
        "embed": mx.concatenate([a.model.embed_tokens.weight, b.model.embed_tokens.weight]),
    }
    assert mx.array_equal(joined["q"], lf.self_attn.q_proj.weight)
    assert mx.array_equal(joined["o"], lf.self_attn.o_proj.weight)
    assert mx.array_equal(joined["up"], lf.mlp.up_proj.weight)
    assert mx.array_equal(joined["down"], lf.mlp.down_proj.weight)
    assert mx.array_equal(joined["embed"], full.model.embed_tokens.weight)


def test_slices_read_from_the_files_equal_slices_of_the_loaded_tensors(checkpoints):
    read = parts(checkpoints["gemma4_text-q4"], "tensor", 2)
    sliced = parts(checkpoints["gemma4_text-q4"], "tensor", 2, record=False)
    for (r_module, r_info), (s_module, s_info) in zip(read, sliced, strict=True):
        assert r_info.sliced_bytes_read > 0 and r_info.sliced_whole == ()
        assert s_info.sliced_bytes_read == 0 and s_info.sliced_whole
        ours, theirs = (
            dict(tree_flatten(r_module.parameters())),
            dict(tree_flatten(s_module.parameters())),
        )
        assert ours.keys() == theirs.keys()
        assert all(mx.array_equal(ours[k], theirs[k]) for k in ours)


def test_a_rank_reads_exactly_its_slices(checkpoints):
    weights = dict(tree_flatten(whole(checkpoints["llama"]).parameters()))
    full = sum(v.nbytes for v in weights.values())
    norms = sum(v.nbytes for k, v in weights.items() if "norm" in k)
    # One key/value head and two ranks: each rank reads the k/v projections whole.
    kv = sum(v.nbytes for k, v in weights.items() if k.endswith(("k_proj.weight", "v_proj.weight")))
    for _, info in parts(checkpoints["llama"], "tensor", 2):
        assert info.sliced_bytes_read == (full - norms - kv) // 2 + kv
        assert info.weight_bytes == info.sliced_bytes_read + norms


def test_fewer_key_value_heads_than_ranks_gives_each_rank_a_whole_head(checkpoints):
    full = whole(checkpoints["llama"]).model.layers[0].self_attn  # 2 heads, 1 kv head
    for module, _ in parts(checkpoints["llama"], "tensor", 2):
        attn = module.model.layers[0].self_attn
        assert (attn.n_heads, attn.n_kv_heads) == (1, 1)
        assert mx.array_equal(attn.k_proj.weight, full.k_proj.weight)


def test_a_vocabulary_that_does_not_divide_splits_into_blocks(checkpoints):
    blocks = [m.model.embed_tokens for m, _ in parts(checkpoints["qwen3_next"], "pipeline", 3)]
    # 256 rows over 3 ranks: blocks of 86, the last holding the rest.
    assert [b.weight.shape[0] for b in blocks] == [86, 86, 84]
    assert [b.vocab_start for b in blocks] == [0, 86, 172]


def test_heads_the_group_does_not_divide_are_refused_naming_the_field(checkpoints):
    with pytest.raises(ParallelRefused) as err:
        parts(checkpoints["llama"], "tensor", 3)
    assert "num_attention_heads = 2 does not divide across 3 processes" in err.value.message
    assert "group sizes that would work: 2" in err.value.message
    assert "Launch 2 processes (mlx.launch -n 2" in err.value.fix


def test_a_refusal_suggests_the_other_mode_when_it_fits(checkpoints):
    # 2 key heads in the delta nets cannot split across 4; 4 layers make 4 stages.
    with pytest.raises(ParallelRefused) as err:
        parts(checkpoints["qwen3_next"], "tensor", 4)
    assert "linear_num_key_heads = 2" in err.value.message
    assert "--parallel pipeline" in err.value.fix


def test_a_microscaling_checkpoint_splits_its_uint8_scales_with_its_weights(checkpoints, tmp_path):
    path = write_quantized(checkpoints["llama"], tmp_path / "q", group_size=16, mode="nvfp4")
    full = whole(path).model.layers[0].self_attn
    (a, _), (b, _) = parts(path, "tensor", 2)
    halves = [m.model.layers[0].self_attn for m in (a, b)]
    for name, axis in (("q_proj", 0), ("o_proj", 1)):
        for leaf in ("weight", "scales"):
            joined = mx.concatenate([h[name][leaf] for h in halves], axis=axis)
            assert mx.array_equal(joined, full[name][leaf]), (name, leaf)
    assert halves[0].o_proj.mode == "nvfp4" and "biases" not in halves[0].o_proj


def test_a_quantized_input_slice_must_be_whole_groups(checkpoints, tmp_path):
    # The tiny config's delta-net out_proj has 32 inputs: 16 per rank, half a group of 32.
    path = write_quantized(checkpoints["qwen3_next"], tmp_path / "q")
    with pytest.raises(ParallelRefused) as err:
        parts(path, "tensor", 2)
    assert "quantized in groups of 32" in err.value.message
    assert "linear_num_value_heads" in err.value.message
    assert "no group size up to 64 works" in err.value.message
    assert "--parallel pipeline" in err.value.fix


def test_more_stages_than_layers_are_refused(checkpoints):
    with pytest.raises(ParallelRefused, match="num_hidden_layers = 2 is fewer than 3 stages"):
        parts(checkpoints["llama"], "pipeline", 3)


def test_gemma_stages_keep_kv_donors_with_the_layers_that_read_them(checkpoints):
    # Layers 3 and 4 read the caches of layers 1 and 2: layers 1-4 share a stage.
    ranges = [info.layers for _, info in parts(checkpoints["gemma4_text"], "pipeline", 2)]
    assert ranges == [(0, 1), (1, 5)]
    with pytest.raises(ParallelRefused, match="num_kv_shared_layers"):
        parts(checkpoints["gemma4_text"], "pipeline", 3)


def test_a_pipeline_rank_keeps_only_its_layers_and_caches(checkpoints):
    (first, a), (second, b) = parts(checkpoints["qwen3_next"], "pipeline", 2)
    assert (a.layers, b.layers) == ((0, 2), (2, 4))
    assert len(first.model.layers) == len(first.make_cache()) == 2
    assert second.model.stage.start == 2 and second.model.stage.rank == 1


# --- what is refused before anything is built --------------------------------------


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.proj = nn.Linear(4, 4, bias=True)


def test_a_plan_naming_a_module_the_model_lacks_is_a_plugin_fault():
    plan = ParallelPlan(vocab=Vocab(embeddings=("embed",)), tensor=(Split("nope", Units("x", 2)),))
    with pytest.raises(ImplementationFailed, match="'nope', which the built model does not have"):
        split_model(Tiny(), plan, "tensor", RankView(0, 2), {}, what="m")


def test_a_partial_sum_with_a_bias_is_a_plugin_fault():
    plan = ParallelPlan(
        vocab=Vocab(embeddings=("embed",)), tensor=(Split("proj", Units("x", 2), dim="in"),)
    )
    with pytest.raises(ImplementationFailed, match="has a bias that every rank would add"):
        split_model(Tiny(), plan, "tensor", RankView(0, 2), {}, what="m")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=True)


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.block = Block()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_biased_partial_sum_reduced_above_keeps_its_bias_on_rank_0_alone(rank):
    # gpt-oss's experts: down_proj's partial products meet at the MoE block's output.
    plan = ParallelPlan(
        vocab=Vocab(embeddings=("embed",)),
        tensor=(Split("block.proj", Units("x", 2), dim="in"), Reduce("block")),
    )
    model = Nested()
    model.block.proj.bias = mx.ones((4,))
    split_model(model, plan, "tensor", RankView(rank, 2), {}, what="m")
    assert model.block.proj.weight.shape == (4, 2)
    assert model.block.proj.bias.tolist() == ([1.0] * 4 if rank == 0 else [0.0] * 4)


def test_a_mode_the_plan_lacks_is_refused():
    plan = ParallelPlan(vocab=Vocab(embeddings=("embed",)), tensor=())
    with pytest.raises(ParallelRefused, match="declares no pipeline-parallel plan"):
        split_model(Tiny(), plan, "pipeline", RankView(0, 2), {}, what="m")


def test_an_unknown_mode_is_refused_naming_the_modes():
    with pytest.raises(ParallelRefused, match="modes: tensor, pipeline"):
        prepare("sideways", RankView(0, 2), implementation=None)


def test_one_process_is_refused_with_how_to_launch_more():
    with pytest.raises(ParallelRefused) as err:
        prepare("tensor", RankView(0, 1), implementation=None)
    assert "needs a group of two or more processes" in err.value.message
    assert "mlx.launch --backend ring -n 2" in err.value.fix


def test_an_implementation_without_a_plan_is_refused(tmp_path):
    host = PluginHost(plugins=[("toy", ToyPlugin())], entry_points=False)
    resolved = mlx_loom.resolve_model(write_toy_checkpoint(tmp_path / "toy"), host=host)
    with pytest.raises(ParallelRefused, match="'toy.lm.v1' declares no parallel plan"):
        prepare("tensor", RankView(0, 2), implementation=resolved.binding.implementation)


def test_load_in_one_process_refuses_parallel(checkpoints):
    with pytest.raises(ParallelRefused, match="this process is alone"):
        mlx_loom.load(checkpoints["llama"], parallel="tensor")


def test_loom_generate_in_one_process_refuses_parallel_with_exit_code_3(checkpoints, capsys):
    from mlx_loom.cli.main import main

    code = main(["generate", "--model", str(checkpoints["llama"]), "--parallel", "tensor"])
    err = capsys.readouterr().err
    assert code == 3
    assert "loom: refused: parallel='tensor' needs a group of two or more processes" in err
    assert "fix: Start every process with MLX's launcher" in err


def test_resizing_an_attribute_the_module_lacks_is_a_plugin_fault():
    plan = ParallelPlan(
        vocab=Vocab(embeddings=("embed",)), tensor=(Resize("proj", {"n_heads": Units("x", 2)}),)
    )
    with pytest.raises(
        ImplementationFailed, match=r"resizes proj.n_heads, which is not an integer"
    ):
        split_model(Tiny(), plan, "tensor", RankView(0, 2), {}, what="m")
