"""The fast lane: ``pytest -m "not slow"`` runs every capability's quick tests in under three
minutes on the 2-core CI machine; ``pytest`` runs everything (CI's command).

A test is slow where its file marks it (``@pytest.mark.slow``) or where it is listed in
``SLOW`` below: the longest test functions by ``pytest --durations=0`` of a fresh clone on the
2-core machine (2026-11-26: 1,402 s in all), taken longest first until the rest came under
100 s of test time (the figure beside each file is what its listed tests took there). Listing
them here, rather than in each test file, keeps the test files themselves as they were. Every
capability keeps at least one fast test: a lane that would leave a test file with none is
refused at collection.
"""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers on two cores: one thread each, before torch
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

if not torch.cuda.is_available():  # before any test imports triton (ember.kernels does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

SLOW: dict[str, tuple[str, ...]] = {
    "test_analysis.py": (  # 72 s
        "test_cli_writes_results_for_every_checkpoint",
        "test_determinism_finds_no_difference_or_the_first_one",
        "test_lanczos_and_hutchinson_equal_the_dense_hessian",
        "test_nonfinite_names_the_module_where_a_step_first_goes_wrong",
        "test_trainer_logs_dynamics_every_n_steps_and_the_report_plots_them",
    ),
    "test_architecture.py": (  # 6 s
        "test_a_new_task_is_one_class_and_one_registry_line",
        "test_the_checker_sees_a_planted_defect",
    ),
    "test_comm.py": (  # 18 s
        "test_bad_arguments_exit_2_with_a_reason",
        "test_two_gloo_ranks_time_every_collective_and_get_it_right",
    ),
    "test_config.py": (  # 5 s
        "test_config_keys_cover_every_leaf",
        "test_every_declared_choice_and_bound_is_enforced",
        "test_round_trip_property",
    ),
    "test_dpo.py": (  # 24 s
        "test_bad_dpo_data_is_a_clear_error",
        "test_dpo_runs_start_at_log2_log_trls_metrics_and_resume_bitwise",
        "test_dpo_with_the_models_own_replies_runs",
        "test_loss_and_metrics_equal_trls",
    ),
    "test_engine.py": (  # 91 s
        "test_batched_greedy_equals_each_prompt_alone_and_the_uncached_loop",
        "test_cache_matches_full_forward_at_every_step",
        "test_compiled_engine_generates_what_the_eager_engine_does",
        "test_compiled_engines_of_two_models_keep_their_own_graphs",
        "test_compiled_training_blocks_run_eagerly_with_a_cache",
        "test_engine_parity_for_a_batch_of_mixed_length_prompts",
        "test_greedy_is_deterministic_and_seeds_reproduce",
        "test_left_padded_rows_match_each_row_alone_at_every_step",
        "test_repeated_prompts_are_prefilled_once_and_sample_as_rows_of_their_own",
        "test_static_cache_decode_compiles_to_one_graph_that_matches_the_eager_cache",
    ),
    "test_evaluate.py": (  # 21 s
        "test_any_source_and_checkpoints",
        "test_chat_cli",
        "test_eval_cli_prints_paths_literally_and_counts",
        "test_generate_cli",
        "test_stride_per_stratum_and_eval_json_accumulates",
        "test_test_split",
        "test_val_split_matches_the_trainer",
    ),
    "test_export.py": (  # 29 s
        "test_a_layout_hf_cannot_hold_is_named",
        "test_an_architecture_ember_cannot_represent_is_named",
        "test_bad_input_is_one_line_and_writes_nothing",
        "test_import_a_checkpoint_made_by_transformers",
        "test_round_trip_is_bit_exact_and_the_import_is_a_run",
        "test_transformers_loads_the_export_without_ember",
        "test_unreadable_hf_folders_are_named",
    ),
    "test_export_graph.py": (  # 77 s
        "test_graph_matches_eager_at_three_shapes",
        "test_onnx_decode_graph_greedy_matches_ember",
    ),
    "test_grpo.py": (  # 23 s
        "test_bad_grpo_setups_are_clear_errors",
        "test_grpo_runs_log_rewards_and_resume_bitwise_mid_rollout",
        "test_loss_gradient_and_metrics_equal_trls",
        "test_rollouts_train_the_completions_score_them_and_are_seeded",
    ),
    "test_hf_parity.py": (  # 1 s
        "test_from_hf_round_trip",
        "test_to_hf_same_logits",
    ),
    "test_import_stock.py": (  # 6 s
        "test_bad_stock_folders_are_named",
        "test_eval_scores_text_bytes",
        "test_export_back_to_hf_is_the_same_model",
        "test_greedy_generation_equals_transformers",
        "test_sft_from_an_imported_run_adds_the_chat_tokens",
        "test_specials_come_from_the_folder",
    ),
    "test_init.py": (  # 1 s
        "test_plain_model_matches_reference_init",
        "test_swapped_modules_initialise_themselves",
    ),
    "test_lora.py": (  # 11 s
        "test_lora_sft_run_resumes_bitwise_saves_adapters_only_and_exports_merged",
        "test_peft_loads_embers_adapters_on_the_exported_base",
        "test_the_written_out_backward_equals_autograds",
        "test_with_chat_tokens_only_their_embedding_rows_move",
    ),
    "test_losses.py": (  # 1 s
        "test_trainer_trains_on_the_z_loss_it_is_given",
    ),
    "test_model.py": (  # 2 s
        "test_cache_protocol_matches_full_forward",
        "test_overfits_one_batch",
    ),
    "test_optim.py": (  # 0 s
        "test_checkpoint_from_before_per_group_lrs_loads",
    ),
    "test_paged.py": (  # 0 s
        "test_packed_chunks_and_decode_equal_the_full_forward",
    ),
    "test_plan.py": (  # 21 s
        "test_cli_prints_the_plan_and_refuses_an_impossible_layout",
        "test_one_process_prediction_is_within_10_percent",
    ),
    "test_precision.py": (  # 3 s
        "test_fp16_autocast_with_a_live_scaler_trains_close_to_fp32",
    ),
    "test_prepare.py": (  # 40 s
        "test_cli_errors_exit_2_without_traceback",
        "test_cli_prepare_stats_and_errors",
        "test_every_verb_has_help",
        "test_prepare_memory_does_not_grow_with_the_corpus",
    ),
    "test_qat.py": (  # 9 s
        "test_init_from_refuses_what_cannot_start_this_model",
        "test_init_from_starts_from_the_source_weights_and_resume_wins",
        "test_qat_run_trains_and_ember_quantize_stores_what_it_saw",
    ),
    "test_quantize.py": (  # 14 s
        "test_a_quantized_run_is_an_ordinary_run",
        "test_bad_input_is_one_line_exit_2_and_nothing_written",
        "test_float_head_and_records_from_before_the_int8_head",
        "test_quantized_model_swaps_the_block_linears_and_the_head_and_stays_close",
        "test_quantizing_a_quantized_run_or_refusing_force_is_clear",
        "test_report_measures_fp32_and_each_scheme",
    ),
    "test_report.py": (  # 5 s
        "test_compare_runs_config_diff",
        "test_data_manifest_summary",
        "test_same_name_runs_get_distinct_labels",
        "test_single_run_report",
    ),
    "test_reward.py": (  # 18 s
        "test_grpo_rewards_are_sigma_of_the_reward_models_score",
        "test_reward_model_learns_an_easy_preference",
        "test_reward_model_setups_are_clear_errors",
        "test_reward_model_trains_ranks_held_out_pairs_and_resumes_bitwise",
    ),
    "test_schedule.py": (  # 4 s
        "test_trainer_applies_the_schedule_from_warmup_to_the_floor",
    ),
    "test_scheduler.py": (  # 44 s
        "test_greedy_answers_equal_the_batch1_engine",
        "test_seeded_sampling_does_not_depend_on_the_batch",
    ),
    "test_server.py": (  # 27 s
        "test_dropped_stream_frees_its_blocks_and_the_queue_is_bounded",
        "test_errors_have_openai_shape_and_status",
        "test_faults_leave_the_server_serving",
        "test_lm_evaluation_harness_against_the_server",
        "test_openai_client_chat",
        "test_openai_client_completions_equal_the_engine",
    ),
    "test_sft.py": (  # 15 s
        "test_sft_from_a_jsonl_file_and_bad_rows",
        "test_sft_learns_and_eval_task_scores_it",
        "test_sft_resumes_bit_for_bit_with_its_epoch_cursor",
        "test_the_exported_chat_template_gives_embers_ids",
    ),
    "test_shards.py": (  # 0 s
        "test_round_trip_property",
    ),
    "test_splits.py": (  # 1 s
        "test_fallback_when_python_ships_no_test_suite",
        "test_the_sample_follows_the_bytes_of_each_kind_of_file",
    ),
    "test_sweep.py": (  # 1 s
        "test_failed_run_is_reported_and_left_out",
        "test_a_config_per_setting",
    ),
    "test_tasks.py": (  # 1 s
        "test_problems_are_seeded_and_splits_are_disjoint",
    ),
    "test_tokenizer.py": (  # 1 s
        "test_bpe_round_trips_any_unicode",
        "test_char_round_trips_over_alphabet",
    ),
    "test_trainer.py": (  # 71 s
        "test_accumulation_matches_one_big_micro_batch",
        "test_activation_checkpointing_equals_plain",
        "test_bf16_autocast_trains_close_to_fp32",
        "test_checkpoint_of_the_nested_optimizer_format_still_loads",
        "test_each_group_follows_the_schedule_from_its_own_peak",
        "test_exact_resume_is_bitwise",
        "test_explicit_resume_from_an_older_step_is_refused",
        "test_half_written_checkpoint_is_ignored",
        "test_keep_best_exports_the_best_weights_with_the_default_checkpoint_cadence",
        "test_keep_last_and_keep_best",
        "test_metrics_without_a_committed_checkpoint_are_refused_not_appended_to",
        "test_muon_exact_resume_is_bitwise",
        "test_no_validation_split_trains_without_eval",
        "test_nonfinite_skip_counts_and_continues",
        "test_nonfinite_skip_every_step_still_ends_at_the_budget",
        "test_nonfinite_stops_and_names_the_module",
        "test_refuses_to_overwrite_an_existing_run",
        "test_resume_keeps_one_history_in_metrics",
        "test_resume_with_a_changed_config_names_each_key",
        "test_resuming_a_finished_run_changes_nothing",
        "test_run_directory_outputs_and_weights",
        "test_sigkill_mid_run_resumes_from_last_commit",
        "test_step_and_token_budgets",
        "test_time_budget",
    ),
}
# A capability whose file marks every test slow keeps one in the lane, by its full id.
FAST: dict[str, tuple[str, ...]] = {
    "test_hangs.py": ("test_a_rank_that_exits_or_hangs_is_named_within_the_timeout[exit-rank 1 has exited]",),
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        path, _, name = item.nodeid.partition("::")
        file = path.rsplit("/", 1)[-1]
        if name.split("[")[0] in SLOW.get(file, ()):
            item.add_marker(pytest.mark.slow)
        if name in FAST.get(file, ()):
            item.own_markers[:] = [m for m in item.own_markers if m.name != "slow"]
    if "not slow" not in (config.getoption("markexpr") or ""):
        return
    files: dict[str, bool] = {}
    for item in items:
        path = item.nodeid.partition("::")[0]
        files[path] = files.get(path, False) or item.get_closest_marker("slow") is None
    bare = sorted(path for path, fast in files.items() if not fast)
    if bare and len(files) >= 10:  # (the whole suite, not a file or two picked by hand)
        raise pytest.UsageError(f"the fast lane would leave no test of {', '.join(bare)}; keep one fast")
