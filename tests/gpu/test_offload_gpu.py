"""The CUDA path of the ZenFlow optimizer: real streams, page-locked buffers, events (``pytest -m gpu``).

Every configuration names its gradient path explicitly (``accumulate: host`` with or without the
gradient hooks, ``accumulate: device``): on CUDA ``auto`` picks the device for a tiny model, and a
suite that left it to ``auto`` would never run the hook path. Each check compares numbers against
an independent reference (torch.optim.AdamW, the CPU implementation, the step() path) and makes
sure the reference is not trivially met (the parameters moved). The race stress tests, which make
every missing wait show up as wrong bits, are in test_race_stress.py; 2-GPU NCCL in test_nccl.py.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from test_offload_helpers import HID, IN, OUT, batches, max_rel_err, snapshot, tiny_net, train, zen

from zfctl.offload import ZenFlowConfig, ZenFlowOptimizer
from zfctl.offload.device import pinned

pytestmark = pytest.mark.gpu
# fc2 and head stand in for the vocabulary matrices: split by row where a config says vocab_select: rows.
HP = {"lr": 1e-2, "weight_decay": 0.01, "vocab_params": ["fc2.weight", "head.weight"]}
ZEN = {"topk_ratio": 0.1, "update_interval": 4, "select_interval": 12}
PATHS = {"host-hooks": {"accumulate": "host"},  # the loop announces the final backward (hooks=True)
         "host-step": {"accumulate": "host"},  # it announces none: step() lands every chunk
         "device": {"accumulate": "device"}}


def norm_rel_err(a: dict, b: dict) -> float:
    """Largest per-parameter ||a - b|| / ||b|| (in fp32)."""
    return max(float((a[n].float() - b[n].float()).norm() / b[n].float().norm()) for n in b)


def loop(model, opt, data, *, hooks: bool, micro: int = 2, set_to_none: bool = True,
         overflow_at: int | None = None) -> list:
    """Gradient accumulation over ``micro`` micro-batches per step on the model's device; ``hooks``:
    announce the last backward (the hook path); ``overflow_at``: that step's loss is scaled to
    overflow fp16."""
    device = next(model.parameters()).device
    stats = []
    for t, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=set_to_none)
        for i, (xs, ys) in enumerate(zip(x.to(device).chunk(micro), y.to(device).chunk(micro))):
            if hooks:
                opt.prepare_backward(final=i == micro - 1)
            loss = F.mse_loss(model(xs).float(), ys.float()) / micro
            if t == overflow_at:
                loss = loss * 1e30  # fp16 gradients overflow: the step is skipped on every path
            opt.scale_loss(loss).backward()
        stats.append(opt.step())
    return stats


def zen_run(cfg: ZenFlowConfig, device: str, *, steps: int = 24, dtype=torch.float32, clip=None,
            hooks: bool = True):
    model = tiny_net(device=device, dtype=dtype)
    with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=clip, **HP) as opt:
        # The same micro-batches and hook announcements on either device, so that a CPU run is
        # the reference of a CUDA run up to the matmul kernels' rounding.
        stats = loop(model, opt, batches(steps, dtype=dtype), hooks=hooks)
        opt.flush()
    return {n: p.cpu() for n, p in snapshot(model).items()}, stats


@pytest.fixture(autouse=True)
def _exact_matmuls():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("cfg", [zen(topk_ratio=1.0),
                                 zen(topk_ratio=0.0, update_interval=1, overlap_step=False,
                                               accumulate="host")],
                         ids=["r=1", "r=0,U=1"])
@pytest.mark.parametrize("clip", [None, 0.25])
def test_cuda_limits_reproduce_torch_adamw(cfg, clip) -> None:
    model = tiny_net(device="cuda")
    init = {n: p.cpu() for n, p in snapshot(model).items()}
    train(model, torch.optim.AdamW(model.parameters(), lr=HP["lr"], weight_decay=HP["weight_decay"]), 50, clip=clip)
    ref = {n: p.cpu() for n, p in snapshot(model).items()}
    model = tiny_net(device="cuda")
    with ZenFlowOptimizer(model.named_parameters(), cfg, max_grad_norm=clip, **HP) as opt:
        train(model, opt, 50)
        opt.flush()
    got = {n: p.cpu() for n, p in snapshot(model).items()}
    assert max_rel_err(got, ref) <= 1e-5
    assert max_rel_err(init, ref) > 1e-2  # the reference trained: the bound is not met by doing nothing


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("overlap", "extra"), [(False, {}), (True, {}),
                                                (True, {"vocab_select": "rows", "install_lag": 1})],
                         ids=["sequential", "overlap", "overlap-rows-lag1"])
def test_cuda_matches_cpu_implementation_fp32(path: str, overlap: bool, extra: dict) -> None:
    """Rings, transposes, hooks, the device sum and installs on CUDA against the same optimizer on
    CPU (where the same code runs synchronously): matmul kernels differ, the optimizer must not."""
    cfg = zen(overlap_step=overlap, **ZEN, **PATHS[path], **extra)
    hooks = path == "host-hooks"
    cpu, cpu_stats = zen_run(cfg, "cpu", hooks=hooks)
    gpu, gpu_stats = zen_run(cfg, "cuda", hooks=hooks)
    assert [s.installed for s in cpu_stats] == [s.installed for s in gpu_stats]
    assert [s.boundary for s in cpu_stats] == [s.boundary for s in gpu_stats]
    # In 2-norm per parameter, not element by element: an element whose gradient nearly cancels
    # over an interval gets the host Adam step lr * g / (|g| + eps), which turns rounding into a
    # visible move. On CPU alone, one micro-batch against two moves fc1.weight[41, 15] by 1.4e-4 at
    # the first boundary: 4.6e-4 in max-norm, 3.4e-5 in 2-norm (torch AdamW: 4e-7). A missing wait
    # or a wrong install moves whole columns by ~lr (1e-2) and fails either way.
    assert norm_rel_err(gpu, cpu) <= 1e-4
    assert max_rel_err(gpu, {n: p.cpu() for n, p in snapshot(tiny_net()).items()}) > 1e-2  # it trained


@pytest.mark.parametrize("path", list(PATHS))
def test_cuda_bf16_trains_like_the_fp32_reference(path: str) -> None:
    """bf16 on CUDA against the same optimizer in fp32 on CPU, within bf16's resolution (2^-8), on
    every path; and the host columns' gradients really crossed PCIe (bytes counted per step)."""
    cfg = zen(overlap_step=True, **ZEN, **PATHS[path])
    ref, _ = zen_run(cfg, "cpu", steps=16)
    got, stats = zen_run(cfg, "cuda", steps=16, dtype=torch.bfloat16, hooks=path == "host-hooks")
    init = {n: p.cpu() for n, p in snapshot(tiny_net()).items()}
    # Per-parameter ||got - ref|| / ||ref||: 0.013 for bf16 against fp32 on the CPU, 0.26 with the
    # CPU updates never installed; the matrices themselves move by 0.16 or more (relative).
    assert norm_rel_err(got, ref) <= 5e-2
    assert min(norm_rel_err({n: init[n]}, {n: ref[n]}) for n in ref if ref[n].dim() == 2) > 0.1
    # Host-column elements (every matrix but its top 10% columns), in bf16, 2 B each: each step's
    # D2H carries at least that many bytes on the host paths, and once per interval (fp32, 4 B)
    # on the device path.
    host_elems = sum(r * (c - max(1, int(0.1 * c))) for r, c in ((HID, IN), (HID, HID), (OUT, HID)))
    for s in stats[1:]:
        if path != "device":
            assert s.d2h_bytes >= 2 * host_elems, s
        elif s.boundary:
            assert s.d2h_bytes >= 4 * host_elems, s
        else:
            assert s.d2h_bytes < 2 * host_elems, s  # no per-step gradient traffic


