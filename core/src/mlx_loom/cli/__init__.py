"""The ``loom`` command line; see :mod:`mlx_loom.cli.main`."""
