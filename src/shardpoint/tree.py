"""Flattening nested training state to named tensors plus a JSON tree, and back.

The tree is stored in ``index.json``. Containers are tagged JSON objects so every
Python type comes back as itself (a tuple stays a tuple, an ``int`` dict key stays an
``int``); a bare JSON object never appears, so tags cannot collide with user data:

    {"dict": [[key, value], ...]}   {"list": [...]}   {"tuple": [...]}
    {"bytes": "<base64>"}           {"float": "nan" | "inf" | "-inf"}
    {"tensor": "<entry name>"}

Finite floats, ints, bools, ``None`` and strings are plain JSON. Objects with
``state_dict()``/``load_state_dict()`` (the ``Stateful`` protocol) are stored as their
state dict. Anything else is refused at save time with its path.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from .errors import StateMismatchError, UnsupportedValueError
from .tensor_memory import plain


@runtime_checkable
class Stateful(Protocol):
    """An object that can save and restore itself through a state dict."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def is_stateful(obj: object) -> bool:
    return not isinstance(obj, (torch.Tensor, dict)) and isinstance(obj, Stateful)


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


class PerRank(dict):  # type: ignore[type-arg]
    """A dict holding this rank's own entry, ``{rank: value}``, which every rank saves
    for itself (``TrainState``'s RNG streams). Under ``torch.distributed`` the value —
    its tensors included — goes into the rank's fragment (format version 2) and the
    index keeps ``{"in_fragment": [rank, path]}``: the index does not grow by a value
    per rank, and a restoring rank reads only the fragment it restores from."""


@dataclass
class FlatState:
    tree: Any  # JSON-ready encoded tree
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # This rank's ``PerRank`` values by path, and the tensors inside them (its fragment's).
    rank_values: dict[str, Any] = field(default_factory=dict)
    rank_tensors: set[str] = field(default_factory=set)


def flatten(state: object, *, rank: int | None = None) -> FlatState:
    """Encode ``state`` to a JSON tree; tensors are collected by dotted path name.
    With ``rank``, that rank's ``PerRank`` values are set aside for its fragment."""
    flat = FlatState(tree=None)
    flat.tree = _encode(state, "", flat.tensors, rank, flat)
    return flat


def _encode(
    value: object,
    path: str,
    tensors: dict[str, torch.Tensor],
    rank: int | None = None,
    flat: FlatState | None = None,
) -> Any:
    if isinstance(value, PerRank) and rank is not None and flat is not None:
        entries = []
        for k, v in value.items():
            at = _join(path, k)
            node = _encode(v, at, tensors)
            if k == rank:
                flat.rank_values[at] = node
                flat.rank_tensors.update(tensor_names(node))
                node = {"in_fragment": [rank, at]}
            entries.append([_encode_key(k, path), node])
        return {"dict": entries}
    if isinstance(value, torch.Tensor):
        if path in tensors:
            raise UnsupportedValueError(
                f"two tensors map to the entry name {path!r}; rename a key so that dotted "
                "paths are unique (e.g. a key containing '.' collides with a nested one)"
            )
        tensors[path] = plain(value)
        return {"tensor": path}
    if is_stateful(value):
        return _encode(value.state_dict(), path, tensors, rank, flat)  # type: ignore[union-attr]
    if isinstance(value, dict):
        return {
            "dict": [
                [_encode_key(k, path), _encode(v, _join(path, k), tensors, rank, flat)]
                for k, v in value.items()
            ]
        }
    if type(value) is list:
        return {
            "list": [_encode(v, _join(path, i), tensors, rank, flat) for i, v in enumerate(value)]
        }
    if type(value) is tuple:
        return {
            "tuple": [_encode(v, _join(path, i), tensors, rank, flat) for i, v in enumerate(value)]
        }
    return _encode_scalar(value, path)


def _encode_key(key: object, path: str) -> Any:
    if type(key) is tuple:
        return {"tuple": [_encode_key(k, path) for k in key]}
    return _encode_scalar(key, _join(path, f"<key {key!r}>"))


