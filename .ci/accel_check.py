#!/usr/bin/env python3
"""Accelerator check of custom_partitioning.py: TPU and GPU, without chips.

Compiles each program below for compile-only targets, which jax builds on
any machine from the platform's compiler (no chip needed):
- TPU (libtpu installed): v5e 2x2, v5e 2x4, v5e 4x4 over 4 hosts, and 2
  slices of v5e 2x4 (XLA's TPU compiler, which never calls a Python
  partitioner);
- GPU (jax's CUDA plugin and pjrt wheels installed): 8 H200s on one host
  and 2 hosts of 4 (XLA:GPU, whose plugin calls a Python partitioner back).
On each: Auto axes, Explicit axes with and without ``jax.set_mesh``, under
Shardy (the op partitioned at lowering), and on GPU under GSPMD too, through
the plugin's callbacks, where the release has GSPMD (before jax 0.12.1).
For each program it checks that ``partition`` was asked with the expected
placement and its ``lower_fn`` traced at the per-shard shapes that placement
gives, that no custom call is left where the op is partitioned at lowering,
and that the compiled program's collectives equal those of ``jax.shard_map``
of the same per-shard code, compiled for the same target. A Pallas kernel is
per-shard code on each platform whose Pallas lowers it without a device
(Mosaic for TPU; Triton for GPU from jax 0.12.1: 0.10.2 cannot lower it
for a compile-only GPU, jax.shard_map alike, which the check confirms).

Where a TPU is attached (``--chip``; the default when JAX_PLATFORMS is
unset and the machine has TPU device files), each program also runs on one
chip against numpy, and the Pallas op on a named axis of a one-device mesh.

    JAX_PLATFORMS=cpu python .ci/accel_check.py [DIR] [--targets tpu,gpu]

Without JAX_PLATFORMS it sets ``cpu`` itself (unless it runs on the chip).
With DIR, the ``custom_partitioning.py`` there is checked (the minimal copy,
``.ci/sections.py --write core DIR``), on the programs its core runs (no
rule-only ops, no vmap, jvp or grad), under Shardy only (it keeps no XLA
callbacks). Prints a table and ``accel_check: N failures``; exits 1 on any.
Exits 0, saying why, where neither libtpu nor a CUDA plugin is installed.
Also exports a program holding an op for ("cpu", platform) at once (one
artifact for both) and compiles it for the target. Past runs are kept,
dated, in .ci/RESULTS.md.
"""
import argparse
import glob
import importlib.util
import os
import re
import sys
import time

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("dir", nargs="?", default=None,
                help="directory of the custom_partitioning.py to check "
                     "(the minimal copy)")
ap.add_argument("--targets", default="tpu,gpu",
                help="platforms to compile for, of those installed")
ap.add_argument("--chip", action="store_true",
                help="also run each program on the attached TPU chip")
ARGS = ap.parse_args()
HAVE_TPU = importlib.util.find_spec("libtpu") is not None
CUDA = next((m for m in ("xla_cuda13", "xla_cuda12")
             if importlib.util.find_spec("jax_plugins") is not None
             and importlib.util.find_spec("jax_plugins." + m) is not None),
            None)
