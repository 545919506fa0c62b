"""The suite's XLA CPU codegen flags (set by ``conftest.py`` before JAX starts).

Compile time dominates this suite: tiny programs, many plans. LLVM without its optimisation
passes and the classic (non-MLIR) fusion emitters halve it (gpt_tiny's 12-step run with a
failure and a repair: 20.2 s -> 11.6 s here). Results move in the last bits at most (that
run's final loss 6.6465764 -> 6.6465769), and both sides of every parity check compile
alike. But the classic emitters expand some ops into loops in the compiled module, which
XLA's cost analysis counts once, and unoptimised code runs long runs slower: the cost
figures, bf16 numerics and the default 150-step run use the production flags, in
subprocesses (``helpers.process_env(codegen=False)``).
"""

CODEGEN_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
# XLA's cost analysis reads the optimised HLO, before LLVM: skipping LLVM's passes leaves every
# figure of tests/programs/class_flops.py unchanged and takes a quarter off its time.
COST_ANALYSIS_FLAGS = ("--xla_backend_optimization_level=0",)


def without_codegen_flags(flags: str) -> str:
  """``XLA_FLAGS`` text less the suite's codegen flags."""
  names = {f.split("=")[0] for f in CODEGEN_FLAGS}
  return " ".join(f for f in flags.split() if f.split("=")[0] not in names)
