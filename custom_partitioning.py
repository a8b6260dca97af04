# custom_partitioning.py: JAX's custom_partitioning in one vendorable file.
# Copyright 2026 The custom_partitioning.py Authors.
# SPDX-License-Identifier: Apache-2.0
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
# The API (names, callback contracts, sharding-rule notation) is JAX's
# (jax.experimental.custom_partitioning, Copyright The JAX Authors,
# Apache-2.0); this file is an independent implementation of it.

"""Custom SPMD partitioning for JAX, in one file you can vendor.

A drop-in replacement for ``jax.experimental.custom_partitioning``: the
``custom_partitioning`` decorator gives an op its own sharding rules and a
per-shard implementation, so XLA's SPMD partitioner runs it on shards instead
of gathering its operands. Under Shardy (jax's default) the op is
partitioned while jax lowers the program, on every backend, Cloud TPU
included: Shardy's propagation, run in-process, places its operands,
``partition`` is asked, and the op becomes a manual computation of the
per-shard program (I.2 to I.6).
Under GSPMD (jax 0.12.0.1 and older; 0.12.1 removed it) it is one XLA
custom call, as upstream: while compiling, XLA asks this module (through
Python callbacks) for the result's sharding and a per-shard program lowered
from the author's ``lower_fn`` (II.7).
The contract is in the docstrings of ``custom_partitioning`` and
``def_partition``.
Its check, ``check_partitioning``, has its own (III.2).
``python custom_partitioning.py`` runs ``_demo`` (III.4).

Upstream's names, here: ``_resolve_kwargs`` is ``_Signature.positional``
(called by ``custom_partitioning._split``), and
``_custom_partitioning_lowering_rule`` is ``_lowering_rule`` (I.3), which
partitions at lowering (``_first_pass``, ``_second_pass``,
``_replace_tagged_calls``) where upstream always emits the custom call.
Upstream's ``_ShardingCallbackInfo`` is ``_Op``, its ``_sharding_callbacks``
``_registry``, and its ``_custom_partitioning_partition``,
``_custom_partitioning_infer_sharding_from_operands`` and
``_custom_partitioning_propagate_user_sharding`` are ``_answer_partition``,
``_answer_infer`` and ``_answer_propagate``, which XLA calls through
``_register_partitioner`` (II.7).

Version
-------
1.6.4 (``__version__``), MAJOR.MINOR.PATCH: MAJOR for a change that can
break code that ran (an API changed or removed, a jax release dropped),
MINOR for an addition (a feature, a jax release supported), PATCH for a fix.
Every change a user can notice bumps it, in the same commit.

How to vendor
-------------
Copy this file into your project and import it instead of
``jax.experimental.custom_partitioning``; it needs only ``jax`` and
``jaxlib``. Keep this header: it is your copy's license. Importing it
registers, under names derived from its module name (so jax's own
implementation and any number of copies coexist), each at the end of the
section that owns it: the primitive ``custom_partitioning_p`` with its
rules, and the decorator type with jax's custom-decorator registry.
XLA's callbacks register the XLA custom-call partitioner
``CustomSPMDPartitioning.<module name>`` (also with PJRT plugins), a handler
turning this module's tagged compile errors back into the author's
exception, and a listener for jax's compile events (from the first custom
call on) (II.7).
Importing it wraps jax's ``lower_jaxpr_to_module`` (private and public; a
later copy of this file joins the first copy's wrapper), which then
rewrites a module holding an op of any copy, replacing each op's custom
call by its partitioned program, and lowers any other module as before,
leaving this file's frames out of source locations as jax does its own
(I.2: jax has no hook after lowering). It changes no jax option and no
environment variable.
Where jax lowered one op once for places Shardy placed apart, the wrapper
lowers the module a second time (II.9).
It reads ``CUSTOM_PARTITIONING_AT_LOWERING`` (``0``: XLA's callbacks under
Shardy too, except on TPU) (II.7).

Supported jax versions
----------------------
jax/jaxlib 0.4.35 through 0.12.1, each with the Shardy partitioner.
Through 0.12.0.1 also with GSPMD: jax 0.12.1 removed it (its flag stays,
with no effect), so there Shardy partitions every op, GSPMD-era ones too
(upstream refuses those there) (II.7).
CI (``.ci/run``) tests every change. The whole suite runs on 0.4.35, 0.5.3,
0.7.2, 0.10.2, 0.11.2 and 0.12.1, and on the newest release with jax's
legacy shims withdrawn (``.ci/withdrawn``). The core set runs on 0.4.36,
0.4.38, 0.5.0, 0.5.1, 0.6.0, 0.6.1, 0.6.2, 0.7.0, 0.7.1, 0.8.0, 0.8.1, 0.8.2,
0.8.3, 0.9.0, 0.9.0.1, 0.9.1, 0.9.2, 0.10.0, 0.10.1, 0.11.0, 0.11.1, 0.12.0
and 0.12.0.1 (also jax 0.12.0 on jaxlib 0.11.2).
Older releases raise ``ImportError``, and so does one lacking a name this
module reads from jax's internals (each looked up at import: ``_NAMES``),
naming it. A newer release is not refused; CI's newest-release run says
whether it works.

Reading order
-------------
First jax's names (``_NAMES``, with the private attributes the module
reads), then three parts by owner, a section each (``grep -n "^# I"``).
Part I, the drop-in core (I.1 to I.7): all a plain op (Auto axes, no
transformation) runs under Shardy, in call order, each helper beside its
first user.

Part II, one section per extra, entered only from lines marked ``# seam:``
that name it; a copy drops an extra with its section, its seam lines and
the text about it, and ``.ci/sections.py`` proves that each copy works
(Part II):

- checks of the per-shard program (II.1);
- placements and errors off the plain path (II.2);
- the shard_map path, Explicit mesh axes (II.3);
- derived ops: vmap, jvp, transposition (II.4);
- ops by their rule alone (II.5);
- a rule derived from infer, GSPMD-era ops under Shardy (II.6);
- XLA's callbacks: GSPMD before jax 0.12.1, and the fallbacks; with the
  keys for the persistent cache (II.7);
- the DEBUG log (II.8);
- ops placed apart: one lowering per place (II.9).

Part III, leaves and tools: III.1 the Shardy rule parser; III.3 the
module's state.
Also ``check_partitioning`` (III.2).
Also the self-demo (III.4).

Each section registers what it owns with jax and XLA at its end. Each
message stands where it is raised; each version branch beside its owner,
naming the release.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
import contextlib
import dataclasses
import enum
import functools
import hashlib
import importlib
import inspect
import itertools
import logging
import math
import os
import struct
import threading
import types
from typing import Any, NamedTuple
import warnings
import weakref

__version__ = "1.6.4"
__all__ = [  # jax's six names, then this module's own (a tool adds its own)
    "custom_partitioning", "custom_partitioning_p", "SdyShardingRule",
    "ArrayMapping", "CompoundFactor", "BATCHING",
    "str_to_sdy_sharding_rule", "sdy_sharding_rule_to_mlir",
]

if __name__ == "__main__":  # seam: the demo's 8 devices (III.4)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # jaxlib's C++ chatter

import jax


def _version_tuple(text: str) -> tuple[int, ...]:
  """``"0.5.3.dev20250101"`` -> ``(0, 5, 3)``."""
  return tuple(int("".join(itertools.takewhile(str.isdigit, part)) or 0)
               for part in text.split(".")[:3])


_JAX_VERSION = _version_tuple(jax.__version__)
if _JAX_VERSION < (0, 4, 35):
  raise ImportError(
      f"{__name__} supports jax 0.4.35 or newer; found jax "
      f"{jax.__version__}. Upgrade jax and jaxlib, or use "
      "jax.experimental.custom_partitioning.")

import numpy as np

# --------------------------------------------------------------------------
# jax's names: every internal one this module reads, looked up once, here
#
# Each module, then the names read from it (an extra's, in a table at its
# section's head); ``name?`` is optional (None where the release lacks it:
# a version branch beside its owner reads it). Public and jax.extend names
# first, then jax._src where jax offers none. Every name from jax._src,
# jax.core, jax.extend and jax.interpreters is here (ReadmeTest holds the
# file to that); jax's stable API is read where it is used. A release
# lacking a required name fails here, at import, by name (``grep -n
# "_jax\."`` lists every use). Beside a name: what jax 0.12.1's source plans
# for it (legacy, deprecated, to be removed). A shim with a successor is not
# read (CI proves it: ``.ci/withdrawn/sitecustomize.py`` lists them).
# --------------------------------------------------------------------------

_NAMES = {
    # The package of jax.interpreters.mlir, whose lower_jaxpr_to_module
    # libraries call: the module's lowering replaces it there too (I.2).
    "jax": "interpreters",
    "jax.core": "ShapedArray Tracer",
    "jax.errors": "UnexpectedTracerError",
    # jax 0.11.0 merged ClosedJaxpr into Jaxpr; 0.12 keeps the old name as
    # a legacy shim only (_closed and _open, in I.7).
    "jax.extend.core": "Jaxpr Primitive jaxpr_as_fun" + (
        " ClosedJaxpr" if _JAX_VERSION < (0, 11) else ""),
    # jax 0.12.0.1: wrap_init without debug_info is "deprecated"; from jax
    # 0.5.1, when it takes it, the module passes it (_trace_to_jaxpr).
    "jax.extend.linear_util": "wrap_init",
    "jax.extend.mlir.dialects.sdy": "AxisRefAttr DimMappingAttr "
                                    "DimensionShardingAttr MeshAttr "
                                    "MeshAxisAttr OpShardingRuleAttr "
                                    "SubAxisInfoAttr TensorMappingAttr "
                                    "TensorShardingAttr "
                                    "TensorShardingPerValueAttr",
    "jax.extend.mlir": "ir passmanager",
    "jax.extend.mlir.ir": "Attribute Location RankedTensorType ShapedType "
                          "Type",
    "jax.interpreters.mlir": "LoweringRuleContext aval_to_ir_types "
                             "dtype_to_ir_type lower_fun make_ir_context "
                             "register_lowering",
    # jax 0.12.0.1: trace_to_jaxpr_dynamic is to be removed "in favor of
    # trace_to_jaxpr", which is private (and caches by function): kept.
    "jax.interpreters.partial_eval": "trace_to_jaxpr_dynamic lower_jaxpr2?",
    "jax.sharding": "AbstractMesh Mesh",
    # jax 0.6.1 made shard_map public (jax.shard_map).
    **({"jax.experimental.shard_map": "shard_map"}
       if _JAX_VERSION < (0, 6, 1) else {}),
    "jax._src.api_util": "argnums_partial debug_info flatten_fun_nokwargs",
    # jax 0.12.1 removed GSPMD; use_shardy_partitioner stays, "DEPRECATED:
    # ... no effect" (_SHARDY).
    "jax._src.config": "disable_jit trace_context" + (
        " use_shardy_partitioner" if _JAX_VERSION < (0, 12, 1) else ""),
    "jax._src.core": "Effect extend_axis_env_nd subjaxprs trace_state_clean "
                     "ShardingTypeError? get_aval? raise_to_shaped? typeof?",
    "jax._src.custom_api_util": "forward_attr register_custom_decorator_type",
    "jax._src.dispatch": "prim_requires_devices_during_lowering",
    "jax._src.interpreters": "mlir",
    "jax._src.interpreters.mlir": "custom_call",
    "jax._src.lib": "version",
    "jax._src.lib.xla_client": "ArrayImpl HloSharding Shape",
    # thread_resources holds `with mesh:`, deprecated for users since jax
    # 0.10.1 (jax.set_mesh succeeds it): read while jax honours the block.
    "jax._src.mesh": "thread_resources empty_abstract_mesh? "
                     "get_abstract_mesh? get_concrete_mesh? "
                     "use_abstract_mesh?",
    # jax 0.12.1 deprecated jax.sharding.SingleDeviceSharding for a function
    # (is_single_device_sharding); the hot path compares types: the class.
    "jax._src.sharding_impls": "GSPMDSharding SPMDAxisContext "
                               "SingleDeviceSharding "
                               "parse_flatten_op_sharding",
    "jax._src.source_info_util": "register_exclusion",
    "jax._src.util": "cache",
}


def _look_up(names: dict) -> None:
  """Reads the names of ``names`` (a table as ``_NAMES``) into ``_jax``."""
  found = {}
  for where, listed in names.items():
    for name in listed.split():
      path = f"{where}.{name.rstrip('?')}"
      found[name.rstrip("?")] = value = _resolve(path)
      if value is None and not name.endswith("?"):
        raise ImportError(
            f"{__name__} needs {path}, which jax {jax.__version__} does not "
            "have; this file is tested with jax 0.4.35 to 0.12.1. Install "
            "one of those releases (pip install -U 'jax==0.12.1'), or use "
            "jax.experimental.custom_partitioning.")
  vars(_jax).update(found)


def _resolve(path: str):
  """The object at dotted ``path`` (modules imported on the way), or None."""
  parts = path.split(".")
  value = importlib.import_module(parts[0])
  for i, part in enumerate(parts[1:], 2):
    if not hasattr(value, part):
      try:
        importlib.import_module(".".join(parts[:i]))
      except ImportError:
        return None
    value = getattr(value, part, None)
    if value is None:
      return None
  return value


_jax = types.SimpleNamespace()  # every name of the tables, as _jax.<name>
_look_up(_NAMES)
_JAXLIB_VERSION = tuple(_jax.version)[:3]


# Readers of jax's private attributes of shardings and avals that several
# sections share (others are read where they are used).
def _aval_mesh(aval):
  # jax 0.5.0 gave ShapedArray a sharding (before it, there is none).
  mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
  return None if mesh is None or mesh.empty else mesh


def _gspmd_hlo(sharding) -> _jax.HloSharding:  # seam: used by (II.7, III.2)
  return sharding._hlo_sharding


# ==========================================================================
# Part I. The drop-in core
#
# What a plain op runs under Shardy (Auto axes, no transformation), in call
# order, each helper beside its first user; ``jit(op)(x)`` stays here.
# It leaves it only for the per-shard checks, entered from I.5 (II.1).
# Every extra joins it at a line marked ``# seam:`` naming its section of
# Part II (``grep -n "seam:"``). A version branch stands beside its owner and
# names the release that forced it (``grep -n "jax 0\."``): Python
# internals are gated on jax's version, C++ bindings (Shardy, XLA) on
# jaxlib's (jax 0.10.2 may run on jaxlib 0.10.1). Unbranched private names
# hold on every supported release, 0.4.35 to 0.12.1.
# ==========================================================================


# --------------------------------------------------------------------------
# I.1 The decorator, and how a call is bound
#
# A call's arguments are bound to positions and sorted by role (``_split``);
# outside any transformation it is compiled (``_eager_call``), else bound
# (``_bind``) as the primitive. Caches are bounded ``_LRU``s (module
# state: III.3).
# Under Explicit mesh axes ``_bind`` takes the shard_map path (II.3).
# --------------------------------------------------------------------------

class custom_partitioning:
  """Gives a function its own SPMD partitioning rules.

  ``custom_partitioning(fun, static_argnums=())`` wraps ``fun`` (pytrees of
  arrays in and out); a call binds ``custom_partitioning_p`` and returns
  ``fun``'s results. Under ``jax.jit`` on several devices the op is
  partitioned by ``def_partition``'s callbacks: under Shardy while jax lowers
  the program (``partition`` asked with the placements Shardy's propagation
  gives, the op then a manual computation of ``lower_fn``, size-0 values
  (placeholders) made outside it; on every backend, TPU included); on one
  device, in a ``shard_map`` manual over every mesh axis and under
  ``jax.disable_jit()``, ``fun`` runs.
  Under GSPMD (jax 0.12.0.1 and older) the op is one XLA custom call whose
  callbacks XLA calls while compiling, as upstream (II.7).
  Under ``jax.vmap``, ``jax.jvp`` and ``jax.grad`` the callbacks see the op
  untransformed and ``lower_fn`` runs transformed on the same local shards
  (upstream supports none of the three); where ``partition``'s shardings
  do not divide an operand or result, the op's derivatives (``jvp``,
  ``grad``, ``vjp``, ``hessian``, under ``vmap`` too) are plain jax's, those
  of ``fun`` on whole values (partitioned by jax at lowering, replicated on
  XLA's callbacks), ``lower_fn`` giving the values (II.4).
  An eager call is compiled: partitioned if an operand is a ``jax.Array``
  sharded over several devices, else ``fun`` runs unasked (as upstream does
  for every eager call).
  Under Explicit mesh axes (jax 0.7+, ``jax.set_mesh``) ``partition`` is asked
  while tracing and the op becomes ``lower_fn`` under ``jax.shard_map``
  between two reshards (II.3).
  Lowered inside another primitive's lowering rule (``mlir.lower_fun(op)``),
  the op takes its devices from the mesh set around the call
  (``jax.set_mesh`` or ``with mesh:``) (II.2).

  Traces of ``fun`` are cached per op on what ``jax.jit`` keys on (static
  arguments, yet told apart wherever a fresh trace could differ: numbers by
  type and bits, so ``2``/``2.0`` and ``0.0``/``-0.0`` differ; tuples,
  frozensets and dataclasses (flax ``struct`` configs too) by item or field,
  alike; any other kind by its own ``==``; operand pytree and avals; jax's
  config); ``jax.clear_caches()`` empties every cache of this module
  (``fun`` is retraced). A lowering asks the callbacks once per distinct
  question (upstream: per custom call), a new lowering anew.
  Where jax's persistent compilation cache is on, a custom call's key
  digests the op (code, values its callbacks read, static arguments, mesh,
  config), so the cache hits across processes and equal ops share answers
  (II.7).
  As with ``jax.jit``, callbacks must not depend on state no argument shows
  (environment variables, files).

  Args:
    fun: the function. Keyword arguments are bound to positions by
      ``inspect.signature(fun)``; keyword-only parameters keep their
      defaults. An unpassed default stays a Python value, as under
      ``jax.jit`` (so ``custom_partitioning(jnp.fft.fft)`` works), unless
      it is an array (then an operand) or static (then callbacks get it).
    static_argnums: int or ints: positions of non-array arguments (negative
      from the end, as in ``jax.jit``), passed first to every callback;
      unhashable ones only skip the trace cache.

  Raises (when called):
    ValueError: ``def_partition`` was never called.
    jax.errors.UnexpectedTracerError: a static argument is a tracer.
    TypeError: a keyword-only argument is passed, or the call does not
      match ``fun``'s signature.
    IndexError: a ``static_argnums`` entry is out of range for the call.

  Mirrors ``jax.experimental.custom_partitioning.custom_partitioning``.
  """

  def __init__(self, fun: Callable, static_argnums: int | Sequence[int] = ()):
    functools.update_wrapper(self, fun)
    self.fun, self.static_argnums = fun, static_argnums
    self._defined = False  # def_partition called
    self._traces = _LRU()  # _traced's
    self._programs = _LRU()  # seam: _explicit_call's (II.3)
    self._generation = 0  # def_partition calls, in _eager_call's key
    self._fast = None  # the last eager call's _Fast (_eager_call)
    self._signature = _Signature(fun)
    self._name = getattr(fun, "__qualname__", None) or repr(fun)

  __getattr__: Any = _jax.forward_attr
  partition = infer_sharding_from_operands = sharding_rule = None
  propagate_user_sharding, decode_shardings, check_vma = None, True, True

  def def_partition(self, partition=None, infer_sharding_from_operands=None,
                    propagate_user_sharding=None, decode_shardings=True,
                    sharding_rule=None, *, check_vma=True,
                    reduction_factors=(), need_replication_factors=(),
                    permutation_factors=(), **factor_sizes):
    """Defines how the op is partitioned; returns ``partition``.

    Callbacks get the static arguments first; ``arg_shapes``,
    ``result_shape`` and ``user_shape`` are pytrees (like the op's
    arguments or results) of ``jax.ShapeDtypeStruct`` with XLA's choice
    as ``.sharding`` (see ``decode_shardings``), as are ``lower_fn``'s
    arguments and results and ``partition``'s shardings. A sharding rule
    (and a callable rule's ``operand_types``/``result_types``) lists
    operands and results in ``jax.tree_util.tree_leaves`` order over
    ``fun``'s parameters (keyword arguments at their positions, dict
    entries by sorted key): ``fun({"x": x, "w": w})``, x (n, k), w (n,),
    returning ``{"y": (n, k), "norm": (n,)}`` has ``"i, i j -> i, i j"``.

    Uneven shapes: a dimension of size n sharded over k devices reaches
    ``lower_fn`` as shards of ceil(n / k), the last padded with unspecified
    values (zeros on CPU in practice; at lowering zeros); XLA drops the
    results' padding.
    Derivatives on such shapes are ``fun``'s (above) (II.4).
    A reduction over a padded dimension is refused (``check_vma``): shard it
    over axes that divide it, or mask the padding in ``lower_fn`` (from
    ``jax.lax.axis_index`` and the global size), ``check_vma=False``.

    Args:
      partition: ``(*static, mesh, arg_shapes, result_shape) -> (mesh,
        lower_fn, result_shardings, arg_shardings)``: XLA reshards the
        operands to ``arg_shardings``; ``lower_fn(*local_args)`` computes
        one shard (collectives may name the returned mesh's axes) sharded
        as ``result_shardings``. With a rule's ``need_replication_factors``,
        a dimension of such a factor is given unsharded, a compound one
        sharded over its factors before it only (upstream: as it
        arrives). That mesh is ``mesh``, another over the
        same devices, or an ``AbstractMesh`` (it and shardings on it made
        concrete on the op's devices). If no mesh could be recovered,
        ``mesh`` is empty and ``lower_fn`` has no mesh axes (naming one
        raises an error saying how to give the op one). None (default):
        ``fun`` runs on one device; on several the call raises
        ``ValueError``.
        With a ``sharding_rule``, None derives it from the rule (both
        partitioners, Explicit axes), a factor keeping the axes its
        operands arrive sharded on (replicated if they disagree; of two
        factors on one axis, the later one); replicated are special
        factors, reduced ones (in no result, in results only, or missing
        from a result sharing another factor with the operand, as ``j`` in
        ``"i, j -> i"`` for ``x * sum(y)``) and factors of compound
        dimensions; each shard runs ``fun`` on its local arrays, so the
        rule must hold shard-wise (II.5).
      infer_sharding_from_operands: ``(*static, mesh, arg_shapes,
        result_shape) -> result sharding(s)`` on ``mesh`` (another mesh
        raises ``ValueError``); ``result_shape`` has no shardings, nor has
        an operand XLA has not placed yet (``.sharding`` None). Shardy at
        lowering never asks it.
        GSPMD asks it (default: derived from ``sharding_rule``), and so
        does the op under Explicit mesh axes for a body jax cannot type
        (II.7).
        Under Shardy, without a ``sharding_rule``, it is probed to derive
        one (where upstream raises ``NotImplementedError``), once per
        operand dimension, that dimension alone sharded over a mesh axis
        that divides it, on the author's shapes and the op's mesh (cached
        per both; an exception is a probe it does not support); the rule
        ties that dimension to each result dimension the axis lands on
        (same size), and a ``UserWarning`` says when no probe could be
        answered (II.6).
        The derived rule is logged at ``DEBUG`` (II.8).
        ``check_partitioning`` reports it (III.2).
      propagate_user_sharding: Shardy propagates through the rule both
        ways and never asks it.
        GSPMD asks it: ``(*static, mesh, user_shape) -> result sharding(s)``
        preferred given the user's; default: the user's (II.7).
      decode_shardings: True: ``NamedSharding``s on the real mesh when one
        can be recovered (``with mesh``, ``jax.set_mesh`` or the jit's
        shardings); else (or False) ``GSPMDSharding``s.
      sharding_rule: Shardy only: an einsum-like string (see
        ``str_to_sdy_sharding_rule``), an ``SdyShardingRule``, or a callable
        ``(*static, mesh, operand_types, result_types) -> rule`` or
        ``-> (string, kwargs)``. None: Shardy leaves the results
        replicated.
        None with GSPMD callbacks: a rule derived from them
        (``infer_sharding_from_operands``) (II.6).
      check_vma: keyword-only, this module's (upstream has none). True:
        tracing ``lower_fn`` raises ``ValueError`` for a replicated result
        that may vary along a mesh axis (a missing ``psum``) and for
        padding entering a reduction the rule makes. As ``jax.shard_map``'s
        check, it follows through the jaxpr the axes each value may vary
        along (loop carries to a fixed point), never refuses where it
        cannot (grouped collectives, unknown primitives with subprograms)
        and ignores size-1 axes; a loop carry may be marked with
        ``jax.lax.pcast(x, axes, to="varying")`` (``pvary`` before jax
        0.8.2) or not, as upstream.
        Under Explicit axes the op's ``jax.shard_map`` check is turned off
        where it refuses what this one proved (an unmarked varying carry,
        a result made equal by ``all_gather``) (II.3).
        A derived op's transposition zeroes cotangents past the end, so
        XLA's padding never enters its reductions (II.4).
        False turns the checks off (for code right by a construction they
        cannot see, such as a ring all-reduce).
      reduction_factors, need_replication_factors, permutation_factors,
      **factor_sizes: for a string ``sharding_rule`` only.

    Raises:
      TypeError: ``partition`` is neither callable nor None, or
        ``sharding_rule`` is of another type.
      ValueError: factor keywords without a string rule, or a bad rule.
      While the op is compiled (``jax.jit``, ``.compile()``, an eager call):
      a callback's exception, with its own type (XLA's error as its
      ``__cause__``); ``TypeError`` or ``ValueError`` naming the callback
      and position for a malformed answer (not a 4-tuple, ``lower_fn`` not
      callable, a sharding that is not a ``jax.sharding.Sharding``, a
      pytree unlike the operands or results, other devices than the op's,
      a spec sharding past the value's rank: upstream's ``IndexError``);
      ``ValueError`` naming the result for ``lower_fn`` results of the
      wrong number, per-shard shape or dtype, and for the ``check_vma``
      checks.
      Under GSPMD, ``NotImplementedError`` for host callbacks in
      ``lower_fn``, for ``jax.export`` and for lowering for TPU (which
      calls no Python partitioner: Shardy is the fix) (II.7).
      At lowering, ``NotImplementedError`` for an ordered effect in
      ``lower_fn`` (``io_callback(..., ordered=True)``), and, on every path,
      for an operand with a symbolic dimension (``jax.export``'s shape
      polymorphism: other arguments may have them).
      Under ``jax.vmap``/``jvp``/``grad``, ``NotImplementedError`` for a
      returned mesh shaped unlike the op's or a sharding without a
      ``PartitionSpec`` (II.4).
    """
    if partition is not None and not callable(partition):
      raise TypeError(
          f"def_partition of {self._name}: partition must be callable; got "
          f"{type(partition).__name__}.")
    extra = dict(factor_sizes, **{kind: factors for kind, factors in zip(
        _SPECIAL_FACTOR_KINDS, (reduction_factors, need_replication_factors,
                                permutation_factors)) if factors})
    if isinstance(sharding_rule, str):
      sharding_rule = str_to_sdy_sharding_rule(sharding_rule, **extra)
    elif not (sharding_rule is None or callable(sharding_rule) or
              isinstance(sharding_rule, SdyShardingRule)):
      raise TypeError(
          f"def_partition of {self._name}: sharding_rule must be a str, an "
          f"SdyShardingRule or a callable; got {type(sharding_rule)}.")
    elif extra:
      raise ValueError(
          f"def_partition of {self._name}: {sorted(extra)} only apply to a "
          "string sharding_rule; put them into the SdyShardingRule (or the "
          "(string, kwargs) pair your callable returns) instead.")
    self._defined = True
    (self.partition, self.infer_sharding_from_operands,
     self.propagate_user_sharding, self.decode_shardings, self.sharding_rule,
     self.check_vma) = (partition, infer_sharding_from_operands,
                        propagate_user_sharding, decode_shardings,
                        sharding_rule, bool(check_vma))
    self._traces.clear()
    self._programs.clear()  # seam: (II.3)
    self._generation += 1
    self._fast = None
    return partition

  def _split(self, args: tuple, kwargs: dict) -> _CallArgs:
    args, unpassed = self._signature.positional(args, kwargs, self._name)
    nums = self.static_argnums
    positions: list[int] = []  # in the author's order: callbacks see it
    for i in (nums,) if isinstance(nums, int) else nums or ():
      if not -len(args) <= i < len(args):
        raise IndexError(
            f"custom_partitioning function {self._name}: static_argnums "
            f"entry {i} is out of range for a call with {len(args)} "
            "arguments.")
      if i % len(args) not in positions:
        positions.append(i % len(args))
    for i in positions:
      if any(isinstance(leaf, _jax.Tracer)
             for leaf in jax.tree_util.tree_leaves(args[i])):
        raise _jax.UnexpectedTracerError(
            f"custom_partitioning function {self._name} got a traced value "
            f"as argument {i}, which static_argnums marks static. Static "
            "arguments must be concrete Python values.")
    # Like jax.jit: unpassed Python defaults are constants, not operands.
    defaults = tuple((i, args[i]) for i in unpassed
                     if i not in positions and not _is_array(args[i]))
    defaults_at = tuple(i for i, _ in defaults)
    fixed = {*positions, *defaults_at}
    static = tuple(args[i] for i in positions)
    return _CallArgs(tuple(positions), static, defaults, tuple(
        a for i, a in enumerate(args) if i not in fixed), _key_of(static),
        defaults_at)

  def _eager_call(self, args: _CallArgs):
    """A call outside any transformation, compiled; cached on all the jitted
    function depends on but what jax.jit keys on itself (the operands)."""
    leaves = args.dyn_args  # concrete arrays are their own leaves
    for x in leaves:  # (a loop: all() of a generator costs 5x as much)
      if type(x) is not _ArrayImpl:
        leaves = jax.tree_util.tree_leaves(args.dyn_args)
        break
    sharded = _any_sharded(leaves)
    # Under Explicit axes the operands' (concrete) mesh is the op's.
    mesh = next((x.sharding.mesh for x in leaves if isinstance(
        getattr(x, "sharding", None), jax.sharding.NamedSharding) and
        isinstance(x.sharding.mesh, _jax.Mesh)), None) if sharded else None
    key = (self, self._generation, args.key, args.defaults_at, sharded, mesh)
    fn = _eager.get(key)
    if fn is None:  # only on a miss: no closure built per hit
      run = (functools.partial(self._bind, eager_mesh=mesh) if sharded
             else self._run_body)
      if not sharded and _log.isEnabledFor(logging.DEBUG):  # seam: log (II.8)
        _debug(self._name, "path", path=_FUN, mesh=None,
               why="an eager call with no operand sharded over several "
               "devices: fun is compiled as it is")
      base = args._replace(dyn_args=())  # holds no operand

      def call(*dyn):
        return run(base._replace(dyn_args=dyn))
      fn = jax.jit(call)
      _eager.put(key, fn)
    if (leaves is args.dyn_args and
        not args.defaults_at and not args.static_argnums):
      # The key's ``sharded`` and ``mesh`` are functions of the operands'
      # shardings: equal shardings, the same function.
      self._fast = _Fast(_cache_epoch(), fn, None if not sharded and all(
          type(x.sharding) is _SingleDevice for x in leaves) else tuple(
              x.sharding for x in leaves))
    return fn(*args.dyn_args)

  def _run_body(self, args: _CallArgs):
    leaves, in_tree = jax.tree_util.tree_flatten(args.dyn_args)
    flat = _FlatArgs(leaves, in_tree, tuple(map(_typeof, leaves)))
    call, out_tree = self._traced(args, flat)
    return jax.tree_util.tree_unflatten(
        out_tree, _jax.jaxpr_as_fun(call)(*leaves))

  def __call__(self, *args, **kwargs):
    eager = _jax.trace_state_clean() and not _jax.disable_jit.value
    plain = not kwargs and len(args) == self._signature.plain
    fast = self._fast
    if eager and plain and fast is not None and fast.fits(args):
      return fast.fn(*args)  # an eager call like the last one
    if not self._defined:
      raise ValueError(
          f"custom_partitioning function {self._name} has no partitioning "
          "rules: call its def_partition(...) before calling it.")
    if plain and not (self.static_argnums or self.static_argnums == 0):
      args = _CallArgs((), (), (), args)  # the common case, kept fast
    else:
      args = self._split(args, kwargs)
    if eager and args.key is not None:
      return self._eager_call(args)
    return self._bind(args)

  def _bind(self, args: _CallArgs, eager_mesh=None):
    leaves, in_tree = jax.tree_util.tree_flatten(args.dyn_args)
    flat = _FlatArgs(leaves, in_tree, tuple(map(_typeof, leaves)))
    # Whether an aval is sharded (jax 0.5.0+) on a mesh with an Explicit axis.
    if _EXPLICIT_PATH and any(  # seam: the shard_map path (II.3)
        jax.sharding.AxisType.Explicit in getattr(getattr(getattr(
            a, "sharding", None), "mesh", None), "axis_types", ())
        for a in flat.in_avals):
      explicit = _explicit_call(self, args, flat, eager_mesh)
      if explicit is not None:
        return explicit
    call, out_tree = _typed_where_jax_can(
        lambda: self._traced(args, flat),
        lambda avals: self._trace_fun(args, flat.in_tree, avals),
        flat.in_avals)
    out_flat = custom_partitioning_p.bind(
        *flat.leaves, **self._params(args, flat, call, out_tree))
    return jax.tree_util.tree_unflatten(out_tree, out_flat)

  def _traced(self, args: _CallArgs, flat: _FlatArgs):
    """``(call, out_tree)``: ``fun`` traced for ``args``, cached where the
    static arguments hash."""
    # jax.jit's trace key (its trace context holds the config), statics by
    # _key_of, unpassed defaults' positions; blind to fun's globals.
    key = None if args.key is None else (
        args.key, args.defaults_at, flat.in_tree, flat.in_avals,
        _SHARDY.value, _jax.trace_context())
    traced = None if key is None else self._traces.get(key)
    if traced is None:  # get and put: no closure built on the hot path
      traced = self._trace_fun(args, flat.in_tree, flat.in_avals)
      if key is not None:
        self._traces.put(key, traced)
    return traced

  def _trace_fun(self, args: _CallArgs, in_tree, in_avals):
    """``fun`` traced to ``(call, out_tree)``. Closed-over arrays stay
    constants; a closed-over tracer cannot be partitioned: refused."""
    fixed = dict([*zip(args.static_argnums, args.static_args), *args.defaults])
    all_args = (_in_call_order(fixed, args.dyn_args) if fixed
                else args.dyn_args)
    try:
      call, out_tree = _trace_to_jaxpr(self.fun, all_args, in_tree, in_avals,
                                       self._name, tuple(sorted(fixed)))
    except _ShardingTypeError as e:
      raise type(e)(
          f"custom_partitioning function {self._name}: jax cannot type its "
          f"body with these operand shardings ({e}). With every mesh axis "
          "Explicit and the mesh set by jax.set_mesh(mesh), the op runs as "
          "jax.shard_map of its lower_fn, which needs no such typing.") from e
    if any(isinstance(c, _jax.Tracer) for c in call.consts):
      raise _jax.UnexpectedTracerError(
          f"custom_partitioning function {self._name} closes over a traced "
          "value (e.g. a variable of an enclosing jax.jit or jax.grad). Pass "
          "it to the function as an argument instead.")
    return call, out_tree()

  def _params(self, args: _CallArgs, flat: _FlatArgs, call, out_tree) -> dict:
    """A call's equation parameters: upstream's, plus ``check_vma`` and
    ``transform`` (empty)."""
    partition = self.partition
    if partition is None and self.sharding_rule is not None:  # seam: (II.5)
      partition = _FromRule(self.fun, args.static_argnums, args.defaults)
    return dict(
        call=call, in_tree=flat.in_tree, out_tree=out_tree, partition=partition,
        propagate_user_sharding=self.propagate_user_sharding,
        infer_sharding_from_operands=self.infer_sharding_from_operands,
        decode_shardings=self.decode_shardings,
        sharding_rule=self.sharding_rule,
        static_args=args.static_args and _Statics(args.static_args, args.key),
        check_vma=self.check_vma, transform=())


def _typed_where_jax_can(typed: Callable, untyped: Callable, avals):
  """``typed()``; where that fails on ``avals`` sharded on a mesh
  (Explicit axes, the op a custom call), ``untyped`` of them without
  shardings, as upstream traces (a Pallas kernel, q @ k.T): partition's
  lower_fn runs, not the body traced here."""
  try:
    return typed()
  except Exception:
    if all(_aval_mesh(a) is None for a in avals):
      raise
    with _no_ambient_mesh():
      return untyped(tuple(_jax.ShapedArray(a.shape, a.dtype,
                                            weak_type=a.weak_type)
                           for a in avals))


_CACHE_SIZE = 64  # entries kept per cache (per op, for per-op caches)


class _LRU:
  """A thread-safe LRU map, emptied (lazily) by ``jax.clear_caches()``."""

  def __init__(self, size: int = _CACHE_SIZE):
    self._size = size
    self._data: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()
    self._epoch = None

  def _current(self) -> collections.OrderedDict:
    """The entries of this cache epoch; call with the lock held."""
    epoch = _cache_epoch()
    if epoch is not self._epoch:
      self._data.clear()
      self._epoch = epoch
    return self._data

  def get(self, key):
    # Every eager call hits this: acquire/release costs less than ``with``,
    # and one lookup that may raise less than a get and then a move.
    self._lock.acquire()
    try:
      data = self._current()
      data.move_to_end(key)  # a hit is now the most recent entry
      return data[key]
    except KeyError:  # a miss
      return None
    finally:
      self._lock.release()

  def cached(self, key, build: Callable[[], Any]):
    """The value under ``key``, else ``build()``, kept (key None: neither)."""
    value = None if key is None else self.get(key)
    if value is None:
      value = build()
      if key is not None:
        self.put(key, value)
    return value

  def pop(self, key):  # seam: used by (II.7)
    with self._lock:
      return self._current().pop(key, None)

  def put(self, key, value) -> None:
    with self._lock:
      self._current()[key] = value
      self._data.move_to_end(key)
      while len(self._data) > self._size:
        self._data.popitem(last=False)

  def clear(self) -> None:
    with self._lock:
      self._data.clear()

  def __len__(self) -> int:  # seam: used by (II.3, II.7)
    with self._lock:
      return len(self._current())


@_jax.cache(max_size=1, trace_context_in_key=False)
def _cache_epoch() -> object:
  """A token that changes when ``jax.clear_caches()`` is called."""
  # jax's util.cache is cleared by jax.clear_caches() on every release
  # (through a set of clear functions up to 0.4.x, util.register_cache
  # since). With jax_check_tracer_leaks on it does not memoize at all.
  return object()


_call_names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_weak_lock = threading.Lock()


def _trace_to_jaxpr(fun: Callable, args: Sequence[Any], in_tree, in_avals,
                    name: str, static_argnums: tuple = ()):
  """``(call, out_tree)``: ``fun`` of ``args`` (those at ``static_argnums``
  fixed) traced at ``in_avals``, the others' leaves by ``in_tree``; the
  body of function ``name`` (``_fun_name``)."""
  # jax 0.5.1 made debug info an argument of lu.wrap_init (and changed
  # api_util.debug_info); before it, we trace without debug info.
  wrapped = _jax.wrap_init(fun) if _JAX_VERSION < (0, 5, 1) else _jax.wrap_init(
      fun, debug_info=_jax.debug_info(
          "custom_partitioning", fun, args, {}, static_argnums=static_argnums))
  if static_argnums:
    wrapped, _ = _jax.argnums_partial(
        wrapped, [i for i in range(len(args)) if i not in static_argnums],
        args, require_static_args_hashable=False)
  flat_fun, out_tree = _jax.flatten_fun_nokwargs(wrapped, in_tree)
  # jax 0.7.0 dropped the fourth result (attrs).
  jaxpr, _, consts, *_ = _jax.trace_to_jaxpr_dynamic(flat_fun, in_avals)
  call = _closed(jaxpr, consts)
  # jax 0.5.1 added DebugInfo.func_name; before it, and for derived bodies,
  # names are kept in the weak table ``_call_names``.
  with _weak_lock:
    _call_names[call] = name
  return call, out_tree


# jax 0.5.3 added jax.typeof; 0.10.0 removed get_aval. jax 0.4.36 removed
# ConcreteArray, whose values tracing must not see.
_typeof = _jax.typeof or (_jax.get_aval if _JAX_VERSION >= (0, 4, 36) else
                          lambda x: _jax.raise_to_shaped(_jax.get_aval(x)))

# jax 0.5.3 added ShardingTypeError (a result's sharding it cannot type).
_ShardingTypeError = _jax.ShardingTypeError or type(
    "_NeverRaised", (Exception,), {})


class _Signature:
  """Binds a call's keyword arguments to positions."""
  _POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY,
                 inspect.Parameter.POSITIONAL_OR_KEYWORD)

  def __init__(self, fun: Callable):
    try:
      self._sig = inspect.signature(fun)
    except (TypeError, ValueError):  # e.g. some builtins: positional only
      self._sig = self.plain = None
      return
    params = self._sig.parameters.values()
    # Calls of exactly this many positional arguments need no binding.
    self.plain = (len(params) if all(p.kind in self._POSITIONAL
                                     for p in params) else None)

  def positional(self, args: tuple, kwargs: dict, name: str):
    """``(args, unpassed)``: the positional parameters' values, defaults
    filled in, and the positions that took their default."""
    if self._sig is None or (not kwargs and len(args) == self.plain):
      if kwargs:
        raise TypeError(f"{name} takes no keyword arguments here: its "
                        "signature cannot be inspected.")
      return args, ()
    try:
      bound = self._sig.bind(*args, **kwargs).arguments
    except TypeError as e:
      raise TypeError(f"{name}: {e}") from None
    out, unpassed = [], []
    for param in self._sig.parameters.values():
      if param.kind == param.KEYWORD_ONLY and param.name in bound:
        raise TypeError(
            f"{name}: keyword-only argument {param.name!r} cannot be passed "
            "to a custom_partitioning function (its arguments are bound to "
            "positions); make it positional or leave it at its default.")
      if param.kind == param.VAR_KEYWORD and bound.get(param.name):
        raise TypeError(
            f"{name}: **{param.name} arguments cannot be passed to a "
            "custom_partitioning function; pass them positionally.")
      if param.kind == param.VAR_POSITIONAL:
        out.extend(bound.get(param.name, ()))
      elif param.kind in self._POSITIONAL:
        if param.name not in bound:
          unpassed.append(len(out))
        out.append(bound.get(param.name, param.default))
    return tuple(out), tuple(unpassed)


class _Fast(NamedTuple):
  """The last eager call's compiled function (``_eager_call``), for one of
  as many operands, each a concrete array placed as ``shardings`` says
  (None: each on one device, any), in the same cache epoch."""
  epoch: object
  fn: Callable
  shardings: tuple | None

  def fits(self, args: tuple) -> bool:
    if self.epoch is not _cache_epoch():
      return False
    if self.shardings is None:  # (loops, as in _eager_call)
      for x in args:
        if type(x) is not _ArrayImpl or type(x.sharding) is not _SingleDevice:
          return False
      return True
    for x, s in zip(args, self.shardings):
      if type(x) is not _ArrayImpl or (x.sharding is not s and x.sharding != s):
        return False
    return True


class _CallArgs(NamedTuple):
  static_argnums: tuple  # positions of the static arguments, author's order
  static_args: tuple     # their values, passed first to every callback
  defaults: tuple        # (position, value) of unpassed Python defaults
  dyn_args: tuple        # the rest: the operands (pytrees of arrays)
  key: Any = ()          # static_args' _key_of, for every cache
  defaults_at: tuple = ()  # the defaults' positions, for every cache


def _in_call_order(fixed: dict, operands) -> tuple:
  """``fixed`` (position -> value) among the operands, in call order."""
  it = iter(operands)
  return tuple(fixed[i] if i in fixed else next(it)
               for i in range(len(fixed) + len(operands)))


def _is_array(value) -> bool:
  return isinstance(value, (np.ndarray, np.generic, jax.Array))


def _static_key(value):
  """A static argument as every cache keys it, alike only where a trace is
  (unlike ``==``: ``0.0``/``-0.0``, ``2``/``2.0``, ``0.5``/``np.float32(0.5)``):
  by type and value, floats by their bits, tuples and frozensets by item,
  dataclasses by field (a frozen config holding ``2`` or ``2.0``)."""
  kind = type(value)
  if isinstance(value, (float, complex)):
    return kind, struct.pack("<dd", value.real, value.imag)
  if isinstance(value, (tuple, frozenset)):
    return kind, (frozenset if isinstance(value, frozenset) else tuple)(
        map(_static_key, value))
  if isinstance(value, np.generic):
    return kind, value.dtype, value.tobytes()
  if dataclasses.is_dataclass(kind):  # an unhashable field: no key at all
    return kind, tuple((f.name, _static_key(getattr(value, f.name)))
                       for f in dataclasses.fields(value))
  return kind, value


def _key_of(static_args: tuple):
  """Static arguments' key (``_static_key``); None if one is unhashable."""
  key = tuple(map(_static_key, static_args))
  try:
    hash(key)
  except TypeError:
    return None
  return key


# jax's array class (C++): ``type(x) is`` it costs a tenth of isinstance.
_ArrayImpl = _jax.ArrayImpl
_SingleDevice = _jax.SingleDeviceSharding


def _any_sharded(xs) -> bool:
  """Whether some ``x`` is a concrete array on several devices or whose
  NamedSharding names a mesh axis (even of size 1: jit types it sharded)."""
  for x in xs:
    if ((type(x) is _ArrayImpl or
         isinstance(x, jax.Array) and not isinstance(x, _jax.Tracer)) and
        (not x.sharding.is_fully_replicated or
         isinstance(x.sharding, jax.sharding.NamedSharding) and
         any(map(_entry_axes, x.sharding.spec)))):
      return True
  return False


class _FlatArgs(NamedTuple):
  leaves: list
  in_tree: Any
  in_avals: tuple


class _Statics:
  """Static arguments as an equation parameter, equal by ``_key_of`` where
  jax or this module keys on parameters (unhashable ones: by identity)."""
  __slots__ = ("value", "key")

  def __init__(self, value: tuple, key):
    self.value, self.key = value, (id(value),) if key is None else key

  def __hash__(self):
    return hash(self.key)

  def __eq__(self, other):
    return isinstance(other, _Statics) and other.key == self.key

  def __repr__(self):  # printed jaxprs show the values
    return repr(self.value)


class _FromRule:  # seam: used by (II.3, II.5, II.7, II.8)
  """The ``partition`` of an op defined by its rule alone: each shard runs
  ``fun`` with the call's static arguments and unpassed defaults."""
  __slots__ = ("fun", "static_argnums", "defaults", "_parts")

  def __init__(self, fun: Callable, static_argnums: tuple, defaults: tuple):
    self.fun, self.static_argnums, self.defaults = fun, static_argnums, defaults
    # Defaults, fun's own objects, need not hash: compared by identity.
    self._parts = (fun, static_argnums, tuple((i, id(v)) for i, v in defaults))

  def __hash__(self):
    return hash(self._parts)

  def __eq__(self, other):
    return isinstance(other, _FromRule) and other._parts == self._parts

  def lower_fn(self, static_args: tuple) -> Callable:
    """``fun`` as a function of the operands, ``static_args`` bound."""
    fixed = dict([*zip(self.static_argnums, static_args), *self.defaults])
    fun = self.fun

    def lower_fn(*operands):
      return fun(*_in_call_order(fixed, operands))
    name = getattr(fun, "__name__", "")
    lower_fn.__name__ = name if name.isidentifier() else "fun"
    return lower_fn


_eager = _LRU()


_jax.register_custom_decorator_type(custom_partitioning)


# --------------------------------------------------------------------------
# I.2 The primitive, and the module's lowering
#
# ``custom_partitioning_p`` carries upstream's parameters through jax
# 0.12.0.1 (0.12.1 dropped infer and propagate) plus ``check_vma`` and
# ``transform``, both read with a default.
#
# Under Shardy the op is partitioned while jax lowers the program, on every
# backend: XLA's TPU compiler never calls a Python partitioner (libtpu lacks
# PJRT's custom-partitioner extension, jax#38196). jax has no hook after
# lowering, so ``lower_jaxpr_to_module`` is wrapped (once for every copy of
# this file; ``_party`` is this copy's part): each op is lowered as a custom
# call tagged with its index and carrying its rule (I.3), Shardy's
# propagation places a copy of the module in-process as XLA's compile would
# (I.4), ``partition`` is asked on those placements (I.5), and the call is
# replaced in the same module by pad -> ``jax.shard_map`` of the per-shard
# program -> slice (I.6), at whose boundary Shardy reshards to
# ``partition``'s shardings.
# Where jax lowered one op once for places Shardy placed apart (a function
# of several callers, equal ops), the module is lowered again (II.9).
# No custom call, and no Python while XLA compiles. Where that cannot be
# done (the release gates, below, as ``_at_lowering`` reads them: I.3), the
# op's lowering raises ``NotImplementedError`` saying why.
# Off TPU, XLA's callbacks partition such an op instead (II.7).
# --------------------------------------------------------------------------

# The release gates: each release (and the switch) that decides an op's
# path, read by _at_lowering (I.3) or where the path branches.

# ``_SHARDY.value``: whether Shardy partitions (else GSPMD), on this thread.
# jax 0.12.1 removed GSPMD: Shardy always partitions, whatever the flag says.
_SHARDY = (_jax.use_shardy_partitioner if _JAX_VERSION < (0, 12, 1) else
           types.SimpleNamespace(value=True))

# Off: XLA's partition callback, as upstream, except on TPU (which has none).
_PARTITION_AT_LOWERING = os.environ.get(  # seam: the switch (II.7)
    "CUSTOM_PARTITIONING_AT_LOWERING", "1") != "0"

# jaxlib 0.9.2's Shardy propagation, run in-process, segfaults on a module
# with another custom call (a LAPACK one) or a function of two callers;
# 0.9.1 and 0.10.2 do not.
# There XLA's callbacks partition every op (II.7).
_PROPAGATES = _JAXLIB_VERSION != (0, 9, 2)

# The shard_map path needs Explicit axes (jax 0.5.3), jax.shard_map with
# check_vma (0.6) and jax.sharding.reshard (0.7.0); else the custom call.
_EXPLICIT_PATH = (hasattr(jax.sharding, "AxisType") and  # seam: (II.3)
                  hasattr(jax, "shard_map") and
                  hasattr(jax.sharding, "reshard") and
                  "check_vma" in inspect.signature(jax.shard_map).parameters)

# jax 0.5.3 made axis types per-axis; before it a partly manual shard_map's
# shardings cannot type the manual subgroup XLA needs (it aborts without).
_MANUAL_TYPED = _JAX_VERSION >= (0, 5, 3)  # seam: used by (II.2, II.4, II.7)

# An answer on a mesh other than the op's, as a manual computation inside
# the op's program: jax 0.5.3 lowers one of other axis names with the
# program's mesh, 0.12.0.1 one of another shape or device order (XLA then
# aborts, or jax raises IndivisibleError); 0.7.2 and 0.10.2 lower both.
# jax 0.9.1's jit cannot read the placement of such an op's result back
# (IndivisibleError); 0.9.0.1 can, 0.9.2 partitions by callbacks.
_LOWERS_REORDERED_MESH = ((0, 7, 0) <= _JAX_VERSION < (0, 11, 0) and
                          _JAX_VERSION[:3] != (0, 9, 1))
_LOWERS_RENAMED_MESH = _JAX_VERSION >= (0, 7, 0)

# Before jax 0.5.3, XLA's import of Shardy's manual computations aborts on jax's
# transposed shard_map (a result of its body used twice); jax 0.6.1 (check_vma)
# and 0.6.2 lower it to one that import refuses (a body's first use not a
# LocalToGlobalShape); 0.6.0 and 0.7.0 do not. Where it imports, II.4 lowers a
# transposed derived op as jax's transposition of its manual computation.
_TRANSPOSED_MANUAL_IMPORTS = not (_JAX_VERSION < (0, 5, 3) or  # seam: (II.4)
                                  (0, 6, 1) <= _JAX_VERSION < (0, 7))

# jax 0.7.0 to 0.10.0 lower a manual computation at the end of the caller's
# block, after its function's return, not where the op's call stands (0.6.2
# and 0.10.1 at the call; 0.10.1 then emits equal ops' shared per-shard
# program once per call): there the module is lowered a second time, each
# op's manual computation emitted as it is lowered, instead of replacing
# its call in the first lowering's module.
_REPLACES_IN_PLACE = not (0, 7) <= _JAX_VERSION < (0, 10, 2)
# jax 0.5.3's shard_map types the platform index it hands its manual
# computation (several platforms); before, one sharding short, MLIR refuses.
_LOWERS_FOR_PLATFORMS = _JAX_VERSION >= (0, 5, 3)


custom_partitioning_p = _jax.Primitive("custom_partitioning")
custom_partitioning_p.multiple_results = True
custom_partitioning_p.def_abstract_eval(lambda *_, call, **__: call.out_avals)


def _impl(*args, **params):
  """Eager evaluation of a bound op (e.g. under ``jax.disable_jit()``):
  compiled, and partitioned only if some operand is sharded (upstream
  never asks the callbacks here; ``partition`` must not see host data)."""
  # Cache key: the params hold the body, every callback and the statics
  # (by _static_key; upstream's bind gives a plain tuple); jax.jit keys on
  # the operands' types and shardings. Names are unique: values never sort.
  call, static = params["call"], params["static_args"]
  if _jax.disable_jit.value:  # jax.jit would call straight back here
    return _jax.jaxpr_as_fun(call)(*args)
  sharded = _any_sharded(args)
  if static and not isinstance(static, _Statics):
    params = dict(params, static_args=_Statics(static, _key_of(static)))
  key = (tuple(sorted(params.items())), sharded)
  fn = _eager.cached(key, lambda: jax.jit(
      functools.partial(custom_partitioning_p.bind, **params) if sharded
      else _jax.jaxpr_as_fun(call)))
  return fn(*args)


def _to_lojax(*args, call, **params):
  """Binds the op anew on its body with hijax primitives expanded, as jax
  0.12 asks of a primitive whose parameters hold a high jaxpr."""
  high = [a for a in (*call.in_avals, *call.out_avals) if a.is_high]
  if high:
    raise NotImplementedError(
        f"custom_partitioning of {_fun_name(call)}: operands and results "
        f"must be arrays, not hijax types ({high[0]}); hijax primitives "
        "inside fun and lower_fn are supported.")
  return custom_partitioning_p.bind(*args, call=_lojax(call), **params)


# The shared lowering: every copy of this file in a process (each a module of
# its own name) takes part in one lowering of a module, so that all copies' ops
# are tagged in one lowering and, where any copy asks for one, lowered in one
# second (a copy wrapping another's wrapper would lower a module up to 2^k times
# for k copies). The first copy wraps jax's ``lower_jaxpr_to_module``; a later
# one finds the parties' table on the wrapper and joins (installed at I.2's
# end). The attribute's name is the protocol, kept by every version of this
# file: a party is called with the lowering's arguments and returns a generator;
# the module is lowered while every party sits at a ``yield``, then each is sent
# the result. A party that yields a true value asks for a second lowering (at
# most two); one that returns takes part no further. Where an older copy
# (without the table) installed its wrapper, this one wraps it.
_PARTIES_ATTR = "custom_partitioning_parties_v1"


def _shared_lowering(lower_jaxpr_to_module: Callable,
                     parties: dict) -> Callable:
  """jax's ``lower_jaxpr_to_module`` with every party in ``parties``
  inside each lowering: one, and a second where any asks."""
  @functools.wraps(lower_jaxpr_to_module)
  def shared_lowering(*args, **kwargs):
    running = []
    try:
      for party in list(parties.values()):
        running.append(party(*args, **kwargs))
        next(running[-1])
      for _ in range(2):
        lowered = lower_jaxpr_to_module(*args, **kwargs)
        again = False
        for party in list(running):
          try:
            again = bool(party.send(lowered)) or again
          except StopIteration:
            running.remove(party)
        if not again:
          break
      return lowered
    finally:
      for party in running:
        party.close()
  setattr(shared_lowering, _PARTIES_ATTR, parties)
  return shared_lowering


def _party(*args, **kwargs):
  """This copy's party in the shared lowering of a module (above): the
  module is lowered at each ``yield``.
  Where one op is placed differently in different places, it asks for a
  second lowering (II.9).
  The custom calls of ops partitioned at lowering are replaced in the
  first lowering's module, where the release can (else it asks for a
  second)."""
  with _in_pass(_Pass()) as first:
    lowered = yield
  if not first.count:
    return
  decided = _propagated(lowered.module)
  # Dimension variables (a platform index) are arguments of the function jax
  # inlines a rule from: dangling in kept rule contexts, so lowered again.
  asks = not _REPLACES_IN_PLACE or any(c.dim_var_values
                                       for c, _ in first.tagged)
  if _per_site(decided):  # seam: ops placed apart (II.9)
    asks = True
  if not asks:
    first.decided = decided
    try:
      _replace_tagged_calls(lowered.module, first)
    except _jax.ir.MLIRError as e:
      # Unforeseen: the releases that place a manual computation away from
      # its call are lowered twice (above). The module may now hold
      # dangling values: neither kept nor lowered again.
      names = sorted({op.name for _, op in first.tagged})
      raise RuntimeError(
          f"custom_partitioning op {', '.join(names)}: replacing its custom "
          "call by its manual computation in the module jax lowered failed "
          f"on jax {jax.__version__} ({e}). This is a bug of this module: "
          "please report it with the program.") from e
  # Where only another party asks for a second lowering, its result is kept:
  # this copy's ops are partitioned in it too, as placed in the first.
  first.tagged.clear()
  with _in_pass(_Pass(decided, first.rules)) as second:
    second.ops = first.ops  # partition asked once per op and placement
    yield asks


class _Pass:
  """One lowering of a module: the first (``decided`` None) tags the ops
  and keeps their rules and what ``_replace_tagged_calls`` lowers each from
  (``tagged``: its rule context and ``_Op``); the second finds each op's
  placements and rule by its index in lowering order (and its placements
  by its place, where jax lowered it once for several); both share one
  ``_Op`` (and its answers) among equal ops (``ops``; ``repeated``: those
  met at more than one call, None in a second lowering)."""
  def __init__(self, decided: dict | None = None, rules: list | None = None):
    self.decided = decided
    self.rules = [] if rules is None else rules
    self.tagged: list = []
    self.ops: dict = {}
    self.repeated: set | None = None
    self.count = 0
    self.sites: dict = {}  # index -> how many of its places were lowered
    self.per_site = (  # seam: ops placed apart (II.9)
        _PerSite(self) if decided is not None and _per_site(decided) else
        None)


_passes = threading.local()


@contextlib.contextmanager
def _in_pass(pass_: _Pass):
  stack = _passes.__dict__.setdefault("stack", [])
  stack.append(pass_)
  try:
    yield pass_
  finally:
    stack.pop()


custom_partitioning_p.def_impl(_impl)
custom_partitioning_p.to_lojax = _to_lojax  # jax 0.12 asks it of a high body

# The shared lowering installed (the first copy) or joined (above).
if getattr(_jax.mlir.lower_jaxpr_to_module, _PARTIES_ATTR, None) is None:
  _jax.mlir.lower_jaxpr_to_module = _shared_lowering(
      _jax.mlir.lower_jaxpr_to_module, {})
getattr(_jax.mlir.lower_jaxpr_to_module, _PARTIES_ATTR)[__name__] = _party
# Libraries lower through the public name too (jax.interpreters.mlir).
_jax.interpreters.mlir.lower_jaxpr_to_module = _jax.mlir.lower_jaxpr_to_module
# jax leaves its own files out of the source locations it records; this
# file's frames (the lowering above, the per-shard programs) stay out too,
# so a program without ops lowers byte for byte as without this module.
_jax.register_exclusion(__file__)


# --------------------------------------------------------------------------
# I.3 The op's lowering rule
#
# Where the op runs (``_partitioned_placement``), whether it is partitioned
# at lowering (``_at_lowering``, reading I.2's release gates), then the op
# as its ``_Op``, built once here and carried to its manual computation,
# and its rule (parsed by III.1, resolved against the op's shapes here).
# In a module's first lowering the op is a tagged custom call
# (``_first_pass``), replaced by ``_replace_tagged_calls`` (I.4); in a
# second (I.2), its manual computation at once (``_second_pass``); both
# through ``_manual_computation`` (I.5).
# --------------------------------------------------------------------------

def _lowering_rule(ctx: _jax.LoweringRuleContext, *values, **params):
  """The op's lowering rule: its body where there is nothing to partition,
  else its part in the pass of the module's lowering under way (I.2)."""
  call, steps = params["call"], params.get("transform", ())
  place, why = _partitioned_placement(ctx, steps, _fun_name(call))
  if place is None:  # nothing to partition: the body, inlined
    return _inlined_body(ctx, call, why, values)
  for i, a in enumerate(ctx.avals_in):  # (results' shapes follow theirs)
    dim = next((d for d in a.shape if not isinstance(d, int)), None)
    if dim is not None:  # (jax.export's shape polymorphism)
      raise NotImplementedError(
          f"custom_partitioning op {_fun_name(call)}: operand {i} has the "
          f"symbolic dimension {dim} ({a.str_short()}); partitioning needs "
          "static shapes. Export it with static shapes (other arguments may "
          "be symbolic), or on one device.")
  mc = ctx.module_context
  why_not = _at_lowering(place, mc.platforms)
  # From here on the op is its _Op, and nothing else. (jax 0.5.0 renamed
  # the module context's backend_or_name backend.)
  op = _op_of(params, place, platforms=mc.platforms, at_lowering=why_not is
              None, backend=mc.backend if _JAX_VERSION >= (0, 5, 0) else
              mc.backend_or_name)
  if why_not is not None and (  # seam: XLA's callbacks (II.7)
      "tpu" not in mc.platforms):
    return _by_callbacks(ctx, op, values)
  if why_not is not None:
    raise _cannot_lower(op.name, mc.platforms, why_not)
  _check_partition(op)
  pass_ = _current_pass()
  if pass_.per_site is not None:  # seam: ops placed apart (II.9)
    pass_.per_site.install(mc)
  index, pass_.count = pass_.count, pass_.count + 1
  if pass_.decided is None:
    return _first_pass(ctx, op, values, pass_, index)
  return _second_pass(ctx, op, values, pass_, index)


def _inlined_body(ctx, call: _ClosedJaxpr, why: str, values):
  """The op lowered as its body, where there is nothing to partition."""
  if _log.isEnabledFor(logging.DEBUG):  # seam: the log (II.8)
    _debug(_fun_name(call), "path", path=_FUN, mesh=getattr(
        ctx.module_context.axis_context, "mesh", None),
           why=f"fun is compiled as it is: {why}")
  if (any(_aval_mesh(a) is not None for a in ctx.avals_in) and
      all(_aval_mesh(a) is None for a in call.in_avals)):
    # fun was traced without shardings, jax refusing to type it on the
    # operands' (a Pallas kernel on a one-device Explicit mesh,
    # _typed_where_jax_can); lower_fun re-traces it on ctx's avals, which
    # jax would refuse alike, so it gets the avals fun was traced on.
    ctx = ctx.replace(avals_in=call.in_avals, avals_out=call.out_avals)
  return _jax.lower_fun(_jax.jaxpr_as_fun(call),
                        multiple_results=True)(ctx, *values)


def _fun_name(call) -> str:
  with _weak_lock:
    name = _call_names.get(call)
  return name or getattr(_open(call).debug_info, "func_name", None) or "<op>"


class _Placement(NamedTuple):
  """Where a lowered op runs. ``mesh``: what the callbacks see (inside a partly
  manual shard_map, the manual axes typed Manual); XLA then asks on ``auto``,
  the auto axes' mesh; the per-shard code on ``whole``, the shard_map's mesh."""
  mesh: Any
  devices: tuple | None
  auto: Any = None
  whole: Any = None


def _partitioned_placement(ctx, steps, name: str):
  """``(placement, why)``: where op ``name`` runs, or None and why its body
  is inlined. The mesh is the first known of: the enclosing shard_map's
  (manual axes typed Manual); one the caller gave on the program's devices
  (without them, one shaped as the program's abstract mesh); that abstract
  mesh on the devices; ``with mesh:``'s, maybe empty (upstream's only)."""
  axis_context = ctx.module_context.axis_context
  devices = getattr(axis_context, "device_assignment", None)
  # The abstract mesh the jit's shardings were built on, else set_mesh's.
  am = getattr(axis_context, "abstract_mesh", None)
  if am is None or am.empty:
    am = _ambient_mesh("get_abstract_mesh")
  if isinstance(axis_context, _jax.SPMDAxisContext) and set(
      axis_context.manual_axes) == set(axis_context.mesh.axis_names):
    return None, ("inside a shard_map manual over every mesh axis (one "
                  "shard's code)")
  if isinstance(axis_context, _jax.SPMDAxisContext):  # seam: shard_map (II.2)
    place = _shard_map_placement(axis_context)
  elif devices is None:  # seam: jax did not say the devices (II.2)
    place = _placement_without_devices(axis_context, am, ctx.avals_in)
  elif isinstance(axis_context, _jax.SPMDAxisContext) or devices is None:
    # Reached only in a copy trimmed of placements off the plain path.
    where = ("inside a partly manual jax.shard_map"
             if isinstance(axis_context, _jax.SPMDAxisContext) else
             "where jax withholds the program's devices (inside another "
             "primitive's lowering rule)")
    raise NotImplementedError(
        f"custom_partitioning op {name} cannot be lowered {where}: this "
        f"copy of {__name__} was trimmed of its placements off the plain "
        "path; call the op outside, or vendor a copy that keeps them.")
  else:
    devices = tuple(devices)
    mesh = _caller_mesh(lambda m: tuple(m.devices.flat) == devices)
    if (mesh is None and am is not None and not am.empty and
        am.size == len(devices)):
      mesh = _mesh_from_abstract(devices, am)
    place = _Placement(mesh if mesh is not None else
                       _jax.thread_resources.env.physical_mesh, devices)
  if (place.devices is not None and len(place.devices) == 1) or getattr(
      axis_context, "num_devices", None) == 1:
    return None, "the program runs on one device"
  if steps and place.auto is not None and (  # seam: a derived op (II.4)
      not _MANUAL_TYPED):
    return None, ("a derived op inside a partly manual shard_map before jax "
                  "0.5.3, whose shardings cannot be expressed")
  return place, None


def _caller_mesh(fits: Callable, eager_mesh=None, with_block: bool = True):
  """The first mesh the caller gave that ``fits`` (every path's order):
  ``with mesh:`` (if ``with_block``), ``jax.set_mesh``, an eager call's."""
  with_mesh = _jax.thread_resources.env.physical_mesh  # `with mesh:`
  sources = ((with_mesh,) if with_block else ()) + (
      _ambient_mesh("get_concrete_mesh"), eager_mesh)
  return next((m for m in sources
               if m is not None and not m.empty and fits(m)), None)


def _ambient_mesh(getter: str):
  """``jax._src.mesh.<getter>()``: the mesh set by ``jax.set_mesh``, or None."""
  # jax 0.4.36 added get_abstract_mesh and get_concrete_mesh (``tuple``
  # stands in before it); until 0.5.1 they return () when no mesh is set.
  mesh = (getattr(_jax, getter) or tuple)()
  return None if isinstance(mesh, tuple) else mesh


def _mesh_from_abstract(devices, am) -> _jax.Mesh:
  # jax 0.4.36 added mesh axis types; before it, meshes have none.
  kwargs = {"axis_types": am.axis_types} if hasattr(am, "axis_types") else {}
  return _jax.Mesh(np.array(devices).reshape(am.axis_sizes),
                       am.axis_names, **kwargs)


def _at_lowering(place: _Placement, platforms) -> str | None:
  """Why the op cannot be partitioned at lowering, or None if it can."""
  if not _SHARDY.value:
    return "GSPMD partitions the program"
  if place.auto is not None:
    return "it sits inside a partly manual jax.shard_map"
  if place.mesh.empty or place.devices is None:
    return "its mesh is unknown"
  if _current_pass() is None:
    return "it is lowered outside jax's lowering of a module"
  if not _PROPAGATES:
    return ("jaxlib 0.9.2's Shardy propagation, run in-process, crashes on "
            "some programs (0.9.1 and 0.10 do not): upgrade jaxlib")
  if _jax.use_abstract_mesh is None and not getattr(_ambient_mesh(
      "get_abstract_mesh"), "empty", True):
    # jax 0.5.3 has use_abstract_mesh, which the per-shard code needs.
    return (f"jax {jax.__version__} cannot clear the ambient mesh "
            "(jax.sharding.use_mesh) around its per-shard code")
  if not (_PARTITION_AT_LOWERING or "tpu" in platforms):  # seam: (II.7)
    return "partitioning at lowering is off on this platform"
  if len(platforms) > 1 and not _LOWERS_FOR_PLATFORMS:
    return (f"jax {jax.__version__} cannot lower it for several platforms "
            "at once: lower for one, or use jax >= 0.5.3")
  return None


def _cannot_lower(name: str, platforms, why: str) -> NotImplementedError:
  """The error of an op that cannot be partitioned at lowering, on TPU (or,
  in a copy without XLA's callbacks, on any platform)."""
  where = "TPU" if "tpu" in platforms else (
      f"{', '.join(platforms)} without XLA's callbacks")
  return NotImplementedError(
      f"custom_partitioning op {name} cannot be lowered for {where}: {why}. "
      f"{_TPU_ADVICE}.")


_TPU_ADVICE = (
    "XLA's TPU compiler cannot call a Python partitioner (jax#38196); this "
    "module partitions at lowering instead, which needs Shardy "
    "(jax.config.update('jax_use_shardy_partitioner', True)), the op outside "
    "any partly manual jax.shard_map, and a mesh (NamedSharding operands, "
    "jax.set_mesh or `with mesh:`)")


def _current_pass() -> _Pass | None:
  stack = getattr(_passes, "stack", None)
  return stack[-1] if stack else None


def _op_of(params: dict, place: _Placement, **fields) -> _Op:
  """The one builder of an ``_Op``: from its equation's parameters, where
  it runs and what its lowering knows."""
  static = params["static_args"]  # _Statics, () or upstream's tuple
  if static and not isinstance(static, _Statics):
    static = _Statics(tuple(static), _key_of(tuple(static)))
  return _Op(**{k: params[k] for k in (
      "call", "partition", "infer_sharding_from_operands", "in_tree",
      "propagate_user_sharding", "sharding_rule", "decode_shardings",
      "out_tree")} | dict(
      name=_fun_name(params["call"]), given_rule=params["sharding_rule"],
      check_vma=params.get("check_vma", True),  # upstream has none
      static_args=getattr(static, "value", ()),
      static_key=getattr(static, "key", ()),
      steps=params.get("transform", ()), place=place, mesh=place.mesh) | fields)


def _check_partition(op: _Op) -> None:
  if op.partition is None:
    raise ValueError(
        f"custom_partitioning op {op.name} runs on {len(op.place.devices)} "
        "devices, but its def_partition was given partition=None, and no "
        "partition is derived from a sharding_rule (none was given, or this "
        "copy of the module was trimmed of rule-only ops): give either.")


_STATE = dict(compare=False)  # a field of an _Op that is not its key


@dataclasses.dataclass(frozen=True)
class _Op:
  """One lowered op, built once by its lowering rule (``_op_of``) and the
  only thing that carries it from there: what asking its ``partition``
  needs to know.
  XLA's callbacks find it by its key, and ask it alike (II.7).
  Equal and hashed on every field but the state (``_STATE``): equal ops of
  one lowering are one op (``pass_.ops``), sharing its answers."""
  name: str
  call: Any  # the body (a closed jaxpr, by identity): jax's own key
  partition: Callable | None
  infer_sharding_from_operands: Callable | None
  propagate_user_sharding: Callable | None
  given_rule: Any  # def_partition's sharding_rule (a callable, unasked)
  decode_shardings: bool
  check_vma: bool
  static_key: Any  # the static arguments' (_Statics.key)
  in_tree: Any
  out_tree: Any
  steps: tuple  # from the author's op to this one (empty: it is that)
  place: _Placement
  # Per operand and result: the manual axes it varies over, if tracked.
  varying: tuple = ((), ())  # seam: used by (II.4, II.7)
  platforms: Any = None
  backend: Any = None
  mesh: Any = None  # place.mesh, what the callbacks see
  # The rule (a callable one asked, _rule_of): a function of the fields
  # above and the op's shapes.
  sharding_rule: SdyShardingRule | None = dataclasses.field(
      default=None, **_STATE)
  # jax's config where the op was lowered, which partition and lower_fn run
  # under on XLA's thread (None: the caller's). Its keyed part is in the
  # content key; in one lowering it is one.
  config: tuple | None = dataclasses.field(  # seam: (II.7)
      default=None, **_STATE)
  # Partition request -> answer: the request holds every input not in the
  # op's key (shapes, dtypes, shardings). At lowering a dict, living with
  # the lowering (its op's placements: at most one entry per op).
  # For XLA's callbacks, which may ask from several threads as long as an
  # executable lives, a bounded _LRU (II.7).
  answers: dict | _LRU = dataclasses.field(default_factory=dict, **_STATE)
  # Partitioned at lowering, not by XLA's callbacks (II.7).
  at_lowering: bool = dataclasses.field(default=False, **_STATE)
  static_args: tuple = dataclasses.field(default=(), **_STATE)


def _first_pass(ctx, op: _Op, values, pass_: _Pass, index: int):
  """The op in the first lowering: a custom call tagged with its index,
  carrying its rule, which Shardy's propagation places (I.4); its rule
  context and ``_Op`` kept for ``_replace_tagged_calls``."""
  op, rule_attr = _rule_of(ctx, op, values, at_lowering=True)
  pass_.rules.append(op.sharding_rule)
  pass_.tagged.append((ctx, op))
  return _jax.custom_call(
      _TARGET, result_types=_ir_types(ctx, op.call.out_avals),
      operands=list(values), backend_config=f"{_AT_LOWERING_TAG}{index}",
      extra_attributes=rule_attr).results


def _rule_of(ctx, op: _Op, values, at_lowering: bool):
  """``(op, attributes)``: ``op`` with its rule (a callable one asked) and,
  under Shardy, the custom call's attributes carrying it."""
  rule, rule_attr = op.sharding_rule, None
  if callable(rule) or (_SHARDY.value and rule is not None):
    with _naming(f"sharding_rule of custom_partitioning op {op.name}: "):
      levels = _rule_levels(op.call, op.steps)
      if callable(rule):  # asked about the author's op
        rule = _asked_rule(ctx, op, levels[0])
      one_size = False
      if isinstance(op.partition, _FromRule):  # seam: one size a factor (II.5)
        one_size = True
      if _SHARDY.value and rule is not None:
        rule_attr = _rule_attr(rule, levels, one_size)
  elif _SHARDY.value:  # seam: a rule derived from infer (II.6)
    rule_attr = _derived_rule_attr(op, at_lowering)
  # Shardy's verifier refuses a rule on an op without operands (where it
  # could only tie results together); partition still decides them all.
  return dataclasses.replace(op, sharding_rule=rule), (
      None if rule_attr is None or not values else
      {"sdy.sharding_rule": rule_attr})


def _second_pass(ctx, op: _Op, values, pass_: _Pass, index: int):
  """The op in a second lowering (I.2): its manual computation, placed as
  the first pass's propagation decided, by its rule as the first pass
  asked it (in that pass's MLIR context)."""
  op = dataclasses.replace(op, sharding_rule=pass_.rules[index])
  try:
    return _manual_computation(ctx, op, values, pass_, index)
  except _KeepCallbacks as e:
    if "tpu" not in op.platforms:  # seam: XLA's callbacks (II.7)
      return _fallback_call(ctx, op, values)
    raise _cannot_lower(op.name, op.platforms, f"its partition {e}") from None


@contextlib.contextmanager
def _naming(prefix: str, suffix: str | Callable[[Exception], str] = ""):
  """Re-raises a plain ValueError or TypeError with ``prefix`` and
  ``suffix`` (or ``suffix(error)``) around its message; subclasses pass."""
  try:
    yield
  except (ValueError, TypeError) as e:
    if type(e) not in (ValueError, TypeError):
      raise
    after = suffix(e) if callable(suffix) else suffix
    raise type(e)(f"{prefix}{e}{after}") from e


class _Level(NamedTuple):
  """An op from the author's (``step`` None) up to the one XLA asks about:
  its values as asked or as partitioned, and its batch dimension's entry."""
  step: Any  # what made it from the level below; None: the author's op
  operands: list
  results: list
  entry: Any = None


def _rule_levels(call, steps: tuple) -> list[_Level]:
  """The op's values by level for its rule: the author's op, each step's."""
  values = ([_Value(a.shape, a.dtype) for a in call.in_avals],
            [_Value(a.shape, a.dtype) for a in call.out_avals])
  if steps:  # seam: a derived op (II.4)
    return _levels(steps, *values)
  return [_Level(None, *values)]


def _rule_attr(rule, levels: list, one_size: bool):
  """The op's Shardy rule: the author's ``rule`` walked up the ``levels``."""
  bottom = levels[0]
  n = len(bottom.operands)
  sizes, dims = _resolve_rule(
      rule, [v.shape for v in bottom.operands + bottom.results], n, one_size)
  ops, res, reduction = dims[:n], dims[n:], list(rule.reduction_factors)
  for level in levels[1:]:  # seam: a derived op's steps (II.4)
    ops, res, reduction = level.step.rule_up(level, sizes, ops, res, reduction)
  return _rule_attr_from_dims(sizes, ops + res, len(ops), reduction,
                              rule.need_replication_factors,
                              rule.permutation_factors)


def _resolve_rule(rule: SdyShardingRule, shapes: Sequence[Sequence[int]],
                  num_operands: int, one_size: bool = False):
  """Expands ``...`` against ``shapes`` (operands', then results') and
  sizes every factor: ``(sizes, dims)``, ``sizes`` each factor's in order of
  first use, ``dims[v][d]`` the factors of dimension ``d`` of value ``v``.
  Raises ValueError on a count or rank mismatch, a factor naming two
  dimensions of one value (Shardy refuses it), an ellipsis standing for
  different numbers of dimensions, or sizes that do not fit (with
  ``one_size``, two sizes of one factor)."""
  for kind, in_rule, in_op in (
      ("operands", len(rule.operand_mappings), num_operands),
      ("results", len(rule.result_mappings), len(shapes) - num_operands)):
    if in_rule != in_op:
      raise ValueError(f"Sharding rule has {in_rule} {kind}, but the "
                       f"operation has {in_op} {kind}.")
  sizes: dict[str, Any] = {}  # None while only compounds have shown it
  group_rank: dict[str, int] = {}
  dims: list[list[tuple[str, ...]]] = []
  mappings = (*rule.operand_mappings, *rule.result_mappings)
  for i, (mapping, shape) in enumerate(zip(mappings, shapes)):
    entries = list(mapping)
    if entries and _is_batching(entries[0]):  # an ellipsis (III.1)
      entries = _expand_ellipsis(entries, len(shape), group_rank)
    if len(entries) != len(shape):
      name = _value_name(i, num_operands)
      raise ValueError(f"Sharding rule {name} has rank {len(entries)}, but "
                       f"the operation {name} has rank {len(shape)}.")
    value_dims = [tuple(entry) if isinstance(entry, CompoundFactor)
                  else (entry,) for entry in entries]
    named = [f for factors in value_dims for f in factors]
    if len(set(named)) < len(named):
      raise ValueError(
          f"Factor {next(f for f in named if named.count(f) > 1)} names two "
          f"dimensions of {_value_name(i, num_operands)} in the rule "
          f"{_rule_text(rule)!r}, which Shardy refuses. Give each a factor "
          "of its own (e.g. 'i j -> i'), those that must not be sharded "
          "in need_replication_factors.")
    for factors, size in zip(value_dims, shape):
      for factor in factors:  # a compound's parts are sized by the rule
        new = size if len(factors) == 1 else rule.factor_sizes.get(factor)
        old = sizes.get(factor)
        if old is None:
          sizes[factor] = new
        elif new is not None and new != old:
          if factor.startswith(_BATCH_FACTOR_PREFIX):
            raise ValueError(f"Batching dimension {factor[1:]} has two "
                             f"sizes: {old} and {new}.")
          if one_size:  # its shards, cut by the rule, would not line up
            raise ValueError(
                f"Factor {factor} has two sizes, {old} and {new}, in the "
                f"rule {_rule_text(rule)!r}; an op defined by its rule "
                "alone needs one per factor (or define a partition).")
          sizes[factor] = min(old, new)  # like jax: the smaller size wins
    dims.append(value_dims)
  if any(len(factors) > 1 for value_dims in dims for factors in value_dims):
    _check_compounds(sizes, dims, shapes, num_operands)  # III.1
  return sizes, dims


def _is_batching(dim) -> bool:
  return (isinstance(dim, str) and dim.startswith(BATCHING) and
          (len(dim) == 1 or dim[1:].isdigit()))


def _rule_attr_from_dims(sizes: dict, dims: list, num_operands: int,
                         reduction, need_replication, permutation):
  """The attribute of a resolved rule; a factor too big for Shardy's parser
  becomes a compound of smaller ones (``_split_size``) everywhere."""
  parts: dict[str, range] = {}  # factor -> the indices of its parts
  part_sizes: list[int] = []
  for factor, size in sizes.items():
    split = [size]
    if size > _MAX_FACTOR_SIZE:  # too big for Shardy's parser (III.1)
      split = _split_size(size, next(
          f"{_value_name(i, num_operands)} dimension {d}"
          for i, value_dims in enumerate(dims)
          for d, factors in enumerate(value_dims) if factor in factors))
    parts[factor] = range(len(part_sizes), len(part_sizes) + len(split))
    part_sizes += split
  tensors = [_jax.TensorMappingAttr.get(dim_mappings=[
      _jax.DimMappingAttr.get(factor_indices=[i for f in factors
                                             for i in parts[f]])
      for factors in value_dims]) for value_dims in dims]
  reduction, need_replication, permutation = (
      [i for f in factors for i in parts[f]]
      for factors in (reduction, need_replication, permutation))
  kwargs: dict[str, Any] = {}
  # jaxlib 0.5.0 added reduction and need_replication factors, 0.5.1
  # permutation factors.
  if _JAXLIB_VERSION >= (0, 5, 0):
    kwargs.update(reduction_factors=reduction,
                  need_replication_factors=need_replication)
  if _JAXLIB_VERSION >= (0, 5, 1):
    kwargs["permutation_factors"] = permutation
  elif permutation or len(kwargs) < 2 and (reduction or need_replication):
    kinds, need = (("permutation", "0.5.1") if kwargs else
                   ("reduction, need_replication or permutation", "0.5.0"))
    raise NotImplementedError(
        f"Shardy sharding rules with {kinds} factors need jax/jaxlib {need} "
        f"or newer; found jaxlib {'.'.join(map(str, _JAXLIB_VERSION))}. "
        "Upgrade, use GSPMD, or drop the special factors from the rule.")
  if _JAXLIB_VERSION >= (0, 6, 1):  # before jaxlib 0.6.1 it fails compiling
    kwargs["is_custom"] = True
  return _jax.OpShardingRuleAttr.get(
      factor_sizes=part_sizes, operand_mappings=tensors[:num_operands],
      result_mappings=tensors[num_operands:], **kwargs)


def _asked_rule(ctx, op: _Op, author: _Level) -> SdyShardingRule:
  """What a callable ``sharding_rule`` answers about the author's op (with
  ``ctx`` None, while tracing: on types of an MLIR context of its own)."""
  with contextlib.ExitStack() as scope:
    if ctx is None:
      scope.enter_context(_jax.make_ir_context())
      scope.enter_context(_jax.Location.unknown())
    operand_types, result_types = ([_jax.RankedTensorType.get(
        v.shape, _jax.dtype_to_ir_type(v.dtype)) for v in side] if ctx is None
        else _ir_types(ctx, [_jax.ShapedArray(v.shape, v.dtype) for v in side])
        for side in (author.operands, author.results))
    produced = op.given_rule(
        *op.static_args, op.mesh, operand_types, result_types)
  kwargs: dict = {}
  if isinstance(produced, (tuple, list)) and len(produced) == 2:
    produced, kwargs = produced
  if isinstance(produced, str):
    return str_to_sdy_sharding_rule(produced, **kwargs)
  if not isinstance(produced, SdyShardingRule):
    raise ValueError(
        "A callable sharding_rule must return an SdyShardingRule, an "
        f"einsum-like string, or (string, kwargs); got {produced!r}.")
  return produced


def _varying_axes(aval) -> frozenset | None:  # seam: used by (II.3, II.7)
  """The manual axes ``aval`` varies over in ``shard_map`` (None: untracked)."""
  # jax 0.6 added ShapedArray.vma; 0.10 moved it to manual_axis_type.varying.
  mat = getattr(aval, "manual_axis_type", None)
  return getattr(aval, "vma", None) if mat is None else mat.varying


_TARGET = f"CustomSPMDPartitioning.{__name__}"
_AT_LOWERING_TAG = f"{_TARGET}:at-lowering:"  # + the op's index


def _ir_types(ctx: _jax.LoweringRuleContext, avals) -> list[_jax.Type]:
  # jax 0.10.1 made aval_to_ir_types take the module context first.
  first = (ctx.module_context,) if _JAX_VERSION >= (0, 10, 1) else ()
  return [t for aval in avals for t in _jax.aval_to_ir_types(*first, aval)]


# jax 0.12.1's jax_partitioning flag lowers each primitive on an Explicit
# mesh as a shard_map by its rule, refusing one without; None lowers the op
# as without the flag: it partitions itself.
_jax.register_lowering(custom_partitioning_p, _lowering_rule, **(
    {"shard_map_collective_rule": lambda *_, **__: None}
    if _JAX_VERSION >= (0, 12, 1) else {}))
# Lowering needs the concrete devices (to pick the mesh and key the op).
_jax.prim_requires_devices_during_lowering.add(custom_partitioning_p)


# --------------------------------------------------------------------------
# I.4 Placements from Shardy
#
# Shardy's propagation, run in-process on a copy of the first lowering's
# module, places each tagged op's operands and results; they are read back
# as ``_Sdy`` placements by the op's index (unplaced: replicated), and
# ``_replace_tagged_calls`` replaces each tagged call, in the module jax
# lowered, by its manual computation (I.5, I.6).
# --------------------------------------------------------------------------

def _propagated(module) -> dict:
  """``{index: [(operand placements, result placements), ...]}``: each tagged
  op's ``_Sdy`` placements (None: unplaced) after Shardy's propagation of a copy
  of ``module``, one per place it runs in, in lowering order (jax lowers a
  function of several callers, and equal ops, once; Shardy places each copy)."""
  with module.context:
    if any(isinstance(a.type, _jax.ShapedType) and
           not a.type.has_static_shape
           for f in module.body.operations if f.operation.name == "func.func"
           for b in f.regions[0].blocks for a in b.arguments):
      # Shardy's propagation refuses a dynamic shape (an argument jax.export
      # made symbolic; the ops' own are static: _lowering_rule): ops
      # unplaced, asked on replicated values, as XLA's propagation would.
      return {}
    copy = module.operation.clone()  # a tenth of a bytecode round trip
    propagation = _jax.passmanager.PassManager.parse(
        "builtin.module(sdy-propagation-pipeline)")
    # jax verified the module; verifying after every pass tripled the time.
    propagation.enable_verifier(False)
    propagation.run(copy.operation)
    # A sharding names its mesh by symbol: `sdy.mesh @name = <[...]>`.
    meshes = {_jax.ir.StringAttr(op.attributes["sym_name"]).value:
              _jax.MeshAttr(op.attributes["mesh"])
              for op in copy.body.operations if op.name == "sdy.mesh"}
    decided: dict = {}
    for op in _in_lowering_order(copy):
      if (index := _tag_index(op)) is None:
        continue
      decided.setdefault(index, []).append((
          [_value_placement(v, meshes) for v in op.operands],
          _placements_of(op.attributes, "sdy.sharding", len(op.results),
                         meshes)))
  return decided


def _per_site(decided: dict) -> bool:  # seam: used by (II.9)
  """Whether propagation placed some op differently in different places."""
  return any(any(s != sites[0] for s in sites) for sites in decided.values())


def _replace_tagged_calls(module, pass_: _Pass) -> None:
  """Lowers each op's manual computation where its tagged custom call
  stands, in the rule context jax lowered the op in, and drops the call:
  lowering the whole program again would cost as much as the first time.
  Off TPU, an op jax cannot lower so keeps its call (and its rule), for
  XLA's callbacks (II.7).
  """
  # jax lowers equal equations (and a function of several callers) once:
  # one index may stand at many calls, all placed alike here.
  calls = [(op, index) for op in _operations(module.operation)
           if (index := _tag_index(op)) is not None]
  # jax's symbol table predates the meshes its lowering lifted last; a
  # function lowered here must not take one of their names.
  table = _jax.ir.SymbolTable(module.operation)
  for ctx, _ in pass_.tagged:
    ctx.module_context.symbol_table = table
  counts = collections.Counter(pass_.tagged[index][1] for _, index in calls)
  pass_.repeated = {op for op, n in counts.items() if n > 1}
  with module.context:
    for call, index in calls:
      ctx, op = pass_.tagged[index]
      try:
        with _jax.ir.InsertionPoint(call), call.location:
          results = _manual_computation(ctx, op, list(call.operands),
                                        pass_, index)
      except _KeepCallbacks as e:
        if "tpu" not in op.platforms:  # seam: XLA's callbacks (II.7)
          call.attributes["backend_config"] = _jax.ir.StringAttr.get(
              _register(ctx, op))  # the call stays, for XLA's callbacks
          continue
        raise _cannot_lower(op.name, op.platforms,
                            f"its partition {e}") from None
      flat = [v for r in results
              for v in ([r] if isinstance(r, _jax.ir.Value) else r)]
      for old, new in zip(call.results, flat):
        old.replace_all_uses_with(new)
      call.erase()
    # As jax's own lowering ends: meshes named inline become module symbols.
    _jax.passmanager.PassManager.parse(
        "builtin.module(sdy-lift-inlined-meshes)").run(module.operation)


def _tag_index(op) -> int | None:
  """The lowering-order index of an op's tagged custom call, else None."""
  if op.name != "stablehlo.custom_call" or "backend_config" not in (
      op.attributes):
    return None
  config = str(op.attributes["backend_config"]).strip('"')
  return (int(config[len(_AT_LOWERING_TAG):])
          if config.startswith(_AT_LOWERING_TAG) else None)


def _in_lowering_order(module) -> list:
  """The operations of ``module``'s ``main`` in the order jax lowered
  them: a called function's where it is called (once per call)."""
  functions = {_jax.ir.StringAttr(f.attributes["sym_name"]).value: f
               for f in (op.operation for op in module.body.operations)
               if "sym_name" in f.attributes}
  walked: dict = {}

  def walk(op) -> list:
    found = []
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          inner = inner.operation
          found.append(inner)
          if inner.name == "func.call":
            callee = _jax.ir.FlatSymbolRefAttr(inner.attributes["callee"]).value
            if callee not in walked and callee in functions:
              walked[callee] = []  # (a recursive call finds it empty)
              walked[callee] = walk(functions[callee])
            found += walked.get(callee, [])
          found += walk(inner)
    return found
  if "main" not in functions:
    return list(_operations(module.operation))
  return walk(functions["main"])


def _operations(op):
  for region in op.regions:
    for block in region.blocks:
      for inner in block.operations:
        yield inner.operation
        yield from _operations(inner.operation)


def _value_placement(value, meshes: dict) -> _Sdy | None:
  """The placement of an operand: its producer's, its function's argument
  attribute, or its while loop's (None: unknown, taken as replicated)."""
  try:  # a cast from a plain Value (jaxlib 0.9's bindings give no subclass)
    result = _jax.ir.OpResult(value)
  except ValueError:
    result = None
  if result is not None:
    owner = result.owner.operation
    # Shardy's own ops name their results' shardings otherwise.
    name = {"sdy.sharding_constraint": "sharding", "sdy.reshard": "sharding",
            "sdy.manual_computation": "out_shardings"}.get(owner.name,
                                                           "sdy.sharding")
    return _placements_of(owner.attributes, name, len(owner.results),
                          meshes)[result.result_number]
  arg = _jax.ir.BlockArgument(value)
  parent = arg.owner.owner
  if parent is None:
    return None
  parent = parent.operation
  if parent.name == "func.func" and "arg_attrs" in parent.attributes:
    attrs = _jax.ir.ArrayAttr(parent.attributes["arg_attrs"])[arg.arg_number]
    return _placements_of(_jax.ir.DictAttr(attrs), "sdy.sharding", 1, meshes)[0]
  if parent.name == "stablehlo.while":
    return _placements_of(parent.attributes, "sdy.sharding",
                          len(parent.results), meshes)[arg.arg_number]
  return None


class _Sdy(NamedTuple):
  """A placement Shardy decided, read out of its MLIR context (which dies
  with the lowering): the mesh it names, as ``axes`` ((name, size), ...)
  and logical ``device_ids`` (None: in order), and per dimension the axes
  sharding it, major first, each ``(name, pre_size, size)`` (a sub-axis
  where ``size`` is less than the axis's)."""
  axes: tuple
  device_ids: tuple | None
  dims: tuple


def _placements_of(attributes, name: str, count: int, meshes: dict) -> list:
  """The ``_Sdy`` placements ``attributes[name]`` gives ``count`` values
  (None: unplaced, i.e. replicated)."""
  if name not in attributes:
    return [None] * count
  attr = attributes[name]
  shardings = (list(_jax.TensorShardingPerValueAttr(attr).shardings)
               if _jax.TensorShardingPerValueAttr.isinstance(attr) else
               [attr])
  if len(shardings) != count:
    return [None] * count
  return [_sdy_placement(_jax.TensorShardingAttr(s), meshes) for s in shardings]


def _sdy_placement(sharding, meshes: dict) -> _Sdy | None:
  ref = sharding.mesh_or_ref  # an inlined mesh, or its symbol's name
  mesh = (_jax.MeshAttr(ref) if _jax.MeshAttr.isinstance(ref) else
          meshes.get(_jax.ir.FlatSymbolRefAttr(ref).value))
  if mesh is None:
    return None
  axes = tuple((a.name, a.size) for a in map(_jax.MeshAxisAttr, mesh.axes))
  sizes = dict(axes)
  dims = []
  for dim in map(_jax.DimensionShardingAttr, sharding.dimension_shardings):
    refs = []
    for axis in map(_jax.AxisRefAttr, dim.axes):
      sub = axis.sub_axis_info
      sub = None if sub is None else _jax.SubAxisInfoAttr(sub)
      refs.append((axis.name, 1, sizes[axis.name]) if sub is None else
                  (axis.name, sub.pre_size, sub.size))
    dims.append(tuple(refs))
  return _Sdy(axes, tuple(mesh.device_ids) or None, tuple(dims))


# --------------------------------------------------------------------------
# I.5 Asking partition, and its checks
#
# ``partition`` is asked on the placements Shardy decided, its answer and
# ``lower_fn``'s results on per-shard shapes checked. ``op.mesh`` is what it
# sees; ``on`` names the mesh of a value's spec and HloSharding (``op.mesh``,
# in a partly manual shard_map ``op.place.auto``, or the mesh ``partition``
# returned, ``_Answer.on``).
# The per-shard program's own checks follow from here (II.1).
# --------------------------------------------------------------------------

def _manual_computation(ctx, op: _Op, values, pass_: _Pass, index: int):
  """The op as a manual computation of its per-shard program, placed as
  the first pass's propagation decided (unplaced: replicated); raises
  ``_KeepCallbacks`` where jax cannot lower that."""
  # Equal ops of one lowering share one _Op, whose answers (op.answers, by
  # the placements asked) are a fresh partition's: the lowering's config
  # and equal ops' fields are one; they live and die with the lowering.
  op = pass_.ops.setdefault(op, op)
  site = pass_.sites.get(index, 0)  # which of the op's places this is
  pass_.sites[index] = site + 1
  decided = _placement(pass_, index, site)
  if pass_.per_site is not None:  # seam: ops placed apart (II.9)
    pass_.per_site.lowered(index, decided)
  operand_places, result_places = decided or ([None] * len(values),
                                              [None] * len(ctx.avals_out))
  operands, results = ([_Value(tuple(a.shape), np.dtype(a.dtype), *(
      _decoded_placement(placed, len(a.shape), op.mesh)))
                        for a, placed in zip(avals, places)]
                       for avals, places in ((ctx.avals_in, operand_places),
                                             (ctx.avals_out, result_places)))
  request = ("manual", *(tuple(str(v.hlo) if v.spec is None else v.spec
                               for v in side)
                         for side in (operands, results)))
  program = op.answers.get(request)
  if program is None:  # (partition runs on this thread, in its config)
    # Jitted where equal ops share it (lowered once, called by each);
    # a jit of one caller only adds a tenth to its lowering.
    jit = pass_.repeated is None or op in pass_.repeated
    if any(isinstance(s, (_Jvp, _Vjp)) for s in op.steps):  # seam: (II.4)
      program = _derivative_program(op, operands, results, jit)
    if program is None:
      shard = _shard_of(op, operands, results, op.mesh)
      _check_lowerable(op, shard)
      program = _manual_program(op, shard, jit=jit)
    op.answers[request] = program
  if _log.isEnabledFor(logging.DEBUG):  # seam: the log (II.8)
    _debug(op.name, "path", path=_AT_LOWERING_PATH, mesh=op.mesh,
           asked=_logged(operands, results))
  # Traced on unsharded types: on Explicit axes the operands' types may
  # differ from what partition asked for (the manual computation reshards).
  with _no_ambient_mesh():
    unsharded = ctx.replace(avals_in=[_jax.ShapedArray(a.shape, a.dtype)
                                      for a in ctx.avals_in])
    try:
      return _jax.lower_fun(program, multiple_results=True)(unsharded,
                                                            *values)
    except KeyError as e:  # jax has no token for an ordered effect
      if not isinstance(e.args[0], _jax.Effect):
        raise
      raise NotImplementedError(
          f"lower_fn of custom_partitioning op {op.name} has an ordered "
          f"effect ({type(e.args[0]).__name__}: io_callback(..., "
          "ordered=True)), which jax orders only in the program it traced, "
          "where the op declares none. Pass ordered=False, or call it "
          "before or after the op.") from None


def _placement(pass_: _Pass, index: int, site: int):
  """Where propagation placed op ``index`` in its ``site``-th place."""
  sites = pass_.decided.get(index) or [None]
  return sites[min(site, len(sites) - 1)]


# A value placed as Shardy decided, given to ``partition`` as upstream gives it:
# ``(spec, hlo)``, its HloSharding and the PartitionSpec of that on ``mesh``
# (the op's, whatever mesh Shardy named; None where no spec states it, as a
# sub-axis that is not a whole axis of ``mesh``). Equal ops of a program share
# placements: each decoded once (jax's decoding of an HloSharding costs more
# than the rest of reading it). The answer is a function of the key alone
# (placement, rank, mesh: all values).
@_jax.cache(max_size=_CACHE_SIZE, trace_context_in_key=False)
def _decoded_placement(placed: _Sdy | None, ndim: int, mesh):
  # The HloSharding on the logical device ids of ``placed``'s mesh.
  if placed is None or not any(placed.dims):
    hlo = _jax.HloSharding.replicate()
    return _decode_spec(hlo, mesh, ndim), hlo
  # Each axis cut at every sub-axis boundary, its pieces major first: a
  # grid of the mesh's devices, in which each sub-axis is a run of pieces.
  cuts = {name: {1, size} for name, size in placed.axes}
  for name, pre, size in itertools.chain.from_iterable(placed.dims):
    cuts[name] |= {pre, pre * size}
  piece, grid = {}, []
  for name, _ in placed.axes:
    bounds = sorted(cuts[name])
    for low, high in zip(bounds, bounds[1:]):
      piece[name, low] = len(grid)
      grid.append(high // low)
  dims = tuple(placed.dims[:ndim]) + ((),) * (ndim - len(placed.dims))
  order, tiles = [], []
  for dim in dims:
    run = [piece[name, low] for name, pre, size in dim
           for low in sorted(cuts[name]) if pre <= low < pre * size]
    order += run
    tiles.append(math.prod(grid[i] for i in run))
  order += [i for i in range(len(grid)) if i not in order]
  copies = math.prod(grid) // math.prod(tiles)
  if placed.device_ids is None:  # the mesh's devices in order: as XLA's
    devices = (f"<=[{math.prod(grid)}]" if order == sorted(order) else
               f"<=[{','.join(map(str, grid))}]"
               f"T({','.join(map(str, order))})")
  else:
    devices = ",".join(map(str, np.asarray(placed.device_ids).reshape(
        grid).transpose(order).ravel()))
  # HLO's sharding text: every supported jaxlib parses it, where building
  # one from parts needs xla_client's OpSharding too.
  shape = ",".join(map(str, tiles + [copies] * (copies > 1)))
  hlo = _jax.HloSharding.from_string(
      f"{{devices=[{shape}]{devices}"
      f"{' last_tile_dim_replicate' if copies > 1 else ''}}}")
  return _decode_spec(hlo, mesh, ndim), hlo


def _decode_spec(hlo_sharding: _jax.HloSharding, mesh, ndim: int):
  """PartitionSpec entries of ``hlo_sharding`` on ``mesh``, or None."""
  if all(d == 1 for d in hlo_sharding.tile_assignment_dimensions()[:ndim]):
    # Also "replicated within a manual subgroup", which jax cannot parse.
    if hlo_sharding.is_replicated() or hlo_sharding.is_tiled():
      return (None,) * ndim
  try:
    spec = _jax.parse_flatten_op_sharding(hlo_sharding, mesh)[0]
    # jax 0.5.3 returns a PartitionSpec; before it, a ParsedPartitionSpec.
    spec = tuple(spec.get_partition_spec() if _JAX_VERSION < (0, 5, 3)
                 else spec)
  except Exception:  # noqa: BLE001 - not expressible on this mesh
    return None
  # Entries past ``ndim`` describe subgroup (manual/replicated) dimensions.
  return spec[:ndim] + (None,) * (ndim - len(spec))


def _shard_of(op: _Op, operands: list, results: list, on) -> _Answer:
  """``partition``'s answer with its per-shard program traced."""
  if op.steps:  # seam: a derived op (II.4)
    return _partition_derived(op, operands, results, on)
  answer, closed = _partition(op, operands, results, on)
  return answer._replace(jaxpr=closed)


def _partition(op: _Op, operands: list, results: list, on):
  """``(answer, jaxpr)``: ``partition``'s answer, its ``lower_fn`` traced
  (None: where ``_manual_program`` traces it)."""
  operands, results = _replicated_as_needed(op, operands, results)
  answer = _ask_partition(op, operands, results, on)
  if _log.isEnabledFor(logging.DEBUG):  # seam: the log (II.8)
    _debug_partition(op, operands, results, answer)
  # At lowering the per-shard code joins the program, callbacks and all
  # (jax 0.5.3 cannot lower a debug callback in a manual computation under
  # Shardy; 0.7.2 can); from there, where no check reads its jaxpr,
  # lower_fn is traced once, in its manual computation (I.6): a second
  # trace cost a third of an op's lowering.
  inside = op.at_lowering and _JAX_VERSION >= (0, 7, 0)
  everywhere = _sharded_everywhere(answer)
  if inside and not op.steps and (not op.check_vma or everywhere):
    closed = None
  else:
    closed = _trace_lower_fn(op, answer)
  if op.check_vma and (  # seam: per-shard checks (II.1)
      closed is not None or _padded(answer.args, answer.on)):
    # (untraced, sharded everywhere: nothing to check unless padded)
    _check_per_shard(op, answer, operands + results, closed, everywhere)
  if not inside and _calls_host(closed):
    raise _host_callback_error(op)
  return answer, closed


def _replicated_as_needed(op: _Op, operands: list, results: list):
  """``operands`` and ``results`` with every dimension of a factor the rule
  says needs replication unsharded (a compound one from that factor on):
  the rule states what the per-shard code can take, so partition is asked
  (and XLA reshards) accordingly."""
  rule = op.sharding_rule
  if not (isinstance(rule, SdyShardingRule) and rule.need_replication_factors):
    return operands, results
  values = operands + results
  try:  # a rule that does not fit the op fails elsewhere, with its cause
    sizes, dims = _resolve_rule(rule, [v.shape for v in values], len(operands))
  except ValueError:
    return operands, results
  needed = set(rule.need_replication_factors)
  for i, (v, value_dims) in enumerate(zip(values, dims)):
    spec = None if v.spec is None else tuple(v.spec) + (None,) * (
        len(v.shape) - len(v.spec))
    if spec is not None and any(
        e is not None and needed.intersection(factors)
        for factors, e in zip(value_dims, spec)):
      values[i] = v._replace(hlo=None, spec=tuple(
          _before_needed(factors, e, needed, sizes, op.mesh)
          if needed.intersection(factors) else e
          for factors, e in zip(value_dims, spec)))
  return values[:len(operands)], values[len(operands):]


def _before_needed(factors: tuple, entry, needed: set, sizes: dict, mesh):
  """``entry``, a dimension's, less the axes that shard its factors from the
  first that needs replication on: its major axes stay while their blocks hold
  whole rows of that factor on (their sizes' product divides the factors' before
  it, an axis crossing from one of those into the next included)."""
  room = math.prod(sizes.get(f) or 1 for f in itertools.takewhile(
      lambda f: f not in needed, factors))
  kept = []
  for axis in _entry_axes(entry):
    if room % mesh.shape[axis]:
      break
    room //= mesh.shape[axis]
    kept.append(axis)
  return None if not kept else kept[0] if len(kept) == 1 else tuple(kept)


def _ask_partition(op: _Op, operands: list, results: list, on) -> _Answer:
  """``partition`` asked about values on ``on``, its answer checked."""
  if isinstance(op.partition, _FromRule):  # seam: rule-only op (II.5)
    answer = _partition_from_rule(op, operands, results)
  else:
    answer = op.partition(*op.static_args, op.mesh,
                          _structs(op, op.in_tree, operands, on),
                          _structs(op, op.out_tree, results, on))
  mesh, lower_fn, out_shardings, in_shardings = _checked_answer(op, answer)
  if op.place.auto is None:
    on = mesh  # lower_fn runs on it: its axis names may differ from the op's
  return _Answer(mesh, on, lower_fn,
                 _encode(op, op.in_tree, in_shardings, operands, "partition",
                         "arg sharding", on),
                 _encode(op, op.out_tree, out_shardings, results,
                         "partition", "result sharding", on))


def _structs(op: _Op, tree, values, on=None):
  """The callbacks' view of ``values`` (on ``on``): ShapeDtypeStructs with
  NamedShardings (``decode_shardings``, a spec) or GSPMDShardings, if known."""
  on = op.mesh if on is None else on
  structs = []
  for v in values:
    if v.spec is None and v.hlo is None:
      sharding = None
    elif op.decode_shardings and v.spec is not None and not op.mesh.empty:
      sharding = jax.sharding.NamedSharding(
          op.mesh, jax.sharding.PartitionSpec(*v.spec))
    else:
      sharding = _jax.GSPMDSharding(
          op.place.devices if on == op.mesh else tuple(on.devices.flat),
          _hlo_of(v, on))
    try:
      struct = jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
    except NotImplementedError:  # XLA's manual subgroup (a partly manual
      struct = jax.ShapeDtypeStruct(v.shape, v.dtype)  # shard_map): unshown
    structs.append(struct)
  return tree.unflatten(structs)


def _checked_answer(op: _Op, answer) -> tuple:
  """``partition``'s answer, ``(mesh, lower_fn, result shardings, arg
  shardings)``, checked, its mesh concrete (in a shard_map: the whole)."""
  where, devices = f"partition of {op.name}", op.place.devices
  if not isinstance(answer, (tuple, list)) or len(answer) != 4:
    got = (f"a sequence of length {len(answer)}"
           if isinstance(answer, (tuple, list)) else type(answer).__name__)
    raise TypeError(f"{where} must return (mesh, lower_fn, result_shardings, "
                    f"arg_shardings); got {got}.")
  mesh, lower_fn, out_shardings, in_shardings = answer
  if not callable(lower_fn):
    raise TypeError(f"{where} returned a lower_fn of type "
                    f"{type(lower_fn).__name__}, which is not callable.")
  if not isinstance(mesh, (_jax.Mesh, _jax.AbstractMesh)):
    raise TypeError(f"{where} returned a mesh of type {type(mesh).__name__}; "
                    "expected a jax.sharding.Mesh.")
  if op.place.auto is not None:  # seam: a partly manual shard_map (II.2)
    # Collectives name the whole program's devices.
    return op.place.whole, lower_fn, out_shardings, in_shardings
  real = not mesh.empty  # an empty mesh is the op's
  if real and isinstance(mesh, _jax.Mesh) and set(mesh.devices.flat) != set(
      devices):
    raise ValueError(
        f"{where} returned a mesh on devices "
        f"{sorted(d.id for d in mesh.devices.flat)}, but the op runs on "
        f"{sorted(d.id for d in devices)}.")
  if real and isinstance(mesh, _jax.AbstractMesh) and mesh.size != len(devices):
    raise ValueError(f"{where} returned a mesh of {mesh.size} devices, but "
                     f"the op runs on {len(devices)}.")
  if isinstance(mesh, _jax.AbstractMesh):
    mesh = _concrete(op, mesh)
  if op.steps and dict(mesh.shape) != dict(op.mesh.shape):  # seam: (II.4)
    raise NotImplementedError(
        f"{where} returned a mesh with axes {dict(mesh.shape)}, but the op's "
        f"mesh has {dict(op.mesh.shape)}; under jax.vmap, jax.jvp and "
        "jax.grad they must be the same.")
  return mesh, lower_fn, out_shardings, in_shardings


class _Answer(NamedTuple):
  """``partition``'s answer, checked: the mesh ``lower_fn`` runs on, the
  mesh ``on`` of the specs, the shardings; once traced, the per-shard
  program (``jaxpr``) XLA gets, with the shardings it takes and gives
  (None at lowering where no check reads it: I.6 traces ``lower_fn``)."""
  mesh: Any
  on: Any
  lower_fn: Callable
  args: list
  results: list
  jaxpr: Any = None


def _concrete(op: _Op, mesh: _jax.AbstractMesh):
  """An AbstractMesh made concrete on the op's devices (as upstream)."""
  if not op.mesh.empty and op.mesh.abstract_mesh == mesh:
    return op.mesh
  return _mesh_from_abstract(op.place.devices, mesh)


def _encode(op: _Op, tree, answer, like: list, callback: str, what: str,
            on=None) -> list[_Value]:
  """The author's pytree of shardings for ``like``, checked, as
  ``_Value``s with specs on ``on``."""
  on = op.mesh if on is None else on
  leaves = None  # a list where a tuple is expected is fine
  for value in [answer, tuple(answer)] if isinstance(answer, list) else [
      answer]:
    with contextlib.suppress(ValueError, TypeError):
      leaves = tree.flatten_up_to(value)
      break
  if leaves is None:
    raise ValueError(f"{callback} of {op.name} returned {what}s {answer!r}, "
                     f"whose structure does not match {tree}.")
  out = []
  for i, (sharding, v) in enumerate(zip(leaves, like)):
    where = f"{callback} of {op.name} returned {what} {i}"
    ndim = len(v.shape)
    if not isinstance(sharding, jax.sharding.Sharding):
      raise TypeError(f"{where} as a {type(sharding).__name__}; expected a "
                      "jax.sharding.Sharding.")
    if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(
        sharding.mesh, _jax.AbstractMesh):
      sharding = jax.sharding.NamedSharding(_concrete(op, sharding.mesh),
                                            sharding.spec)
    handed = False
    if on == op.place.auto:  # seam: a partly manual shard_map (II.2)
      handed = _handed_back(op, sharding)
    if not handed and sharding.device_set != set(op.place.devices):
      raise ValueError(
          f"{where} on devices {sorted(d.id for d in sharding.device_set)}, "
          f"but the op runs on {sorted(d.id for d in op.place.devices)}.")
    # Entries past the rank that shard nothing are read as upstream reads
    # them (jax's cuDNN attention specs its rank-3 statistics so).
    if isinstance(sharding, jax.sharding.NamedSharding) and any(
        e is not None and (not isinstance(e, (str, tuple)) or _shard_count(
            e, sharding.mesh) > 1) for e in sharding.spec[ndim:]):
      raise ValueError(f"{where} with spec {_spec_text(sharding.spec)} for "
                       f"a value of rank {ndim}.")
    if on == op.place.auto and not handed:  # seam: partly manual (II.2)
      sharding = _onto_auto_axes(op, sharding, where)
    hlo = sharding._to_xla_hlo_sharding(ndim)
    spec = None if on.empty else _decode_spec(hlo, on, ndim)
    if (  # seam: infer's and propagate's (II.3, II.4, II.6, II.7)
        spec is None and callback != "partition" and isinstance(
            sharding, jax.sharding.NamedSharding) and not on.empty and
        dict(sharding.mesh.shape) != dict(on.shape)):
      # (A renamed mesh of the op's shape decodes: it places alike.)
      raise _ForeignMesh(
          f"{where} on the mesh {dict(sharding.mesh.shape)}, but the op's "
          f"mesh, which it was given, is {dict(on.shape)}, and no "
          "PartitionSpec of the op's mesh places the value so: return "
          "shardings on the mesh passed to it.")
    if spec is None and op.steps:  # seam: a derived op (II.4)
      raise NotImplementedError(
          f"{where}, which has no PartitionSpec on the mesh "
          f"{dict(op.mesh.shape)}; under jax.vmap, jax.jvp and jax.grad, "
          "shardings must have one.")
    out.append(v._replace(spec=spec, hlo=hlo))
  return out


class _ForeignMesh(ValueError):  # seam: used by (II.3, II.4, II.6, II.7)
  """A callback answered on a mesh other than the one it was given."""


def _sharded_everywhere(answer: _Answer) -> bool:
  """Whether partition shards every result over every mesh axis (none
  is replicated, so none can vary where it may not)."""
  on = answer.on
  return all(v.spec is not None and math.prod(
      _shard_count(e, on) for e in v.spec) == on.size for v in answer.results)


def _shard_count(entry, mesh) -> int:
  """How many shards a PartitionSpec entry cuts its dimension into."""
  return math.prod(mesh.shape[a] for a in _entry_axes(entry))


def _entry_axes(entry) -> tuple:
  """A PartitionSpec entry as a tuple of mesh axis names."""
  return (() if entry is None else
          tuple(entry) if isinstance(entry, tuple) else (entry,))


def _trace_lower_fn(op: _Op, answer: _Answer) -> _ClosedJaxpr:
  """``lower_fn`` traced on local shapes; its results checked against the
  shapes and dtypes ``partition``'s result shardings need."""
  args = _lower_fn_args(op, answer.lower_fn,
                        [_local_struct(v, answer.on) for v in answer.args])
  try:
    with _manual_scope(answer.mesh):
      closed, out_shape = jax.make_jaxpr(
          answer.lower_fn, axis_env=list(answer.mesh.shape.items()),
          return_shape=True)(*args)
      if getattr(closed, "is_high", False):  # jax 0.11.2 added hijax
        closed = _lojax(closed, answer.mesh)
  except NameError as e:  # an unbound axis name
    if not answer.mesh.empty:
      raise
    raise ValueError(
        f"lower_fn of {op.name} names a mesh axis ({e}), but partition "
        "returned the empty mesh: the op's mesh could not be recovered (the "
        "program's shardings are not NamedShardings and no mesh is set). "
        "Return a mesh over the op's devices, or use NamedSharding inputs, "
        "jax.set_mesh or `with mesh:`.") from e
  _check_lower_fn_results(op, answer, jax.tree_util.tree_leaves(out_shape))
  return closed


def _lower_fn_args(op: _Op, lower_fn: Callable, flat: list) -> tuple:
  """The op's operands (``flat``, per shard) as ``lower_fn`` takes them;
  a TypeError where its signature cannot."""
  args = op.in_tree.unflatten(flat)
  try:
    inspect.signature(lower_fn).bind(*args)
  except TypeError as e:
    raise TypeError(f"lower_fn of {op.name} cannot take the op's {len(args)} "
                    f"operand(s): {e}.") from None
  except ValueError:  # no signature to read (a builtin): let the call tell
    pass
  return args


def _check_lower_fn_results(op: _Op, answer: _Answer, got: list) -> None:
  """Raises where ``lower_fn``'s results (``got``, flat) are not the per-shard
  shapes and dtypes ``partition``'s result shardings need."""
  local_results = [_local_struct(v, answer.on) for v in answer.results]
  if len(got) != len(local_results):
    raise ValueError(
        f"lower_fn of {op.name} returned {len(got)} outputs; the op has "
        f"{len(local_results)} ({op.out_tree}).")
  for i, (g, want) in enumerate(zip(got, local_results)):
    if g.shape != want.shape or g.dtype != want.dtype:
      raise ValueError(
          f"lower_fn of {op.name} returned result {i} with local shape "
          f"{g.dtype}{list(g.shape)}, but its result sharding needs "
          f"{want.dtype}{list(want.shape)}.")


def _local_struct(v: _Value, on) -> jax.ShapeDtypeStruct:
  """A shard of ``v``, uneven dimensions rounded up (XLA pads)."""
  if v.spec is None:
    tile = v.hlo.tile(_jax.Shape.array_shape(np.dtype(v.dtype), v.shape))
    return jax.ShapeDtypeStruct(tuple(tile.dimensions()), v.dtype)
  spec = tuple(v.spec) + (None,) * (len(v.shape) - len(v.spec))
  return jax.ShapeDtypeStruct(
      tuple(-(-size // _shard_count(e, on)) for size, e in zip(v.shape, spec)),
      v.dtype)


def _manual_scope(mesh):
  """Where lower_fn is traced: ``mesh`` with every axis Manual, as in
  jax.shard_map, so that jax.lax.pcast/pvary can mark a loop carry varying
  (no equation outside check_vma); no mesh where jax has no varying types."""
  # jax 0.6.0 added varying types (pvary); 0.8.2 pcast.
  if mesh.empty or not (hasattr(jax.lax, "pcast") or hasattr(jax.lax, "pvary")):
    return _no_ambient_mesh()
  am = mesh.abstract_mesh
  return _jax.use_abstract_mesh(am.update_axis_types(
      {name: jax.sharding.AxisType.Manual for name in am.axis_names}))


def _lojax(closed, mesh=None):
  """``closed``, a high jaxpr, with its hijax primitives expanded (jax
  lowers only low jaxprs), collectives bound to ``mesh``'s axes."""
  with _jax.extend_axis_env_nd(list(mesh.shape.items()) if mesh else []):
    return _jax.lower_jaxpr2(closed)


def _calls_host(jaxpr) -> bool:
  """Whether ``jaxpr`` (or a jaxpr nested in it, closed or not) calls back
  to Python."""
  return any(eqn.primitive.name in {"debug_callback", "pure_callback",
                                    "io_callback"} for eqn in jaxpr.eqns) or (
      any(_calls_host(sub) for sub in _jax.subjaxprs(jaxpr)))


def _host_callback_error(op: _Op) -> NotImplementedError:
  return NotImplementedError(
      f"lower_fn of {op.name} calls back to Python (jax.debug.callback, "
      "jax.debug.print, jax.pure_callback or io_callback), which XLA "
      "cannot run inside a custom-partitioned op. Move the callback out "
      "of lower_fn, before or after the op.")


# --------------------------------------------------------------------------
# I.6 The per-shard program as a manual computation
#
# pad -> ``jax.shard_map`` of the per-shard program -> slice, jitted, in
# the program jax lowers; an answer jax cannot lower so raises
# ``_KeepCallbacks``.
# Off TPU, XLA's callbacks then take the op (II.7).
# --------------------------------------------------------------------------

class _KeepCallbacks(Exception):
  """Why an op's answer cannot become a manual computation: off TPU, XLA's
  callbacks partition it instead."""


def _check_lowerable(op: _Op, shard: _Answer):
  """Raises ``_KeepCallbacks`` where jax cannot lower ``shard`` (an answer
  of ``op``'s) as a manual computation."""
  mesh = shard.mesh  # jax lowers it inside the op's? (I.2's gates)
  if (not _LOWERS_REORDERED_MESH
      if mesh.devices.tolist() != op.mesh.devices.tolist() else
      mesh.axis_names != op.mesh.axis_names and not _LOWERS_RENAMED_MESH):
    raise _KeepCallbacks(
        f"returns the mesh {dict(shard.mesh.shape)}, whose manual "
        f"computation jax {jax.__version__} cannot lower inside the op's "
        f"{dict(op.mesh.shape)} (jax 0.7 to 0.10 but 0.9.1 can; return the "
        "op's mesh)")
  for what, side in (("operand", shard.args), ("result", shard.results)):
    for i, v in enumerate(side):
      if v.spec is None:
        raise _KeepCallbacks(
            f"returns a sharding for {what} {i} that has no PartitionSpec "
            f"on the mesh {dict(mesh.shape)}, which a manual computation "
            "needs")


def _manual_program(op: _Op, shard: _Answer, per_shard=None,
                    jit: bool = True) -> Callable:
  """The pad -> ``shard_map`` of ``shard``'s per-shard program -> slice
  (XLA pads uneven shards of a custom call; here jax does), jitted if
  ``jit``.
  ``per_shard`` (of the flat operands), if given, runs instead, checked by
  jax's typing of shard_map: a derived op's transposition (II.4).
  Where ``shard`` holds no jaxpr, ``lower_fn`` is traced in the shard_map,
  its arguments and results checked as ``_trace_lower_fn`` does. Uneven
  operands are padded with zeros."""
  if shard.lower_fn is None:  # seam: plain jax's, partitioned by jax (II.4)
    return _plain_program(shard)
  mesh, on = shard.mesh, shard.on
  padded = [[tuple(size * _shard_count(e, on) for size, e in zip(
      _local_struct(v, on).shape, v.spec + (None,) * len(v.shape)))
      for v in side] for side in (shard.args, shard.results)]
  if any(t != jax.sharding.AxisType.Auto for t in _axis_types(mesh) or ()):
    # Operands traced unsharded: on Explicit axes shard_map would refuse.
    mesh = _jax.Mesh(mesh.devices, mesh.axis_names, axis_types=(
        jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
  spec = jax.sharding.PartitionSpec

  def padded_to(x, shape):  # XLA pads with unspecified values; here zeros
    return jax.numpy.pad(x, [(0, p - s) for s, p in zip(x.shape, shape)])

  def traced(*xs):  # lower_fn traced here, once (I.5 did not)
    args = _lower_fn_args(op, shard.lower_fn, list(xs))
    got = [jax.numpy.asarray(y) for y in jax.tree_util.tree_leaves(
        shard.lower_fn(*args))]
    _check_lower_fn_results(op, shard, got)
    return got
  mapped = _shard_map(
      per_shard or (traced if shard.jaxpr is None else
                    _jax.jaxpr_as_fun(shard.jaxpr)), mesh,
      [spec(*v.spec) for v in shard.args],
      [spec(*v.spec) for v in shard.results], checked=per_shard is not None,
      values=(shard.args, shard.results, on))

  def program(*xs):
    # jax 0.7.2's jit traces under set_mesh's mesh again: cleared here.
    with _no_ambient_mesh():
      xs = [x if x.shape == shape else padded_to(x, shape)
            for x, shape in zip(xs, padded[0])]
      return [y if y.shape == v.shape else y[tuple(map(slice, v.shape))]
              for y, v in zip(mapped(*xs), shard.results)]
  program.__name__ = op.name if op.name.isidentifier() else "op"
  # Jitted, equal ops share one function (lowered once); jax 0.7.2's Shardy
  # leaves a function of several callers unplaced (an all-gather at each
  # call), 0.10.2's places it: inlined before.
  return jax.jit(program) if jit and _JAX_VERSION >= (0, 10) else program


def _axis_types(mesh) -> tuple | None:
  # jax 0.4.36 added axis types (a dict by type); 0.5.3 made them per axis.
  types_ = getattr(mesh, "axis_types", None)
  return types_ if isinstance(types_, tuple) else None


def _shard_map(fun, mesh, in_specs, out_specs, checked: bool, values):
  """``jax.shard_map`` of ``fun``, unchecked unless ``checked`` (the per-shard
  checks ran already), over ``values`` (``(operands, results, on)``, ``_Value``s
  with specs on ``on``), less those of size 0: XLA refuses a manual computation
  whose operands are all empty (jax.shard_map's alike), and they hold nothing to
  pass; they are made per shard inside, whole outside."""
  args, results, on = values
  kept = [[math.prod(v.shape) > 0 for v in side] for side in (args, results)]

  def inner(*xs):
    xs = iter(xs)
    return _kept(kept[1], fun(*[next(xs) if k else jax.numpy.zeros(
        _local_struct(v, on).shape, v.dtype) for k, v in zip(kept[0], args)]))
  specs = tuple(_kept(kept[0], in_specs)), _kept(kept[1], out_specs)
  # jax 0.6.1 made shard_map public, its check_rep renamed check_vma.
  mapped = (jax.shard_map(inner, mesh=mesh, in_specs=specs[0],
                          out_specs=specs[1], check_vma=checked)
            if _JAX_VERSION >= (0, 6, 1) else
            _jax.shard_map(inner, mesh, *specs, check_rep=checked))

  def outer(*xs):
    ys = iter(mapped(*_kept(kept[0], xs)))
    return [next(ys) if k else jax.numpy.zeros(v.shape, v.dtype)
            for k, v in zip(kept[1], results)]
  return outer


def _kept(flags: list, xs) -> list:
  return [x for k, x in zip(flags, xs) if k]


def _no_ambient_mesh():
  """Clears the ambient mesh for lower_fn: under an Explicit one, jax 0.5.3
  to 0.8.x give the per-shard module constraints XLA cannot export or run."""
  if _jax.use_abstract_mesh is None:
    return contextlib.nullcontext()
  return _jax.use_abstract_mesh(_jax.empty_abstract_mesh)


# --------------------------------------------------------------------------
# I.7 Shared by the core and the extras: values, specs, jaxprs
#
# An operand or result as the callbacks see it (``_Value``), XLA's view of
# one, infer and propagate asked, and small readers of PartitionSpec
# entries and jaxprs that several sections use; here, so that a copy can
# drop any extra. What only extras use is marked, at its definition, as a
# seam naming them, and goes with the last of them.
# --------------------------------------------------------------------------

class _Value(NamedTuple):
  """An operand or result. ``spec``: its PartitionSpec entries (None: none
  or unknown); ``hlo``: the HloSharding as given (None: by ``spec`` alone
  or unknown); ``varying``: the manual axes it varies over, if tracked."""
  shape: tuple
  dtype: Any
  spec: tuple | None = None
  hlo: _jax.HloSharding | None = None
  varying: frozenset | None = None

  def known(self) -> bool:
    return self.spec is not None or self.hlo is not None


def _hlo_parts(  # seam: used by (II.7)
    shape: _jax.Shape, sharding: _jax.HloSharding | None):
  if not shape.is_tuple():
    return [shape], [sharding]
  shapes = list(shape.tuple_shapes())
  return shapes, (list(sharding.tuple_elements()) if sharding is not None
                  else [None] * len(shapes))


def _from_xla(  # seam: used by (II.7)
    shapes, hlo_shardings, on, varying=()) -> list[_Value]:
  return [_Value(tuple(s.dimensions()), s.numpy_dtype(),
                 None if h is None or on.empty
                 else _decode_spec(h, on, len(s.dimensions())), h, v)
          for s, h, v in zip(shapes, hlo_shardings,
                             list(varying) or [None] * len(shapes))]


def _hlo_of(v: _Value, on) -> _jax.HloSharding:
  return v.hlo if v.hlo is not None else jax.sharding.NamedSharding(
      on, jax.sharding.PartitionSpec(*v.spec))._to_xla_hlo_sharding(
          len(v.shape))


def _ask_infer(  # seam: used by (II.3, II.4, II.6, II.7)
    op: _Op, operands: list, results: list):
  """``infer_sharding_from_operands``'s answer, else the rule's, or None."""
  if op.infer_sharding_from_operands is None:
    if op.sharding_rule is not None:  # seam: inferred by the rule (II.5)
      return _infer_by_rule(op, operands, results)
    return None
  answer = op.infer_sharding_from_operands(
      *op.static_args, op.mesh, _structs(op, op.in_tree, operands),
      op.out_tree.unflatten([jax.ShapeDtypeStruct(v.shape, v.dtype)
                             for v in results]))
  if answer is None:
    return None
  return _encode(op, op.out_tree, answer, results,
                 "infer_sharding_from_operands", "result sharding")


def _ask_propagate(  # seam: used by (II.4, II.7)
    op: _Op, results: list) -> list[_Value]:
  """``propagate_user_sharding``'s answer, or None (the user's stand)."""
  if op.propagate_user_sharding is None:
    return None
  answer = op.propagate_user_sharding(*op.static_args, op.mesh,
                                      _structs(op, op.out_tree, results))
  return _encode(op, op.out_tree, answer, results, "propagate_user_sharding",
                 "result sharding")


def _with_specs(  # seam: used by (II.4, II.6)
    values: list, specs) -> list[_Value]:
  return [v._replace(spec=spec, hlo=None) for v, spec in zip(values, specs)]


def _spec_text(spec: tuple) -> str:
  """``PartitionSpec(None, 'x')``, also where jax prints ``P(...)``."""
  return f"PartitionSpec({', '.join(map(repr, spec))})"


# jax 0.11.0 merged ClosedJaxpr into Jaxpr (a jaxpr holds its consts);
# 0.12.0.1 keeps ClosedJaxpr, ``<jaxpr>.jaxpr`` and ``Jaxpr(jaxpr, consts)``
# only as shims "to remove", so from 0.11 the module reads none of them.
if _JAX_VERSION >= (0, 11):
  _ClosedJaxpr = _jax.Jaxpr
  _closed = _jax.Jaxpr.with_consts  # (jaxpr, consts)

  def _open(closed: _jax.Jaxpr) -> _jax.Jaxpr:
    return closed
else:
  _ClosedJaxpr = _closed = _jax.ClosedJaxpr

  def _open(closed: _jax.ClosedJaxpr) -> _jax.Jaxpr:
    return closed.jaxpr


def _eqn_axes(eqn) -> set:  # seam: used by (II.1, II.4)
  """The mesh axes an equation's collective runs over."""
  values = [eqn.params.get(param) for param in ("axes", "axis_name")]
  return {axis for v in values
          for axis in (v if isinstance(v, (tuple, list)) else (v,))
          if isinstance(axis, str)}


def _axes_in(specs) -> set:  # seam: used by (II.1, II.2, II.3, II.4)
  return {a for spec in specs for e in spec or () for a in _entry_axes(e)}


def _real_axes(mesh) -> tuple:  # seam: used by (II.1, II.4, III.2)
  """The axes of ``mesh`` of size > 1 (HloShardings cannot name others)."""
  return tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)


def _padded(values: list, mesh) -> bool:  # seam: used by (II.1, II.4)
  """Whether a value is sharded unevenly (XLA pads the last shards)."""
  return any(size % _shard_count(entry, mesh)
             for v in values for size, entry in zip(v.shape, v.spec or ()))


# ==========================================================================
# Part II. The extras, one section each
#
# Each extra runs only when it applies and holds what it owns (helpers,
# stores, version branches, its registrations with jax). A seam line ends
# in ``(II.n)``, the section it enters: an ``if``/``elif`` whose branch is
# all that section's (deleted, the rest of its chain stays; a lone ``else``
# body takes its place), or a statement that is (deleted whole).
# ==========================================================================

# --------------------------------------------------------------------------
# II.1 Checks of the per-shard program
#
# Two silent mistakes in ``lower_fn`` are refused while it is traced (unless
# ``check_vma=False``): reducing over a dimension the mesh does not divide
# (XLA pads the last shards with unspecified values; ``_reduced_factors``),
# and a result replicated over a mesh axis it may vary along. *Varying axes*
# are followed as shard_map's check_vma does: operands vary over their
# sharded axes, ``axis_index`` and scattering collectives add theirs,
# ``psum``/``pmax``/``pmin``/``all_gather`` remove theirs, loop carries take
# the union over iterations; an unknown effect (grouped collectives, other
# subprograms) never raises. Size-1 axes never count.
# --------------------------------------------------------------------------

# jax's names only this section reads (looked up as _NAMES's).
_CHECK_NAMES = {
    "jax.extend.core": "Literal",
    "jax._src.core": "jaxprs_in_params",
}
_look_up(_CHECK_NAMES)

def _check_per_shard(op: _Op, answer: _Answer, values: list,
                     closed: _ClosedJaxpr, everywhere: bool) -> bool:
  """Raises where ``closed``, ``lower_fn`` traced for ``answer`` about
  ``values`` (operands, then results), would give wrong values: a reduction
  over padding, a replicated result that varies (none where ``everywhere``:
  ``_sharded_everywhere``). Returns whether every result was proven equal
  along the axes it is replicated over."""
  on = answer.on
  if op.sharding_rule is not None and _padded(answer.args, on):
    _check_even_reductions(op, values, answer.args, on)
  if everywhere:
    return True
  return _check_replicated_results(
      op.name, _open(closed), [v.spec for v in answer.args],
      [v.spec for v in answer.results], _real_axes(on),
      lambda: _unreplicated(op, values, answer.args))


def _unreplicated(op: _Op, values: list, args: list) -> dict:
  """Mesh axis -> why: where ``args`` (partition's operand placements)
  shard a dimension of a factor the rule says needs replication, the
  likely cause of a result varying over that axis."""
  rule = op.sharding_rule
  if not (isinstance(rule, SdyShardingRule) and rule.need_replication_factors):
    return {}
  try:  # a rule that does not fit the op fails elsewhere, with its cause
    _, dims = _resolve_rule(rule, [v.shape for v in values], len(args))
  except ValueError:
    return {}
  needed, why = set(rule.need_replication_factors), {}
  for i, (value_dims, v) in enumerate(zip(dims, args)):
    for d, (factors, entry) in enumerate(zip(value_dims, v.spec or ())):
      for factor in sorted(needed.intersection(factors)):
        for axis in _entry_axes(entry):
          why.setdefault(axis, (
              f" Here partition's arg sharding shards operand {i} dimension "
              f"{d} over {axis!r}, but that dimension is factor {factor!r}, "
              "which the sharding rule lists in need_replication_factors "
              "(partition is asked with it unsharded): give it unsharded in "
              "arg_shardings, or gather it in lower_fn."))
  return why


def _check_even_reductions(op: _Op, values: list, args: list, mesh) -> None:
  """Raises if ``args`` pads an operand dimension the rule reduces over."""
  shapes = [v.shape for v in values]
  try:  # a rule that does not fit the op fails elsewhere, with its cause
    _, dims = _resolve_rule(op.sharding_rule, shapes, len(args))
  except ValueError:
    return
  reduced = _reduced_factors(op.sharding_rule, dims, len(args))
  for i, (value_dims, v) in enumerate(zip(dims, args)):
    for d, (factors, entry) in enumerate(zip(value_dims, v.spec or ())):
      count = _shard_count(entry, mesh)
      if shapes[i][d] % count and reduced.intersection(factors):
        raise ValueError(
            f"partition of {op.name} shards operand {i} dimension {d} (size "
            f"{shapes[i][d]}) over mesh axes {sorted(_axes_in([[entry]]))} "
            f"({count} devices), which do not divide it, and the op's "
            "sharding rule reduces over that dimension: XLA pads the last "
            "shards with unspecified values, which the reduction would mix "
            "into the result (jax.shard_map refuses such operands too). "
            "Shard that dimension over axes that divide its size (or not at "
            f"all), or pad it to a multiple of {count} before the op; if "
            "lower_fn masks the padding itself (from jax.lax.axis_index and "
            "the global size), pass check_vma=False to def_partition.")


def _check_replicated_results(name: str, jaxpr: _jax.Jaxpr, in_specs: list,
                              out_specs: list, axes, why=None) -> bool:
  """Raises if a result replicated over one of ``axes`` (no size-1 axes) may
  vary over it; returns whether every such result was proven equal.
  ``in_specs``/``out_specs``: lower_fn's (None: unknown, which never raises);
  ``why``: called only to raise, mesh axis -> a known cause for the error."""
  in_varying = [None if spec is None else frozenset(_axes_in([spec]))
                for spec in in_specs]
  proven = True
  for i, (varying, spec) in enumerate(zip(_varying(jaxpr, in_varying),
                                          out_specs)):
    if varying is None or spec is None:
      proven = proven and spec is not None and set(axes) <= _axes_in([spec])
      continue
    for axis in axes:
      if axis in varying and axis not in _axes_in([spec]):
        raise ValueError(
            f"lower_fn of {name} returns result {i} as replicated over mesh "
            f"axis {axis!r} (its result sharding has spec {spec}), but its "
            f"value differs between the devices along {axis!r}: it is computed "
            f"from an operand sharded over {axis!r} (or from axis_index) and "
            "no collective over that axis makes it equal."
            f"{why().get(axis, '') if why else ''} Likely fix: a missing"
            f" jax.lax.psum/pmax/all_gather over {axis!r} in lower_fn, "
            f"or a result sharding over {axis!r}. If the value is equal by "
            "construction, pass check_vma=False to def_partition.")
  return proven


_INVARIANT_OVER_AXES = frozenset({"psum", "pmax", "pmin", "all_gather",
                                  "psum_invariant", "all_gather_invariant"})
_VARYING_OVER_AXES = frozenset({"reduce_scatter", "all_to_all", "ppermute",
                                "axis_index"})
_SAME_VALUES = frozenset({"pvary", "pbroadcast"})  # only retype a value


def _varying(jaxpr: _jax.Jaxpr, in_varying: list) -> list:
  """Per output of ``jaxpr``: the mesh axes it may vary over (a frozenset),
  or None where that is unknown; ``in_varying`` likewise per input."""
  env: dict = dict(zip(jaxpr.invars, in_varying))

  def read(v):
    return frozenset() if isinstance(v, _jax.Literal) else env.get(
        v, frozenset())  # constants are equal everywhere

  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    union = None if None in ins else frozenset().union(*ins)
    name = eqn.primitive.name
    outs: list = [union] * len(eqn.outvars)
    if name in _INVARIANT_OVER_AXES or name in _VARYING_OVER_AXES:
      # A psum of several values: each output from its own operand.
      change = (frozenset.difference if name in _INVARIANT_OVER_AXES
                else frozenset.union)
      outs = [None if v is None or eqn.params.get("axis_index_groups")
              is not None else change(v, _eqn_axes(eqn))
              for v in (ins if len(ins) == len(outs) else outs)]
    elif name == "cond":
      branches = [_varying(_open(b), ins[1:]) for b in eqn.params["branches"]]
      outs = [None if ins[0] is None or None in per_out
              else ins[0].union(*per_out) for per_out in zip(*branches)]
    elif name in ("scan", "while"):
      outs = _loop_varying(eqn, ins)
    elif name not in _SAME_VALUES and any(True for _ in _jax.jaxprs_in_params(
        eqn.params)):
      # Followed only into one jaxpr called with the operands one to one
      # (jit, checkpoint, custom_jvp/vjp calls).
      subs = [v if isinstance(v, _jax.Jaxpr) else _open(v)
              for v in eqn.params.values()
              if isinstance(v, (_jax.Jaxpr, _ClosedJaxpr))]
      outs = (_varying(subs[0], ins) if len(subs) == 1 and (
          len(subs[0].invars), len(subs[0].outvars)) == (len(ins), len(outs))
              else [None] * len(outs))
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _loop_varying(eqn, ins: list) -> list:
  """``_varying`` of a ``scan`` or ``while``: each carry varies over what it
  starts with and any iteration adds (to a fixed point, as check_vma types
  it), a while loop's also over its predicate's (counts may differ)."""
  p = eqn.params
  if eqn.primitive.name == "scan":
    if "num_consts" in p:  # jax 0.11.0 replaced these with ft_in
      n, k = p["num_consts"], p["num_carry"]
    else:
      n, k = (len(list(part)) for part in p["ft_in"].unpack()[:2])
    body, cond, cond_consts = _open(p["jaxpr"]), None, []
    consts, carry, xs = ins[:n], ins[n:n + k], ins[n + k:]
  else:
    n, m = p["cond_nconsts"], p["body_nconsts"]
    body, cond = _open(p["body_jaxpr"]), _open(p["cond_jaxpr"])
    cond_consts, consts, carry, xs = ins[:n], ins[n:n + m], ins[n + m:], []
    k = len(carry)
  while True:
    outs = _varying(body, consts + carry + xs)
    stop = [] if cond is None else _varying(cond, cond_consts + carry)
    new = [None if None in (c, o, *stop) else c.union(o, *stop)
           for c, o in zip(carry, outs[:k])]
    if new == carry:
      return new + outs[k:]
    carry = new


# --------------------------------------------------------------------------
# II.2 Placements and errors off the plain path
#
# Placements inside a shard_map or without devices, infer/propagate errors
# kept for partition.
# --------------------------------------------------------------------------

def _shard_map_placement(axis_context) -> _Placement:
  """Inside a shard_map manual over some mesh axes: its mesh, the manual
  ones typed Manual (from jax 0.5.3), and the sub-mesh over the others
  (devices of one manual group)."""
  whole, manual = axis_context.mesh, axis_context.manual_axes
  names, devices = whole.axis_names, tuple(whole.devices.flat)
  if not manual:
    return _Placement(whole, devices)
  keep = [i for i, n in enumerate(names) if n not in manual]
  auto = _jax.Mesh(
      whole.devices[tuple(0 if n in manual else slice(None) for n in names)],
      tuple(names[i] for i in keep), **(
          {"axis_types": tuple(whole.axis_types[i] for i in keep)}
          if _MANUAL_TYPED else {}))
  mesh = whole if not _MANUAL_TYPED else _jax.Mesh(
      whole.devices, names, axis_types=tuple(
          jax.sharding.AxisType.Manual if n in manual else t
          for n, t in zip(names, whole.axis_types)))
  return _Placement(mesh, devices, auto, whole)


def _placement_without_devices(axis_context, am, avals) -> _Placement:
  """Without devices (inside another primitive's lowering): a mesh the
  caller gave of the program's shape, else ``with mesh:``'s."""
  num_devices = getattr(axis_context, "num_devices", None)
  abstract = [m for m in [am, *map(_aval_mesh, avals)]
              if m is not None and not m.empty]
  mesh = _caller_mesh(lambda m: num_devices in (None, m.size) and all(
      dict(am.shape) == dict(m.shape) for am in abstract))
  if mesh is None:
    return _Placement(_jax.thread_resources.env.physical_mesh, None)
  return _Placement(mesh, tuple(mesh.devices.flat))


def _handed_back(op: _Op, sharding) -> bool:
  """Whether ``sharding`` is a GSPMDSharding on the auto part's devices, as
  ``_structs`` hands one to callbacks without ``decode_shardings``: its
  HloSharding is on the auto part already."""
  return isinstance(sharding, _jax.GSPMDSharding) and (
      sharding.device_set == set(op.place.auto.devices.flat))


def _onto_auto_axes(op: _Op, sharding, where: str):
  """Re-homes a sharding of the whole mesh onto ``op.place.auto``."""
  if not isinstance(sharding, jax.sharding.NamedSharding):
    raise TypeError(f"{where} as a {type(sharding).__name__}; inside a "
                    "partly manual shard_map it must be a NamedSharding.")
  auto = op.place.auto
  manual = _axes_in([sharding.spec]) - set(auto.axis_names)
  if manual:
    raise ValueError(f"{where} with spec {_spec_text(sharding.spec)}, which "
                     f"shards over the manual axes {sorted(manual)}; only "
                     f"{auto.axis_names} may be used here.")
  return jax.sharding.NamedSharding(auto, sharding.spec)


# --------------------------------------------------------------------------
# II.3 The shard_map path (Explicit mesh axes)
#
# Where every operand's sharding is in its type, ``partition`` is asked
# while tracing and the op becomes reshard -> ``jax.shard_map(lower_fn)``
# -> reshard, with no custom call (README: "Explicit mesh axes: two paths").
# --------------------------------------------------------------------------

# jax's names only this section reads (looked up as _NAMES's).
_EXPLICIT_NAMES = {
    "jax.interpreters.ad": "JVPTracer",
    "jax._src.interpreters.batching": "BatchTracer",
}
_look_up(_EXPLICIT_NAMES)

def _explicit_call(user_op, args: _CallArgs, flat: _FlatArgs, eager_mesh=None):
  """The op's results, via shard_map; None where it keeps the custom call."""
  mesh, why_not = _explicit_mesh(flat, eager_mesh)
  if mesh is None:
    if why_not is not None and _log.isEnabledFor(logging.DEBUG):  # seam: (II.8)
      _debug(user_op._name, "path", path=_CUSTOM_CALL, mesh=None,
             why=f"not run as shard_map under Explicit axes: {why_not}")
    return None
  # All that fun's trace and the callbacks are given (see _traced).
  key = ((args.key, args.defaults_at, flat.in_tree, flat.in_avals, mesh,
          _jax.trace_context())
         if args.key is not None else None)
  hit = None if key is None else user_op._programs.get(key)
  if hit is not None and _log.isEnabledFor(logging.DEBUG):  # seam: log (II.8)
    _debug(user_op._name, "partition", mesh=mesh, cached=True,
           path=_SHARD_MAP if hit.run is not None else _CUSTOM_CALL,
           asked=_logged([_Value(a.shape, a.dtype, _spec_of(a))
                          for a in flat.in_avals]))
  program = hit or user_op._programs.cached(key, lambda: _explicit_program(
      user_op, args, flat, mesh))
  if program.run is None:
    return None
  return jax.tree_util.tree_unflatten(
      program.out_tree, _run_program(user_op, program, key, flat, mesh))


def _run_program(user_op, program: _Program, key, flat: _FlatArgs, mesh):
  """Runs (traces) the program, or its untyped twin where shard_map's types
  refuse what the module's check proved (an unmarked loop carry a collective
  makes varying: TypeError; a result made equal by all_gather: ValueError),
  or where neither can decide (a Pallas kernel whose out_shape has no
  varying axes; its results unfollowed by the check), as upstream runs it."""
  prefix = (f"custom_partitioning op {user_op._name}, run as jax.shard_map "
            "of its lower_fn under Explicit mesh axes: ")
  try:
    with _naming(prefix, _shard_map_advice):
      return program.run(*flat.leaves)
  except (TypeError, ValueError) as e:
    # shard_map's own refusals (a result it cannot prove replicated, a
    # carry it types as varying) stand where the module's check proved
    # nothing; anything else its types cannot decide runs untyped.
    if (program.untyped is None or type(e) not in (TypeError, ValueError)
        or not program.proven and _shard_map_advice(e)):
      raise
    why = e.__cause__ or e
  with _naming(prefix):
    out = program.untyped(*flat.leaves)
  if key is not None:  # a fresh plan would be refused alike: keep this one
    user_op._programs.put(key, program._replace(run=program.untyped,
                                                untyped=None))
  if _log.isEnabledFor(logging.DEBUG):  # seam: the log (II.8)
    _debug(user_op._name, "path", path=_SHARD_MAP, mesh=mesh,
           why=f"run with shard_map's check_vma off: its types refuse "
           f"lower_fn ({why})")
  return out


def _explicit_mesh(flat: _FlatArgs, eager_mesh=None):
  """``(mesh, why_not)``: the concrete mesh to run shard_map on, or None and
  (for the log, if the operands' mesh is all Explicit) why not; no callback."""
  if not _EXPLICIT_PATH or _jax.disable_jit.value:
    return None, None
  meshes = {m for m in map(_aval_mesh, flat.in_avals) if m is not None}
  if len(meshes) != 1:
    return None, (None if not any(map(_all_explicit, meshes)) else
                  "the operands are on different meshes")
  (am,) = meshes
  if not _all_explicit(am):
    return None, None
  ambient = _ambient_mesh("get_abstract_mesh")
  if ambient is not None and not ambient.empty and ambient != am:
    return None, "another mesh is ambient (inside a shard_map or auto_axes)"
  mesh = _caller_mesh(lambda m: m.abstract_mesh == am, eager_mesh,
                      with_block=False)
  if mesh is None:
    return None, ("no concrete mesh for the operands' mesh is known (set "
                  "one with jax.set_mesh)")
  if mesh.size == 1:  # the body, inlined
    return None, None
  if any(map(_vmapped_over_mesh_axis, flat.leaves)):
    return None, ("under a jax.vmap whose batch dimension is sharded over "
                  "a mesh axis")
  return mesh, None


def _all_explicit(am) -> bool:
  types_ = _axis_types(am)
  return bool(am.axis_names) and types_ is not None and all(
      t == jax.sharding.AxisType.Explicit for t in types_)


def _vmapped_over_mesh_axis(x) -> bool:
  """Whether ``x`` is (the primal of) a jax.vmap tracer whose batch dimension
  is sharded over a mesh axis in its type: jax's vmap of shard_map moves it
  to no mesh axis (an all-gather, jax 0.10.2; a size-1 axis is then unbound
  in lower_fn), so such calls keep the custom call."""
  while isinstance(x, (_jax.BatchTracer, _jax.JVPTracer)):
    dim, x = ((None, x.primal) if isinstance(x, _jax.JVPTracer)
              else (x.batch_dim, x.val))
    spec = tuple(getattr(getattr(_typeof(x), "sharding", None), "spec", ()))
    if isinstance(dim, int) and dim < len(spec) and spec[dim] is not None:
      return True
  return False


class _Program(NamedTuple):
  """A call signature's plan; ``run`` None: the custom call."""
  run: Callable | None  # jitted reshard -> shard_map -> reshard
  out_tree: Any
  untyped: Callable | None = None  # check_vma off (None: off already)
  proven: bool = False  # the module's check proved replicated results equal


# jax 0.6.0 added the cast to varying types jax.lax.pvary, 0.8.2 pcast(x,
# axes, to="varying"), 0.10.0 removed pvary; advice names the one it has.
_VARYING_CAST = ('jax.lax.pcast(x, axes, to="varying")'
                 if hasattr(jax.lax, "pcast") else "jax.lax.pvary(x, axes)")


def _shard_map_advice(error: Exception) -> str:
  """Advice on shard_map's refusals (jax's names shard_map's arguments)."""
  if type(error) is ValueError and "out_specs" in str(error):
    return (" (here: shard_map's check_vma cannot prove a result replicated "
            "over an axis its sharding leaves out; reduce it over that axis "
            "(jax.lax.psum, pmax, all_gather), or, if lower_fn makes it "
            "equal on every device in a way jax does not follow, pass "
            "check_vma=False to def_partition)")
  if type(error) is TypeError and "carry" in str(error):
    return (" (here: shard_map's check_vma types loop carries: one that a "
            f"collective makes varying needs {_VARYING_CAST} on its initial "
            "value; or pass check_vma=False to def_partition)")
  return ""


def _explicit_program(user_op, args: _CallArgs, flat: _FlatArgs,
                      mesh) -> _Program:
  """Plans one call signature: ``partition`` asked, checked, compiled."""
  call, out_tree, type_error = _typed_trace(user_op, args, flat)
  params = user_op._params(args, flat, call, out_tree)
  rule = params["sharding_rule"]
  op = _op_of(params, _Placement(mesh, tuple(mesh.devices.flat)),
              sharding_rule=None if callable(rule) else rule)
  operands, results, typed = _explicit_values(op, flat.in_avals, call, mesh,
                                              type_error)
  with _naming(f"sharding_rule of custom_partitioning op {op.name}: "):
    if callable(rule):  # asked as the custom call's lowering asks it
      op = dataclasses.replace(op, sharding_rule=_asked_rule(
          None, op, _Level(None, operands, results)))
    if rule is not None and (
        _SHARDY.value or op.infer_sharding_from_operands is None):
      # Where the custom call's lowering (Shardy) or inference (GSPMD) would.
      _resolve_rule(op.sharding_rule, [v.shape for v in operands + results],
                    len(operands), isinstance(op.partition, _FromRule))
  # As the custom call asks it (_partition); typed keeps the result types.
  operands, results = _replicated_as_needed(op, operands, results)
  answer = None
  if isinstance(op.partition, _FromRule) and callable(rule):
    why = NotImplementedError("its partition is derived from a callable "
                              "sharding_rule, which is asked only while "
                              "lowering.")
  else:
    if op.partition is None:
      raise ValueError(
          f"custom_partitioning op {op.name} runs on {mesh.size} devices "
          "(Explicit mesh axes), but its def_partition was given "
          "partition=None and no sharding_rule to derive a partition from: "
          "give either.")
    answer = _ask_partition(op, operands, results, mesh)
    why = _unrunnable(answer, mesh)
  if why is not None:
    if type_error is not None:  # the custom call cannot run it either
      raise type(why)(
          f"custom_partitioning op {op.name}: jax cannot type its body "
          f"under Explicit mesh axes ({type_error}), so it runs as "
          f"jax.shard_map of its lower_fn, but {why}") from type_error
    if _log.isEnabledFor(logging.DEBUG):  # seam: the log (II.8)
      _debug_partition(op, operands, results, answer, _CUSTOM_CALL,
                       why=("asked while tracing; not run as shard_map "
                            f"under Explicit axes: {why}"))
    return _Program(None, out_tree)
  closed, proven = _trace_lower_fn(op, answer), False
  if op.check_vma:  # seam: per-shard checks (II.1)
    proven = _check_per_shard(op, answer, operands + results, closed,
                              _sharded_everywhere(answer))
  if _log.isEnabledFor(logging.DEBUG):  # seam: the log (II.8)
    _debug_partition(op, operands, results, answer, _SHARD_MAP)
  build = functools.partial(_shard_map_program, op, answer, flat.in_avals,
                            typed or answer.results,
                            getattr(user_op.fun, "__name__", ""))
  return _Program(build(op.check_vma), out_tree, untyped=(
      build(False) if op.check_vma else None), proven=proven)


def _typed_trace(user_op, args: _CallArgs, flat: _FlatArgs):
  """``(call, out_tree, type_error)``: ``fun`` traced on the operands' types
  or, where jax cannot type it (``type_error``), without shardings."""
  try:
    return (*user_op._trace_fun(args, flat.in_tree, flat.in_avals), None)
  except (_ShardingTypeError, ValueError) as e:
    # Some ops raise a plain ValueError instead of ShardingTypeError (rfft
    # of a sharded axis, jax 0.10.2).
    with _no_ambient_mesh():
      # jax 0.5.0 gave ShapedArray a sharding, defaulting to the ambient mesh.
      unsharded = [_jax.ShapedArray(a.shape, a.dtype, weak_type=a.weak_type)
                   for a in flat.in_avals]
      try:
        return (*user_op._trace_fun(args, flat.in_tree, unsharded), e)
      except Exception:
        if isinstance(e, _ShardingTypeError):
          raise
        raise e from None  # a ValueError of the body itself


def _explicit_values(op: _Op, in_avals, call, mesh, type_error):
  """``(operands, results, typed)``: the values asked about, specs as the
  custom call's (no size-1 axes), and the program's result types (None:
  ``partition``'s): jax's typing of ``fun``, else the op's inference."""
  operands = [_Value(a.shape, a.dtype, _as_xla_spec(_spec_of(a), mesh))
              for a in in_avals]
  results = [_Value(a.shape, a.dtype) for a in call.out_avals]
  if type_error is None:
    typed = [_Value(a.shape, a.dtype, _spec_of(a)) for a in call.out_avals]
    return operands, [v._replace(spec=_as_xla_spec(v.spec, mesh))
                      for v in typed], typed
  try:
    inferred = _ask_infer(op, operands, results)
  except _ForeignMesh:  # a device order the op's mesh cannot state:
    inferred = None     # only types here, which partition's answer gives
  if _log.isEnabledFor(logging.DEBUG):  # seam: the log (II.8)
    _debug_infer(op, operands, inferred, _SHARD_MAP)
  if inferred is not None and all(v.spec is not None for v in inferred):
    return operands, inferred, inferred
  return operands, results, None


def _spec_of(aval) -> tuple:
  """The PartitionSpec entries of an abstract value's type, one per axis."""
  spec = tuple(aval.sharding.spec) if _aval_mesh(aval) is not None else ()
  return spec + (None,) * (len(aval.shape) - len(spec))


def _as_xla_spec(spec, mesh) -> tuple:
  """``spec`` without its size-1 axes, as a round trip through XLA reads."""
  def entry_of(entry):
    axes = [a for a in _entry_axes(entry) if mesh.shape[a] > 1]
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)
  return tuple(map(entry_of, spec))


def _unrunnable(answer: _Answer, mesh):
  """Why shard_map cannot run ``answer``, as the error to raise where
  nothing else can run it; None if it can."""
  if answer.mesh.axis_names != mesh.axis_names or (
      dict(answer.mesh.shape) != dict(mesh.shape)):
    return NotImplementedError(
        f"partition returned a mesh with axes {dict(answer.mesh.shape)}, "
        f"not the op's {dict(mesh.shape)}.")
  for what, side in (("operand", answer.args), ("result", answer.results)):
    for i, v in enumerate(side):
      if v.spec is None:
        return NotImplementedError(
            f"partition returned a sharding for {what} {i} that has no "
            f"PartitionSpec on the mesh {dict(mesh.shape)}.")
      for d, entry in enumerate(v.spec):
        count = _shard_count(entry, mesh)
        if v.shape[d] % count:
          return ValueError(
              f"partition shards {what} {i} dimension {d} (size "
              f"{v.shape[d]}) over {count} devices, which do not divide "
              "it, and jax.shard_map takes only even shards. Shard that "
              "dimension over axes that divide its size, or pad it.")
  return None


def _shard_map_program(op: _Op, answer: _Answer, in_avals, typed: list,
                       fun_name: str, check_vma: bool) -> Callable:
  """The jitted reshard -> ``jax.shard_map(lower_fn)`` -> reshard."""
  mesh, lower_fn, in_tree = answer.mesh, answer.lower_fn, op.in_tree
  out_axes = [_axes_in([v.spec]) for v in answer.results]

  def per_shard(*local_args):
    outs = jax.tree_util.tree_leaves(lower_fn(*in_tree.unflatten(local_args)))
    return [_invariant_over_size1(x, axes, mesh)
            for x, axes in zip(outs, out_axes)]
  # An operand differing from the answer only in size-1 axes keeps its
  # type: a psum over ('z', 'y') on P(('z', 'y')) needs it varying over 'y'.
  arg_specs = [t if _as_xla_spec(t, mesh) == v.spec else v.spec
               for t, v in zip(map(_spec_of, in_avals), answer.args)]
  am = mesh.abstract_mesh  # no devices: one jit trace serves every mesh like it
  mapped = _shard_map(
      per_shard, am, [jax.sharding.PartitionSpec(*s) for s in arg_specs],
      [jax.sharding.PartitionSpec(*v.spec) for v in answer.results],
      check_vma, (answer.args, answer.results, answer.on))

  def reshard(xs, specs):  # an equation only where the type changes
    return [x if _spec_of(_typeof(x)) == spec else jax.sharding.reshard(
        x, jax.sharding.NamedSharding(am, jax.sharding.PartitionSpec(*spec)))
        for x, spec in zip(xs, specs)]

  def program(*flat):
    return reshard(mapped(*reshard(flat, arg_specs)), [v.spec for v in typed])
  program.__name__ = fun_name if fun_name.isidentifier() else "op"
  return jax.jit(program)


def _invariant_over_size1(x, spec_axes: set, mesh):
  """``x`` made invariant (by a no-op psum) over size-1 axes it varies over
  but its out spec omits, which check_vma would needlessly refuse."""
  axes = tuple(a for a in sorted(_varying_axes(_typeof(x)) or ())
               if mesh.shape[a] == 1 and a not in spec_axes)
  if not axes:
    return x
  if x.dtype == np.bool_:  # psum takes numbers
    return jax.lax.psum(x.astype(np.int8), axes).astype(np.bool_)
  return jax.lax.psum(x, axes)


# --------------------------------------------------------------------------
# II.4 Derived ops: vmap, jvp and transposition
#
# ``jax.vmap``, ``jax.jvp`` and ``jax.grad``'s transposition bind a
# *derived* op: the same callbacks, ``transform`` listing the steps from the
# author's op, ``call`` the body transformed alike. Each question XLA asks
# walks down the steps to the author's op and its answer back up (as spec
# entries), ``lower_fn`` becoming ``vmap``/``jvp``/``vjp`` of itself; where
# the answer pads a value, a derivative is the body's (plain jax's program;
# at lowering, ``lower_fn``'s effects run beside it, as on even values).
# --------------------------------------------------------------------------

# jax's names only this section reads (looked up as _NAMES's).
_DERIVED_NAMES = {
    "jax.interpreters.ad": "Zero instantiate_zeros is_undefined_primal "
                           "primitive_jvps primitive_transposes",
    # jax 0.4.36 added fancy_primitive_batchers (rules get the axis data,
    # and unbatched calls); primitive_batchers became its "compat shim. TODO:
    # delete" (0.12.0.1).
    "jax.interpreters.batching": "fancy_primitive_batchers"
                                 if _JAX_VERSION >= (0, 4, 36) else
                                 "primitive_batchers",
}
_look_up(_DERIVED_NAMES)

@dataclasses.dataclass(frozen=True)
class _Step:
  """A step from an op to one derived from it: the values below it (``down``),
  per-value items above it (``up``: spec entries or a rule's dimensions), its
  part of each question (default: keep shardings); hashable, for cache keys."""

  def infer(self, op, level, below, inner):
    return inner()

  def propagate(self, op, results, inner):
    return inner(results)

  def rule_up(self, level, sizes, ops, res, reduction):
    return (*self.up(ops, res), reduction)

  def entry(self, values, used, mesh):
    """The spec entry a batch dimension gets (``used()``: the op below's)."""
    return None

  # jax.grad transposes the top step that is not ``transposed_below`` (a
  # batch dimension leaves linearity as it is) into ``transposed()``, or
  # cannot (None: the op is not linear in some operands).
  transposed_below = False

  def transposed(self):
    return None

  def transform(self, fn, entry):
    """``fn``, of global values, transformed as jax does this step (a
    batch dimension on the axes of ``entry``)."""
    return self.lower(fn)


def _jvp(primals, tangents, **params):
  """The primals come from a derived op computing them as jax's
  linearization does, the tangents from a derived jvp op; an op with a
  non-float result is differentiated through its body."""
  call = params["call"]
  mask = tuple(type(t) is not _jax.Zero and
               jax.numpy.issubdtype(_typeof(p).dtype, jax.numpy.inexact)
               for p, t in zip(primals, tangents))
  if not any(mask):
    return (custom_partitioning_p.bind(*primals, **params),
            [_jax.Zero(a.to_tangent_aval()) for a in call.out_avals])
  if not all(jax.numpy.issubdtype(a.dtype, jax.numpy.inexact)
             for a in call.out_avals):
    out = custom_partitioning_p.bind(*primals, **params)
    tangents = [_jax.instantiate_zeros(t) for t in tangents]
    return out, jax.jvp(_jax.jaxpr_as_fun(call), list(primals), tangents)[1]
  # The primal is what jax's linearization computes (a custom_vjp's fwd),
  # so that an outer jvp or grad differentiates what plain jax does.
  steps = params.get("transform", ())
  out = _bind_derived(primals, params, ("primal", mask), _Primal(mask).lower(
      _jax.jaxpr_as_fun(call)), steps + (_Primal(mask),))
  operands = [*primals, *(t for t, m in zip(tangents, mask) if m)]
  return out, _bind_derived(operands, params, ("jvp", mask), _Jvp(mask).lower(
      _jax.jaxpr_as_fun(call)), steps + (_Jvp(mask),))


@dataclasses.dataclass(frozen=True)
class _Primal(_Step):
  """The primal results of ``jax.jvp`` of the op below (in the primals in
  ``mask``), as jax's linearization computes them: a ``jax.custom_vjp`` runs its
  fwd, whose own derivative an outer jvp or grad then takes (plain jax's second
  order and forward-over-reverse). Same values, same shardings."""
  mask: tuple

  def down(self, operands, results):
    return operands, results

  def up(self, operands, results, batch_item=None):
    return operands, results

  def lower(self, fn, *_):
    def primal_fn(*xs):
      partial_fn, chosen = _masked(fn, xs, self.mask)
      return jax.linearize(partial_fn, *chosen)[0]
    return primal_fn


_derived = _LRU()


def _bind_derived(operands, params, tag: tuple, fun, transform) -> list:
  """Binds the op derived by ``transform``, its body ``fun`` (``call``
  transformed as ``tag`` says) traced for ``operands``."""
  # A pure function of the key: the body, the tag, the operands' avals
  # (with the shardings the results inherit) and jax's trace context.
  call = params["call"]
  in_avals = tuple(_typeof(x) for x in operands)
  key = (call, tag, in_avals, _jax.trace_context())

  def traced(avals):
    return _trace_to_jaxpr(fun, avals, jax.tree_util.tree_structure(avals),
                           avals, f"{tag[0]} of {_fun_name(call)}")[0]

  # Untyped where jax cannot type the body, as the op itself was bound.
  derived = _derived.get(key)
  if derived is None:
    derived = _typed_where_jax_can(lambda: traced(in_avals), traced, in_avals)
    _derived.put(key, derived)
  return custom_partitioning_p.bind(*operands, **dict(
      params, call=derived, transform=transform))


def _masked(fn: Callable, primals, mask):
  """``fn`` as a function of the primals marked in ``mask`` alone."""
  def partial_fn(*chosen):
    it = iter(chosen)
    return fn(*[next(it) if m else p for p, m in zip(primals, mask)])
  return partial_fn, [p for p, m in zip(primals, mask) if m]


@dataclasses.dataclass(frozen=True)
class _Jvp(_Step):
  """``jax.jvp``: operands are the primals, then the tangents of those in
  ``mask``; results are tangents, sharded like their primals."""
  mask: tuple

  def down(self, operands, results):
    return operands[:len(self.mask)], results

  def up(self, operands, results, batch_item=None):
    return operands + [v for v, m in zip(operands, self.mask) if m], results

  def transposed(self):
    return _Vjp(self.mask)

  def lower(self, fn, *_):
    def jvp_fn(*xs):
      partial_fn, chosen = _masked(fn, xs[:len(self.mask)], self.mask)
      return list(jax.jvp(partial_fn, chosen, list(xs[len(self.mask):]))[1])
    return jvp_fn


def _transpose(cts, *args, **params):
  """Transposes a jvp op (linear in its tangents) into a vjp op."""
  steps = params.get("transform", ())
  k = max((i for i, s in enumerate(steps) if not s.transposed_below),
          default=None)
  call, vjp = params["call"], None if k is None else steps[k].transposed()
  if vjp is None or any(
      _jax.is_undefined_primal(p) for p in args[:len(vjp.mask)]):
    raise NotImplementedError(
        f"{_fun_name(call)}: a custom_partitioning op can be transposed only "
        "in its tangents, as jax.grad does.")
  mask = vjp.mask
  n = len(mask)

  def body(*xs):
    # Transposed, not linearized again (a custom_vjp's custom_lin has no
    # jvp), from primals typed as the tangents (shard_map's varying axes).
    linear = functools.partial(_jax.jaxpr_as_fun(call), *xs[:n])
    return list(jax.linear_transpose(linear, *(
        p for p, m in zip(xs, mask) if m))(list(xs[n:])))
  operands = [*args[:n], *map(_jax.instantiate_zeros, cts)]
  return [None] * n + list(_bind_derived(
      operands, params, ("transpose",), body,
      steps[:k] + (vjp,) + steps[k + 1:]))


def _levels(steps: tuple, operands: list, results: list) -> list[_Level]:
  """The ops from the author's to the top one, whose values are given."""
  if not steps:
    return [_Level(None, operands, results)]
  return [*_levels(steps[:-1], *steps[-1].down(operands, results)),
          _Level(steps[-1], operands, results)]


@dataclasses.dataclass(frozen=True)
class _Vjp(_Step):
  """``jax.grad``'s transposition: operands are the primals, then the
  results' cotangents; results, the cotangents of the primals in ``mask``."""
  mask: tuple

  def down(self, operands, results):  # cotangents stand for results
    return operands[:len(self.mask)], operands[len(self.mask):]

  def up(self, operands, results, batch_item=None):
    return operands + results, [v for v, m in zip(operands, self.mask) if m]

  def infer(self, op, level, below, inner):
    primals = [v for v, m in zip(level.operands, self.mask) if m]
    return None if any(v.spec is None for v in primals) else primals

  def propagate(self, op, results, inner):
    return results

  def rule_up(self, level, sizes, ops, res, reduction):
    return (*self.up(ops, res), [])

  def transform(self, fn, entry):
    def vjp_fn(*xs):
      n = len(self.mask)
      partial_fn, chosen = _masked(fn, xs[:n], self.mask)
      return list(jax.vjp(partial_fn, *chosen)[1](list(xs[n:])))
    return vjp_fn

  def lower(self, fn, op, answer, below, batched):
    """``fn`` transposed per shard. Along a mesh axis that no collective of
    ``fn`` runs over and that every result is replicated over if an operand is,
    the devices compute alike: each result's cotangent (the same on every copy)
    goes undivided to ``fn``'s pullback and nothing is summed, so a custom
    backward rule that is not linear (a clip) sees what plain jax gives it.
    Along the other axes the pullback runs as jax transposes ``pmap`` code (a
    ``psum``'s transpose is a ``psum``), then corrected: one of a result's
    copies gets its cotangent, the others zero, and an operand's cotangent is
    summed over the axes it is replicated over, which is exact for pullbacks
    linear in their cotangents and for backward rules that map a zero cotangent
    to zero (a clip or a sign after a collective: each copy's rule sees the
    whole cotangent or none). At lowering, ``_derivative_program`` serves first;
    uneven operands never come here (``_partition_derived``)."""
    copies = functools.partial(_copies_over, op, answer.on, batched=batched)
    results = [set(copies(v)) for v in below.results]
    operands = [copies(v) for v, m in zip(below.operands, self.mask) if m]
    n = len(self.mask)

    def vjp_fn(*xs):
      partial_fn, chosen = _masked(fn, xs[:n], self.mask)
      shared = _collective_axes(_open(jax.make_jaxpr(partial_fn)(*chosen)),
                                set(answer.mesh.axis_names)) | {
          a for axes in operands for a in axes
          if not all(a in r for r in results)}
      kept_along = [tuple(a for a in r if a in shared) for r in results]
      grads = jax.vjp(partial_fn, *chosen)[1](_on_one_copy(xs[n:], kept_along))
      psums = [tuple(a for a in axes if a in shared) for axes in operands]
      return [jax.lax.psum(g, axes) if axes else g
              for g, axes in zip(grads, psums)]
    return vjp_fn


def _derivative_program(op: _Op, operands: list, results: list, jit: bool):
  """At lowering, an op derived through a transposition as jax's own
  transformations of the author's op as a checked ``jax.shard_map``; where
  jax cannot type ``lower_fn``, as transposed per shard; a jvp as
  ``_partition_derived`` gives it; on uneven operands, a derivative as
  plain jax computes it, with ``lower_fn``'s effects (``_forward``);
  ``partition`` asked once for all. None on releases that cannot.

  Typed, jax transposes a collective as its dual (a ``psum``'s cotangent
  reaches each device whole), so a backward rule after a collective that
  is not linear in its cotangents (a clip, a sign) sees what plain jax
  gives it, which ``_Vjp.lower``'s correction of pmap's transposition
  cannot give."""
  if not _TRANSPOSED_MANUAL_IMPORTS:  # the releases: I.2
    return None
  levels = _levels(op.steps, operands, results)
  answer, closed = _partition(op, levels[0].operands, levels[0].results,
                              op.mesh)
  if _padded(answer.args + answer.results, answer.on):
    return _forward(op, levels, answer, closed, _manual_program(
        op, _partition_derived(op, operands, results, op.mesh,
                               (answer, closed))))
  if not any(isinstance(s, _Vjp) for s in op.steps):
    shard = _partition_derived(op, operands, results, op.mesh,
                               (answer, closed))
    _check_lowerable(op, shard)
    return _manual_program(op, shard, jit=jit)
  _check_lowerable(op, answer)

  def per_shard(*xs):
    return jax.tree_util.tree_leaves(answer.lower_fn(*op.in_tree.unflatten(
        xs)))
  fn = _manual_program(op, answer, per_shard, jit=False)
  for level in _specs_up(levels, answer, closed)[1:]:
    fn = level.step.transform(fn, level.entry)
  try:  # jax types lower_fn here, or the per-shard transposition serves
    with _no_ambient_mesh():
      jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(v.shape, v.dtype)
                           for v in levels[-1].operands])
  except Exception as e:  # noqa: BLE001 - the other path reports real errors
    if _log.isEnabledFor(logging.DEBUG):  # seam: the log (II.8)
      _debug(op.name, "path", path=_AT_LOWERING_PATH, mesh=op.mesh,
             why=f"transposed per shard: jax's types refuse lower_fn ({e})")
    return _manual_program(op, _partition_derived(
        op, operands, results, op.mesh, (answer, closed)))
  return jax.jit(fn) if _JAX_VERSION >= (0, 10) else fn


def _forward(op: _Op, levels: list, answer: _Answer, closed, body: Callable):
  """``body`` (plain jax's derivative), after the author's ``lower_fn``
  per shard on the primals where it has effects (a host callback), its
  results unused, so that they run as often as in lower_fn's derivative on
  even rows (XLA drops the rest). Where it has none, or its answer cannot
  be lowered (then XLA's callbacks, which refuse host callbacks, take the
  author's op), ``body`` alone."""
  if not closed.effects:
    return body
  try:
    _check_lowerable(op, answer)
  except _KeepCallbacks:
    return body
  def of_primals(fn, step):  # of the step's operands: the op below's
    return lambda *xs: fn(*step.down(list(xs), [])[0])
  fn = _manual_program(op, answer._replace(jaxpr=closed), jit=False)
  for level in _specs_up(levels, answer, closed)[1:]:
    fn = (level.step.transform(fn, level.entry)
          if isinstance(level.step, _Batch) else of_primals(fn, level.step))

  def program(*xs):
    fn(*xs)
    return body(*xs)
  return program


def _on_one_copy(cts: list, copies: list) -> list:
  """Each of ``cts`` kept on the first of the devices along its axes in
  ``copies`` (which hold equal copies of its result), zero on the others."""
  def kept(ct, axes):
    if not axes:  # (a derived op's results are inexact: no float0)
      return ct
    first = functools.reduce(jax.numpy.logical_and, [
        jax.lax.axis_index(a) == 0 for a in axes])
    return jax.numpy.where(first, ct, jax.numpy.zeros_like(ct))
  return [kept(ct, axes) for ct, axes in zip(cts, copies)]


def _partition_derived(op: _Op, operands: list, results: list, on,
                       asked=None) -> _Answer:
  """The author's answer about the op below (``asked``, if given: what
  ``_partition`` answered), walked up ``op.steps``."""
  if op.mesh.empty:
    raise NotImplementedError(
        f"{op.name} is lowered for several devices without a mesh; jax.vmap, "
        "jax.jvp and jax.grad of a custom_partitioning op need one (jit with "
        "NamedSharding arguments, jax.set_mesh or `with mesh:`).")
  levels = _levels(op.steps, operands, results)
  answer, closed = asked or _partition(op, levels[0].operands,
                                       levels[0].results, on)
  if _padded(answer.args + answer.results, answer.on) and any(
      isinstance(s, (_Jvp, _Vjp)) for s in op.steps):
    # Plain jax's derivative, by construction: of the body (fun, which no
    # padding reaches), on whole values; at lowering jax partitions it. No
    # padding of lower_fn's is exact: one that a collective moves into a
    # real row has a derivative there, and 0 * inf on padding sums NaN.
    whole = [[v._replace(spec=(None,) * len(v.shape), hlo=None) for v in side]
             for side in (levels[-1].operands, levels[-1].results)]
    return _Answer(on, on, None, *whole, op.call)
  levels = _specs_up(levels, answer, closed)
  # lower_fn transformed by each step (given batch dimensions above it).
  fn = _jax.jaxpr_as_fun(closed)
  for i in range(1, len(levels)):
    fn = levels[i].step.lower(fn, op, answer, levels[i - 1], _axes_in(
        [[level.entry] for level in levels[i + 1:]]))
  top = levels[-1]
  with _no_ambient_mesh():
    closed = jax.make_jaxpr(fn, axis_env=list(answer.mesh.shape.items()))(
        *[_local_struct(v, answer.on) for v in top.operands])
  # Placed by position on answer.on, as lower_fn's axis_index counts them.
  args, outs = ([v._replace(hlo=_hlo_of(v, answer.on)) for v in side]
                for side in (top.operands, top.results))
  return answer._replace(jaxpr=closed, args=args, results=outs)


def _plain_program(shard: _Answer) -> Callable:
  """Plain jax's derivative (``_partition_derived``'s on uneven operands),
  which jax partitions."""
  fn = _jax.jaxpr_as_fun(shard.jaxpr)
  if _JAXLIB_VERSION >= (0, 5, 0):
    return fn
  # Before jaxlib 0.5.0 XLA partitions a slice of an unevenly sharded value
  # wrong (plain jax's own program too: 7 rows over 4 devices shifted):
  # there it runs on whole values, its operands and results replicated.
  whole = functools.partial(jax.lax.with_sharding_constraint, shardings=(
      jax.sharding.NamedSharding(shard.mesh, jax.sharding.PartitionSpec())))
  return lambda *xs: [whole(y) for y in fn(*[whole(x) for x in xs])]


def _infer(op: _Op, levels: list):
  """Result values of the op at the top of ``levels``, or None."""
  *below, top = levels
  if top.step is None:
    return _ask_infer(op, top.operands, top.results)
  return top.step.infer(op, top, below[-1], lambda: _infer(op, below))


def _propagate_derived(  # seam: used by (II.7)
    op: _Op, results: list) -> list[_Value] | None:
  """Result values of the op, given its user's; None (the user's stand)
  where one has no PartitionSpec to walk down the steps."""
  if any(v.spec is None for v in results):
    return None
  return _propagate(op, op.steps, results)


def _propagate(op: _Op, steps: tuple, results: list) -> list[_Value]:
  """Result values of the op ``steps`` above the author's, given its user's."""
  if not steps:
    asked = _ask_propagate(op, results)
    return results if asked is None else asked
  return steps[-1].propagate(
      op, results, lambda below: _propagate(op, steps[:-1], below))


def _specs_up(levels: list, answer: _Answer,
              closed: _ClosedJaxpr) -> list[_Level]:
  """``levels`` as partitioned: the author's answer walked up (a batch
  dimension keeps its axes unless shardings or collectives below use them)."""
  out = [levels[0]._replace(operands=answer.args, results=answer.results)]
  for level in levels[1:]:
    args, outs = ([v.spec for v in side]
                  for side in (out[-1].operands, out[-1].results))
    entry = level.step.entry(level.operands + level.results, functools.partial(
        _collective_axes, _open(closed), set(answer.on.axis_names),
        _axes_in(args + outs)), answer.on)
    args, outs = level.step.up(args, outs, entry)
    out.append(_Level(level.step, _with_specs(level.operands, args),
                      _with_specs(level.results, outs), entry))
  return out


def _collective_axes(jaxpr: _jax.Jaxpr, names: set, also=()) -> set:
  """``also``, and those of ``names`` that ``jaxpr``'s collectives run over."""
  return set(also) | names & set().union(*map(_eqn_axes, jaxpr.eqns), *(
      _collective_axes(sub, names) for sub in _jax.subjaxprs(jaxpr)))


def _copies_over(op: _Op, on, value: _Value, batched: set) -> tuple:
  """The (not size-1) axes along which devices hold equal copies of
  ``value``: those of ``on`` its spec and batch dimensions leave out and,
  inside a partly manual shard_map, the manual axes it does not vary over
  (none where untyped: jax < 0.6 and ``check_vma=False``)."""
  used = _axes_in([value.spec]) | batched
  axes = tuple(a for a in _real_axes(on) if a not in used)
  if op.place.auto is None or value.varying is None or not any(
      op.varying[0] + op.varying[1]):
    return axes
  return axes + tuple(a for a in _real_axes(op.place.whole)
                      if a not in op.place.auto.axis_names and
                      a not in value.varying)


def _batch(args, dims, **params):
  """Batches the op: every operand gets the batch dimension in front."""
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  call = params["call"]
  if size == 0:  # nothing to partition (and no item to unbatch below)
    outs = jax.vmap(_jax.jaxpr_as_fun(call), in_axes=list(dims))(*args)
    return outs, [0] * len(outs)
  args = [jax.lax.broadcast(x, (size,)) if d is None
          else jax.numpy.moveaxis(x, d, 0) for x, d in zip(args, dims)]
  batched = tuple(d is not None for d in dims)

  def body(*xs):
    # Broadcast operands unbatched again: under Explicit axes, vmap wants
    # all batch dimensions sharded alike.
    return jax.vmap(_jax.jaxpr_as_fun(call),
                    in_axes=[0 if b else None for b in batched])(
                        *[x if b else x[0] for x, b in zip(xs, batched)])
  outs = _bind_derived(args, params, ("vmap", batched), body,
                       params.get("transform", ()) + (_Batch(),))
  return outs, [0] * len(outs)


def _batch_rule(axis_data, args, dims, **params):
  """``_batch`` as jax 0.4.36's batching rules are called: the axis data
  first, and also when no operand is batched (then the op binds as is)."""
  del axis_data
  if all(d is None for d in dims):
    outs = custom_partitioning_p.bind(*args, **params)
    return outs, [None] * len(outs)
  return _batch(args, dims, **params)


def _unbatched(v: _Value) -> _Value:
  """``v`` without its batch dimension; a sharding with no PartitionSpec
  reads as replicated (XLA reshards to what ``partition`` asks anyway)."""
  spec = (None,) * len(v.shape) if v.spec is None and v.known() else v.spec
  return _Value(v.shape[1:], v.dtype, spec and tuple(spec[1:]), None, v.varying)


@dataclasses.dataclass(frozen=True)
class _Batch(_Step):
  """``jax.vmap``: every operand and result gains a leading dimension."""
  transposed_below = True

  def down(self, operands, results):
    return [_unbatched(v) for v in operands], [_unbatched(v) for v in results]

  def up(self, operands, results, batch_item=None):
    return [[(batch_item, *v) for v in side] for side in (operands, results)]

  def infer(self, op, level, below, inner):
    inferred = inner()
    if inferred is None:
      return None
    entry = self.entry(level.operands, functools.partial(
        _axes_in, [v.spec for v in inferred + below.operands]), op.mesh)
    return _with_specs(level.results, [(entry, *v.spec) for v in inferred])

  def propagate(self, op, results, inner):
    preferred = inner([_unbatched(v) for v in results])
    entry = self.entry(results, functools.partial(
        _axes_in, [v.spec for v in preferred]), op.mesh)
    return _with_specs(results, [(entry, *v.spec) for v in preferred])

  def rule_up(self, level, sizes, ops, res, reduction):
    factor = f"{_BATCH_FACTOR_PREFIX}vmap{len(sizes)}"  # a fresh factor
    sizes[factor] = level.operands[0].shape[0]
    return (*self.up(ops, res, (factor,)), reduction)

  def entry(self, values, used, mesh):
    """The axes the batch dimension arrives on (first in ``values``) that
    the op below leaves free and that divide the batch size, or None."""
    entry = next((v.spec[0] for v in values if v.spec and v.spec[0]), None)
    used = used()
    axes = [a for a in _entry_axes(entry) if a not in used]
    while axes and values[0].shape[0] % math.prod(mesh.shape[a] for a in axes):
      axes.pop()
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)

  def lower(self, fn, *_):
    return jax.vmap(fn)

  def transform(self, fn, entry):
    return jax.vmap(fn, spmd_axis_name=entry)


_jax.primitive_jvps[custom_partitioning_p] = _jvp
_jax.primitive_transposes[custom_partitioning_p] = _transpose
if _JAX_VERSION >= (0, 4, 36):  # see _batch_rule
  _jax.fancy_primitive_batchers[custom_partitioning_p] = _batch_rule
else:
  _jax.primitive_batchers[custom_partitioning_p] = _batch


# --------------------------------------------------------------------------
# II.5 Ops defined by their sharding rule alone
#
# ``def_partition(sharding_rule=...)`` without ``partition`` (or without
# ``infer_sharding_from_operands``): both are derived from the rule.
# --------------------------------------------------------------------------

def _infer_by_rule(op: _Op, operands: list, results: list):
  """The result shardings the op's rule implies, or None (GSPMD); it needs
  every placed operand's PartitionSpec."""
  if not any(v.known() for v in operands) or any(
      v.spec is None and v.hlo is not None for v in operands):
    return None
  shapes = [v.shape for v in operands + results]
  with _naming(f"sharding_rule of custom_partitioning op {op.name}: "):
    if isinstance(op.partition, _FromRule):  # as the partition will answer
      specs = _rule_specs(op.sharding_rule, shapes, [v.spec for v in operands],
                          [None] * len(results))[1]
    else:
      specs = _infer_from_rule(op.sharding_rule, shapes,
                               [v.spec for v in operands])
  return [v._replace(spec=spec) for v, spec in zip(results, specs)]


def _infer_from_rule(rule: SdyShardingRule, shapes: list,
                     in_specs: list) -> list:
  """GSPMD inference from a Shardy rule: each result dimension's spec entry is
  the mesh axes of the first operand dimension (``in_specs``; None: unplaced)
  of its single, passthrough factor, unless the result has them already
  (``shapes``: operands', then results')."""
  _, dims = _resolve_rule(rule, shapes, len(in_specs))
  blocked = set(rule.need_replication_factors) | set(rule.reduction_factors)
  axes_of: dict[str, Any] = {}
  for value_dims, spec in zip(dims, in_specs):
    for factors, axes in zip(value_dims, spec or ()):
      if len(factors) == 1 and factors[0] not in blocked and axes is not None:
        axes_of.setdefault(factors[0], axes)
  out = []
  for value_dims in dims[len(in_specs):]:
    used, spec = set(), []
    for factors in value_dims:
      axes = axes_of.get(factors[0]) if len(factors) == 1 else None
      axes = axes if used.isdisjoint(_entry_axes(axes)) else None
      used.update(_entry_axes(axes))
      spec.append(axes)
    out.append(tuple(spec))
  return out


def _partition_from_rule(op: _Op, operands: list, results: list):
  """What a ``partition`` written from the op's rule would return."""
  lower_fn = op.partition.lower_fn(op.static_args)
  if op.mesh.empty:  # no axis to name: replicated is right for every op
    replicated = _jax.GSPMDSharding(op.place.devices,
                                              _jax.HloSharding.replicate())
    in_shardings = [replicated] * len(operands)
    out_shardings = [replicated] * len(results)
  else:
    with _naming(f"sharding_rule of custom_partitioning op {op.name}: "):
      in_specs, out_specs = _rule_specs(
          op.sharding_rule, [v.shape for v in operands + results],
          [v.spec for v in operands], [v.spec for v in results])
    in_shardings, out_shardings = ([jax.sharding.NamedSharding(
        op.mesh, jax.sharding.PartitionSpec(*spec)) for spec in specs]
        for specs in (in_specs, out_specs))
  return (op.mesh, lower_fn, op.out_tree.unflatten(out_shardings),
          op.in_tree.unflatten(in_shardings))


def _rule_specs(rule: SdyShardingRule, shapes: list, in_specs: list,
                out_specs: list) -> tuple[list, list]:
  """``(operand specs, result specs)``, as PartitionSpec entries, of an op
  partitioned by its rule alone, from the specs values arrive with (None:
  unknown; ``shapes``: operands', then results'). A factor keeps the mesh
  axes the operands bring it on, else the results' (slicing a replicated
  operand costs no communication), unless one side brings it on two (a
  conflict), it is special or reduced, in a compound dimension, or an earlier
  factor (in order of first use) keeps those axes."""
  num_operands = len(in_specs)
  sizes, dims = _resolve_rule(rule, shapes, num_operands, one_size=True)
  blocked = _reduced_factors(rule, dims, num_operands).union(
      rule.need_replication_factors, rule.permutation_factors)
  blocked.update(f for value_dims in dims for factors in value_dims
                 if len(factors) > 1 for f in factors)
  axes_of: dict[str, tuple] = {}
  for side, specs in ((dims[:num_operands], in_specs),
                      (dims[num_operands:], out_specs)):
    brought: dict[str, set] = {}
    for value_dims, spec in zip(side, specs):
      for factors, entry in zip(value_dims, spec or ()):
        if factors[0] not in blocked and entry is not None:
          brought.setdefault(factors[0], set()).add(_entry_axes(entry))
    for factor, axes in brought.items():  # unless the operands decided:
      if factor not in axes_of and len(axes) > 1:
        blocked.add(factor)  # a conflict: no side's choice is better
      elif factor not in axes_of:
        (axes_of[factor],) = axes
  used, kept = set(), {}
  for factor in sizes:
    axes = axes_of.get(factor, ())
    if axes and factor not in blocked and not used & set(axes):
      used.update(axes)
      kept[factor] = axes[0] if len(axes) == 1 else axes
  specs = [tuple(kept.get(factors[0]) if len(factors) == 1 else None
                 for factors in value_dims) for value_dims in dims]
  return specs[:num_operands], specs[num_operands:]


# --------------------------------------------------------------------------
# II.6 A rule derived from infer: GSPMD-era ops under Shardy
#
# Shardy propagates through an op by its sharding rule alone. An op given only
# GSPMD callbacks gets one derived from its own infer, probed as
# ``def_partition``'s docstring says (one dimension per value); what no probe
# ties (infer raised, put the axis nowhere, or where no factor can state it)
# gets a factor of its own. Any rule is right here: ``partition`` decides the
# shardings and XLA reshards to them; the rule only spares reshards. Logged at
# DEBUG and reported by ``check_partitioning``, so the author can paste it.
# --------------------------------------------------------------------------

class _Derived(NamedTuple):
  rule: SdyShardingRule
  text: str  # as an author writes it
  why: str  # what no probe could tie, and what that costs; "" if all tied
  failed: bool  # no probe was answered: the rule shares no factor


# Key: every input of infer's answers (its function, statics, trees, the
# author's shapes and dtypes, mesh and devices, decode_shardings, jax's
# trace context); blind, like jax's caches, to what infer reads elsewhere.
# Bounded at 256; cleared by jax.clear_caches().
_derived_rules = _LRU(256)
_rules_seen = threading.local()  # ``found``: check_partitioning's list


def _derived_rule_attr(op: _Op, at_lowering: bool = False):
  """The Shardy rule attribute of an op with GSPMD callbacks and no rule,
  from its derived rule; None if it has neither infer nor propagate."""
  if (op.infer_sharding_from_operands is None and
      op.propagate_user_sharding is None):
    return None
  levels = _rule_levels(op.call, op.steps)
  with _naming(f"sharding_rule of custom_partitioning op {op.name}: "):
    return _rule_attr(_derived_rule(op, levels[0], at_lowering).rule, levels,
                      False)


def _derived_rule(op: _Op, author: _Level,
                  at_lowering: bool = False) -> _Derived:
  """The author's op's rule, derived from its infer (cached), logged."""
  static_key = _key_of(op.static_args)
  key = None if static_key is None else (
      op.infer_sharding_from_operands, static_key, op.in_tree, op.out_tree,
      op.decode_shardings, op.place,
      tuple((v.shape, v.dtype) for v in author.operands + author.results),
      _jax.trace_context())
  derived = None if key is None else _derived_rules.get(key)
  hit = derived is not None
  if not hit:
    derived = _derive(op, author)
    if key is not None:
      _derived_rules.put(key, derived)
  name, place = op.name, op.place
  if getattr(_rules_seen, "found", None) is not None:
    _rules_seen.found.append((name, derived.text, derived.why))
  if derived.failed and not hit:
    warnings.warn(
        f"custom_partitioning op {name} has no sharding_rule, and none could "
        f"be derived from its GSPMD callbacks under Shardy ({derived.why}). "
        f"It runs with the rule '{derived.text}', which ties no operand to "
        "a result: XLA reshards operands and results to what partition "
        "returns, which may gather them. Pass sharding_rule= to "
        "def_partition.", stacklevel=2)
  if _log.isEnabledFor(logging.DEBUG):  # seam: the log (II.8)
    _debug(name, "sharding_rule", path=_AT_LOWERING_PATH if at_lowering
           else _CUSTOM_CALL, mesh=place.mesh, cached=hit,
           answered=repr(derived.text),
           by="a derivation from infer_sharding_from_operands",
           why="; ".join(filter(None, [derived.why, (
               "pass it as def_partition's sharding_rule to fix it")])))
  return derived


@contextlib.contextmanager
def _derived_rules_seen():  # seam: used by (III.2)
  """Collects ``(op name, rule text, why)`` for each rule derived (or cached) on
  this thread meanwhile: ``check_partitioning``'s jits lower there."""
  outer, _rules_seen.found = getattr(_rules_seen, "found", None), []
  try:
    yield _rules_seen.found
  finally:
    _rules_seen.found = outer


def _derive(op: _Op, author: _Level) -> _Derived:
  op, place = dataclasses.replace(op, steps=(), sharding_rule=None), op.place
  operands, results = author.operands, author.results
  n, shapes = len(operands), [v.shape for v in operands + results]
  mesh = place.auto if place.auto is not None else op.mesh
  axes = [] if mesh.empty or op.infer_sharding_from_operands is None else [
      a for a in mesh.axis_names if mesh.shape[a] > 1]

  def ask(specs):  # results' specs (None: infer left them to XLA), or error
    try:
      inferred = _ask_infer(op, _with_specs(operands, specs), results)
    except _ForeignMesh:  # the author's mistake, not an unsupported probe
      raise
    except Exception as e:  # noqa: BLE001 - a probe infer does not support
      return e
    return None if inferred is None else [v.spec for v in inferred]

  unsharded = [(None,) * len(s) for s in shapes[:n]]
  base = ask(unsharded)
  fixed = set() if not isinstance(base, list) else {
      a for spec in base for e in spec or () for a in _entry_axes(e)}
  group = {(i, d): (i, d) for i, s in enumerate(shapes) for d in range(len(s))}
  members = {k: {k} for k in group}
  raised, unstated, answered, tried = [], [], False, False
  for i, d in [(k, d) for k, s in enumerate(shapes[:n]) for d in range(len(s))]:
    for axis in [a for a in axes
                 if a not in fixed and shapes[i][d] % mesh.shape[a] == 0]:
      specs = list(unsharded)
      specs[i] = tuple(axis if k == d else None for k in range(len(shapes[i])))
      got, tried = ask(specs), True
      if isinstance(got, Exception):
        raised.append((i, d, got))
        continue
      answered = True
      for r, spec in enumerate(got or ()):
        e = next((e for e, entry in enumerate(spec or ())
                  if axis in _entry_axes(entry)), None)
        if e is not None and not _joined(group, members, (i, d), (n + r, e),
                                         shapes):
          unstated.append(f"operand {i} dimension {d} (size {shapes[i][d]}) "
                          f"to result {r} dimension {e} (size "
                          f"{shapes[n + r][e]})")
      break
  names: dict = {}
  mappings = [ArrayMapping(*(names.setdefault(group[(v, d)], _factor_name(
      len(names))) for d in range(len(s)))) for v, s in enumerate(shapes)]
  rule = SdyShardingRule(tuple(mappings[:n]), tuple(mappings[n:]))
  why = []
  if op.infer_sharding_from_operands is None:
    why.append("it has no infer_sharding_from_operands to derive it from")
  elif not axes:
    why.append("its mesh has no axis of more than one device to probe with")
  for i, d, e in raised[:1]:
    why.append(f"infer_sharding_from_operands raised on {len(raised)} "
               f"probe{'s' * (len(raised) > 1)}, first with operand {i} "
               f"dimension {d} sharded: {type(e).__name__}: {e}")
  if unstated:
    why.append("no factor states its mapping of " + "; ".join(unstated))
  ties = (tried or op.infer_sharding_from_operands is None) and any(
      s and max(s) > 1 for s in shapes[:n]) and any(
          s and max(s) > 1 for s in shapes[n:])  # some tie was possible
  return _Derived(rule, _rule_text(rule), "; ".join(why),
                  failed=ties and not answered)


def _joined(group: dict, members: dict, a: tuple, b: tuple, shapes) -> bool:
  """Puts dimensions ``a`` and ``b`` (value, dimension) under one factor if
  one can state it: equal sizes, no value twice; whether they share one."""
  ra, rb = group[a], group[b]
  if ra == rb:  # tied already (through another result)
    return True
  if shapes[a[0]][a[1]] != shapes[b[0]][b[1]] or (
      {v for v, _ in members[ra]} & {v for v, _ in members[rb]}):
    return False
  for k in members[rb]:
    group[k] = ra
  members[ra] |= members.pop(rb)
  return True


def _factor_name(k: int) -> str:
  letters = "ijklmnopqrstuvwxyzabcdefgh"
  return letters[k] if k < len(letters) else f"f{k}"


# --------------------------------------------------------------------------
# II.7 XLA's callbacks: GSPMD before jax 0.12.1, and the fallbacks
#
# Under GSPMD, and off TPU where the op cannot be partitioned at lowering
# (``_at_lowering``; an answer jax cannot lower, ``_KeepCallbacks``), the op is
# one XLA custom call, as upstream: while compiling, XLA asks this module,
# through Python callbacks, for the result's sharding (infer, propagate) and the
# per-shard program (partition). Without this section those ops raise the error
# they raise on TPU. The callbacks find the op by the custom call's key
# (``_register``; with jax's persistent cache on, a key by content, at the end
# of this section). An exception never reaches XLA raw (under GSPMD that
# aborts): it is parked under a tag in XLA's message, by which
# ``_reraise_callback_error`` gives jax the original. One from infer or
# propagate waits in ``_pending`` for the thread's partition callback (XLA
# compiles one program at a time on a thread, and partitions last); a compile
# that ends drops it (``_drop_pending``). XLA talks in HloShardings on flat
# lists of shapes, the callbacks in jax shardings on pytrees; in between, each
# operand and result is a ``_Value``. A question goes XLA -> ``_answer_<q>`` (a
# derived op's steps) -> ``_ask_<q>`` (I.7), the only caller of that author's
# callback. The per-shard program is lowered to the module XLA inlines
# (``_per_shard_module``).
# --------------------------------------------------------------------------

# jax's names only this section reads (looked up as _NAMES's): XLA's
# Python-partitioner API and what a custom call's compile needs.
_CALLBACK_NAMES = {
    "jax.interpreters.mlir": "LoweringParameters module_to_bytecode",
    "jax.monitoring": "register_event_duration_secs_listener",
    "jax._src.compiler": "register_xla_runtime_error_handler",
    "jax._src.config": "State compilation_cache_dir config "
                       "enable_compilation_cache",
    "jax._src.core": "AxisEnv?",
    "jax._src.dispatch": "BACKEND_COMPILE_EVENT",
    "jax._src.lax": "linalg",
    "jax._src.lib": "lapack",
    "jax._src.lib.xla_client": "Client register_custom_call_partitioner",
    "jax._src.source_info_util": "new_name_stack",
    "jax._src.xla_bridge": "register_plugin_callbacks",
}
_look_up(_CALLBACK_NAMES)

def _custom_call(ctx, op: _Op, values, rule_attr):
  """The op as one custom call, partitioned by XLA's callbacks (below)."""
  return _jax.custom_call(
      _TARGET, result_types=_ir_types(ctx, op.call.out_avals),
      operands=list(values), backend_config=_register(ctx, op),
      extra_attributes=rule_attr).results


def _by_callbacks(ctx, op: _Op, values):
  """The op as one custom call, partitioned by XLA's callbacks: under
  GSPMD, and off TPU where it cannot be partitioned at lowering."""
  name, place = op.name, op.place
  if ctx.module_context.lowering_parameters.for_export:
    raise NotImplementedError(
        f"jax.export cannot serialize the custom_partitioning op {name}: its "
        "partitioning callbacks are Python functions that XLA calls while "
        "compiling, and they cannot be stored in a serialized artifact. Export "
        "on a single device, or export the per-shard code (e.g. with "
        "jax.shard_map) instead.")
  if place.devices is None:
    raise ValueError(
        f"custom_partitioning op {name} is lowered for several devices, but "
        "jax did not say which: jax withholds them from a lowering rule that "
        "binds the op (e.g. through jax.interpreters.mlir.lower_fun) unless "
        "its primitive is in jax._src.dispatch."
        "prim_requires_devices_during_lowering. Add that primitive to the set "
        "(prim_requires_devices_during_lowering.add(your_primitive)), or set "
        "the mesh around the call, with jax.set_mesh(mesh) or `with mesh:`, "
        "so the op can find its devices; or call the op outside that "
        "primitive.")
  _check_partition(op)
  op, rule_attr = _rule_of(ctx, op, values, at_lowering=False)
  if place.auto is not None:  # the manual axes each value varies on
    op = dataclasses.replace(op, varying=tuple(
        tuple(_varying_axes(a) for a in avals)
        for avals in (ctx.avals_in, ctx.avals_out)))
  return _custom_call(ctx, op, values, rule_attr)


def _fallback_call(ctx, op: _Op, values):
  """Off TPU, an op whose answer jax cannot lower as a manual computation:
  the custom call, partitioned by XLA's callbacks."""
  # Placed by its rule, as in the first pass (without, Shardy leaves
  # the custom call replicated: gathers around it).
  rule_attr = None
  if isinstance(op.sharding_rule, SdyShardingRule) and values:
    rule_attr = {"sdy.sharding_rule": _rule_attr(
        op.sharding_rule, _rule_levels(op.call, op.steps),
        isinstance(op.partition, _FromRule))}
  return _custom_call(ctx, op, values, rule_attr)


# Options jax sets while tracing, not users (check_vma in a jax.shard_map's
# body, jax 0.10.2): lower_fn, traced on plain local types, goes without.
def _config_values() -> tuple:
  """Every jax option's value on this thread, context managers included, as
  ``(name, value)`` pairs, but ``check_vma`` (above)."""
  return tuple((name, holder.value)
               for name, holder in _jax.config._value_holders.items()
               if isinstance(holder, _jax.State) and name != "check_vma")


@contextlib.contextmanager
def _config_entered(values: tuple):
  """Runs the block on this thread under ``values`` (``_config_values``),
  each option that differs set by its (thread-local) context manager, as
  the user's ``with`` did."""
  holders = _jax.config._value_holders
  with contextlib.ExitStack() as stack:
    for name, value in values or ():  # None: the caller's, as it is
      if holders[name].value != value:
        stack.enter_context(holders[name](value))
    yield


_PROCESS_NONCE = os.urandom(8).hex()  # makes opaque values process-local


_registry: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
# Kept alive by the lowering's keep-alive list, whose id is the key.
_lowering_ops: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _register(ctx, op: _Op) -> str:
  """Registers ``op`` under its key, which must tell apart ops that
  answer differently; returns the key."""
  _listen_to_compiles()
  # partition and lower_fn run on XLA's thread, in the lowering's config.
  op = dataclasses.replace(op, answers=_LRU(256), at_lowering=False,
                           config=_config_values())
  if (_jax.compilation_cache_dir.value and  # keys by content (below)
      _jax.enable_compilation_cache.value):
    key = _content_key(ctx, op)
  else:
    # In one lowering the config (and the partitioner) is one: equal ops
    # are one op. A new lowering asks anew.
    keepalives = ctx.module_context.keepalives
    with _weak_lock:
      table = _lowering_ops.get(id(keepalives))
      if table is None:  # lives as long as the lowering
        # One lowering's ops (a UserDict: a dict has no weakref).
        table = _lowering_ops[id(keepalives)] = collections.UserDict()
        keepalives.append(table)
      op = table.setdefault(op, op)
    key = f"{_TARGET}:{_PROCESS_NONCE}:{id(op)}"  # unique while op lives
  with _weak_lock:
    # Keep the first live entry: lowerings that hold it must keep finding it.
    op = _registry.setdefault(key, op)
  ctx.module_context.add_keepalive(op)
  return key


def _question(answer: Callable, default: Callable):
  """XLA's infer or propagate callback, ``(*xla_args, key) -> answer(op,
  *xla_args)``, or ``default(*xla_args)``, XLA's own answer, where the
  op leaves the question to XLA; and where ``answer`` raises, the error kept
  for the partition callback (which raises it: XLA aborts on one here)."""
  def question(*args):
    *xla_args, key = args
    with _weak_lock:
      op = _registry.get(key.decode() if isinstance(key, bytes) else key)
    if op is None:
      return default(*xla_args)
    if op.place.auto is not None and not _MANUAL_TYPED:  # seam: (II.2)
      return default(*xla_args)
    if op.steps and op.mesh.empty:  # seam: a derived op (II.4)
      return default(*xla_args)
    try:
      return answer(op, *xla_args)
    except BaseException as e:  # noqa: BLE001 - must not reach XLA raw
      with _weak_lock:  # the first error of this compile
        _pending.setdefault(threading.get_ident(), (op.name, e))
      return default(*xla_args)
  return question


def _answer_infer(op: _Op, arg_shapes, arg_shardings, result_shape):
  """The result sharding XLA gets from the operands', or None."""
  results = _from_xla(*_hlo_parts(result_shape, None), op.mesh)
  operands = _from_xla(arg_shapes, arg_shardings, op.mesh)
  if op.steps:  # seam: a derived op (II.4)
    inferred = _infer(op, _levels(op.steps, operands, results))
  else:
    inferred = _ask_infer(op, operands, results)
  if _log.isEnabledFor(logging.DEBUG):  # seam: the log (II.8)
    _debug_infer(op, operands, inferred)
  if inferred is None:
    return None
  return _pack_hlo(result_shape, [_hlo_of(v, op.mesh) for v in inferred])


def _answer_propagate(op: _Op, user_sharding, shape):
  """The op's result sharding given its user's (kept where the op has no
  ``propagate_user_sharding``)."""
  results = _from_xla(*_hlo_parts(shape, user_sharding), op.mesh)
  if op.steps:  # seam: a derived op (II.4)
    propagated = _propagate_derived(op, results)
  else:
    propagated = _ask_propagate(op, results)
  if _log.isEnabledFor(logging.DEBUG):  # seam: the log (II.8)
    _debug_propagate(op, results, propagated)
  if propagated is None:
    return user_sharding
  return _pack_hlo(shape, [_hlo_of(v, op.mesh) for v in propagated])


def _pack_hlo(shape: _jax.Shape, shardings: list[_jax.HloSharding]):
  return (_jax.HloSharding.tuple_sharding(shape, shardings)
          if shape.is_tuple() else shardings[0])


_pending: dict[int, tuple[str, BaseException]] = {}


def _drop_pending(event=_jax.BACKEND_COMPILE_EVENT, *_, **__) -> None:
  """jax's event listener: after a backend compile, failed or not, kept
  infer/propagate errors go. Called on the caller's thread, it may drop
  one another thread's compile kept (which goes on as if it was None)."""
  if event != _jax.BACKEND_COMPILE_EVENT:  # another of jax's events
    return
  with _weak_lock:
    _pending.clear()


_ERROR_TAG = f"[{_TARGET} error #"


def _partitioner(answer: Callable):
  """XLA's partition callback, ``(*xla_args, key) -> answer(op,
  *xla_args)``; an error reaches XLA as a ``RuntimeError`` naming the
  parked original (``_park``), by which jax is given it back."""
  def partition(*args):
    *xla_args, key = args
    with _weak_lock:
      op = _registry.get(key.decode() if isinstance(key, bytes) else key)
    if op is None:
      raise RuntimeError(f"{_TARGET}: no custom_partitioning op is registered "
                         f"under key {key!r}; was its lowering dropped?")
    with _weak_lock:  # an infer/propagate error kept on this thread
      name, e = _pending.pop(threading.get_ident(), (None, None))
    if e is not None:
      raise RuntimeError(_park(e, f"custom_partitioning op {name}")) from e
    try:
      return answer(op, *xla_args)
    except BaseException as e:  # noqa: BLE001 - must not reach XLA raw
      raise RuntimeError(_park(e, f"custom_partitioning op {op.name}")) from e
  return partition


_parked_errors = _LRU()
_parked_counter = itertools.count()


def _park(error: BaseException, where: str) -> str:
  """Parks ``error``; returns a message naming it for the handler."""
  tag = next(_parked_counter)
  _parked_errors.put(tag, error)  # bounded: old compiles that never failed
  return f"{_ERROR_TAG}{tag}] {where}: {type(error).__name__}: {error}"


def _reraise_callback_error(xla_error: Exception):
  """Compile-error handler: gives back the author's original exception."""
  _drop_pending()
  text = str(xla_error)
  start = text.find(_ERROR_TAG)
  if start < 0:
    return None
  tag = text[start + len(_ERROR_TAG):].split("]", 1)[0]
  return _parked_errors.pop(int(tag)) if tag.isdigit() else None


def _answer_partition(op: _Op, arg_shapes, arg_shardings, result_shape,
                      result_sharding):
  """``(per-shard module, operand shardings, result sharding)``, cached."""
  request = (tuple((tuple(s.dimensions()), str(s.numpy_dtype()), str(h))
                   for s, h in zip(arg_shapes, arg_shardings)),
             str(result_shape), str(result_sharding))
  hit = op.answers.get(request)
  if hit is not None:
    if _log.isEnabledFor(logging.DEBUG):  # seam: the log (II.8)
      _debug_cached_partition(op, arg_shapes, arg_shardings, result_shape,
                              result_sharding, hit)
    return hit
  on = op.mesh if op.place.auto is None else op.place.auto
  result_shapes, result_shardings = _hlo_parts(result_shape, result_sharding)
  # XLA's thread has none of the lowering thread's context managers:
  # partition and lower_fn run under the config the op was lowered with.
  operands = _from_xla(arg_shapes, arg_shardings, on, op.varying[0])
  results = _from_xla(result_shapes, result_shardings, on, op.varying[1])
  with _config_entered(op.config):
    shard = _shard_of(op, operands, results, on)
    module = _per_shard_module(op, shard)
  answer = (module, [_hlo_of(v, on) for v in shard.args],
            _pack_hlo(result_shape, [_hlo_of(v, on) for v in shard.results]))
  op.answers.put(request, answer)
  return answer


def _per_shard_module(op: _Op, shard: _Answer) -> bytes:
  """The per-shard program lowered to the module XLA inlines, as bytecode."""
  mesh, closed = shard.mesh, shard.jaxpr
  kwargs: dict[str, Any] = {  # jax 0.5.0 renamed backend_or_name
      "backend" if _JAX_VERSION >= (0, 5, 0) else "backend_or_name":
          op.backend}
  params: dict[str, Any] = {}
  if _JAX_VERSION < (0, 7, 0):  # jax 0.7.0 dropped name_stack
    kwargs["name_stack"] = _jax.new_name_stack()
  if _JAX_VERSION >= (0, 7, 1):  # jax 0.7.1 added these three
    kwargs.update(num_const_args=0, in_avals=closed.in_avals)
    params["hoist_constants_as_args"] = False
  if _JAX_VERSION >= (0, 11, 0):  # jax 0.11.0 made out_avals required
    kwargs["out_avals"] = closed.out_avals
  with _jax.extend_axis_env_nd(list(mesh.shape.items())), _no_ambient_mesh():
    lowered = _jax.mlir.lower_jaxpr_to_module(  # the shared lowering
        "custom_partitioning_shard", closed, ordered_effects=[],
        donated_args=[False] * len(closed.in_avals),
        axis_context=_jax.SPMDAxisContext(mesh, frozenset(mesh.axis_names)),
        platforms=op.platforms,
        lowering_parameters=_jax.LoweringParameters(**params), **kwargs)
  # Host callbacks cannot work: XLA finds them by index in the compiled
  # program's list, fixed before this ran (upstream segfaults).
  if lowered.host_callbacks:
    raise _host_callback_error(op)
  if shard.lower_fn is None:  # seam: plain jax's body (II.4)
    # Traced in the caller's program, its types' shardings (a partly
    # manual shard_map's) are constraints no per-shard program can keep.
    for constraint in [o for o in _operations(lowered.module.operation)
                       if o.name == "sdy.sharding_constraint" or (
                           o.name == "stablehlo.custom_call" and str(
                               o.attributes["call_target_name"]) ==
                           '"Sharding"')]:
      constraint.results[0].replace_all_uses_with(constraint.operands[0])
      constraint.erase()
  return _jax.module_to_bytecode(lowered.module)


_register_partitioner = functools.partial(
    _jax.register_custom_call_partitioner, name=_TARGET,
    prop_user_sharding=_question(_answer_propagate, lambda users, _: users),
    partition=_partitioner(_answer_partition),
    infer_sharding_from_operands=_question(_answer_infer, lambda *_: None),
    can_side_effecting_have_replicated_sharding=True)
_register_partitioner()
_jax.register_plugin_callbacks(_register_partitioner)
_jax.register_xla_runtime_error_handler(_reraise_callback_error)


@functools.cache
def _listen_to_compiles() -> None:
  """From the first custom call on, ``_drop_pending`` hears of each compile."""
  # jax reports dispatch.BACKEND_COMPILE_EVENT (with its duration) after each
  # backend compile that succeeds, 0.4.35 to 0.12.1.
  _jax.register_event_duration_secs_listener(_drop_pending)


# Keys that hit across processes
#
# With jax's persistent compilation cache on, a custom call's key (part of
# the program's) names the op by content, alike in every process: a digest
# of every ``_Op`` field not marked state (body jaxpr and constants; each
# callback's code and what it reads: closures, globals, user modules'
# attributes, defaults; static arguments, pytrees, mesh, devices,
# partitioner, jax's trace context). Plain data (user objects by fields;
# arrays up to _MAX_HASHED_BYTES, as hashing costs in every lowering), code,
# meshes, devices and shardings are described faithfully; anything else is
# *opaque*: named by its identity in one lowering of one process. So a key
# holds across processes unless the op reads opaque values, and a changed
# program (even in place: each lowering is described anew) never gets an old
# key. State read through libraries (environment, files, random numbers) is
# not seen: as in functions jax.jit traces, callbacks must not read it.

# Code of these packages is identified by name and version, not by content.
_LIBRARY_PREFIXES = frozenset(
    "jax jaxlib numpy builtins functools operator math typing collections abc"
    " ml_dtypes opt_einsum scipy os sys random time io pathlib".split())
_MAX_DESCRIPTION = 200_000  # items; a bigger description is made opaque
_MAX_HASHED_BYTES = 1 << 20  # a bigger array is opaque
# This module's classes -> what describes their objects (this section's end).
_DESCRIBED_BY: dict[type, Callable[[Any], Any]] = {}
_SKIPPED_CLASS_ATTRS = frozenset(
    "__dict__ __weakref__ __doc__ __module__ __qualname__ __annotations__"
    " __dataclass_fields__ __dataclass_params__ __match_args__".split())


def _content_key(ctx, op: _Op) -> str:
  """The op's key across processes, unlike its ``_Op`` (whose body, and anything
  without a value, are equal by identity): a digest of its content."""
  call = op.call
  # What the cache loads runs per-shard code no one lowered in this process.
  _ensure_lapack(op.platforms, _open(call))
  # The keep-alive list lives as long as the lowering and its executables.
  describer = _Describer(
      f"{_PROCESS_NONCE}:{id(ctx.module_context.keepalives)}")
  # jax's trace context (its tracing caches' key), each entry by value: the
  # axis environment is a tuple of frames in jax 0.4.35, in 0.10 and 0.11
  # a core.AxisEnv, whose repr is its address.
  axis_env = _jax.AxisEnv or ()  # a class, or no class
  context = tuple(("axis env", dict(v.axis_sizes), v.spmd_axis_names,
                   getattr(v, "explicit_mesh_axis_names", None))
                  if isinstance(v, axis_env) else v
                  for v in _jax.trace_context())
  parts = (str(_open(call)), call.consts, op, context, _SHARDY.value)
  try:
    describer.add((jax.__version__, *parts))
  except RecursionError:  # too deep, or too big (``add``)
    describer.out = ["too big to describe"]
    describer.opaque(parts)
  digest = hashlib.sha256("\n".join(describer.out).encode()).hexdigest()
  return f"{_TARGET}:{digest[:40]}"


_lapack_ready = False  # see _ensure_lapack


def _ensure_lapack(platforms, jaxpr: _jax.Jaxpr) -> None:
  """Registers jaxlib's LAPACK kernels (tenths of a second, once) if ``jaxpr``
  uses one on CPU, as jax.export does for a loaded module: jax does so only
  when it lowers one, and XLA segfaults if cached per-shard code calls one."""
  global _lapack_ready
  if _lapack_ready or "cpu" not in platforms:
    return
  linear_algebra = {p for p in vars(_jax.linalg).values()
                    if isinstance(p, _jax.Primitive)}
  jaxprs = [jaxpr]
  while jaxprs and not _lapack_ready:
    jaxpr = jaxprs.pop()
    if any(eqn.primitive in linear_algebra for eqn in jaxpr.eqns):
      _jax.lapack._lapack.initialize()
      _lapack_ready = True
    jaxprs.extend(_jax.subjaxprs(jaxpr))


class _Describer:
  """Writes a description of Python values (a content key's); ``scope`` names
  one lowering in one process (opaque values are described within it)."""

  def __init__(self, scope: str):
    self.scope = scope
    self.out: list[str] = []
    # id -> (position, object): kept, so no temporary reuses the id.
    self.seen: dict[int, tuple[int, Any]] = {}

  def add(self, obj) -> None:
    out = self.out
    if len(out) > _MAX_DESCRIPTION:
      raise RecursionError
    if isinstance(obj, (str, bytes, int, float, complex, bool, type(None))):
      out.append(str(_static_key(obj)))  # not repr: it loses a NaN's sign
      return
    if id(obj) in self.seen:  # shared or cyclic
      out.append(f"same as #{self.seen[id(obj)][0]}")
      return
    self.seen[id(obj)] = (len(self.seen), obj)
    kind = type(obj)
    if isinstance(obj, (tuple, list)):  # also PartitionSpec, namedtuples
      out.append(f"{kind.__module__}.{kind.__qualname__}[{len(obj)}]")
      for item in obj:
        self.add(item)
    elif isinstance(obj, (set, frozenset)):
      out.append(f"{kind.__name__}[{len(obj)}]")
      for item in sorted(obj, key=self._alone):
        self.add(item)
    elif isinstance(obj, dict):
      out.append(f"dict[{len(obj)}]")
      for item in itertools.chain.from_iterable(obj.items()):
        self.add(item)
    elif isinstance(obj, (np.ndarray, np.generic, jax.Array)):
      self._array(obj)
    elif isinstance(obj, (np.dtype, enum.Enum)):
      out.append(f"{kind.__qualname__} {obj!r}")
    elif isinstance(obj, types.ModuleType):
      out.append(f"module {obj.__name__}")
    elif isinstance(obj, functools.partial):
      out.append("partial")
      self.add((obj.func, obj.args, obj.keywords))
    elif isinstance(obj, types.MethodType):
      out.append("method")
      self.add((obj.__func__, obj.__self__))
    elif isinstance(obj, types.FunctionType):
      self._function(obj)
    elif isinstance(obj, type):
      self._class(obj)
    elif isinstance(obj, types.CodeType):
      self._code(obj)
    elif isinstance(obj, types.BuiltinFunctionType):
      out.append(f"builtin {obj.__module__}.{obj.__qualname__}")
      if not isinstance(obj.__self__, (types.ModuleType, type(None))):
        self.add(obj.__self__)
    else:
      self._object(obj)

  def _object(self, obj) -> None:
    """Describes jax's objects, this module's, wrappers, user objects."""
    out, kind = self.out, type(obj)
    if isinstance(obj, jax.sharding.Mesh):
      out.append("empty mesh" if obj.empty else
                 f"mesh {obj.axis_names} {obj.devices.shape} "
                 f"{[d.id for d in obj.devices.flat]} {_axis_types(obj)}")
    elif isinstance(obj, _jax.AbstractMesh):  # its repr is its value
      out.append(f"abstract mesh {obj!r}")
    elif isinstance(obj, jax.Device):
      out.append(f"device {obj.platform} {obj.id}")
    elif isinstance(obj, _jax.Client):  # one per platform in a process
      out.append(f"backend {obj.platform} {obj.platform_version}")
    elif isinstance(obj, jax.sharding.NamedSharding):
      out.append(f"named sharding {obj.spec} {obj.memory_kind}")
      self.add(obj.mesh)
    elif isinstance(obj, _jax.GSPMDSharding):
      out.append(f"gspmd sharding {_gspmd_hlo(obj)} "
                 f"{[d.id for d in obj._device_assignment]}")
    elif isinstance(obj, (jax.tree_util.PyTreeDef, SdyShardingRule)):
      out.append(f"{kind.__qualname__} {obj}")
    elif any(t in _DESCRIBED_BY for t in kind.__mro__):
      out.append(f"{kind.__qualname__}")
      self.add(next(_DESCRIBED_BY[t] for t in kind.__mro__
                    if t in _DESCRIBED_BY)(obj))
    elif hasattr(obj, "__wrapped__"):  # e.g. a jax.jit-wrapped function
      out.append(f"wrapper {kind.__qualname__}")
      self.add(obj.__wrapped__)
    elif not _is_library(kind.__module__) and hasattr(obj, "__dict__"):
      out.append("object")  # dataclasses, other user objects: by fields
      self._class(kind)
      self.add(vars(obj))
    else:
      self.opaque(obj)

  def opaque(self, obj) -> None:
    kind = type(obj)
    self.out.append(f"opaque {kind.__module__}.{kind.__qualname__} "
                    f"{self.scope}:{id(obj)}")

  def _alone(self, obj) -> str:  # to sort set members
    sub = _Describer(self.scope)
    sub.add(obj)
    return "\n".join(sub.out)

  def _array(self, obj) -> None:
    value = None
    # Checked before np.asarray, which copies a jax.Array to the host.
    if getattr(obj, "nbytes", 0) <= _MAX_HASHED_BYTES:
      with contextlib.suppress(Exception):  # e.g. not addressable from here
        value = np.asarray(obj)
    if value is None:
      return self.opaque(obj)
    self.out.append(f"array {value.dtype} {value.shape} "
                    f"{hashlib.sha256(value.tobytes()).hexdigest()}")

  def _function(self, fn: types.FunctionType) -> None:
    self.out.append(f"def {fn.__module__}.{fn.__qualname__}")
    if _is_library(fn.__module__):
      return
    self.add((fn.__defaults__, fn.__kwdefaults__))
    self._code(fn.__code__)
    for cell in fn.__closure__ or ():
      try:
        self.add(cell.cell_contents)
      except ValueError:  # an empty cell
        self.out.append("empty cell")
    self._reads("global ", fn.__globals__, _code_names(fn.__code__))

  def _reads(self, prefix: str, namespace, names, depth: int = 0) -> None:
    """Describes what code using ``names`` may read from ``namespace``, and
    from user modules in it (``co_names`` holds ``cfg.SCALE``'s too)."""
    for name in names:
      if name in namespace:
        self.out.append(f"{prefix}{name}")
        self.add(value := namespace[name])
        if (isinstance(value, types.ModuleType) and depth <= 4 and
            not _is_library(value.__name__)):
          self._reads(f"attr {value.__name__}.", vars(value), names, depth + 1)

  def _class(self, cls: type) -> None:
    self.out.append(f"class {cls.__module__}.{cls.__qualname__}")
    if _is_library(cls.__module__):
      return
    self.add(cls.__bases__)
    for attr, value in sorted(vars(cls).items()):
      if attr not in _SKIPPED_CLASS_ATTRS:
        self.out.append(attr)
        self.add(getattr(value, "__func__", value))  # unwrap static/class

  def _code(self, code: types.CodeType) -> None:
    self.out.append(f"code {code.co_code.hex()} {code.co_names}")
    for const in code.co_consts:
      self.add(const)


def _is_library(module_name: str | None) -> bool:
  return (module_name or "").split(".")[0] in _LIBRARY_PREFIXES


def _code_names(code: types.CodeType) -> list[str]:
  """Global and attribute names used by ``code`` and the code nested in it."""
  nested = (_code_names(const) for const in code.co_consts
            if isinstance(const, types.CodeType))
  return sorted(set(code.co_names).union(*nested))


# How the content key describes this module's objects: an op by every field
# that is not state (a field added to _Op is in the key unless it is marked
# as state), but its body, described by its text.
_DESCRIBED_BY.update({
    _Op: lambda op: tuple((f.name, getattr(op, f.name))
                          for f in dataclasses.fields(op)
                          if f.compare and f.name != "call"),
    _Statics: lambda obj: obj.value,
    _FromRule: lambda obj: (obj.fun, obj.static_argnums, obj.defaults),
    custom_partitioning: lambda obj: (
        obj.fun, obj.static_argnums, obj.partition,
        obj.infer_sharding_from_operands, obj.propagate_user_sharding,
        obj.decode_shardings, obj.sharding_rule, obj.check_vma),
})
# A derived op's step by class and fields: jvp and vjp differ.
_DESCRIBED_BY[_Step] = dataclasses.astuple  # seam: derived ops (II.4)


# --------------------------------------------------------------------------
# II.8 The log of what each op was asked
#
# Silent at the default WARNING (README, "Debugging": what a record holds).
# At DEBUG, a record per question an op is asked (by XLA or, under Explicit
# axes, while tracing) and per run of ``fun`` instead; a derived op is named
# as jax made it ("transpose of jvp of f") and answers in its author's
# callbacks' view. Callers check ``_log.isEnabledFor`` (tracing is hot).
# --------------------------------------------------------------------------

_log = logging.getLogger(__name__)
_CUSTOM_CALL = "custom call"
_SHARD_MAP = "shard_map under Explicit axes"  # seam: used by (II.3)
_FUN = "fun"
_AT_LOWERING_PATH = "manual computation at lowering, Shardy"


def _debug(name: str, question: str, *, path: str, mesh, asked: str = "",
           answered: str = "", by: str = "", why: str = "",
           cached: bool = False) -> None:
  axes = {} if mesh is None or mesh.empty else dict(mesh.shape)
  where = (f"{path}, {'Shardy' if _SHARDY.value else 'GSPMD'}"
           if path == _CUSTOM_CALL else path)
  text = "; ".join(filter(None, [
      f"custom_partitioning op {name}: {question} [{where}] "
      + (f"on mesh {axes}" if axes else "with no mesh"),
      asked and f"asked with {asked}",
      "answered from the cache" + (answered and f": {answered}") if cached
      else answered and f"{by} answered {answered}", why]))
  _log.debug(text, extra={"custom_partitioning": dict(
      op=name, question=question, path=path, mesh=axes, cached=cached,
      why=why)})


def _logged_spec(v: _Value) -> str:
  if v.spec is not None:
    return _spec_text(v.spec)
  return "unplaced" if v.hlo is None else f"HloSharding {v.hlo}"


def _logged(operands=None, results=None) -> str:
  return ", ".join(
      f"{what} [{', '.join(map(_logged_spec, values))}]"
      for what, values in (("operands", operands), ("results", results))
      if values is not None)


def _debug_partition(op: _Op, operands: list, results: list, answer,
                     path: str = _CUSTOM_CALL, why: str = "") -> None:
  """Records ``partition`` asked about the author's op (``answer``: _Answer)."""
  _debug(op.name, "partition", path=_AT_LOWERING_PATH if op.at_lowering
         else path, mesh=op.mesh, asked=_logged(operands, results),
         answered=_logged(answer.args, answer.results) if answer else "",
         by=("the sharding rule" if isinstance(op.partition, _FromRule)
             else "partition"), why=why)


def _debug_cached_partition(  # seam: used by (II.7)
    op: _Op, arg_shapes, arg_shardings, result_shape, result_sharding,
    hit) -> None:
  """Records a repeated ``partition`` question, answered with ``hit``."""
  on = op.mesh if op.place.auto is None else op.place.auto
  asked, answered = (
      _logged(_from_xla(arg_shapes, args, on),
              _from_xla(*_hlo_parts(result_shape, result), on))
      for args, result in ((arg_shardings, result_sharding), hit[1:]))
  _debug(op.name, "partition", path=_CUSTOM_CALL, mesh=op.mesh, cached=True,
         asked=asked, answered=answered)


def _debug_infer(op: _Op, operands: list, inferred,
                 path: str = _CUSTOM_CALL) -> None:
  by = ("infer_sharding_from_operands"
        if op.infer_sharding_from_operands is not None else
        "the sharding rule (no infer_sharding_from_operands)"
        if op.sharding_rule is not None else
        "nobody (no infer_sharding_from_operands, no sharding_rule)")
  _debug(op.name, "infer_sharding_from_operands", path=path, mesh=op.mesh,
         asked=_logged(operands), by=by,
         answered=(_logged(results=inferred) if inferred is not None else
                   "nothing: XLA propagates on its own" if path == _CUSTOM_CALL
                   else "nothing"))


def _debug_propagate(  # seam: used by (II.7)
    op: _Op, users: list, answer: list | None) -> None:
  """``answer`` None: the user's sharding was kept without asking."""
  by = ("the module (no propagate_user_sharding: the user's sharding)"
        if answer is None else "propagate_user_sharding")
  _debug(op.name, "propagate_user_sharding", path=_CUSTOM_CALL,
         mesh=op.mesh, asked=_logged(results=users), by=by,
         answered=_logged(results=users if answer is None else answer))


# --------------------------------------------------------------------------
# II.9 Ops placed apart: one lowering per place
#
# jax lowers a function of several callers once, and equal equations once (its
# lowering caches, ``ModuleContext.lowering_cache`` and
# ``cached_primitive_lowerings``), but Shardy may place each place of such an op
# apart; one module cannot hold both. ``_party`` then asks for a second
# lowering, in which the two caches are wrapped (``_SiteCache``): an entry whose
# lowering lowered ops is reused only where those ops are placed as there, and
# is lowered again elsewhere, its ops under their first lowering's indices
# (``_PerSite``). A copy without this section partitions a function placed apart
# as its first call asks (XLA reshards at the others). jax reads the two caches
# with ``.get(key, default)``, ``[key]`` (a miss raising ``KeyError``, which
# ``__missing__`` answers) and writes them with ``[key] = entry``, nothing else
# (in ``mlir.py`` and ``pjit.py``, 0.4.36 to 0.12.1; jax 0.4.35 has no
# lowering_cache): what ``_SiteCache`` overrides, and what ``SiteCacheTest``
# reads jax's source for.
# --------------------------------------------------------------------------

class _PerSite:
  """The second pass's view of jax's lowering caches where one op was
  placed apart (as II.9's head says), keeping each entry's variants."""

  def __init__(self, pass_: _Pass):
    self.pass_ = pass_
    self.start = None  # the index when installed
    self.since = []  # (index, placement) of each op lowered since then
    self.open: dict = {}  # key -> the same, since its lowering began
    self.starts: dict = {}  # key -> the index its lowering began at
    # key -> (index of its first op, one past its last, its ops' indices)
    self.spans: dict = {}
    self.variants: dict = {}  # (key, its ops' placements) -> entry
    self.resume: dict = {}  # key -> the index to go on from, lowered again
    self.module = None  # the module being lowered when installed

  def install(self, mc):
    if mc.module is not self.module:
      # A copy of this file of another protocol version, wrapping the
      # shared lowering, keeps this pass over two lowerings of the module:
      # the first's entries are functions of another module.
      self.__init__(self.pass_)
      self.module = mc.module
    if self.start is None:
      self.start = self.pass_.count
    # jax 0.4.35 has no lowering_cache (it lowers equal equations apart).
    for name in ("lowering_cache", "cached_primitive_lowerings"):
      cache = getattr(mc, name, None)
      if cache is not None and not isinstance(cache, _SiteCache):
        setattr(mc, name, _SiteCache(cache, self, name))

  def lowered(self, index: int, placement):
    for frame in (self.since, *self.open.values()):
      frame.append((index, placement))

  def missed(self, key):
    """The entry for ``key`` where its ops are placed as here, or None
    (then jax lowers it here)."""
    pass_ = self.pass_
    span = self.spans.get(key)
    if span is not None:
      first, end, indices = span
      ahead: dict = {}
      placements = []
      for i in indices:
        ahead[i] = ahead.get(i, -1) + 1
        placements.append(_placement(pass_, i, pass_.sites[i] + ahead[i]))
      entry = self.variants.get((key, repr(placements)))
      if entry is not None:
        for i, placement in zip(indices, placements):
          pass_.sites[i] += 1
          self.lowered(i, placement)
        pass_.count = max(pass_.count, end)
        return entry
      self.resume[key] = pass_.count
      pass_.count = first
    self.starts[key] = pass_.count
    self.open[key] = []
    return None

  def put(self, key, entry) -> bool:
    """Whether the entry for ``key`` lowered ops (then it is kept here,
    by their placements, and not in jax's cache)."""
    pass_ = self.pass_
    # Entries being lowered when installed began before any op.
    first = self.starts.pop(key, self.start)
    frame = self.open.pop(key, None)
    frame = list(self.since) if frame is None else frame
    if not frame:
      return False
    self.spans.setdefault(key, (first, pass_.count, [i for i, _ in frame]))
    self.variants[key, repr([p for _, p in frame])] = entry
    pass_.count = max(pass_.count, self.resume.pop(key, pass_.count))
    return True


class _SiteCache(dict):
  """One of jax's lowering caches, asking ``_PerSite`` where it misses."""

  def __init__(self, entries: dict, sites: _PerSite, name: str):
    super().__init__(entries)
    self.sites, self.name = sites, name

  def get(self, key, default=None):
    if key in self:
      return dict.__getitem__(self, key)
    entry = self.sites.missed((self.name, key))
    return default if entry is None else entry

  def __missing__(self, key):
    entry = self.sites.missed((self.name, key))
    if entry is None:
      raise KeyError(key)
    return entry

  def __setitem__(self, key, entry):
    if not self.sites.put((self.name, key), entry):
      dict.__setitem__(self, key, entry)


# ==========================================================================
# Part III. Leaves and tools
# ==========================================================================

# --------------------------------------------------------------------------
# III.1 Sharding rules for Shardy
#
# A rule names a *factor* for every dimension of every operand and result,
# einsum-style: "i j, j k -> i k"; dimensions that share a factor are sharded
# alike. A leading "..." (or "...2", a numbered group) stands for any number
# of leading batch dimensions; "(a b)" is a dimension made of two factors.
# --------------------------------------------------------------------------

BATCHING: str = "\u2026"  # one character ("…") standing for "..." in a rule.
_BATCH_FACTOR_PREFIX = "?"  # of expanded batch factors: no user can write it
_SPECIAL_FACTOR_KINDS = ("reduction_factors", "need_replication_factors",
                         "permutation_factors")  # as SdyShardingRule names them


def _check_factor_name(name: str) -> None:
  for char in name:
    if not (char == "_" or char.isdigit() or char.isalpha()):
      raise ValueError(f"Unknown character {char!r} in factor {name!r}.")
  if not name[0].isalpha():
    raise ValueError(f"A factor name must start with a letter; got {name!r}.")


class CompoundFactor(tuple):
  """A dimension made of two or more factors, e.g. ``CompoundFactor('b', 'c')``.
  Raises ValueError for fewer than two factors, a non-str factor or BATCHING."""

  def __new__(cls, *factors):
    if len(factors) < 2:
      raise ValueError("A compound factor needs at least two factors; got "
                       f"{factors!r}.")
    for factor in factors:
      if not isinstance(factor, str):
        raise ValueError("Each element of CompoundFactor must be a str; got "
                         f"{type(factor)}.")
      if _is_batching(factor):
        raise ValueError("Ellipsis (BATCHING) can't be used in a compound "
                         "factor.")
      _check_factor_name(factor)
    return tuple.__new__(cls, factors)


class ArrayMapping(tuple):
  """The factors of one operand or result, one entry per dimension: a factor
  name or a ``CompoundFactor``, or first ``BATCHING`` (leading batch
  dimensions), e.g. ``ArrayMapping(BATCHING, CompoundFactor('b', 'c'), 'd')``.
  Raises ValueError for another type, a bad name, or ``BATCHING`` not first."""

  def __new__(cls, *dims):
    for i, dim in enumerate(dims):
      if not isinstance(dim, (str, CompoundFactor)):
        raise ValueError("Each element of ArrayMapping must be a str or "
                         f"CompoundFactor; got {type(dim)}.")
      if _is_batching(dim) and i != 0:
        raise ValueError("Ellipsis can only be used at the beginning of a "
                         "dimension list.")
      if isinstance(dim, str) and not _is_batching(dim):
        _check_factor_name(dim)
    return tuple.__new__(cls, dims)


class SdyShardingRule:
  """A Shardy sharding rule: factor mappings for all operands and results.

  Args:
    operand_mappings: one ``ArrayMapping`` per operand.
    result_mappings: one ``ArrayMapping`` per result.
    reduction_factors: factors summed over (present in operands only); if one
      is sharded, the result needs an all-reduce.
    need_replication_factors: factors whose dimensions must not be sharded.
    permutation_factors: factors whose sharding needs a collective permute.
    **factor_sizes: sizes of factors that only occur inside compound factors.
  Raises:
    ValueError: a size given for an unknown or whole-dimension factor, a
      missing size, or special factors not in a tuple, unknown, repeated or
      listed in two kinds.
  """

  def __init__(self, operand_mappings: tuple[ArrayMapping, ...],
               result_mappings: tuple[ArrayMapping, ...], *,
               reduction_factors: tuple[str, ...] = (),
               need_replication_factors: tuple[str, ...] = (),
               permutation_factors: tuple[str, ...] = (),
               **factor_sizes: int):
    # Set first: a refused rule still prints (in a traceback's locals).
    specials = (reduction_factors, need_replication_factors,
                permutation_factors)
    (self.operand_mappings, self.result_mappings, self.factor_sizes,
     self.reduction_factors, self.need_replication_factors,
     self.permutation_factors) = (operand_mappings, result_mappings,
                                  factor_sizes, *specials)
    # factor -> whether some dimension is exactly it (so its size can be
    # read off the operand) rather than only part of compounds.
    whole_dim: dict[str, bool] = {}
    for dim in itertools.chain(*operand_mappings, *result_mappings):
      compound = isinstance(dim, CompoundFactor)
      for factor in dim if compound else (dim,):
        whole_dim[factor] = whole_dim.get(factor, False) or not compound
    for factor in factor_sizes:
      if factor not in whole_dim:
        raise ValueError(f"Factor {factor} is not used in the rule, but a "
                         "size is given for it.")
    for factor, whole in whole_dim.items():
      if whole and factor in factor_sizes:
        raise ValueError(f"Factor {factor} is a whole dimension, so its size "
                         "comes from the operand; do not give a size.")
      if not whole and factor not in factor_sizes:
        raise ValueError(f"Factor {factor} only occurs in compound factors; "
                         "give its size as a keyword argument.")
    seen: set[str] = set()
    for kind, factors in zip(_SPECIAL_FACTOR_KINDS, specials):
      if not isinstance(factors, tuple):
        raise ValueError(f"{kind} must be a tuple of factors; got {factors!r}.")
      if len(set(factors)) != len(factors):
        raise ValueError(f"{kind} contains duplicated factors: {factors}.")
      for factor in factors:
        if factor not in whole_dim:
          raise ValueError(f"Factor {factor} in {kind} is not used in the "
                           "rule.")
        if factor in seen:
          raise ValueError(f"Factor {factor} can only be in one of the "
                           "reduction, need replication, or permutation "
                           "factor sets.")
        seen.add(factor)

  def __str__(self):
    special = "".join(f" {kind}={getattr(self, kind)}"
                      for kind in _SPECIAL_FACTOR_KINDS if getattr(self, kind))
    return (f"SdyShardingRule({self.operand_mappings}, "
            f"{self.result_mappings}, {self.factor_sizes}{special})")

  __repr__ = __str__


def _parse_side(text: str) -> tuple[ArrayMapping, ...]:
  """One side of a rule string (``"i j, (a b) k"``) as mappings."""
  side = " ".join(text.split())
  text = text.translate({ord(char): f" {char} " for char in "(),"})
  values, dims = [], []
  compound: list[str] | None = None  # factors of an open "(...)"
  for token in text.replace(BATCHING, f" {BATCHING}").split():
    if token == "(":
      if compound is not None:
        raise ValueError("Compound factors can't be nested.")
      compound = []
    elif token == ")":
      if compound is None:
        raise ValueError(f"Brackets are not balanced in rule side {side!r}.")
      dims.append(CompoundFactor(*compound))
      compound = None
    elif token == ",":
      values.append(ArrayMapping(*dims))
      dims = []
    else:
      if token[0] == BATCHING:  # "…", or "…2" (a group), maybe a name after
        if compound is not None or dims:
          raise ValueError("Ellipsis can only be used at the beginning of a "
                           "dimension list.")
        group = "".join(itertools.takewhile(str.isdigit, token[1:]))
        dims.append(BATCHING + str(int(group or "0")))
        token = token[1 + len(group):]
      if token:
        (dims if compound is None else compound).append(token)
  if compound is not None:
    raise ValueError(f"Brackets are not balanced in rule side {side!r}.")
  return (*values, ArrayMapping(*dims))


def str_to_sdy_sharding_rule(rule: str, *,
                             reduction_factors: tuple[str, ...] = (),
                             need_replication_factors: tuple[str, ...] = (),
                             permutation_factors: tuple[str, ...] = (),
                             **factor_sizes: int) -> SdyShardingRule:
  """Parses an einsum-like rule such as ``"... i j, j k -> ... i k"`` into an
  ``SdyShardingRule``. Factor names start with a letter and hold letters, digits
  and ``_``; values are separated by ``,``; an empty one is a scalar.

  Raises:
    TypeError: ``rule`` is not a str, or a factor size is not an int.
    ValueError: the rule is malformed or inconsistent (see ``SdyShardingRule``).
  """
  if not isinstance(rule, str):
    raise TypeError(f"rule must be a str; got {type(rule)}.")
  if not all(isinstance(size, int) for size in factor_sizes.values()):
    raise TypeError(f"factor sizes must be ints; got {factor_sizes}.")
  if BATCHING in rule:
    raise ValueError(f"Unknown character {BATCHING!r} in sharding rule.")
  rule = rule.replace("...", BATCHING)
  if "." in rule:
    raise ValueError("Character '.' may only appear as part of '...'.")
  sides = rule.split("->")
  if len(sides) != 2:  # the first message is upstream's
    raise ValueError(f"There is no -> in rule: {rule!r}." if len(sides) == 1
                     else f"A rule has exactly one '->'; got {rule!r}.")
  return SdyShardingRule(
      *map(_parse_side, sides), reduction_factors=reduction_factors,
      need_replication_factors=need_replication_factors,
      permutation_factors=permutation_factors, **factor_sizes)


def _value_name(i: int, num_operands: int) -> str:
  return f"operand {i}" if i < num_operands else f"result {i - num_operands}"


def _rule_text(rule: SdyShardingRule) -> str:
  """``rule`` as written: ``"... (a b) i, j -> ... i"``."""
  return " -> ".join(", ".join(" ".join(
      f"({' '.join(d)})" if isinstance(d, CompoundFactor) else "..." +
      d[1:].lstrip("0") if _is_batching(d) else d for d in m) for m in side)
      for side in (rule.operand_mappings, rule.result_mappings))


def _expand_ellipsis(entries: list, rank: int, group_rank: dict) -> list:
  """``entries`` of a value whose first stands for leading dimensions:
  those dimensions as batch factors of the ellipsis's group."""
  group = entries[0][1:] or "0"
  num_batch = max(rank - len(entries) + 1, 0)
  if group_rank.setdefault(group, num_batch) != num_batch:
    raise ValueError("Ellipsis represents different numbers of leading "
                     f"dimensions: {group_rank[group]} and {num_batch}.")
  return [f"{_BATCH_FACTOR_PREFIX}{group}_{d}"
          for d in range(num_batch)] + entries[1:]


def _check_compounds(sizes: dict, dims: list, shapes, num_operands: int):
  """Raises where a dimension's compound factors do not multiply to it."""
  for i, (value_dims, shape) in enumerate(zip(dims, shapes)):
    for d, (factors, size) in enumerate(zip(value_dims, shape)):
      product = math.prod(sizes[factor] for factor in factors)
      if len(factors) > 1 and product != size:
        raise ValueError(
            f"{_value_name(i, num_operands)} dimension {d} has size {size}, "
            f"but its compound factors {factors} multiply to {product}.")


# Shardy's parser, which reads the rule back while XLA compiles, takes factor
# sizes as 32-bit integers ("integer value too large"). Trial division stops
# at _TRIAL_DIVISION_LIMIT: a cofactor left above _MAX_FACTOR_SIZE is taken
# as unsplittable (it may be a product of primes above the limit).
_MAX_FACTOR_SIZE = 2**31 - 1
_TRIAL_DIVISION_LIMIT = 2**21


def _split_size(size: int, where: str | None = None) -> list[int] | None:
  """``size`` as factors of at most ``_MAX_FACTOR_SIZE``, major first, or
  None if a prime factor is bigger (given ``where``, the dimension's name: a
  ValueError naming it). The major part takes the small primes first: mesh
  axes (usually powers of two) then still divide it, so Shardy shards the
  dimension through it without splitting a mesh axis."""
  if size <= _MAX_FACTOR_SIZE:
    return [size]
  primes, rest, p = [], size, 2
  while p * p <= rest and p < _TRIAL_DIVISION_LIMIT:
    while rest % p == 0:
      primes.append(p)
      rest //= p
    p += 1 if p == 2 else 2
  if rest > _MAX_FACTOR_SIZE:
    if where is None:
      return None
    raise ValueError(
        f"{where} has size {size}, which is not a product of factors of at "
        f"most {_MAX_FACTOR_SIZE} (2**31 - 1), the largest factor size a "
        "Shardy sharding rule can hold. Reshape the dimension, or (jax "
        "0.12.0.1 and older) use the GSPMD partitioner for this op.")
  parts: list[int] = []
  for p in primes + ([rest] if rest > 1 else []):  # ascending
    for i, part in enumerate(parts):
      if part * p <= _MAX_FACTOR_SIZE:
        parts[i] = part * p
        break
    else:
      parts.append(p)
  return parts


def sdy_sharding_rule_to_mlir(rule: SdyShardingRule,
                              operand_types: list[_jax.Type],
                              result_types: list[_jax.Type]) -> _jax.Attribute:
  """Checks ``rule`` against the op's MLIR types (``operand_types``,
  ``result_types``: ranked tensor types of the custom call) and returns its
  ``sdy.OpShardingRuleAttr``.

  Raises:
    ValueError: operand/result counts or ranks do not match the rule, a
      factor names two dimensions of one value, or sizes are inconsistent.
    TypeError: a type is not an ``ir.Type`` (counts are checked first).
  """
  types_ = [*operand_types, *result_types]
  typed = all(isinstance(t, _jax.Type) for t in types_)
  if not typed and (len(operand_types), len(result_types)) == (
      len(rule.operand_mappings), len(rule.result_mappings)):
    raise TypeError("operand_types and result_types must be lists of "
                    f"ir.Type; got {operand_types} and {result_types}.")
  # Mismatched counts (upstream checks them before the types) raise here.
  shapes = [_jax.ShapedType(t).shape if typed else () for t in types_]
  sizes, dims = _resolve_rule(rule, shapes, len(operand_types))
  return _rule_attr_from_dims(sizes, dims, len(operand_types), *(
      getattr(rule, kind) for kind in _SPECIAL_FACTOR_KINDS))


def _reduced_factors(  # seam: used by (II.1, II.5)
    rule: SdyShardingRule, dims: list, num_operands: int) -> set:
  """The factors of a resolved rule no shard can keep (the one definition
  every check and derivation uses): reduction factors, those of operands or
  results only (``j`` of ``"i, j -> i"``, as ``x * sum(y)``), and those a
  result lacks of the operands it shares a factor with (of all operands, if
  it has no factor), as ``n`` for the second result of ``"b n -> b n, b"``."""
  factors = [{f for fs in value_dims for f in fs} for value_dims in dims]
  ins, outs = factors[:num_operands], factors[num_operands:]
  reduced = set(rule.reduction_factors) | (
      set().union(*ins) ^ set().union(*outs))
  for out in outs:
    for operand in ins:
      if operand & out or not out:
        reduced |= operand - out
  return reduced


# --------------------------------------------------------------------------
# III.2 Checking an op's partitioning: check_partitioning
#
# A wrong ``partition`` (an FFT axis kept sharded, a psum forgotten) gives
# plausible numbers, and one-device tests never run it. Deterministic but for
# the cotangents' fixed seed.
# --------------------------------------------------------------------------

def _any_explicit(mesh) -> bool:
  types_ = _axis_types(mesh)  # None before jax 0.5.3: no axis is Explicit
  return types_ is not None and jax.sharding.AxisType.Explicit in types_


_ONE_AXIS, _SEVERAL, _TUPLE, _PADDED = _CLASSES = (
    "one dimension over one axis", "several dimensions over one axis each",
    "one dimension over a tuple of axes", "padded")


def check_partitioning(fn: Callable, *example_args, grad: bool = False,
                       meshes=None, rtol: float | None = None,
                       atol: float | None = None,
                       max_combinations: int = 32) -> PartitioningReport:
  """Checks that ``jax.jit(fn)`` computes what ``fn`` on one device does,
  whatever sharding its operands arrive in. For an op author's tests.

  On each mesh, over its axes of more than one device, every example argument is
  placed replicated or in one of four classes: one dimension over one axis that
  divides it; several dimensions, one axis each; one dimension over all the axes
  as a tuple (both orders); padded, one dimension over an axis that does not
  divide it (XLA pads the last shards, never a global result; not on Explicit
  axes, where jax types no uneven sharding, nor on jax 0.9 under Shardy, which
  cannot compile a padded result). Across arguments: all combinations, or
  ``max_combinations`` per mesh chosen deterministically (all replicated, each
  argument sharded alone, all sharded at once, then the rest). Each one's jitted
  results (with ``grad``, also its VJP's gradients) are compared with
  ``jax.jit(fn)`` on ``jax.devices()[0]``, where each op runs its own ``fun``
  (no callback); results also with each result asked for (as by a consumer) in
  its shardings of those classes but padded in turn, then replicated, the
  arguments placed in turn (none on Explicit axes; max_combinations).

  Args:
    fn: a ``custom_partitioning`` op or a function of arrays built from
      ops (e.g. a ``jax.custom_vjp``); bind non-array arguments into it.
    *example_args: arrays (``numpy`` or ``jax``) or pytrees of them, each
      leaf an operand; small, with dimensions the mesh axes divide (2, 4, 8
      on 8 devices: sharded evenly) and others (padded).
    grad: also compare the VJP for fixed random cotangents (seed 0; zero for
      non-float results; no gradient for an integer argument), each placed as
      its result comes out of the jitted forward, as in a real loss (never
      padded; two compiles per combination); then, on each mesh without Explicit
      axes, the operands replicated, each cotangent in the k-th one-axis
      sharding of its result, for every k (one compile each).
    meshes: a ``jax.sharding.Mesh`` or a sequence of them; default a 1-D
      mesh ``('x',)`` over all devices and, for p the device count's
      smallest factor (1 < p < count), a 2-D mesh ``('x', 'y')`` of shape
      ``(p, count // p)``, both with Auto axes (``jax.make_mesh`` gives
      Explicit ones from jax 0.9). A mesh with an Explicit axis is checked
      under ``jax.set_mesh``, so that ops take their Explicit-axes path.
    rtol, atol: as in ``numpy.allclose``; default by dtype as jax types it,
      ``rtol`` 1e-9 for 64-bit floats (and complex128), 1e-4 for 32-bit,
      5e-3 for float16, 3e-2 for bfloat16, 2 epsilon for float8 types,
      ``atol`` that times the reference's largest magnitude (at least 1);
      integers and booleans exact; inf and NaN exact (same sign) always.
    max_combinations: the bound per mesh.

  Returns:
    A ``PartitioningReport``; its ``str`` says what was checked on which
    meshes, and per argument which classes were not tried and why.

  Raises:
    TypeError: ``fn`` is not callable, an example leaf is not an array, or
      ``meshes`` holds a non-mesh.
    ValueError: ``max_combinations`` is less than 1, or no example argument.
    AssertionError: a result or gradient differs; the message names the
      function, the mesh, the operand (and cotangent, requested result)
      shardings as ``PartitionSpec``s, which result or gradient, largest error.
    Exception: an error compiling or running a placement, or on one
      device, is re-raised with its type, chained to the original, the
      message naming the mesh and shardings (or the device).
  """
  name, arg_names, hosts, in_tree, flat, meshes = _checked_examples(
      fn, example_args, meshes, max_combinations)
  run, outs, ct_shapes = _runner(fn, name, in_tree, hosts, arg_names, grad)
  device = jax.devices()[0]
  try:
    want = run([jax.device_put(h, device) for h in hosts])
  except Exception as e:
    raise _renamed(e, f"check_partitioning({name}): on one device "
                      f"({device})") from e

  def check(mesh, specs, ct_specs=None, out_specs=None):
    where = (f"check_partitioning({name}) on {_mesh_text(mesh)} with "
             f"operand shardings {_specs_text(specs, arg_names, flat)}")
    for kind, given in (("cotangent", ct_specs),
                        ("requested result", out_specs)):
      if given is not None:
        where += f" and {kind} shardings {_specs_text(given, [], True)}"
    placed = [_placed(h, mesh, spec) for h, spec in zip(hosts, specs)]
    try:
      # ``mesh`` made ambient if it has an Explicit axis: jax 0.7.1 added
      # jax.set_mesh; from 0.5.3 to 0.7.0, jax.sharding.use_mesh.
      setter = getattr(jax, "set_mesh", None) or getattr(
          jax.sharding, "use_mesh", None)
      with (setter(mesh) if setter is not None and _any_explicit(mesh) else
            contextlib.nullcontext()):
        got = run([x for x, _ in placed], tuple(c for _, c in placed),
                  ct_specs, mesh, out_specs)
    except Exception as e:
      raise _renamed(e, where) from e
    for (what, g), (_, w) in zip(got, want):
      _compare(g, w, rtol, atol, f"{where}: {what} differs from {name} on "
               "one device")
  per_mesh, cotangents, requested = [], 0, 0
  offered, tried = [set() for _ in hosts], [set() for _ in hosts]
  seen = contextlib.nullcontext([])  # (op name, rule, why) of derived rules
  seen = _derived_rules_seen()  # seam: rules derived from infer (II.6)
  with seen as derived:
    for mesh in meshes:
      options = [_shardings_of(h.shape, mesh) for h in hosts]
      chosen = _sharding_combinations(options, max_combinations)
      for specs in chosen:
        check(mesh, specs)
      for ct_specs in _cotangent_specs(ct_shapes, mesh):
        check(mesh, [()] * len(hosts), ct_specs)
        cotangents += 1
      for k, out_specs in enumerate(_cotangent_specs(
          [s.shape for s in outs], mesh, requested=True)[:max_combinations]):
        check(mesh, [o[k % len(o)] for o in options], out_specs=out_specs)
        requested += 1
      for i, h in enumerate(hosts):
        offered[i] |= {_placement_class(s, h.shape, mesh) for s in options[i]}
        tried[i] |= {_placement_class(c[i], h.shape, mesh) for c in chosen}
      per_mesh.append((_mesh_text(mesh), len(chosen),
                       math.prod(map(len, options))))
  return PartitioningReport(
      name, sum(n for _, n, _ in per_mesh), tuple(per_mesh), grad=bool(grad),
      max_combinations=max_combinations, cotangent_placements=cotangents,
      result_requests=requested, derived_rules=tuple(dict.fromkeys(derived)),
      **_coverage(arg_names, hosts, meshes, offered, tried))


def _checked_examples(fn, example_args: tuple, meshes, max_combinations):
  """``(name, arg_names, host arrays, in_tree, flat, meshes)``, checked;
  ``flat``: no argument is a pytree."""
  if not callable(fn):
    raise TypeError("check_partitioning: fn must be callable (a "
                    "custom_partitioning op or a function built from them); "
                    f"got {type(fn).__name__} {_short_repr(fn)}.")
  name = (getattr(fn, "_name", None) if isinstance(fn, custom_partitioning)
          else None) or getattr(fn, "__qualname__", None) or getattr(
              fn, "__name__", None) or _short_repr(fn)
  if not isinstance(max_combinations, int) or max_combinations < 1:
    raise ValueError(f"check_partitioning({name}): max_combinations must be "
                     f"a positive int; got {max_combinations!r}.")
  paths_leaves, in_tree = jax.tree_util.tree_flatten_with_path(example_args)
  if not paths_leaves:
    raise ValueError(f"check_partitioning({name}): no example argument "
                     "(an array) to place.")
  arg_names = [f"argument {path[0].idx}"
               f"{jax.tree_util.keystr(tuple(path[1:]))}"
               for path, _ in paths_leaves]
  for arg_name, (_, leaf) in zip(arg_names, paths_leaves):
    if not _is_array(leaf):
      raise TypeError(f"check_partitioning({name}): example {arg_name} is a "
                      f"{type(leaf).__name__} ({_short_repr(leaf)}), not an "
                      "array. Pass numpy or jax arrays; bind other arguments "
                      "into fn (functools.partial or a lambda).")
  if meshes is None:
    devices = np.array(jax.devices())
    n = devices.size
    factors = [p for p in range(2, n) if n % p == 0]
    meshes = [jax.sharding.Mesh(devices, ("x",))] + [
        jax.sharding.Mesh(devices.reshape(p, n // p), ("x", "y"))
        for p in factors[:1]]
  meshes = [meshes] if isinstance(meshes, jax.sharding.Mesh) else list(meshes)
  for mesh in meshes:
    if not isinstance(mesh, jax.sharding.Mesh):
      raise TypeError(f"check_partitioning({name}): meshes must hold "
                      f"jax.sharding.Mesh objects; got {type(mesh).__name__}.")
  return (name, arg_names, [np.asarray(leaf) for _, leaf in paths_leaves],
          in_tree, all(len(path) == 1 for path, _ in paths_leaves), meshes)


def _short_repr(value, limit: int = 60) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _runner(fn: Callable, name: str, in_tree, hosts: list, arg_names: list,
            grad: bool) -> tuple[Callable, list, list]:
  """``(run, results' ShapeDtypeStructs, cotangent shapes)`` (None: not a
  float); ``run`` gives ``[(what, array)]`` of the jitted results (constrained
  to ``out_specs``) and, with ``grad``, not ``out_specs``, the gradients."""
  def args_of(leaves, constraints):
    return in_tree.unflatten(_constrained(leaves, constraints))

  def forward(leaves, constraints, out_constraints):
    outs, tree = jax.tree_util.tree_flatten(fn(*args_of(leaves, constraints)))
    return tree.unflatten(_constrained(outs, out_constraints))
  forward.__name__ = forward.__qualname__ = f"check_partitioning_{name}"
  jitted_forward = jax.jit(forward, static_argnums=(1, 2))
  # Cotangents: seed 0; None for a non-float result (its float0 is built
  # while tracing); floats as jax types them (bfloat16: not numpy's).
  rng, cts = np.random.default_rng(0), []
  shapes = jax.tree_util.tree_leaves(jax.eval_shape(
      fn, *in_tree.unflatten(hosts)))
  for s in shapes if grad else []:
    ct = None
    if jax.numpy.issubdtype(s.dtype, jax.numpy.inexact):
      ct = rng.standard_normal(s.shape)
      if jax.numpy.issubdtype(s.dtype, jax.numpy.complexfloating):
        ct = ct + 1j * rng.standard_normal(s.shape)
      ct = ct.astype(s.dtype)
    cts.append(ct)

  def pullback(leaves, cts, constraints, ct_constraints):
    out, vjp = jax.vjp(fn, *args_of(leaves, constraints))
    outs, out_tree = jax.tree_util.tree_flatten(out)
    cts = _constrained(cts, ct_constraints)
    return vjp(out_tree.unflatten([
        np.zeros(o.shape, jax.dtypes.float0) if c is None
        else _typed_like(c, o) for o, c in zip(outs, cts)]))
  pullback.__name__ = pullback.__qualname__ = f"check_partitioning_{name}_vjp"
  jitted_pullback = jax.jit(pullback, static_argnums=(2, 3))

  def run(leaves, constraints=None, ct_specs=None, mesh=None, out_specs=None):
    out = jitted_forward(leaves, constraints, out_specs and tuple(
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*s))
        for s in out_specs))
    found = [(f"result {jax.tree_util.keystr(tuple(path))}" if path else
              "the result", leaf)
             for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]]
    if grad and out_specs is None:
      placed = [(None, None) if c is None else
                (jax.device_put(c, _arguable(o, mesh)), None) if spec is None
                else _placed(c, mesh, spec) for c, o, spec in zip(
                    cts, jax.tree_util.tree_leaves(out),
                    ct_specs or [None] * len(cts))]
      grads = jitted_pullback(leaves, [c for c, _ in placed], constraints,
                              tuple(k for _, k in placed))
      found += [(f"gradient with respect to {arg_name}", g) for arg_name, g
                in zip(arg_names, jax.tree_util.tree_leaves(grads))
                if g.dtype != jax.dtypes.float0]
    return [(what, np.asarray(leaf)) for what, leaf in found]
  return run, shapes, [None if c is None else c.shape for c in cts]


