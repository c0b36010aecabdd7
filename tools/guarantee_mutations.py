"""Break each guarantee of docs/reliability.md on purpose and check its test notices.

    python tools/guarantee_mutations.py            # every mutation (about 30 minutes)
    python tools/guarantee_mutations.py --only lock,undo

Each mutation is a small edit of the library source that breaks one mechanism (the
commit order, a checksum check, the undo copy...). The tool applies it to the file in
place — so subprocesses, spawned ranks and torchrun workers run the broken code too —
runs the tests named for that guarantee, and restores the file byte for byte, also on
Ctrl-C. A mutation the tests do not notice ("SURVIVED") is a test that proves less than
the docs say. Exit status 1 if any survived. Not part of the test run: it edits src/.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    guarantee: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


HOSTILE = "tests/test_hostile_files.py::"
FRAGMENT_VALUES = (
    "tests/test_format_v2.py::test_a_fragment_value_naming_what_no_file_holds_is_a_typed_error"
)
V2_HUGE_MESH = (
    "tests/test_format_v2.py::"
    "test_an_index_claiming_a_mesh_of_2_to_the_62_ranks_is_a_typed_error_in_bounded_time"
)
INCREMENTAL = "tests/test_incremental.py::"
MANY_CHUNKS = "tests/test_hostile_input.py::"
RESTART = (
    "tests/test_save_plan_cache.py::"
    "test_a_process_group_initialized_again_in_the_same_processes_saves_with_a_new_plan["
)
BACKGROUND = "tests/test_save_plan_cache.py::"
MANAGER = "tests/test_checkpoint_manager.py::"
ROLLBACK = "tests/test_rollback.py::"
GRACE = "tests/test_preemption_grace.py::"
CAMPAIGN = "tests/test_goodput_campaign.py::"
ERASURE = "tests/test_memory_erasure.py::"
LOAD_BUDGET = "tests/test_load_memory_budget.py::"
UNDO_POOL = "tests/test_load_undo_pool.py::"
MUTATIONS = [
    Mutation(
        "parity pieces used unchecked",
        "a rebuild never uses a corrupt piece",
        "src/shardpoint/training/parity.py",
        '        if which["index"] != "sum" and digest(piece) != which["hash"]:\n',
        "        if False:\n",
        (ERASURE + "test_a_corrupt_parity_piece_is_caught_by_the_rebuilding_rank",),
    ),
    Mutation(
        "XOR sums made of unchecked pieces",
        "a rebuild never uses a corrupt piece",
        "src/shardpoint/training/memory_tier.py",
        '                if digest(piece.numpy()) != detail["hash"] and error is None:\n',
        "                if False:\n",
        (
            ERASURE + "test_a_corrupt_piece_is_caught_by_its_checksum_and_the_disk_is_used[parity]",
            ERASURE + "test_a_corrupt_piece_is_caught_by_its_checksum_and_the_disk_is_used[data]",
        ),
    ),
    Mutation(
        "orphaned copies never offered",
        "ranks that moved restore from memory",
        "src/shardpoint/training/memory_tier.py",
        "                if kept_by == self.rank or (kept_by is None and self.rank =="
        " min(self.mates)):\n",
        "                if kept_by == self.rank:\n",
        (ERASURE + "test_a_replaced_node_that_comes_back_with_another_nodes_rank_is_rebuilt",),
    ),
    Mutation(
        "an orphaned replica of its owner ignored",
        "ranks that moved restore from memory",
        "src/shardpoint/training/memory_restore_plan.py",
        "        elif holder == owner and not copies[(owner, newest)][1]:\n",
        "        elif False:\n",
        (
            ERASURE
            + "test_with_replicas_ranks_that_swap_nodes_take_their_copies_from_where_they_are",
        ),
    ),
    Mutation(
        "a rebuild planned with too few pieces",
        "more losses than parity fall back to the disk",
        "src/shardpoint/training/memory_restore_plan.py",
        "            if len(found) < pl.k:\n",
        "            if not found:\n",
        (ERASURE + "test_more_lost_nodes_than_parity_fall_back_to_the_disk",),
    ),
    Mutation(
        "marker before index",
        "visible ⇒ complete",
        "src/shardpoint/commit.py",
        "        self.storage.write_small_durably(INDEX_NAME, index)\n"
        "        self.storage.sync()\n"
        "        self.storage.write_small_durably(MARKER_NAME, marker_json(index, checkpoint))\n",
        "        self.storage.write_small_durably(MARKER_NAME, marker_json(index, checkpoint))\n"
        "        self.storage.sync()\n"
        "        self.storage.write_small_durably(INDEX_NAME, index)\n",
        (
            "tests/test_crash_consistency.py::test_sigkill_at_any_point_never_loses_a_committed_checkpoint",
        ),
    ),
    Mutation(
        "no marker on 2 ranks",
        "visible ⇒ complete (2 ranks)",
        "src/shardpoint/save_commit.py",
        "                    plan.commit.finish(index.to_json())\n",
        "                    if len(results) == 1:\n"
        "                        plan.commit.finish(index.to_json())\n",
        (
            "tests/test_crash_consistency.py::"
            "test_sigkill_of_one_rank_during_a_two_rank_save_never_exposes_a_partial_checkpoint",
        ),
    ),
    Mutation(
        "marker deleted last",
        "a committed checkpoint is never modified",
        "src/shardpoint/commit.py",
        "            if self.is_committed():\n"
        "                self.storage.delete(MARKER_NAME)\n"
        "                self.storage.sync()\n"
        "            notes = (MARKER_NAME, PRUNED_NAME)\n",
        "            notes = (MARKER_NAME, PRUNED_NAME)  # the marker stays\n",
        (
            "tests/test_checkpoint_manager.py::"
            "test_a_crash_during_retention_never_leaves_zero_valid_checkpoints",
        ),
    ),
    Mutation(
        "checksum mismatch ignored",
        "every byte is checked",
        "src/shardpoint/loading.py",
        "        if checksum(data[i * step : (i + 1) * step]) != p.chunk.checksums[block]:",
        "        if False:",
        ("tests/test_corruption_matrix.py",),
    ),
    Mutation(
        "chunk tiling not checked",
        "hostile input gives typed errors only",
        "src/shardpoint/format/parse.py",
        "        _check_cover(name, shape, chunks, where, boxes)\n",
        "",
        (
            "tests/test_hostile_input.py::"
            "test_any_value_anywhere_in_the_index_gives_a_typed_error_or_a_consistent_index",
            "tests/test_integrity.py",
        ),
    ),
    Mutation(
        "many chunks not checked",
        "hostile input gives typed errors only",
        "src/shardpoint/format/coverage.py",
        "    sizes = list(map(files.get, [c.file for c in chunks]))\n",
        "    return True\n",
        (MANY_CHUNKS + "test_a_bad_chunk_among_many_is_named_as_among_few",),
    ),
    Mutation(
        "many chunks past their file",
        "hostile input gives typed errors only",
        "src/shardpoint/format/coverage.py",
        "    if not ((end - begin == size.prod(axis=1) * item) & (end <= np.array(sizes))).all():",
        "    if not (end - begin == size.prod(axis=1) * item).all():",
        (MANY_CHUNKS + "test_a_bad_chunk_among_many_is_named_as_among_few",),
    ),
    Mutation(
        "many chunks' overlap not sorted out",
        "index checks stay linear",
        "src/shardpoint/format/coverage.py",
        "        return bool((hi[order[:-1], 0] <= lo[order[1:], 0]).all())",
        "        return True",
        (MANY_CHUNKS + "test_two_of_many_chunks_that_overlap_are_refused",),
    ),
    Mutation(
        "a grid of many chunks not matched",
        "index checks stay linear",
        "src/shardpoint/format/coverage.py",
        "        return len(np.unique(np.stack(cells, axis=1), axis=0)) == len(lo)",
        "        return True",
        (MANY_CHUNKS + "test_two_of_many_chunks_that_overlap_are_refused",),
    ),
    Mutation(
        "no retries",
        "object stores: transient faults survived",
        "src/shardpoint/storage/object_store.py",
        '    "max_retries": 10,',
        '    "max_retries": 0,',
        (
            "tests/test_object_store.py::"
            "test_saves_and_loads_survive_injected_500s_503s_and_dropped_connections",
        ),
    ),
    Mutation(
        "raw object-store errors",
        "every error on a read is typed (object stores)",
        "src/shardpoint/storage/object_store.py",
        "        if not isinstance(exc, BaseError):\n            raise\n",
        "        raise\n",
        (
            "tests/test_object_store.py::"
            "test_a_load_from_an_unreachable_store_is_a_typed_error_and_changes_nothing",
        ),
    ),
    Mutation(
        "memory copy identity unchecked",
        "memory tier: never a stale or partial copy",
        "src/shardpoint/training/memory_tier.py",
        '            if meta != self._identity(step)["memory_tier"]:',
        "            if False:",
        (
            "tests/test_memory_tier.py::"
            "test_a_memory_copy_tagged_with_another_rank_world_size_or_step_is_refused",
        ),
    ),
    Mutation(
        "pickle on a load path",
        "no pickle",
        "src/shardpoint/tree.py",
        '    ``resolve(rank, path)`` the values kept in fragments."""\n'
        "    if not isinstance(node, dict):\n        return node\n",
        '    ``resolve(rank, path)`` the values kept in fragments."""\n'
        "    if not isinstance(node, dict):\n        return node\n"
        "    from pickle import loads\n\n"
        "    if isinstance(node, bytes):\n"
        "        return loads(node)\n",
        ("tests/test_no_pickle.py",),
    ),
    Mutation(
        "RNG not restored",
        "exact resume",
        "src/shardpoint/training/rng.py",
        'def restore_rng(state: dict[str, Any]) -> None:\n    py = state["python"]\n',
        'def restore_rng(state: dict[str, Any]) -> None:\n    return\n    py = state["python"]\n',
        (
            "tests/test_rng.py",
            "tests/test_distributed.py::test_fsdp2_training_continues_bit_identical_on_the_same_world_size",
        ),
    ),
    Mutation(
        "FIFO blocks open",
        "a special file never hangs a reader",
        "src/shardpoint/storage/direct_io.py",
        "    fd = os.open(path, flags | os.O_NONBLOCK)",
        "    fd = os.open(path, flags)",
        (
            HOSTILE
            + "test_a_special_file_in_place_of_a_checkpoint_file_is_a_typed_error_for_every_reader",
        ),
    ),
    Mutation(
        "raw OS errors",
        "every OS error on a read is typed",
        "src/shardpoint/storage/direct_io.py",
        "    except OSError as exc:\n        raise CorruptCheckpointError(\n"
        '            f"{where}: cannot be read',
        "    except ZeroDivisionError as exc:\n        raise CorruptCheckpointError(\n"
        '            f"{where}: cannot be read',
        (
            HOSTILE + "test_an_os_error_at_any_read_of_a_load_is_typed_and_leaves_the_state_"
            "unchanged",
        ),
    ),
    Mutation(
        "undo",
        "a failed load changes nothing",
        "src/shardpoint/loading.py",
        "            self._saved.append((views, [copy]))\n",
        "            pass\n",
        (HOSTILE + "test_a_corrupt_second_tensor_leaves_every_tensor_unchanged",),
    ),
    Mutation(
        "undo not waited for",
        "a failed load changes nothing",
        "src/shardpoint/loading.py",
        "                        for piece in ahead:  # a batch is overwritten"
        " only once it is saved\n"
        "                            piece.result()\n",
        "",
        (HOSTILE + "test_a_corrupt_tensor_read_in_later_batches_leaves_every_tensor_unchanged",),
    ),
    Mutation(
        "no Stateful roll-back",
        "a failed load changes nothing",
        "src/shardpoint/loading.py",
        "        for give_back in reversed(m.undo):",
        "        for give_back in []:",
        (HOSTILE + "test_a_stateful_that_rejects_its_state_rolls_back_every_tensor_and_stateful",),
    ),
    Mutation(
        "optimizer groups unchecked",
        "a failed load changes nothing",
        "src/shardpoint/tree.py",
        '            _match_param_groups(target["param_groups"], stored["param_groups"], path, m)',
        "            pass",
        (
            HOSTILE + "test_an_optimizer_over_fewer_parameters_is_refused_before_the_model_changes",
            HOSTILE + "test_a_train_state_with_an_optimizer_over_fewer_parameters_is_refused",
        ),
    ),
    Mutation(
        "event log raises",
        "writes after the commit are best effort",
        "src/shardpoint/training/events.py",
        "            except Exception as exc:  # OSError (ENOSPC, EROFS...), the object store's "
        "too",
        "            except ZeroDivisionError as exc:",
        (HOSTILE + "test_a_full_disk_for_the_event_log_fails_neither_the_save_nor_retention",),
    ),
    Mutation(
        "deletion failure raises",
        "read-only checkpoints restore and list",
        "src/shardpoint/training/housekeeping.py",
        "        except (OSError, CheckpointError) as exc:  # read-only, permissions, "
        "another writer",
        "        except ZeroDivisionError as exc:",
        (HOSTILE + "test_restore_and_listing_work_on_a_read_only_directory_with_a_leftover",),
    ),
    Mutation(
        "lock",
        "two writers on one directory are refused",
        "src/shardpoint/storage/local.py",
        "            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)",
        "            pass",
        (HOSTILE + "test_a_save_into_a_directory_another_process_is_saving_to_is_refused",),
    ),
    Mutation(
        "lock after leftovers",
        "two writers on one directory are refused",
        "src/shardpoint/commit.py",
        "                lock.acquire()\n            except FileNotFoundError:\n"
        "                if attempt == attempts - 1:\n",
        "                pass\n            except FileNotFoundError:\n"
        "                if attempt == attempts - 1:\n",
        (
            # The race alone notices it about two runs in three: exclusive file creation
            # keeps the two writers' files apart, and only their commits still collide.
            HOSTILE + "test_a_save_into_a_directory_another_process_is_saving_to_is_refused",
            HOSTILE + "test_two_processes_saving_the_same_steps_never_report_a_checkpoint_that_"
            "is_not_there",
        ),
    ),
    Mutation(
        "replicated state once per job",
        "a node restores from its own disk alone",
        "src/shardpoint/plan.py",
        "    if not per_node:\n        return plan_writes(load, replicated)\n",
        "    if True:\n        return plan_writes(load, replicated)\n",
        (
            "tests/test_node_local_copies.py::"
            "test_each_node_holds_and_indexes_its_own_copy_and_restores_from_it_alone",
        ),
    ),
    Mutation(
        "stale plan reused",
        "few collectives, never a stale plan",
        "src/shardpoint/save_plan.py",
        "        unsettled = own_error is not None or own != cached.own\n",
        "        unsettled = own_error is not None\n",
        (
            "tests/test_save_plan_cache.py::"
            "test_a_sharded_tensor_that_changes_shape_on_every_rank_is_saved_with_a_new_plan",
        ),
    ),
    Mutation(
        "a new process group not followed",
        "few collectives, never a stale plan",
        "src/shardpoint/dist.py",
        "    if world is not _WORLD:\n",
        "    if _WORLD is None:\n",
        (RESTART + "same-processes]",),
    ),
    Mutation(
        "plans kept across process groups",
        "few collectives, never a stale plan",
        "src/shardpoint/save_plan.py",
        "    generation = dist.generation()\n",
        "    generation = 0\n",
        (RESTART + "rank-1-replaced]",),
    ),
    Mutation(
        "speculative save not tried again",
        "few collectives, never a stale plan",
        "src/shardpoint/saving.py",
        "                plan = plan_save(state, storage, options, group=group)\n",
        "                raise RuntimeError(outcome.why)\n",
        (
            "tests/test_speculative_saves.py::"
            "test_an_unchanged_save_onto_a_crashed_saves_leftovers_commits_and_clears_them",
        ),
    ),
    Mutation(
        "background saves agree before staging",
        "few collectives, never a stale plan",
        "src/shardpoint/save_plan.py",
        "    speculative = cached is not None\n",
        "    speculative = cached is not None and not staged\n",
        (
            BACKGROUND + "test_an_unchanged_background_save_has_one_collective_and_a_changed_"
            "rank_waits_for_its_part",
        ),
    ),
    Mutation(
        "a changed background rank neither copies nor waits",
        "a background save holds the state at the call",
        "src/shardpoint/saving.py",
        "    if staging is not None and plan.unsettled and plan.error is None:\n",
        "    if False:\n",
        (
            BACKGROUND + "test_an_unchanged_background_save_has_one_collective_and_a_changed_"
            "rank_waits_for_its_part",
            BACKGROUND + "test_a_changed_rank_whose_state_exceeds_its_staging_pool_waits_for_"
            "its_part",
        ),
    ),
    Mutation(
        "a changed rank's copy not made",
        "a background save holds the state at the call",
        "src/shardpoint/saving.py",
        '            plan.local = {name: t.to("cpu", copy=True) for',
        "            plan.local = {name: t for",
        (
            BACKGROUND + "test_an_unchanged_background_save_has_one_collective_and_a_changed_"
            "rank_waits_for_its_part",
        ),
    ),
    Mutation(
        "a changed rank copies whatever it holds",
        "a background save's memory stays within its staging pool",
        "src/shardpoint/saving.py",
        "        if held <= staging.spare_bytes():\n",
        "        if True:\n",
        (
            BACKGROUND + "test_a_changed_rank_whose_state_exceeds_its_staging_pool_waits_for_"
            "its_part",
        ),
    ),
    Mutation(
        "steady files removed on again",
        "a background save holds the state at the call",
        "src/shardpoint/save_commit.py",
        "        if again and plan.staged:  # the steady ranks' files stay",
        "        if again and plan.staged and False:  # the steady ranks' files stay",
        (
            BACKGROUND + "test_an_unchanged_background_save_has_one_collective_and_a_changed_"
            "rank_waits_for_its_part",
        ),
    ),
    Mutation(
        "a piece nobody staged dropped",
        "a background save holds the state at the call",
        "src/shardpoint/plan.py",
        "            if any(key in c for c in held_by):\n",
        "            if False:\n",
        (
            BACKGROUND + "test_a_background_save_that_cannot_be_completed_around_what_was_staged_"
            "fails_cleanly",
        ),
    ),
    Mutation(
        "new chunks of a background again not planned",
        "a background save holds the state at the call",
        "src/shardpoint/plan.py",
        "    return pieces + plan_writes_per_node(load, lists, nodes, per_node)\n",
        "    return pieces\n",
        (
            BACKGROUND + "test_a_background_save_in_which_every_rank_changed_is_planned_again_"
            "at_the_call",
            "tests/test_node_local_copies.py::"
            "test_a_background_per_node_save_whose_structure_changed_keeps_each_nodes_copy",
        ),
    ),
    Mutation(
        "a background again's cover not per node",
        "a background save holds the state at the call",
        "src/shardpoint/plan.py",
        "            cut.add((*key, nodes[rank] if per_node else None))\n",
        "            cut.add((*key, None))\n",
        (
            "tests/test_write_plan.py::"
            "test_a_background_again_covers_every_held_chunk_once_around_the_steady_ranks",
        ),
    ),
    Mutation(
        "a background again's orphan to another node",
        "a background save holds the state at the call",
        "src/shardpoint/plan.py",
        " if not per_node or nodes[r] == node]\n",
        "]\n",
        (
            "tests/test_write_plan.py::"
            "test_a_background_again_covers_every_held_chunk_once_around_the_steady_ranks",
        ),
    ),
    Mutation(
        "a steady rank's fragment chunks not chained",
        "an incremental save refers only to committed checkpoints",
        "src/shardpoint/save_commit.py",
        "    records, sizes = [*result.chunks, *result.in_fragment], ",
        "    records, sizes = result.chunks, ",
        (
            INCREMENTAL + "test_a_background_save_run_again_after_a_change_keeps_the_chain_of_"
            "its_steady_ranks",
        ),
    ),
    Mutation(
        "a failed lock kept by a background save",
        "earlier checkpoints and other saves are never damaged (speculative writes)",
        "src/shardpoint/save_plan.py",
        "        if own_error is not None and commit_ is not None:\n",
        "        if own_error is not None and commit_ is not None and not staged:\n",
        (
            "tests/test_speculative_saves.py::"
            "test_an_unchanged_save_into_a_committed_checkpoint_writes_nothing_there[background]",
        ),
    ),
    Mutation(
        "a background save writes into a leftover's name",
        "earlier checkpoints and other saves are never damaged (speculative writes)",
        "src/shardpoint/write_phase.py",
        "            elif plan.speculative and _taken(plan, files):\n",
        "            elif False:\n",
        (
            "tests/test_speculative_saves.py::"
            "test_an_unchanged_save_onto_a_crashed_saves_leftovers_commits_and_clears_them"
            "[background]",
        ),
    ),
    Mutation(
        "leftovers not cleared before a background again",
        "earlier checkpoints and other saves are never damaged (speculative writes)",
        "src/shardpoint/save_plan.py",
        "            plan.commit.clear(keep=set(every_kept or ()))\n",
        "            pass\n",
        (
            "tests/test_speculative_saves.py::"
            "test_an_unchanged_save_onto_a_crashed_saves_leftovers_commits_and_clears_them"
            "[background]",
        ),
    ),
    Mutation(
        "a background failure tried again",
        "a background save holds the state at the call",
        "src/shardpoint/save_commit.py",
        "        if outcome is not None and plan.speculative and (changed or not plan.staged):\n",
        "        if outcome is not None and plan.speculative:\n",
        (
            BACKGROUND + "test_a_rank_that_fails_before_staging_a_speculative_background_save_"
            "fails_it_everywhere",
        ),
    ),
    Mutation(
        "files not created exclusively",
        "earlier checkpoints and other saves are never damaged (speculative writes)",
        "src/shardpoint/storage/direct_io.py",
        "    if exclusive:\n        # Claimed",
        "    if False:\n        # Claimed",
        (
            "tests/test_speculative_saves.py::"
            "test_an_unchanged_save_beside_another_jobs_save_leaves_its_files_alone",
        ),
    ),
    Mutation(
        "a streamed file renamed over another writer's",
        "earlier checkpoints and other saves are never damaged (speculative writes)",
        "src/shardpoint/storage/direct_io.py",
        "                link_new(self.tmp, self.path)  # FileExistsError: the name is another's\n"
        "                self.tmp.unlink(missing_ok=True)\n",
        "                os.replace(self.tmp, self.path)\n",
        (
            "tests/test_speculative_saves.py::"
            "test_a_streamed_file_made_exclusively_neither_replaces_nor_removes_anothers",
        ),
    ),
    Mutation(
        "a failed background save removes every file it meant to write",
        "earlier checkpoints and other saves are never damaged (speculative writes)",
        "src/shardpoint/background_save.py",
        "            made = [f.shard.name for f in self.files if f not in closing]\n",
        "            made = list(self._by_name)\n",
        (
            "tests/test_speculative_saves.py::"
            "test_a_background_save_whose_file_name_another_writer_took_leaves_that_file",
        ),
    ),
    Mutation(
        "a failed write removes files it did not create",
        "earlier checkpoints and other saves are never damaged (speculative writes)",
        "src/shardpoint/storage/direct_io.py",
        "        for path in created:\n",
        "        for path in files:\n",
        (
            "tests/test_speculative_saves.py::"
            "test_an_unchanged_save_beside_another_jobs_save_leaves_its_files_alone",
        ),
    ),
    Mutation(
        "no marker check before a speculative write",
        "earlier checkpoints and other saves are never damaged (speculative writes)",
        "src/shardpoint/save_plan.py",
        "            if Commit(storage).is_committed():\n",
        "            if False:\n",
        (
            "tests/test_speculative_saves.py::"
            "test_an_unchanged_save_into_a_committed_checkpoint_writes_nothing_there",
        ),
    ),
    Mutation(
        "leftovers not cleared at the commit",
        "a committed checkpoint holds only its own files",
        "src/shardpoint/save_commit.py",
        "                    plan.commit.clear(keep=index.files)\n",
        "",
        (
            "tests/test_speculative_saves.py::"
            "test_leftovers_a_speculative_save_does_not_collide_with_are_cleared_at_its_commit",
        ),
    ),
    Mutation(
        "errors agreed by all-reduce ignored",
        "a failure on one rank fails every rank (loads that share reads)",
        "src/shardpoint/dist.py",
        "    if not top:\n",
        "    if True:\n",
        (
            "tests/test_shared_reads.py::"
            "test_a_checksum_error_on_the_rank_that_reads_fails_every_rank_and_changes_nothing",
        ),
    ),
    Mutation(
        "index inputs relayed to every rank",
        "what a rank receives per save does not grow with the ranks (node-local copies)",
        "src/shardpoint/save_commit.py",
        "        if plan.commit is not None:  # it commits its node's copy: it needs the inputs\n"
        "            leaders = [0, *(r for r, s in enumerate(plan.structures)"
        ' if s["leader"] and r)]\n',
        "        if True:\n            leaders = list(range(len(plan.structures)))\n",
        (
            "tests/test_node_local_copies.py::"
            "test_only_each_nodes_first_rank_receives_what_its_nodes_index_needs",
        ),
    ),
    Mutation(
        "a node's copy not withdrawn",
        "visible ⇒ complete (node-local copies)",
        "src/shardpoint/save_commit.py",
        "        if plan.commit is not None and error is None:\n",
        "        if False:\n",
        (
            "tests/test_node_local_copies.py::"
            "test_a_node_that_cannot_commit_makes_every_node_withdraw_its_copy",
        ),
    ),
    Mutation(
        "outcome broadcast as an all-gather",
        "few collectives: a rank's traffic per save does not grow with the ranks",
        "src/shardpoint/dist.py",
        "    payload = _encoded(value) if rank() == src else None\n",
        "    return all_gather_json(value if rank() == src else None, group)[src]\n",
        (
            "tests/test_save_plan_cache.py::"
            "test_what_a_rank_receives_per_unchanged_save_does_not_grow_with_the_ranks",
        ),
    ),
    Mutation(
        "fragment not checked",
        "every byte is checked (format version 2 fragments)",
        "src/shardpoint/checkpoint_dir.py",
        "            if recorded is None or raw is None or (len(raw), checksum(raw)) != recorded:",
        "            if raw is None:",
        (
            "tests/test_format_v2.py::"
            "test_a_missing_edited_or_swapped_fragment_is_a_typed_error_naming_it",
        ),
    ),
    Mutation(
        "fragment geometry not checked",
        "hostile input gives typed errors only (format version 2 fragments)",
        "src/shardpoint/format/parse.py",
        "                or (chunk.offsets, chunk.shape) != sharding.box(entry.shape, coord)\n",
        "                or False\n",
        ("tests/test_format_v2.py::test_a_fragment_that_lies_about_a_chunk_is_refused",),
    ),
    Mutation(
        "HSDP replicas all write",
        "every byte written once (format version 2 shardings with replicas)",
        "src/shardpoint/save_plan.py",
        "    return coord is not None and h.sharding.writer(coord) == rank",
        "    return coord is not None",
        (
            "tests/test_format_v2.py::"
            "test_a_sharded_tensor_is_described_once_and_its_chunks_are_in_the_writers_fragments",
        ),
    ),
    Mutation(
        "per-rank values in the index",
        "the index does not grow by a value per rank (format version 2)",
        "src/shardpoint/tree.py",
        "            if k == rank:\n                flat.rank_values[at] = node",
        "            if False:\n                flat.rank_values[at] = node",
        (
            "tests/test_format_v2.py::"
            "test_each_ranks_rng_streams_live_in_its_fragment_not_in_the_index",
        ),
    ),
    Mutation(
        "planning error outside the agreement",
        "a failure on one rank fails every rank (loads that share reads)",
        "src/shardpoint/shared_reads.py",
        "        try:  # finding the chunks reads fragments: an error joins the agreement below\n"
        "            pieces, stored, wanted = _pieces(reads)\n"
        "        except Exception as exc:\n"
        "            error = exc\n",
        "        pieces, stored, wanted = _pieces(reads)\n",
        (
            "tests/test_shared_reads.py::"
            "test_a_fragment_one_rank_cannot_read_while_planning_fails_every_rank",
        ),
    ),
    Mutation(
        "piece received in place without an undo copy",
        "a failed load changes nothing (loads that share reads)",
        "src/shardpoint/shared_reads.py",
        "                undo.save([into])  # before its bytes start to change\n",
        "                pass\n",
        (
            "tests/test_shared_reads.py::"
            "test_a_load_that_fails_after_the_exchange_puts_every_received_piece_back",
        ),
    ),
    Mutation(
        "shared reads planned by rank 0 alone",
        "what a rank receives does not grow with the ranks (loads that share reads)",
        "src/shardpoint/shared_reads.py",
        "    return xxhash.xxh3_64_intdigest(key.encode()) % world\n",
        "    return 0\n",
        (
            "tests/test_shared_reads.py::"
            "test_planning_a_shared_load_sends_no_rank_every_ranks_needs",
        ),
    ),
    Mutation(
        "coordinator failure not told",
        "a failure on one rank fails every rank (shared reads, planning)",
        "src/shardpoint/shared_reads.py",
        "    except Exception as exc:\n        failure = exc\n",
        "    except Exception as exc:\n        raise exc\n",
        ("tests/test_shared_reads.py::test_a_coordinator_that_fails_to_plan_fails_every_rank",),
    ),
    Mutation(
        "part failure not joined",
        "a failure on one rank fails every rank (shared reads, taking a part)",
        "src/shardpoint/loading.py",
        "        if shared is not None and shared.error is not None:\n"
        "            raise shared.error\n",
        "",
        (
            "tests/test_shared_reads.py::"
            "test_a_rank_that_cannot_take_its_part_of_the_plan_fails_every_rank",
        ),
    ),
    Mutation(
        "buffered piece without an undo copy",
        "a failed load changes nothing (loads that share reads)",
        "src/shardpoint/shared_reads.py",
        "                    if region.live:\n                        undo.save([dest])\n",
        "                    pass\n",
        (
            "tests/test_shared_reads.py::"
            "test_a_load_that_fails_after_the_exchange_puts_every_received_piece_back",
        ),
    ),
    Mutation(
        "relay to the smallest subtree first",
        "what a rank receives per save does not grow with the ranks (node-local copies)",
        "src/shardpoint/dist.py",
        "    return parent, children\n",
        "    return parent, children[::-1]\n",
        (
            "tests/test_node_local_copies.py::"
            "test_the_relay_tree_reaches_every_rank_once_within_ceil_log2_rounds",
        ),
    ),
    Mutation(
        "upload proposals all-gathered",
        "what a rank receives per save does not grow with the ranks (uploads)",
        "src/shardpoint/training/tiers.py",
        "        step = dist.max_of([-1 if newest is None else newest], self.group)[0]\n",
        "        offered = [p for p in dist.all_gather_json(newest, self.group) if p is not None]\n"
        "        step = max(offered, default=-1)\n",
        (
            "tests/test_node_local_copies.py::"
            "test_each_node_holds_and_indexes_its_own_copy_and_restores_from_it_alone",
        ),
    ),
    Mutation(
        "every error all-gathered",
        "what a rank receives does not grow with the ranks (errors)",
        "src/shardpoint/dist.py",
        '    return broadcast_json(error, world - top, group) or "(no message)"\n',
        "    errors = [e for e in all_gather_json(error, group) if e is not None]\n"
        '    return errors[0] or "(no message)"\n',
        (
            "tests/test_coordination.py::"
            "test_first_error_gives_every_rank_the_lowest_failing_ranks_message_and_no_other",
        ),
    ),
    Mutation(
        "memory holdings all-gathered",
        "what a rank receives does not grow with the ranks (memory-tier restore)",
        "src/shardpoint/training/memory_tier.py",
        "        holdings = dist.gather_json(self._holdings(), 0, self.group)\n",
        "        holdings = dist.all_gather_json(self._holdings(), self.group)\n",
        (
            "tests/test_memory_tier.py::"
            "test_a_replaced_node_restores_from_buddies_and_a_restart_from_its_own_memory",
        ),
    ),
    Mutation(
        "local steps all-gathered",
        "what a rank receives does not grow with the ranks (restore)",
        "src/shardpoint/training/restore.py",
        "        every_rank = dist.gather_json(sorted(local))"
        "  # on rank 0, which sends the union\n",
        "        every_rank = dist.all_gather_json(sorted(local))\n",
        (
            "tests/test_memory_tier.py::"
            "test_a_replaced_node_restores_from_buddies_and_a_restart_from_its_own_memory",
        ),
    ),
    Mutation(
        "probe verdicts all-gathered",
        "what a rank receives does not grow with the ranks (directory detection)",
        "src/shardpoint/training/node_layout.py",
        "    separate = bool(dist.max_of([int(blind)])[0])"
        "  # also: all have looked before any probe goes\n",
        "    separate = any(dist.all_gather_json(blind))\n",
        (
            "tests/test_node_local_copies.py::"
            "test_node_local_directories_are_told_from_a_shared_one_by_probes_alone",
        ),
    ),
    Mutation(
        "save structure all-gathered",
        "what a rank receives does not grow with the ranks (save planning)",
        "src/shardpoint/save_plan.py",
        "    failed, gathered = dist.gather_distinct_json(facts, structure, error, 0, group)\n",
        "    everyone = dist.all_gather_json([facts, structure, error], group)\n"
        "    failed = next((e for _, _, e in everyone if e), None)\n"
        "    gathered = None if failed or me else [(f, v) for f, v, _ in everyone]\n",
        (
            "tests/test_save_plan_cache.py::"
            "test_what_a_rank_receives_to_plan_a_save_does_not_grow_with_the_ranks",
        ),
    ),
    Mutation(
        "stale holder loads",
        "replicated chunks go to the least-loaded holder",
        "src/shardpoint/plan.py",
        "        while heap[0][0] != load[heap[0][1]]:\n",
        "        while False:\n",
        (
            "tests/test_write_plan.py::"
            "test_the_plan_is_the_least_loaded_holder_for_every_chunk_however_lists_are_shared",
        ),
    ),
    Mutation(
        "header checksum not compared",
        "every byte is checked (shard headers)",
        "src/shardpoint/checkpoint_dir.py",
        "        if expected is not None and checksum(raw) != expected:\n",
        "        if False:\n",
        (
            "tests/test_integrity.py::test_a_load_checks_each_shard_header_by_its_checksum_in_the_index",
        ),
    ),
    Mutation(
        "plan failure not told",
        "a failure on one rank fails every rank (rank 0's plans)",
        "src/shardpoint/dist.py",
        "        _scatter_payloads([_encoded([str(exc) or type(exc).__name__, None])] * ranks,"
        " src, group)\n",
        "        pass\n",
        (
            "tests/test_coordination.py::"
            "test_a_plan_that_fails_on_rank_0_fails_every_rank_instead_of_hanging",
        ),
    ),
    Mutation(
        "reads not shared",
        "each stored byte read once (share_reads)",
        "src/shardpoint/shared_reads.py",
        "    for n, (key, boxes) in enumerate(needs.items()):"
        "  # in the order met: the same on a rerun\n",
        "    for n, (key, boxes) in enumerate({}.items()):\n",
        (
            "tests/test_shared_reads.py::"
            "test_a_two_replica_two_shard_load_reads_each_byte_from_storage_once",
            "tests/test_shared_reads.py::"
            "test_a_resharding_load_reads_each_stored_byte_once_when_sharing",
        ),
    ),
    Mutation(
        "remote read first",
        "a replaced node alone reads from the remote",
        "src/shardpoint/training/restore.py",
        "            copies.append(remote_copy)",
        "            copies.insert(0, remote_copy)",
        (
            "tests/test_node_local_copies.py::"
            "test_a_node_that_lost_its_disk_reads_from_the_remote_and_only_it_does",
        ),
    ),
    Mutation(
        "multipart not aborted",
        "a failed background upload leaves nothing",
        "src/shardpoint/storage/object_store.py",
        "            self._file.__exit__(OSError, error, None)",
        "            pass",
        (
            "tests/test_async_object_store.py::test_a_failed_part_write_surfaces_on_wait_and_commits_nothing",
        ),
    ),
    Mutation(
        "reference by counter alone",
        "an incremental save never refers to bytes that differ",
        "src/shardpoint/incremental.py",
        "            if identity(flat_bytes(host_contiguous(data_of(p))).numpy())"
        " == stored.identity:",
        "            if True:",
        (
            INCREMENTAL
            + "test_bytes_changed_behind_the_version_counter_are_written_not_referred_to",
        ),
    ),
    Mutation(
        "retention ignores references",
        "deleting a checkpoint keeps the files others refer to",
        "src/shardpoint/training/housekeeping.py",
        "                kept = source.kept_files(step, references)\n",
        "                kept = ()\n",
        (
            INCREMENTAL + "test_retention_keeps_referenced_files_marked_pruned_then_deletes_them",
            "tests/test_crash_consistency.py::test_sigkill_at_any_point_never_loses_a_committed_checkpoint[incremental-100]",
        ),
    ),
    Mutation(
        "pruned note after the marker",
        "deleting a checkpoint keeps the files others refer to",
        "src/shardpoint/commit.py",
        "            if kept and PRUNED_NAME not in names:",
        "            if False:",
        (INCREMENTAL + "test_retention_keeps_referenced_files_marked_pruned_then_deletes_them",),
    ),
    Mutation(
        "chain advances on failure",
        "an incremental save refers only to committed checkpoints",
        "src/shardpoint/save_commit.py",
        "    records, sizes = [*result.chunks, *result.in_fragment], "
        "{**result.files, **result.referenced}\n",
        "    records, sizes = [*result.chunks, *result.in_fragment], "
        "{**result.files, **result.referenced}\n"
        "    if plan.chain is not None and result.error is None:\n"
        "        plan.chain.committed(plan.storage.root, records, plan.tokens, sizes)\n",
        (INCREMENTAL + "test_a_failed_save_leaves_the_chain_on_the_last_committed_checkpoint",),
    ),
    Mutation(
        "reference escapes the parent",
        "a reference never leaves the parent directory",
        "src/shardpoint/storage/local.py",
        "            escapes = (ref is not None or path.is_symlink()) and _outside(path, top)",
        "            escapes = path.is_symlink() and _outside(path, top)",
        (INCREMENTAL + "test_a_sibling_that_is_a_symlink_out_of_the_parent_is_refused",),
    ),
    Mutation(
        "upload every referenced file",
        "an upload sends only what the remote lacks",
        "src/shardpoint/training/tiers.py",
        "                missing += [n for n in files if target.size(n) != source.size(n)]",
        "                missing += files",
        (
            "tests/test_object_store.py::test_incremental_uploads_send_only_what_the_remote_lacks_and_keep_what_it_refers_to",
        ),
    ),
    Mutation(
        "no index size limit",
        "sizes readers could not handle are refused",
        "src/shardpoint/storage/local.py",
        "                if size > limit:",
        "                if False:",
        (HOSTILE + "test_a_huge_sparse_index_is_refused_before_it_is_read",),
    ),
    Mutation(
        "mesh ranks held one by one",
        "hostile input gives typed errors only (a mesh's rank count)",
        "src/shardpoint/format/parse.py",
        "            ranks: Sequence[int] = range(first, first + count)\n",
        "            ranks: Sequence[int] = tuple(range(first, first + count))\n",
        (V2_HUGE_MESH,),
    ),
    Mutation(
        "sharding's chunks counted to the end",
        "hostile input gives typed errors only (a mesh's rank count)",
        "src/shardpoint/checkpoint_dir.py",
        "            expected = sum(1 for _ in itertools.islice(derived, len(chunks) + 1))\n",
        "            expected = sum(1 for _ in derived)\n",
        (V2_HUGE_MESH,),
    ),
    Mutation(
        "fragment values not resolved",
        "hostile input gives typed errors only (values kept in fragments)",
        "src/shardpoint/checkpoint_dir.py",
        "        tree_codec.decode(self.index.tree, lambda name: None, self.fragment_value)\n",
        "        pass\n",
        (
            "tests/test_format_v2.py::"
            "test_a_tree_that_keeps_a_value_in_a_fragment_that_lacks_it_fails_verify",
        ),
    ),
    Mutation(
        "mesh ranks read per DTensor",
        "a save's planning does not grow with ranks x tensors (device meshes)",
        "src/shardpoint/tensor_kinds.py",
        "    facts = _MESH_FACTS.get(device_mesh)\n",
        "    facts = None\n",
        (
            "tests/test_save_plan_cache.py::"
            "test_a_save_reads_each_device_meshs_ranks_once_not_once_per_dtensor",
        ),
    ),
    Mutation(
        "shard layout computed per DTensor",
        "a save's planning does not grow with ranks x tensors (device meshes)",
        "src/shardpoint/tensor_kinds.py",
        "    box = boxes.get(key)\n",
        "    box = None\n",
        (
            "tests/test_save_plan_cache.py::"
            "test_a_save_reads_each_device_meshs_ranks_once_not_once_per_dtensor",
        ),
    ),
    Mutation(
        "fragment value's tensors not looked up",
        "hostile input gives typed errors only (values kept in fragments)",
        "src/shardpoint/format/parse.py",
        "                if tensor not in entries and not elsewhere:\n",
        "                if False:\n",
        (FRAGMENT_VALUES + "[tensor-held-nowhere]",),
    ),
    Mutation(
        "fragment in a fragment followed",
        "hostile input gives typed errors only (values kept in fragments)",
        "src/shardpoint/format/parse.py",
        '    raise ValueError("a value kept in a fragment refers to a fragment again")\n',
        "    return None\n",
        (FRAGMENT_VALUES + "[fragment-in-a-fragment]",),
    ),
    Mutation(
        "chunk numbers not range-checked while decoding",
        "hostile input gives typed errors only",
        "src/shardpoint/format/index.py",
        "_UInt64 = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]\n",
        "_UInt64 = int\n",
        (
            "tests/test_format_edge_values.py::test_a_number_of_the_index_out_of_its_range_is_corrupt",
        ),
    ),
    Mutation(
        "the rest of a refused index not checked to be JSON",
        "hostile input gives typed errors only",
        "src/shardpoint/format/parse.py",
        "    _decode(_DECODE_JSON, raw, where)\n",
        "",
        (
            "tests/test_hostile_input.py::"
            "test_a_wrong_value_before_what_json_cannot_hold_is_still_a_typed_error",
        ),
    ),
    Mutation(
        "user metadata encoded by msgspec",
        "a save refuses what JSON cannot hold (NaN in user metadata)",
        "src/shardpoint/format/index.py",
        '        json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)',
        "        msgspec.json.encode(value).decode()",
        (
            "tests/test_reader.py::"
            "test_user_metadata_is_written_as_json_writes_it_and_nan_is_refused",
        ),
    ),
    Mutation(
        "mesh hashed by its ranks",
        "a save's planning does not grow with ranks x tensors (strided meshes)",
        "src/shardpoint/sharding.py",
        "        return hash(self.digest)\n",
        "        return hash((self.shape, self.ranks))\n",
        (
            "tests/test_sharding_geometry.py::"
            "test_a_strided_mesh_is_looked_up_without_hashing_its_ranks_again",
        ),
    ),
    Mutation(
        "save reads the signal flag again",
        "every rank acts on the same preemption decision",
        "src/shardpoint/training/manager.py",
        "        preempting = self._preempting\n",
        "        preempting = self.preemption.signal is not None\n",
        (
            "tests/test_checkpoint_manager.py::"
            "test_a_signal_between_the_agreement_and_the_save_counts_for_the_next_save",
        ),
    ),
    Mutation(
        "prune counts invalid ones",
        "earlier checkpoints never damaged (prune)",
        "src/shardpoint/cli.py",
        '    if row["status"] != "valid":\n',
        "    if False:\n",
        ("tests/test_cli.py::test_prune_keeps_the_newest_checkpoints_that_load",),
    ),
    Mutation(
        "prune follows links",
        "earlier checkpoints never damaged (prune)",
        "src/shardpoint/cli.py",
        '    if os.path.islink(row["path"]):\n'
        '        return "a symbolic link: prune deletes only real directories"\n',
        "",
        ("tests/test_cli.py::test_prune_never_follows_links_nor_counts_names_that_are_not_steps",),
    ),
    Mutation(
        "prune counts other names",
        "earlier checkpoints never damaged (prune)",
        "src/shardpoint/cli.py",
        '    if _step_of(row["path"]) is None:',
        '    if row["step"] is None:',  # the metadata's step: a copy named best counts
        ("tests/test_cli.py::test_prune_never_follows_links_nor_counts_names_that_are_not_steps",),
    ),
    Mutation(
        "savers share a group",
        "async saves: errors never lost (two savers)",
        "src/shardpoint/background_save.py",
        "            self._group, self._group_generation = "
        "dist.new_cpu_group(), dist.generation()\n",
        "            global _SHARED_GROUP\n"
        "            _SHARED_GROUP = globals().get('_SHARED_GROUP') or dist.new_cpu_group()\n"
        "            self._group, self._group_generation = _SHARED_GROUP, dist.generation()\n",
        (
            "tests/test_async_save.py::test_two_savers_with_saves_in_flight_at_once_commit_each_its_own",
        ),
    ),
    Mutation(
        "best strategy drops a preemption save",
        "preemption saves (HF Trainer)",
        "src/shardpoint/integrations/transformers.py",
        "        if self._manager_rules.asked == step and self._saved_step != step:\n",
        "        if False:\n",
        (
            "tests/test_hf_trainer.py::"
            "test_a_preemption_on_an_evaluation_step_is_saved_under_save_strategy_best",
        ),
    ),
    Mutation(
        "whole chunks past their file",
        "hostile input gives typed errors only",
        "src/shardpoint/format/coverage.py",
        "    if not ((end - begin == nbytes) & (end <= np.array(sizes, np.int64))).all():\n",
        "    if not (end - begin == nbytes).all():\n",
        (MANY_CHUNKS + "test_a_bad_whole_tensor_chunk_among_many_is_named",),
    ),
    Mutation(
        "retention drops the save just made",
        "earlier checkpoints never damaged (retention)",
        "src/shardpoint/training/housekeeping.py",
        "        keep = self.retention.keep(candidates) | {saved} | unreadable\n",
        "        keep = self.retention.keep(candidates) | unreadable\n",
        (MANAGER + "test_the_save_just_made_is_kept_beside_a_higher_damaged_step",),
    ),
    Mutation(
        "retention deletes through links",
        "earlier checkpoints never damaged (retention)",
        "src/shardpoint/training/housekeeping.py",
        "        keep = keep | {s for s in steps if source.linked(s)}"
        "  # never deleted through a link\n",
        "",
        (MANAGER + "test_retention_and_clean_up_never_delete_through_a_linked_step",),
    ),
    Mutation(
        "unreadable best metric guessed",
        "earlier checkpoints never damaged (retention)",
        "src/shardpoint/training/housekeeping.py",
        "                    if isinstance(exc.__cause__, OSError):",
        "                    if False:",
        (MANAGER + "test_a_best_metric_that_cannot_be_read_deletes_nothing_that_round",),
    ),
    Mutation(
        "damaged local copy uploaded",
        "earlier checkpoints never damaged (remote)",
        "src/shardpoint/training/tiers.py",
        "            if source.size(name) != wanted[name]:\n",
        "            if False:\n",
        (MANAGER + "test_a_damaged_local_checkpoint_is_not_uploaded_over_the_remote_copy",),
    ),
    Mutation(
        "remote retention drops the upload",
        "earlier checkpoints never damaged (remote)",
        "src/shardpoint/training/housekeeping.py",
        "for s in steps]) | {uploaded}",
        "for s in steps])",
        (MANAGER + "test_remote_retention_keeps_the_step_just_uploaded",),
    ),
    Mutation(
        "memory tier shared between runs",
        "exact resume (memory tier: the run's own copy)",
        "src/shardpoint/training/node_layout.py",
        '    return "job-" + hashlib.sha256(f"{where}\\n{chosen}".encode()).hexdigest()[:16]',
        '    return "job-" + hashlib.sha256(str(directory).encode()).hexdigest()[:16]',
        ("tests/test_memory_tier.py::test_a_new_run_never_restores_an_earlier_runs_memory_copy",),
    ),
    Mutation(
        "replica write failure not agreed",
        "clear errors (no hang on one rank's failure)",
        "src/shardpoint/training/memory_tier.py",
        "            if replica is not None and error is None:\n",
        "            if replica is not None and error is None and False:\n",
        (
            "tests/test_memory_tier.py::"
            "test_a_replica_that_cannot_be_written_fails_the_memory_save_on_every_rank",
        ),
    ),
    Mutation(
        "memory budget ignores the kept step",
        "memory tier budget",
        "src/shardpoint/training/memory_tier.py",
        "        need = held + int(own * (1 + share))\n",
        "        need = int(own * (1 + share))\n",
        (
            "tests/test_memory_tier.py::"
            "test_the_memory_budget_counts_the_step_kept_until_the_next_is_in_place",
        ),
    ),
    Mutation(
        "overlapping reads skip a segment",
        "every byte is checked",
        "src/shardpoint/storage/direct_io.py",
        "        i = bisect.bisect_right(self.reach, lo)  # every one before ends at or",
        "        i = max(bisect.bisect_right(segments, lo, key=lambda s: s.offset) - 1, 0) #",
        (
            "tests/test_range_reads.py::test_any_overlapping_segments_each_get_their_bytes_and_one_report",
        ),
    ),
    Mutation(
        "bounce read fills a zero-copy interior",
        "every byte is checked (reported complete only when in place)",
        "src/shardpoint/storage/direct_io.py",
        "                skip = inner.get(id(s))\n",
        "                skip = None\n",
        (
            "tests/test_range_reads.py::"
            "test_a_bounce_read_never_fills_what_another_segments_zero_copy_read_fills",
        ),
    ),
    Mutation(
        "strided shard taken for a block",
        "exact resume (resharding)",
        "src/shardpoint/tensor_kinds.py",
        "        if not _one_box(t.placements, tuple(t.device_mesh.shape)):\n",
        "        if False:\n",
        (
            "tests/test_format_v2.py::"
            "test_a_strided_shard_that_is_not_one_block_is_refused_on_load_and_save",
        ),
    ),
    Mutation(
        "new rank's streams reported missing",
        "exact resume (RNG on more ranks)",
        "src/shardpoint/tree.py",
        "            dropped = [k for k in target if k not in stored]\n",
        "            dropped = []\n",
        ("tests/test_rng.py::test_rng_streams_saved_on_2_ranks_load_on_3",),
    ),
    Mutation(
        "restore error on one rank not agreed",
        "clear errors (no hang on one rank's failure)",
        "src/shardpoint/training/restore.py",
        "        except Exception as exc:  # anything else (a Stateful's own error): raised on e",
        "        except ZeroDivisionError as exc:  #",
        (MANAGER + "test_an_error_on_one_rank_during_restore_is_raised_on_every_rank",),
    ),
    Mutation(
        "failed load keeps plain values",
        "all-or-nothing loads",
        "src/shardpoint/tree.py",
        "                if not in_stateful:  # a Stateful takes its whole state back instead\n"
        "                    _undo_put(m, target, key, value)\n",
        "",
        (HOSTILE + "test_a_rejected_load_puts_plain_values_back_too",),
    ),
    Mutation(
        "conjugate view saved as an alias",
        "exact resume (values as shown)",
        "src/shardpoint/save_plan.py",
        "            part = part.resolve_conj().resolve_neg()\n",
        "            pass\n",
        (
            "tests/test_roundtrip.py::"
            "test_conjugate_and_negative_views_save_their_values_and_are_refused_as_destinations",
        ),
    ),
    Mutation(
        "passed-over step skipped",
        "exact resume (a resumed run's own saves)",
        "src/shardpoint/training/manager.py",
        "        if self._passed_over:\n"
        "            passed, self._passed_over = self._passed_over, {}\n"
        "            self.housekeeping.set_aside_passed_over(passed)\n",
        "",
        (MANAGER + "test_steps_a_restore_passed_over_are_saved_anew_by_the_resumed_run",),
    ),
    Mutation(
        "failed background save stops preemption save",
        "preemption: the final save happens",
        "src/shardpoint/training/manager.py",
        "                if not preempting:\n                    raise\n",
        "                raise\n",
        (MANAGER + "test_a_failed_background_save_does_not_stop_the_preemption_save",),
    ),
    Mutation(
        "per-rank plain tensor committed",
        "clear errors (refused at save)",
        "src/shardpoint/plan.py",
        "            key = (h.name, h.offsets, h.shape, h.dtype)\n",
        "            key = (h.name, h.offsets, h.shape, '')\n",
        (
            "tests/test_distributed.py::test_a_plain_tensor_that_differs_per_rank_is_refused_at_save",
        ),
    ),
    Mutation(
        "pickle weights cut to the model's shape",
        "clear errors (shapes checked)",
        "src/shardpoint/hf.py",
        "    if differ:  # checked before any tensor is written, as for safetensors files\n",
        "    if False:\n",
        ("tests/test_hf.py::test_pickle_weights_of_other_shapes_are_refused_before_any_is_loaded",),
    ),
    Mutation(
        "export leaves a half export",
        "earlier output never half written",
        "src/shardpoint/hf.py",
        "            for file in written:\n                with contextlib.suppress(Exception):\n",
        "            for file in []:\n                with contextlib.suppress(Exception):\n",
        ("tests/test_hf.py::test_a_failed_export_leaves_no_half_export_and_can_be_run_again",),
    ),
    Mutation(
        "index entries in no file imported",
        "clear errors (incomplete HF download)",
        "src/shardpoint/hf.py",
        "        if lost:\n",
        "        if False:\n",
        ("tests/test_hf.py::test_an_index_listing_a_tensor_no_file_holds_is_refused",),
    ),
    Mutation(
        "header past the readers' limit",
        "open format (every file readable)",
        "src/shardpoint/layout.py",
        " or header + entry > HEADER_BUDGET):\n",
        "):\n",
        (
            "tests/test_safetensors_format.py::"
            "test_files_end_before_their_header_could_pass_the_readers_limit",
            "tests/test_hf.py::"
            "test_an_exported_file_ends_before_its_header_could_pass_the_readers_limit",
        ),
    ),
    Mutation(
        "rollback ignores the marker time",
        "rollback: idempotent across requeues",
        "src/shardpoint/training/rollback.py",
        "committed_at is not None and committed_at < self.time\n",
        "committed_at is not None\n",
        (
            ROLLBACK + "test_the_same_rollback_asked_again_after_a_requeue_changes_nothing",
            ROLLBACK
            + "test_the_command_line_rollback_is_applied_by_the_next_start_and_survives_requeues",
        ),
    ),
    Mutation(
        "rollback skips no batches",
        "rollback: exact resume without the bad batches",
        "src/shardpoint/training/rollback.py",
        "    return to_it[-1].skip_batches if to_it else 0\n",
        "    return 0\n",
        (ROLLBACK + "test_a_rollback_with_skipped_batches_resumes_as_a_run_that_never_saw_them",),
    ),
    Mutation(
        "rollback keeps newer memory copies",
        "rollback: no tier restores past it",
        "src/shardpoint/training/housekeeping.py",
        "            self.memory.discard(rollback.passes_over)\n",
        "            pass\n",
        (ROLLBACK + "test_a_rollback_drops_newer_memory_copies_written_before_it",),
    ),
    Mutation(
        "rollback leaves the remote",
        "rollback: no tier restores past it",
        "src/shardpoint/training/housekeeping.py",
        '            tiers.append(("remote", self.remote))\n        for name, tier in tiers:\n',
        "            pass\n        for name, tier in tiers:\n",
        (ROLLBACK + "test_a_rollback_sets_aside_the_remote_copies_too_keeping_their_bytes",),
    ),
    Mutation(
        "explicit older restore sets nothing aside",
        "restore(step=N): later saves and retention correct",
        "src/shardpoint/training/restore.py",
        '                    passed = {s: ({"local", "remote"}, "superseded") for s in newer}\n',
        "                    passed = {}\n",
        (
            ROLLBACK
            + "test_restoring_an_explicit_older_step_lets_later_saves_and_retention_proceed",
        ),
    ),
    Mutation(
        "NaN saved",
        "never committing NaN",
        "src/shardpoint/training/manager.py",
        '        if first is None:\n            return\n        self.events.log("save_refused"',
        '        if True:\n            return\n        self.events.log("save_refused"',
        (ROLLBACK + "test_a_state_with_nan_is_never_committed_and_the_good_checkpoints_stay",),
    ),
    Mutation(
        "NaN checked on its own rank only",
        "never committing NaN (every rank agrees)",
        "src/shardpoint/training/manager.py",
        "        _, first = dist.worst_error(mine, 0)\n",
        "        first = mine\n",
        (ROLLBACK + "test_nan_on_one_rank_is_refused_on_every_rank_and_no_tier_takes_it",),
    ),
    Mutation(
        "preemption ignores the grace",
        "a short grace: the final save goes to memory and exits in time",
        "src/shardpoint/training/manager.py",
        "        short = needed > left\n",
        "        short = False\n",
        (
            GRACE
            + "test_a_grace_shorter_than_a_disk_save_saves_to_memory_and_the_restart_restores_it",
            GRACE + "test_sigusr1_with_a_short_grace_on_2_nodes_saves_to_memory_exits_143_and_"
            "resumes_exactly",
        ),
    ),
    Mutation(
        "grace decided per rank",
        "a short grace: every rank saves to the same tier",
        "src/shardpoint/training/manager.py",
        "            short = bool(dist.max_of([int(short)])[0])\n",
        "            short = short and dist.rank() == 0\n",
        (
            GRACE + "test_sigusr1_with_a_short_grace_on_2_nodes_saves_to_memory_exits_143_and_"
            "resumes_exactly",
        ),
    ),
    Mutation(
        "preemption to memory without the buddies",
        "a short grace: the memory copy is complete before the exit",
        "src/shardpoint/training/manager.py",
        "            self.memory.wait()  # this node's copy and the buddies' replicas complete\n",
        "            pass\n",
        (GRACE + "test_a_memory_save_that_fails_at_preemption_falls_back_to_the_disk",),
    ),
    Mutation(
        "restarts ignore the memory tier",
        "elastic restarts recover from host memory, losing at most its interval",
        "src/shardpoint/training/restore.py",
        "            if in_memory is not None and in_memory >= max(on_disk | remote, "
        "default=-1):\n",
        "            if False:\n",
        (
            CAMPAIGN + "test_each_failure_restores_from_its_tier_and_loses_at_most_that_tiers_"
            "interval",
        ),
    ),
    Mutation(
        "retention forgets the last good one",
        "a streak of diverged saves keeps the last good checkpoint",
        "src/shardpoint/training/retention.py",
        "            kept |= set(good[-self.keep_last_good :])\n",
        "            pass\n",
        (
            "tests/test_checkpoint_manager.py::"
            "test_a_streak_of_diverged_saves_never_rotates_the_last_good_checkpoint_out",
            "tests/test_retention_policy.py::"
            "test_keep_last_good_keeps_the_newest_good_ones_behind_a_bad_streak",
        ),
    ),
    Mutation(
        "every save recorded as good",
        "a streak of diverged saves keeps the last good checkpoint",
        "src/shardpoint/training/manager.py",
        '        metadata = {"step": step, "metrics": metrics, "good": finite}\n',
        '        metadata = {"step": step, "metrics": metrics, "good": True}\n',
        (
            "tests/test_checkpoint_manager.py::"
            "test_a_streak_of_diverged_saves_never_rotates_the_last_good_checkpoint_out",
        ),
    ),
    Mutation(
        "the step just saved taken as good",
        "a streak of diverged saves keeps the last good checkpoint",
        "src/shardpoint/training/housekeeping.py",
        "            if step == saved and saved_good or step != saved and self._good(step):\n",
        "            if step == saved or self._good(step):\n",
        (
            "tests/test_checkpoint_manager.py::"
            "test_a_streak_of_diverged_saves_never_rotates_the_last_good_checkpoint_out",
        ),
    ),
    Mutation(
        "load stages past its budget",
        "a load holds at most its host-memory budget of new tensors",
        "src/shardpoint/loading.py",
        "                        while reads and (reads[0][0].done() or staged > batch.staged):\n",
        "                        while reads and reads[0][0].done():\n",
        (LOAD_BUDGET + "test_a_load_that_cannot_read_in_place_holds_at_most_its_budget",),
    ),
    Mutation(
        "placed batch without an undo copy",
        "a failed load changes nothing (batches placed before the failure)",
        "src/shardpoint/loading.py",
        "                        if p.live:\n                            undo.save([p.copy[0]])\n"
        "                        p.copy[0].copy_(p.copy[1])\n",
        "                        p.copy[0].copy_(p.copy[1])\n",
        (LOAD_BUDGET + "test_batches_placed_before_a_corrupt_one_are_put_back",),
    ),
    Mutation(
        "undo in pool slots not put back",
        "a failed load changes nothing (undo copy in a staging pool)",
        "src/shardpoint/loading.py",
        "                    live[0].copy_(old[0])\n                    continue\n"
        "                _scatter(old, live)\n",
        "                    live[0].copy_(old[0])\n                    continue\n",
        (UNDO_POOL + "test_a_failed_load_into_pool_slots_puts_every_tensor_back",),
    ),
    Mutation(
        "undo slots kept after the load",
        "a load hands the slots it borrowed back to the saver's pool",
        "src/shardpoint/loading.py",
        "            for slot in self._borrowed:\n                self._pool.release(slot)\n",
        "            pass\n",
        (UNDO_POOL + "test_loads_into_a_pool_reuse_its_slots_and_a_save_after_them_too",),
    ),
]


