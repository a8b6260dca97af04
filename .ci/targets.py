"""Compile-only TPU and GPU targets: devices jax compiles for without the
chips, on any machine where the platform's compiler is installed (libtpu;
jax's CUDA plugin and pjrt wheels), with JAX_PLATFORMS=cpu. Shared by
.ci/accel_check.py and .ci/bench.py."""
import os

# A stream_executor.GpuTargetConfigProto in text form: the H200's facts
# that XLA:GPU reads to compile without the device.
H200 = (
    'gpu_device_info { threads_per_block_limit: 1024 threads_per_warp: 32 '
    'shared_memory_per_block: 49152 shared_memory_per_core: 233472 '
    'threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128 '
    'block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 '
    'block_dim_limit_z: 65535 memory_bandwidth: 4800000000000 '
    'l2_cache_size: 52428800 clock_rate_ghz: 1.98 '
    'device_memory_size: 151397597184 shared_memory_per_block_optin: 232448 '
    'cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 '
    'registers_per_block_limit: 65536 } platform_name: "CUDA" '
    'dnn_version_info { major: 9 minor: 10 patch: 0 } '
    'device_description_str: "NVIDIA H200 141GB HBM3e"')

# name: (platform, topology arguments, (devices, hosts, slices) it gives)
TARGETS = {
    "v5e 2x2": ("tpu", dict(topology_name="v5e:2x2",
                            chips_per_host_bounds=(2, 2, 1), num_slices=1),
                (4, 1, 1)),
    "v5e 2x4": ("tpu", dict(topology_name="v5e:2x4",
                            chips_per_host_bounds=(2, 4, 1), num_slices=1),
                (8, 1, 1)),
    "v5e 4x4, 4 hosts": ("tpu", dict(topology_name="v5e:4x4",
                                     chips_per_host_bounds=(2, 2, 1),
                                     num_slices=1), (16, 4, 1)),
    "2 slices of v5e 2x4": ("tpu", dict(topology_name="v5e:2x4",
                                        chips_per_host_bounds=(2, 4, 1),
                                        num_slices=2), (16, 2, 2)),
    "8 H200s": ("gpu", dict(topology="1x1x8"), (8, 1, 1)),
    "2 hosts of 4 H200s": ("gpu", dict(topology="1x2x4"), (8, 2, 1)),
}


def devices(name):
  """The target's compile-only devices, checked against what it should
  give (AssertionError otherwise)."""
  from jax.experimental import topologies
  platform, kw, want = TARGETS[name]
  # libtpu takes a machine-wide lock (/tmp/libtpu_lockfile) for the chips
  # it would drive: compile-only, there are none, and another process (a
  # second check, a test run) may hold it.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  if platform == "tpu":
    devs = topologies.get_topology_desc(
        platform="tpu", chip_config_name="default", wrap=(False,) * 3,
        **kw).devices
  else:
    devs = topologies.get_topology_desc(
        platform="cuda", target_config=H200, **kw).devices
  got = (len(devs), len({d.process_index for d in devs}),
         len({getattr(d, "slice_index", 0) for d in devs}))
  assert got == want, f"{name}: (devices, hosts, slices) {got}, not {want}"
  return devs
