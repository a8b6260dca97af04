#!/usr/bin/env python3
"""TPU check of custom_partitioning.py (run on a machine with a TPU).

Compiles each program for compile-only v5e:2x2 and v5e:2x4 topologies
under Shardy (XLA's TPU compiler, which never calls a Python partitioner),
checks that ``partition`` was asked, that the lowered module holds no custom
call and that the compiled program has no more collectives than
``jax.shard_map`` of the same per-shard code; then runs each on the
attached chip against numpy, and the Pallas op on a named axis of a
one-device mesh (Explicit, with and without set_mesh; Auto). Prints a
table. Exits 0, printing "skipped", where jax has no TPU backend.

    python .ci/tpu_check.py [DIR]

With DIR, the ``custom_partitioning.py`` there is checked (the minimal
copy, ``.ci/sections.py --write core DIR``), on the programs its core
runs (no rule-only ops, no vmap, jvp or grad). Past runs' tables are kept,
dated, in .ci/RESULTS.md.
"""
import os
import re
import sys
import time

MODULE_DIR = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    os.path.dirname(__file__), "..")
sys.path.insert(0, MODULE_DIR)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P
import numpy as np  # noqa: E402

# The chip's default matmul precision (bf16 passes) is not numpy's.
jax.config.update("jax_default_matmul_precision", "highest")

try:
  jax.devices("tpu")
except RuntimeError:
  print("tpu_check: skipped (jax has no TPU backend here)")
  sys.exit(0)

from custom_partitioning import custom_partitioning  # noqa: E402

AUTO = (jax.sharding.AxisType.Auto,)
EXPLICIT = (jax.sharding.AxisType.Explicit,)
asked = []


def rows_op(body):  # a row-wise op with partition + infer + rule
  op = custom_partitioning(body)

  def part(mesh, arg_shapes, result_shape):
    asked.append([a.sharding.spec for a in arg_shapes])
    s = NamedSharding(mesh, P(arg_shapes[0].sharding.spec[0]))
    return mesh, body, s, (s,)

  def infer(mesh, arg_shapes, result_shape):
    return NamedSharding(mesh, P(arg_shapes[0].sharding.spec[0]))
  op.def_partition(part, infer_sharding_from_operands=infer,
                   sharding_rule="i j -> i j")
  return op


fft = rows_op(jnp.fft.fft)
double = rows_op(lambda x: x * 2 + 1)

rule_only = custom_partitioning(lambda x: jnp.tanh(x))
rule_only.def_partition(sharding_rule="i j -> i j")


@custom_partitioning
def gspmd_era(x):  # no rule: derived from infer
  return jnp.cos(x)


def _ge_part(mesh, arg_shapes, result_shape):
  asked.append([a.sharding.spec for a in arg_shapes])
  s = NamedSharding(mesh, P(arg_shapes[0].sharding.spec[0]))
  return mesh, jnp.cos, s, (s,)


gspmd_era.def_partition(_ge_part, infer_sharding_from_operands=lambda m, a, r:
                        NamedSharding(m, P(a[0].sharding.spec[0])))


@custom_partitioning
def matmul(x, w):
  return x @ w


def _mm_part(mesh, arg_shapes, result_shape):
  asked.append([a.sharding.spec for a in arg_shapes])
  rows = arg_shapes[0].sharding.spec[0]
  k = arg_shapes[0].sharding.spec[1] if len(arg_shapes[0].sharding.spec) > 1 \
      else None

  def lower(x, w):
    y = x @ w
    return jax.lax.psum(y, k) if k else y
  return (mesh, lower, NamedSharding(mesh, P(rows, None)),
          (NamedSharding(mesh, P(rows, k)), NamedSharding(mesh, P(k, None))))


matmul.def_partition(_mm_part, sharding_rule="i k, k j -> i j",
                     reduction_factors=("k",))


@jax.custom_vjp
def clip_grad(v):  # a backward rule not linear in its cotangent
  return v


clip_grad.defvjp(lambda v: (v, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))


@custom_partitioning
def clipped_matmul(x, w):
  return clip_grad(x @ w)


