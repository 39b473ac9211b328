"""Installs (docs/design.md, "Transfer scheduling", H2D parameters): what they move and who waits.

* The bf16/fp16 install DMAs the upload buffer the CPU AdamW writes in the model dtype (host.py):
  the params it installs are bit for bit those of the install that DMAs the fp32 master and
  rounds on the device (``zenflow.tuning.upload_buffer: false``, the engine before the upload
  buffer existed), at half the PCIe bytes.
* The install runs on its own stream (install.py). Through the CUDA shim
  (tests/offload/cuda_shim.py) the compute stream's waits are read back: with the forward hooks
  attached, each module's forward waits for its own parameters' scatter and nothing waits for
  the whole install before the forward; without them the compute stream waits for all of it at
  install time. ``install_waits`` is the checker; tests plant a whole-install wait and a missing
  layer wait and see it report them.
* The upload buffer's fence: the event after the last DMA that reads it is what the next CPU
  update (its writer) waits for.
"""

from __future__ import annotations

import pytest
import torch
from cuda_shim import FakeStream, as_cuda, fake_cuda
from test_offload_helpers import batches, tiny_net, zen

from zfctl.offload import ZenFlowOptimizer
from zfctl.offload.cpu import host as host_module
from zfctl.offload.device import pinned

HP = {"lr": 1e-2, "weight_decay": 0.01, "max_grad_norm": 1.0}
# Boundaries every 3 steps, selections at t = 1 and every 4 steps after: installs on both sides of
# each selection, with the device-owned columns changing between them.
BASE = {"topk_ratio": 0.25, "update_interval": 3, "select_interval": 4, "full_warm_up_rounds": 1,
        "overlap_step": True}


def _train(dtype: torch.dtype, accumulators: int, steps: int = 14, *, announce: bool = False, **extra):
    """Params after every step, the steps' stats, and whether the engine had an upload buffer.
    ``announce``: the loop announces each final backward (the hook path), else step() lands."""
    cfg = zen(**BASE, host_accumulators=accumulators, **extra)
    model = tiny_net(dtype=dtype)
    out, stats = [], []
    with ZenFlowOptimizer(model.named_parameters(), cfg, **HP) as opt:
        upload = opt.host.upload is not None
        for x, y in batches(steps, dtype=dtype):
            opt.zero_grad(set_to_none=True)
            if announce:
                opt.prepare_backward(final=True)
            loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
            opt.scale_loss(loss).backward()
            stats.append(opt.step())
            out.append({n: p.detach().clone() for n, p in model.named_parameters()})
        opt.flush()
    return out, stats, upload


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("accumulators", [1, 2])
@pytest.mark.parametrize("path", ["step", "hooks"])
def test_the_upload_buffer_installs_the_bits_of_the_fp32_master(dtype, accumulators, path) -> None:
    """The params after every step, the upload buffer's install against the fp32 master's (the
    device rounding while scattering, as before the upload buffer): the same bits, at half the
    install bytes, and the CPU update's host bytes 2 B per element more (it writes the upload)."""
    extra = {"announce": path == "hooks", "accumulate": "host"}
    got, got_stats, upload = _train(dtype, accumulators, upload_buffer=True, **extra)
    want, want_stats, master = _train(dtype, accumulators, upload_buffer=False, **extra)
    assert upload and not master  # the reference installs from the fp32 master
    installs = [i for i, s in enumerate(got_stats) if s.installed]
    selections = [i for i, s in enumerate(got_stats) if s.selection]
    assert len(installs) >= 4 and any(installs[0] < s < installs[-1] for s in selections)
    for t, (a, b) in enumerate(zip(got, want)):
        for n in a:
            assert torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)), (t, n)
    for a, b in zip(got_stats, want_stats):
        assert (a.installed, a.boundary, a.selection) == (b.installed, b.boundary, b.selection)
        n = b.bytes.get("host.update", 0) // 24  # the host-owned elements the reference's update touched
        up, ref = a.bytes.get("h2d.install", 0), b.bytes.get("h2d.install", 0)
        assert 2 * up == ref and (up > 0) == a.installed  # the install's PCIe bytes halve (ledger.py)
        assert a.bytes.get("host.update", 0) - b.bytes.get("host.update", 0) == (2 * n if a.boundary else 0)


