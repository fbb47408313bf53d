"""Hugging Face export and import: transformers loads what we write and computes the same
logits (fp32, 1e-4); what transformers writes we load and compute the same logits."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_lsgd.training.checkpointing import CheckpointError
from megatron_lsgd.training.checkpointing.full_model import read_lsgd, to_module
from tests.unit_tests.checkpointing.single import LLAMA, run_single

transformers = pytest.importorskip("transformers")
convert = pytest.importorskip("tools.checkpoint.convert")

TOKENS = torch.tensor([[1, 5, 9, 200, 17, 3, 3, 64, 100, 2, 7, 11], [40, 41, 42, 0, 249, 8, 8, 8, 1, 2, 3, 4]])


def _ours(load_dir: str) -> torch.Tensor:
    model = to_module(read_lsgd(load_dir))
    with torch.no_grad():
        return model(TOKENS, torch.arange(TOKENS.shape[1]).expand_as(TOKENS))


def _theirs(hf_dir: str) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def _convert(*args: str) -> int:
    return convert.main(["--model-type", "GPT", *args])


@pytest.mark.parametrize("family,expected_class", [("llama", "LlamaForCausalLM"), ("gpt2", "GPT2LMHeadModel")])
def test_export_trained_checkpoint(tmp_path, monkeypatch, caplog, family, expected_class):
    ckpt, hf = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    extra = LLAMA if family == "llama" else []
    assert run_single(extra + ["--train-iters", "3", "--save", ckpt], monkeypatch) == 0
    assert _convert("--loader", "lsgd", "--saver", "hf", "--load-dir", ckpt, "--save-dir", hf) == 0
    config = json.load(open(os.path.join(hf, "config.json")))
    assert config["architectures"] == [expected_class]
    # The tokenizer's true vocabulary (NullTokenizer 250, padded to 256 for training) and its
    # end-of-document id; GPT-2 uses <|endoftext|> as bos too, the NullTokenizer has no bos.
    assert config["vocab_size"] == 250 and config["eos_token_id"] == 249
    assert config["bos_token_id"] == (249 if family == "gpt2" else None)
    transformers.logging.enable_propagation()
    with caplog.at_level("WARNING"):
        theirs = _theirs(hf)
    assert not [r for r in caplog.records if "vocab" in r.getMessage().lower()]
    ours = _ours(ckpt)
    assert ours.shape[-1] == 256 and theirs.shape[-1] == 250
    torch.testing.assert_close(theirs, ours[..., :250], rtol=0, atol=1e-4)


def _random_hf_model(family: str):
    torch.manual_seed(0)
    if family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       tie_word_embeddings=False, rms_norm_eps=1e-5)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4)
        model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # fresh HF init has zero biases and unit norms: perturb so every tensor matters
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_import_from_transformers_and_back(tmp_path, family):
    hf_in, ckpt, hf_out = str(tmp_path / "hf_in"), str(tmp_path / "ckpt"), str(tmp_path / "hf_out")
    _random_hf_model(family).save_pretrained(hf_in)
    with open(os.path.join(hf_in, "tokenizer.json"), "w") as f:
        f.write('{"version": "1.0"}')
    assert _convert("--loader", "hf", "--saver", "lsgd", "--load-dir", hf_in, "--save-dir", ckpt) == 0
    torch.testing.assert_close(_ours(ckpt), _theirs(hf_in), rtol=0, atol=1e-4)

    # Tokenizer files travel with the checkpoint and back out to Hugging Face; the generation
    # config written by save_pretrained is not a tokenizer file and stays behind.
    meta = json.load(open(os.path.join(ckpt, "iter_0000000", "metadata.json")))
    assert os.path.exists(os.path.join(hf_in, "generation_config.json"))
    assert sorted(os.listdir(meta["args"]["tokenizer_model"])) == ["tokenizer.json"]
    assert meta["tokenizer"]["vocab_size"] == 256
    assert _convert("--loader", "lsgd", "--saver", "hf", "--load-dir", ckpt, "--save-dir", hf_out) == 0
    assert os.path.isfile(os.path.join(hf_out, "tokenizer.json"))
    torch.testing.assert_close(_theirs(hf_out), _theirs(hf_in), rtol=0, atol=1e-5)


def test_import_rejects_unknown_tensors_and_architectures(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    hf_in = str(tmp_path / "hf_in")
    _random_hf_model("llama").save_pretrained(hf_in)
    path = os.path.join(hf_in, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)  # a Qwen3-style extra
    save_file(tensors, path)
    assert _convert("--loader", "hf", "--saver", "lsgd", "--load-dir", hf_in, "--save-dir", str(tmp_path / "x")) == 2
    assert "q_norm" in capsys.readouterr().err

    cfg_path = os.path.join(hf_in, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["model_type"] = "mistral"
    json.dump(cfg, open(cfg_path, "w"))
    assert _convert("--loader", "hf", "--saver", "lsgd", "--load-dir", hf_in, "--save-dir", str(tmp_path / "y")) == 2
    assert "mistral" in capsys.readouterr().err
    assert not os.path.exists(str(tmp_path / "y" / "latest_checkpointed_iteration.txt"))


def test_export_rejects_models_hugging_face_cannot_express(tmp_path, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    # RMSNorm with learned positions and GELU is neither Llama nor GPT-2.
    assert run_single(["--normalization", "RMSNorm", "--train-iters", "2", "--save", ckpt], monkeypatch) == 0
    with pytest.raises(CheckpointError, match="--normalization LayerNorm"):
        from megatron_lsgd.training.checkpointing.hf_mapping import to_hf

        full = read_lsgd(ckpt)
        to_hf(full.params, full.config)