clipped_matmul.def_partition(
    lambda mesh, a, r: (
        mesh, lambda x, w: clip_grad(jax.lax.psum(x @ w, "y")),
        NamedSharding(mesh, P("x", None)),
        (NamedSharding(mesh, P("x", "y")), NamedSharding(mesh, P("y", None)))),
    sharding_rule="i k, k j -> i j")


def _clipped_loss(f):
  return jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w)) * 100.0))


@custom_partitioning
def two(x):  # two results
  return x + 1, jnp.sum(x, axis=1)


two.def_partition(sharding_rule="i j -> i j, i")


@custom_partitioning
def asks_replicated(x):
  return jnp.cumsum(x, axis=0)


def _ar_part(mesh, arg_shapes, result_shape):
  asked.append([a.sharding.spec for a in arg_shapes])
  s = NamedSharding(mesh, P())
  return mesh, lambda x: jnp.cumsum(x, axis=0), s, (s,)


asks_replicated.def_partition(_ar_part, sharding_rule="i j -> i j")


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
  asked.append([a.sharding.spec for a in arg_shapes])
  s = NamedSharding(mesh, P(arg_shapes[0].sharding.spec[0]))
  return mesh, pallas_double, s, (s,)


pallas_op.def_partition(_pl_part, sharding_rule="i j -> i j")


def need_replication_op(body, rule):
  """An op whose rule says its operand's last dimension needs replication;
  partition hands back what it is given, refusing to be asked with that
  dimension (or a result's) sharded: a kernel the module's check cannot
  see would compute on half of each row (issues 64, 65)."""
  op = custom_partitioning(body)

  def part(mesh, arg_shapes, result_shape):
    given = [arg_shapes[0].sharding, result_shape.sharding]
    specs = [tuple(s.spec) + (None,) * (2 - len(s.spec)) for s in given]
    asked.append(specs)
    if any(spec[1] is not None for spec, v in zip(
        specs, (arg_shapes[0], result_shape)) if len(v.shape) == 2):
      raise AssertionError(f"partition asked with {specs}: the rule's "
                           "need-replication dimension sharded")
    return mesh, body, given[1], (given[0],)
  op.def_partition(part, sharding_rule=rule,
                   need_replication_factors=(rule.split()[1],))
  return op


row_sums = need_replication_op(lambda x: jnp.sum(x, axis=1), "i k -> i")
doubled_rows = need_replication_op(lambda x: x * 2.0, "i j -> i j")


def scan_cond(x):
  def body(c, _):
    return jax.lax.cond(jnp.sum(c) > 0, double, rule_only, c), None
  return jax.lax.scan(body, x, None, length=2)[0]


# name: (program, numpy reference, shapes, dtype, shard_map twin or None)
CASES = {
    "partition op (fft)": (fft, lambda x: np.fft.fft(x), [(64, 128)],
                           np.complex64, jnp.fft.fft),
    "rule-only op": (rule_only, np.tanh, [(64, 128)], np.float32, jnp.tanh),
    "GSPMD-era op": (gspmd_era, np.cos, [(64, 128)], np.float32, jnp.cos),
    "two results": (lambda x: two(x)[0] + two(x)[1][:, None],
                    lambda x: x + 1 + x.sum(1)[:, None], [(64, 128)],
                    np.float32, None),
    "asks other shardings": (asks_replicated, lambda x: np.cumsum(x, 0),
                             [(64, 128)], np.float32, None),
    "static argument": (lambda x: scaled_op(x, 3.0), lambda x: x * 3,
                        [(64, 128)], np.float32, None),
    "uneven (60 rows)": (lambda x: double(x[:60]), lambda x: x[:60] * 2 + 1,
                         [(64, 128)],
                         np.float32, None),
    "several ops, scan, cond": (scan_cond, None, [(64, 128)], np.float32,
                                None),
    "vmap": (jax.vmap(double), lambda x: x * 2 + 1, [(8, 64, 128)],
             np.float32, None),
    "grad": (jax.grad(lambda x: jnp.sum(jnp.sin(double(x)))),
             lambda x: 2 * np.cos(2 * x + 1), [(64, 128)], np.float32, None),
    "jvp": (lambda x: jax.jvp(rule_only, (x,), (x,))[1],
            lambda x: x / np.cosh(x) ** 2, [(64, 128)], np.float32, None),
    "2-D mesh matmul (psum)": (matmul, lambda x, w: x @ w,
                               [(64, 128), (128, 128)], np.float32, None),
    "2-D grad, clip after psum": (
        _clipped_loss(clipped_matmul),
        _clipped_loss(lambda x, w: clip_grad(x @ w)),
        [(64, 128), (128, 128)], np.float32, None),
    "2-D need_replication (k sharded)": (row_sums, lambda x: x.sum(1),
                                         [(64, 128)], np.float32, None),
    "2-D need_replication result": (doubled_rows, lambda x: x * 2,
                                    [(64, 128)], np.float32, None),
    "Pallas kernel as lower_fn": (pallas_op, lambda x: x * 2, [(64, 128)],
                                  np.float32, pallas_double),
}