def test_cuda_bit_identical_across_slots_and_pinning() -> None:
    """The same optimizer with one tiny ring slot (every chunk through one slot: each refill waits
    for the previous copy) and with pageable memory (the staging path): the same bits."""
    base, _ = zen_run(zen(**ZEN, **PATHS["host-step"]), "cuda", hooks=False)
    for kw in ({"ring_slots": 1, "ring_slot_mb": 0.0005}, {"pin_memory": False}):
        other, _ = zen_run(zen(**ZEN, **PATHS["host-step"], **kw), "cuda", hooks=False)
        assert all(torch.equal(base[n], other[n]) for n in base), kw
    again, _ = zen_run(zen(**ZEN, **PATHS["host-step"]), "cuda", hooks=False)
    assert all(torch.equal(base[n], again[n]) for n in base)  # and run to run


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_resume_mid_interval_is_bit_identical(path: str, dtype) -> None:
    cfg, data = zen(**ZEN, **PATHS[path]), batches(20, dtype=dtype)
    hooks = path == "host-hooks"
    model = tiny_net(device="cuda", dtype=dtype)
    with ZenFlowOptimizer(model.named_parameters(), cfg, **HP) as opt:
        loop(model, opt, data, hooks=hooks)
    expected = snapshot(model)
    model = tiny_net(device="cuda", dtype=dtype)
    with ZenFlowOptimizer(model.named_parameters(), cfg, **HP) as opt:
        loop(model, opt, data[:10], hooks=hooks)
        assert opt.pipeline.busy or opt.pipeline.pending_install  # an update in flight at the save
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model = tiny_net(seed=5, device="cuda", dtype=dtype)
    model.load_state_dict(saved["model"])
    with ZenFlowOptimizer(model.named_parameters(), cfg, **HP) as opt:
        opt.load_state_dict(saved["opt"])
        loop(model, opt, data[10:], hooks=hooks)
    got = snapshot(model)
    assert all(torch.equal(expected[n], got[n]) for n in expected)


