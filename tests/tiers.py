"""Which tests run only in the full suite (``slow``): long end-to-end runs and the extra plans
of parity checks whose other plans stay in the fast tier.

Parity tests parametrized over TP groups keep four plans in the fast tier
(``tp_cases.FAST_GROUPS``); the rest of their plans are marked there.
``python -m pytest -m "not slow" -n 2`` keeps every sharded operation against its dense
reference (layouts, blocks, collectives, every layer, the whole GPT on an uneven plan and a
shared KV group, the cross-class sync exact on a mixed-degree plan, placement round trips,
live recovery, a checkpoint resume onto another plan, config errors). ``conftest.py`` marks
these ids and fails the run when one no longer names a collected test, so the list cannot
go stale silently. Multi-process tests are marked in their module (``multiprocess``, ``slow``).
"""

SLOW = {
    # Flops from XLA's cost analysis: the scheduling tests of wasted work, not parity.
    "tests/test_cost.py::test_every_device_of_a_reduced_replica_executes_within_2_percent_of_its_own_need",
    "tests/test_cost.py::test_healthy_replica_executes_its_own_work_only[1:1,1:2-2]",
    "tests/test_cost.py::test_healthy_replica_executes_its_own_work_only[1:2-3]",
    # The memory plan: gpt_8b on a CPU host; flops extended from 2 layers.
    "tests/test_footprint.py::test_gpt_8b_on_a_cpu_host_prints_the_plan_and_stops_in_one_line",
    "tests/test_footprint.py::test_flops_extended_from_two_layers_equal_the_unrolled_model",
    "tests/test_footprint.py::test_dry_run_allocates_nothing_and_reports_every_class",
    "tests/test_cost.py::test_a_scanned_program_is_refused_not_miscounted",
    # More plans of the GPT parity check (tp8-failed3 and tied tp8-failed3 stay fast; the
    # layers run on every fast plan in test_layers).
    "tests/test_model.py::test_gpt_loss_and_gradient_match_dense_reference[tp3-failednone]",
    "tests/test_model.py::test_gpt_loss_and_gradient_match_dense_reference[tp2-failednone]",
    "tests/test_model.py::test_gpt_loss_and_gradient_match_dense_reference[tp4-failed1]",
    "tests/test_model.py::test_gpt_loss_and_gradient_match_dense_reference[tp8-failed0,1,2,3]",
    "tests/test_model.py::test_gpt_loss_and_gradient_match_dense_reference[tp8-failed0]",
    "tests/test_model.py::test_gpt_loss_and_gradient_match_dense_reference[tp8-failed2,5]",
    "tests/test_model.py::test_gpt_loss_and_gradient_match_dense_reference[tp8-failed7]",
    "tests/test_model.py::test_gpt_loss_and_gradient_match_dense_reference[tp8-failednone]",
    "tests/test_model.py::test_tied_embeddings_loss_and_gradient_match_dense_reference[tp3-failednone]",
    "tests/test_model.py::test_scanned_unrolled_and_rematerialised_blocks_match_dense_reference[True-full]",
    "tests/test_model.py::test_scanned_unrolled_and_rematerialised_blocks_match_dense_reference[False-none]",
    "tests/test_model.py::test_scanned_unrolled_and_rematerialised_blocks_match_dense_reference[True-dots_with_no_batch_dims_saveable]",
    "tests/test_model.py::test_padding_stays_zero_after_optimizer_steps",
    # Mixed degrees on four plans in one subprocess of 24 devices, and the sync's identical
    # gradients on near-equal runs (the 4+3 plan against one device, and the nested regroup,
    # stay fast).
    "tests/test_nonuniform_dp.py::test_every_replica_has_identical_gradients_after_sync[near-equal-runs]",
    "tests/test_nonuniform_dp.py::test_mixed_degrees_match_single_device_in_subprocess",
    "tests/test_nonuniform_dp.py::test_proportional_shares_keep_global_batch_in_proportion_to_live_devices",
    "tests/test_nonuniform_dp.py::test_slot_weights_give_slow_slot_fewer_units_and_same_result",
    # Long runs through train(): the live failure-and-repair run and the detector stay fast.
    "tests/test_live_recovery.py::test_proportional_shares_equal_a_single_device_fed_the_same_sequences",
    "tests/test_live_recovery.py::test_failures_at_three_places_then_one_more",
    "tests/test_live_recovery.py::test_restart_path_and_a_failure_inside_a_step_give_the_same_losses",
    "tests/test_live_recovery.py::test_a_failure_that_drops_a_replica_live_equals_restart",
    "tests/test_live_recovery.py::test_one_replica_has_no_peer_and_falls_back_to_the_checkpoint",
    # Resume (restore onto other plans stays fast in test_placement_roundtrip).
    "tests/test_resume.py::test_resume_onto_a_reduced_replica_matches_the_uninterrupted_run",
    "tests/test_resume.py::test_resume_same_plan_gives_identical_losses",
    "tests/test_resume.py::test_sigkill_during_an_async_save_resumes_from_the_last_complete_step",
    "tests/test_resume.py::test_every_sequence_once_when_the_plan_loses_devices",
    "tests/test_resume.py::test_sigint_stops_after_the_step_with_one_line_and_whole_metrics",
    "tests/test_resume.py::test_a_finished_run_says_so",
    "tests/test_resume.py::test_checkpoint_of_another_model_and_a_damaged_one_are_one_line_errors",
    # 150 steps in two precisions; 30 steps from Hugging Face weights.
    "tests/test_precision.py::test_bf16_compute_tracks_fp32_over_150_steps",
    "tests/test_hf_train.py::test_training_from_hf_weights_keeps_them_at_lr_zero",
    # End-to-end runs whose output the full suite checks (test_train's parity run stays fast).
    "tests/test_train.py::test_default_tiny_run_lowers_the_loss",
    "tests/test_train.py::test_two_replicas_of_different_degree_match_single_device",
    "tests/test_train.py::test_metrics_jsonl_has_one_full_precision_record_per_step",
    "tests/test_output.py::test_validation_loss_summary_and_tensorboard",
    # Compiling ahead: two runs through a failure and a repair waiting for the background
    # compile, and the restart path (the bound, the cache folder, the lowered program's
    # independence of the failed slot and the config errors stay fast).
    "tests/test_precompile.py::test_a_recovery_compiled_ahead_compiles_nothing_and_changes_no_loss",
    "tests/test_precompile.py::test_the_restart_path_compiles_no_step_ahead_of_it",
    # Micro-batches: the single-class program and the two training runs against one pass
    # (the two-class program, the constant batch through a failure and a repair and through
    # a dropped replica stay fast).
    "tests/test_accumulate.py::test_micro_batched_steps_equal_single_pass_steps[4-1-2]",
    "tests/test_constant_batch.py::test_four_micro_batches_train_as_one_pass[mesh0]",
    "tests/test_constant_batch.py::test_four_micro_batches_train_as_one_pass[mesh1]",
}
