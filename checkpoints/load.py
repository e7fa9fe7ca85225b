"""Load a GPT from a checkpoint directory, a safetensors file, a shipped name or a Hugging Face hub id."""

from __future__ import annotations

import contextlib
import ctypes
import json
import numbers
import os
import re
from pathlib import Path

import torch

from checkpoints.errors import CheckpointError
from checkpoints.hf_config import read_config
from checkpoints.placement import resolve_device, resolve_dtype
from checkpoints.safetensors_io import (
    FILE_DTYPES,
    PREFIX,
    file_shape,
    iter_tensors,
    model_key,
    read_header,
    read_small_file,
)
from model import GPT, GPTConfig, int4
from model.config import PRESETS
from model.quant import COMPUTE_DTYPE, Int8TiedEmbedding, quantize_child, quantize_int8, quantize_rows

SHIPPED_DIR = Path(__file__).parent
SINGLE_FILE = "model.safetensors"
# The weight-only quantized dtype names: their bits, and whether each quantizes the output head (the tied
# embedding) too.
QUANT_MODES = {"int8": (8, True), "int8-body": (8, False), "int4": (4, True), "int4-body": (4, False)}
INT8_MODES = {name: head for name, (bits, head) in QUANT_MODES.items() if bits == 8}  # the older name
INDEX_FILE = "model.safetensors.index.json"
MAX_INDEX_BYTES = 16 * 2**20  # GPT-2 xl's index is about 30 KB


def shipped_names() -> list[str]:
    """Names of the checkpoints that ship inside the package (loadable by name)."""
    return sorted(p.parent.name for p in SHIPPED_DIR.glob(f"*/{'config.json'}"))


# A hub id is "name" or "owner/name"; anything else that does not exist is a missing local path.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def _is_hub_id(source: str) -> bool:
    return _HUB_ID.fullmatch(source) is not None and not source.endswith((".safetensors", ".json"))


def _shipped_list() -> str:
    return "shipped: " + (", ".join(shipped_names()) or "none")


def _from_hub(repo_id: str) -> Path:
    try:
        import huggingface_hub
    except ImportError as e:
        raise CheckpointError(
            f"{repo_id!r} is not an existing path or a shipped checkpoint ({_shipped_list()}); to fetch "
            "it as a Hugging Face hub id install the hf extra (pip install 'gptgen[hf]'), "
            "or pass a local directory"
        ) from e
    try:
        return Path(
            huggingface_hub.snapshot_download(
                repo_id, allow_patterns=["config.json", SINGLE_FILE, INDEX_FILE, "model-*.safetensors"]
            )
        )
    except Exception as e:  # the hub raises many types (network, auth, offline cache miss): report them all
        raise CheckpointError(
            f"{repo_id!r} is not an existing path or a shipped checkpoint ({_shipped_list()}), and the "
            f"Hugging Face hub and its local cache do not have it ({type(e).__name__}); download it where "
            "the hub is reachable and pass its local directory instead"
        ) from e


