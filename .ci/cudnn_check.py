#!/usr/bin/env python3
"""jax's own clients of custom_partitioning, through the file, against jax.

jax's cuDNN attention (``jax.nn.dot_product_attention(...,
implementation="cudnn")``, ``jax._src.cudnn.fused_attention_stablehlo``) and
cuDNN scaled matmul (``jax.nn.scaled_matmul``, ``scaled_matmul_stablehlo``)
are built on jax's custom_partitioning. jax imports them during ``import
jax``, so swapping ``jax.experimental.custom_partitioning`` afterwards does
not reach them: this check runs two copies of each module's source, one as
it is (upstream) and one with its ``custom_partitioning`` imports pointed at
the file under test, with ``jax.nn``'s cuDNN names pointed at each in turn.
Each case is compiled for 8 compile-only H200s (``.ci/targets.py``) under
Shardy and, where the release has it, GSPMD; the HLO after XLA's SPMD pass
(``--xla_dump_to``: from jax 0.12 XLA will not compile cuDNN attention
without a GPU, upstream alike) must hold the same per-device cuDNN calls
(target and operand shapes) and the same collectives as upstream's, and
both compiles must end alike.

Needs jax's CUDA plugin and pjrt wheels and the cuDNN library
(``pip install --no-deps --target DIR nvidia-cudnn-cu12``, or ``-cu13`` for
the CUDA 13 plugin; DIR on PYTHONPATH: jax's cuDNN version check loads it).
Exits 0, saying why, where either is missing; 1 on any difference.

    PYTHONPATH=DIR python .ci/cudnn_check.py [MODULE_DIR]
"""
import atexit
import ctypes
import glob
import importlib.util
import itertools
import os
import re
import shutil
import sys
import tempfile
import time
import types

CUDA = next((m for m in ("xla_cuda13", "xla_cuda12")
             if importlib.util.find_spec("jax_plugins") is not None
             and importlib.util.find_spec("jax_plugins." + m) is not None),
            None)
LIB = next((lib for p in sys.path for lib in glob.glob(os.path.join(
    p, "nvidia", "cudnn", "lib", "libcudnn.so.9"))), None)
if CUDA is None or LIB is None:
  print("cudnn_check: skipped (needs jax's CUDA plugin and the cuDNN "
        f"library on PYTHONPATH; plugin {CUDA}, cuDNN {LIB})")
  sys.exit(0)
# Under JAX_PLATFORMS=cpu the plugin does not load cuDNN; jax's version
# check asks it for its version.
ctypes.CDLL(LIB, mode=ctypes.RTLD_GLOBAL)
DUMP = tempfile.mkdtemp(prefix="cudnn_check_")
atexit.register(shutil.rmtree, DUMP, ignore_errors=True)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_dump_to={DUMP}"
                           " --xla_dump_hlo_pass_re=spmd-partitioning")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [sys.argv[1] if len(sys.argv) > 1 else
                os.path.join(HERE, ".."), HERE]
import jax  # noqa: E402
from jax._src.nn import functions as nn_functions  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402
import targets  # noqa: E402

import custom_partitioning  # noqa: E402 - the file under test

IMPORTS = {  # jax's line -> the file's
    "from jax._src.custom_partitioning import custom_partitioning":
        "from custom_partitioning import custom_partitioning",
    "from jax._src.custom_partitioning_sharding_rule import":
        "from custom_partitioning import",
}


def copy_of(name: str, ours: bool):
  """A copy of ``jax._src.cudnn.<name>``, its custom_partitioning the
  file's if ``ours``; compute-capability checks answer for sm_90 (jax asks
  the default backend, the CPU)."""
  path = importlib.util.find_spec(f"jax._src.cudnn.{name}").origin
  with open(path) as f:
    source = f.read()
  if ours:
    for line, new in IMPORTS.items():
      source = source.replace(line, new)
    if "jax._src.custom_partitioning" in source or (
        IMPORTS[next(iter(IMPORTS))] not in source):
      raise SystemExit(f"cudnn_check: {name} imports custom_partitioning "
                       "otherwise now: update IMPORTS")
  module = types.ModuleType(f"{name}_{'file' if ours else 'upstream'}")
  exec(compile(source, path, "exec"), module.__dict__)  # noqa: S102

  def capability(want, equal=False):
    want = tuple(int(x) for x in want.split("."))
    return (9, 0) == want if equal else (9, 0) >= want
  module.check_compute_capability = capability
  module.is_cuda_compute_capability_equal = lambda c: capability(c, True)
  return module


COPIES = {impl: (copy_of("fused_attention_stablehlo", impl == "file"),
                 copy_of("scaled_matmul_stablehlo", impl == "file"))
          for impl in ("upstream", "file")}


def use(impl: str):
  """Points jax.nn's cuDNN names at ``impl``'s copies."""
  attention, matmul = COPIES[impl]
  nn_functions.cudnn_dot_product_attention = attention.dot_product_attention
  nn_functions.MaskType = attention.MaskType
  nn_functions.cudnn_scaled_matmul = matmul.scaled_matmul_wrapper


DEVICES = targets.devices("8 H200s")
MESH = Mesh(np.array(DEVICES).reshape(2, 4), ("x", "y"))
QKV = (8, 256, 8, 64)  # (batch, sequence, heads, head), bf16