# A TPU VM exposes its chips as /dev/accel* (v4) or /dev/vfio/N (v5e on);
# other machines may have vfio devices too, but not libtpu beside them.
CHIP = ARGS.chip or ("JAX_PLATFORMS" not in os.environ and HAVE_TPU and bool(
    glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*")))
# libtpu's warnings about its environment, GSPMD's deprecation: one a compile.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if not CHIP:
  # A compile-only target needs no backend of its platform; without this,
  # an installed CUDA plugin would look for a GPU.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
WANT = set(ARGS.targets.split(","))
if not ((HAVE_TPU and "tpu" in WANT) or (CUDA and "gpu" in WANT) or CHIP):
  print("accel_check: skipped (neither libtpu nor jax's CUDA plugin is "
        "installed: no TPU or GPU compiler to target)")
  sys.exit(0)

MODULE_DIR = ARGS.dir or os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, MODULE_DIR)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P
import numpy as np  # noqa: E402

# The chip's default matmul precision (bf16 passes) is not numpy's.
jax.config.update("jax_default_matmul_precision", "highest")

import targets  # noqa: E402 - .ci/targets.py, beside this script

import custom_partitioning as cp_module  # noqa: E402
from custom_partitioning import custom_partitioning  # noqa: E402

MINIMAL = ARGS.dir is not None
# jax 0.12.1 removed GSPMD; a copy without II.7 has no XLA callbacks.
with open(cp_module.__file__) as _fh:
  HAS_CALLBACKS = "\n# II.7 " in _fh.read()
HAS_GSPMD = jax.__version_info__ < (0, 12, 1)
# Pallas lowers for a compile-only GPU (Triton) from jax 0.12.1; on 0.10.2
# it raises "Cannot lower pallas_call on platform: gpu" (jaxlib's Triton
# lowering needs a GPU jaxlib), jax.shard_map alike: there a failing twin is
# reported as n/a, elsewhere it fails the check. 0.12.0.1's CUDA 12 plugin
# was not tried (CI's GPU cells are 0.10.2 and 0.12.1).
PALLAS_GPU = jax.__version_info__ >= (0, 12, 1)

AUTO = (jax.sharding.AxisType.Auto,)
EXPLICIT = (jax.sharding.AxisType.Explicit,)
asked = []  # the placements partition was asked with, per call
traced = []  # the shapes each lower_fn was traced at, per trace
shape_errors = []  # a lower_fn traced at shapes its placement does not give


def spec_of(sharding, ndim):
  """A sharding's spec as a tuple of ndim entries (None where replicated),
  or None where it has no PartitionSpec."""
  spec = getattr(sharding, "spec", None)
  if spec is None:
    return None
  return tuple(spec) + (None,) * (ndim - len(spec))


def shard_shape(sharding, shape):
  """The per-shard shape a placement gives (jax pads uneven shards up)."""
  spec = spec_of(sharding, len(shape))
  if spec is None:
    return None
  out = []
  for d, s in zip(shape, spec):
    n = 1
    for a in (() if s is None else s if isinstance(s, tuple) else (s,)):
      n *= sharding.mesh.shape[a]
    out.append(-(-d // n))
  return tuple(out)


def checked(part):
  """partition, recording what it is asked, and its lower_fn, checking the
  shapes it is traced at against those the returned placements give."""
  def wrapped(mesh, arg_shapes, result_shape):
    asked.append(tuple(spec_of(a.sharding, len(a.shape)) for a in arg_shapes))
    m, lower, out_s, arg_s = part(mesh, arg_shapes, result_shape)
    results = (result_shape if isinstance(result_shape, (list, tuple))
               else (result_shape,))
    outs = out_s if isinstance(out_s, (list, tuple)) else (out_s,)
    want_in = [shard_shape(s, a.shape) for s, a in zip(arg_s, arg_shapes)]
    want_out = [shard_shape(s, r.shape) for s, r in zip(outs, results)]

    def lower_checked(*xs):
      got = [tuple(x.shape) for x in xs]
      traced.append(got)
      if got != want_in:
        shape_errors.append(f"lower_fn traced at {got}, placement gives "
                            f"{want_in}")
      ys = lower(*xs)
      got_out = [tuple(y.shape) for y in jax.tree.leaves(ys)]
      if got_out != want_out:
        shape_errors.append(f"lower_fn returned {got_out}, placement gives "
                            f"{want_out}")
      return ys
    return m, lower_checked, out_s, arg_s
  return wrapped


def rows_op(body):  # a row-wise op with partition + infer + rule
  op = custom_partitioning(body)

  def part(mesh, arg_shapes, result_shape):
    s = NamedSharding(mesh, P(arg_shapes[0].sharding.spec[0]))
    return mesh, body, s, (s,)

  def infer(mesh, arg_shapes, result_shape):
    return NamedSharding(mesh, P(arg_shapes[0].sharding.spec[0]))
  op.def_partition(checked(part), infer_sharding_from_operands=infer,
                   sharding_rule="i j -> i j")
  return op


def double_body(x):
  return x * 2 + 1


fft = rows_op(jnp.fft.fft)
# One op per program: the module answers an op asked again with the same
# placement from its cache, and each program must see partition asked.
double, double_uneven, double_vmap, double_grad = (
    rows_op(double_body) for _ in range(4))

rule_only = custom_partitioning(lambda x: jnp.tanh(x))
rule_only.def_partition(sharding_rule="i j -> i j")


@custom_partitioning
def gspmd_era(x):  # no rule: derived from infer
  return jnp.cos(x)


def _ge_part(mesh, arg_shapes, result_shape):
  s = NamedSharding(mesh, P(arg_shapes[0].sharding.spec[0]))
  return mesh, jnp.cos, s, (s,)


gspmd_era.def_partition(checked(_ge_part),
                        infer_sharding_from_operands=lambda m, a, r:
                        NamedSharding(m, P(a[0].sharding.spec[0])))


def matmul_local(x, w):
  return jax.lax.psum(x @ w, "y")


@custom_partitioning
def matmul(x, w):
  return x @ w


def _mm_part(mesh, arg_shapes, result_shape):
  rows = arg_shapes[0].sharding.spec[0]
  k = arg_shapes[0].sharding.spec[1] if len(arg_shapes[0].sharding.spec) > 1 \
      else None

  def lower(x, w):
    y = x @ w
    return jax.lax.psum(y, k) if k else y
  return (mesh, lower, NamedSharding(mesh, P(rows, None)),
          (NamedSharding(mesh, P(rows, k)), NamedSharding(mesh, P(k, None))))


matmul.def_partition(checked(_mm_part), sharding_rule="i k, k j -> i j",
                     reduction_factors=("k",))


@jax.custom_vjp
def clip_grad(v):  # a backward rule not linear in its cotangent
  return v


clip_grad.defvjp(lambda v: (v, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))


def clipped_local(x, w):
  return clip_grad(jax.lax.psum(x @ w, "y"))


@custom_partitioning
def clipped_matmul(x, w):
  return clip_grad(x @ w)


clipped_matmul.def_partition(
    checked(lambda mesh, a, r: (
        mesh, clipped_local, NamedSharding(mesh, P("x", None)),
        (NamedSharding(mesh, P("x", "y")),
         NamedSharding(mesh, P("y", None))))),
    sharding_rule="i k, k j -> i j")


def _clipped_loss(f):
  return jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w)) * 100.0))