def _directory_files(directory: Path) -> list[Path]:
    single, index = directory / SINGLE_FILE, directory / INDEX_FILE
    if single.exists() and index.exists():
        raise CheckpointError(
            f"{directory} holds both {SINGLE_FILE} and {INDEX_FILE}; remove the one that is stale"
        )
    if single.exists():
        return [single]
    if index.exists():
        try:
            raw = json.loads(read_small_file(index, MAX_INDEX_BYTES, "a safetensors index").decode("utf-8"))
        except (OSError, ValueError, RecursionError) as e:  # (ValueError: not UTF-8 or not JSON)
            raise CheckpointError(f"{index} is not a valid safetensors index (JSON): {e}") from e
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if (
            not isinstance(weight_map, dict)
            or not weight_map
            or not all(isinstance(v, str) for v in weight_map.values())
        ):
            raise CheckpointError(
                f"{index} is not a valid safetensors index: it must be a JSON object whose weight_map maps "
                "tensor names to shard file names, naming at least one"
            )
        files = []
        for name in sorted(set(weight_map.values())):
            f = (
                directory / name
            )  # a shard must be a plain file name in this directory, never a path elsewhere
            if f.parent != directory or not f.name.endswith(".safetensors"):
                raise CheckpointError(f"{index} names shard {name!r}, which is not a .safetensors file here")
            try:
                present = f.exists()
            except (OSError, ValueError):  # a name too long for the file system, or with a NUL byte
                present = False
            if not present:
                raise CheckpointError(f"{index} names shard {name!r}, which is missing from {directory}")
            files.append(f)
        return files
    for link in (single, index):
        if link.is_symlink():  # (exists() follows it)
            raise CheckpointError(f"{link} is a link to nothing (its target is missing, or links back)")
    hint = (
        " (pytorch_model.bin is pickle, which gptgen never loads: convert it to safetensors)"
        if (directory / "pytorch_model.bin").exists()
        else ""
    )
    raise CheckpointError(f"{directory} has no {SINGLE_FILE} or {INDEX_FILE}{hint}")


def _resolve(source: str | os.PathLike[str], config: GPTConfig | str | None) -> tuple[GPTConfig, list[Path]]:
    if isinstance(source, str) and not source.strip():
        raise CheckpointError(
            "the checkpoint path is empty; give a directory, a .safetensors file or a shipped name "
            f"({_shipped_list()})"
        )
    path = Path(source).expanduser()
    if isinstance(source, str) and source in shipped_names():
        # A shipped name is the shipped checkpoint, even where the working directory has a folder of that
        # name (write ./name for the folder).
        path = SHIPPED_DIR / source
    elif not path.exists():
        name = str(source)
        if name in shipped_names():  # a Path("shakespeare") that is not here: the shipped one, as before
            path = SHIPPED_DIR / name
        elif _is_hub_id(name) and not Path(name.split("/")[0]).is_dir():  # "runs/x" is a local path
            path = _from_hub(name)
        else:
            raise CheckpointError(f"checkpoint path {name} does not exist")
    if path.is_dir():
        cfg = read_config(path / "config.json") if config is None else _config(config)
        return cfg, _directory_files(path)
    if path.name.endswith(".safetensors"):
        if config is None:
            if not (path.parent / "config.json").is_file():
                raise CheckpointError(
                    f"{path} has no config.json beside it; put the model's config.json there, or name "
                    "its config: --config in the commands, config= in Python (a config.json path, or a "
                    "preset such as 'gpt2')"
                )
            return read_config(path.parent / "config.json"), [path]
        return _config(config), [path]
    raise CheckpointError(f"{path} is neither a checkpoint directory nor a .safetensors file")


def _config(config: GPTConfig | str) -> GPTConfig:
    if isinstance(config, GPTConfig):
        return config
    if not str(config).strip():
        raise CheckpointError(
            "the config is empty; give a config.json path, a checkpoint directory or a preset name "
            f"({', '.join(PRESETS)})"
        )
    if isinstance(config, str) and config in PRESETS:  # a preset name, even beside a file of that name
        return GPTConfig.from_preset(config)  # (write ./gpt2 for the file)
    path = Path(config).expanduser()
    if path.is_dir():  # a checkpoint directory: its config.json
        return read_config(path / "config.json")
    if path.suffix == ".json" or path.exists() or os.sep in str(config):  # a path, even a wrong one
        return read_config(path)
    try:
        return GPTConfig.from_preset(config)
    except ValueError as e:
        raise CheckpointError(f"config={config!r}: {e}, or give a path to a config.json") from e


