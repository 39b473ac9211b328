"""The `zenflow.*` options: the library's defaults are the `default` preset, about nine options
outside `zenflow.tuning`, one validator for the CLI and the library, and every key of an older
zfctl still loads (mapped, with a note) from a saved plan, `--config`, `--set`, `zfctl bench
--set` and a DeepSpeed JSON."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, fields, replace
from pathlib import Path

import pytest
import torch
import yaml
from conftest import widen_consoles
from test_offload_helpers import snapshot
from torch import nn
from typer.testing import CliRunner

from zfctl.cli import app
from zfctl.errors import ConfigError, UserError
from zfctl.offload import ZenFlowConfig, ZenFlowOptimizer, vocab_matrices
from zfctl.offload.config import AUTO_SELECT_STEPS, TuningConfig
from zfctl.offload.sizing import AUTO_DEVICE_SHARE, device_fits
from zfctl.plan import memory, plan_from_dict, plan_to_dict, resolve_plan
from zfctl.plan.coerce import section_from_dict
from zfctl.plan.deepspeed import from_deepspeed
from zfctl.plan.io import dump_plan_yaml, load_plan_yaml
from zfctl.plan.legacy import RETIRED
from zfctl.plan.presets import get_preset
from zfctl.train.optim import build_optimizer
from zfctl.train.rundir import plan_differences

runner = CliRunner()

# A plan.yaml's zenflow section as zfctl wrote it before zenflow.tuning existed (the default
# preset of that version): what every checkpoint saved by it holds.
OLD_DEFAULT = {
    "topk_ratio": 0.1, "select_strategy": "step", "select_interval": 8, "update_interval": 4,
    "full_warm_up_rounds": 20, "overlap_step": True, "install_lag": 0, "deferred_lr_scale": "repeat",
    "vocab_select": "rows", "stream_grads": True, "accumulate": "auto", "pin_memory": True, "auto_ratio": 0.99,
    "auto_min_interval": 1, "auto_max_interval": 16, "cpu_threads": 0, "accumulate_threads": 0,
    "ring_slots": 4, "ring_slot_mb": 32.0, "inflight_mb": 0.0,
}
TUNING = [f.name for f in fields(TuningConfig)]
MODEL = {"model": {"config": {"model_type": "llama"}}}  # the least a plan needs besides zenflow


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    widen_consoles(monkeypatch)


def zf(*args: object):
    return runner.invoke(app, [str(a) for a in args])


# -- the defaults ----------------------------------------------------------------------------
def test_the_library_defaults_are_the_default_preset() -> None:
    assert get_preset("zenflow", "default").load() == {"zenflow": {}}  # the preset sets nothing
    assert resolve_plan("tiny-llama", "alpaca-sample").zenflow == ZenFlowConfig() == section_from_dict(
        ZenFlowConfig, {}, "zenflow")
    d = ZenFlowConfig()
    assert (d.topk_ratio, d.select_interval, d.update_interval, d.full_warm_up_rounds, d.overlap_step) == (
        0.1, 8, 4, 20, True)
    assert (d.deferred_lr_scale, d.vocab_select, d.accumulate, d.cpu_threads) == ("repeat", "rows", "auto", 0)
    assert d.tuning == TuningConfig() and d.tuning.install_lag == 0  # install_lag stays opt-in
    # paper is a short diff against them
    assert get_preset("zenflow", "paper").load()["zenflow"] == {
        "select_interval": "auto", "full_warm_up_rounds": 0, "deferred_lr_scale": "off", "vocab_select": "columns"}


class TokenModel(nn.Module):
    """An embedding, a hidden layer and an output head: every kind of matrix the options treat
    differently (vocab_select: rows picks tokens in the first and last)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.fc = nn.Linear(16, 48)
        self.head = nn.Linear(48, 64)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(nn.functional.gelu(self.fc(self.embed(ids))))


def _train(opt: ZenFlowOptimizer, model: nn.Module, steps: int) -> list:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 24, (8, 6), generator=g)  # tokens 24..63 never appear
        opt.zero_grad(set_to_none=True)
        logits = model(ids[:, :-1])
        nn.functional.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1)).backward()
        out.append(opt.step())
    opt.flush()
    return out