def _typed_like(x, like):
  """``x`` resharded like ``like``'s type if that is on Explicit mesh axes
  (a cotangent must match its output's type; jax 0.7.0 exported reshard)."""
  aval = _typeof(like)
  if hasattr(jax.sharding, "reshard") and _any_explicit(_aval_mesh(aval)):
    return jax.sharding.reshard(x, aval.sharding.spec)
  return x


def _arguable(result: jax.Array, mesh) -> jax.sharding.Sharding:
  """``result``'s sharding (on ``mesh``, or one device if None) as jax.jit
  takes it for an argument: jax 0.4.35 to 0.5.3 with Shardy give a padded
  result a GSPMDSharding, which their jit refuses for an argument."""
  sharding = result.sharding
  if mesh is None or not isinstance(sharding, _jax.GSPMDSharding):
    return sharding
  spec = _decode_spec(_gspmd_hlo(sharding), mesh, result.ndim)
  return jax.sharding.NamedSharding(mesh,
                                    jax.sharding.PartitionSpec(*spec or ()))


def _constrained(xs: list, shardings) -> list:  # shardings None: none
  return [x if s is None else jax.lax.with_sharding_constraint(x, s)
          for x, s in zip(xs, shardings or [None] * len(xs))]


def _placed(host, mesh, spec: tuple) -> tuple:
  """``(host put on mesh in spec, None)``; for a padded ``spec``, which
  ``jax.device_put`` refuses, ``(host replicated, spec's sharding)``, to
  constrain it to inside ``jit`` as a user's program would."""
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
  if _placement_class(spec, host.shape, mesh) != _PADDED:
    return jax.device_put(host, sharding), None
  return _placed(host, mesh, ())[0], sharding


