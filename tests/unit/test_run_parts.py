"""The trainer's parts built alone, without ``train()``: the recovery record and the guard
over the other processes (arrival, a lost process taken over, the stop it ends in)."""

import dataclasses
import functools
import time

import pytest
from helpers import SMALL, KeyValueStore

from models.gpt import model_layouts
from ntp_jax.parallel.plan import make_plan
from ntp_jax.processes.arrival import ProcessLost
from ntp_jax.processes.distributed import Job
from ntp_jax.processes.heartbeat import LOST_EXIT_CODE
from ntp_jax.training.process_guard import ProcessGuard, ProcessStop
from ntp_jax.training.recovery import Recoveries
from ntp_jax.training.run_state import RunState


class Events:
  def __init__(self):
    self.rows = []

  def __call__(self, kind, **fields):
    self.rows.append((kind, fields))


def test_a_recovery_is_written_once_its_first_step_ran_with_only_the_fields_it_set():
  events, compiled = Events(), [10.0]
  recoveries = Recoveries(events, lambda: compiled[0])
  record = recoveries.begin(100.0, 10.0, plan_s=0.25, wait_s=0.5, ahead=True)
  record.path, record.move_s, record.copied_bytes, record.seconds = "live", 1.5, 4096, 2.0
  compiled[0] = 10.75  # seconds this thread compiled since the failure
  recoveries.finish(7, 0.125)
  recoveries.finish(8, 0.125)  # nothing pending: nothing written
  assert events.rows == [("recovered", {
      "step": 7, "path": "live", "seconds": 2.0, "plan_s": 0.25, "wait_s": 0.5,
      "move_s": 1.5, "copied_bytes": 4096, "compile_s": 0.75, "compiled_ahead": True,
      "first_step_s": 0.125})]
  recoveries.begin(200.0, 10.75, cut=True).redo = 3
  recoveries.finish(9, None)  # no step ran on the plan: no first_step_s
  assert events.rows[1] == ("recovered", {"step": 9, "plan_s": 0.0, "wait_s": 0.0, "redo": 3,
                                          "compile_s": 0.0, "compiled_ahead": False})


def test_a_recovery_over_several_processes_says_each_ones_compile_seconds_and_the_most():
  events, compiled, asked = Events(), [10.0], []

  def gather(step, seconds):
    asked.append((step, seconds))
    return {0: seconds, 1: 2.5, 2: None}  # process 2 was not heard from

  recoveries = Recoveries(events, lambda: compiled[0], gather=gather)
  recoveries.begin(100.0, 10.0).path = "live"
  compiled[0] = 10.5
  recoveries.finish(7, 0.125)
  assert asked == [(7, 0.5)]
  fields = events.rows[0][1]
  assert fields["compile_s"] == 2.5  # the slowest process's: the others wait for it
  assert fields["compile_s_by_process"] == [[0, 0.5], [1, 2.5], [2, None]]
  recoveries.begin(200.0, 10.5)
  recoveries.finish(9, None)  # no step on the plan: the processes are not asked
  assert asked == [(7, 0.5)] and "compile_s_by_process" not in events.rows[1][1]


def test_the_run_state_counts_redone_steps_after_a_rewind():
  state = RunState(frozenset())
  state.start_at(4, 40)
  state.advance(8)
  state.advance(8)
  assert (state.step, state.cursor, state.furthest, state.redoing) == (6, 56, 6, False)
  state.rewind(4, 40)
  assert state.redoing and state.furthest == 6


@dataclasses.dataclass(eq=False)
class Device:
  id: int
  process_index: int


class Heartbeat:
  def __init__(self):
    self.takeover_s, self.lost_processes, self.lost, self.taken = 2.0, set(), None, 0

  def take_over(self):
    self.taken += 1
    return set(self.lost_processes)