def test_a_library_user_trains_like_the_cli() -> None:
    """`ZenFlowOptimizer(params)` with the plan's hyper-parameters is `build_optimizer(plan)` of
    the default preset, bit for bit: warm-up, re-selection every 8 steps, repeat, rows."""
    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=["train.lr=1e-2", "train.weight_decay=0.01"])
    t = plan.train
    torch.manual_seed(0)
    cli_model = TokenModel()
    lib_model = TokenModel()
    lib_model.load_state_dict(cli_model.state_dict())
    with build_optimizer(cli_model, plan, steps_per_epoch=1000) as opt:
        cli_stats = _train(opt, cli_model, 40)
    with ZenFlowOptimizer(lib_model.named_parameters(), lr=t.lr, betas=tuple(t.betas), eps=t.eps,
                          weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm,
                          vocab_params=vocab_matrices(lib_model)) as opt:
        assert opt.config == ZenFlowConfig()
        lib_stats = _train(opt, lib_model, 40)
    a, b = snapshot(cli_model), snapshot(lib_model)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert [s.step for s in lib_stats if s.selection] == [20, 28, 36]  # after 20 warm-up steps, every 8
    assert [s.selection for s in cli_stats] == [s.selection for s in lib_stats]


# -- select_interval -------------------------------------------------------------------------
def test_select_interval_counts_steps_or_epochs() -> None:
    assert ZenFlowConfig(select_interval=12).select_period(None) == 12
    assert ZenFlowConfig(select_interval="epoch").select_period(30) == 30
    assert ZenFlowConfig(select_interval="3 epochs").select_period(30) == 90
    assert ZenFlowConfig(select_interval="auto").select_period(30) == 30
    assert ZenFlowConfig(select_interval="auto").select_period(None) == AUTO_SELECT_STEPS
    with pytest.raises(UserError, match="select_interval=3 epochs needs the epoch length"):
        ZenFlowConfig(select_interval="3 epochs").select_period(None)
    # one spelling per meaning
    assert ZenFlowConfig(select_interval="1 epoch").select_interval == "epoch"
    assert ZenFlowConfig(select_interval=" 2Epoch ").select_interval == "2 epochs"
    assert resolve_plan("tiny-llama", "alpaca-sample", overrides=["zenflow.select_interval=4 epochs"]
                        ).zenflow.select_interval == "4 epochs"


# -- one validator ---------------------------------------------------------------------------
@pytest.mark.parametrize(("key", "value", "fix"), [
    ("topk_ratio", 1.5, "must be a number in [0, 1], e.g. 0.1"),
    ("topk_ratio", "lots", "must be a number in [0, 1], e.g. 0.1"),
    ("update_interval", 0, "must be an integer in [1, 64] or auto"),
    ("update_interval", "often", "must be an integer in [1, 64] or auto"),
    ("select_interval", "weekly", "must be an integer >= 1 (steps), auto, epoch or 'N epochs'"),
    ("select_interval", 0, "must be an integer >= 1 (steps), auto, epoch or 'N epochs'"),
    ("full_warm_up_rounds", -1, "must be an integer >= 0"),
    ("overlap_step", "maybe", "must be true or false"),
    ("deferred_lr_scale", "double", "use one of off, sqrt, linear, repeat"),
    ("vocab_select", "tokens", "use one of columns, rows"),
    ("accumulate", "gpu", "use one of auto, host, device"),
    ("tuning.ring_slots", 0, "must be an integer >= 1"),
    ("tuning.ring_slot_mb", 0.0, "must be a number of MiB > 0, e.g. 32"),
    ("tuning.auto_ratio", 1.5, "must be a number in (0, 1], e.g. 0.99"),
    ("tuning.install_lag", -2, "must be an integer >= 0"),
])
def test_the_cli_and_the_library_refuse_a_value_alike(key: str, value: object, fix: str) -> None:
    name = key.rsplit(".", 1)[-1]
    lib = ZenFlowConfig(tuning=TuningConfig(**{name: value})) if key.startswith("tuning.") else \
        ZenFlowConfig(**{name: value})
    with pytest.raises(ConfigError) as from_library:
        lib.validate()
    as_typed = json.dumps(value) if not isinstance(value, str) else value
    with pytest.raises(ConfigError) as from_cli:
        resolve_plan("tiny-llama", "alpaca-sample", overrides=[f"zenflow.{key}={as_typed}"])
    assert str(from_cli.value) == str(from_library.value) == f"zenflow.{key}={value!r}: {fix}"


