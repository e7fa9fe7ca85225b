"""CausalAttention: the seeds' worked example, mask slicing, and KV buffers at per-row positions."""

import pytest
import torch
from torch import nn

from model import CausalAttention
from model.attention import CHUNK

# "Your journey starts with one step", 3-d embeddings, as in the seeds' worked example.
INPUTS = torch.tensor(
    [[0.43, 0.15, 0.89], [0.55, 0.87, 0.66], [0.57, 0.85, 0.64],
     [0.22, 0.58, 0.33], [0.77, 0.25, 0.10], [0.05, 0.80, 0.55]]
)  # fmt: skip
PUBLISHED_ROW_2 = [0.5517, 0.4483, 0.0, 0.0, 0.0, 0.0]
PUBLISHED_ROW_6 = [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529]


def seeded_attention() -> tuple[CausalAttention, nn.Linear, nn.Linear, nn.Linear]:
    torch.manual_seed(789)
    w_query, w_key, w_value = (nn.Linear(3, 2, bias=False) for _ in range(3))  # drawn in this order
    attn = CausalAttention(3, 2, 6)
    with torch.no_grad():
        attn.c_attn.weight.copy_(torch.cat([w_query.weight, w_key.weight, w_value.weight]))
    return attn.eval(), w_query, w_key, w_value


def test_worked_example_matches_published_weights():
    attn, *_ = seeded_attention()
    w = attn.attention_weights(INPUTS[None])[0, 0]  # (6, 6)
    assert torch.allclose(w[1], torch.tensor(PUBLISHED_ROW_2), atol=5e-5)
    assert torch.allclose(w[5], torch.tensor(PUBLISHED_ROW_6), atol=5e-5)
    assert torch.all(w.triu(diagonal=1) == 0)  # exactly zero above the diagonal
    assert torch.allclose(w.sum(-1), torch.ones(6), atol=1e-6)


def test_mask_after_softmax_renormalised_gives_same_weights():
    attn, w_query, w_key, _ = seeded_attention()
    q, k = w_query(INPUTS), w_key(INPUTS)
    unmasked = torch.softmax(q @ k.T / k.shape[-1] ** 0.5, dim=-1)
    simple = unmasked * torch.tril(torch.ones(6, 6))
    renormalised = simple / simple.sum(dim=-1, keepdim=True)
    assert torch.allclose(attn.attention_weights(INPUTS[None])[0, 0], renormalised, atol=1e-6)


def test_mask_is_a_nonpersistent_buffer_sliced_not_rebuilt():
    attn = CausalAttention(8, 8, 16, num_heads=2)
    assert "mask" in dict(attn.named_buffers()) and "mask" not in attn.state_dict()
    assert torch.equal(attn.mask, torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1))
    ptr = attn.mask.data_ptr()
    attn(torch.randn(2, 5, 8))
    assert attn.mask.data_ptr() == ptr and attn.mask.shape == (16, 16)


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_prefix_output_equals_truncated_full_output(heads):
    torch.manual_seed(0)
    attn = CausalAttention(8, 8, 12, num_heads=heads, qkv_bias=True).eval()
    x = torch.randn(3, 12, 8)
    full = attn(x)
    for t in range(1, 13):
        assert torch.allclose(attn(x[:, :t]), full[:, :t], atol=1e-6), t


def test_forward_equals_explicit_softmax_path():
    torch.manual_seed(1)
    attn = CausalAttention(12, 12, 10, num_heads=3, qkv_bias=True).eval()
    x = torch.randn(2, 7, 12)
    weights = attn.attention_weights(x)  # (B, H, T, T)
    _, _, v = attn._qkv(x)
    by_hand = attn.c_proj((weights @ v).transpose(1, 2).reshape(2, 7, 12))
    assert torch.allclose(attn(x), by_hand, atol=1e-6)


def test_kv_buffers_at_explicit_positions_equal_full_sequence():
    torch.manual_seed(2)
    attn = CausalAttention(8, 8, 16, num_heads=2).eval()
    x = torch.randn(2, 9, 8)
    k_buf, v_buf = torch.zeros(2, 2, CHUNK, 4), torch.zeros(2, 2, CHUNK, 4)  # (a decode step reads chunks)
    parts, start = [], 0
    for size in (4, 1, 3, 1):  # uneven chunks
        positions = torch.arange(start, start + size).expand(2, -1)
        parts.append(attn(x[:, start : start + size], positions=positions, kv=(k_buf, v_buf)))
        start += size
    assert torch.allclose(torch.cat(parts, 1), attn(x), atol=1e-6)


