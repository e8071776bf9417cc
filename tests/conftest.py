"""Shared test fixtures: paths to the real third-party data beside the checkout."""
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED.is_dir():
        pytest.fail(f"shared data folder {SHARED} is missing: the tests need ../shared/data beside the checkout")
    return SHARED


@pytest.fixture(params=["compiled", "numpy"])
def loops(request, monkeypatch):
    """Run a test on the compiled loops (runtime/kernels/jit.py) and on the numpy fast paths."""
    from maceq.runtime.kernels import jit as k_jit

    if request.param == "numpy":
        monkeypatch.setenv("MACEQ_NO_JIT", "1")
        assert not k_jit.available()
    else:
        monkeypatch.delenv("MACEQ_NO_JIT", raising=False)
        monkeypatch.delenv("MACEQ_NO_BLAS_BINDING", raising=False)
        assert k_jit.available(), "numba is a dependency: the compiled loops must be available"
        # numpy's wheels ship OpenBLAS: the compiled convolutions must find its GEMMs, or they would
        # silently test the numpy paths twice
        assert k_jit.gemm_available(), "no CBLAS GEMM found in numpy's BLAS (runtime/kernels/blas.py)"
    return request.param


# ------------------------------------------------------------------------------------------------
# Test tiers. A test's own marker wins; otherwise its file's tier below, else "unit". Tests measured
# above 1.5 s on a 2-core development machine (an Intel Xeon, then an AMD EPYC) are also "slow":
# `pytest -m "not slow"` is the fast development tier; CI runs everything. Tests that need an outside
# program or package carry a needs_* marker too.