def _shardings_of(shape: tuple, mesh) -> list[tuple]:
  """One operand's candidates: replicated, then by class (``_CLASSES``);
  none padded on Explicit axes or if not ``_returns_padded()``."""
  axes, rank = _real_axes(mesh), len(shape)

  def divides(d: int, names: tuple) -> bool:
    return shape[d] > 0 and shape[d] % math.prod(
        mesh.shape[a] for a in names) == 0

  def spec(entries: dict) -> tuple:  # {dimension: entry}
    return tuple(entries.get(d) for d in range(max(entries) + 1))
  one = [spec({d: a}) for d in range(rank) for a in axes if divides(d, (a,))]
  multi = len(axes) > 1
  several = [spec(dict(zip(dims, axes)))
             for dims in itertools.permutations(range(rank), len(axes))
             if multi and all(divides(d, (a,)) for d, a in zip(dims, axes))]
  tuples = [spec({d: t}) for d in range(rank) for t in (axes, axes[::-1])
            if multi and divides(d, t)]
  padded = [] if _any_explicit(mesh) or not _returns_padded() else [
      spec({d: a}) for d in range(rank) for a in axes
      if shape[d] % mesh.shape[a]]
  return [()] + one + several + tuples + padded


def _returns_padded() -> bool:
  """Whether jax compiles a jit whose result XLA leaves padded, as
  check_partitioning's padded placements need: not jax 0.9 with Shardy
  (0.9.2 raises IndivisibleError; 0.8.3, 0.10.2 give another sharding)."""
  return _JAX_VERSION[:2] != (0, 9) or not _SHARDY.value