def _encode_scalar(value: object, path: str) -> Any:
    kind = type(value)
    if kind is str:
        try:
            value.encode("utf-8")  # type: ignore[attr-defined]
        except UnicodeEncodeError:
            raise UnsupportedValueError(
                f"cannot save the string at {path or '<root>'!r}: it holds a lone surrogate "
                f"({value!r}), which is not valid Unicode; fix the text (the index is UTF-8)"
            ) from None
        return value
    if value is None or kind in (bool, int):
        return value
    if kind is float:
        if math.isfinite(value):  # type: ignore[arg-type]
            return value
        return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}  # type: ignore[operator]
    if kind is bytes:
        return {"bytes": base64.b64encode(value).decode("ascii")}  # type: ignore[arg-type]
    raise UnsupportedValueError(
        f"cannot save {kind.__module__}.{kind.__qualname__} at {path or '<root>'!r}: only "
        "tensors, Stateful objects, dict/list/tuple, and int/float/bool/None/str/bytes are "
        "stored (no pickle). Convert it (e.g. to a tensor, a list or a str) before saving."
    )


# Supplies the encoded value a rank kept in its fragment: (rank, path) -> tree node.
Resolver = Callable[[int, str], Any]


def _no_fragment(rank: int, path: str) -> Any:
    raise ValueError(f"the value at {path!r} is in rank {rank}'s fragment, which is not read here")


def decode(
    node: Any, tensor: Callable[[str], torch.Tensor], resolve: Resolver = _no_fragment
) -> Any:
    """Rebuild the Python value of an encoded tree; ``tensor(name)`` supplies tensors,
    ``resolve(rank, path)`` the values kept in fragments."""
    if not isinstance(node, dict):
        return node
    ((tag, body),) = node.items()
    if tag == "dict":
        return {_decode_key(k): decode(v, tensor, resolve) for k, v in body}
    if tag == "list":
        return [decode(v, tensor, resolve) for v in body]
    if tag == "tuple":
        return tuple(decode(v, tensor, resolve) for v in body)
    if tag == "in_fragment":
        return decode(resolve(*fragment_ref(body)), tensor, resolve)
    if tag == "tensor":
        return tensor(body)
    if tag == "float":
        return float(body)
    if tag == "bytes":
        return base64.b64decode(body)
    raise ValueError(f"unknown tree tag {tag!r}")


def fragment_ref(body: Any) -> tuple[int, str]:
    """The (rank, path) of an ``{"in_fragment": [rank, path]}`` node."""
    if type(body) is not list or len(body) != 2 or type(body[0]) is not int:
        raise ValueError(f"malformed fragment reference {body!r:.100}")
    if type(body[1]) is not str:
        raise ValueError(f"malformed fragment reference {body!r:.100}")
    return body[0], body[1]


def _decode_key(node: Any) -> Any:
    return decode(node, lambda name: _no_tensor_key(name))


def _no_tensor_key(name: str) -> torch.Tensor:
    raise ValueError(f"a dict key cannot be a tensor ({name!r})")


def tensor_names(node: Any) -> list[str]:
    """Every tensor entry name referenced by an encoded tree, in tree order (not those
    of values kept in fragments: they are the fragments' entries)."""
    names: list[str] = []
    decode(node, lambda name: names.append(name), _skip)  # type: ignore[func-returns-value]
    return names


def _skip(rank: int, path: str) -> Any:
    return None


@dataclass
class LoadMatch:
    """How a checkpoint tree maps onto the state it is loaded into.

    ``destinations`` are the live tensors to fill in place; ``finish`` assigns the
    loaded values and calls ``load_state_dict`` once every tensor has been read.
    """

    destinations: dict[str, torch.Tensor] = field(default_factory=dict)
    materialize: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # refused even when not strict
    finish: Callable[[Callable[[str], torch.Tensor]], Any] = lambda tensor: None
    # Called in reverse order if the load fails: each gives a Stateful its old state back.
    undo: list[Callable[[], None]] = field(default_factory=list)
    resolve: Resolver = _no_fragment  # values kept in fragments, read when matched


def match(target: object, node: Any, resolve: Resolver = _no_fragment) -> LoadMatch:
    """Pair the live ``target`` state with a stored tree, without reading any tensor;
    a value kept in a fragment is read (``resolve``) only where it is matched."""
    m = LoadMatch(resolve=resolve)
    m.finish = _match(target, node, "", m, in_stateful=False)
    return m


Finisher = Callable[[Callable[[str], torch.Tensor]], Any]