def two_body(x):
  return x + 1, jnp.sum(x, axis=1)


two = custom_partitioning(two_body)  # two results
two.def_partition(sharding_rule="i j -> i j, i")


def cumsum0(x):
  return jnp.cumsum(x, axis=0)


asks_replicated = custom_partitioning(cumsum0)


def _ar_part(mesh, arg_shapes, result_shape):
  s = NamedSharding(mesh, P())
  return mesh, cumsum0, s, (s,)


asks_replicated.def_partition(checked(_ar_part), sharding_rule="i j -> i j")


def scaled(x, k):
  return x * k


scaled_op = custom_partitioning(scaled, static_argnums=(1,))
scaled_op.def_partition(sharding_rule="i j -> i j")


def pallas_double(x):
  from jax.experimental import pallas as pl

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape,
                                                                x.dtype))(x)


pallas_op = custom_partitioning(pallas_double)


def _pl_part(mesh, arg_shapes, result_shape):
  s = NamedSharding(mesh, P(arg_shapes[0].sharding.spec[0]))
  return mesh, pallas_double, s, (s,)


pallas_op.def_partition(checked(_pl_part), sharding_rule="i j -> i j")


def need_replication_op(body, rule):
  """An op whose rule says its operand's last dimension needs replication;
  partition hands back what it is given, refusing to be asked with that
  dimension (or a result's) sharded: a kernel the module's check cannot
  see would compute on half of each row (issues 64, 65)."""
  op = custom_partitioning(body)

  def part(mesh, arg_shapes, result_shape):
    given = [arg_shapes[0].sharding, result_shape.sharding]
    specs = [spec_of(s, 2) for s in given]
    if any(spec[1] is not None for spec, v in zip(
        specs, (arg_shapes[0], result_shape)) if len(v.shape) == 2):
      raise AssertionError(f"partition asked with {specs}: the rule's "
                           "need-replication dimension sharded")
    return mesh, body, given[1], (given[0],)
  op.def_partition(checked(part), sharding_rule=rule,
                   need_replication_factors=(rule.split()[1],))
  return op


def row_sums_body(x):
  return jnp.sum(x, axis=1)


def doubled_body(x):
  return x * 2.0


row_sums = need_replication_op(row_sums_body, "i k -> i")
doubled_rows = need_replication_op(doubled_body, "i j -> i j")


def scan_cond_of(on_true, on_false):
  def run(x):
    def body(c, _):
      return jax.lax.cond(jnp.sum(c) > 0, on_true, on_false, c), None
    return jax.lax.scan(body, x, None, length=2)[0]
  return run