def test_the_combinations_are_checked_once() -> None:
    with pytest.raises(ConfigError, match=r"zenflow\.select_interval=2: must be >= update_interval \(4\)"):
        ZenFlowConfig(select_interval=2).validate()
    ZenFlowConfig(select_interval="epoch", update_interval=16).validate()  # epochs: no step comparison
    bad = {**MODEL, "zenflow": {"tuning": {"auto_min_interval": 8, "auto_max_interval": 4}}}
    with pytest.raises(ConfigError, match=r"zenflow\.tuning\.auto_max_interval=4: must be >= "):
        plan_from_dict(bad)


def test_the_cli_prints_the_librarys_words() -> None:
    res = zf("plan", "tiny-llama", "--data", "alpaca-sample", "--set", "zenflow.update_interval=often")
    assert res.exit_code == 2
    assert res.stderr.strip() == "error: zenflow.update_interval='often': must be an integer in [1, 64] or auto"


# -- presets show ----------------------------------------------------------------------------
def test_presets_show_default_lists_at_most_ten_options_outside_tuning() -> None:
    res = zf("presets", "show", "default")
    assert res.exit_code == 0, res.output
    keys = set(re.findall(r"zenflow\.[a-z_]+(?:\.[a-z_]+)?", res.output))
    outside = {k for k in keys if not k.startswith("zenflow.tuning")}
    assert 0 < len(outside) <= 10, sorted(outside)
    section = zf("presets", "show", "zenflow")
    assert section.exit_code == 0
    tuning_at = section.output.index(" tuning ")
    assert all(section.output.index(f"zenflow.tuning.{k} ") > tuning_at for k in TUNING)
    assert all(f"zenflow.{f.name} " in section.output[:tuning_at] for f in fields(ZenFlowConfig)
               if f.name != "tuning")


def test_plan_yaml_holds_the_tuning_block_with_its_comments(tmp_path: Path) -> None:
    plan = resolve_plan("tiny-llama", "alpaca-sample", overrides=["zenflow.tuning.install_lag=2"])
    dump_plan_yaml(plan, tmp_path / "plan.yaml")
    text = (tmp_path / "plan.yaml").read_text()
    assert "  tuning:\n    # Opt-in: with overlap_step" in text and "\n    install_lag: 2\n" in text
    assert load_plan_yaml(tmp_path / "plan.yaml") == plan


# -- keys of an older zfctl --------------------------------------------------------------------
def _old_plan_file(path: Path, zenflow: dict) -> Path:
    data = plan_to_dict(resolve_plan("tiny-llama", "alpaca-sample"))
    data["zenflow"] = zenflow
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_an_old_saved_plan_loads_as_today_with_a_note_per_key(tmp_path: Path) -> None:
    notes: list[str] = []
    old = load_plan_yaml(_old_plan_file(tmp_path / "plan.yaml", OLD_DEFAULT), notes)
    assert old.zenflow == ZenFlowConfig()
    # keys added since were never flat; retired keys (accumulate_threads) are dropped, one note each
    assert len(notes) == len(set(TUNING) & set(OLD_DEFAULT)) + 1 + len(set(RETIRED) & set(OLD_DEFAULT))
    assert any(n.startswith("plan.yaml: old key zenflow.tuning.accumulate_threads dropped") for n in notes)
    assert any(n.startswith("plan.yaml: old key zenflow.tuning.stream_grads dropped: the gradients always leave")
               for n in notes)
    assert "plan.yaml: old key zenflow.install_lag read as zenflow.tuning.install_lag" in notes
    assert ("plan.yaml: old keys zenflow.select_strategy=step, select_interval=8 read as "
            "zenflow.select_interval=8") in notes
    # a resume compares it with the run folder's plan, written by this version: no change
    dump_plan_yaml(old, tmp_path / "new.yaml")
    assert plan_differences(old, load_plan_yaml(tmp_path / "new.yaml")) == []
    # both written by the old version: mapped alike
    again = load_plan_yaml(_old_plan_file(tmp_path / "again.yaml", OLD_DEFAULT))
    assert plan_differences(old, again) == []
    # an edited tuning key is named by its own dotted key
    edited = replace(old, zenflow=replace(old.zenflow, tuning=replace(old.zenflow.tuning, install_lag=2)))
    assert plan_differences(old, edited) == ["zenflow.tuning.install_lag: 0 -> 2"]


