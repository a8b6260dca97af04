#!/usr/bin/env python3
"""Side-by-side benchmark of a custom_partitioning module against its peers.

Every figure is measured in a fresh process on 8 forced CPU devices, with the
implementations interleaved (A B C A B C ...) so that drift of a shared, noisy
machine hits them alike. Quote the medians and the ratios, not single times.

Implementations ("impls"):
  project   the module given with --module (default: the repository's
            custom_partitioning.py, one directory above this script)
  upstream  jax.experimental.custom_partitioning from the installed jax
  shard_map the same per-shard body written with jax.shard_map (the ideal)
  plain     the body under jit with no partitioning hints at all

Cases:
  compile   jit(...).lower(x).compile() of a chain of L elementwise custom ops
            on a (64, 128) float32 array sharded P('x') over 8 devices (seconds)
  trace     jit(...).trace(x) of the same chain: Python tracing only (seconds)
  eager     one call of the op outside jit on a single-device (64, 128) array
            (microseconds per call, median of 300 calls after warm-up)
  fft       run time of the batched FFT example, (2048, 1024) complex64 sharded
            P('x'): a custom-partitioned fft against a plain jit(fft), which
            all-gathers (milliseconds per call)
  compile_explicit
            the compile case on a mesh whose axis is of type Explicit (the
            default of jax.make_mesh in recent jax), under jax.set_mesh
            (seconds; needs jax >= 0.7)
  grad      run time of jit(grad) of a training-style loss through an
            attention-like op (rows of q sharded, lower_fn all-gathers k),
            (512, 64) float32 over 8 devices (milliseconds per call); notes
            give the collectives in the compiled gradient. Upstream has no
            differentiation rule and reports no figure.
  grad_explicit
            the grad case on an Explicit mesh under jax.set_mesh
  compile_derived
            the compile case under Shardy (set JAX_USE_SHARDY_PARTITIONER=1)
            with ops defined the GSPMD way, partition and infer only: the
            project derives their sharding rule from infer ("project"),
            against the same ops given that rule by hand ("project_rule");
            run with --chain 64. Upstream refuses such ops under Shardy.
  distinct  jit(...).lower(x) and .compile() of a chain of L distinct
            elementwise ops (each its own function, so nothing is shared) on
            the compile case's array (seconds, lower+compile; notes give the
            median of lower alone, tracing included)
  step      the same for a training step, jit(value_and_grad) of an L-layer
            MLP (tanh(x @ w), (64, 128) rows sharded P('x')) holding ONE
            elementwise op in its middle
  distinct_gpu, step_gpu, distinct_tpu, step_tpu
            distinct and step compiled for compile-only targets (no chip:
            .ci/targets.py), 8 H200s (needs jax's CUDA plugin and pjrt
            wheels) or v5e 2x4 (needs libtpu): XLA:GPU's and the TPU
            compiler's lower + compile, with JAX_PLATFORMS=cpu
  lower_bigconst
            jit(...).lower() of a chain of 32 ops whose lower_fn reads a
            256 MiB module-level numpy table (seconds): the cost of whatever
            an implementation does with the values its callbacks read

Usage:
  python .ci/bench.py [--module PATH] [--cases compile,trace,eager,fft]
                     [--chain 256] [--repeat 5] [--json OUT]
Exit status is 0 when every measurement ran; the table is printed last.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

N_DEVICES = 8


class _nullcontext:
  def __enter__(self):
    return None

  def __exit__(self, *exc):
    return False


def _worker(case: str, impl: str, module_path: str, chain: int) -> dict:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = (
      flags + f" --xla_force_host_platform_device_count={N_DEVICES}").strip()
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P
  import numpy as np

  if impl in ("project", "project_rule"):
    spec = importlib.util.spec_from_file_location("cp_under_test", module_path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["cp_under_test"] = mod
    spec.loader.exec_module(mod)
    custom_partitioning = mod.custom_partitioning
  else:
    from jax.experimental.custom_partitioning import custom_partitioning

  target = {"gpu": "8 H200s", "tpu": "v5e 2x4"}.get(case.rsplit("_", 1)[-1])
  if target:  # compile-only: arguments are shapes, nothing runs
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import targets
    case = case.rsplit("_", 1)[0]
    devices = targets.devices(target)
  else:
    devices = jax.devices()[:N_DEVICES]
  mesh = Mesh(np.array(devices), ("x",))
  row = NamedSharding(mesh, P("x"))

  def put(host, sharding):
    if target:
      return jax.ShapeDtypeStruct(host.shape, host.dtype, sharding=sharding)
    return jax.device_put(host, sharding)

  def body(x):
    return jnp.tanh(x) * 2.0 + jnp.sin(x)

  def make_op(fn, rule):
    if impl == "shard_map":
      return jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    if impl == "plain":
      return fn
    op = custom_partitioning(fn)

    def partition(mesh_, arg_shapes, result_shape):
      s = arg_shapes[0].sharding
      return mesh_, fn, s, (s,)

    def infer(mesh_, arg_shapes, result_shape):
      return arg_shapes[0].sharding

    op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                     sharding_rule=rule)
    return op

  if case in ("compile", "trace", "compile_derived"):
    op = make_op(body, None if case == "compile_derived" and impl != (
        "project_rule") else "i j -> i j")

    def model(x):
      for _ in range(chain):
        x = op(x)
      return x

    x = jax.device_put(np.ones((64, 128), np.float32), row)
    f = jax.jit(model, in_shardings=row, out_shardings=row)
    t0 = time.perf_counter()
    if case == "trace":
      f.trace(x)
    else:
      f.lower(x).compile()
    return {"value": time.perf_counter() - t0, "unit": "s"}

  if case == "eager":
    if impl == "shard_map":
      return {"value": None, "unit": "us"}
    op = make_op(body, "i j -> i j")
    if impl == "plain":
      op = jax.jit(body)
    x = jnp.ones((64, 128), jnp.float32)
    for _ in range(20):
      op(x).block_until_ready()
    times = []
    for _ in range(300):
      t0 = time.perf_counter()
      op(x).block_until_ready()
      times.append(time.perf_counter() - t0)
    return {"value": statistics.median(times) * 1e6, "unit": "us"}

  if case == "fft":
    def fft(x):
      return jnp.fft.fft(x)

    def keep_batch(sharding, ndim):
      spec = tuple(sharding.spec)[: ndim - 1]
      spec = spec + (None,) * (ndim - len(spec))
      return NamedSharding(sharding.mesh, P(*spec))

    if impl in ("project", "upstream"):
      op = custom_partitioning(fft)

      def partition(mesh_, arg_shapes, result_shape):
        s = keep_batch(arg_shapes[0].sharding, len(arg_shapes[0].shape))
        return mesh_, fft, s, (s,)

      def infer(mesh_, arg_shapes, result_shape):
        return keep_batch(arg_shapes[0].sharding, len(arg_shapes[0].shape))

      op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                       sharding_rule="...i -> ...i")
    elif impl == "shard_map":
      op = jax.shard_map(fft, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    else:
      op = fft
    rng = np.random.default_rng(0)
    host = (rng.standard_normal((2048, 1024))
            + 1j * rng.standard_normal((2048, 1024))).astype(np.complex64)
    x = jax.device_put(host, row)
    f = jax.jit(op, in_shardings=row, out_shardings=row)
    out = f(x)
    out.block_until_ready()
    err = float(np.max(np.abs(np.asarray(out) - np.fft.fft(host))))
    times = []
    for _ in range(15):
      t0 = time.perf_counter()
      f(x).block_until_ready()
      times.append(time.perf_counter() - t0)
    hlo = f.lower(x).compile().as_text()
    gathers = hlo.count("all-gather") + hlo.count("all-to-all")
    return {"value": statistics.median(times) * 1e3, "unit": "ms",
            "max_abs_err": err, "gather_ops": gathers}


  if case == "compile_explicit":
    from jax.sharding import AxisType
    emesh = jax.make_mesh((N_DEVICES,), ("x",),
                          axis_types=(AxisType.Explicit,))
    erow = NamedSharding(emesh, P("x"))
    if impl == "shard_map":
      op = jax.shard_map(body, mesh=emesh, in_specs=P("x"), out_specs=P("x"))
    else:
      op = make_op(body, "i j -> i j")

    def emodel(x):
      for _ in range(chain):
        x = op(x)
      return x

    with jax.set_mesh(emesh):
      x = jax.device_put(np.ones((64, 128), np.float32), erow)
      f = jax.jit(emodel)
      t0 = time.perf_counter()
      f.lower(x).compile()
    return {"value": time.perf_counter() - t0, "unit": "s"}

  if case in ("grad", "grad_explicit"):
    import re

    from jax.sharding import AxisType
    kind = AxisType.Explicit if case == "grad_explicit" else AxisType.Auto
    gmesh = jax.make_mesh((N_DEVICES,), ("x",), axis_types=(kind,))
    rows = NamedSharding(gmesh, P("x", None))

    def attend(q, k):
      s = q @ k.T
      return jax.nn.softmax(s, axis=-1) @ k

    def local(q, k):  # rows of q on this shard, k sharded too: gather it
      kf = jax.lax.all_gather(k, "x", tiled=True)
      return attend(q, kf)

    if impl == "shard_map":
      op = jax.shard_map(local, mesh=gmesh, in_specs=(P("x"), P("x")),
                         out_specs=P("x"))
    elif impl == "plain":
      op = attend
    else:
      op = custom_partitioning(attend)

      def gpartition(mesh_, arg_shapes, result_shape):
        r = NamedSharding(mesh_, P("x", None))
        return mesh_, local, r, (r, r)

      def ginfer(mesh_, arg_shapes, result_shape):
        return NamedSharding(mesh_, P("x", None))

      op.def_partition(partition=gpartition,
                       infer_sharding_from_operands=ginfer,
                       sharding_rule="i d, j d -> i d")

    def loss(q, k):
      return jnp.sum(op(q, k) ** 2)

    rng = np.random.default_rng(0)
    qh = rng.standard_normal((512, 64)).astype(np.float32)
    kh = rng.standard_normal((512, 64)).astype(np.float32)
    ctx = jax.set_mesh(gmesh) if kind == AxisType.Explicit else _nullcontext()
    with ctx:
      q = jax.device_put(qh, rows)
      k = jax.device_put(kh, rows)
      g = jax.jit(jax.grad(loss, argnums=(0, 1)))
      try:
        out = g(q, k)
      except Exception as e:  # upstream: no differentiation rule
        return {"value": None, "unit": "ms",
                "error": type(e).__name__}
      jax.block_until_ready(out)
      ref = jax.jit(jax.grad(lambda a, b: jnp.sum(attend(a, b) ** 2),
                             argnums=(0, 1)))(qh, kh)
      err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(out, ref))
      times = []
      for _ in range(15):
        t0 = time.perf_counter()
        jax.block_until_ready(g(q, k))
        times.append(time.perf_counter() - t0)
      hlo = g.lower(q, k).compile().as_text()
    coll = {c: len(re.findall(r"\s" + c + r"(-start)?\(", hlo))
            for c in ("all-gather", "all-reduce", "reduce-scatter",
                      "all-to-all", "collective-permute")}
    return {"value": statistics.median(times) * 1e3, "unit": "ms",
            "max_abs_err": round(err, 6),
            "collectives": sum(coll.values()),
            "detail": ",".join(f"{k}:{v}" for k, v in coll.items() if v)}

  if case in ("distinct", "step"):
    def bodies(k):
      return lambda x: jnp.tanh(x) * (1.0 + k) + jnp.sin(x)

    x = put(np.ones((64, 128), np.float32), row)
    if case == "distinct":
      ops = [make_op(bodies(k), "i j -> i j") for k in range(chain)]

      def dmodel(x):
        for op in ops:
          x = op(x)
        return x
      f, args = jax.jit(dmodel, in_shardings=row, out_shardings=row), (x,)
    else:
      op = make_op(bodies(0), "i j -> i j")

      def loss(ws, x):
        for i, w in enumerate(ws):
          x = jnp.tanh(x @ w)
          if i == len(ws) // 2:
            x = op(x)
        return jnp.sum(x ** 2)
      ws = [put(np.eye(128, dtype=np.float32) * 0.5,
                NamedSharding(mesh, P())) for _ in range(chain)]
      f, args = jax.jit(jax.value_and_grad(loss)), (ws, x)
    t0 = time.perf_counter()
    lowered = f.lower(*args)
    t1 = time.perf_counter()
    lowered.compile()
    return {"value": time.perf_counter() - t0, "unit": "s",
            "lower": t1 - t0}

  if case == "lower_bigconst":
    table = np.ones((256 * 1024 * 1024 // 4,), np.float32)
    op = custom_partitioning(body)

    def bpartition(mesh_, arg_shapes, result_shape):
      s = arg_shapes[0].sharding

      def lower_fn(x):
        return body(x) + table[0]
      return mesh_, lower_fn, s, (s,)

    op.def_partition(partition=bpartition,
                     infer_sharding_from_operands=lambda m, a, r: a[0].sharding,
                     sharding_rule="i j -> i j")

    def bmodel(x):
      for _ in range(32):
        x = op(x)
      return x

    x = jax.device_put(np.ones((64, 128), np.float32), row)
    f = jax.jit(bmodel, in_shardings=row, out_shardings=row)
    t0 = time.perf_counter()
    f.lower(x)
    return {"value": time.perf_counter() - t0, "unit": "s"}

  raise SystemExit(f"unknown case {case!r}")


IMPLS = {
    "compile": ("project", "upstream", "shard_map", "plain"),
    "trace": ("project", "upstream", "shard_map", "plain"),
    "eager": ("project", "upstream", "plain"),
    "fft": ("project", "upstream", "shard_map", "plain"),
    "compile_explicit": ("project", "upstream", "shard_map", "plain"),
    "grad": ("project", "upstream", "shard_map", "plain"),
    "grad_explicit": ("project", "upstream", "shard_map", "plain"),
    "lower_bigconst": ("project", "upstream"),
    "compile_derived": ("project", "project_rule"),
    "distinct": ("project", "shard_map"),
    "step": ("project", "shard_map"),
    "distinct_gpu": ("project", "shard_map"),
    "step_gpu": ("project", "shard_map"),
    "distinct_tpu": ("project", "shard_map"),
    "step_tpu": ("project", "shard_map"),
}


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  # The repository's module whatever the working directory.
  ap.add_argument("--module", default=os.path.join(
      os.path.dirname(os.path.abspath(__file__)), os.pardir,
      "custom_partitioning.py"))
  ap.add_argument("--cases", default="compile,trace,eager,fft")
  ap.add_argument("--chain", type=int, default=256)
  ap.add_argument("--repeat", type=int, default=5)
  ap.add_argument("--json", default=None)
  ap.add_argument("--worker", nargs=2, metavar=("CASE", "IMPL"))
  args = ap.parse_args()
  module_path = os.path.abspath(args.module)

  if args.worker:
    print(json.dumps(_worker(args.worker[0], args.worker[1], module_path,
                             args.chain)))
    return 0

  if not os.path.exists(module_path):
    print(f"no module at {module_path}", file=sys.stderr)
    return 2
  results: dict = {}
  failed = False
  for case in args.cases.split(","):
    impls = IMPLS[case]
    samples: dict = {i: [] for i in impls}
    lowers: dict = {i: [] for i in impls}  # the lower-alone figures, if any
    extra: dict = {}
    for _ in range(args.repeat):
      for impl in impls:
        cmd = [sys.executable, os.path.abspath(__file__), "--module",
               module_path, "--chain", str(args.chain), "--worker", case, impl]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
          failed = True
          print(f"[{case}/{impl}] failed:\n{proc.stderr[-2000:]}",
                file=sys.stderr)
          continue
        rec = json.loads(proc.stdout.strip().splitlines()[-1])
        if rec["value"] is not None:
          samples[impl].append(rec["value"])
        if rec.get("lower") is not None:
          lowers[impl].append(rec["lower"])
        extra[impl] = {k: v for k, v in rec.items()
                       if k not in ("value", "lower")}
        if lowers[impl]:
          extra[impl]["lower"] = round(statistics.median(lowers[impl]), 4)
    results[case] = {
        impl: {"median": statistics.median(v) if v else None,
               "min": min(v) if v else None, "max": max(v) if v else None,
               **extra.get(impl, {})}
        for impl, v in samples.items()}

  def fmt(v):
    return f"{v:10.4g}" if v is not None else f"{'-':>10}"

  print(f"{'case':8} {'impl':10} {'median':>10} {'min':>10} {'max':>10}"
        f" {'vs upstream':>12} {'vs shard_map':>12}  notes")
  for case, per in results.items():
    up = per.get("upstream", {}).get("median")
    twin = per.get("shard_map", {}).get("median")
    for impl, r in per.items():
      med = r["median"]
      ratio = "".join(f"{med / base:12.3f} " if (med is not None and base)
                      else f"{'-':>12} " for base in (up, twin))[:-1]
      notes = " ".join(f"{k}={v}" for k, v in r.items()
                       if k not in ("median", "min", "max"))
      print(f"{case:8} {impl:10} {fmt(med)} {fmt(r['min'])} {fmt(r['max'])}"
            f" {ratio}  {notes}")
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(results, fh, indent=2)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
