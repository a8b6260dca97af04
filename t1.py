from h import *
from jax import lax
import sys
MODE = sys.argv[1] if len(sys.argv) > 1 else "none"   # none | auto | explicit
n = 8
if MODE == "explicit":
  mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
else:
  mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
rows = NamedSharding(mesh, P("x"))
rs = np.random.RandomState(0)
X = rs.randn(16, 32).astype(np.float32)

def batch_sh(sh, ndim):
  spec = tuple(sh.spec)[: ndim - 1] if isinstance(sh, NamedSharding) else ()
  return NamedSharding(mesh, P(*spec, *[None] * (ndim - len(spec))))

def make_rowwise(cpf, f, static=()):
  op = cpf(f, static_argnums=static) if static else cpf(f)
  def part(*a):
    *st, m, arg_shapes, rshape = a
    x = arg_shapes[0]
    sh = batch_sh(x.sharding, x.ndim)
    return mesh, (lambda *l: f(*l, *st)) if False else (lambda *l: f(*st, *l) if static and static[0] == 0 else f(*l, *st)), sh, (sh,)
  def infer(*a):
    *st, m, arg_shapes, rshape = a
    return batch_sh(arg_shapes[0].sharding, arg_shapes[0].ndim)
  op.def_partition(part, infer_sharding_from_operands=infer, sharding_rule="... i -> ... i")
  return op

softmax = lambda a: jax.nn.softmax(a, axis=-1)
def scaled(a, s): return jnp.fft.fft(a).real * s

OPS = {
  "fft": (lambda cpf: make_rowwise(cpf, jnp.fft.fft), jnp.fft.fft, (X,)),
  "softmax": (lambda cpf: make_rowwise(cpf, softmax), softmax, (X,)),
  "cumsum-direct": (lambda cpf: make_rowwise(cpf, jnp.cumsum) , None, None),
}

def check(name, build, ref, args, transforms=("jit","eager_host","eager_single","eager_sharded","grad","vmap")):
  for cpf_name, cpf in (("ours", cp), ("upstream", upstream_cp)):
    for t in transforms:
      def f():
        op = build(cpf)
        a = args[0]
        if t == "jit":
          y = jax.jit(op, in_shardings=rows)(a)
        elif t == "eager_host":
          y = op(a)
        elif t == "eager_single":
          y = op(jax.device_put(a, jax.devices()[0]))
        elif t == "eager_sharded":
          y = op(jax.device_put(a, rows))
        elif t == "grad":
          y = jax.jit(jax.grad(lambda v: jnp.sum(jnp.abs(op(v)) ** 2)), in_shardings=rows)(a)
          close(y, jax.grad(lambda v: jnp.sum(jnp.abs(ref(v)) ** 2))(a), 1e-3); return
        elif t == "vmap":
          ab = np.stack([a, a + 1])
          y = jax.jit(jax.vmap(op))(jax.device_put(ab, NamedSharding(mesh, P(None, "x"))))
          close(y, jax.vmap(ref)(ab), 1e-3); return
        close(y, ref(a), 1e-3)
      run(f"{MODE} {name} {cpf_name} {t}", f)

def ctx():
  if MODE == "none":
    import contextlib; return contextlib.nullcontext()
  return jax.set_mesh(mesh)
with ctx():
  check("fft", OPS["fft"][0], jnp.fft.fft, (X.astype(np.complex64),))
  check("softmax", OPS["softmax"][0], softmax, (X,))
  # wrapping jnp.cumsum directly (axis default None -> flatten!). use axis kw? direct wrap: cumsum(a) flattens.
  def cs(cpf):
    op = cpf(jnp.cumsum)
    def part(m, arg_shapes, r):
      sh = NamedSharding(mesh, P()); return mesh, lambda a: jnp.cumsum(a), sh, (sh,)
    op.def_partition(part, infer_sharding_from_operands=lambda m, a, r: NamedSharding(mesh, P()), sharding_rule="i j -> k")
    return op
  check("cumsum direct (flatten)", cs, jnp.cumsum, (X,), ("jit", "eager_host", "eager_sharded"))
  # static arg
  def st(cpf):
    op = cpf(scaled, static_argnums=(1,))
    def part(s, m, arg_shapes, r):
      sh = batch_sh(arg_shapes[0].sharding, 2); return mesh, lambda a: scaled(a, s), sh, (sh,)
    op.def_partition(part, infer_sharding_from_operands=lambda s, m, a, r: batch_sh(a[0].sharding, 2), sharding_rule="... i -> ... i")
    return op
  for cpf_name, cpf in (("ours", cp), ("upstream", upstream_cp)):
    def f():
      op = st(cpf)
      close(jax.jit(op, static_argnums=1, in_shardings=(rows,))(X, 3.0), scaled(X, 3.0), 1e-3)
      close(op(jax.device_put(X, rows), 3.0), scaled(X, 3.0), 1e-3)
      close(op(X, 3.0), scaled(X, 3.0), 1e-3)
    run(f"{MODE} static {cpf_name}", f)
print(sum(r == "ok" for _, r in RES), "/", len(RES))