@pytest.mark.parametrize(("strategy", "interval", "today"), [
    ("step", 8, 8), ("epoch", 1, "epoch"), ("epoch", 3, "3 epochs"), ("auto", "auto", "auto"),
    ("auto", 1, "auto"), ("auto", 2, "2 epochs"),
])
def test_select_strategy_folds_into_select_interval(tmp_path: Path, strategy: str, interval: object,
                                                    today: object) -> None:
    old = {**OLD_DEFAULT, "select_strategy": strategy, "select_interval": interval, "update_interval": 4}
    assert load_plan_yaml(_old_plan_file(tmp_path / "plan.yaml", old)).zenflow.select_interval == today
    with pytest.raises(ConfigError, match="give an integer when select_strategy is 'epoch'"):
        load_plan_yaml(_old_plan_file(tmp_path / "bad.yaml", {"select_strategy": "epoch", "select_interval": "auto"}))


def test_old_keys_in_a_config_file_and_in_set(tmp_path: Path) -> None:
    cfg = tmp_path / "mine.yaml"
    cfg.write_text("zenflow:\n  install_lag: 1\n  ring_slots: 2\n  select_strategy: epoch\n  select_interval: 2\n")
    notes: list[str] = []
    z = resolve_plan("tiny-llama", "alpaca-sample", config=cfg, notes=notes).zenflow
    assert (z.tuning.install_lag, z.tuning.ring_slots, z.select_interval) == (1, 2, "2 epochs")
    assert sum(n.startswith(f"--config {cfg}: old key") for n in notes) == 3
    # --set: a pair given as two overrides is read as a pair; a lone strategy re-reads the
    # interval of the layers below, as the old merged plan did (the default's 8 -> 8 epochs).
    notes = []
    z = resolve_plan("tiny-llama", "alpaca-sample", zenflow="paper", notes=notes, overrides=[
        "zenflow.select_strategy=epoch", "zenflow.select_interval=2", "zenflow.pin_memory=false"]).zenflow
    assert (z.select_interval, z.tuning.pin_memory, z.deferred_lr_scale) == ("2 epochs", False, "off")
    assert "--set: old key zenflow.pin_memory read as zenflow.tuning.pin_memory" in notes
    z = resolve_plan("tiny-llama", "alpaca-sample", overrides=["zenflow.select_strategy=epoch"]).zenflow
    assert z.select_interval == "8 epochs"
    with pytest.raises(ConfigError, match="also given as zenflow.tuning.install_lag=2"):
        resolve_plan("tiny-llama", "alpaca-sample",
                     overrides=["zenflow.install_lag=1", "zenflow.tuning.install_lag=2"])