def _placement_class(spec: tuple, shape: tuple, mesh) -> str | None:
  """``spec``'s class of placements (``_CLASSES``); None: replicated."""
  entries = [(n, e) for n, e in zip(shape, spec) if e is not None]
  if not entries:
    return None
  if any(n % _shard_count(e, mesh) for n, e in entries):
    return _PADDED
  if any(isinstance(e, tuple) for _, e in entries):
    return _TUPLE
  return _SEVERAL if len(entries) > 1 else _ONE_AXIS


def _cotangent_specs(shapes: list, mesh, requested: bool = False
                     ) -> list[tuple]:
  """For k in 1 .. n-1 (n > 1: the most candidates of a shape), each cotangent
  in its k-th one-axis sharding, cyclically (a shape None: none); an asked-for
  result (``requested``) in its k-th of every class the operands get but padded
  (XLA never pads a global result), then all replicated once more. None on
  Explicit axes: a value is typed as its result."""
  if _any_explicit(mesh):
    return []
  classes = set(_CLASSES) - {_PADDED} if requested else {_ONE_AXIS}
  options = [[()] if shape is None else [
      s for s in _shardings_of(shape, mesh)
      if _placement_class(s, shape, mesh) in {None, *classes}]
             for shape in shapes]
  longest = max(map(len, options), default=1)
  return [tuple(o[k % len(o)] for o in options)
          for k in range(1, longest + (longest > 1 and requested))]


