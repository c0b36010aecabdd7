"""The pure planners, one behaviour per test, no processes and no files: how a file's
bytes are cut into zero-copy blocks and bounce spans (``storage/direct_io.py``), how a
rank's pieces are packed into shard files (``layout._pack``), how rank 0 builds the
index from every rank's report (``save_commit.build_index``), and how every rank's
tree becomes one (``tree.merge_trees``)."""

from __future__ import annotations

import mmap
from types import SimpleNamespace

import pytest
import torch

from shardpoint.errors import UnsupportedValueError
from shardpoint.format.index import PLAIN_VERSION, REFERENCES_VERSION, Chunk
from shardpoint.layout import HEADER_BUDGET, _pack
from shardpoint.names import fragment_file, shard_file
from shardpoint.save_commit import build_index
from shardpoint.save_records import ChunkRecord, WriteResult
from shardpoint.sharding import Mesh, Sharding
from shardpoint.storage.direct_io import (
    COALESCE_GAP,
    _blocks,
    _bounce_read_spans,
    _ByOffset,
    _coalesce,
    _gaps,
    _padded,
    _zero_copy_interiors,
)
from shardpoint.storage.io_types import ALIGN, BLOCK, ZERO_COPY_MIN_BYTES, Segment
from shardpoint.tree import decode, flatten, merge_trees

MiB = 1024 * 1024


# ---- direct_io: zero-copy interiors, blocks, bounce spans, coalesced reads ---------------


def _page_aligned(nbytes: int) -> torch.Tensor:
    """Bytes whose first one sits at a page boundary (anonymous mmap), so a test picks
    the address of a tensor modulo the page size by slicing."""
    memory = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
    assert memory.data_ptr() % ALIGN == 0
    return memory


def _segment(offset: int, nbytes: int) -> Segment:
    """A segment whose memory is not looked at (address, congruence irrelevant)."""
    return Segment(offset, torch.empty(nbytes, dtype=torch.uint8))


def test_padded_rounds_up_to_whole_pages_and_keeps_zero_and_exact_pages():
    assert [_padded(n) for n in (0, 1, ALIGN - 1, ALIGN, ALIGN + 1)] == [
        0,
        ALIGN,
        ALIGN,
        ALIGN,
        2 * ALIGN,
    ]


def test_a_large_congruent_segment_moves_its_whole_inner_pages_zero_copy():
    memory = _page_aligned(3 * MiB)
    # Address 100 into a page, file offset 100 into a page: congruent.
    s = Segment(3 * ALIGN + 100, memory[100 : 100 + MiB + 5000])
    assert s.end == 1_065_964
    assert _zero_copy_interiors([s]) == [(4 * ALIGN, 260 * ALIGN, s)]


def test_a_large_segment_not_congruent_with_its_file_offset_has_no_zero_copy_interior():
    memory = _page_aligned(3 * MiB)
    s = Segment(3 * ALIGN + 101, memory[100 : 100 + MiB + 5000])
    assert _zero_copy_interiors([s]) == []


def test_a_congruent_segment_moves_zero_copy_from_exactly_zero_copy_min_bytes():
    memory = _page_aligned(2 * MiB)
    just_under = Segment(0, memory[: ZERO_COPY_MIN_BYTES - 1])
    exactly = Segment(0, memory[:ZERO_COPY_MIN_BYTES])
    assert _zero_copy_interiors([just_under]) == []
    assert _zero_copy_interiors([exactly]) == [(0, ZERO_COPY_MIN_BYTES, exactly)]


def test_blocks_cut_an_interior_into_block_long_jobs_the_last_one_shorter():
    s = _segment(0, 0)
    assert list(_blocks([(ALIGN, ALIGN + 2 * BLOCK + ALIGN, s)])) == [
        (ALIGN, ALIGN + BLOCK, s),
        (ALIGN + BLOCK, ALIGN + 2 * BLOCK, s),
        (ALIGN + 2 * BLOCK, ALIGN + 2 * BLOCK + ALIGN, s),
    ]


def test_blocks_of_an_interior_of_whole_blocks_have_no_empty_tail():
    s = _segment(0, 0)
    assert list(_blocks([(0, 2 * BLOCK, s)])) == [(0, BLOCK, s), (BLOCK, 2 * BLOCK, s)]