class TiedNet(torch.nn.Module):
    """Token embedding tied to the output head, a matrix that never gets a gradient, fp16."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, HID)
        self.fc = torch.nn.Linear(HID, HID)
        self.unused = torch.nn.Linear(HID, HID)  # in the optimizer, never in the forward
        self.head = torch.nn.Linear(HID, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(self.emb(ids))))


def _tied_run(hooks: bool):
    torch.manual_seed(0)
    model = TiedNet().cuda().half()
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, 64, (8, 6), generator=g) for _ in range(14)]
    cfg = zen(**ZEN, **PATHS["host-hooks"], vocab_select="rows", overlap_step=True)
    with ZenFlowOptimizer(model.named_parameters(), cfg, lr=1e-3, max_grad_norm=1.0,
                          vocab_params=["emb.weight"]) as opt:
        stats = []
        for t, batch in enumerate(ids):
            opt.zero_grad(set_to_none=True)
            batch = batch.cuda()
            if hooks:
                opt.prepare_backward(final=True)
            loss = F.cross_entropy(model(batch).float().view(-1, 64), batch.view(-1))
            opt.scale_loss(loss * (1e30 if t == 7 else 1.0)).backward()  # step 7 overflows fp16
            stats.append(opt.step())
        opt.flush()
    return {n: p.detach().cpu() for n, p in model.named_parameters()}, stats


def test_cuda_hook_path_tied_embedding_unused_matrix_and_fp16_overflow() -> None:
    ref, ref_stats = _tied_run(hooks=False)
    got, stats = _tied_run(hooks=True)
    assert [s.skipped for s in stats] == [s.skipped for s in ref_stats] and stats[7].skipped
    assert all(torch.equal(ref[n], got[n]) for n in ref)
    assert sum(s.early_chunks > 0 for s in stats) >= 8  # the hooks really moved the gradients
    torch.manual_seed(0)
    assert torch.equal(got["unused.weight"].float(), TiedNet().half().unused.weight.float())  # zero grad, no wd


def test_cuda_inflight_cap_makes_hooks_wait_and_changes_no_bit() -> None:
    """A cap below one chunk (zenflow.inflight_mb): every hook waits for the previous copy (the
    waits are counted), and the result is the step() path's."""
    from zfctl.offload.device.pcie import delay_copies

    cfg = zen(**ZEN, **PATHS["host-hooks"], inflight_mb=1e-4, ring_slot_mb=0.0005)
    ref, _ = zen_run(zen(**ZEN, **PATHS["host-step"], ring_slot_mb=0.0005), "cuda", hooks=False)
    delay_copies(1_000_000)  # ~0.5 ms per copy: the previous chunk's copy is still running at each hook
    try:
        got, stats = zen_run(cfg, "cuda")
    finally:
        delay_copies(0)
    assert sum(s.budget_waits for s in stats) > 0
    assert all(torch.equal(ref[n], got[n]) for n in ref)