def _sharding_combinations(options: list[list], bound: int) -> list[tuple]:
  """At most ``bound`` combinations of the per-operand ``options`` (each
  replicated first): all if they fit; else all replicated, each operand
  sharded alone (round-robin), "diagonals" (operand i takes its k-th
  option, for every k), then the rest in ``itertools.product`` order."""
  if math.prod(map(len, options)) <= bound:
    return list(itertools.product(*options))
  replicated = [o[0] for o in options]
  ks = range(1, max(map(len, options)))
  chosen: dict[tuple, None] = {}
  for combination in itertools.chain(
      [replicated],
      (replicated[:i] + [o[k]] + replicated[i + 1:]
       for k in ks for i, o in enumerate(options) if k < len(o)),
      ([o[k % len(o)] for o in options] for k in ks),
      itertools.product(*options)):
    chosen.setdefault(tuple(combination), None)
    if len(chosen) == bound:
      break
  return list(chosen)


def _coverage(arg_names: list, hosts: list, meshes: list, offered: list,
              tried: list) -> dict:
  """The report's ``replicated_only``, ``placements`` and ``untried``."""
  replicated_only, untried = [], []
  for arg_name, h, offer, done in zip(arg_names, hosts, offered, tried):
    missed = [f"{c} ({_why_not(c, h.shape, meshes, c in offer)})"
              for c in _CLASSES if c not in done]
    if offer == {None}:
      replicated_only.append(f"{arg_name} (shape {h.shape})")
    elif missed:
      untried.append(f"on {arg_name} (shape {h.shape}): {', '.join(missed)}")
  return dict(
      replicated_only=tuple(replicated_only), untried=tuple(untried),
      placements=tuple(c for c in _CLASSES if any(c in t for t in tried)))