def test_which_models_get_an_upload_buffer(monkeypatch) -> None:
    """fp32: none, the master is the model-dtype copy (4 B per element move). bf16 with
    ``upload_buffer: auto`` and no plan: one where the host state with it fits 85% of the free
    RAM (host.py ``upload_dtype``), else none; ``true`` regardless."""
    def build(dtype, **kw):
        with ZenFlowOptimizer(tiny_net(dtype=dtype).named_parameters(), zen(**BASE, **kw), **HP) as opt:
            return opt.host.upload, opt.host.install_source is opt.host.master, opt.host.update_bytes

    assert build(torch.float32, upload_buffer=True) == (None, True, 24)
    upload, from_master, nbytes = build(torch.bfloat16)
    assert upload.dtype == torch.bfloat16 and not from_master and nbytes == 26
    monkeypatch.setattr(host_module, "available_ram", lambda: 1000.0)  # a host with no room
    assert build(torch.bfloat16)[0] is None and build(torch.bfloat16, upload_buffer=True)[0] is not None


# -- the install stream's waits, through the CUDA shim ------------------------------------------
def install_waits(compute: FakeStream, install: FakeStream,
                  params: dict[str, list[torch.Tensor]]) -> tuple[list[tuple], int]:
    """Read the compute stream's waits against the install stream's scatters; returns the faults
    and the number of installs seen (each ordered after the compute stream by its own wait).

    ``params``: each hooked module's name -> the params it owns; the compute log must hold
    ``("forward", name)`` markers (a pre-hook registered after the optimizer's). An install is the
    install stream's scatters (copies into a param's memory) after its wait for an event recorded
    on the compute stream, which places it on the compute stream's timeline. A compute-stream
    wait for an event of the install stream covers every scatter before that event's record.
    Faults: ``("unordered", position)``, a scatter before the install stream waited for the
    compute stream; ``("missing", module, shape)``, a module's forward with one of its params'
    scatters not waited for; ``("early", module, owners)``, a forward after a wait that covered a
    param none of whose modules has run yet since the install: the whole-install wait that holds
    back the first layers for the last ones.
    """
    unique = {id(p): p for ps in params.values() for p in ps}  # a tied matrix: one param, two owners
    owners = {k: {m for m, ps in params.items() if any(id(p) == k for p in ps)} for k in unique}
    spans = {k: (p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for k, p in unique.items()}
    owner = {}  # scatter position in the install stream's log -> the param it writes
    unordered: list[tuple] = []
    starts = {}  # the compute event an install waited for -> its scatter positions
    current = None
    for pos, (op, what) in enumerate(install.log):
        if op == "wait_event" and what.stream is compute:
            current = starts.setdefault(what, [])
        elif op == "copy":
            hit = [k for k, (lo, hi) in spans.items() if lo <= what[0] < hi]
            if hit and current is not None:
                current.append(pos)
                owner[pos] = hit[0]
            elif hit:
                unordered.append(("unordered", pos))
    faults: list[tuple] = []
    pending: dict[int, set[int]] = {}  # param -> its scatter positions not waited for yet
    waited: set[int] = set()  # params covered by a wait whose owners have not run yet
    ran: set[str] = set()  # modules forwarded since the last install
    for op, what in compute.log:
        if op == "record" and what in starts:
            ran, waited = set(), set()
            for pos in starts[what]:
                pending.setdefault(owner[pos], set()).add(pos)
        elif op == "wait_event" and what.stream is install:
            upto = len(what.after)
            for k in list(pending):
                left = {p for p in pending[k] if p >= upto}
                if len(left) < len(pending[k]):
                    waited.add(k)
                pending[k] = left
                if not left:
                    del pending[k]
        elif op == "forward":
            ran.add(what)
            faults += [("missing", what, unique[k].shape) for k in pending if what in owners[k]]
            early = {k for k in waited if not owners[k] & ran}
            faults += [("early", what, sorted(owners[k])) for k in early]
            waited = set()  # each reported once
    return unordered + faults, sum(bool(v) for v in starts.values())


def _tiny_net_losses(steps: int):
    """The tiny net and its loop: two micro-batches per step (two forwards)."""
    model = tiny_net(dtype=torch.bfloat16)

    def losses():
        for x, y in batches(steps, dtype=torch.bfloat16):
            yield [torch.nn.functional.mse_loss(model(xs).float(), ys.float()) for xs, ys in zip(x.chunk(2), y.chunk(2))]

    return model, losses, {}


def _tiny_llama_losses(steps: int):
    """A one-layer Llama with tied embeddings (the embedding and the head share one matrix, owned
    by two modules), by-row vocabulary matrices, one micro-batch per step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from zfctl.offload import vocab_matrices

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(steps)]

    def losses():
        for ids in data:
            yield [model(input_ids=ids, labels=ids).loss]

    return model, losses, {"vocab_params": vocab_matrices(model), "vocab_select": "rows"}


def _shim_run(monkeypatch, *, hooks: bool, steps: int = 12, plant=None, net=_tiny_net_losses, **tuning):
    """A bf16 model trained on CPU with the install's CUDA branch (fake streams): the faults
    ``install_waits`` reads from the compute and install streams' logs."""
    shim = fake_cuda(monkeypatch)
    model, losses, extra = net(steps)
    vocab = extra.pop("vocab_params", ())
    # One selection (t = 1, no install pending then): a later one would collect the update in
    # flight and wait for that whole install before its migration (optimizer.py ``_reselect``).
    cfg = zen(**{**BASE, "select_interval": 100}, accumulate="host", **extra, **tuning)
    with ZenFlowOptimizer(model.named_parameters(), cfg, vocab_params=vocab, **HP) as opt:
        as_cuda(opt.transfers.h2d, "stream")
        installer = as_cuda(opt.installer, "stream")
        hooked = opt.attach_install_waits(model) if hooks else 0
        host = {id(opt.params[s.index]) for s in opt.layout.host_slots}
        owned = {}
        for name, m in model.named_modules():
            ps = [p for p in m.parameters(recurse=False) if id(p) in host]
            if ps:
                owned[name] = ps
                m.register_forward_pre_hook(lambda _m, _a, name=name: shim.compute.log.append(("forward", name)))
        if plant is not None:
            plant(opt, monkeypatch)
        installs = 0
        for micro in losses():
            opt.zero_grad(set_to_none=True)
            for loss in micro:
                loss.backward()
            installs += opt.step().installed
        opt.transfers.h2d.cuda = installer.cuda = False  # close() on CPU
    assert installs >= 3 and hooked == (len(owned) if hooks else 0)
    faults, seen = install_waits(shim.compute, installer.stream, owned)
    assert seen == installs  # every install was read (each ordered after the compute stream)
    return faults, shim


def test_with_hooks_each_forward_waits_for_its_own_layer_only(monkeypatch) -> None:
    """Hooks attached: every module's first forward after an install waits for its own params'
    scatter, and no wait before it covers a later module's (no whole-install wait)."""
    faults, _ = _shim_run(monkeypatch, hooks=True)
    assert faults == []


def test_without_an_upload_buffer_the_fp32_master_goes_the_same_way(monkeypatch) -> None:
    """``upload_buffer: false`` (bf16): the install's device slots take the master's fp32 chunks
    (twice the bytes of the model-dtype slots) and the layers wait the same way."""
    faults, _ = _shim_run(monkeypatch, hooks=True, upload_buffer=False)
    assert faults == []


def test_hf_llama_layers_wait_for_their_own_install(monkeypatch) -> None:
    """The same on a transformers Llama: embedding, attention and MLP projections, the head tied
    to the embedding (its one matrix owned by two modules, installed first with the embedding)."""
    faults, _ = _shim_run(monkeypatch, hooks=True, steps=10, net=_tiny_llama_losses)
    assert faults == []
    faults, _ = _shim_run(monkeypatch, hooks=False, steps=10, net=_tiny_llama_losses)
    assert {f[0] for f in faults} == {"early"}  # no hooks: the whole install before the first layer


def test_without_hooks_the_compute_stream_waits_for_the_whole_install(monkeypatch) -> None:
    """A library user's loop (no hooks): the compute stream waits for all of it at install time,
    so nothing is missing, and the first forward waits for the last layer's columns too."""
    faults, _ = _shim_run(monkeypatch, hooks=False)
    assert not [f for f in faults if f[0] == "missing"]
    assert {f[1] for f in faults if f[0] == "early"} == {"fc1"}


def test_the_checker_sees_a_whole_install_wait_come_back(monkeypatch) -> None:
    """Planted: with hooks attached, a wait for the whole install right after it is enqueued."""
    def plant(opt, mp):
        install = opt.pipeline._install

        def then_wait(stats):
            install(stats)
            opt.installer.wait_all()

        mp.setattr(opt.pipeline, "_install", then_wait)

    faults, _ = _shim_run(monkeypatch, hooks=True, plant=plant)
    assert faults and {f[0] for f in faults} == {"early"}


def test_the_checker_sees_a_missing_layer_wait(monkeypatch) -> None:
    """Planted: one module's forward pre-hook does not wait (its event is dropped)."""
    def plant(opt, mp):
        before = opt.installer._before_forward
        last = max(k for keys in opt.installer._owners.values() for k in keys)  # the head's key

        def skip_head(key):
            if key == last:
                opt.installer._pending.pop(key, None)
                return
            before(key)

        mp.setattr(opt.installer, "_before_forward", skip_head)

    faults, _ = _shim_run(monkeypatch, hooks=True, plant=plant)
    assert faults and {(f[0], f[1]) for f in faults} == {("missing", "head")}


def test_the_next_update_waits_for_the_dma_that_reads_the_upload_buffer(monkeypatch) -> None:
    """bf16, page-locked upload buffer (registered through the shim): each install's fence is the
    event after its last copy that reads the upload buffer, the master is not read by any copy,
    and the CPU update after the install waits for that fence before it writes the upload
    (pipeline.py ``_install_wait``). A selection's migration does not consume it: the worker
    writes the leaving rows of the master and the upload behind the update, after that fence,
    taken by value (migration.py ``Departure``), and the fence stays for the next update."""
    shim = fake_cuda(monkeypatch)
    model = tiny_net(dtype=torch.bfloat16)
    cfg = zen(**BASE, accumulate="host")
    with ZenFlowOptimizer(model.named_parameters(), cfg, **HP) as opt:
        ring = as_cuda(opt.transfers.h2d, "stream")
        installer = as_cuda(opt.installer, "stream")
        host = opt.host
        host.upload = pinned.empty(host.upload.numel(), torch.bfloat16, pin=True)  # as on CUDA
        host.refresh_upload()
        up = (host.upload.data_ptr(), host.upload.data_ptr() + 2 * host.upload.numel())
        master = (host.master.data_ptr(), host.master.data_ptr() + 4 * host.master.numel())
        fences, waited = [], []
        install = opt.pipeline._install

        def fenced(stats):
            install(stats)
            fences.append(host.install_fence)

        monkeypatch.setattr(opt.pipeline, "_install", fenced)
        run = opt.pipeline.worker.run

        def checked(update):
            waited.append(all(f in shim.host_syncs for f in fences))  # every earlier install's fence
            return run(update)

        monkeypatch.setattr(opt.pipeline.worker, "run", checked)
        selections = 0
        for x, y in batches(14, dtype=torch.bfloat16):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()
            stats = opt.step()
            if stats.selection and host.install_fence is not None:  # the first: after the warm-up's install
                selections += 1
                assert host.install_fence is fences[-1]  # kept for the next update
        opt.pipeline.settle()
        reads = [pos for pos, (op, what) in enumerate(ring.stream.log) if op == "copy" and up[0] <= what[1] < up[1]]
        assert not [w for op, w in ring.stream.log if op == "copy" and master[0] <= w[1] < master[1]]
        ring.cuda = installer.cuda = False  # close() on CPU
    assert len(fences) >= 4 and all(f is not None for f in fences)
    for fence in fences:  # the event after the last copy before it that reads the upload buffer
        assert fence.stream is ring.stream
        assert max(p for p in reads if p < len(fence.after)) == len(fence.after) - 1
    assert len(waited) >= 4 and all(waited) and selections >= 1


def test_a_second_install_before_the_forward_keeps_the_first_ones_waits(monkeypatch) -> None:
    """Two installs with no forward between them, the second touching only the head: fc1 and fc2
    still wait for the first install's events (install.py ``_publish`` keeps the modules
    an earlier install left waiting)."""
    shim = fake_cuda(monkeypatch)
    model = tiny_net(dtype=torch.bfloat16)
    with ZenFlowOptimizer(model.named_parameters(), zen(**BASE, accumulate="host"), **HP) as opt:
        ring, installer = as_cuda(opt.transfers.h2d, "stream"), as_cuda(opt.installer, "stream")
        assert opt.attach_install_waits(model) == 3
        owned = {}
        for name in ("fc1", "fc2", "head"):
            m = getattr(model, name)
            owned[name] = [m.weight]
            m.register_forward_pre_hook(lambda _m, _a, name=name: shim.compute.log.append(("forward", name)))
        chunks = opt.transfers.chunks
        last = [ch for ch in chunks if ch.slot.name == "head.weight"]
        assert last and len(last) < len(chunks)
        for part in (chunks, last):
            installer.run(ring, part, opt.host.install_source, opt.params, lambda slot: None)
        model(batches(1, dtype=torch.bfloat16)[0][0])
        ring.cuda = installer.cuda = False  # close() on CPU
    faults, seen = install_waits(shim.compute, installer.stream, owned)
    assert seen == 2 and faults == []