def guard_of_two_processes(per_process=4, **job_fields):
  """Process 0's guard in a job of two processes that take ``per_process`` consecutive devices
  of the two TP-4 replicas in turn (4: a replica each; 1: every TP group across both)."""
  devices = [Device(i, (i // per_process) % 2) for i in range(8)]
  heartbeat, store = Heartbeat(), KeyValueStore()
  job = Job(process_id=0, num_processes=2, heartbeat=heartbeat, client=store, **job_fields)
  logged, events = [], Events()
  guard = ProcessGuard(job, devices, lambda line, **_: logged.append(line), events)
  plan = make_plan(functools.partial(model_layouts, SMALL), tp=4, dp=2, failed=frozenset(),
                   batch_size=4)
  return guard, plan, heartbeat, store, logged, events


def test_the_guard_waits_for_every_process_and_raises_when_one_is_lost():
  guard, plan, heartbeat, store, _, _ = guard_of_two_processes(recoverable=True)
  assert guard.arrives_at_start(plan) and guard.arrives_before_sync(plan)
  assert guard.plan_processes(plan) == {0, 1}
  store.key_value_set(guard.arrival.key(3, 1, "start"), "1")
  guard.arrive(3, plan, "start")  # the peer is there: returns
  assert guard.arrival.key(3, 0, "start") in store.values
  heartbeat.lost_processes, heartbeat.lost = {1}, "lost process 1 of 2: no heartbeat"
  with pytest.raises(ProcessLost) as lost:
    guard.arrive(3, plan, "sync")
  assert lost.value.processes == {1} and heartbeat.taken == 1


def test_process_0_gathers_every_live_processs_compile_seconds_and_skips_a_lost_one():
  guard, plan, heartbeat, store, _, _ = guard_of_two_processes(recoverable=True)
  arrival = guard.arrival
  store.key_value_set("ntp_jax/report/0/7/compile_s/1", "0.25")
  assert guard.compile_seconds_of(7, plan, 0.5) == {0: 0.5, 1: 0.25}
  assert store.values["ntp_jax/report/0/7/compile_s/0"] == "0.5"
  heartbeat.lost_processes = {1}  # silent and lost: not waited for
  assert guard.compile_seconds_of(8, plan, 0.0) == {0: 0.0, 1: None}
  arrival.process_id = 1  # another process says its own and reads nothing
  assert arrival.report("compile_s", 9, "1.0", {0, 1}) == {}
  assert store.values["ntp_jax/report/0/9/compile_s/1"] == "1.0"


def test_tp_groups_across_processes_wait_at_the_start_of_a_step_only():
  guard, plan, *_ = guard_of_two_processes(per_process=1, recoverable=True)
  assert guard.arrives_at_start(plan) and not guard.arrives_before_sync(plan)


def test_a_recoverable_guard_turns_a_lost_process_into_failures_of_its_slots():
  guard, plan, _, _, logged, events = guard_of_two_processes(recoverable=True)
  lost = ProcessLost({1}, 5, "lost process 1 of 2: no heartbeat")
  failures = guard.take_loss(lost, 5, plan.tp, frozenset({(1, 2)}))
  # Slot 2 of replica 1 had failed already: the other three fail inside step 5.
  assert [(e.step, e.mid, e.kind, e.replica, e.slot) for e in failures] == [
      (5, True, "fail", 1, s) for s in (0, 1, 3)]
  assert guard.lost_processes == {1} and guard.live_processes() == {0}
  [(name, row)] = events.rows  # the row's time: when the loss was known
  assert name == "process_lost" and row.pop("time") == pytest.approx(time.time(), abs=60)
  assert row == {"step": 5, "processes": [1]}
  assert guard.arrival.epoch == 1 and "goes on without it" in logged[0]
  assert guard.job.lost == {1} and guard.job.speaker  # process 0 still speaks for the job


def test_a_guard_that_cannot_go_on_returns_the_stop_instead_of_ending_the_process():
  guard, plan, _, _, _, _ = guard_of_two_processes(recoverable=False, jit_checkpoint_s=0.0)
  state = RunState(frozenset(), plan=plan, step=5, cursor=20)
  stop = guard.stop(ProcessLost({1}, 5, "lost process 1 of 2"), state.just_in_time({}),
                    checkpoints=None)
  assert isinstance(stop, ProcessStop) and stop.status == LOST_EXIT_CODE
  assert stop.message == ("lost process 1 of 2; distributed.jit_checkpoint_s=0: no "
                          "just-in-time checkpoint; restart the job: with checkpoint.every=0 "
                          "it starts again from step 0")


def test_the_lowest_live_process_speaks_for_the_job(tmp_path):
  """Process 0 writes the metrics until it is lost; then the next live one appends to the same
  file (``Job.speaker``, asked at every write)."""
  from ntp_jax.training.metrics import MetricsWriter
  assert Job(0, 3).speaker and not Job(1, 3).speaker
  first, second = Job(0, 3), Job(1, 3)
  writers = [MetricsWriter(str(tmp_path), enabled=lambda j=j: j.speaker) for j in (first, second)]
  for writer in writers:
    writer.write({"step": 0})
  second.lost.add(0)  # process 0 is lost: process 1 speaks from now on
  for writer in writers[1:]:
    writer.write({"step": 1})
  with open(tmp_path / "metrics.jsonl") as f:
    assert f.read().splitlines() == ['{"step": 0}', '{"step": 1}']


def test_a_speaker_lost_before_writing_a_completed_steps_row_leaves_it_to_the_next(tmp_path):
  """Process 0 completes step 2 with the others but is lost before writing its row: process 1
  writes the rows it kept after the file's last step record (step 2 and the event after it)
  before its own, and none twice."""
  from ntp_jax.training.metrics import MetricsWriter, read_records
  first, second = Job(0, 3), Job(1, 3)
  writers = [MetricsWriter(str(tmp_path), enabled=lambda j=j: j.speaker) for j in (first, second)]
  for step in (0, 1):
    for writer in writers:
      writer.write({"step": step})
  writers[1].write({"step": 2})  # process 0 was lost before it wrote step 2's row
  writers[1].write({"event": "recovered", "step": 3})
  second.lost.add(0)
  writers[1].write({"event": "process_lost", "step": 3})
  writers[1].write({"step": 3})
  assert read_records(str(tmp_path / "metrics.jsonl")) == [
      {"step": 0}, {"step": 1}, {"step": 2}, {"event": "recovered", "step": 3},
      {"event": "process_lost", "step": 3}, {"step": 3}]


def test_the_next_speaker_counts_only_the_rows_of_this_run(tmp_path):
  """A resumed run: the file holds step 2 from the run before, not from this one; the next
  speaker still writes this run's step 2 that the lost speaker missed."""
  from ntp_jax.training.metrics import MetricsWriter, read_records
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"event": "start"}\n{"step": 1}\n{"step": 2}\n{"step": 3}\n')
  first, second = Job(0, 2), Job(1, 2)
  writers = [MetricsWriter(str(tmp_path), enabled=lambda j=j: j.speaker) for j in (first, second)]
  for writer in writers:
    writer.write({"event": "resume", "step": 1})
    writer.write({"step": 1})
  writers[1].write({"step": 2})  # process 0 was lost before it wrote this run's step 2
  second.lost.add(0)
  writers[1].write({"step": 3})
  assert read_records(str(path))[4:] == [{"event": "resume", "step": 1}, {"step": 1},
                                         {"step": 2}, {"step": 3}]