def _why_not(cls: str, shape: tuple, meshes: list, offered: bool) -> str:
  if offered:
    return "left out by max_combinations"
  axes = [_real_axes(mesh) for mesh in meshes]
  if not any(axes):
    return "no mesh has an axis of more than one device"
  if cls == _PADDED:
    if not _returns_padded() and any(
        n % m.shape[a] for m in meshes if not _any_explicit(m)
        for a in _real_axes(m) for n in shape):
      return ("jax 0.9 under Shardy cannot compile a program whose result "
              "is padded")
    explicit = [_any_explicit(m) for m, a in zip(meshes, axes) if a]
    if all(explicit):
      return "jax types no uneven sharding on Explicit mesh axes"
    if any(explicit):
      return ("jax types no uneven sharding on Explicit mesh axes, and every "
              "other mesh axis divides each of its dimensions")
    return "every mesh axis divides each of its dimensions"
  if cls == _ONE_AXIS:
    return "no mesh axis divides any of its dimensions"
  if cls == _SEVERAL and len(shape) < 2:
    return "it has fewer than two dimensions"
  if all(len(a) < 2 for a in axes):
    return "no mesh has two axes of more than one device"
  if cls == _SEVERAL:
    return "no mesh's axes each divide a different one of its dimensions"
  return "no mesh's axes together divide any of its dimensions"


