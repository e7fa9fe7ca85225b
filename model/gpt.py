"""GPT: the GPT-2 decoder (embeddings, pre-LayerNorm blocks, tied output head), named like its checkpoints."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import CHUNK, CausalAttention
from model.cache import KVCache
from model.config import GPTConfig

_ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU, "swish": nn.SiLU}


class TiedEmbedding(nn.Embedding):
    """The token embedding, which is also the output head."""

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``x @ weight.T``, (..., n_embd) -> (..., vocab_size); a weight ``checkpoints.load`` laid out
        as (n_embd, vocab padded to 16) is multiplied over its padded width (why: its ``_lay_out_head``)."""
        w = self.weight
        if w.stride(0) == 1:
            w = w.as_strided((w.stride(1), w.shape[1]), (1, w.stride(1)))
        return F.linear(x, w)[..., : self.num_embeddings]


class MLP(nn.Module):
    """The position-wise feed-forward layer: ``c_fc``, activation, ``c_proj``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        name = config.activation_function
        self.c_fc = nn.Linear(config.n_embd, config.inner_dim)
        self.act = _ACTIVATIONS[name]() if name in _ACTIVATIONS else nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(config.inner_dim, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalAttention(config.n_embd, config.n_embd, config.n_positions, config.attn_pdrop,
                                    config.n_head, qkv_bias=True)  # fmt: skip
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, x: torch.Tensor, **attend: Any) -> torch.Tensor:
        x = x + self.resid_dropout(self.attn(self.ln_1(x), **attend))
        return x + self.resid_dropout(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    """A GPT-2-family language model, its submodules named as in checkpoints (``wte``, ``h.N.attn.c_attn``):
    a Hugging Face GPT-2 state dict maps onto it without the ``transformer.`` prefix, its four Conv1D weights
    transposed. The head is the token embedding (tied): there is no ``lm_head``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        # On the meta device (shapes only: checkpoints.load reads every weight) nothing is initialised: a meta
        # normal_ imports torch._dynamo and sympy (75 MB). Given a weight, nn.Embedding skips its initialiser.
        shapes_only = torch.empty(()).is_meta
        wte = torch.empty(config.vocab_size, config.n_embd) if shapes_only else None
        wpe = torch.empty(config.n_positions, config.n_embd) if shapes_only else None
        self.wte = TiedEmbedding(config.vocab_size, config.n_embd, _weight=wte)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd, _weight=wpe)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self._share_causal_mask()
        if shapes_only:
            return
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():  # GPT-2's scaled init of each residual projection
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _share_causal_mask(self) -> None:
        mask = self.h[0].attn.mask  # every layer slices one mask, not n_layer copies (48 MiB for GPT-2 1.5B)
        for block in self.h[1:]:
            block.attn.mask = mask

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> GPT:
        to = fn(torch.empty(0, dtype=self.compute_dtype)).dtype  # (a quantized model's layers: no nn.Linear)
        if not isinstance(self.h[0].mlp.c_fc, nn.Linear) and to not in (self.compute_dtype, torch.bfloat16):
            raise ValueError(f"a quantized model computes in bf16, it cannot be converted to {to}; load its "
                             "checkpoint in that dtype (checkpoints.load(dtype=...))")  # fmt: skip
        super()._apply(fn, recurse)  # .to() converts each layer's buffer on its own: share one again
        self._share_causal_mask()
        return self

    def reset_buffers(self) -> None:
        """Rebuild the shared causal mask, e.g. after ``to_empty``."""
        self.h[0].attn.reset_buffers()
        self._share_causal_mask()

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        slot: int | None = None,
        span: int | None = None,
        last_only: bool = False,
        step: bool = False,
        embedded: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Next-token logits for ``input_ids`` (B, T): (B, T, vocab_size), or with ``last_only`` (B, 1, V).

        Without a cache, the full-sequence forward from position 0: the reference for every cached path. With
        one, row ``i`` writes its keys and values into slot ``i`` (a single row: into ``slot`` if given) at
        its ``positions`` (B, T), and each token attends to its row's cached positions up to its own (below
        ``span``, default ``cache.max_len``). A ``step`` (a few tokens per row, as speculation verifies; one
        per row always is one) attends as :meth:`model.CausalAttention.decode`, ``span`` in whole chunks.
        ``embedded``: the blocks' input (:meth:`embed` of these ids and positions), if already computed."""
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids has no positions; pass at least one token per row")
        if cache is None:
            if positions is not None or slot is not None or span is not None or embedded is not None:
                raise ValueError("positions, slot, span and embedded need a cache; pass cache= too")
            x = self._reference(input_ids)
        else:
            step = step or input_ids.shape[1] == 1
            span = self._check_cached(input_ids, positions, cache, slot, span)
            span = -(-span // CHUNK) * CHUNK if step else span
            want = (*input_ids.shape, self.config.n_embd)  # (the shape embedded must have, if given)
            if embedded is not None and tuple(embedded.shape) != want:
                raise ValueError(f"embedded has shape {tuple(embedded.shape)}; pass GPT.embed's, {want}")
            x = self.embed(input_ids, positions) if embedded is None else embedded
            for i, block in enumerate(self.h):
                x = block(x, positions=positions, kv=cache.layer(i, slot), span=span, step=step)
        return self.wte.project(self.ln_f(x[:, -1:] if last_only else x))  # the tied output head, (B, T, V)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The blocks' input: token plus position embeddings, (B, T) ids -> (B, T, n_embd)."""
        return self.drop(self.wte(input_ids) + self.wpe(positions))

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The reference forward up to the head, (B, T, n_embd): ``self.wte.project`` of it is the logits."""
        return self.ln_f(self._reference(input_ids))

    def attention_weights(self, input_ids: torch.Tensor, layers: Sequence[int] | None = None) -> torch.Tensor:
        """The reference forward's attention weights, (len(layers), B, n_head, T, T), every layer by default;
        only the layers asked for are kept (all of GPT-2 XL's at 1,024 tokens would be 4.8 GB)."""
        wanted = list(range(len(self.h))) if layers is None else [int(i) for i in layers]
        if any(not 0 <= i < len(self.h) for i in wanted):
            raise ValueError(f"layers {wanted} must be in 0..{len(self.h) - 1}")
        maps: dict[int, torch.Tensor] = {i: torch.empty(0) for i in wanted}  # filled in by the forward
        self._reference(input_ids, maps)
        return torch.stack([maps[i] for i in wanted])

    def _reference(
        self, input_ids: torch.Tensor, attention: dict[int, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The full-sequence forward up to ``ln_f``; fills ``attention`` with its keyed layers' weights."""
        t = input_ids.shape[1]
        if t == 0:
            raise ValueError("input_ids has no positions; pass at least one token per row")
        if t > self.config.n_positions:
            raise ValueError(f"{t} positions exceed the model's context window n_positions="
                             f"{self.config.n_positions}; shorten the input to at most "
                             f"{self.config.n_positions} tokens")  # fmt: skip
        x = self.embed(input_ids, torch.arange(t, device=input_ids.device)[None, :])  # positions (1, T)
        for i, block in enumerate(self.h):
            if attention is not None and i in attention:
                attention[i] = block.attn.attention_weights(block.ln_1(x))
            x = block(x)
        return x

    @staticmethod
    def _check_cached(
        ids: torch.Tensor, positions: torch.Tensor | None, cache: KVCache, slot: int | None, span: int | None
    ) -> int:
        """Check a cached call's shapes (and, outside a compiled graph, its positions); return its span."""
        b, t = ids.shape
        shape = None if positions is None else tuple(positions.shape)
        if shape != (b, t):
            raise ValueError(f"cached forward needs positions of shape {(b, t)}, one per token; got {shape}")
        if slot is None and b != cache.slots:
            raise ValueError(f"the cache has {cache.slots} slots but the input has {b} rows; pass one row "
                             "per slot, or one row with slot=")  # fmt: skip
        if slot is not None and (b != 1 or not 0 <= slot < cache.slots):
            raise ValueError(f"slot={slot} needs one row and a slot in 0..{cache.slots - 1}; got {b} rows")
        span = cache.max_len if span is None else span
        if not 0 < span <= cache.max_len:
            raise ValueError(f"span={span} must be in 1..{cache.max_len} (the cache's max_len)")
        if not torch.compiler.is_compiling():
            low, high = int(positions.min()), int(positions.max())
            if low < 0 or high >= span:
                raise ValueError(f"position {high if high >= span else low} is outside 0..{span - 1}, the "
                                 f"cache positions attention reads (KV cache of {cache.max_len} positions, "
                                 f"span {span}); allocate a larger cache or shorten the input")  # fmt: skip
        return span

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of activations and of the KV cache (bf16 for an int8- or int4-quantized model)."""
        return self.ln_f.weight.dtype

    @property
    def device(self) -> torch.device:
        """Where the model's tensors live."""
        return self.ln_f.weight.device

    def num_parameters(self) -> int:
        """Number of parameters (the tied head counted once), quantized or not (its weights are buffers)."""
        with torch.device("meta"):  # (shapes only: the unquantized model of this config)
            return sum(p.numel() for p in GPT(self.config).parameters())