# What the minimal copy lacks: rule-only ops (II.5), derived ops (II.4).
EXTRAS = {"rule-only op", "two results", "static argument",
          "several ops, scan, cond", "vmap", "grad", "jvp",
          "2-D grad, clip after psum"}
if len(sys.argv) > 1:
  CASES = {k: v for k, v in CASES.items() if k not in EXTRAS}


def collectives(text):
  return sum(len(re.findall(rf"\b{c}(-start)?\(", text)) for c in (
      "all-gather", "all-reduce", "all-to-all", "collective-permute",
      "reduce-scatter"))


def topology(name, bounds):
  from jax.experimental import topologies
  return topologies.get_topology_desc(
      name, "tpu", chip_config_name="default", chips_per_host_bounds=bounds,
      num_slices=1, wrap=(False,) * 3).devices


def compile_case(name, devices, axis_types, set_mesh):
  fn, _, shapes, dtype, twin = CASES[name]
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
  del asked[:]
  ctx = jax.set_mesh(mesh) if set_mesh else _null()
  with ctx:
    lowered = jax.jit(fn).lower(*args)
    text = lowered.as_text()
    compiled = lowered.compile().as_text()
    extra = ""
    if twin is not None:
      sm = jax.jit(jax.shard_map(twin, mesh=mesh, in_specs=tuple(specs),
                                 out_specs=specs[0], check_vma=False))
      want = collectives(sm.lower(*args).compile().as_text())
      got = collectives(compiled)
      assert got <= want, (name, got, want)
      extra = f"{got} vs shard_map {want}"
  assert "CustomSPMDPartitioning" not in text, name
  return asked[:], extra


class _null:
  def __enter__(self):
    return None

  def __exit__(self, *_):
    return False