TIERS = ("unit", "oracle", "e2e")
FILE_TIER = {
    "oracle/": "oracle", "test_dw3x3_arm.py": "oracle", "test_float_neon.py": "oracle",
    "test_dsp_nnlib.py": "oracle", "test_nnlib_golden.py": "oracle", "test_gpu_opencl.py": "oracle",
    "test_properties.py": "oracle", "test_quantize_kernel.py": "oracle", "test_fast_paths.py": "oracle",
    "test_end_to_end.py": "e2e", "test_report_browser.py": "e2e", "test_mixed_precision.py": "e2e",
    "test_auto_mixed.py": "e2e", "test_hardening.py": "e2e", "test_parallel.py": "e2e", "test_ppocr.py": "e2e",
    "test_devices.py": "e2e", "test_bias_correction.py": "e2e", "test_report.py": "e2e", "test_budget.py": "e2e",
}
SLOW = (
    "oracle/test_activation_oracle.py::test_leaky_relu_all_codes_vs_tflite",
    "oracle/test_activation_oracle.py::test_prelu_all_codes_vs_tflite",
    "oracle/test_conv_oracle.py::test_conv2d_int8_per_channel_matches_tflite",
    "oracle/test_conv_oracle.py::test_conv2d_uint8_matches_tflite",
    "oracle/test_conv_oracle.py::test_depthwise_conv2d_matches_tflite[int8]",
    "oracle/test_eltwise_oracle.py::test_kernel_matches_neon_transcription_on_all_pairs",
    "oracle/test_eltwise_oracle.py::test_kernel_matches_transcription_on_saturation_and_int16_wrap",
    "oracle/test_eltwise_oracle.py::test_truncating_rescale_is_visible_and_modelled",
    "oracle/test_model_replay.py::test_every_layer_matches_its_oracle",
    "oracle/test_mul_oracle.py::test_mul_fast_equals_ref_every_pair",
    "test_analysis.py::test_accumulated_equals_numpy_over_two_images",
    "test_analysis.py::test_bad_inputs",
    "test_analysis.py::test_first_conv_isolated_equals_accumulated",
    "test_analysis.py::test_isolated_equals_numpy_quantized_inputs",
    "test_analysis.py::test_layers_are_the_uint8_nodes_by_exact_names",
    "test_analysis.py::test_op_runner_equals_run_op",
    "test_analysis.py::test_running_error_formulas_and_edge_cases",
    "test_analysis.py::test_source_path_gives_the_same_as_the_graph",
    "test_analysis.py::test_the_figures_do_not_depend_on_the_thread_count",
    "test_architecture.py::test_function_local_maceq_imports_only_for_optional_dependencies",
    "test_architecture.py::test_imports_go_one_way_down",
    "test_architecture.py::test_no_import_cycle_between_packages",
    "test_auto_mixed.py::",
    "test_bias_correction.py::test_cli_recipe_records_the_steps",
    "test_bias_correction.py::test_correction_is_what_the_written_model_computes",
    "test_budget.py::test_bad_input_exits_2_with_one_line",
    "test_budget.py::test_global_metrics",
    "test_budget.py::test_inf_sqnr_and_fp32_layers",
    "test_budget.py::test_junit_one_testcase_per_layer",
    "test_budget.py::test_one_layer_over_budget_then_relaxed",
    "test_budget.py::test_unmeasured_uint8_layer_fails_its_limits",
    "test_devices.py::test_gpu_float_path_stores_half_and_matches_opencl",
    "test_devices.py::test_gpu_opencl_backend_equals_simulation_fmnist",
    "test_devices.py::test_gpu_opencl_backend_equals_simulation_mobilenet_v2",
    "test_devices.py::test_one_model_per_device_with_its_scheme",
    "test_dsp_nnlib.py::test_node_calls_run_every_input_of_their_shape",
    "test_dsp_nnlib.py::test_supernode_ref_fast_equals_scalar",
    "test_dw3x3_arm.py::test_every_sweep_output_of_stock_mace_is_reproduced",
    "test_dw3x3_arm.py::test_every_uint8_tap_of_mobilenet_v2_is_reproduced",
    "test_dw3x3_arm.py::test_every_whole_model_output_of_stock_mace_is_reproduced",
    "test_end_to_end.py::",
    "test_equalize.py::test_float_function_is_kept_on_calibration_and_held_out_images",
    "test_equalize.py::test_quantized_cpu_layers_gain_from_equalization",
    "test_equalize.py::test_relu6_rule_moves_only_channels_below_the_clip",
    "test_equalize.py::test_replace_mode_is_exact_for_the_relu_graph_and_reaches_nagels_fixed_point",
    "test_fast_paths.py::test_conv2d_beyond_the_exact_region[compiled-2000-127-g64]",
    "test_fast_paths.py::test_conv2d_ties_and_the_negative_correction[compiled]",
    "test_fast_paths.py::test_conv2d_ties_and_the_negative_correction[numpy]",
    "test_fast_paths.py::test_depthwise_fast_equals_ref_random[compiled]",
    "test_fast_paths.py::test_depthwise_fast_equals_ref_random[numpy]",
    "test_fast_paths.py::test_depthwise_ties_and_the_negative_correction[compiled]",
    "test_fast_paths.py::test_eltwise_tables_equal_ref[compiled]",
    "test_fast_paths.py::test_eltwise_tables_equal_ref[numpy]",
    "test_fast_paths.py::test_model_on_fast_kernels_equals_reference_kernels",
    "test_fast_paths.py::test_requant_floor_terms_exact_ties",
    "test_fast_paths.py::test_requant_floor_terms_int32_edges",
    "test_fast_paths.py::test_requant_floor_terms_random",
    "test_float_neon.py::test_gemm_is_an_fma_chain_over_depth[compiled]",
    "test_float_neon.py::test_golden_mobilenet_v2_fp32_whole_model",
    "test_float_ops.py::test_mace_reference_float_model_matches_onnxruntime",
    "test_fuzz_smoke.py::test_target_seeds_regressions_and_mutations",
    "test_gpu_opencl.py::test_conv_random_configs_opencl_equals_numpy_and_scalar_ref",
    "test_hardening.py::test_cli_name_is_checked_before_any_folder_is_made",
    "test_hardening.py::test_cli_name_with_a_path_is_refused_inside_the_output_folder",
    "test_hardening.py::test_rerun_gives_bit_identical_outputs",
    "test_hardening.py::test_sigkill_at_any_moment_leaves_the_old_set_or_no_model_and_a_rerun_succeeds",
    "test_hardening.py::test_single_image_calibration",
    "test_hardening.py::test_sources_only_safe_load_yaml_and_never_unpickle",
    "test_hardening.py::test_very_large_images_are_streamed_in_bounded_memory",
    "test_heap.py::test_a_model_section_sets_the_heap_and_opt_out_leaves_it",
    "test_mixed_precision.py::test_cli_auto_mode_flags",
    "test_mixed_precision.py::test_mixed_model_accuracy",
    "test_model_patterns.py::test_a_model_whose_cpu_result_is_undefined_is_not_written",
    "test_parallel.py::",
    "test_ppocr.py::",
    "test_properties.py::test_gpu_requantize_float32_rte",
    "test_properties.py::test_gpu_requantize_per_channel_vectorised",
    "test_properties.py::test_multiply_by_quantized_multiplier",
    "test_properties.py::test_nnlib_d32_requant",
    "test_properties.py::test_nnlib_float_to_int_conversions",
    "test_properties.py::test_nnlib_quantize_requant_and_range_limits",
    "test_properties.py::test_quantize_multiplier_float32_range",
    "test_properties.py::test_quantize_multiplier_float64",
    "test_properties.py::test_round_half_away_matches_c_round",
    "test_properties.py::test_rounding_divide_by_pot",
    "test_properties.py::test_srdhm_matches_gemmlowp",
    "test_properties.py::test_srdhm_vectorised_elementwise",
    "test_quantize_kernel.py::test_quantize_matches_exact_transcription_on_halfway_points",
    "test_report.py::",
    "test_report_browser.py::",
    "test_threads.py::test_a_run_drops_each_tensor_after_its_last_reader",
    "test_threads.py::test_every_tensor_is_the_same_with_any_number_of_threads",
    "test_threads.py::test_input_quantize_range_is_per_batch",
)
NEEDS = {"test_report_browser.py::": "needs_chromium", "test_gpu_opencl.py::": "needs_opencl",
         "test_devices.py::test_gpu_opencl": "needs_opencl", "test_parallel.py::test_ray": "needs_ray",
         "test_parallel.py::test_mixed_precision_on_ray": "needs_ray"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = item.nodeid.split("tests/", 1)[-1]
        if not any(item.get_closest_marker(t) for t in TIERS):
            tier = next((t for f, t in FILE_TIER.items() if rel.startswith(f)), "unit")
            item.add_marker(getattr(pytest.mark, tier))
        if rel.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
        for prefix, mark in NEEDS.items():
            if rel.startswith(prefix):
                item.add_marker(getattr(pytest.mark, mark))