def _check_geometry(cfg: GPTConfig, headers: dict[Path, dict[str, dict]]) -> None:
    """Check the config's layer count and embedding shapes against the files' tensors (headers only).

    Building even a shapes-only model of ``n_layer`` 20,000 took 19 s and 900 MB before the weights could
    say it was wrong (2**70 never ended). (Fewer layers than the file holds is left to :func:`_plan`, which
    names the unexpected keys.)
    """
    files = list(headers)
    tensors: dict[str, tuple[Path, str, tuple[int, ...]]] = {}  # our name -> (file, file key, shape)
    for path, header in headers.items():
        for key, info in header.items():
            tensors[key.removeprefix(PREFIX)] = (path, key, tuple(info.get("shape", ())))
    layers = {int(m.group(1)) for name in tensors if (m := re.match(r"h\.(\d+)\.", name))}
    held = max(layers) + 1 if layers else 0
    if cfg.n_layer > held:
        raise CheckpointError(
            f"{files[0] if len(files) == 1 else files[0].parent}: the config says n_layer={cfg.n_layer} but "
            f"the weights hold {held} layers; the config.json does not describe these weights"
        )
    for name, want in (
        ("wte.weight", (cfg.vocab_size, cfg.n_embd)),
        ("wpe.weight", (cfg.n_positions, cfg.n_embd)),
    ):
        if name in tensors and tensors[name][2] != want:
            path, key, shape = tensors[name]
            raise CheckpointError(
                f"{path}: tensor {key} has shape {shape} but the config implies {want}; the config.json does "
                "not describe these weights"
            )


def _plan(model: GPT, headers: dict[Path, dict[str, dict]]) -> dict[Path, dict[str, str]]:
    """Check every file's keys, shapes and dtypes against the model before reading any weights."""
    expected = dict(model.named_parameters())
    plan: dict[Path, dict[str, str]] = {}
    found: set[str] = set()
    unexpected: list[str] = []
    files = list(headers)
    for path, header in headers.items():
        plan[path] = {}
        for file_key, info in header.items():
            name = model_key(file_key)
            if file_key.removeprefix(PREFIX) == "lm_head.weight":  # not read (tied to wte), but must fit it
                want = tuple(expected["wte.weight"].shape)
                if tuple(info.get("shape", ())) != want:
                    raise CheckpointError(
                        f"{path}: tensor {file_key} has shape {tuple(info.get('shape', ()))} but the "
                        f"output head is tied to wte, {want}; the config.json does not describe these weights"
                    )
            if name is None:
                continue
            if name not in expected:
                unexpected.append(file_key)
                continue
            if info.get("dtype") not in FILE_DTYPES:
                raise CheckpointError(
                    f"{path}: tensor {file_key} has dtype {info.get('dtype')!r}; "
                    f"supported weight dtypes are {', '.join(FILE_DTYPES)}"
                )
            want = file_shape(name, tuple(expected[name].shape))
            if tuple(info.get("shape", ())) != want:
                raise CheckpointError(
                    f"{path}: tensor {file_key} has shape {tuple(info.get('shape', ()))} but the config "
                    f"implies {want}; the config.json does not describe these weights"
                )
            if name in found:
                raise CheckpointError(
                    f"{path}: tensor {file_key} is {name}, which the checkpoint already holds (with or "
                    "without the 'transformer.' prefix, or in another shard); remove the duplicate"
                )
            plan[path][file_key] = name
            found.add(name)
    if unexpected:
        raise CheckpointError(
            f"{files[0].parent}: unexpected keys {sorted(unexpected)[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}; is this a GPT-2 checkpoint?"
        )
    missing = sorted(set(expected) - found)
    if missing:
        raise CheckpointError(
            f"{files[0].parent}: missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''} "
            f"({len(missing)} in all); the checkpoint is incomplete"
        )
    return plan


