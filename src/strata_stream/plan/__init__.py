"""`strata-stream plan`: will a model run here, in how much memory, and how fast.

`model_bytes` reads the checkpoint's headers (local or the hub's metadata), `arena` asks the
loader's arena rule, `hit_rate` replays a routing trace at that arena, `speed` turns the misses
into decode ceilings, and `plan` puts them together (docs/plan.md).
"""

from strata_stream.plan.plan import Plan, format_plan, make_plan

__all__ = ["Plan", "format_plan", "make_plan"]
