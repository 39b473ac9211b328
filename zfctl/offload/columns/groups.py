"""What a selection's migration moves, one state tensor of one device block at a time (``Group``),
and the ids of each group (``GroupIds``): migration.py's units, built by selector.py ``_migrate``
from the plan (selection.py ``BlockMoves``). A group's device side is its block's rows, so one
device operation covers every matrix of the block; its host side stays per matrix (each
matrix's rows addressed by column id in its own host view: departure.py ``Pair``)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from zfctl.offload.columns.departure import Pair
from zfctl.offload.columns.selection import BlockMoves

IDS = ("leave_pos", "stay_src", "stay_dst", "enter_dst")  # a group's id tensors, in upload order


@dataclass(frozen=True)
class Group:
    """One state tensor of one device block: ``dev`` its block rows ``[block.ncols, width]``,
    ``pairs`` the host side of each matrix of ``plan.moves`` (departure.py ``Pair``: host rows,
    where leaving rows go, scale, mirror), None for a matrix this tensor does not move
    (release.py's gradient of a matrix no hook took)."""

    dev: torch.Tensor
    plan: BlockMoves
    pairs: tuple[Pair | None, ...]

    @property
    def width(self) -> int:
        return self.dev.shape[1]


@dataclass
class GroupIds:
    """A group's ids (host tensors, block rows; ``dev`` their device copies after the upload) and,
    per member matrix (index into ``plan.moves``), where its share starts in each."""

    host: dict[str, torch.Tensor]
    members: list[int]
    leave0: list[int]  # cumulative: member j's leaving rows are [leave0[j], leave0[j + 1])
    stay0: list[int]
    enter0: list[int]
    dev: dict[str, torch.Tensor] = field(default_factory=dict)


def group_ids(plan: BlockMoves, members: list[int]) -> GroupIds:
    """The ids of ``members`` of ``plan``: the block's own arrays when every matrix moves (no op),
    else the members' slices, concatenated (release.py's gradient of some matrices only)."""
    counts = {"leave": plan.leave_n, "stay": plan.stay_n, "enter": plan.enter_n}
    starts = {k: [0, *itertools.accumulate(v)] for k, v in counts.items()}
    cum = {k: [0, *itertools.accumulate(v[i] for i in members)] for k, v in counts.items()}
    if len(members) == len(plan.moves):
        host = {n: getattr(plan, n) for n in IDS}
    else:
        def part(name: str, kind: str) -> torch.Tensor:
            src = getattr(plan, name)
            return torch.cat([src[starts[kind][i] : starts[kind][i + 1]] for i in members] or [src[:0]])

        host = {"leave_pos": part("leave_pos", "leave"), "stay_src": part("stay_src", "stay"),
                "stay_dst": part("stay_dst", "stay"), "enter_dst": part("enter_dst", "enter")}
    return GroupIds(host, members, cum["leave"], cum["stay"], cum["enter"])