def _check_tied_head(headers: dict[Path, dict[str, dict]]) -> None:
    """A file's ``lm_head.weight`` must equal ``wte.weight``, bit for bit: the head is the tied embedding, so
    an untied head (one that differs) is refused, not dropped. Read a piece of each at a time."""
    where = {key.removeprefix(PREFIX): (path, key) for path, header in headers.items() for key in header}
    if "lm_head.weight" not in where or "wte.weight" not in where:
        return
    (head_path, head_key), (wte_path, wte_key) = where["lm_head.weight"], where["wte.weight"]
    untied = (f"{head_path}: tensor {head_key} differs from {wte_key}: an output head of its own, which this "
              "loader does not support (the head is the token embedding, tied as in GPT-2)")  # fmt: skip
    if headers[head_path][head_key]["dtype"] != headers[wte_path][wte_key]["dtype"]:
        raise CheckpointError(f"{untied}; they are even stored in different dtypes")
    heads, wtes = iter_tensors(head_path, {head_key: ""}), iter_tensors(wte_path, {wte_key: ""})
    for (_, index, head), (_, _, wte) in zip(heads, wtes, strict=True):  # (same shape and dtype: same pieces)
        if not torch.equal(head, wte):
            raise CheckpointError(f"{untied} (from row {index[0].start})")


