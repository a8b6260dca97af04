"""Tests for custom_partitioning.py (stdlib unittest, 8 forced CPU devices).

Run from the repository root: ``python -m unittest -v``.

Tests whose behaviour depends on the partitioner run once per partitioner:
each such class is generated as ``...Shardy`` and ``...GSPMD`` variants. Set
``JAX_USE_SHARDY_PARTITIONER=1`` (or ``0``) to run only that variant.
"""

import os
import re
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import unittest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from custom_partitioning import custom_partitioning

_ENV_SHARDY = os.environ.get("JAX_USE_SHARDY_PARTITIONER")
PARTITIONERS = {"Shardy": True, "GSPMD": False}
if _ENV_SHARDY is not None:
  _want = _ENV_SHARDY.lower() in ("1", "true", "yes", "on")
  PARTITIONERS = {k: v for k, v in PARTITIONERS.items() if v == _want}


def both_partitioners(cls):
  """Adds one subclass of test class ``cls`` per partitioner to its module.

  Use as ``both_partitioners(FooTest); del FooTest`` so that only the
  variants are collected.
  """
  module = vars(sys.modules[cls.__module__])
  for label, shardy in PARTITIONERS.items():
    name = cls.__name__ + label
    module[name] = type(name, (cls,), {"shardy": shardy,
                                       "__qualname__": name,
                                       "__module__": cls.__module__})


class CPTestCase(unittest.TestCase):
  """Base: sets the partitioner for each test; small helpers."""

  shardy = None  # None: leave the process default alone

  def setUp(self):
    super().setUp()
    if self.shardy is not None:
      old = jax.config.jax_use_shardy_partitioner
      jax.config.update("jax_use_shardy_partitioner", self.shardy)
      self.addCleanup(jax.config.update, "jax_use_shardy_partitioner", old)

  @staticmethod
  def mesh(shape=(8,), names=("x",)):
    return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape),
                names)

  @staticmethod
  def hlo(jitted, *args):
    """Compiled (post-partitioning) HLO text of ``jitted`` on ``args``."""
    return jitted.lower(*args).compile().as_text()

  def assertCollectives(self, text, present=(), absent=()):
    for name in present:
      self.assertIn(name, text, f"expected {name} in the compiled HLO")
    for name in absent:
      self.assertNotIn(name, text, f"unexpected {name} in the compiled HLO")


def elementwise_op(body=lambda x: jnp.sin(x) * 2.0, rule="i j -> i j"):
  """A custom-partitioned elementwise op that keeps its operand sharding."""
  op = custom_partitioning(body)

  def partition(mesh, arg_shapes, result_shape):
    s = arg_shapes[0].sharding
    return mesh, body, s, (s,)

  def infer(mesh, arg_shapes, result_shape):
    return arg_shapes[0].sharding

  op.def_partition(partition, infer_sharding_from_operands=infer,
                   sharding_rule=rule)
  return op


class ElementwiseTest(CPTestCase):

  def test_values_and_no_collectives(self):
    op = elementwise_op()
    s = NamedSharding(self.mesh(), P("x"))
    x = jax.device_put(np.arange(64 * 8, dtype=np.float32).reshape(64, 8), s)
    f = jax.jit(op, in_shardings=s, out_shardings=s)
    np.testing.assert_allclose(f(x), np.sin(np.asarray(x)) * 2.0, rtol=1e-6)
    self.assertCollectives(self.hlo(f, x),
                           absent=("all-gather", "all-reduce", "all-to-all"))


both_partitioners(ElementwiseTest)
del ElementwiseTest

HERE = os.path.dirname(os.path.abspath(__file__))


class ReadmeTest(unittest.TestCase):

  def test_readme_example_runs(self):
    """The README's example is real code: run it (it asserts its results)."""
    with open(os.path.join(HERE, "README.md")) as f:
      blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    example = [b for b in blocks if "def_partition" in b]
    self.assertEqual(len(example), 1, "README has one full example")
    exec(compile(example[0], "README.md", "exec"), {"__name__": "readme"})


if __name__ == "__main__":
  unittest.main()
