"""The XLA flags every process of the suite compiles with (tests/conftest.py sets them for the
suite's own processes and the scripts they start; the walk-through passes them to a user's).

The suite compiles hundreds of small programs that then run for milliseconds, so most of its
time is XLA's CPU compiler, even unoptimised. Each flag makes that compile cheaper and none
changes a result a test checks (the suite passes with them):
- unoptimised machine code: most of a small program's compile is LLVM's optimisation passes
  (the HLO passes, fusion included, still run as in a default build);
- the older loop emitters for fusions, which XLA builds without the MLIR pipeline of the
  new fusion emitters: the largest saving, though the code of a loop that trains for hundreds
  of steps runs slower with them;
- one codegen module per program: on two cores shared by two workers, the parallel codegen
  split only adds work.
Not `--xla_cpu_enable_concurrency_optimized_scheduler=false`, though it saves compile time
too: with it, the two processes of tests/parallel/test_multihost.py's SIGTERM test failed on
mismatched collectives (gloo) in every full run of that file.
What each saved, and what it cost: benchmarks/NOTES.md, "The test suite's time".
"""
import contextlib
import functools

FAST_COMPILE = " ".join([
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
])


@contextlib.contextmanager
def optimised():
    """``jax.jit`` calls made inside compile with LLVM's optimisation on, whatever XLA_FLAGS say.

    For the few fixtures that run one program for hundreds of steps (reward models trained to a
    learning threshold): unoptimised machine code runs a small model's training step about 4x
    slower, which there costs more than the compile saves (benchmarks/NOTES.md, "The test
    suite's time"). The option reaches XLA per program (jax.jit's compiler_options), so the
    rest of the process keeps FAST_COMPILE. Other machine code may round differently in the last
    bits, so it suits checks against thresholds (a learning bar), not bitwise comparisons with
    programs compiled outside it.
    """
    import jax  # here: conftest imports this module before it sets what jax reads at import

    plain = jax.jit
    jax.jit = functools.partial(plain, compiler_options={"xla_backend_optimization_level": 2})
    try:
        yield
    finally:
        jax.jit = plain