# Twins: jax.shard_map of the same per-shard code, a function of the mesh.
# On Explicit axes shard_map takes its operands as placed: each is resharded
# to its in_spec first, as the op's program reshards them for partition.
ROW = P("x")


def sm(f, ins=ROW, outs=ROW, check_vma=False):
  def twin(mesh):
    mapped = jax.shard_map(f, mesh=mesh, in_specs=ins, out_specs=outs,
                           check_vma=check_vma)
    if EXPLICIT[0] not in mesh.axis_types:
      return mapped
    specs = ins if isinstance(ins, tuple) else (ins,)
    return lambda *xs: mapped(*[jax.sharding.reshard(
        x, NamedSharding(mesh, s)) for x, s in zip(xs, specs)])
  return twin


def _two_twin(mesh):
  t = sm(two_body, outs=(P("x"), P("x")))(mesh)
  return lambda x: t(x)[0] + t(x)[1][:, None]


ROWS = (("x", None),)  # partition asked with rows sharded on x
MM = (("x", "y"), ("y", None))

# name: (program, numpy reference, shapes, dtype, twin, asked with)
# twin: mesh -> jax.shard_map program of the same per-shard code (None:
# none can be written, said in a comment); asked with: the placements of
# partition's arguments expected in every call (None: the op has no
# partition, its rule decides).
CASES = {
    "partition op (fft)": (fft, lambda x: np.fft.fft(x), [(64, 128)],
                           np.complex64, sm(jnp.fft.fft), ROWS),
    "rule-only op": (rule_only, np.tanh, [(64, 128)], np.float32,
                     sm(jnp.tanh), None),
    "GSPMD-era op": (gspmd_era, np.cos, [(64, 128)], np.float32, sm(jnp.cos),
                     ROWS),
    "two results": (lambda x: two(x)[0] + two(x)[1][:, None],
                    lambda x: x + 1 + x.sum(1)[:, None], [(64, 128)],
                    np.float32, _two_twin, None),
    "asks other shardings": (asks_replicated, lambda x: np.cumsum(x, 0),
                             [(64, 128)], np.float32,
                             sm(cumsum0, P(), P()), ROWS),
    "static argument": (lambda x: scaled_op(x, 3.0), lambda x: x * 3,
                        [(64, 128)], np.float32, sm(lambda x: x * 3.0), None),
    # jax.shard_map cannot split 60 rows 8 ways: the twin pads them to a
    # multiple of the devices and slices the result, as the module does.
    "uneven (60 rows)": (
        lambda x: double_uneven(x[:60]), lambda x: x[:60] * 2 + 1,
        [(64, 128)], np.float32,
        lambda mesh: lambda x: sm(double_body)(mesh)(jnp.pad(
            x[:60], ((0, -60 % mesh.shape["x"]), (0, 0))))[:60], ROWS),
    "several ops, scan, cond": (
        scan_cond_of(double, rule_only), None, [(64, 128)], np.float32,
        lambda mesh: scan_cond_of(sm(double_body)(mesh), sm(jnp.tanh)(mesh)),
        ROWS),
    # partition is asked for one element of the batch; lower_fn is vmapped.
    "vmap": (jax.vmap(double_vmap), lambda x: x * 2 + 1, [(8, 64, 128)],
             np.float32, sm(jax.vmap(double_body), P(None, "x"),
                            P(None, "x")), ROWS),
    "grad": (jax.grad(lambda x: jnp.sum(jnp.sin(double_grad(x)))),
             lambda x: 2 * np.cos(2 * x + 1), [(64, 128)], np.float32,
             lambda mesh: jax.grad(lambda x: jnp.sum(jnp.sin(
                 sm(double_body)(mesh)(x)))), ROWS),
    "jvp": (lambda x: jax.jvp(rule_only, (x,), (x,))[1],
            lambda x: x / np.cosh(x) ** 2, [(64, 128)], np.float32,
            lambda mesh: lambda x: jax.jvp(sm(jnp.tanh)(mesh), (x,), (x,))[1],
            None),
    "2-D mesh matmul (psum)": (
        matmul, lambda x, w: x @ w, [(64, 128), (128, 128)], np.float32,
        sm(matmul_local, (P("x", "y"), P("y", None)), P("x", None)), MM),
    "2-D grad, clip after psum": (
        _clipped_loss(clipped_matmul),
        _clipped_loss(lambda x, w: clip_grad(x @ w)),
        [(64, 128), (128, 128)], np.float32,
        # check_vma: psum's transpose is then no collective (w's gradient
        # is not asked for), as the module transposes the op.
        lambda mesh: _clipped_loss(sm(clipped_local, (
            P("x", "y"), P("y", None)), P("x", None), True)(mesh)), MM),
    "2-D need_replication (k sharded)": (
        row_sums, lambda x: x.sum(1), [(64, 128)], np.float32,
        sm(row_sums_body, P("x", None), P("x")), ROWS),
    "2-D need_replication result": (
        doubled_rows, lambda x: x * 2, [(64, 128)], np.float32,
        sm(doubled_body, P("x", None), P("x", None)), ROWS),
    "Pallas kernel as lower_fn": (pallas_op, lambda x: x * 2, [(64, 128)],
                                  np.float32, sm(pallas_double), ROWS),
}