def test_each_row_attends_only_up_to_its_own_position():
    # Row 0 at position 2, row 1 at position 6, in one call: each equals its own sequence alone.
    torch.manual_seed(3)
    attn = CausalAttention(8, 8, 16, num_heads=2).eval()
    seqs = [torch.randn(1, 3, 8), torch.randn(1, 7, 8)]
    k_buf, v_buf = torch.full((2, 2, CHUNK, 4), 1e4), torch.full((2, 2, CHUNK, 4), 1e4)  # unwritten: garbage
    for row, s in enumerate(seqs):
        kv = (k_buf[row : row + 1], v_buf[row : row + 1])
        attn(s[:, :-1], positions=torch.arange(s.shape[1] - 1)[None], kv=kv)
    last = torch.cat([s[:, -1:] for s in seqs])
    out = attn(last, positions=torch.tensor([[2], [6]]), kv=(k_buf, v_buf))
    for row, s in enumerate(seqs):
        assert torch.allclose(out[row], attn(s)[0, -1:], atol=1e-6), row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_decode_row_has_the_same_bits_over_any_span_and_beside_any_rows(dtype):
    # The arrangement the engine's promise rests on: in a call of a fixed row count, a row's decode
    # attention depends on that row alone, whatever the number of chunks read (set by the furthest row) and
    # whatever the other rows hold.
    torch.manual_seed(5)
    chunks = 4
    attn = CausalAttention(16, 16, chunks * CHUNK, num_heads=2).eval().to(dtype)
    x = torch.randn(3, 1, 16).to(dtype)
    for position in (0, 5, CHUNK - 1, CHUNK, 2 * CHUNK + 7):
        outs = []
        for trial, span in enumerate(range((position // CHUNK + 1) * CHUNK, chunks * CHUNK + 1, CHUNK)):
            k_buf = torch.randn(3, 2, chunks * CHUNK, 8).to(dtype) * (trial + 1)  # other rows: anything
            v_buf = torch.randn(3, 2, chunks * CHUNK, 8).to(dtype) * (trial + 1)
            torch.manual_seed(position)  # row 0: the same keys and values every time
            k_buf[0], v_buf[0] = torch.randn(2, 2, chunks * CHUNK, 8).to(dtype)
            k_buf[0, :, position + 1 :] = 0  # past the row's position: as the engine keeps it (cleared)
            v_buf[0, :, position + 1 :] = 0
            inputs = torch.cat([x[:1], torch.randn(2, 1, 16).to(dtype)])
            positions = torch.tensor([[position], [span - 1], [trial]])
            outs.append(attn(inputs, positions=positions, kv=(k_buf, v_buf), span=span)[0])
        assert len(outs) >= 2 or position >= 2 * CHUNK
        assert all(torch.equal(outs[0], out) for out in outs), position


def test_a_decode_step_reads_whole_chunks():
    attn = CausalAttention(8, 8, 100, num_heads=2).eval()
    kv = (torch.zeros(1, 2, 100, 4), torch.zeros(1, 2, 100, 4))
    with pytest.raises(ValueError, match=f"whole chunks of {CHUNK}"):
        attn(torch.randn(1, 1, 8), positions=torch.tensor([[3]]), kv=kv, span=100)


def test_dropout_only_in_training():
    torch.manual_seed(4)
    attn = CausalAttention(8, 8, 16, dropout=0.5, num_heads=2)
    x = torch.randn(1, 6, 8)
    attn.eval()
    assert torch.equal(attn(x), attn(x))
    attn.train()
    w = attn.attention_weights(x)
    assert (w == 0).sum() > (torch.ones(6, 6).triu(1) == 1).sum()  # some allowed weights were dropped


def test_errors_name_the_limit():
    with pytest.raises(ValueError, match=r"d_out \(10\) must be divisible by num_heads \(3\)"):
        CausalAttention(4, 10, 8, num_heads=3)
    attn = CausalAttention(4, 4, 8)
    with pytest.raises(ValueError, match="sequence of 9 positions exceeds this attention's context_length"):
        attn(torch.randn(1, 9, 4))
    with pytest.raises(ValueError, match="attention over a KV cache needs the positions"):
        attn(torch.randn(1, 3, 4), kv=(torch.zeros(1, 1, 8, 4), torch.zeros(1, 1, 8, 4)))


def test_a_long_window_keeps_a_bounded_mask_and_builds_longer_ones_per_call(monkeypatch):
    # A model of many positions must not hold an n_positions-squared mask (40,000 positions: 1.6 GB).
    import model.attention as attention

    monkeypatch.setattr(attention, "MASK_BUFFER_POSITIONS", 8)
    torch.manual_seed(0)
    attn = CausalAttention(16, 16, context_length=20, dropout=0.0, num_heads=2).eval()
    assert attn.mask.shape == (8, 8)
    x = torch.randn(2, 20, 16)
    with torch.no_grad():
        weights = attn.attention_weights(x)  # 20 positions: past the kept mask
        out = attn(x)
    above = torch.ones(20, 20, dtype=torch.bool).triu(1)
    assert (weights[:, :, above] == 0).all() and torch.allclose(weights.sum(-1), torch.ones(2, 2, 20))
    monkeypatch.setattr(attention, "MASK_BUFFER_POSITIONS", 2048)
    whole = CausalAttention(16, 16, context_length=20, dropout=0.0, num_heads=2).eval()
    whole.load_state_dict(attn.state_dict())
    with torch.no_grad():
        assert torch.equal(whole(x), out)  # the same arithmetic as with the whole mask kept
