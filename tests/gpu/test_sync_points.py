"""No implicit host-device sync on the hot path (``pytest -m gpu``): the sync points that are left
are the ones docs/design.md lists ("Transfer scheduling", sync points), each an explicit event
wait that the code names.

``torch.cuda.set_sync_debug_mode("error")`` raises at every *implicit* synchronisation: a
blocking copy between host and device (``.to(device)`` from pageable memory, ``.cpu()``,
``.item()``, ``.tolist()`` of a device tensor, ``bool()`` of one), and the ops whose output size
depends on device data (``nonzero``, boolean-mask indexing). It does not see explicit
``Event.synchronize()`` calls, which are the listed sync points. The checked window holds a
re-selection (one process: the column ids' D2H is an explicit event wait, the migration is
asynchronous DMA, migration.py); the first selection stays outside it only because it is step 0.
fp16's overflow check (one ``.item()`` per step, the fp16-only sync) and a data-parallel
selection (blocking ``OwnedRows`` collectives) are listed and not checked here.
"""

from __future__ import annotations

import pytest
import torch
from test_offload_gpu import HP, PATHS, ZEN, loop
from test_offload_helpers import batches, tiny_net, zen

from zfctl.offload import ZenFlowOptimizer
from zfctl.train.loss import to_device

pytestmark = pytest.mark.gpu
STEADY = 10  # steps checked: after the first selection (t = 0), through the re-selection at t = 6
SELECT = 6


@pytest.fixture
def sync_is_an_error():
    """Every implicit sync raises while the test runs its checked section (see the docstring)."""
    yield lambda mode: torch.cuda.set_sync_debug_mode(mode)
    torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("clip", [None, 0.5], ids=["coef-known", "clip"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_steady_state_steps_make_no_implicit_sync(sync_is_an_error, path, clip, dtype) -> None:
    """10 steady-state ZenFlow steps (two micro-batches each; boundaries, installs with the
    per-layer install waits, the hook path's streamed gradients, the device path's copy out, and
    a re-selection whose update from the step before is still in flight) with every implicit
    sync an error."""
    cfg = zen(**{**ZEN, "update_interval": 2, "select_interval": SELECT}, **PATHS[path], overlap_step=True)
    hooks = path == "host-hooks"
    model = tiny_net(device="cuda", dtype=dtype)
    # The batches go to the device before the checked section: a blocking .cuda() is a sync itself.
    data = [(x.cuda(), y.cuda()) for x, y in batches(1 + STEADY, dtype=dtype)]
    with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=clip, **HP) as opt:
        # Each layer's forward waits for its own part of an install (zfctl/offload/device/install.py):
        # device-side waits in forward pre-hooks, counted here, inside the checked section.
        assert opt.attach_install_waits(model) == 3  # fc1, fc2, head
        waits = []
        wait = opt.installer._wait
        opt.installer._wait = lambda event: (waits.append(event), wait(event))
        first = loop(model, opt, data[:1], hooks=hooks)  # t = 0: the selection (listed syncs)
        assert first[0].selection
        waits.clear()
        sync_is_an_error("error")
        stats = loop(model, opt, data[1:], hooks=hooks)
        sync_is_an_error(0)
        in_loop = len(waits)
        opt.flush()
    assert [s.step for s in stats if s.selection] == [SELECT]
    assert not stats[SELECT - 1].installed  # no early install at the selection
    assert sum(s.boundary for s in stats) >= 4 and sum(s.installed for s in stats) >= 3
    # Every install followed by a forward in the checked steps (the last step's is not) is waited
    # for three times, once per layer, by that forward; nothing waits for a whole install (the
    # step's own wait finds every layer waited for already). A wait removed or added shows here.
    assert in_loop == 3 * sum(s.installed for s in [first[0], *stats[:-1]])
    if hooks:
        assert all(s.early_chunks > 0 for s in stats)  # the hooks moved the gradients


def test_micro_batches_reach_the_device_without_a_sync(sync_is_an_error) -> None:
    """``to_device`` page-locks the collated batch and copies it with
    ``non_blocking``; a blocking copy from pageable memory would drain the device before every
    micro-batch after the first."""
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 1000, (4, 64), generator=g),
             "labels": torch.randint(0, 1000, (4, 64), generator=g),
             "attention_mask": torch.ones(4, 64, dtype=torch.long)}
    busy = torch.randn(2048, 2048, device="cuda")
    sync_is_an_error("error")
    for _ in range(4):
        busy = busy @ busy / busy.norm()  # device work in flight, which the copy must not wait for
        on = to_device(batch, torch.device("cuda"))
    sync_is_an_error(0)
    assert all(torch.equal(on[k].cpu(), batch[k]) for k in batch)
    assert all(v.device.type == "cuda" for v in on.values())