# A Stateful may define ``stored_keys_to_load(rel_path, keys)``: of a stored dict at
# ``rel_path`` inside its state, the keys this rank needs (None: all). Per-rank state
# (RNG streams: every rank saved its own) is then read only where it is restored.
KeySelector = Callable[[tuple[object, ...], list[object]], "list[object] | None"]


def _match(
    target: object,
    node: Any,
    path: str,
    m: LoadMatch,
    *,
    in_stateful: bool,
    select: KeySelector | None = None,
    rel: tuple[object, ...] = (),
) -> Finisher:
    tag = next(iter(node)) if isinstance(node, dict) else None
    if tag == "in_fragment":
        node = m.resolve(*fragment_ref(node["in_fragment"]))
        tag = next(iter(node)) if isinstance(node, dict) else None

    if tag == "tensor":
        name = node["tensor"]
        if isinstance(target, torch.Tensor):
            m.destinations[name] = target
            return lambda tensor: target
        m.materialize.append(name)
        return lambda tensor: tensor(name)

    if is_stateful(target):
        before = target.state_dict()  # type: ignore[union-attr]
        kept = _copy_containers(before)  # finishing fills ``before``'s containers in place
        select = getattr(target, "stored_keys_to_load", None)
        inner = _match(before, node, path, m, in_stateful=True, select=select)

        def finish_stateful(tensor: Callable[[str], torch.Tensor]) -> Any:
            # Its tensors are put back first (loading.Undo), then its other state.
            m.undo.append(lambda: target.load_state_dict(kept))  # type: ignore[union-attr]
            try:
                target.load_state_dict(inner(tensor))  # type: ignore[union-attr]
            except (RuntimeError, ValueError, KeyError) as exc:
                raise StateMismatchError(
                    f"{type(target).__name__} at {path or '<root>'!r} rejected the checkpoint's "
                    f"state: {exc}"
                ) from exc
            return target

        return finish_stateful

    if tag == "dict" and isinstance(target, dict):
        stored = {_decode_key(k): v for k, v in node["dict"]}
        wanted = select(rel, list(stored)) if select is not None else None
        dropped: list[object] = []
        if wanted is not None:
            # The selected stored keys are what this rank restores; its own keys the
            # checkpoint lacks (a rank the saved run did not have) are not missing:
            # the Stateful derives them from the selected ones, so they are dropped.
            stored = {k: v for k, v in stored.items() if k in wanted}
            dropped = [k for k in target if k not in stored]
        if in_stateful and "param_groups" in target and "param_groups" in stored:
            _match_param_groups(target["param_groups"], stored["param_groups"], path, m)
        children: dict[object, Finisher] = {}
        for key, child in stored.items():
            if key in target:
                children[key] = _match(
                    target[key],
                    child,
                    _join(path, key),
                    m,
                    in_stateful=in_stateful,
                    select=select,
                    rel=(*rel, key),
                )
            elif in_stateful:
                children[key] = _materialize(child, m)
            else:
                m.unexpected.append(_join(path, key))
        if wanted is None:
            m.missing.extend(_join(path, k) for k in target if k not in stored)

        def finish_dict(tensor: Callable[[str], torch.Tensor]) -> Any:
            for key in dropped:
                del target[key]  # type: ignore[attr-defined]
            for key, child_finish in children.items():
                value = child_finish(tensor)
                if not in_stateful:  # a Stateful takes its whole state back instead
                    _undo_put(m, target, key, value)
                target[key] = value  # type: ignore[index]
            return target

        return finish_dict

    if (
        tag in ("list", "tuple")
        and isinstance(target, (list, tuple))
        and len(target) == len(node[tag])
    ):
        items = [
            _match(t, c, _join(path, i), m, in_stateful=in_stateful)
            for i, (t, c) in enumerate(zip(target, node[tag]))
        ]

        def finish_sequence(tensor: Callable[[str], torch.Tensor]) -> Any:
            values = [f(tensor) for f in items]
            if isinstance(target, list) and tag == "list":
                if not in_stateful:
                    before = list(target)
                    m.undo.append(lambda: target.__setitem__(slice(None), before))
                target[:] = values
                return target
            return tuple(values) if tag == "tuple" else values

        return finish_sequence

    if isinstance(target, torch.Tensor):
        m.missing.append(f"{path} (a tensor in the state, not in the checkpoint)")
    return _materialize(node, m)