def test_gaps_are_what_the_interiors_leave_of_the_file_in_offset_order():
    s = _segment(0, 0)
    interiors = [(10 * ALIGN, 12 * ALIGN, s), (2 * ALIGN, 4 * ALIGN, s)]  # not sorted
    assert _gaps(interiors, 14 * ALIGN) == [
        (0, 2 * ALIGN),
        (4 * ALIGN, 10 * ALIGN),
        (12 * ALIGN, 14 * ALIGN),
    ]


def test_gaps_of_an_empty_file_are_none_and_an_interior_up_to_the_end_leaves_no_tail():
    s = _segment(0, 0)
    assert _gaps([], 0) == []
    assert _gaps([(0, 3 * ALIGN, s)], 3 * ALIGN) == []


def test_a_gap_longer_than_a_block_is_split_into_block_long_spans():
    assert _gaps([], 2 * BLOCK + ALIGN) == [
        (0, BLOCK),
        (BLOCK, 2 * BLOCK),
        (2 * BLOCK, 2 * BLOCK + ALIGN),
    ]


def test_a_direct_write_covers_every_byte_of_the_padded_file_exactly_once():
    memory = _page_aligned(4 * MiB)
    small = Segment(0, memory[: 8 + 300])  # a header and a small tensor, bounced
    large = Segment(8 + 300, memory[8 + 300 : 8 + 300 + 2 * MiB + 7])  # congruent
    size = large.end
    interiors = _zero_copy_interiors([small, large])
    assert [(lo, hi) for lo, hi, _ in interiors] == [(ALIGN, 512 * ALIGN)]
    spans = [(lo, hi) for lo, hi, _ in _blocks(interiors)] + _gaps(interiors, _padded(size))
    covered = sorted(spans)
    assert covered == [(0, ALIGN), (ALIGN, 512 * ALIGN), (512 * ALIGN, 513 * ALIGN)]
    assert all(lo % ALIGN == 0 and hi % ALIGN == 0 for lo, hi in covered)


def test_bounce_read_spans_are_the_heads_tails_and_small_segments_rounded_out_and_merged():
    memory = _page_aligned(3 * MiB)
    large = Segment(100, memory[100 : 100 + MiB + 5000])  # interior [ALIGN, 257 pages)
    assert large.end == 1_053_676
    beside = Segment(large.end + 10, memory[:50])  # in the tail's last page: merged
    empty = Segment(5 * ALIGN + 7, memory[:0])  # nothing to read
    far = Segment(2 * MiB, memory[:10])
    interiors = _zero_copy_interiors([large])
    assert [(lo, hi) for lo, hi, _ in interiors] == [(ALIGN, 257 * ALIGN)]
    assert _bounce_read_spans([large, beside, empty, far], interiors) == [
        (0, ALIGN),  # the head [100, 4096)
        (257 * ALIGN, 258 * ALIGN),  # the tail and the small segment after it
        (2 * MiB, 2 * MiB + ALIGN),
    ]


def test_bounce_read_spans_of_segments_in_adjacent_pages_merge_into_one_span():
    first = _segment(0, 100)
    next_page = _segment(ALIGN + 5, 5)
    apart = _segment(3 * ALIGN, 5)  # a page between: a span of its own
    assert _bounce_read_spans([first, next_page, apart], []) == [
        (0, 2 * ALIGN),
        (3 * ALIGN, 4 * ALIGN),
    ]


@pytest.mark.parametrize(("gap", "spans"), [(COALESCE_GAP, 1), (COALESCE_GAP + 1, 2)])
def test_small_reads_are_coalesced_across_a_gap_of_at_most_coalesce_gap(gap, spans):
    a = _segment(0, 100)
    b = _segment(100 + gap, 100)
    expected = [(0, b.end)] if spans == 1 else [(0, 100), (b.offset, b.end)]
    assert _coalesce([a, b]) == expected


