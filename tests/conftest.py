"""Test set-up: 8 simulated CPU devices, fixed before JAX starts."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (must come after XLA_FLAGS)

jax.config.update("jax_enable_x64", False)

if len(jax.devices()) < 8:
  raise RuntimeError(
      f"tests need 8 devices, found {len(jax.devices())}; "
      "XLA_FLAGS was set before conftest ran")
