"""The trainer's messages say each thing once and agree: a damaged checkpoint's error names
TensorStore's cause, not its spec, and leaves no traceback behind; the summary's compile time
is the goodput's."""

import sys
import types

from ntp_jax.resilience.goodput import GoodputClock
from ntp_jax.state.checkpoint import one_line, quiet_late_reads
from ntp_jax.training.trainer import finish


def test_one_line_gives_the_innermost_cause_without_the_store_spec():
  cause = ValueError('OUT_OF_RANGE: Error reading "params.head.kernel/0.7.0" in OCDBT database: '
                     "Requested byte range [0, 15225) is not valid for value of size 100")
  try:
    try:
      raise cause
    except ValueError as inner:
      raise Exception("Encountered error while reading array index: (slice(0, 2, 1),). See "
                      "full TensorStore details: <bound method pybind11_detail_function_record"
                      "_v1.spec of TensorStore({\n  'base': {\n 'driver': 'zarr'}})>") from inner
  except Exception as err:
    text = one_line(err)
  assert text == f"ValueError: {cause}"
  assert one_line(RuntimeError("x" * 400), 50) == f"RuntimeError: {'x' * 47}..."


def test_the_late_reads_of_a_failed_restore_print_nothing_and_other_errors_still_do():
  seen, before = [], sys.unraisablehook
  sys.unraisablehook = seen.append
  try:
    quiet_late_reads()
    quiet_late_reads()  # once is enough: a second call wraps nothing
    late = types.SimpleNamespace(exc_type=RuntimeError,
                                 exc_value=RuntimeError("Event loop is closed"))
    other = types.SimpleNamespace(exc_type=RuntimeError, exc_value=RuntimeError("other"))
    sys.unraisablehook(late)
    sys.unraisablehook(other)
    assert seen == [other]
  finally:
    sys.unraisablehook = before


def test_the_summary_and_the_goodput_say_the_same_compile_time():
  """A recovery compiles besides its first step (and waits for the background compile): the
  goodput's compile bucket counts it, and so does the summary."""
  clock = GoodputClock()
  clock.add("compile", 3.0 + 2.0)  # the first steps of two plans
  clock.add("compile", 1.5)  # the moves of the recovery between them
  clock.add("productive", 1.0)
  records = [{"step": 0, "loss": 2.0, "tokens": 10, "step_time_s": 3.0, "compiled": True},
             {"step": 1, "loss": 1.5, "tokens": 10, "step_time_s": 1.0},
             {"step": 2, "loss": 1.0, "tokens": 10, "step_time_s": 2.0, "compiled": True}]
  run = types.SimpleNamespace(records=records, clock=clock, redone_steps=0, marks=[],
                              writer=types.SimpleNamespace(path="runs/x/metrics.jsonl"))
  lines = []
  finish(run, None, lines.append)
  summary, goodput = lines[0], lines[1]
  assert "(6.5 s of it compiling)" in summary, summary
  assert "compile 6.5 s" in goodput, goodput
