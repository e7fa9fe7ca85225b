"""GPT: shapes, naming, tied head, positions from the padding mask, and input errors."""

import pytest
import torch
import transformers

from conftest import TINY_CONFIGS, make_model
from model import GPT, GPTConfig, KVCache


def test_submodule_names_mirror_gpt2_checkpoint_keys():
    names = set(dict(GPT(TINY_CONFIGS["2x2x32"]).named_parameters()))
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=211,
                                                              n_positions=64))  # fmt: skip
    hf_names = {k.removeprefix("transformer.") for k in hf.state_dict() if not k.startswith("lm_head")}
    hf_names = {k for k in hf_names if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    assert names == hf_names


def test_output_head_is_the_token_embedding():
    model = make_model(TINY_CONFIGS["2x2x32"])
    x = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        hidden = model.wte(x) + model.wpe(torch.arange(5))
        for block in model.h:
            hidden = block(hidden, offset=0, key_padding_mask=None, kv=None)
        logits = model(x)
        assert logits.shape == (1, 5, 211)
        assert torch.allclose(logits, model.ln_f(hidden) @ model.wte.weight.T, atol=1e-5)
        assert torch.allclose(model(x, last_only=True)[:, 0], logits[:, -1], atol=1e-6)
    assert not any("lm_head" in n for n, _ in model.named_parameters())


def test_positions_count_from_first_real_token():
    model = make_model(TINY_CONFIGS["2x2x32"], seed=1)
    x = torch.tensor([[7, 8, 9]])
    padded = torch.tensor([[0, 0, 7, 8, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    with torch.no_grad():
        assert torch.allclose(model(padded, attention_mask=mask)[:, 2:], model(x), atol=1e-5)
        # without the mask, the padding shifts the positions and the logits differ
        assert not torch.allclose(model(padded)[:, 2:], model(x), atol=1e-3)


def test_residual_projections_use_scaled_init():
    config = GPTConfig(n_layer=8, n_head=4, n_embd=128, vocab_size=100, n_positions=16)
    torch.manual_seed(0)
    model = GPT(config)
    assert abs(model.h[0].mlp.c_proj.weight.std().item() - 0.02 / 4) < 1e-3
    assert abs(model.h[0].mlp.c_fc.weight.std().item() - 0.02) < 2e-3


def test_input_errors_name_the_limit():
    config = TINY_CONFIGS["2x2x32"]
    model = make_model(config)
    with pytest.raises(ValueError, match="65 positions exceed the model's context window n_positions=64"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids has no positions"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 3\), expected \(1, 4\)"):
        model(torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match="cache was allocated for batch size 2, input has 1 rows"):
        model(torch.zeros(1, 4, dtype=torch.long), cache=KVCache(config, 2, 8))
    cache = KVCache(config, 1, 8)
    model(torch.zeros(1, 6, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="KV cache holds 8 positions but 10 are needed"):
        model(torch.zeros(1, 4, dtype=torch.long), cache=cache)


def test_layers_share_one_causal_mask(tmp_path):
    from _hf_helpers import tiny_checkpoint

    import checkpoints

    def shared(model: GPT) -> bool:
        n = model.config.n_positions
        first = model.h[0].attn.mask
        return torch.equal(first, torch.ones(n, n, dtype=torch.bool).triu(1)) and all(
            block.attn.mask.data_ptr() == first.data_ptr() for block in model.h
        )

    config = GPTConfig(n_layer=3, n_head=2, n_embd=32, vocab_size=50, n_positions=16)
    model = GPT(config)
    assert shared(model)
    assert shared(model.to(torch.bfloat16))
    with torch.device("meta"):
        empty = GPT(config)
    empty.to_empty(device="cpu")  # buffers uninitialised
    empty.reset_buffers()
    assert shared(empty)
    directory, _ = tiny_checkpoint(tmp_path / "ckpt")
    assert shared(checkpoints.load(directory))
    # the mask is non-persistent: not in the state dict, so checkpoints never carry it
    assert not any(k.endswith("attn.mask") for k in model.state_dict())