# What the minimal copy lacks: rule-only ops (II.5), derived ops (II.4).
EXTRAS = {"rule-only op", "two results", "static argument",
          "several ops, scan, cond", "vmap", "grad", "jvp",
          "2-D grad, clip after psum"}
if MINIMAL:
  CASES = {k: v for k, v in CASES.items() if k not in EXTRAS}

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute",
               "reduce-scatter")


def collectives(text):
  return {c: n for c in COLLECTIVES
          for n in [len(re.findall(rf"\b{c}(-start)?\(", text))] if n}


def fmt_coll(c):
  return "+".join(f"{n} {k}" for k, n in sorted(c.items())) or "0"


def topology(name):
  return targets.devices(name)


class _null:
  def __enter__(self):
    return None

  def __exit__(self, *_):
    return False


class NotLowered(Exception):
  """Pallas that this release cannot lower for the target (twin alike)."""


def compile_case(name, devices, platform, axis_types, set_mesh, shardy,
                 known=None):
  """Compiles one program and its twin; returns the cell's text. Raises on
  a failed check."""
  fn, _, shapes, dtype, twin, asks = CASES[name]
  n = len(devices)
  two_d = name.startswith("2-D")
  mesh = jax.sharding.Mesh(
      np.array(devices).reshape((n // 2, 2) if two_d else (n,)),
      ("x", "y") if two_d else ("x",), axis_types=axis_types * (2 if two_d
                                                                else 1))
  specs = [P("x", "y"), P("y", None)] if two_d else [
      P(*([None] * (len(shapes[0]) - 2)), "x", None)]
  args = [jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(mesh, sp))
          for s, sp in zip(shapes, specs)]
  pallas = name.startswith("Pallas")
  with jax.set_mesh(mesh) if set_mesh else _null():
    want = None
    if twin is not None:
      try:
        want = collectives(jax.jit(twin(mesh)).lower(*args).compile()
                           .as_text())
      except Exception as e:
        if pallas and platform == "gpu" and not PALLAS_GPU:
          raise NotLowered(f"{type(e).__name__}: "
                           f"{str(e).splitlines()[0][:120]}") from None
        raise AssertionError(f"the shard_map twin fails: {type(e).__name__}"
                             f": {str(e).splitlines()[0][:200]}") from e
    del asked[:], traced[:], shape_errors[:]
    lowered = jax.jit(fn).lower(*args)
    if shardy:  # partitioned at lowering: XLA is left nothing to call back
      assert "CustomSPMDPartitioning" not in lowered.as_text(), "custom " \
          "call left in the lowered module"
    compiled = lowered.compile().as_text()
  notes = []
  assert "CustomSPMDPartitioning" not in compiled, "custom call compiled"
  if asks is not None:
    assert asked, "partition never asked"
    wrong = sorted({str(a) for a in asked if a != asks})
    assert not wrong, f"partition asked with {wrong}, not {asks}"
    assert traced, "lower_fn never traced"
    assert not shape_errors, shape_errors[0]
    notes.append(f"asked {len(asked)}x")
  got = collectives(compiled)
  if want is not None and known is not None and got == known[0]:
    notes.append(f"{fmt_coll(got)} (known: shard_map {fmt_coll(want)})")
  elif want is not None:
    assert got == want, f"collectives {fmt_coll(got)}, shard_map's " \
        f"{fmt_coll(want)}"
    notes.append(f"{fmt_coll(got)} = shard_map")
  else:
    notes.append(f"{fmt_coll(got)} collectives")
  return ", ".join(notes)


# Known deviations from the twin, each its exact counts (a change either
# way is seen): (program, partitioner, mode) -> (collectives, why).
KNOWN = {
    ("2-D grad, clip after psum", "GSPMD", mode): (
        {"all-gather": 1, "all-reduce": 1, "reduce-scatter": 1},
        "under GSPMD (XLA's callbacks) the derived backward op is placed by "
        "XLA with its cotangent sharded over y: it gathers it and psums "
        "the transposed psum (values right; at lowering and on the "
        "shard_map path it is shard_map's one all-reduce)")
    for mode in ("Auto", "Explicit, no set_mesh")}

MODES = [("Auto", AUTO, False), ("Explicit", EXPLICIT, True),
         ("Explicit, no set_mesh", EXPLICIT, False)]


def set_shardy(on):
  jax.config.update("jax_use_shardy_partitioner", on)
  jax.clear_caches()


def check_targets():
  """Compiles every program for every installed target; returns (rows,
  failures), rows: name -> {target: [cell text]}."""
  rows = {name: {} for name in CASES}
  failures = []
  for tname, (platform, _, want) in targets.TARGETS.items():
    if platform not in WANT or not (HAVE_TPU if platform == "tpu" else CUDA):
      continue
    t0 = time.perf_counter()
    try:
      devices = topology(tname)
    except Exception as e:  # noqa: BLE001 - reported
      failures.append(f"{tname}: no topology: {type(e).__name__}: {e}")
      continue
    partitioners = [("Shardy", True)]
    if platform == "gpu" and HAS_GSPMD and HAS_CALLBACKS:
      partitioners.append(("GSPMD", False))
    n_cells = 0
    for pname, shardy in partitioners:
      set_shardy(shardy)
      try:
        for name in CASES:
          for label, types, setm in MODES:
            if name.startswith("uneven") and types == EXPLICIT:
              continue  # jax refuses uneven shardings on Explicit axes
            where = f"{tname}, {pname}, {label}"
            n_cells += 1
            try:
              note = compile_case(name, devices, platform, types, setm,
                                  shardy, KNOWN.get((name, pname, label)))
              rows[name].setdefault(tname, []).append(("ok", where, note))
            except NotLowered as e:
              rows[name].setdefault(tname, []).append(("n/a", where, str(e)))
            except Exception as e:  # noqa: BLE001 - reported in the table
              msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}" \
                  if str(e) else type(e).__name__
              rows[name].setdefault(tname, []).append(("FAIL", where, msg))
              failures.append(f"{name} [{where}]: {msg}")
              print(f"FAIL {name} [{where}]: {msg}", flush=True)
      finally:
        set_shardy(True)
    print(f"{tname} ({want[0]} devices, {want[1]} host(s), {want[2]} "
          f"slice(s); {', '.join(p for p, _ in partitioners)}): {n_cells} "
          f"compiles and twins in {time.perf_counter() - t0:.1f} s",
          flush=True)
  return rows, failures