@pytest.mark.parametrize(("length", "joins"), [(990, True), (991, False)])
def test_a_coalesced_span_grows_to_exactly_one_block_and_no_further(length, joins):
    a = _segment(0, BLOCK - 1000)
    b = _segment(BLOCK - 990, length)  # a 10-byte gap; ends at BLOCK, or one past it
    expected = [(0, b.end)] if joins else [(0, a.end), (b.offset, b.end)]
    assert _coalesce([a, b]) == expected


def test_a_segment_overlapping_the_span_so_far_joins_it_even_past_a_block():
    a = _segment(0, BLOCK - 1000)
    b = _segment(500, BLOCK)  # two regions of one stored range
    assert _coalesce([a, b]) == [(0, BLOCK + 500)]


def test_coalescing_no_segments_gives_no_spans():
    assert _coalesce([]) == []


def test_by_offset_finds_an_earlier_longer_segment_reaching_into_a_span():
    long = _segment(0, 10_000)
    inner = _segment(100, 100)
    later = _segment(5000, 100)
    by_offset = _ByOffset([long, inner, later])
    assert list(by_offset.overlapping(6000, 7000)) == [long]
    assert list(by_offset.overlapping(150, 5050)) == [long, inner, later]
    assert list(by_offset.overlapping(10_000, 20_000)) == []  # ends are exclusive


# ---- layout._pack: pieces into shard files ----------------------------------------------


