"""GPT: shapes, naming, tied head, positions from the padding mask, and input errors."""

import pytest
import torch
import transformers

from helpers import INT4_CONFIG, TINY_CONFIGS, in_dtype, make_model
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
            hidden = block(hidden)
        logits = model(x)
        assert logits.shape == (1, 5, 211)
        assert torch.allclose(logits, model.ln_f(hidden) @ model.wte.weight.T, atol=1e-5)
        assert torch.allclose(model(x, last_only=True)[:, 0], logits[:, -1], atol=1e-6)
    assert not any("lm_head" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int8-body", "int4", "int4-body"])
def test_num_parameters_is_the_checkpoints_in_every_dtype(dtype):
    # GPT-2 124M's formula (the tied head once), whether the weights are parameters or quantized buffers.
    c = INT4_CONFIG
    layer = 12 * c.n_embd**2 + 13 * c.n_embd  # two LayerNorms, four linear layers with biases (MLP 4x wide)
    expected = c.vocab_size * c.n_embd + c.n_positions * c.n_embd + c.n_layer * layer + 2 * c.n_embd
    assert make_model(c).num_parameters() == expected
    assert in_dtype(make_model(c), dtype).num_parameters() == expected


def test_positions_are_explicit_per_row():
    # The same tokens at other positions give other logits: each row's positions are its own.
    model = make_model(TINY_CONFIGS["2x2x32"], seed=1)
    config = model.config
    x = torch.tensor([[7, 8, 9]])
    with torch.no_grad():
        at_zero = model(x, positions=torch.arange(3)[None], cache=KVCache(config, 1, 16))
        assert torch.allclose(at_zero, model(x), atol=1e-5)
        shifted = model(x, positions=torch.arange(5, 8)[None], cache=KVCache(config, 1, 16))
        assert not torch.allclose(shifted, model(x), atol=1e-3)


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
    cache = KVCache(config, 2, 8)
    ids, pos = torch.zeros(2, 4, dtype=torch.long), torch.arange(4).expand(2, -1)
    with pytest.raises(ValueError, match=r"cached forward needs positions of shape \(2, 4\)"):
        model(ids, cache=cache)
    with pytest.raises(ValueError, match="the cache has 2 slots but the input has 1 rows"):
        model(ids[:1], positions=pos[:1], cache=cache)
    with pytest.raises(ValueError, match=r"slot=2 needs one row and a slot in 0\.\.1"):
        model(ids[:1], positions=pos[:1], cache=cache, slot=2)
    with pytest.raises(ValueError, match=r"span=9 must be in 1\.\.8"):
        model(ids, positions=pos, cache=cache, span=9)
    with pytest.raises(ValueError, match=r"position 8 is outside 0\.\.7"):
        model(ids, positions=pos + 5, cache=cache)
    with pytest.raises(ValueError, match=r"position 5 is outside 0\.\.4"):
        model(ids, positions=pos + 2, cache=cache, span=5)
    with pytest.raises(ValueError, match="positions, slot, span and embedded need a cache"):
        model(ids, positions=pos)
    with pytest.raises(ValueError, match=r"embedded has shape \(2, 3, 5\); pass GPT.embed's"):
        model(ids, positions=pos, cache=cache, embedded=torch.zeros(2, 3, 5))
    # embedded= is the blocks' input as given: GPT.embed's gives the plain cached forward's logits bitwise
    tokens = torch.randint(0, config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(0))
    plain = model(tokens, positions=pos, cache=KVCache(config, 2, 8))
    given = model(tokens, positions=pos, cache=KVCache(config, 2, 8), embedded=model.embed(tokens, pos))
    assert torch.equal(plain, given)


def test_layers_share_one_causal_mask(tmp_path):
    import checkpoints
    from helpers import tiny_checkpoint

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