def _mesh_text(mesh) -> str:
  axes = ", ".join(f"{name!r}: {size}" for name, size in mesh.shape.items())
  types_ = _axis_types(mesh)
  if any(t != jax.sharding.AxisType.Auto for t in types_ or ()):
    names = ", ".join(t.name for t in types_)
    axes += f", axis_types=({names}{',' * (len(types_) == 1)})"
  return f"Mesh({axes})"


def _specs_text(specs, arg_names: list, flat: bool) -> str:
  """``(PartitionSpec('x'), PartitionSpec())``; pytree leaves named."""
  if flat:
    return f"({', '.join(map(_spec_text, specs))}{',' * (len(specs) == 1)})"
  return "{" + ", ".join(f"{arg_name}: {_spec_text(spec)}" for arg_name, spec
                         in zip(arg_names, specs)) + "}"


def _renamed(error: Exception, where: str) -> Exception:
  """``error``'s type with ``where`` before its message (else ``error``
  itself, with ``where`` as a note, for a type that takes no message)."""
  try:
    return type(error)(f"{where}: {type(error).__name__}: {error}")
  except Exception:
    if hasattr(error, "add_note"):  # Python 3.11 added it
      error.add_note(where)
    return error


def _compare(got, want, rtol, atol, what: str) -> None:
  """Raises AssertionError (message after ``what``) unless ``got`` is ``want``
  within rtol/atol (None: by dtype) if finite, else exact (signed inf, NaN)."""
  got, want = np.asarray(got), np.asarray(want)
  if got.shape != want.shape or got.dtype != want.dtype:
    raise AssertionError(f"{what}: got {got.dtype}{list(got.shape)}, on one "
                         f"device {want.dtype}{list(want.shape)}")
  wide = np.complex128 if np.iscomplexobj(want) else np.float64
  g, w = got.astype(wide), want.astype(wide)
  tol = _default_tolerance(want.dtype)
  scale = float(np.max(np.abs(w[np.isfinite(w)]), initial=0.0))
  rtol = tol if rtol is None else rtol
  atol = tol * max(scale, 1.0) if atol is None else atol
  with np.errstate(invalid="ignore"):
    error = np.abs(g - w)
    same = (g == w) | (np.isnan(g) & np.isnan(w))
    bad = ~same & (~np.isfinite(w) | ~(error <= atol + rtol * np.abs(w)))
  if not bad.any():
    return
  error = np.where(same, 0.0, np.nan_to_num(error, nan=np.inf))
  at = np.unravel_index(int(np.argmax(np.where(bad, error, -1.0))), want.shape)
  got_at, want_at = (format(v, ".6g") if isinstance(v, (float, complex))
                     else str(v) for v in (got[at].item(), want[at].item()))
  raise AssertionError(
      f"{what}: largest error {float(np.max(error)):.3g} ({int(bad.sum())} "
      f"of {bad.size} elements off; at index {tuple(map(int, at))} got "
      f"{got_at}, expected {want_at}; rtol={rtol:.3g}, atol={atol:.3g})")


