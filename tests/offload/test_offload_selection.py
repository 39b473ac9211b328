"""Column selection and state migration: the loudest columns win, and state follows each column
exactly (master, both moments and its step counter) when the selection changes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_offload_helpers import zen

from zfctl.offload import ZenFlowOptimizer
from zfctl.offload.columns.selection import plan_moves
from zfctl.offload.columns.selection import stay_share as share
from zfctl.offload.columns.selector import Selector
from zfctl.offload.layout import column_runs, num_selected

ROWS, COLS = 64, 32
FIRST = [1, 5, 9, 13]
SECOND = [2, 5, 20, 30]  # 5 stays; 2, 20, 30 enter; 1, 9, 13 leave


def linear(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(COLS, ROWS)


def planted_grads(layer: torch.nn.Linear, loud: list[int], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    w = torch.randn(ROWS, COLS, generator=g)
    w[:, loud] *= 50.0
    layer.weight.grad = w
    layer.bias.grad = torch.randn(ROWS, generator=g)


def test_num_selected_limits() -> None:
    assert [num_selected(32, r) for r in (0.0, 0.01, 0.125, 0.5, 1.0)] == [0, 1, 4, 16, 32]


def test_column_runs_merge_adjacent_columns() -> None:
    offsets = torch.tensor([0, 3, 6, 10, 14, 20])  # five columns of lengths 3, 3, 4, 4, 6
    mask = torch.tensor([True, True, False, True, True])
    assert column_runs(mask, offsets).tolist() == [[0, 6], [10, 10]]
    assert column_runs(~mask, offsets).tolist() == [[6, 4]]
    assert column_runs(torch.zeros(5, dtype=torch.bool), offsets).shape == (0, 2)


def test_planted_large_gradient_columns_are_selected() -> None:
    layer = linear()
    with ZenFlowOptimizer(layer.named_parameters(), zen(topk_ratio=0.125), lr=1e-3) as opt:
        planted_grads(layer, FIRST, step=0)
        stats = opt.step()
        assert stats.selection
        assert opt.device_state.index[0].tolist() == FIRST
        assert stats.selected_fraction == 4 / 32
        owned = opt.host.device_owned.nonzero().flatten().tolist()
        assert owned == FIRST  # the host skips exactly those columns


def test_stay_share_counts_every_column_of_every_matrix_once() -> None:
    """Staying / previously selected columns over all matrices: a matrix with more selected
    columns weighs more, and the same column id in two matrices is two columns."""
    def ids(*c: int) -> torch.Tensor:
        return torch.tensor(c, dtype=torch.int64)

    def stay_share(olds, news, cols):  # the moves plan_selection gives, per matrix of ``cols`` columns
        return share([plan_moves(SimpleNamespace(k=n.numel(), cols=c), o, n) for o, n, c in zip(olds, news, cols)])

    olds = [ids(1, 5, 9, 13), ids(0, 1, 2, 3, 4, 5, 6, 7), ids(2)]
    news = [ids(2, 5, 20, 30), ids(0, 1, 2, 3, 4, 5, 6, 8), ids(3)]  # 1 + 7 + 0 of 4 + 8 + 1 stay
    assert stay_share(olds, news, [32, 10, 4]) == 8 / 13
    # Column 5 stays in the first matrix only: offset, the second's 5 is not the first's.
    assert stay_share([ids(5), ids(1)], [ids(5), ids(5)], [8, 8]) == 1 / 2
    assert stay_share([None, None], news[:2], [32, 10]) is None  # the first selection: nothing to stay


def test_a_selection_records_the_share_of_device_columns_that_stay() -> None:
    """``StepStats.select_stay``: None before a second selection, then the share of the last
    selection's device columns chosen again (FIRST -> SECOND keeps column 5 of 4: 0.25)."""
    layer = linear()
    cfg = zen(topk_ratio=0.125, update_interval=2, overlap_step=True, select_interval=4)
    with ZenFlowOptimizer(layer.named_parameters(), cfg, lr=1e-2) as opt:
        stays = []
        for step in range(9):
            planted_grads(layer, FIRST if step < 4 else SECOND, step)
            stats = opt.step()
            stays.append((stats.selection, stats.select_stay))
    assert stays[0] == (True, None) and stays[4] == (True, 0.25) and stays[8] == (True, 1.0)
    assert all(s == (False, None) for i, s in enumerate(stays) if i % 4)