def tpu_gspmd_named():
  """Under GSPMD, lowering an op for TPU raises naming Shardy."""
  if not (HAVE_TPU and "tpu" in WANT and HAS_GSPMD):
    return None
  try:
    devices = topology("v5e 2x4")
  except Exception as e:  # noqa: BLE001 - reported
    return f"FAIL: no topology: {type(e).__name__}: {e}"
  set_shardy(False)
  try:
    mesh = jax.sharding.Mesh(np.array(devices), ("x",), axis_types=AUTO)
    arg = jax.ShapeDtypeStruct((64, 128), np.float32,
                               sharding=NamedSharding(mesh, P("x")))
    try:
      jax.jit(double).lower(arg).compile()
      return "FAIL: GSPMD compiled an op for TPU (libtpu cannot call back)"
    except NotImplementedError as e:
      return ("ok: refused, naming Shardy" if "shardy" in str(e).lower()
              else f"FAIL: {e}")
    except Exception as e:  # noqa: BLE001
      return f"FAIL: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
  finally:
    set_shardy(True)


def multi_platform_export():
  """One artifact for CPU and an accelerator (issue 71): a program holding
  an op, exported for ("cpu", platform), holds no custom call and compiles
  for the target; the test suite runs such artifacts on CPU. A list of
  (target, result) lines."""
  import jax.export
  out = []
  for plat, target, name in (("tpu", "v5e 2x4", "tpu"),
                             ("gpu", "8 H200s", "cuda")):
    if plat not in WANT or (HAVE_TPU if plat == "tpu" else CUDA) in (
        None, False):
      continue
    try:
      mesh = jax.sharding.Mesh(np.array(topology(target)), ("x",),
                               axis_types=AUTO)
      arg = jax.ShapeDtypeStruct((64, 128), np.float32,
                                 sharding=NamedSharding(mesh, P("x")))
      op = rows_op(double_body)
      exported = jax.export.export(jax.jit(lambda x, op=op: op(x) + 1),
                                   platforms=("cpu", name))(arg)
      assert exported.platforms == ("cpu", name), exported.platforms
      assert "CustomSPMDPartitioning" not in exported.mlir_module()
      hlo = jax.jit(exported.call).trace(arg).lower().compile().as_text()
      assert "CustomSPMDPartitioning" not in hlo, "custom call compiled"
      assert not collectives(hlo), f"collectives {fmt_coll(collectives(hlo))}"
      out.append((target, "ok: exported for cpu and " + name +
                  ", compiled, no custom call, no collective"))
    except Exception as e:  # noqa: BLE001 - reported
      out.append((target, f"FAIL: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200] if str(e) else ''}"))
  return out


