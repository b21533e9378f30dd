"""Layers model families share if they want: gated MLPs, routed experts, RoPE kinds, loading.

Nothing here is required: a family may write its own modules. What lives here
is solved once, one way, so three families do not carry three versions.
"""