def test_migration_moves_master_moments_and_counters_exactly(monkeypatch) -> None:
    """The selection at step 4 comes one step after the boundary that submitted a CPU update: that
    update is not drained nor installed; it updates the entering columns first, the device takes
    them as updated, and the worker writes the leaving columns' rows behind it."""
    layer = linear()
    cfg = zen(topk_ratio=0.125, update_interval=2, overlap_step=True, select_interval=4)
    captured: dict[str, object] = {}
    original, arrive = Selector.select, Selector.arrive
    holder: list[ZenFlowOptimizer] = []

    def select_and_capture(self, grads, host, stats, **kw):
        captured["before"] = _state(holder[0])
        return original(self, grads, host, stats, **kw)

    def arrive_and_capture(self):
        arrive(self)
        captured["after"] = _state(holder[0])  # right after migration, before this step's device update

    monkeypatch.setattr(Selector, "select", select_and_capture)
    monkeypatch.setattr(Selector, "arrive", arrive_and_capture)
    with ZenFlowOptimizer(layer.named_parameters(), cfg, lr=1e-2, weight_decay=0.1) as opt:
        holder.append(opt)
        for step in range(4):
            planted_grads(layer, FIRST, step)
            opt.step()
        planted_grads(layer, SECOND, 4)
        stats = opt.step()
        assert stats.selection and not stats.installed  # no drain, no early install
        opt.pipeline.settle()  # the update and the leaving state written behind it
        assert opt.pipeline.pending_install  # installed on the ordinary schedule, not yet
        settled = _state(opt)
        groups = opt.host.update_groups()

    before, after = captured["before"], captured["after"]
    assert before["index"] == FIRST and after["index"] == SECOND
    for key in ("master", "exp_avg", "exp_avg_sq", "steps"):
        dev_b, dev_a, host = before["dev"][key], after["dev"][key], settled["host"][key]
        for row, col in enumerate(SECOND):
            if col in FIRST:  # staying: its device state moved rows, unchanged
                assert torch.equal(dev_a[row], dev_b[FIRST.index(col)]), (key, col)
            else:  # entering: the host's state after the update in flight, bit for bit
                assert torch.equal(dev_a[row], host[col]), (key, col)
        for row, col in enumerate(FIRST):
            if col not in SECOND:  # leaving: the device's state, bit for bit, back on the host
                assert torch.equal(host[col], dev_b[row]), (key, col)
    # Counters: 4 device steps for the first selection; the host columns had 2 CPU updates.
    assert before["dev"]["steps"].tolist() == [4.0] * 4
    assert after["dev"]["steps"].tolist() == [2.0, 4.0, 2.0, 2.0]
    # Leaving columns keep their own count on the host: the next CPU update runs two groups,
    # step 3 for the columns that never left and step 5 for the three that came back.
    assert [step for step, _ in groups] == [3, 5]
    assert groups[1][1].tolist() == [[c * ROWS, ROWS] for c in (1, 9, 13)]


def _state(opt: ZenFlowOptimizer) -> dict:
    slot = opt.selector.selectable[0]
    dev, host = opt.device_state.column_state(slot), opt.host.column_state(slot)
    keys = ("master", "exp_avg", "exp_avg_sq", "steps")
    return {
        "index": None if opt.device_state.index[0] is None else opt.device_state.index[0].tolist(),
        "dev": {k: v.clone() for k, v in zip(keys, dev)},
        "host": {k: v.clone() for k, v in zip(keys, host)},
    }


def _column_states(gen: torch.Generator, n: int, rows: int) -> list[torch.Tensor]:
    return [torch.randn(n, rows, generator=gen) for _ in range(3)] + [torch.randint(1, 9, (n,), generator=gen).float()]