def run(m: Mutation) -> tuple[bool, float, str]:
    """Apply ``m``, run its tests, restore the file; (killed, seconds, last line)."""
    path = ROOT / m.file
    original = path.read_bytes()
    text = original.decode()
    if text.count(m.old) != 1:
        raise SystemExit(f"{m.name}: the text to replace is not found exactly once in {m.file}")
    mutated = text.replace(m.old, m.new)
    compile(mutated, m.file, "exec")  # a mutant that does not even parse proves nothing
    start = time.perf_counter()
    try:
        path.write_text(mutated)
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=900,
        )
        # The first failure says why the tests noticed: it must be the broken guarantee.
        why = [ln for ln in done.stdout.splitlines() if ln.startswith(("E ", "FAILED"))]
        return done.returncode != 0, time.perf_counter() - start, " ".join(why[:1])
    except subprocess.TimeoutExpired:
        return True, time.perf_counter() - start, "timed out (a hang counts as noticed)"
    finally:
        path.write_bytes(original)


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # so that ``run`` restores the file it mutated


def main() -> int:
    signal.signal(signal.SIGTERM, _stop)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated mutation names (default: all)")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only.split(",")]
    survived = 0
    print(f"{'mutation':32} {'guarantee':44} result   seconds")
    for m in chosen:
        killed, seconds, last = run(m)
        survived += not killed
        verdict = "killed" if killed else "SURVIVED"
        print(f"{m.name:32} {m.guarantee:44} {verdict:8} {seconds:7.1f}   {last[:70]}", flush=True)
    print(f"{len(chosen) - survived} of {len(chosen)} mutations noticed by their tests")
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main())
