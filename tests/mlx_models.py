"""The tests' checkpoints: strata_stream.mlx_lm.random_model (tiny by default)."""

from strata_stream.mlx_lm.random_model import CONFIGS, make_checkpoint

__all__ = ["CONFIGS", "make_checkpoint"]
