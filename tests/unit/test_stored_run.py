"""The one reader of a stored run (ntp_jax.training.stored_run): where it is found, what older
metadata may lack, and one line naming the file for bad metadata."""

import os
import time

import numpy as np
import pytest

from ntp_jax.state.checkpoint import CheckpointError, Checkpoints, restart_hint
from ntp_jax.training.stored_run import open_stored_run

PARAMS = {("params", "w"): np.arange(6, dtype=np.float32).reshape(2, 3),
          ("opt_state", "mu", "w"): np.zeros((2, 3), np.float32)}
CONFIG = {"model": {"factory": "examples.mlp_lm:model_spec", "vocab_size": 512},
          "train": {"seq_len": 64, "steps": 10, "schedule_steps": 12}, "data": {"path": "x.bin"}}
PLAN = {"tp": 2, "dp": 1, "replicas": [{"replica": 0, "live_slots": [0, 1]}], "global_batch": 4}


def _save(directory, step, meta):
  checkpoints = Checkpoints(str(directory), asynchronous=False)
  checkpoints.save(step, PARAMS, meta)
  checkpoints.close()


def test_a_current_checkpoint_from_its_workdir_checkpoints_or_step_folder(tmp_path):
  _save(tmp_path / "checkpoints", 3, {"data_cursor": 12, "plan": PLAN, "config": CONFIG})
  (tmp_path / "checkpoints" / "tokenizer.json").write_text("{}")
  for where in (tmp_path, tmp_path / "checkpoints", tmp_path / "checkpoints" / "3"):
    run = open_stored_run(str(where), field="--from")
    assert (run.step, run.data_cursor, run.plan, run.just_in_time) == (3, 12, PLAN, False)
    assert run.directory == str(tmp_path / "checkpoints") and run.workdir == str(tmp_path)
    assert run.step_dir == str(tmp_path / "checkpoints" / "3")
    assert (run.seq_len, run.schedule_steps, run.factory) == (64, 12, CONFIG["model"]["factory"])
    assert (run.init_from, run.data_path) == ("", "x.bin")
    assert run.tokenizer_file == str(tmp_path / "checkpoints" / "tokenizer.json")
    assert run.param_shapes == {("params", "w"): ((2, 3), "float32")}  # no optimizer state
    assert run.written("model.vocab_size") == 512 and run.written("model.d_ff") is None


def test_what_older_metadata_may_lack(tmp_path):
  """No plan, no data cursor, a config without schedule_steps, model or data: what stands in."""
  _save(tmp_path, 2, {"config": {"train": {"steps": 10}}})
  run = open_stored_run(str(tmp_path), field="--checkpoint")
  assert (run.plan, run.data_cursor, run.seq_len) == (None, None, None)
  assert run.schedule_steps == 10  # train.steps before schedule_steps existed
  assert (run.factory, run.init_from, run.data_path, run.tokenizer_file) == (None, "", "", None)
  with pytest.raises(CheckpointError, match=r"^checkpoint .*/2: its metadata holds no model "
                                            r"config$"):
    run.model_spec()


@pytest.mark.parametrize("meta,message", [
    ({"data_cursor": "12"}, "data_cursor is '12', not a whole number >= 0"),
    ({"data_cursor": -1}, "data_cursor is -1, not a whole number >= 0"),
    ({"plan": [1, 2]}, "plan is [1, 2], not a plan summary"),
    ({"config": "gpt_tiny"}, "config is 'gpt_tiny', not a mapping"),
])
def test_bad_metadata_is_one_line_naming_the_file(tmp_path, meta, message):
  _save(tmp_path, 5, meta)
  with pytest.raises(CheckpointError) as err:
    open_stored_run(str(tmp_path), field="--from")
  assert str(err.value) == f"checkpoint {os.path.join(tmp_path, '5', 'meta')}: {message}"


def test_where_there_is_no_run_is_one_line_naming_the_flag(tmp_path):
  with pytest.raises(CheckpointError, match=r"^--from: no folder /no/such$"):
    open_stored_run("/no/such", field="--from")
  with pytest.raises(CheckpointError, match=r"^--checkpoint: .* holds no complete checkpoint, "
                                            r"see$"):
    open_stored_run(str(tmp_path), field="--checkpoint", hint=", see")
  _save(tmp_path, 1, {})
  with pytest.raises(CheckpointError, match=r"^--step: .*/4 is not a complete checkpoint "
                                            r"\(complete steps: 1\)$"):
    open_stored_run(str(tmp_path), 4, field="--checkpoint")


def test_a_reader_leaves_the_unfinished_save_of_a_writer_alone(tmp_path):
  """A run in progress may be filling a step's temporary folder while generation or an export
  reads the same folder: only a writer removes unfinished saves."""
  _save(tmp_path, 1, {})
  unfinished = tmp_path / "2.orbax-checkpoint-tmp"
  (unfinished / "state.orbax-checkpoint-tmp").mkdir(parents=True)
  assert open_stored_run(str(tmp_path), field="--from").step == 1
  time.sleep(0.5)  # orbax removes temporary folders in a background thread
  assert unfinished.is_dir()


def test_a_stopping_process_names_only_a_checkpoint_that_exists(tmp_path):
  """``restart_hint``: the newest complete step folder, never an unfinished or absent one."""
  directory = tmp_path / "checkpoints"
  assert restart_hint(None) == ("restart the job: with checkpoint.every=0 it starts again "
                                "from step 0")
  nothing = f"restart the job: no checkpoint was written to {directory} yet, so it starts " \
            "again from step 0"
  assert restart_hint(str(directory)) == nothing  # no folder at all
  _save(directory, 3, {"data_cursor": 12, "plan": PLAN, "config": CONFIG})
  os.makedirs(directory / "7")  # a save cut short: no commit metadata, no items
  os.makedirs(directory / "7.orbax-checkpoint-tmp")
  assert restart_hint(str(directory)) == f"restart the job: it resumes from {directory / '3'}"
