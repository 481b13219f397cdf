"""Field ownership as the Kubernetes API server keeps it (server-side apply), for the test API server.

Fake on purpose (no cluster can run here), and smaller than the real thing in one way only:
lists are atomic (a list is one field, as `x-kubernetes-list-type: atomic` makes it), where the
real server merges some lists by key. The rest is the API server's rules, which the operator's
hand-over of `replicas` to an autoscaler depends on:

- Each field of an object is owned by the managers that last set it: an apply owns every field
  in its configuration; an update (patch, put) owns the fields whose value it changed, taking
  them from every other manager.
- An apply that drops a field it owned removes it from the object, unless another manager owns
  it too (then it stays, at its value).
- An apply that sets a field another manager owns, to another value, is a conflict (409) unless
  forced; forced, the field changes hands. The same value shares it.
- Ownership is kept in `metadata.managedFields` (FieldsV1: `{"f:spec": {"f:replicas": {}}}`).
"""

from __future__ import annotations

import copy
from typing import Any, Final

Path = tuple[str, ...]
Owners = dict[tuple[str, str], set[Path]]
"""(manager, operation: Apply or Update) -> the fields it owns."""

_UNOWNED: Final = {("apiVersion",), ("kind",), ("status",)}
_SERVER_META: Final = frozenset(
    {"name", "namespace", "uid", "creationTimestamp", "resourceVersion", "generation", "deletionTimestamp"}
    | {"managedFields"}
)
_MISSING: Final = object()


class ApplyConflict(Exception):
    """An apply would change fields other managers own (what a 409 Conflict says)."""

    def __init__(self, conflicts: list[tuple[Path, str]]) -> None:
        self.conflicts = conflicts
        fields = ", ".join(f"{'.'.join(p)} (owned by {m})" for p, m in conflicts)
        super().__init__(f"Apply failed with {len(conflicts)} conflicts: {fields}")


def leaves(obj: dict[str, Any], prefix: Path = ()) -> dict[Path, Any]:
    """Every field of `obj` that can be owned, by path; a list or an empty map is one field."""
    out: dict[Path, Any] = {}
    for key, value in obj.items():
        path = (*prefix, key)
        if path in _UNOWNED or (prefix == ("metadata",) and key in _SERVER_META):
            continue
        if isinstance(value, dict) and value:
            out |= leaves(value, path)
        else:
            out[path] = value
    return out


def owners(obj: dict[str, Any]) -> Owners:
    out: Owners = {}
    for entry in obj.get("metadata", {}).get("managedFields") or []:
        key = (entry["manager"], entry["operation"])
        out[key] = out.get(key, set()) | _paths(entry.get("fieldsV1") or {})
    return out


def apply(live: dict[str, Any] | None, config: dict[str, Any], manager: str, force: bool) -> dict[str, Any]:
    """The object after `manager` applies `config` to `live` (None: it creates it)."""
    obj = copy.deepcopy(live) if live is not None else {}
    held = owners(obj)
    wanted = leaves(config)
    mine = (manager, "Apply")
    conflicts = [
        (path, other[0])
        for path, value in wanted.items()
        for other, paths in held.items()
        if other != mine and _overlaps(path, paths) and _get(obj, path) != value
    ]
    if conflicts and not force:
        raise ApplyConflict(conflicts)
    for path, other in conflicts:
        for key in [k for k in held if k[0] == other and k != mine]:
            held[key] = {p for p in held[key] if not _related(p, path)}
    for path in held.get(mine, set()) - wanted.keys():
        if not any(_overlaps(path, paths) for key, paths in held.items() if key != mine):
            _remove(obj, path)
    for path, value in wanted.items():
        _put(obj, path, copy.deepcopy(value))
    for key in ("apiVersion", "kind"):
        if key in config:
            obj[key] = config[key]
    held[mine] = set(wanted)
    return _with_owners(obj, held)


def update(old: dict[str, Any], new: dict[str, Any], manager: str) -> dict[str, Any]:
    """`new` (the object after `manager`'s patch or put of `old`), owning what it changed."""
    before, after = leaves(old), leaves(new)
    changed = {p for p in before.keys() | after.keys() if before.get(p, _MISSING) != after.get(p, _MISSING)}
    held = owners(old)
    for key in held:
        held[key] = {p for p in held[key] if not any(_related(p, c) for c in changed)}
    mine = (manager, "Update")
    held[mine] = held.get(mine, set()) | {p for p in changed if p in after}
    return _with_owners(copy.deepcopy(new), held)


def created(obj: dict[str, Any], manager: str) -> dict[str, Any]:
    """A new object made by `manager`'s create (an update of nothing)."""
    return _with_owners(copy.deepcopy(obj), {(manager, "Update"): set(leaves(obj))})


def _with_owners(obj: dict[str, Any], held: Owners) -> dict[str, Any]:
    obj.setdefault("metadata", {})["managedFields"] = [
        {
            "manager": manager,
            "operation": operation,
            "apiVersion": obj.get("apiVersion", "v1"),
            "fieldsType": "FieldsV1",
            "fieldsV1": _fields_v1(paths),
        }
        for (manager, operation), paths in sorted(held.items())
        if paths
    ]
    return obj


def _fields_v1(paths: set[Path]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path in paths:
        node = tree
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return tree


def _paths(tree: dict[str, Any], prefix: Path = ()) -> set[Path]:
    out: set[Path] = set()
    for key, sub in tree.items():
        if not key.startswith("f:"):
            continue
        path = (*prefix, key[2:])
        out |= _paths(sub, path) if sub else {path}
    return out


def _related(a: Path, b: Path) -> bool:
    """One is the other or inside it."""
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def _overlaps(path: Path, paths: set[Path]) -> bool:
    return any(_related(path, p) for p in paths)


def _get(obj: dict[str, Any], path: Path) -> Any:
    node: Any = obj
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return _MISSING
        node = node[key]
    return node


def _put(obj: dict[str, Any], path: Path, value: Any) -> None:
    node = obj
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[path[-1]] = value


def _remove(obj: dict[str, Any], path: Path) -> None:
    node: Any = obj
    for key in path[:-1]:
        if not isinstance(node, dict) or key not in node:
            return
        node = node[key]
    if isinstance(node, dict):
        node.pop(path[-1], None)
