"""GPT: the GPT-2 decoder (embeddings, pre-LayerNorm blocks, tied output head), named like its checkpoints."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from model.attention import CausalAttention
from model.cache import KVCache
from model.config import GPTConfig
from model.linear import Linear, TiedEmbedding


def _activation(name: str) -> nn.Module:
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return nn.GELU(approximate="tanh")
    if name == "gelu":
        return nn.GELU()
    if name == "relu":
        return nn.ReLU()
    return nn.SiLU()  # "silu" / "swish"; GPTConfig has rejected anything else


class MLP(nn.Module):
    """The position-wise feed-forward layer: ``c_fc``, activation, ``c_proj``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = Linear(config.n_embd, config.inner_dim)
        self.act = _activation(config.activation_function)
        self.c_proj = Linear(config.inner_dim, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalAttention(
            config.n_embd,
            config.n_embd,
            config.n_positions,
            dropout=config.attn_pdrop,
            num_heads=config.n_head,
            qkv_bias=True,
        )
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def forward(
        self,
        x: torch.Tensor,
        *,
        offset: int,
        key_padding_mask: torch.Tensor | None,
        kv: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        a = self.attn(self.ln_1(x), offset=offset, key_padding_mask=key_padding_mask, kv=kv)
        x = x + self.resid_dropout(a)
        return x + self.resid_dropout(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    """A GPT-2-family language model.

    Submodules carry the checkpoint's names (``wte``, ``wpe``, ``h.N.attn.c_attn``, ``ln_f``...), so a
    Hugging Face GPT-2 state dict maps onto it by dropping the ``transformer.`` prefix and transposing the
    four Conv1D weights. The output head is the token embedding matrix (tied), so there is no ``lm_head``.

    Args:
        config: the model's hyperparameters.

    Example:
        >>> model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=100, n_positions=32))
        >>> model(torch.tensor([[1, 2, 3]])).shape
        torch.Size([1, 3, 100])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        # Built on the meta device (shapes only: checkpoints.load then reads every weight), nothing is
        # initialised: a meta normal_ runs a Python reference that imports torch._dynamo and sympy, 75 MB
        # resident for the rest of the process. Given a weight, nn.Embedding skips its initialiser.
        shapes_only = torch.empty(()).is_meta

        def weight(rows: int) -> torch.Tensor | None:
            return torch.empty(rows, config.n_embd) if shapes_only else None

        self.wte = TiedEmbedding(config.vocab_size, config.n_embd, _weight=weight(config.vocab_size))
        self.wpe = nn.Embedding(config.n_positions, config.n_embd, _weight=weight(config.n_positions))
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self._share_causal_mask()
        if shapes_only:
            return
        self.apply(self._init_weights)
        # GPT-2's scaled init: each residual projection is divided by sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def _share_causal_mask(self) -> None:
        # Every layer slices the same (n_positions, n_positions) mask: hold one tensor, not n_layer copies
        # (12 MiB for GPT-2 124M, 48 MiB for 1.5B).
        mask = self.h[0].attn.mask
        for block in self.h[1:]:
            block.attn.mask = mask

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> GPT:
        super()._apply(fn, recurse)  # .to() converts each layer's buffer on its own: share one again
        self._share_causal_mask()
        return self

    def reset_buffers(self) -> None:
        """Rebuild the non-persistent buffers (the causal mask, shared by every layer), e.g. after
        ``to_empty``."""
        self.h[0].attn.reset_buffers()
        self._share_causal_mask()

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Compute next-token logits.

        Args:
            input_ids: token ids, (B, T).
            cache: a :class:`KVCache` holding ``cache.length`` earlier positions; the new positions are
                appended and ``cache.length`` advances by ``T``. Without one, this is the plain
                full-sequence causal forward.
            attention_mask: (B, cache.length + T), 1 for real tokens and 0 for (left) padding, covering the
                cached positions and the new ones. Positions then count from each row's first real token.
            last_only: compute logits for the last position only (what generation needs).

        Returns:
            Logits of shape (B, T, vocab_size), or (B, 1, vocab_size) with ``last_only``.

        Raises:
            ValueError: if the positions exceed ``n_positions`` or the cache, or shapes disagree.
        """
        b, t = input_ids.shape
        offset = 0 if cache is None else cache.length
        end = offset + t
        if t == 0:
            raise ValueError("input_ids has no positions; pass at least one token per row")
        if end > self.config.n_positions:
            raise ValueError(
                f"{end} positions exceed the model's context window n_positions={self.config.n_positions}; "
                f"shorten the input to at most {self.config.n_positions - offset} tokens"
            )
        if cache is not None and cache.batch_size != b:
            raise ValueError(f"cache was allocated for batch size {cache.batch_size}, input has {b} rows")
        if attention_mask is None:
            key_padding_mask = None
            positions = torch.arange(offset, end, device=input_ids.device)[None, :]  # (1, T)
        else:
            if tuple(attention_mask.shape) != (b, end):
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(b, end)}: one "
                    f"entry per cached ({offset}) and new ({t}) position of each row"
                )
            key_padding_mask = attention_mask.bool()
            # Position ids count from each row's first real token, so left padding does not shift them.
            positions = (key_padding_mask.long().cumsum(-1) - 1).clamp(min=0)[:, offset:]  # (B, T)
        x = self.drop(self.wte(input_ids) + self.wpe(positions))  # (B, T, C)
        for i, block in enumerate(self.h):
            kv = None if cache is None else cache.layer(i)
            x = block(x, offset=offset, key_padding_mask=key_padding_mask, kv=kv)
        if cache is not None:
            cache.length = end
        if last_only:
            x = x[:, -1:]
        return self.wte.project(self.ln_f(x))  # the tied output head, (B, T, V)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of activations and of the KV cache (bf16 for an int8-quantized model)."""
        return self.ln_f.weight.dtype

    @property
    def device(self) -> torch.device:
        """Where the model's tensors live."""
        return self.ln_f.weight.device

    def num_parameters(self) -> int:
        """Number of parameters (the tied head counted once)."""
        return sum(p.numel() for p in self.parameters())