def attention_cases():
  specs = {"batch": P("x"), "heads": P(None, None, "y"),
           "both": P("x", None, "y"), "batch over x, y": P(("x", "y"))}
  for (label, spec), causal in [*((s, False) for s in specs.items()),
                                (("both", specs["both"]), True)]:
    def f(q, k, v, causal=causal):
      return jax.nn.dot_product_attention(q, k, v, implementation="cudnn",
                                          is_causal=causal)

    def loss(q, k, v, f=f):
      return f(q, k, v).astype(jnp.float32).sum()
    args = [jax.ShapeDtypeStruct(QKV, jnp.bfloat16,
                                 sharding=NamedSharding(MESH, spec))] * 3
    name = f"attention, {label}{', causal' if causal else ''}"
    yield name, "forward", f, args
    yield name, "grad", jax.grad(loss, (0, 1, 2)), args


def matmul_cases():
  # (B, M, K) x (B, N, K), scales per block of 32 along K.
  b, m, n, k = 8, 256, 128, 512
  for label, a_spec, b_spec in (("batch", P("x"), P("x")),
                                ("M", P(None, "y"), P()),
                                ("K", P(None, None, "y"), P(None, None, "y")),
                                ("batch, K", P("x", None, "y"),
                                 P("x", None, "y"))):
    def f(a, b_, a_scales, b_scales):
      return jax.nn.scaled_matmul(a, b_, a_scales, b_scales)
    shapes = [((b, m, k), jnp.float8_e4m3fn, a_spec),
              ((b, n, k), jnp.float8_e4m3fn, b_spec),
              ((b, m, k // 32), jnp.float8_e8m0fnu, a_spec),
              ((b, n, k // 32), jnp.float8_e8m0fnu, b_spec)]
    args = [jax.ShapeDtypeStruct(s, t, sharding=NamedSharding(MESH, p))
            for s, t, p in shapes]
    yield f"scaled_matmul, {label} sharded", "forward", f, args


KERNEL = re.compile(r' = (.*?) custom-call\(.*custom_call_target='
                    r'"((?:__cudnn|__op)\$[^"]+)"(.*)')
SHAPE = re.compile(r"\b[a-z][a-z0-9]*\[[0-9,]*\]")
COUNT = itertools.count()
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
               "collective-permute")


def after_spmd(f, args):
  """``(kernels, collectives, compiled)`` of ``f`` on ``args`` after XLA's
  SPMD pass: each cuDNN call's target, result and operand shapes, and the
  collectives, sorted; ``compiled``: None, or the compile's error type."""
  # XLA dumps a file name once per process: each module is named apart.
  tag = f"case{next(COUNT)}"

  def case(*xs):
    return f(*xs)
  case.__name__ = tag
  lowered = jax.jit(case).lower(*args)
  try:
    lowered.compile()
    compiled = error = None
  except Exception as e:  # noqa: BLE001 - compared with upstream's
    compiled, error = type(e).__name__, str(e)
  dumped = sorted(n for n in os.listdir(DUMP)
                  if f"jit_{tag}." in n and "after_spmd-partitioning" in n)
  if not dumped:
    raise AssertionError(f"no HLO after the SPMD pass: {error}")
  with open(os.path.join(DUMP, dumped[-1])) as fh:
    text = fh.read()
  kernels = []
  for result, target, rest in KERNEL.findall(text):
    operands = rest.split("operand_layout_constraints=", 1)[-1].split("}}")[0]
    kernels.append((target, tuple(SHAPE.findall(result)),
                    tuple(SHAPE.findall(operands)) if
                    "operand_layout_constraints=" in rest else ()))
  collectives = sorted(c for c in COLLECTIVES
                       for _ in re.findall(r"\s" + c + r"(-start)?\(", text))
  return sorted(kernels), collectives, compiled


def main() -> int:
  # GSPMD where jax has it and the file keeps XLA's callbacks (II.7; the
  # minimal copy has none).
  partitioners = [True] + ([False] if jax.__version_info__ < (0, 12, 1) and
                           hasattr(custom_partitioning, "_answer_partition")
                           else [])
  failures, t0 = 0, time.time()
  print(f"jax {jax.__version__}, {CUDA}, 8 H200s (compile-only)")
  for shardy in partitioners:
    jax.config.update("jax_use_shardy_partitioner", shardy)
    for name, what, f, args in [*attention_cases(), *matmul_cases()]:
      got = {}
      for impl in ("upstream", "file"):
        use(impl)
        try:
          got[impl] = after_spmd(f, args)
        except Exception as e:  # noqa: BLE001 - reported as a row
          got[impl] = (type(e).__name__, str(e).splitlines()[0][:200])
      ok = got["upstream"] == got["file"]
      failures += not ok
      up = got["upstream"]
      kernels = (", ".join(f"{t.split('$')[1]} {r[0]}" for t, r, _ in up[0])
                 if len(up) == 3 else up)
      print(f"{'ok  ' if ok else 'FAIL'} {'Shardy' if shardy else 'GSPMD':6}"
            f" {name:32} {what:7} kernels {kernels}; collectives "
            f"{up[1] if len(up) == 3 else '-'}"
            f"{'' if len(up) != 3 or up[2] is None else f'; compile {up[2]}'}")
      if not ok:
        print(f"     upstream: {got['upstream']}\n     file:     "
              f"{got['file']}")
  print(f"cudnn_check: {failures} failures ({time.time() - t0:.0f} s)")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