def _tensors(sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    return {name: torch.empty(n, dtype=torch.uint8) for name, n in sizes.items()}


def test_packing_no_pieces_still_gives_one_empty_file():
    assert _pack([], {}, 100, 3) == {"rank00003-00000.safetensors": []}


def test_pieces_fill_files_greedily_in_state_order():
    tensors = _tensors({"a": 40, "b": 40, "c": 40, "d": 10})
    assert _pack(list(tensors), tensors, 100, 0) == {
        shard_file(0, 0): ["a", "b"],
        shard_file(0, 1): ["c", "d"],
    }


def test_a_file_takes_pieces_up_to_exactly_max_bytes():
    tensors = _tensors({"a": 50, "b": 50, "c": 1})
    assert _pack(list(tensors), tensors, 100, 0) == {
        shard_file(0, 0): ["a", "b"],
        shard_file(0, 1): ["c"],
    }


def test_one_tensor_larger_than_max_bytes_gets_a_file_of_its_own():
    tensors = _tensors({"a": 10, "big": 500, "c": 10})
    assert _pack(list(tensors), tensors, 100, 0) == {
        shard_file(0, 0): ["a"],
        shard_file(0, 1): ["big"],
        shard_file(0, 2): ["c"],
    }


def test_an_oversized_first_tensor_does_not_leave_an_empty_file_before_it():
    tensors = _tensors({"big": 500, "c": 10})
    assert _pack(list(tensors), tensors, 100, 0) == {
        shard_file(0, 0): ["big"],
        shard_file(0, 1): ["c"],
    }


def test_packing_counts_bytes_not_elements():
    tensors = {"a": torch.empty(20, dtype=torch.float32), "b": torch.empty(5)}  # 80 + 20
    assert _pack(["a", "b"], tensors, 99, 0) == {
        shard_file(0, 0): ["a"],
        shard_file(0, 1): ["b"],
    }


def test_packing_follows_the_order_of_the_names_given_not_of_the_tensors():
    tensors = _tensors({"a": 60, "b": 60, "c": 30})
    assert _pack(["a", "c", "b"], tensors, 100, 0) == {
        shard_file(0, 0): ["a", "c"],
        shard_file(0, 1): ["b"],
    }


def test_files_are_named_for_the_rank_and_numbered_from_zero():
    tensors = _tensors({"a": 100, "b": 100, "c": 100})
    assert list(_pack(list(tensors), tensors, 100, 12)) == [
        "rank00012-00000.safetensors",
        "rank00012-00001.safetensors",
        "rank00012-00002.safetensors",
    ]


def test_a_file_ends_once_its_header_would_pass_the_header_budget():
    # Each entry counts twice its name's bytes plus 256: ten such fill the budget exactly.
    length = (HEADER_BUDGET // 10 - 256) // 2
    assert 10 * (2 * length + 256) == HEADER_BUDGET
    names = [chr(ord("a") + i) * length for i in range(11)]
    tensors = _tensors(dict.fromkeys(names, 0))  # no bytes: only the header counts
    packed = _pack(names, tensors, 1 << 40, 0)
    assert [len(group) for group in packed.values()] == [10, 1]
    assert packed[shard_file(0, 1)] == [names[10]]


# ---- save_commit.build_index: the index from every rank's report ------------------------

SUM = "0123456789abcdef"
CREATED = "2026-01-01T00:00:00+00:00"


def _record(
    name: str,
    rank: int,
    offsets: tuple[int, ...],
    shape: tuple[int, ...],
    global_shape: tuple[int, ...],
    *,
    dtype: str = "F32",
    begin: int = 8192,
    copy_of: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
    file: str | None = None,
) -> ChunkRecord:
    nbytes = 4 * shape[0] * shape[1] if len(shape) == 2 else 4 * shape[0]
    key = name if shape == global_shape else f"{name}@{','.join(map(str, offsets))}"
    chunk = Chunk(
        file or shard_file(rank, 0), key, offsets, shape, (begin, begin + nbytes), shape[0], (SUM,)
    )
    return ChunkRecord(name, dtype, global_shape, chunk, copy_of)


def _result(rank: int, *chunks: ChunkRecord, size: int = 100_000, **kw) -> WriteResult:
    file = shard_file(rank, 0)
    return WriteResult(
        files={file: size}, chunks=list(chunks), headers={file: f"{rank:016x}"}, **kw
    )


def _plan(nodes: list[int], aliases: list[dict[str, str]] | None = None) -> SimpleNamespace:
    """What build_index reads of a save's plan: every rank's aliases and node."""
    aliases = aliases or [{} for _ in nodes]
    return SimpleNamespace(structures=[{"aliases": a, "node": n} for a, n in zip(aliases, nodes)])


def _build(results: list[WriteResult], **kw):
    plan = kw.pop("plan", None) or _plan([0] * len(results))
    table = kw.pop("table", ({}, None))
    return build_index(plan, {"dict": []}, results, kw.pop("metadata", None), table, CREATED, **kw)


def test_an_index_of_no_ranks_is_empty():
    index = _build([])
    assert (index.files, index.entries, index.world_size) == ({}, {}, 0)
    assert index.format_version == PLAIN_VERSION


def test_a_rank_without_chunks_still_lists_its_files():
    index = _build([_result(0)])
    assert index.files == {shard_file(0, 0): 100_000}
    assert index.entries == {}


def test_a_tensors_chunks_are_sorted_by_offsets_whichever_rank_wrote_them():
    rows_4_to_8 = _record("w", 0, (4, 0), (4, 2), (8, 2))
    rows_0_to_4 = _record("w", 1, (0, 0), (4, 2), (8, 2))
    index = _build([_result(0, rows_4_to_8), _result(1, rows_0_to_4, size=200_000)])
    entry = index.entries["w"]
    assert (entry.dtype, entry.shape) == ("F32", (8, 2))
    assert [c.offsets for c in entry.chunks] == [(0, 0), (4, 0)]
    assert [c.file for c in entry.chunks] == [shard_file(1, 0), shard_file(0, 0)]
    assert index.files == {shard_file(0, 0): 100_000, shard_file(1, 0): 200_000}
    assert index.world_size == 2
    assert index.created == CREATED


def test_a_dtype_that_differs_between_ranks_is_refused_naming_per_rank():
    on_rank_0 = _record("step_scale", 0, (0,), (1,), (1,))
    on_rank_1 = _record("step_scale", 1, (0,), (1,), (1,), dtype="BF16")
    with pytest.raises(UnsupportedValueError) as refused:
        _build([_result(0, on_rank_0), _result(1, on_rank_1)])
    assert "'step_scale' is F32[1] on one rank and BF16[1] on rank 1" in str(refused.value)
    assert "shardpoint.PerRank" in str(refused.value)


def test_a_global_shape_that_differs_between_ranks_is_refused():
    with pytest.raises(UnsupportedValueError, match=r"'w' is F32\[4\] on one rank"):
        _build(
            [
                _result(0, _record("w", 0, (0,), (4,), (4,))),
                _result(1, _record("w", 1, (0,), (4,), (8,))),
            ]
        )


def _two_nodes() -> tuple[list[int], list[WriteResult]]:
    """Four ranks on two nodes: the norm's box is written on both nodes (by ranks 1 and
    2), the bias's on node 0 only (rank 0)."""
    norm = ((0,), (8,))
    bias = ((0,), (4,))
    results = [
        _result(0, _record("bias", 0, *bias, (4,), copy_of=bias)),
        _result(1, _record("norm", 1, *norm, (8,), copy_of=norm)),
        _result(2, _record("norm", 2, *norm, (8,), copy_of=norm)),
        _result(3),
    ]
    return [0, 0, 1, 1], results


def test_a_node_local_index_takes_the_nodes_own_copy_of_replicated_state():
    nodes, results = _two_nodes()
    first = _build(results, plan=_plan(nodes), node=0, nodes=nodes)
    second = _build(results, plan=_plan(nodes), node=1, nodes=nodes)
    assert [c.file for c in first.entries["norm"].chunks] == [shard_file(1, 0)]
    assert [c.file for c in second.entries["norm"].chunks] == [shard_file(2, 0)]


def test_a_node_local_index_takes_the_first_nodes_copy_of_state_its_node_does_not_hold():
    nodes, results = _two_nodes()
    second = _build(results, plan=_plan(nodes), node=1, nodes=nodes)
    assert [c.file for c in second.entries["bias"].chunks] == [shard_file(0, 0)]
    # Its own files, and the other node's file it takes the bias from; not rank 1's.
    assert second.files == {shard_file(r, 0): 100_000 for r in (0, 2, 3)}


def test_a_node_without_a_copy_takes_the_lowest_numbered_nodes_of_several_copies():
    box = ((0,), (8,))
    nodes = [0, 1, 2]
    results = [  # a copy on nodes 0 and 2, none on node 1
        _result(0, _record("norm", 0, *box, (8,), copy_of=box)),
        _result(1),
        _result(2, _record("norm", 2, *box, (8,), copy_of=box)),
    ]
    middle = _build(results, plan=_plan(nodes), node=1, nodes=nodes)
    assert [c.file for c in middle.entries["norm"].chunks] == [shard_file(0, 0)]


def test_a_node_local_index_keeps_only_the_headers_of_the_files_it_lists():
    nodes, results = _two_nodes()
    first = _build(results, plan=_plan(nodes), node=0, nodes=nodes)
    second = _build(results, plan=_plan(nodes), node=1, nodes=nodes)
    assert first.files.keys() == {shard_file(0, 0), shard_file(1, 0)}
    assert first.headers == {shard_file(r, 0): f"{r:016x}" for r in (0, 1)}
    assert second.headers == {shard_file(r, 0): f"{r:016x}" for r in (0, 2, 3)}


def test_an_index_that_refers_to_earlier_checkpoints_files_has_the_references_version():
    earlier = "../step-000000001/rank00000-00000.safetensors"
    unchanged = _record("w", 0, (0,), (4,), (4,), file=earlier)
    changed = _record("b", 0, (0,), (4,), (4,))
    index = _build([_result(0, unchanged, changed, referenced={earlier: 5000}), _result(1)])
    assert index.format_version == REFERENCES_VERSION
    assert index.files == {earlier: 5000, shard_file(0, 0): 100_000, shard_file(1, 0): 100_000}


def test_an_index_without_references_has_the_plain_version():
    index = _build([_result(0, _record("w", 0, (0,), (4,), (4,))), _result(1)])
    assert index.format_version == PLAIN_VERSION


def test_every_ranks_fragment_is_listed_with_its_size_and_checksum():
    fragmented = _result(1, fragment=(321, SUM), fragment_files=[shard_file(1, 0)])
    fragmented.files[fragment_file(1)] = 321
    index = _build([_result(0), fragmented])
    assert index.fragments == {1: (321, SUM)}
    assert index.files[fragment_file(1)] == 321


def test_aliases_come_from_every_ranks_structure_except_names_that_are_entries():
    w = _record("w", 0, (0,), (4,), (4,))
    plan = _plan([0, 0], [{"tied": "w"}, {"w": "tied", "head": "w"}])
    index = _build([_result(0, w), _result(1)], plan=plan)
    assert index.aliases == {"tied": "w", "head": "w"}


def test_a_sharded_entry_is_described_by_its_sharding_and_lists_no_chunks():
    sharding = Sharding(Mesh((2,), range(2)), (0,))
    index = _build([_result(0), _result(1)], table=({"big": ("BF16", (8, 4), sharding)}, None))
    assert index.entries["big"].chunks == ()
    assert (index.entries["big"].dtype, index.entries["big"].shape) == ("BF16", (8, 4))
    assert index.shardings == {"big": sharding}


def test_a_tensor_sharded_on_some_ranks_and_written_whole_on_others_is_refused():
    sharding = Sharding(Mesh((2,), range(2)), (0,))
    table = ({"w": ("F32", (4,), sharding)}, None)
    with pytest.raises(UnsupportedValueError, match=r"'w' is sharded on some ranks"):
        _build([_result(0, _record("w", 0, (0,), (4,), (4,))), _result(1)], table=table)


def test_a_conflict_in_the_sharded_table_is_refused_with_its_message():
    with pytest.raises(UnsupportedValueError, match="sharded differently"):
        _build([_result(0)], table=({}, "'w' is sharded differently on different ranks"))


# ---- tree.merge_trees: one tree from every rank's ------------------------------------------


def _tree(state: object) -> object:
    return flatten(state).tree


def _value(tree: object) -> object:
    return decode(tree, lambda name: f"<tensor {name}>")


def test_equal_trees_merge_into_the_first_one_itself():
    trees = [_tree({"step": 3, "lr": 0.1}), _tree({"step": 3, "lr": 0.1})]
    assert merge_trees(trees) is trees[0]


def test_one_ranks_tree_is_the_jobs_tree():
    tree = _tree({"step": 3, "weights": [1, 2]})
    assert merge_trees([tree]) is tree


def test_keys_held_by_some_ranks_only_are_merged_in_order_of_first_appearance():
    trees = [_tree({"step": 3, "rng": {0: "a"}}), _tree({"step": 3, "rng": {1: "b"}, "x": 1})]
    assert _value(merge_trees(trees)) == {"step": 3, "rng": {0: "a", 1: "b"}, "x": 1}
    assert list(_value(merge_trees(trees))) == ["step", "rng", "x"]


def test_an_int_key_and_the_equal_looking_str_key_stay_two_keys():
    merged = _value(merge_trees([_tree({1: "int"}), _tree({"1": "str"})]))
    assert merged == {1: "int", "1": "str"}


def test_lists_of_one_length_are_merged_item_by_item():
    trees = [_tree({"groups": [{"lr": 0.1}, {0: 1}]}), _tree({"groups": [{"lr": 0.1}, {1: 2}]})]
    assert _value(merge_trees(trees)) == {"groups": [{"lr": 0.1}, {0: 1, 1: 2}]}


def test_tuples_stay_tuples_when_merged():
    trees = [_tree(({0: "a"},)), _tree(({1: "b"},))]
    assert _value(merge_trees(trees)) == ({0: "a", 1: "b"},)


def test_lists_of_different_lengths_are_refused():
    with pytest.raises(UnsupportedValueError, match=r"at 'groups' differs across ranks"):
        merge_trees([_tree({"groups": [1, 2]}), _tree({"groups": [1, 2, 3]})])


def test_a_value_that_differs_across_ranks_is_refused_naming_its_path():
    trees = [_tree({"opt": {"groups": [{"lr": 0.1}]}}), _tree({"opt": {"groups": [{"lr": 0.2}]}})]
    with pytest.raises(UnsupportedValueError, match=r"at 'opt\.groups\.0\.lr' differs"):
        merge_trees(trees)


def test_trees_of_different_kinds_at_the_root_are_refused_naming_the_root():
    with pytest.raises(UnsupportedValueError, match=r"at '<root>' differs"):
        merge_trees([_tree({"a": 1}), _tree([1])])


def test_a_differing_value_is_refused_even_when_the_first_ranks_agree():
    trees = [_tree({"seed": 1}), _tree({"seed": 1}), _tree({"seed": 2})]
    with pytest.raises(UnsupportedValueError, match=r"at 'seed' differs"):
        merge_trees(trees)
