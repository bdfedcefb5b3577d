"""`splicer splice` and `splicer inspect`: which modules a checkpoint holds (`modules`), what a restore names
(`selection`, `rules`), the checks before writing (`validate`, `unquantized`), the config edit (`config_edit`) and the
splice itself (`core`).

`from splicer.splice import splice` keeps its meaning: the entry points of `core` are named here.
"""

from .core import plan_splice, select_modules, splice, verify_plan, write_plan

__all__ = ["plan_splice", "select_modules", "splice", "verify_plan", "write_plan"]