def load(
    source: str | os.PathLike[str],
    *,
    config: GPTConfig | str | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    group_size: int | None = None,
    plain: bool = False,
) -> GPT:
    """Load a GPT-2-family checkpoint and return the model in eval mode.

    Args:
        source: a directory with ``config.json`` and ``model.safetensors`` (or a sharded
            ``model.safetensors.index.json``); a single ``.safetensors`` file (with a ``config.json`` beside
            it, or ``config=``); the name of a shipped checkpoint; or a Hugging Face hub id such as
            ``openai-community/gpt2`` (needs ``huggingface_hub`` and the hub or its local cache).
        config: a :class:`GPTConfig`, a preset name or a ``config.json`` path, overriding the directory's.
        device: where to put the model (default CPU).
        dtype: ``float32`` (default), ``bfloat16`` or ``float16``, as a torch dtype or a name; or
            ``"int8"``: int8 weights with per-row scales (output head included), bf16 activations; or
            ``"int8-body"``: the same with the tied embedding and output head kept in bf16; or ``"int4"`` /
            ``"int4-body"``: the same with 4-bit weights, one bf16 scale and zero per ``group_size`` weights.
        group_size: int4's group size, 32 (default), 64 or 128; only with ``"int4"`` and ``"int4-body"``.
        plain: keep every weight in its plain layout, (out, in) rows contiguous, which a compiled step of one
            row reads in place (``generate.load(..., compile=True)``); by default on the CPU the layouts its
            eager products of a few rows read faster (:func:`_lay_out_weights`, :func:`_lay_out_head`).

    Returns:
        The model, in eval mode, on ``device`` in ``dtype``.

    Raises:
        CheckpointError: (a ``ValueError``) if the checkpoint is missing, unreadable, not safetensors,
            truncated, or does not match its config; the message names the file, key or shape.
        ValueError: for an unsupported ``dtype`` or ``group_size``, or a device that is unknown, absent, or
            cannot compute in ``dtype``.

    Example:
        >>> model = load("shakespeare", dtype="bfloat16")  # doctest: +SKIP
    """
    # Weight-only int8/int4: linear layers read in fp32 and quantized, computed in bf16.
    bits, include_head = QUANT_MODES.get(dtype, (None, None)) if isinstance(dtype, str) else (None, None)
    quantize = bits is not None
    if group_size is not None and bits is None:
        resolve_dtype(dtype)  # an unknown dtype is reported as such, before its group size
    if group_size is not None and bits != 4:
        shown = dtype or "float32"
        raise ValueError(
            f"group_size={group_size!r} applies to dtype 'int4' or 'int4-body' only, not {shown!r}"
        )
    if bits == 4:
        group_size = int4.DEFAULT_GROUP_SIZE if group_size is None else group_size
        if isinstance(group_size, numbers.Integral) and not isinstance(group_size, bool):
            group_size = int(group_size)  # (a numpy integer too)
        int4.check_group_size(group_size)
    try:
        dtype = torch.float32 if quantize else resolve_dtype(dtype)
    except ValueError as e:
        modes = ", ".join(repr(m) for m in QUANT_MODES)
        raise ValueError(f"{e}, or the names {modes} (weight-only int8 and int4)") from None
    device = resolve_device(device, torch.bfloat16 if quantize else dtype)
    if bits == 4 and device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"int4 runs on the CPU and CUDA only (stock kernels), not {device.type}; use int8 or bfloat16"
        )
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"source={source!r} must be a checkpoint's path or name (a str or os.PathLike)")
    if config is not None and not isinstance(config, (GPTConfig, str, os.PathLike)):
        raise ValueError(f"config={config!r} must be a GPTConfig, a preset name or a config.json path")
    cfg, files = _resolve(source, config)
    headers = {path: read_header(path) for path in files}  # each file's header, checked against its size
    _check_geometry(cfg, headers)  # before any module is built: an absurd config would hang or exhaust memory
    with torch.device("meta"):  # shapes only: weights are allocated once, below, and filled in place
        model = GPT(cfg)
    plan = _plan(model, headers)
    _check_tied_head(headers)
    if bits == 4:
        widths = {m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)}
        int4.check_group_size(group_size, *sorted(widths | {cfg.n_embd}))  # before any weight is read
    model = model.to(dtype=dtype)  # still on meta: the layouts for dtype are fitted without memory
    if not quantize and device.type == "cpu" and not plain:
        _lay_out_weights(model)
    if quantize and not include_head:
        model.wte.to(COMPUTE_DTYPE)  # the head stays bf16: its pieces are cast as read, never held in fp32
    # Uninitialised memory on the device, strides kept: what to_empty does, but to_empty calls
    # torch.empty_like on meta tensors, whose first call imports sympy (36 MiB resident from then on).
    model._apply(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device))
    model.reset_buffers()
    if not quantize and dtype == torch.float32 and device.type == "cpu" and not plain:
        _lay_out_head(model)
    if quantize:
        put = _QuantLoad(model, device, bits=bits, include_head=include_head, group_size=group_size).put
    else:
        params = dict(model.named_parameters())

        def put(name: str, index: tuple[slice, ...], piece: torch.Tensor) -> None:
            params[name][index].copy_(piece)

    with torch.no_grad():
        for path, names in plan.items():
            for name, index, piece in iter_tensors(path, names):  # one piece (<= 16 MiB) at a time
                put(name, index, piece)
    if quantize:
        # What is left (nothing, normally) is quantized, and the rest cast to bf16.
        if bits == 4:
            model = int4.quantize_int4(model, group_size, include_head=include_head)
        else:
            model = quantize_int8(model, include_head=include_head)
    _release_freed_memory()  # the pieces read are freed, but the heap they grew stays resident without this
    return model.eval()