def test_cuda_d2h_probe_measures_a_plausible_rate_and_close_unpins_everything() -> None:
    model = tiny_net().cuda()
    before = pinned.registered_bytes()
    with ZenFlowOptimizer(model.named_parameters(), zen(**ZEN, **PATHS["host-hooks"]), lr=1e-2) as opt:
        # PCIe gen3 x16 moves ~12 GB/s, gen5 x16 ~55, NVLink-C2C ~400: anything outside is a bad timing.
        gbps = opt.gradient_path.d2h_gbps
        assert gbps is not None and 1.0 < gbps < 1000.0
        assert pinned.registered_bytes() > before  # the install source, gradient slots
    assert pinned.registered_bytes() == before  # the probe's buffer and every engine buffer released


@pytest.mark.parametrize("path", list(PATHS))
def test_cuda_memory_is_what_the_plan_says(path: str) -> None:
    """The tensors the optimizer holds on the device and in page-locked host memory, on CUDA,
    against the plan's lines for the engine (tests/plan/test_plan_memory.py does the same on CPU), and
    nothing pinned through the caching allocator's power-of-two rounding but a few scalars."""
    from test_plan_memory import held_bytes

    from zfctl.plan import resolve_plan
    from zfctl.plan.memory import GB, Machine, estimate
    from zfctl.train.models.load import load_model
    from zfctl.train.optim import build_optimizer

    acc = "device" if path == "device" else "host"
    announce = path != "host-step"  # else step() lands the gradients
    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=[
        "train.device=cuda", "train.precision=bf16", f"zenflow.accumulate={acc}",
        "zenflow.full_warm_up_rounds=0", "zenflow.select_interval=4",
        "zenflow.update_interval=2"])
    import gc

    gc.collect()  # optimizers of earlier tests unpin when collected: not during the measurement
    before_pinned = pinned.registered_bytes()
    model = load_model(plan.model, precision="bf16", device=torch.device("cuda"), seed=0)
    opt = build_optimizer(model, plan, steps_per_epoch=100)
    try:
        ids = torch.randint(0, 4096, (2, 32), device="cuda")
        for _ in range(5):  # past a boundary: the install's device slots exist
            opt.zero_grad(set_to_none=True)
            if announce:
                opt.prepare_backward(final=True)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        held = held_bytes(opt, params)
        pinned_now = pinned.registered_bytes() - before_pinned
    finally:
        opt.close()
    est = estimate(plan, Machine(512 * GB, True, "GPU", 80 * GB))
    # freed once each copy lands; held only around a checkpoint taken or resumed inside an interval
    transient = {"gradient temporaries in flight", "checkpoint interval sum"}
    planned = sum(i.bytes for i in est.items if i.code.startswith("zfctl/offload") and i.name not in transient)
    assert held == pytest.approx(planned, rel=0.02), (held, planned)
    # bf16: the install DMAs the upload buffer, the only one of the host state's buffers pinned
    # (an fp32 model pins its master instead; zfctl/offload/cpu/host.py install_source).
    assert est.item("upload buffer") > 0
    locked = sum(est.item(n) for n in ("upload buffer", "gradient slots", "selection staging"))
    locked += est.item("gradient accumulators") if acc == "device" else 0
    assert pinned_now == pytest.approx(locked, rel=0.01), (pinned_now, locked)
    stats = torch.cuda.host_memory_stats()
    assert stats.get("allocated_bytes.current", 0) < 2**20  # the scalar fetches only
