"""Which pods take which ranks in the world an elastic operation forms: pure functions of the serving world's
layout (pod index -> its ranks), the DPA group size `g` (tp * cp ranks) and the pods that exist.

A DPA group is ranks `grp * g .. grp * g + g - 1`; a pod holds `per_pod` consecutive ranks of one group, so a
group spans `g // per_pod` pods. A new pod takes the lowest index no pod holds (a Terminating pod's index too: a
pod of a lost node keeps its name until the node is back).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass

Ranks = Mapping[int, list[int]]


def groups_of(layout: Ranks, g: int) -> dict[int, list[int]]:
    """DPA group -> the pods holding its ranks (in index order)."""
    groups: dict[int, list[int]] = {}
    for i, ranks in sorted(layout.items()):
        if ranks:
            groups.setdefault(ranks[0] // g, []).append(i)
    return groups


def free_indices(*held: Collection[int]) -> Iterator[int]:
    """Pod indices none of `held` holds, lowest first."""
    return (i for i in range(10_000) if not any(i in h for h in held))


@dataclass(frozen=True)
class ScaleUpPlan:
    target: dict[int, list[int]]
    rejoin: list[int]  # spares that take ranks back (no new pod for them)


def scale_up(layout: Ranks, from_dpa: int, to_dpa: int, g: int, per_pod: int, taken: Collection[int] = (),
             spares: Collection[int] = (), standby: Collection[int] = ()) -> ScaleUpPlan:
    """Groups `from_dpa .. to_dpa - 1` added: on the spares first (pods a recovery kept whose crashed rank
    restarts in place), then on the running standby pods (configured like new pods, but started already), then
    on new pods. `taken`: every pod index that exists, terminating ones too."""
    kept = iter(sorted(spares))
    ready = iter(sorted(i for i in standby if i not in spares))
    free = (i for source in (ready, free_indices(layout, taken)) for i in source)
    target = {i: list(r) for i, r in layout.items()}
    rejoin = []
    for grp in range(from_dpa, to_dpa):
        ranks = list(range(grp * g, (grp + 1) * g))
        for k in range(g // per_pod):
            i = next(kept, None)
            if i is None:
                i = next(free)
            else:
                rejoin.append(i)
            target[i] = ranks[k * per_pod:(k + 1) * per_pod]
    return ScaleUpPlan(target, rejoin)


def scale_down(layout: Ranks, to_dpa: int, g: int) -> tuple[dict[int, list[int]], list[int]]:
    """The first `to_dpa` groups stay; the pods of the others leave: (what stays, the leaving pods)."""
    keep = {i: list(r) for i, r in layout.items() if r and r[0] // g < to_dpa}
    return keep, sorted(i for i in layout if i not in keep)


@dataclass(frozen=True)
class ReplacePlan:
    target: dict[int, list[int]]
    leaving: list[int]  # the replaced pods
    groups: list[int]  # the groups replaced in this step
    by: dict[int, int]  # replaced pod -> the new pod taking its ranks
    later: int  # groups with an old pod left for the next steps


def replace(layout: Ranks, dpa: int, g: int, stale: Collection[int], max_unavailable: int,
            taken: Collection[int]) -> ReplacePlan:
    """The first groups holding a pod of an old template (`stale`), at most `max_unavailable` of them and never
    every group (one keeps serving where there are two or more), each pod replaced by a new one with its ranks."""
    groups = groups_of(layout, g)
    old = [grp for grp, members in sorted(groups.items()) if set(members) & set(stale)]
    chosen = old[:min(max_unavailable, max(1, dpa - 1))]
    leaving = sorted(i for grp in chosen for i in groups[grp])
    free = free_indices(layout, taken)
    target = {i: list(r) for i, r in layout.items() if i not in leaving}
    by = {}
    for i in leaving:
        by[i] = next(free)
        target[by[i]] = list(layout[i])
    return ReplacePlan(target, leaving, chosen, by, len(old) - len(chosen))


@dataclass(frozen=True)
class RecoverPlan:
    target: dict[int, list[int]]  # the complete groups, renumbered from 0
    leaving: list[int]  # pods of incomplete groups that are not lost (they leave with their group)
    groups: int  # the groups kept


def recover(layout: Ranks, g: int, lost: Collection[int]) -> RecoverPlan | None:
    """The groups none of whose pods is `lost`, renumbered in order; None when no group is complete."""
    groups = groups_of(layout, g)
    complete = [grp for grp, members in sorted(groups.items()) if not set(members) & set(lost)]
    if not complete:
        return None
    target: dict[int, list[int]] = {}
    for j, grp in enumerate(complete):
        for i in groups[grp]:
            target[i] = [r - grp * g + j * g for r in layout[i]]
    leaving = sorted(i for i in layout if i not in target and i not in lost)
    return RecoverPlan(target, leaving, len(complete))