def _undo_put(m: LoadMatch, target: Any, key: object, value: Any) -> None:
    """Let a failed load put ``target[key]`` back (``load`` is all or nothing for the
    plain values it replaces too, not only for tensors and Statefuls)."""
    if key in target:
        old = target[key]
        if old is not value:
            m.undo.append(lambda: target.__setitem__(key, old))


def _match_param_groups(live: Any, node: Any, path: str, m: LoadMatch) -> None:
    """An optimizer's parameter groups must hold the same parameters as the stored ones.

    Inside a Stateful, stored keys the live state lacks are loaded rather than refused
    (a fresh optimizer has no per-parameter state yet), so without this check an
    optimizer over other parameters would take the checkpoint silently, or be refused
    by its ``load_state_dict`` only after the model's tensors were overwritten.
    """
    try:
        stored = decode(node, _no_tensor_key)
        ours = [list(g["params"]) for g in live]
        theirs = [list(g["params"]) for g in stored]
    except (TypeError, KeyError, ValueError):
        return  # not an optimizer's state dict
    if [len(g) for g in ours] != [len(g) for g in theirs] or (
        _all_str(ours) and _all_str(theirs) and ours != theirs
    ):
        m.mismatched.append(
            f"{_join(path, 'param_groups')!r}: the optimizer's parameter groups differ "
            f"(checkpoint {_group_summary(theirs)}, state {_group_summary(ours)}); build the "
            "optimizer over the same parameters as the saved one"
        )


def _all_str(groups: list[list[Any]]) -> bool:
    return all(isinstance(p, str) for g in groups for p in g)


def _group_summary(groups: list[list[Any]]) -> str:
    return f"{len(groups)} group(s) of {[len(g) for g in groups]} parameters"


def _copy_containers(value: Any) -> Any:
    """``value`` with every dict and list copied; tensors and other leaves shared."""
    if isinstance(value, dict):
        return type(value)((k, _copy_containers(v)) for k, v in value.items())
    if isinstance(value, list):
        return [_copy_containers(v) for v in value]
    return value


def _materialize(node: Any, m: LoadMatch) -> Finisher:
    node = _resolved(node, m.resolve)
    m.materialize.extend(tensor_names(node))
    return lambda tensor: decode(node, tensor)


def _resolved(node: Any, resolve: Resolver) -> Any:
    """``node`` with every fragment reference replaced by the value it refers to."""
    if not isinstance(node, dict):
        return node
    ((tag, body),) = node.items()
    if tag == "in_fragment":
        return _resolved(resolve(*fragment_ref(body)), resolve)
    if tag == "dict":
        return {"dict": [[k, _resolved(v, resolve)] for k, v in body]}
    if tag in ("list", "tuple"):
        return {tag: [_resolved(v, resolve) for v in body]}
    return node


def merge_trees(trees: list[Any], path: str = "") -> Any:
    """One tree for the whole job from every rank's tree (rank order).

    Dicts are merged key by key (a key held by some ranks only, such as a rank's own
    entry under a per-rank dict, is taken from those); anything else must be equal on
    every rank that has it.
    """
    head = trees[0]
    if all(t == head for t in trees[1:]):
        return head
    tags = {next(iter(t)) if isinstance(t, dict) else None for t in trees}
    if tags == {"dict"}:
        merged: dict[str, tuple[Any, list[Any]]] = {}
        for t in trees:
            for key, value in t["dict"]:
                slot = merged.setdefault(json.dumps(key), (key, []))
                slot[1].append(value)
        return {
            "dict": [
                [key, merge_trees(values, _join(path, decode(key, _no_tensor_key)))]
                for key, values in merged.values()
            ]
        }
    if len(tags) == 1 and tags <= {"list", "tuple"}:
        (tag,) = tags
        if len({len(t[tag]) for t in trees}) == 1:
            return {
                tag: [
                    merge_trees(list(items), _join(path, i))
                    for i, items in enumerate(zip(*(t[tag] for t in trees)))
                ]
            }
    raise UnsupportedValueError(
        f"the value at {path or '<root>'!r} differs across ranks; values outside tensors must "
        "be the same on every rank, so keep rank-specific values under a key per rank "
        "(e.g. {rank: value}), as TrainState does for RNG streams"
    )
