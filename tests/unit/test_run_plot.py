"""``goodput.png`` covers the whole run across resumes (``ntp_jax.training.run_plot``): the series
are gathered from every session of ``metrics.jsonl`` (a real stopped and resumed run:
``tests/integration/test_run_plot_sessions.py``)."""

import json

from ntp_jax.training.run_plot import gather_series, run_title


def test_crashes_failures_and_repairs_are_marked_and_redone_steps_drawn_once(tmp_path):
  plan = {"tp": 4, "dp": 2, "replicas": [{"live_slots": [0, 1, 2, 3]}] * 2}
  reduced = {**plan, "replicas": [{"live_slots": [0, 1, 2, 3]}, {"live_slots": [0, 1, 3]}]}
  step = lambda s, loss: {"step": s, "loss": loss, "tokens": 100, "step_time_s": 0.5}  # noqa: E731
  rows = [{"event": "start", "step": 0, "plan": {"tp": 9}}, step(0, 9.0),
          {"event": "end", "step": 1},
          {"event": "start", "step": 0, "plan": plan}, step(0, 5.0), step(1, 4.0),
          {"event": "fail", "step": 2, "replica": 1, "slot": 2, "mid": True}, step(2, 3.5),
          # a crash: no stop row; the resume redoes step 2
          {"event": "resume", "step": 2, "plan": reduced}, step(2, 3.0),
          {"event": "repair", "step": 3, "replica": 1, "slot": 2}, step(3, 2.0)]
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  series = gather_series(str(path))
  assert series.steps == [0, 1, 2, 3] and series.loss == [5.0, 4.0, 3.0, 2.0]  # the last run
  assert series.tokens_per_s == [200.0] * 4
  assert [(m.kind, m.label) for m in series.marks] == [
      ("fail", "fail 2.mid@1:2"), ("resume", "resume at 2 after a crash"),
      ("repair", "repair 3@1:2")]
  title = run_title("runs/x", {"factory": "examples.mlp_lm:model_spec"}, series)
  assert title == ("runs/x: examples.mlp_lm:model_spec; mesh 2 x 4, TP degrees 4,4 -> 4,3, "
                   "2 sessions")


def test_a_stop_by_a_hook_is_marked_with_the_hook(tmp_path):
  rows = [{"event": "start", "step": 0, "plan": {"tp": 2}},
          {"step": 0, "loss": 5.0, "tokens": 100, "step_time_s": 0.5},
          {"event": "stop", "step": 1, "hook": "Watch.on_step", "error": "ValueError: x",
           "checkpoint": None}]
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert [m.label for m in gather_series(str(path)).marks] == ["stop (hook Watch.on_step)"]


def test_the_title_names_every_tp_degree_the_run_went_through(tmp_path):
  """A failure then its repair: 8 -> 7 -> 8, not the start alone (nor start and end, equal)."""
  plan = {"tp": 8, "dp": 1, "replicas": [{"live_slots": list(range(8))}]}
  step = lambda s, degree: {"step": s, "loss": 1.0, "tokens": 100,  # noqa: E731
                            "step_time_s": 0.5, "tp_degree": degree, "tp_degrees": [degree]}
  rows = [{"event": "start", "step": 0, "plan": plan}, step(0, 8), step(1, 8),
          {"event": "fail", "step": 2, "replica": 0, "slot": 3}, step(2, 7), step(3, 7),
          {"event": "repair", "step": 4, "replica": 0, "slot": 3}, step(4, 8)]
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  title = run_title("runs/x", {"factory": "models.gpt:model_spec"}, gather_series(str(path)))
  assert title == "runs/x: models.gpt:model_spec; mesh 1 x 8, TP degrees 8 -> 7 -> 8"
  # A long history keeps its ends and counts the changes.
  rows += [step(5 + i, degree) for i, degree in enumerate([7, 6, 5, 4, 3, 2])]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  title = run_title("runs/x", {"factory": "models.gpt:model_spec"}, gather_series(str(path)))
  assert title.endswith("TP degrees 8 -> 7 -> 8 -> ... (8 changes) -> 4 -> 3 -> 2"), title