def main():
  print(f"accel_check: jax {jax.__version__}, "
        f"{'the minimal copy in ' + MODULE_DIR if MINIMAL else 'whole file'}"
        f" ({cp_module.__version__}); TPU: "
        f"{'libtpu' if HAVE_TPU else 'not installed'}; GPU: "
        f"{CUDA or 'no CUDA plugin'}; GSPMD: "
        f"{'yes' if HAS_GSPMD and HAS_CALLBACKS else 'no'}", flush=True)
  t0 = time.perf_counter()
  rows, failures = check_targets()
  gspmd = tpu_gspmd_named()
  if gspmd is not None and gspmd.startswith("FAIL"):
    failures.append("TPU under GSPMD: " + gspmd)
  exports = multi_platform_export()
  failures += [f"multi-platform export [{t}]: {r}" for t, r in exports
               if r.startswith("FAIL")]
  chip_rows = {}
  if CHIP:
    chip_rows, chip_failures = run_on_chip()
    failures += chip_failures
  names = [t for t in targets.TARGETS if any(t in r for r in rows.values())]
  print()
  print("| program | " + " | ".join(names) + " | partition asked | "
        "collectives (= shard_map's) |" + (" one chip |" if CHIP else ""))
  print("|---" * (len(names) + 3 + bool(CHIP)) + "|")
  for name, per in rows.items():
    cells = []
    for t in names:
      got = per.get(t, [])
      ok = sum(s == "ok" for s, *_ in got)
      na = sum(s == "n/a" for s, *_ in got)
      known = sum("known:" in n for s, _, n in got if s == "ok")
      cells.append(f"{ok} of {len(got)}" + (f" ({na} n/a)" if na else "")
                   + (f" ({known} known)" if known else ""))
    notes = [n for s, _, n in sum(per.values(), []) if s == "ok"]
    asks = sorted({m.group(1) for n in notes
                   for m in [re.search(r"asked (\d+)x", n)] if m}, key=int)
    coll = sorted({m.group(1).strip() for n in notes
                   for m in [re.search(r"([^,]*) = shard_map", n)] if m})
    line = (f"| {name} | " + " | ".join(cells) + f" | "
            f"{', '.join(a + 'x' for a in asks) or '-'} | "
            f"{', '.join(coll) or '-'} |")
    if CHIP:
      line += f" {chip_rows.get(name, '-')} |"
    print(line)
  na = sorted({f"{w}: {n}" for per in rows.values() for cells in
               per.values() for s, w, n in cells if s == "n/a"})
  if na:
    print(f"n/a (jax {jax.__version__} cannot lower it for the target, "
          "jax.shard_map alike): " + "; ".join(na[:1]) +
          (f" (and {len(na) - 1} more cells)" if len(na) > 1 else ""))
  known = sorted({f"{name} [{w.split(', ', 1)[1]}]: {n}; {KNOWN[k][1]}"
                  for name, per in rows.items() for cells in per.values()
                  for s, w, n in cells if "known:" in n
                  for k in [(name, *w.split(", ", 2)[1:])]})
  for k in known:
    print("known deviation: " + k)
  if gspmd is not None:
    print(f"TPU under GSPMD: {gspmd}")
  for t, r in exports:
    print(f"multi-platform export [{t}]: {r}")
  for f in failures:
    if not f.startswith(tuple(CASES)):  # those are printed as they fail
      print("FAIL " + f)
  print(f"accel_check: {len(failures)} failures "
        f"({time.perf_counter() - t0:.0f} s)")
  return 1 if failures else 0