@pytest.mark.parametrize("rows_per_piece", [1, 3, 64])
def test_the_mover_is_exact_and_moves_every_byte_through_page_locked_memory(monkeypatch, rows_per_piece) -> None:
    """A selection moves ~1.3 GB each way at 1B parameters. The Mover (migration.py, on its CUDA
    branch through the shim) packs the moves into pieces: every H2D leaves from its page-locked in
    ring, every D2H lands in its page-locked out buffer, each a non_blocking copy on a copy stream;
    once the leaving rows are written (``Departure.finish``) the state has the bits the blocking
    ``migrate`` gives, and the same bytes moved, whatever the piece size (one row, some, all)."""
    from cuda_shim import as_cuda, fake_cuda

    from zfctl.offload import sizing
    from zfctl.offload.columns import migration
    from zfctl.offload.columns.departure import Pair
    from zfctl.offload.columns.groups import Group
    from zfctl.offload.columns.selection import ColumnState, migrate, plan_selection
    from zfctl.offload.device import pinned
    from zfctl.offload.layout import plan_layout
    from zfctl.offload.ledger import Ledger

    shim = fake_cuda(monkeypatch)
    rows, cols, k = 8, 40, 10
    gen = torch.Generator().manual_seed(3)
    old = torch.tensor([0, 3, 4, 9, 12, 17, 20, 25, 31, 39])
    new = torch.tensor([1, 3, 5, 9, 13, 18, 21, 25, 30, 38])  # 3 and 9 and 25 stay, 7 leave, 7 enter
    dev0, host0 = _column_states(gen, k, rows), _column_states(gen, cols, rows)
    ref_dev, ref_host = [t.clone() for t in dev0], [t.clone() for t in host0]
    ref_bytes = migrate(ColumnState(*ref_dev), ref_host, old, new)
    assert ref_bytes == (7 * (3 * rows + 1) * 4,) * 2

    monkeypatch.setattr(sizing, "STAGE_BYTES", rows_per_piece * rows * 4)
    layout = plan_layout([("w", torch.empty(rows, cols, device="meta"))], k / cols)
    block = plan_selection(layout, list(layout.slots), [old], [new]).blocks[0]
    mover = migration.Mover(torch.device("cpu"), pin=True, ring=sizing.ring_elems(k * rows, k, rows),
                            out=sizing.out_elems(k * rows), ids=4 * k)
    as_cuda(mover, "in_stream", "out_stream")
    mover.pin, mover.ledger = True, Ledger()
    dev, host = [t.clone() for t in dev0], [t.clone() for t in host0]
    dep = migration.Departure()
    groups = [Group(d.view(k, -1), block, (Pair(h.view(cols, -1), dep),)) for d, h in zip(dev, host)]
    fill = mover.move(groups)
    assert fill is not None
    fill()  # the worker's part (migration.py): the entering rows, through the in ring
    mover.join()
    dep.finish()
    for a, b in zip(dev + host, ref_dev + ref_host):
        assert torch.equal(a, b)
    tab = mover.ledger.close()
    d2h, h2d = tab.total("d2h."), tab.total("h2d.")
    ids = 8 * (7 + 7)  # the device rows of the leaving and entering columns (the staying keep theirs)
    assert d2h == ref_bytes[0] and h2d == ref_bytes[1] + ids
    dma = [c for c in shim.copies if pinned.holds(c[1]) or pinned.holds(c[2])]
    assert sum(dst.numel() * dst.element_size() for _, dst, _, _, _ in dma) == d2h + h2d
    assert all(non_blocking and stream in (mover.in_stream, mover.out_stream) for stream, _, _, non_blocking, _ in dma)
    pieces = sum(stream is mover.in_stream and src.dtype == torch.float32 for stream, _, src, _, _ in dma)
    assert pieces >= ref_bytes[1] // (4 * sizing.ring_elems(k * rows, k, rows) // sizing.IN_SLOTS)
    assert mover.slot_waits == max(0, pieces - sizing.IN_SLOTS)  # in-ring slots reused, DMA-paced