def _lay_out_weights(model: GPT) -> None:
    """Give each linear layer's weight (out, in) the memory layout of its transpose, (in, out), as GPT-2's
    files store it: on the CPU the BLAS's product of a few rows reads that layout faster (a decode step's
    products: about 25% at GPT-2 124M's sizes, fp32 and bf16) and many rows as fast. Only where the output
    width is a multiple of 16: there a row's result does not depend on its place among the rows (tested:
    a request alone equals it beside others, bit for bit); the tied head's odd width has products where it
    does (:func:`_lay_out_head`). A fixed rule, the same layout in every process."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.out_features % 16 == 0:
            weight = module.weight
            transposed = torch.empty(weight.shape[::-1], dtype=weight.dtype, device=weight.device)
            module.weight = torch.nn.Parameter(transposed.t(), requires_grad=weight.requires_grad)


def _lay_out_head(model: GPT) -> None:
    """In fp32, the tied head's weight (vocab, n_embd) as a view of an (n_embd, vocab padded to a multiple of
    16) matrix, zeros in the padding: the BLAS's product of a few rows reads that layout up to 2x faster
    than (vocab, n_embd) (bf16 as fast, fp16 slower, so they keep it), and over the padded width a row's
    logits do not depend on its place among the rows (:meth:`TiedEmbedding.project`)."""
    weight = model.wte.weight
    vocab, width = weight.shape
    padded = torch.zeros(width, -(-vocab // 16) * 16, dtype=weight.dtype, device=weight.device)
    model.wte.weight = torch.nn.Parameter(padded[:, :vocab].t(), requires_grad=weight.requires_grad)


class _QuantLoad:
    """Fills a model loaded with a quantized dtype (:data:`QUANT_MODES`) so that it never holds the whole
    fp32 model.

    Each layer is quantized as soon as all its tensors are read, and its fp32 copy dropped: a layer's fp32
    pages are written (made resident) only while it is read. With ``include_head`` the tied head is
    quantized row piece by row piece as it arrives (rows quantize independently: int8 has one scale a row,
    int4 its groups along the row), so its fp32 pages are never written; without, the model holds it in
    bf16 already and the pieces are cast into it.
    """

    HEAD = "wte.weight"

    def __init__(self, model: GPT, device: torch.device, *, bits: int, include_head: bool,
                 group_size: int | None) -> None:  # fmt: skip
        self.model, self.bits, self.group_size = model, bits, group_size
        self.quantized_head = self.HEAD if include_head else None  # the name quantized row piece by piece
        self.params = dict(model.named_parameters())  # the only references besides the model's own
        self.unread = {name: p.numel() for name, p in self.params.items()}  # elements not read yet
        if include_head:
            vocab, width = self.params[self.HEAD].shape
            if bits == 8:
                self.head = torch.empty(vocab, width, dtype=torch.int8, device=device)
                self.head_scale = torch.empty(vocab, dtype=COMPUTE_DTYPE, device=device)
            else:
                self.head = torch.empty(vocab, width // 2, dtype=torch.uint8, device=device)
                self.head_scale = torch.empty(
                    width // group_size, vocab, 2, dtype=COMPUTE_DTYPE, device=device
                )

    def put(self, name: str, index: tuple[slice, ...], piece: torch.Tensor) -> None:
        """Place one piece from :func:`iter_tensors`; quantize its layer once the layer is complete."""
        if name == self.quantized_head:
            piece = piece.to(self.head.device)
            if self.bits == 8:
                self.head[index], self.head_scale[index] = quantize_rows(piece)
            else:
                rows = index[0]
                self.head[rows], self.head_scale[:, rows] = int4.quantize_groups(piece, self.group_size)
        else:
            self.params[name][index].copy_(piece)
        self.unread[name] -= piece.numel()
        if self.unread[name] == 0:
            self._quantize_owner(name)

    def _quantize_owner(self, name: str) -> None:
        module_path = name.rpartition(".")[0]
        parent_path, _, child = module_path.rpartition(".")
        parent = self.model.get_submodule(parent_path)
        own = [f"{module_path}.{n}" for n, _ in getattr(parent, child).named_parameters()]
        if any(self.unread[n] for n in own):
            return
        if name == self.quantized_head:
            head = (Int8TiedEmbedding(self.head, self.head_scale) if self.bits == 8
                    else int4.Int4TiedEmbedding(self.head, self.head_scale, self.group_size))  # fmt: skip
            setattr(parent, child, head)
        elif not (
            quantize_child(parent, child, include_head=False)
            if self.bits == 8
            else int4.quantize_child_int4(parent, child, self.group_size, include_head=False)
        ):
            return
        for n in own:
            del self.params[n]
        _release_freed_memory()


def _release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc's ``malloc_trim``; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError, TypeError):  # not glibc: no malloc_trim
        ctypes.CDLL(None).malloc_trim(0)