def _default_tolerance(dtype) -> float:
  """The default rtol (see check_partitioning's ``rtol``)."""
  if not jax.numpy.issubdtype(dtype, jax.numpy.inexact):
    return 0.0
  info = jax.numpy.finfo(dtype)  # of the parts, for a complex dtype
  if info.bits >= 32:
    return 1e-9 if info.bits >= 64 else 1e-4
  # Summed in another order, a float8 sum rounds otherwise: a correct psum
  # of random rows was off by up to 2 epsilon of the largest magnitude.
  return {"float16": 5e-3, "bfloat16": 3e-2}.get(np.dtype(dtype).name,
                                                  2 * float(info.eps))


@dataclasses.dataclass(frozen=True)
class PartitioningReport:
  """What ``check_partitioning`` checked; ``str()`` says it in sentences.

  Attributes:
    name: the checked function's name.
    checked: placements compiled, run and compared, over all meshes.
    meshes: ``(description, checked, total)`` per mesh, total before the bound.
    replicated_only: the example arguments (with shapes) no mesh shards.
    grad: whether gradients were compared too.
    max_combinations: the bound per mesh.
    placements: the classes besides replicated that some argument was checked
      in: ``"one dimension over one axis"``, ``"several dimensions over one
      axis each"``, ``"one dimension over a tuple of axes"``, ``"padded"``.
    untried: per argument with classes not checked, a sentence naming
      them and why (e.g. no mesh axis divides it, or the bound).
    cotangent_placements: with ``grad``, how many cotangent placements
      other than their results' were checked (operands replicated).
    result_requests: how many combinations were checked with each result
      requested in a sharding (a sharding constraint, as by a consumer).
    derived_rules: under Shardy, per op without a ``sharding_rule`` (a
      GSPMD-era op), ``(op name, rule text, what no probe could tie)`` for
      each rule derived from its ``infer_sharding_from_operands``.
  """
  name: str
  checked: int
  meshes: tuple
  replicated_only: tuple
  grad: bool
  max_combinations: int
  placements: tuple = ()
  untried: tuple = ()
  cotangent_placements: int = 0
  result_requests: int = 0
  derived_rules: tuple = ()

  def __str__(self) -> str:
    what = "results and gradients" if self.grad else "results"
    n, left, r = self.cotangent_placements, sum(
        total - k for _, k, total in self.meshes), self.result_requests
    per_mesh = "; ".join(f"{text}: {k} of {total}"
                         for text, k, total in self.meshes)
    return "".join(part for part in (
        f"check_partitioning({self.name}): {self.checked} combinations of "
        f"operand shardings checked, {what} equal to {self.name} on one "
        f"device ({per_mesh}). ",
        n and f"Cotangents also checked in {n} sharding{'s' * (n > 1)} "
        "other than their results' (the operands replicated). ",
        f"Placements checked: {', '.join(['replicated', *self.placements])}.",
        self.replicated_only and " No mesh axis divides "
        f"{', '.join(self.replicated_only)}: checked replicated only.",
        self.untried and f" Not tried {'; '.join(self.untried)}.",
        left and f" {left} combinations left unchecked (max_combinations="
        f"{self.max_combinations} per mesh): raise max_combinations, or pass "
        "meshes=, to check them.",
        r and f" Results also checked in {r} combination{'s' * (r > 1)} "
        "with their shardings requested (a sharding constraint on each, as "
        "a consumer's).", *(
            f" Op {op} has no sharding_rule: derived sharding_rule '{text}' "
            f"from its infer_sharding_from_operands{why and f' ({why})'}; "
            "pass it to def_partition to fix it."
            for op, text, why in self.derived_rules)) if part)


__all__ += ["check_partitioning", "PartitioningReport"]


# --------------------------------------------------------------------------
# III.3 The module's state
#
# All state this module keeps but the stores on its objects (per op, per
# lowered op), each beside its owner, the section in brackets (a copy
# without it has no such store). Caches are bounded ``_LRU``s, each with
# its own lock; a hit answers what a fresh computation would (a comment
# where each is filled says what its key holds).
#
#   store           maps                                  bound   cleared
#   op._traces      call signature -> traced fun          64/op   C, D  (I.1)
#   op._programs    call signature -> _Program            64/op   C, D  (II.3)
#   _eager          eager call -> jitted function         64      C     (I.1)
#   _derived        (body, tag, avals) -> derived body    64      C     (II.4)
#   _derived_rules  (infer, statics, shapes, mesh, config)
#                   -> rule derived from infer            256     C     (II.6)
#   _rules_seen     thread -> rules derived meanwhile     threads -     (II.6)
#   _Op.answers     partition request -> manual program (a dict of its
#                   lowering)                             1/op    -     (I.5)
#   _Op.answers     partition request -> XLA's answer     256/op  C     (II.7)
#   _decoded_placement (Shardy placement, rank, mesh)
#                   -> (PartitionSpec, HloSharding)       64      C     (I.5)
#   _pending        thread -> (op, error) of its compile  threads P, F  (II.7)
#   _registry       custom call key -> _Op                weak    -     (II.7)
#   _lowering_ops   lowering -> its ops by parameters     weak    -     (II.7)
#   _parked_errors  tag -> a callback's exception         64      C, R  (II.7)
#   _parked_counter the next tag                          -       -     (II.7)
#   _call_names     body -> name of its function          weak    -     (I.1)
#   _lapack_ready   jaxlib's LAPACK kernels registered    -       never (II.7)
#
# jax's configuration (the trace context its caches key on): op._traces
# keys on it, as every cache of an extra does; _eager's jax.jit functions
# key on it themselves and are built alike under any. An _Op's answers at
# lowering live in one lowering, which has one config.
# _registry's content keys hold it by value, its other keys name an op of
# one lowering, which has one (so do XLA's _Op.answers); _pending is no
# cache (II.7).
#
# C: ``jax.clear_caches()`` (seen at each ``_LRU``'s next use); D:
# ``def_partition``. The weak tables share ``_weak_lock``.
# P: popped by the thread's next partition callback; F: emptied when a
# compile ends; R: popped when the failed compile re-raises it. Lowerings
# and executables that may still call back keep their ``_registry`` entries
# alive; ``_pending`` shares ``_weak_lock`` (II.7).
# Not state: ``_DESCRIBED_BY``, filled at import (II.7).
# --------------------------------------------------------------------------

def _store_sizes(op=None) -> dict[str, int]:  # seam: used by (II.3, II.7)
  """Entries per store (III.3) (and ``op``'s own, if given), for tests."""
  sizes = {}
  for name in ("call_names", "registry", "eager", "derived", "parked_errors"):
    store = globals().get(f"_{name}")  # None: a copy without its section
    if store is not None:
      with _weak_lock:  # (the weak tables' lock; the others hold their own)
        sizes[name] = len(store)
  if op is not None:
    sizes.update(traces=len(op._traces), programs=len(op._programs))
  return sizes


# --------------------------------------------------------------------------
# III.4 Self-demo: python custom_partitioning.py
# --------------------------------------------------------------------------

def _batched_fft_op() -> custom_partitioning:
  """An FFT over the last axis that keeps the batch axes sharded: rows are
  independent, so each shard transforms its own rows, with no collective."""
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  @custom_partitioning
  def fft(x):
    return jnp.fft.fft(x)

  def infer(mesh, arg_shapes, result_shape):
    """The operand's batch sharding, with the last dimension replicated."""
    x = arg_shapes[0]
    spec = tuple(x.sharding.spec)[:len(x.shape) - 1]
    spec += (None,) * (len(x.shape) - len(spec))
    return NamedSharding(x.sharding.mesh, P(*spec))

  def partition(mesh, arg_shapes, result_shape):
    sharding = infer(mesh, arg_shapes, result_shape)
    return mesh, jnp.fft.fft, sharding, (sharding,)

  fft.def_partition(partition, infer_sharding_from_operands=infer,
                    sharding_rule="... i -> ... i")
  return fft


def _demo() -> None:
  """Batched FFT and gradient on row shards; exits non-zero if wrong."""
  import timeit

  import jax.numpy as jnp
  import jaxlib

  fft = _batched_fft_op()
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  real, imag = np.random.default_rng(0).standard_normal((2, 1024, 512))
  host = (real + 1j * imag).astype(np.complex64)
  # What ran decides what the lines below prove: say it first.
  if not _SHARDY.value:
    partitioner = "GSPMD (JAX_USE_SHARDY_PARTITIONER=1 for Shardy)"
  elif _JAX_VERSION < (0, 12, 1):
    partitioner = "Shardy (JAX_USE_SHARDY_PARTITIONER=0 for GSPMD)"
  else:
    partitioner = "Shardy (the only one since jax 0.12.1)"
  print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}; partitioner "
        f"{partitioner}")
  print(f"{len(jax.devices())} {jax.devices()[0].platform.upper()} devices, "
        f"input {host.shape} {host.dtype} sharded over rows")
  # The gradient is partitioned by the same callbacks: still no collective.
  # Parseval: the gradient of sum |fft(x)|^2 is 2 * n * x.
  grad = jax.grad(lambda x: jnp.sum(jnp.abs(fft(x.astype(jnp.complex64))) ** 2))
  spectrum = np.fft.fft(host)
  for label, fn, x, want, limit in (
      ("custom_partitioning fft", fft, host, spectrum, 1e-2),
      ("plain jit(jnp.fft.fft)", jnp.fft.fft, host, spectrum, 1e-2),
      ("jax.grad of |fft|^2", grad, host.real, 2 * 512 * host.real, 1e-1)):
    x = jax.device_put(x.copy(), rows)
    jitted = jax.jit(fn, in_shardings=rows, out_shardings=rows)
    error = float(np.max(np.abs(np.asarray(jitted(x)) - want)))
    hlo_text = jitted.lower(x).compile().as_text()
    found = ", ".join(c for c in ("all-gather", "all-to-all", "all-reduce",
                                  "collective-permute") if c in hlo_text)
    ms = timeit.timeit("f(x).block_until_ready()", number=10,
                       globals={"f": jitted, "x": x}) * 100
    print(f"{label:26} max error vs {'2*n*x' if fn is grad else 'numpy'} "
          f"{error:.2e}; collectives: {found or 'none'}; {ms:.2f} ms per call")
    if error > limit:
      raise SystemExit(f"{label}: wrong result")
    if found and fn is not jnp.fft.fft:
      raise SystemExit(f"{label}: should need no collectives")
  print("OK: the custom fft and its gradient are right and ran on the row "
        "shards with no gather")


if __name__ == "__main__":
  _demo()