def run_on_chip():
  """Each program on one attached TPU chip against numpy; the Pallas op on
  a named axis of a one-device mesh; eager and compile times."""
  out, failures = {}, []
  try:
    chip = jax.devices("tpu")[:1]
  except RuntimeError as e:
    return {}, [f"no TPU chip attached: {e}"]
  rng = np.random.default_rng(0)
  for name, (fn, ref, shapes, dtype, *_) in CASES.items():
    try:
      xs = [rng.standard_normal(s).astype(dtype) for s in shapes]
      mesh = jax.sharding.Mesh(np.array(chip), ("x",), axis_types=AUTO)
      got = jax.jit(fn)(*[jax.device_put(x, NamedSharding(mesh, P()))
                          for x in xs])
      if ref is not None:
        np.testing.assert_allclose(np.asarray(got), ref(*xs), rtol=2e-2,
                                   atol=2e-2)
      out[name] = "right" if ref is not None else "ran"
    except Exception as e:  # noqa: BLE001
      out[name] = "FAIL"
      failures.append(f"{name} on the chip: {type(e).__name__}: "
                      f"{str(e)[:200]}")
  one = one_device_named_axis(chip)
  print(one)
  if "FAIL" in one:
    failures.append(one)
  print(bench(chip))
  return out, failures


def one_device_named_axis(chip):
  """The Pallas op on P("b", None) of a one-device mesh: the op is its body
  there, which pallas_call refuses to type on a named axis (Explicit)."""
  x = np.random.default_rng(1).standard_normal((64, 128)).astype(np.float32)
  cells = []
  for label, types, setm in (("Explicit", EXPLICIT, True),
                             ("Explicit, no set_mesh", EXPLICIT, False),
                             ("Auto", AUTO, False)):
    mesh = jax.sharding.Mesh(np.array(chip), ("b",), axis_types=types)
    try:
      with jax.set_mesh(mesh) if setm else _null():
        arg = jax.device_put(x, NamedSharding(mesh, P("b", None)))
        for out in (jax.jit(pallas_op)(arg), pallas_op(arg)):
          np.testing.assert_allclose(np.asarray(out), x * 2)
      cells.append(f"{label}: right")
    except Exception as e:  # noqa: BLE001 - reported in the line
      cells.append(f"{label}: FAIL {type(e).__name__}: "
                   f"{str(e).splitlines()[0][:200]}")
  return ("Pallas kernel as lower_fn, one-device mesh, P('b', None) (jit "
          "and eager): " + "; ".join(cells))


def bench(chip):
  x = np.ones((8, 128), np.float32)
  on_chip = jax.device_put(x, chip[0])
  f = double  # partition, infer and rule: in every copy
  g = jax.jit(double_body)
  for fn in (f, g):
    fn(on_chip).block_until_ready()

  def per_call(fn):
    times = []
    for _ in range(9):
      t = time.perf_counter()
      for _ in range(300):
        fn(on_chip)
      jax.block_until_ready(fn(on_chip))
      times.append((time.perf_counter() - t) / 301 * 1e6)
    return sorted(times)[4]
  jf = jax.jit(f)
  us = {"op": [], "jit": [], "jit(op)": []}
  for _ in range(3):  # interleaved
    for label, fn in (("op", f), ("jit", g), ("jit(op)", jf)):
      us[label].append(per_call(fn))
  op_us, jit_us, jop_us = (sorted(us[k])[1] for k in ("op", "jit", "jit(op)"))
  return (f"eager (8, 128) f32 on the chip: op {op_us:.0f} us, jit "
          f"{jit_us:.0f} us ({op_us / jit_us:.2f}x), jit(op) {jop_us:.0f} us")


if __name__ == "__main__":
  sys.exit(main())