def test_old_keys_on_the_command_line_print_a_note() -> None:
    res = zf("plan", "tiny-llama", "--data", "alpaca-sample", "--set", "zenflow.install_lag=1", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["plan"]["zenflow"]["tuning"]["install_lag"] == 1
    res = zf("plan", "tiny-llama", "--data", "alpaca-sample", "--set", "zenflow.install_lag=1")
    assert "note: --set: old key zenflow.install_lag read as zenflow.tuning.install_lag" in res.stderr
    # a retired key: accepted, dropped, and one note says what replaces it
    res = zf("plan", "tiny-llama", "--data", "alpaca-sample", "--set", "zenflow.tuning.stream_grads=false")
    assert res.exit_code == 0, res.output
    assert ("note: --set: old key zenflow.tuning.stream_grads dropped: the gradients always leave during the "
            "announced last backward (the hook path); a library loop that does not call "
            "prepare_backward(final=True) gets step() copying them") in res.stderr


def test_old_keys_in_bench_set() -> None:
    from zfctl.cli.bench import _zenflow_config

    notes: list[str] = []
    cfg = _zenflow_config("default", ["zenflow.install_lag=1", "zenflow.select_strategy=epoch",
                                      "zenflow.select_interval=2"], notes)
    assert (cfg.tuning.install_lag, cfg.select_interval, cfg.deferred_lr_scale) == (1, "2 epochs", "repeat")
    assert len(notes) == 2 and all(n.startswith("--set: old key") for n in notes)
    with pytest.raises(UserError, match="sets zenflow.tuning.pin_memory itself; use --pin"):
        _zenflow_config(None, ["zenflow.pin_memory=false"])
    assert _zenflow_config(None, []) == resolve_plan("tiny-llama", "alpaca-sample", zenflow="paper").zenflow


def test_deepspeed_keys_map_with_a_note_and_keep_deepspeeds_behaviour() -> None:
    ds = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                                "zenflow": {"topk_ratio": 0.2, "select_strategy": "step", "select_interval": 4,
                                            "update_interval": 4, "auto_ratio": 0.9}}}
    out = from_deepspeed(ds)
    assert out.fragment["zenflow"] == {
        "overlap_step": False, "update_interval": 4, "select_interval": 4, "full_warm_up_rounds": 0,
        "deferred_lr_scale": "off", "vocab_select": "columns", "topk_ratio": 0.2,
        "tuning": {"pin_memory": False, "install_lag": 0, "auto_ratio": 0.9}}
    assert {n for n in out.notes if "read as" in n} == {
        "DeepSpeed key zero_optimization.offload_optimizer.pin_memory read as zenflow.tuning.pin_memory",
        "DeepSpeed key zero_optimization.zenflow.auto_ratio read as zenflow.tuning.auto_ratio",
        ("DeepSpeed key zero_optimization.zenflow.select_strategy=step with select_interval=4 read as "
         "zenflow.select_interval=4")}
    # DeepSpeed's select_interval alone counts epochs (its default strategy is auto)
    epochs = dict(ds, zero_optimization={**ds["zero_optimization"], "zenflow": {"select_interval": 2}})
    assert from_deepspeed(epochs).fragment["zenflow"]["select_interval"] == "2 epochs"
    # keys the block omits keep DeepSpeed's meaning, though zfctl's defaults changed
    z = plan_from_dict({**MODEL, "zenflow": from_deepspeed({"zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {}}}).fragment["zenflow"]}).zenflow
    assert asdict(z) == {**asdict(ZenFlowConfig()), "overlap_step": False, "update_interval": "auto",
                         "select_interval": "auto", "full_warm_up_rounds": 0, "deferred_lr_scale": "off",
                         "vocab_select": "columns"}


# -- accumulate: auto ------------------------------------------------------------------------
def test_one_rule_decides_accumulate_auto() -> None:
    """The device accumulator's rule (device_fits) is the one the plan applies, and only where no
    host layout fits the host (zfctl/plan/layouts.py: slots > carry > the device path): a host
    that holds the carry keeps the sum there whatever the GPU."""
    assert memory.AUTO_DEVICE_SHARE is AUTO_DEVICE_SHARE
    assert device_fits(60.0, 25.0, 100.0) and not device_fits(60.0, 25.5, 100.0)
    plan = resolve_plan("llama3.2-1b", "alpaca", overrides=["train.device=cuda"])
    chosen = {gb: memory.estimate(plan, memory.Machine(1e12, True, "gpu", gb * 1e9)).accumulate
              for gb in (16, 20.35, 80)}
    assert chosen == {16: "host", 20.35: "host", 80: "host"}


def test_the_run_builds_the_plans_layout_whatever_machine_it_finds(monkeypatch) -> None:
    """``machine.*`` is the machine the plan was made for, and the run builds the plan's answer:
    a plan made for a 37 GB host takes the carry wherever it runs (a smaller host is refused by
    the run's check instead, tests/plan/test_plan_holds.py), and this machine's size is never
    consulted to choose."""
    from zfctl.plan import machine as machine_mod
    from zfctl.plan.settle import settle

    plan = resolve_plan("llama2-7b", "alpaca", overrides=["train.device=cuda", "machine.gpu_memory=48GB",
                                                          "machine.host_memory=128GB"])
    assert memory.estimate(plan).grad_layout == "carry"  # what `zfctl plan` shows for the target
    for gb in (128, 2048):
        monkeypatch.setattr(machine_mod, "this_machine", lambda gb=gb: memory.Machine(gb * 1e9, True, "gpu", 80e9))
        assert settle(plan).zenflow.tuning.grad_layout == "carry", gb
