"""The Metal verify policy, as data: MLX's attention dispatch and the windows it allows.

No GPU runs here, so the rules are tested as what they are: a table read from
MLX's Metal source (cited and pinned in ``mlx_loom.host._metal_attention``),
checked against the MLX that is installed (its version, and the kernel header
its wheel ships), and the windows that table allows for the geometries of
real models: MiniCPM5-1B (16 query / 2 KV heads of 128), Qwen3-Next-80B-A3B
(16 / 2 of 256) and Gemma 4 (mlx-lm's ``gemma4_text`` defaults: 8 / 1 heads,
sliding layers of 256 over a window of 512, full layers of 512).
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx
import mlx.core as mx
import pytest

from mlx_loom.errors import CapabilityRefused
from mlx_loom.host import VERIFY_POLICIES
from mlx_loom.host import _metal_attention as rules
from mlx_loom.host._verify import metal_policy
from mlx_loom.nn import AttentionGeometry

MINICPM5_1B = AttentionGeometry(16, 2, 128)
QWEN3_NEXT_80B = AttentionGeometry(16, 2, 256)
GEMMA4_SLIDING = AttentionGeometry(8, 1, 256, window=512)
GEMMA4_FULL = AttentionGeometry(8, 1, 512)
#: Apple GPU device classes as MLX reads them (last letter of the architecture name).
DEVICES = ["g", "p", "s", "d"]


# --- the table is MLX's, at the pinned version -----------------------------------------


def test_the_rules_are_pinned_to_the_installed_mlx():
    # A different MLX may dispatch differently: re-read its source, then bump the pin.
    assert mx.__version__ == rules.MLX_VERSION


def _sdpa_vector_header() -> str:
    header = Path(mlx.__path__[0]) / "include/mlx/backend/metal/kernels/sdpa_vector.h"
    return header.read_text()


def test_the_installed_mlx_ships_the_vector_kernels_the_rules_name():
    header = _sdpa_vector_header()
    kernels = set(re.findall(r"\[\[kernel\]\] void (\w+)\(", header))
    assert kernels == {
        "sdpa_vector",
        "sdpa_vector_2pass_1",
        "sdpa_vector_2pass_1_gqa",
        "sdpa_vector_2pass_2",
    }


def test_the_vector_kernels_partition_keys_by_index_and_skip_the_causally_hidden_ones():
    """Why a window query equals its decode step when kernel and blocks agree."""
    header = _sdpa_vector_header()
    one_pass = header.split("[[kernel]] void sdpa_vector_2pass_1(")[0]
    two_pass = header.split("[[kernel]] void sdpa_vector_2pass_1(")[1].split("[[kernel]]")[0]
    gqa = header.split("[[kernel]] void sdpa_vector_2pass_1_gqa(")[1].split("[[kernel]]")[0]
    # one pass: key i goes to SIMD-group i % 32 whatever the key count
    assert "for (int i = simd_gid; i < N; i += BN)" in one_pass
    assert "use_key = i <= (N - int(tpg.y) + int(q_seq_idx));" in one_pass
    # two passes: key i goes to block i % blocks
    assert "int i = block_idx;" in two_pass and "i += blocks" in two_pass
    assert "use_key = ii <= (N - q_seq_len + int(q_seq_idx));" in two_pass
    # the decode-only variant cuts the keys into contiguous chunks instead
    assert "const int chunk = (N + blocks - 1) / blocks;" in gqa


@pytest.mark.parametrize(
    "qL,gqa,kernel",
    [
        (1, 8, "vector"),
        (4, 8, "vector"),  # 4 * 8 = 32
        (5, 8, "unfused"),  # 40 > 32: a GQA-8 model's --num-draft-tokens 4 leaves the vector kernel
        (8, 4, "vector"),
        (9, 1, "full"),  # more than 8 queries: the steel kernel
        (2, 16, "vector"),
        (3, 16, "unfused"),
    ],
)
def test_the_query_length_thresholds(qL, gqa, kernel):
    g = AttentionGeometry(gqa * 2, 2, 128)
    assert rules.metal_attention_kernel(qL, 100, g, "g") == kernel


def test_head_dims_without_a_vector_kernel_run_unfused():
    for dims in [(80, 80), (192, 192), (32, 32)]:
        g = AttentionGeometry(8, 8, *dims)
        assert rules.metal_attention_kernel(1, 100, g, "g") == "unfused"
    assert rules.metal_attention_kernel(1, 100, AttentionGeometry(8, 8, 192, 128), "g") == "vector"
    # head dim 512: a vector kernel for one GQA-8 query from 1024 keys only
    assert rules.metal_attention_kernel(1, 2048, GEMMA4_FULL, "g") == "vector-d512"
    assert rules.metal_attention_kernel(2, 2048, GEMMA4_FULL, "g") == "unfused"


@pytest.mark.parametrize(
    "device,n_simds,N,blocks",
    [
        ("s", 8, 1024, 64),
        ("s", 8, 1025, 128),
        ("s", 4, 20000, 64),
        ("s", 8, 8193, 256),
        ("s", 8, 32769, 512),
        ("s", 8, 65537, 1024),
        ("d", 2, 8193, 256),
        ("d", 2, 8192, 128),
        ("d", 4, 20000, 128),
        ("d", 6, 16384, 512),
        ("d", 8, 65536, 1024),
        ("g", 4, 100000, 64),
        ("g", 3, 100000, 32),
    ],
)
def test_the_two_pass_block_counts(device, n_simds, N, blocks):
    assert rules.two_pass_blocks(device, n_simds, N) == blocks


def test_two_passes_start_at_1024_keys_on_large_devices_and_4096_with_gqa():
    mha, gqa = AttentionGeometry(8, 8, 128), AttentionGeometry(8, 2, 128)
    assert rules.metal_attention_kernel(1, 1023, mha, "s") == "vector"
    assert rules.metal_attention_kernel(1, 1024, mha, "s").startswith("vector-2pass/")
    assert rules.metal_attention_kernel(1, 100000, mha, "g") == "vector"
    assert rules.metal_attention_kernel(1, 4095, gqa, "g") == "vector"
    assert rules.metal_attention_kernel(1, 4096, gqa, "g") == "vector-2pass/64"


# --- the windows the policy allows, per geometry ---------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_minicpm5_1b_windows(device):
    policy = metal_policy(device)
    g = [MINICPM5_1B]
    assert policy.refusal(g) == ""
    assert policy.window(100, 5, g) == 4  # --num-draft-tokens 4 would leave the vector kernel
    assert policy.window(100, 9, g) == 4
    assert policy.window(100, 3, g) == 3
    # From 8192 keys a one-token step runs the chunked GQA-8 decode kernel: no window.
    assert policy.window(8191, 4, g) == 1
    assert policy.window(20000, 4, g) == 1


def test_minicpm5_1b_windows_stop_where_two_passes_begin():
    g = [MINICPM5_1B]
    # GQA: two passes from 4096 keys; a window may not reach them from below.
    assert metal_policy("g").window(4090, 4, g) == 4  # keys up to 4094
    assert metal_policy("g").window(4093, 4, g) == 2  # 4094, 4095; 4096 is two-pass
    assert metal_policy("g").window(4094, 4, g) == 1
    assert metal_policy("g").window(4095, 4, g) == 4  # 2-pass with 64 blocks throughout
    # Large devices: two passes from 1024 keys; one block count for n_simds 8..32 ('s')
    assert metal_policy("s").window(1021, 4, g) == 2
    assert metal_policy("s").window(1023, 4, g) == 1  # 1024 keys: 64 blocks, 1025: 128
    assert metal_policy("s").window(1024, 4, g) == 4


@pytest.mark.parametrize("device", DEVICES)
def test_qwen3_next_80b_windows(device):
    policy = metal_policy(device)
    g = [QWEN3_NEXT_80B]
    assert policy.refusal(g) == ""
    assert policy.window(100, 5, g) == 4  # GQA 8: four queries at most on the vector kernel
    # Head dim 256 has no chunked decode kernel: long contexts keep their windows.
    assert policy.window(100000, 4, g) == 4


def test_qwen3_next_80b_windows_are_cut_at_block_count_changes():
    g = [QWEN3_NEXT_80B]
    assert metal_policy("d").window(16380, 4, g) == 3  # 16384 keys: 128 -> 512 blocks
    assert metal_policy("d").window(16382, 4, g) == 1
    assert metal_policy("d").window(16383, 4, g) == 4
    assert metal_policy("s").window(8190, 4, g) == 2  # 8193 keys: 128 -> 256 blocks
    assert metal_policy("s").window(32766, 4, g) == 2
    assert metal_policy("s").window(65534, 4, g) == 2


@pytest.mark.parametrize("device", DEVICES)
def test_gemma4_is_refused_for_its_head_dim_512_layers(device):
    policy = metal_policy(device)
    why = policy.refusal([GEMMA4_SLIDING, GEMMA4_FULL])
    assert "unfused" in why and "of 512" in why
    with pytest.raises(CapabilityRefused, match="no verify window of 2 tokens") as err:
        policy.check([GEMMA4_SLIDING, GEMMA4_FULL])
    assert "of 512" in str(err.value) and err.value.fix
    # Its sliding layers alone would allow windows, until the window wraps.
    assert policy.refusal([GEMMA4_SLIDING]) == ""
    assert policy.window(100, 4, [GEMMA4_SLIDING]) == 4
    assert policy.window(509, 4, [GEMMA4_SLIDING]) == 3  # keys up to 512
    assert policy.window(600, 4, [GEMMA4_SLIDING]) == 1


def test_a_model_that_declares_no_attention_geometry_is_refused_where_kernels_vary():
    assert "declares no attention geometry" in metal_policy("g").refusal([])
    assert VERIFY_POLICIES.for_backend("cpu").refusal([]) == ""


def test_a_gqa_above_16_never_allows_a_window_of_2():
    why = metal_policy("g").refusal([AttentionGeometry(32, 1, 128)])
    assert "a window of 2 runs MLX's unfused attention" in why


def test_the_cpu_policy_allows_every_window_and_cuda_stays_refused():
    cpu = VERIFY_POLICIES.for_backend("cpu")
    for g in (MINICPM5_1B, QWEN3_NEXT_80B, GEMMA4_FULL):
        assert cpu.window(9000, 9, [g]) == 9
        assert cpu.refusal([g]) == ""
    assert VERIFY_POLICIES.for_backend("metal").kernel is not None
    with pytest.raises(CapabilityRefused, match="not been measured"):
        VERIFY_POLICIES.for_backend("cuda")