def main():
  rows, failed = [], 0
  rng = np.random.default_rng(0)
  topos = [("v5e:2x2", (2, 2, 1)), ("v5e:2x4", (2, 4, 1))]
  devices = {name: topology(name, b) for name, b in topos}
  chip = jax.devices("tpu")[:1]
  for name in CASES:
    cells = []
    for topo, _ in topos:
      for label, types, setm in (("Auto", AUTO, False),
                                 ("Explicit", EXPLICIT, True),
                                 ("Explicit, no set_mesh", EXPLICIT, False)):
        if name.startswith("uneven") and types == EXPLICIT:
          continue  # jax refuses uneven shardings on Explicit axes
        try:
          got, extra = compile_case(name, devices[topo], types, setm)
          cells.append(f"{topo} {label}: ok" + (
              f" (partition asked {len(got)}x{'; ' + extra if extra else ''})"
              if got or extra else ""))
        except Exception as e:  # noqa: BLE001 - reported in the table
          failed += 1
          cells.append(f"{topo} {label}: FAIL {type(e).__name__}: "
                       f"{str(e).splitlines()[0][:200]}")
    fn, ref, shapes, dtype, _ = CASES[name]
    try:
      xs = [rng.standard_normal(s).astype(dtype) for s in shapes]
      mesh = jax.sharding.Mesh(np.array(chip), ("x",), axis_types=AUTO)
      out = jax.jit(fn)(*[jax.device_put(x, NamedSharding(mesh, P()))
                          for x in xs])
      if ref is not None:
        np.testing.assert_allclose(np.asarray(out), ref(*xs), rtol=2e-2,
                                   atol=2e-2)
      cells.append("chip: right" if ref is not None else "chip: ran")
    except Exception as e:  # noqa: BLE001
      failed += 1
      cells.append(f"chip: FAIL {type(e).__name__}: {str(e)[:200]}")
    rows.append((name, cells))
    print(f"{name}: " + "; ".join(cells), flush=True)
  # GSPMD names Shardy.
  jax.config.update("jax_use_shardy_partitioner", False)
  try:
    mesh = jax.sharding.Mesh(np.array(devices["v5e:2x4"]), ("x",),
                             axis_types=AUTO)
    arg = jax.ShapeDtypeStruct((64, 128), np.float32,
                               sharding=NamedSharding(mesh, P("x")))
    try:
      jax.jit(double).lower(arg).compile()
      gspmd = "GSPMD: compiled"
    except NotImplementedError as e:
      gspmd = ("GSPMD: refused, naming Shardy" if "shardy" in str(e).lower()
               else f"GSPMD: FAIL {e}")
  finally:
    jax.config.update("jax_use_shardy_partitioner", True)
  print("| program | compiled for v5e:2x2 and v5e:2x4 (Auto; Explicit with "
        "and without set_mesh) | partition asked | collectives (shard_map's)"
        " | one chip |")
  print("|---|---|---|---|---|")
  for name, cells in rows:
    compiled = [c for c in cells if not c.startswith("chip")]
    ok = sum(": ok" in c for c in compiled)
    asked = sorted({m.group(1) for c in compiled
                    for m in [re.search(r"asked (\d+)x", c)] if m})
    coll = sorted({m.group(0) for c in compiled
                   for m in [re.search(r"\d+ vs shard_map \d+", c)] if m})
    ran = cells[-1].split(": ", 1)[1]
    coll = ", ".join(c.replace(" vs shard_map ", " (") + ")" for c in coll)
    print(f"| {name} | {ok} of {len(compiled)} | "
          f"{', '.join(a + 'x' for a in asked) or '-'} | {coll or '-'} | "
          f"{ran[:60]} |")
  print(gspmd)
  one = one_device_named_axis(chip)
  failed += one.count("FAIL")
  print(one)
  print(bench(devices["v5e:2x4"], chip))
  print(f"tpu_check: {failed} failures")
  return 1 if failed or "FAIL" in gspmd else 0


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


def bench(devices, chip):
  x = np.ones((8, 128), np.float32)
  on_chip = jax.device_put(x, chip[0])
  f = double  # partition, infer and rule: in every copy
  g = jax.jit(lambda x: x * 2 + 1)
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
  mesh = jax.sharding.Mesh(np.array(devices), ("x",), axis_types=AUTO)
  arg = jax.ShapeDtypeStruct((64, 128), np.float32,
                             sharding=NamedSharding(mesh, P("x")))

  def chain(op):
    def run(x):
      for _ in range(32):
        x = op(x)
      return x
    return run
  sm = jax.shard_map(lambda x: x * 2 + 1, mesh=mesh, in_specs=P("x"),
                     out_specs=P("x"))
  compile_s = {}
  for label, fn in (("op", chain(double)), ("shard_map", chain(sm))):
    times = []
    for _ in range(3):
      jax.clear_caches()
      t = time.perf_counter()
      jax.jit(fn).lower(arg).compile()
      times.append(time.perf_counter() - t)
    compile_s[label] = sorted(times)[1]
  return (f"eager (8, 128) f32 on the chip: op {op_us:.0f} us, jit "
          f"{jit_us:.0f} us ({op_us / jit_us:.2f}x), jit(op) {jop_us:.0f} us;"
          " compile of 32 ops "
          f"v5e:2x4 Auto: op {compile_s['op']:.2f} s, shard_map "
          f"{compile_s['shard_map']:.2f} s "
          f"({compile_s['op'] / compile_s['shard_map']:.2f}x)")


if __name__ == "__main__":
  sys.exit(main())
