"""Every fixture of the suite (the helpers are in _helpers.py):

* ``shm_dir``: a private directory on /dev/shm (a real tmpfs) for every test, so leak checks
  only see that test's segments;
* ``tmpfs``: a freshly mounted 64 MiB tmpfs, for capacity checks and leak checks that count the
  filesystem's bytes (skipped, with the reason, where ``mount`` is not allowed);
* ``children``: starts ``tests/children/job.py`` processes and kills what is left of them;
* ``process_group_of_one``: a real gloo process group of one rank in the test's process;

and Hypothesis's profile: derandomized, with no example database, so that CI sees what a
developer sees, and no deadline, so that no example fails by time. The inputs are the same on
every run of the same tests, not of one test alone: Hypothesis (6.170) also draws constants
found in the loaded modules of the project, so the whole suite, the fast loop, one file and
``-k`` may give a test different inputs. A fuzz test's asserted counts therefore hold with a
wide margin in randomized runs, not only in the derandomized one.

It also marks the tests that the fast loop leaves to CI (see NOTE [ The fast loop ] below).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import warnings

import pytest
import torch.distributed as dist
from hypothesis import settings

from _helpers import Child, free_port

SHM_ROOT = "/dev/shm"

settings.register_profile("stocaching", deadline=None, derandomize=True, database=None,
                          print_blob=False)
settings.load_profile("stocaching")

# NOTE [ The fast loop ]
# `python -m pytest -q -m "not slow"` runs tests of every file and of every module of stocaching
# in about 2 minutes on 2 cores; `python -m pytest -q` (CI, .ci/run) runs everything, about 20
# minutes. `slow` is added here, in one place, from measured durations (`--durations=0`, the
# whole suite on 2 cores shared with other jobs, 2026-11): every test that took 1.5 s or more,
# and each start-method variant (a test id naming spawn, forkserver or torchrun; the fork
# variant, a fraction of a second, stays). A few tests also carry @pytest.mark.slow in their
# files. KEEP holds the exceptions that keep a test of every file, and the command line, in the
# loop. A new test that takes seconds belongs in SLOW: the fast loop names those that took over
# FAST_BUDGET_S at its end.
SLOW_VARIANTS = {"spawn", "forkserver", "torchrun"}

# "file::test" covers every parametrization of the test; "file::test[id]" that one. Seconds as
# measured (all parametrizations together).
SLOW = {
    "tests/test_wrapper.py::test_two_processes_storing_different_values_are_told_the_split_point",  # 11 s
    # the holder's first attempt with stdin open (KEEP has the closed one)
    "tests/test_restarts.py::"
    "test_a_first_attempt_with_no_holder_to_ask_leaves_the_leaders_descriptors_alone[open]",  # 7 s
    # a DataLoader run in a container's limits (a memory cgroup, a 64 MiB /dev/shm)
    "tests/test_containers.py::test_auto_sizes_within_the_memory_limit_and_a_loader_runs",  # 12 s
    "tests/test_containers.py::test_auto_never_fails_a_loader_of_float_batches_that_runs_without_it",  # 60 s
    "tests/test_containers.py::test_auto_with_a_disk_tier_under_a_memory_limit_serves_float_batches",  # 30 s
    "tests/test_containers.py::test_auto_under_mp_spawn_leaves_room_for_spawned_workers",
    "tests/test_containers.py::test_auto_under_a_limit_never_fails_a_loader_that_runs_without_it",
    # torture, fuzz, endurance, kills and fault-injection matrices
    "tests/test_batch.py::test_a_writer_killed_mid_copy_leaves_a_miss_in_a_batch",  # 3 s
    "tests/test_concurrency.py::test_torture_reads_are_never_corrupt",  # 31 s
    "tests/test_endurance.py::test_workers_recreated_every_epoch_leak_nothing",  # 33 s
    "tests/test_faults.py::test_fault_cell",  # 177 s (45 cells)
    "tests/test_faults.py::test_sigkill_at_random_times_during_big_writes",  # 5 s
    "tests/test_faults.py::test_writer_dying_after_state_set_leaves_slot_writable",  # 8 s
    "tests/test_fields.py::test_a_writer_of_a_fields_sample_killed_mid_write_leaves_a_miss",  # 7 s
    "tests/test_fields.py::test_random_operations_on_a_fields_cache_match_a_model",  # 2 s
    "tests/test_fuzz.py::test_cache_matches_model",  # 34 s
    "tests/test_fuzz_samples.py::test_fields_and_open_sizes_match_model",  # 15 s
    "tests/test_lifecycle.py::test_nothing_left_after_any_exit",  # 24 s
    "tests/test_persistent.py::"
    "test_a_slot_half_written_when_a_job_was_killed_is_a_miss_in_the_next_job",  # 6 s
    "tests/test_saved.py::test_a_save_killed_mid_write_leaves_the_previous_file_loadable",  # 6 s
    "tests/test_prefetch.py::test_sigkill_of_the_trainer_leaves_nothing",  # 7 s
    "tests/test_prefetch_closing.py::"
    "test_ending_in_any_order_is_quiet_and_frees_the_staging_area",  # 24 s (10 cells)
    "tests/test_prefetch_processes.py::"
    "test_sigkill_of_the_trainer_takes_its_loader_processes_along",  # 17 s
    "tests/test_open_size.py::test_a_writer_killed_mid_write_leaves_a_miss",  # 8 s
    "tests/test_open_size.py::test_writers_and_clears_never_give_a_torn_sample",  # 4 s
    # trainers: Lightning, Hugging Face, Accelerate, Ray Train and their examples in the docs
    "tests/test_trainers.py::"
    "test_accelerate_prepare_deals_each_rank_its_own_cache_aware_batches",  # 20 s
    "tests/test_trainers.py::"
    "test_accelerate_prepare_of_a_per_rank_sampler_warns_once_with_the_fix",  # 12 s
    "tests/test_trainers.py::test_each_trainers_example_in_the_docs_runs_as_shown",  # 59 s
    "tests/test_trainers.py::"
    "test_hugging_face_trainer_resumed_mid_epoch_trains_the_rest_of_that_epoch",  # 73 s
    "tests/test_trainers.py::"
    "test_hugging_face_trainer_trains_each_rank_on_its_cache_aware_batches",  # 34 s
    "tests/test_trainers.py::test_lightning_cache_made_before_the_launch_fails_at_once",  # 17 s
    "tests/test_trainers.py::test_lightning_trains_each_rank_on_its_own_cache_aware_share",  # 35 s
    "tests/test_trainers.py::"
    "test_lightning_wrapping_a_sampler_that_is_not_distributed_warns_once_with_the_fix",  # 20 s
    "tests/test_ray.py::"
    "test_a_dataset_holding_a_cache_in_train_loop_config_fails_at_fit_with_the_advice",  # 14 s
    "tests/test_ray.py::"
    "test_ray_places_three_workers_2_plus_1_and_the_process_group_reconciles_the_nodes",  # 58 s
    "tests/test_ray.py::"
    "test_ray_workers_that_build_the_dataset_in_train_loop_per_worker_share_one_cache",  # 57 s
    "tests/test_ray.py::"
    "test_the_advice_sent_in_train_loop_config_builds_one_cache_per_node",  # 53 s
    # several ranks: torchrun, mp.spawn, two nodes, a rank waiting for another
    "tests/test_launchers.py::"
    "test_a_leader_done_before_another_rank_constructs_waits_for_it",  # 7 s
    "tests/test_launchers.py::"
    "test_a_leader_waits_for_missing_ranks_only_while_one_may_come",  # 9 s
    "tests/test_launchers.py::test_mp_spawn_ranks_share_one_cache",  # 10 s
    "tests/test_launchers.py::"
    "test_readme_example_under_torchrun_with_every_rank_reading_every_index",  # 9 s
    "tests/test_mixtures.py::"
    "test_torchrun_two_ranks_cover_the_mixture_and_resume_from_rank_1",  # 6 s
    "tests/test_prefetch.py::test_ddp_two_ranks_one_cache_each_index_once",  # 6 s
    "tests/test_sampler.py::"
    "test_a_torchrun_job_resumed_on_another_number_of_ranks_gives_every_index_once",  # 20 s
    "tests/test_processes.py::test_mismatched_configuration_is_named",  # 6 s
    "tests/test_processes.py::test_real_torchrun_two_local_ranks",  # 4 s
    "tests/test_processes.py::test_two_local_ranks_share_one_segment",  # 9 s
    "tests/test_processes.py::test_two_nodes_under_real_torchrun",  # 11 s
    "tests/test_processes.py::test_waiting_rank_names_the_leader_that_never_came",  # 3 s
    "tests/test_saved.py::test_two_local_ranks_under_torchrun_load_once",  # 5 s
    "tests/test_disk_tier.py::test_two_torchrun_ranks_read_each_others_tier_rows",  # 4 s
    # a fresh interpreter: the command line, copied modules, new processes, the benchmark
    "tests/test_benchmark.py::"
    "test_persistent_command_prints_its_checks_and_leaves_nothing",  # 29 s
    "tests/test_benchmark.py::test_latency_command_prints_one_line_per_target",  # 2 s
    "tests/test_benchmark.py::test_quality_command_runs",  # 6 s
    "tests/test_benchmark.py::test_run_end_to_end",  # 4 s
    "tests/test_benchmark.py::test_run_spawn_persistent_views_release_the_cache",  # 8 s
    "tests/test_benchmark.py::test_run_varied_sizes_end_to_end",  # 3 s
    "tests/test_benchmark.py::test_run_with_repeats",  # 2 s
    "tests/test_benchmark.py::test_run_with_a_tiered_arm_checks_it_against_both_caches",  # 4 s
    "tests/test_benchmark.py::test_run_with_the_device_loader",  # 3 s
    "tests/test_docs.py::test_module_runs_as_a_copied_single_file",  # 3 s
    "tests/test_docs.py::test_the_readme_example_runs_on_the_core_copied_alone",  # 7 s
    "tests/test_cli.py::test_cli_errors_name_its_own_flags_in_one_line",  # 11 s
    "tests/test_cli.py::test_cli_output_into_a_closed_pipe_ends_quietly",  # 3 s
    "tests/test_cli.py::"
    "test_cli_plan_takes_torch_dtypes_and_says_when_it_does_not_fit",  # 10 s
    "tests/test_cli.py::test_the_help_of_every_option_is_written",  # 8 s
    "tests/test_cli.py::test_cli_info_lists_live_segments",  # 2 s
    "tests/test_cli.py::test_cli_plan",  # 5 s
    "tests/test_cli.py::test_the_cli_inspects_saved_files_and_says_which_are_damaged",  # 6 s
    "tests/test_lifecycle.py::test_startup_leftover_is_removed_by_clean",  # 4 s
    "tests/test_mixtures.py::test_mixtures_py_works_copied_next_to_stocaching_py",  # 2 s
    "tests/test_order.py::test_the_order_works_copied_next_to_stocaching_py",  # 8 s
    "tests/test_sampler.py::test_samplers_py_works_copied_next_to_stocaching_py",  # 2 s
    "tests/test_streams.py::test_the_stream_works_copied_next_to_stocaching_py",  # 3 s
    # (the [False] variant, 2 s, stays: the fast loop's resume of a stream on another world)
    "tests/test_streams.py::test_a_state_of_two_nodes_resumes_once_on_other_worlds[True]",  # 2.4 s
    "tests/test_wrapper.py::test_the_wrapper_works_copied_next_to_stocaching_py",  # 3 s
    "tests/test_persistent.py::test_a_persistent_cache_goes_to_spawned_processes_too",  # 5 s
    "tests/test_persistent.py::test_clean_removes_a_persistent_cache_only_by_name_or_flag",  # 3 s
    "tests/test_persistent.py::test_the_next_job_attaches_with_every_filled_slot_a_hit",  # 2 s
    "tests/test_saved.py::test_a_saved_cache_loads_in_a_new_process_with_the_same_samples",  # 4 s
    "tests/test_sending.py::test_every_kind_of_cache_goes_through_a_pool",  # 7 s
    "tests/test_sending.py::test_torch_multiprocessing_pool_queue_and_process",  # 3 s
    # the others over 1.5 s
    "tests/test_cache.py::test_writing_a_read_only_view_raises_and_changes_nothing",  # 2 s
    "tests/test_docs.py::test_the_package_imports_from_the_checkouts_parent_folder",  # 7 s
    "tests/test_capacity_security.py::"
    "test_cache_that_just_fits_fills_completely_without_sigbus",  # 5 s
    "tests/test_capacity_security.py::"
    "test_stale_segments_are_reclaimed_and_live_ones_never_touched",  # 6 s
    "tests/test_device.py::test_a_newer_iterator_stops_the_one_alive_which_then_raises",  # 2 s
    "tests/test_device.py::test_a_writer_racing_the_gather_never_yields_a_torn_row",  # 2 s
    "tests/test_device.py::"
    "test_closing_with_an_iterator_alive_returns_frees_the_staging_and_ends_the_iterator",  # 6 s
    "tests/test_device.py::"
    "test_the_program_ends_with_an_iterator_alive_and_the_loader_never_closed",  # 2 s
}

KEEP = {
    # one cell of each matrix that is its file's only fast candidate: a DataLoader worker
    # killed while it reads; the Prefetcher closed first, the ordinary ending
    "tests/test_faults.py::test_fault_cell[worker-read-KILL]",  # 2 s
    "tests/test_prefetch_closing.py::"
    "test_ending_in_any_order_is_quiet_and_frees_the_staging_area[prefetcher-closed-first-0]",
    # the file's only test
    "tests/test_fuzz_samples.py::test_fields_and_open_sizes_match_model",  # 15 s
    # `python -m stocaching` (stocaching/__main__.py) in a fresh interpreter
    "tests/test_cli.py::test_cli_info_lists_live_segments",  # 2 s
    # the holder's first attempt, with the leader's stdin closed (as CI starts it)
    "tests/test_restarts.py::"
    "test_a_first_attempt_with_no_holder_to_ask_leaves_the_leaders_descriptors_alone[closed]",
}

FAST_BUDGET_S = 5.0  # a test in the fast loop that takes longer is listed at the end


def _entries(nodeid: str) -> tuple[str, str]:
    """The two SLOW/KEEP entries that can name a test: itself, and all its parametrizations."""
    return nodeid, nodeid.split("[", 1)[0]


def _is_slow(item: pytest.Item) -> bool:
    if any(e in KEEP for e in _entries(item.nodeid)):
        return False
    if any(e in SLOW for e in _entries(item.nodeid)):
        return True
    callspec = getattr(item, "callspec", None)
    return callspec is not None and not SLOW_VARIANTS.isdisjoint(callspec.id.split("-"))


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marks
def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        if _is_slow(item):
            item.add_marker(slow)
    if config.args_source is not pytest.Config.ArgsSource.TESTPATHS:
        return  # some files or tests named: the tables are checked on whole runs only
    named = {e for item in items for e in _entries(item.nodeid)}
    stale = sorted((SLOW | KEEP) - named)
    if stale:
        warnings.warn(f"tests/conftest.py's SLOW or KEEP names tests that no longer exist "
                      f"(renamed?): {stale}", pytest.PytestWarning, stacklevel=1)
    files = {item.path.name for item in items}
    fast = {item.path.name for item in items if not item.get_closest_marker("slow")}
    if files - fast:
        warnings.warn(f"every test of {sorted(files - fast)} is slow, so the fast loop "
                      f"(-m 'not slow') runs none of it: name one in KEEP in tests/conftest.py",
                      pytest.PytestWarning, stacklevel=1)


def pytest_terminal_summary(terminalreporter, config):
    if "not slow" not in (config.option.markexpr or ""):
        return
    over = sorted((r.duration, r.nodeid) for r in terminalreporter.stats.get("passed", [])
                  if r.when == "call" and r.duration > FAST_BUDGET_S and r.nodeid not in KEEP)
    if over:
        terminalreporter.write_line(
            f"fast loop: {len(over)} test(s) took over {FAST_BUDGET_S:g} s; if they always "
            f"do, add them to SLOW in tests/conftest.py: "
            + ", ".join(f"{n} ({d:.1f} s)" for d, n in over[::-1]))


@pytest.fixture
def process_group_of_one():
    """A real gloo process group of one rank in this process, destroyed afterwards."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def shm_dir(monkeypatch):
    """A fresh directory on /dev/shm (a real tmpfs); STOCACHING_SHM_DIR points child processes
    at it. Removed afterwards."""
    d = tempfile.mkdtemp(prefix="stocaching-test-", dir=SHM_ROOT)
    monkeypatch.setenv("STOCACHING_SHM_DIR", d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def tmpfs():
    """Mount a fresh 64 MiB tmpfs and yield its path; unmount and remove it afterwards.

    The mount point is a new directory in the system temp dir with mode 0755 (pytest's
    ``tmp_path`` is private to root), so that a child running as another user can reach the
    tmpfs, whose own mode is 1777 like /dev/shm."""
    d = tempfile.mkdtemp(prefix="reliability-shm-")
    os.chmod(d, 0o755)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=1777", "tmpfs", d],
                       capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a private tmpfs here ({r.stderr.strip() or r.returncode}); "
                    "these tests need root or CAP_SYS_ADMIN to isolate their leak checks")
    try:
        yield os.path.realpath(d)
    finally:
        if subprocess.run(["umount", d], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", d], capture_output=True)
        with contextlib.suppress(OSError):
            os.rmdir(d)


@pytest.fixture
def private_shm_dir(tmpfs, monkeypatch):
    """STOCACHING_SHM_DIR on a tmpfs of the test's own, for tests of programs that use /dev/shm
    themselves (Ray keeps its object store there): the leak check's byte count then counts
    only the cache's segments."""
    monkeypatch.setenv("STOCACHING_SHM_DIR", tmpfs)
    return tmpfs


@pytest.fixture
def children(tmp_path):
    """Start job processes with ``children(label, env)``; any still running at the end are
    killed (only the process groups this fixture started)."""
    started: list[Child] = []

    def start(label: str, env: dict[str, str]) -> Child:
        c = Child(env, tmp_path / f"{label}.stderr", label)
        started.append(c)
        return c

    yield start
    for c in started:
        c.close()
