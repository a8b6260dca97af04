"""jax's legacy shims, withdrawn from custom_partitioning.py's reach.

CI's newest-release cell puts this directory first on PYTHONPATH, so every
Python process it starts (the suite's subprocesses too) loads this file.
Before the module is first imported, each name below is deleted from jax,
or made to raise when code in a file named custom_partitioning.py reads it;
jax's own code keeps them. The suite then fails wherever the module still
reads a shim, as it would on the release that deletes it.

Add a name here when a jax release marks one the module reads (a comment
"legacy", "compat shim" or "TODO ... remove" beside it in jax's source), and
say so in the module's names table (``_NAMES``, or the table of the extra
that reads it).
"""

import importlib.abc
import sys

# (where, name, what jax says of it). Each is withdrawn on releases where
# jax keeps it only as a shim; on older ones the name is the real thing.
WITHDRAWN = [
    ("jax.extend.core", "ClosedJaxpr",
     "0.11.0 merged ClosedJaxpr into Jaxpr; kept for export (noqa: F401)"),
    ("jax.interpreters.batching", "primitive_batchers",
     "backwards compat shim of fancy_primitive_batchers. TODO: delete"),
    ("jax._src.core.Jaxpr", "jaxpr",
     "Legacy accessor from the days of ClosedJaxpr ... remove uses and delete"),
    ("jax._src.core.Jaxpr", "literals", "legacy ClosedJaxpr name for consts"),
    ("jax._src.core.Jaxpr", "map_jaxpr", "Legacy ClosedJaxpr method"),
    ("jax._src.core.Jaxpr", "__init__(jaxpr, consts)",
     "Legacy ClosedJaxpr(jaxpr, consts) construction ... migrate callers and "
     "remove"),
    ("jax._src.core.Jaxpr", "replace(jaxpr=...)",
     "Legacy ClosedJaxpr.replace(jaxpr=..., consts=...) form ... remove"),
    ("jax._src.config", "use_shardy_partitioner",
     "DEPRECATED: Shardy is now always enabled; this flag has no effect"),
]


def _from_module() -> bool:
  """Whether the code that called the caller is custom_partitioning.py's."""
  caller = sys._getframe(2)
  return caller.f_code.co_filename.endswith("custom_partitioning.py")


def _refuse(what: str, why: str):
  raise AttributeError(
      f"custom_partitioning.py read {what}, which this CI cell withdraws "
      f"(jax: {why}); read its successor (.ci/withdrawn/sitecustomize.py)")


def _withdraw() -> None:
  import jax  # noqa: F401  (the module imports it next anyway)
  from jax._src import config, core
  # From jax 0.12.1 the flag is a name only (jax.config.update still sets
  # it, by name, for users' code); jax's own code no longer reads it.
  version = tuple(int("".join(filter(str.isdigit, p)) or 0)
                  for p in jax.__version__.split(".")[:3])
  if version >= (0, 12, 1) and hasattr(config, "use_shardy_partitioner"):
    delattr(config, "use_shardy_partitioner")
  if not hasattr(core.Jaxpr, "with_consts"):
    return  # before jax 0.11 these names are the real thing, not shims
  import jax.extend.core
  import jax.interpreters.batching
  why = {name: note for _, name, note in WITHDRAWN}
  # A release that deleted a shim already has nothing to withdraw.
  for module in (jax.extend.core, jax.interpreters.batching):
    for where, name, _ in WITHDRAWN:
      if where == module.__name__ and hasattr(module, name):
        delattr(module, name)

  def guarded(name, shim):
    def get(self):
      if _from_module():
        _refuse(f"Jaxpr.{name}", why[name])
      return shim.__get__(self, core.Jaxpr)
    return property(get)

  for name in ("jaxpr", "literals", "map_jaxpr"):
    if name in vars(core.Jaxpr):
      setattr(core.Jaxpr, name, guarded(name, vars(core.Jaxpr)[name]))

  init, replace = core.Jaxpr.__init__, core.Jaxpr.replace

  def __init__(self, constvars, *args, **kwargs):
    if isinstance(constvars, core.Jaxpr) and _from_module():
      _refuse("Jaxpr(jaxpr, consts)", why["__init__(jaxpr, consts)"])
    init(self, constvars, *args, **kwargs)

  def replace_(self, **kwargs):
    if "jaxpr" in kwargs and _from_module():
      _refuse("Jaxpr.replace(jaxpr=...)", why["replace(jaxpr=...)"])
    return replace(self, **kwargs)

  core.Jaxpr.__init__ = __init__
  core.Jaxpr.replace = replace_


class _BeforeTheModule(importlib.abc.MetaPathFinder):
  """Withdraws the names just before ``import custom_partitioning``."""

  def find_spec(self, name, path=None, target=None):
    if name == "custom_partitioning":
      sys.meta_path.remove(self)
      _withdraw()
    return None


sys.meta_path.insert(0, _BeforeTheModule())
