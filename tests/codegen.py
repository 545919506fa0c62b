"""The suite's XLA CPU codegen flags (set by ``conftest.py`` before JAX starts).

Compile time dominates this suite: tiny programs, many plans. LLVM without its optimisation
passes and the classic (non-MLIR) fusion emitters halve it. Neither changes what a program
computes; the classic emitters do expand some ops (scatters) into loops in the compiled
module, so XLA's cost analysis, which counts a loop body once, is measured under the
production flags instead (``tests/programs/class_flops.py``), and so is bf16 numerics.
"""

CODEGEN_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def without_codegen_flags(flags: str) -> str:
  """``XLA_FLAGS`` text less the suite's codegen flags."""
  names = {f.split("=")[0] for f in CODEGEN_FLAGS}
  return " ".join(f for f in flags.split() if f.split("=")[0] not in names)
