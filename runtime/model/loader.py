"""Load a model at an exact revision: a Hugging Face directory or a GGUF file.

**Revision.** The revision is a sha256 hex digest of the weights (:func:`compute_revision`):

- GGUF file: the sha256 of the file (``sha256sum model.gguf``);
- Hugging Face directory: the sha256 of a manifest listing every ``*.safetensors`` file in the
  directory, sorted by file name, one line each in ``sha256sum`` format
  (``"<sha256 hex>  <file name>\\n"``); reproducible with
  ``cd DIR && sha256sum *.safetensors | LC_ALL=C sort -k2 | sha256sum``.

Config and tokenizer files are not part of the revision: it names the weights.

**Formats.** Directories are read with ``safetensors`` (config.json for the architecture,
``transformers`` for the tokenizer); GGUF files with gguf-py's ``GGUFReader`` and its
``dequantize`` (every type gguf.quants supports: F32, F16, BF16, Q4_0/Q4_1/Q5_x/Q8_0, K-quants...),
the tokenizer and chat template coming from the GGUF metadata. llama.cpp's converter permutes the
rows of Q and K for the ``llama`` architecture (interleaved-pair RoPE); we undo that permutation
so the weights match the Hugging Face rotate-half convention our model uses.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .llama import LlamaForCausalLM
from .parallel import ParallelLayout, TensorParallel, shard_config, shard_weights
from .config import ConfigError, ModelConfig, UnsupportedConfigError, gguf_metadata
from .tokenizer import Tokenizer, TokenizerError

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""Model dtypes by name (the ``--dtype`` values)."""


class ModelLoadError(RuntimeError):
    """The model could not be loaded; the message says what was wrong and with which path/value."""


class RevisionMismatchError(ModelLoadError):
    """The weights on disk do not have the requested revision."""

    def __init__(self, path: Path, expected: str, actual: str) -> None:
        super().__init__(
            f"revision mismatch for {path}: expected {expected}, found {actual} on disk "
            "(the revision is the sha256 of the weights; see graphserving.runtime.model.loader)"
        )
        self.path, self.expected, self.actual = path, expected, actual


class UnsupportedArchitectureError(ModelLoadError):
    """The model's architecture (or a feature of it) is not implemented by our model."""


@dataclass
class LoadedModel:
    """A model ready to serve.

    Attributes:
        model: our :class:`LlamaForCausalLM`, weights loaded, in eval mode.
        config: its architecture (``eos_token_ids`` merged with the tokenizer's).
        tokenizer: the matching tokenizer and chat template.
        revision: sha256 hex of the weights (:func:`compute_revision`).
        name: served model name (the file stem for GGUF, the directory name otherwise).
        path: the file or directory loaded.
        timings: seconds spent per load phase (``revision``: hashing, ``metadata``: parsing the GGUF
            header, ``weights``: reading, dequantising and copying, ``tokenizer``), for the
            worker's phase report.
    """

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    revision: str
    name: str
    path: Path
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        """Parameter dtype."""
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        """Where the parameters live."""
        return self.model.embed_tokens.device


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A supported model dtype from a ``torch.dtype`` or its name (``"float32"``, ``"bfloat16"``, ``"float16"``).

    Raises:
        ModelLoadError: any other value.
    """
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ModelLoadError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _weight_files(directory: Path) -> list[Path]:
    return sorted((p for p in directory.glob("*.safetensors") if p.is_file()), key=lambda p: p.name)


def revision_manifest(directory: str | Path) -> str:
    """The manifest whose sha256 is a directory's revision: ``"<sha256>  <name>\\n"`` per ``*.safetensors`` file, by name.

    Raises:
        ModelLoadError: the directory has no ``*.safetensors`` file.
    """
    directory = Path(directory)
    files = _weight_files(directory)
    if not files:
        raise ModelLoadError(f"model directory {directory} has no *.safetensors weights file")
    return "".join(f"{_sha256_file(p)}  {p.name}\n" for p in files)


def compute_revision(path: str | Path) -> str:
    """The revision (sha256 hex) of a GGUF file or a Hugging Face directory (see the module docstring).

    Raises:
        ModelLoadError: the path does not exist or has no weights.
    """
    path = Path(path)
    if path.is_file():
        return _sha256_file(path)
    if path.is_dir():
        return hashlib.sha256(revision_manifest(path).encode()).hexdigest()
    raise ModelLoadError(f"model path {path} does not exist")


def _normalise_revision(revision: str) -> str:
    return revision.strip().lower().removeprefix("sha256:")


def load_model(
    path: str | Path,
    revision: str | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    parallel: TensorParallel | None = None,
) -> LoadedModel:
    """Load a model, checking its revision first.

    Args:
        path: a ``.gguf`` file, or a directory with ``config.json`` and ``*.safetensors``.
        revision: expected sha256 hex (optionally prefixed ``sha256:``); ``None`` skips the check.
        dtype: parameter dtype (float32, bfloat16, float16); weights are converted at load.
        device: where to place the model.
        max_positions: rows of the RoPE tables (default: the model's ``max_model_len``).
        parallel: load this rank's share of a tensor-parallel model (runtime/model/parallel.py):
            the returned config is the rank's sharded one, the weights its shards.

    Returns:
        The :class:`LoadedModel`.

    Raises:
        ModelLoadError: missing path, unreadable files, missing weights, an unsupported dtype.
        RevisionMismatchError: the weights' revision differs from ``revision`` (both in the message).
        UnsupportedArchitectureError: an architecture or feature our model does not implement.
    """
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    dtype = parse_dtype(dtype)
    is_gguf = path.is_file() and _is_gguf(path)
    if not is_gguf and not (path.is_dir() and (path / "config.json").is_file()):
        raise ModelLoadError(
            f"model path {path} is neither a GGUF file nor a directory with config.json and *.safetensors"
        )
    timings: dict[str, float] = {}
    start = time.perf_counter()
    actual = compute_revision(path)
    timings["revision"] = time.perf_counter() - start
    if revision is not None and _normalise_revision(revision) != actual:
        raise RevisionMismatchError(path, revision, actual)

    try:
        if is_gguf:
            model, config, tokenizer = _load_gguf(path, dtype, device, max_positions, timings, actual, parallel)
            name = path.stem
        else:
            model, config, tokenizer = _load_hf_dir(path, dtype, device, max_positions, timings, parallel)
            name = path.name
    except UnsupportedConfigError as exc:
        raise UnsupportedArchitectureError(f"{path}: {exc}") from exc
    except (ConfigError, TokenizerError) as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    model.eval()
    log.info("loaded %s (revision %s, %s) in %s", path, actual[:12], dtype,
             ", ".join(f"{phase} {seconds:.2f}s" for phase, seconds in timings.items()))
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, revision=actual, name=name, path=path,
                       timings=timings)


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def _merge_eos(config: ModelConfig, tokenizer: Tokenizer) -> tuple[ModelConfig, Tokenizer]:
    """One set of end-of-sequence ids for both: the config's, then the tokenizer's."""
    eos = list(config.eos_token_ids)
    for token_id in tokenizer.eos_token_ids:
        if token_id not in eos:
            eos.append(token_id)
    tokenizer.eos_token_ids = tuple(eos)
    if config.bos_token_id is not None:
        tokenizer.bos_token_id = config.bos_token_id
    return dataclasses.replace(config, eos_token_ids=tuple(eos)), tokenizer


# ---------------------------------------------------------------------- Hugging Face directory

def _load_hf_dir(
    path: Path, dtype: torch.dtype, device: torch.device | str, max_positions: int | None, timings: dict[str, float],
    parallel: TensorParallel | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig, Tokenizer]:
    start = time.perf_counter()
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {exc}") from exc
    config = ModelConfig.from_hf_config(raw)
    generation = path / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        extra = eos if isinstance(eos, list) else [eos] if eos is not None else []
        merged = tuple(dict.fromkeys([*config.eos_token_ids, *(int(e) for e in extra)]))
        config = dataclasses.replace(config, eos_token_ids=merged)

    layout = parallel.layout if parallel is not None else ParallelLayout()
    model = LlamaForCausalLM(shard_config(config, layout), dtype=dtype, device=device, max_positions=max_positions,
                             parallel=parallel)
    try:
        model.load_weights(shard_weights(_iter_safetensors(path), layout))
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"{path}: {exc.args[0] if exc.args else exc}") from exc
    timings["weights"] = time.perf_counter() - start
    start = time.perf_counter()
    tokenizer = Tokenizer.from_hf_dir(path)
    timings["tokenizer"] = time.perf_counter() - start
    config, tokenizer = _merge_eos(config, tokenizer)
    config = model.config = shard_config(config, layout)
    return model, config, tokenizer


def _iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for file in _weight_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as exc:
            raise ModelLoadError(f"cannot read safetensors file {file}: {exc}") from exc


# ---------------------------------------------------------------------- GGUF

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
}

_GGUF_EXPERT_NAMES = {
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
"""llama.cpp's stacked expert tensors ([E, rows, cols]) and the stacked names
``LlamaForCausalLM.load_weights`` takes for them."""


def gguf_to_hf_name(name: str) -> str | None:
    """The Hugging Face weight name of a GGUF tensor name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); ``None`` for tensors that are not weights
    of our model (e.g. ``rope_freqs.weight``)."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_EXPERT_NAMES and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{_GGUF_EXPERT_NAMES[parts[2]]}"
    return None


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation for the ``llama`` architecture.

    llama.cpp's converter reorders each head's rows from the rotate-half layout ``[2, D/2]`` to
    interleaved pairs ``[D/2, 2]`` (its ``permute`` in convert_hf_to_gguf.py). This is the inverse:
    rows ``[heads, D/2, 2]`` -> ``[heads, 2, D/2]``. Works for weights [rows, H] and biases [rows].
    """
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _load_gguf(
    path: Path, dtype: torch.dtype, device: torch.device | str, max_positions: int | None, timings: dict[str, float],
    revision: str, parallel: TensorParallel | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig, Tokenizer]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    start = time.perf_counter()
    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError, KeyError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    config = ModelConfig.from_gguf(reader)
    timings["metadata"] = time.perf_counter() - start
    start = time.perf_counter()
    permuted = config.architecture == "llama"  # llama.cpp permutes Q/K only for its llama arch

    def tensor(t) -> torch.Tensor:
        try:
            array = dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise UnsupportedArchitectureError(
                f"GGUF tensor {t.name} has type {t.tensor_type.name}, which gguf.quants cannot dequantize"
            ) from exc
        shape = tuple(int(n) for n in reversed(t.shape))
        if not array.flags.writeable:  # unquantised tensors are views of the read-only file map
            array = array.copy()
        return torch.from_numpy(array.reshape(shape))

    freq_factors = None
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            freq_factors = tensor(t)
    layout = parallel.layout if parallel is not None else ParallelLayout()
    model = LlamaForCausalLM(shard_config(config, layout), dtype=dtype, device=device, max_positions=max_positions,
                             rope_freq_factors=freq_factors, parallel=parallel)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for t in reader.tensors:
            name = gguf_to_hf_name(t.name)
            if name is None:
                if t.name != "rope_freqs.weight":
                    log.warning("ignoring GGUF tensor %s", t.name)
                continue
            value = tensor(t)
            if permuted and ".attn_q." in t.name:
                value = unpermute_rope_rows(value, config.num_attention_heads)
            elif permuted and ".attn_k." in t.name:
                value = unpermute_rope_rows(value, config.num_key_value_heads)
            yield name, value

    try:
        model.load_weights(shard_weights(weights(), layout))
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"{path}: {exc.args[0] if exc.args else exc}") from exc
    timings["weights"] = time.perf_counter() - start
    start = time.perf_counter()
    tokenizer = _cached_gguf_tokenizer(path, gguf_metadata(reader), revision)
    timings["tokenizer"] = time.perf_counter() - start
    config, tokenizer = _merge_eos(config, tokenizer)
    config = model.config = shard_config(config, layout)
    return model, config, tokenizer


CACHE_DIR_ENV = "GRAPHSERVING_CACHE_DIR"
"""Where converted GGUF tokenizers are cached (default ``~/.cache/graphserving``); empty disables."""


def tokenizer_cache_dir(revision: str, environ: dict[str, str] | None = None) -> Path | None:
    """The cache directory of a GGUF file's converted tokenizer, or None when caching is off.

    Keyed by the file's sha256 (its revision) and the transformers version that converted it, so a
    changed file or converter never reuses a stale tokenizer.
    """
    import transformers

    environ = os.environ if environ is None else environ
    root = environ.get(CACHE_DIR_ENV, str(Path.home() / ".cache" / "graphserving"))
    if not root:
        return None
    return Path(root) / "tokenizers" / f"{revision}-transformers-{transformers.__version__}"


def _cached_gguf_tokenizer(path: Path, metadata: dict, revision: str) -> Tokenizer:
    """:func:`_gguf_tokenizer`, through a cache of the converted tokenizer (``save_pretrained``
    files): converting a GGUF vocabulary takes seconds, loading the saved fast tokenizer a fraction
    of that. The cache is best effort: an unreadable or unwritable one only costs the conversion."""
    from transformers import PreTrainedTokenizerFast

    chat_template = metadata.get("tokenizer.chat_template")
    cache = tokenizer_cache_dir(revision)
    if cache is not None and (cache / "tokenizer.json").is_file():
        try:
            return Tokenizer(PreTrainedTokenizerFast.from_pretrained(str(cache), local_files_only=True),
                             chat_template=chat_template)
        except (OSError, ValueError, TypeError) as exc:
            log.warning("ignoring the cached tokenizer in %s: %s", cache, exc)
    tokenizer = _gguf_tokenizer(path, metadata)
    if cache is not None:
        staging = None
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=cache.parent))
            tokenizer.hf_tokenizer.save_pretrained(str(staging))
            os.replace(staging, cache)  # atomic: readers see all of it or none
        except OSError as exc:  # read-only home, a concurrent writer won: not worth failing a load
            log.info("tokenizer not cached in %s: %s", cache, exc)
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


def _gguf_tokenizer(path: Path, metadata: dict) -> Tokenizer:
    """The tokenizer of a GGUF file, converted by transformers from the file's ``tokenizer.*`` metadata.

    Uses transformers' GGUF tokenizer converter directly (its metadata reader skips the tensor
    data), falling back to the public ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``,
    which re-reads the whole file, if that module layout is not available.
    """
    chat_template = metadata.get("tokenizer.chat_template")
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError:
        return Tokenizer.from_gguf(path, chat_template=chat_template)
    try:
        architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
        backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
        hf = PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)
    except (KeyError, ValueError, TypeError) as exc:
        raise TokenizerError(f"cannot build a tokenizer from GGUF file {path}: {exc}") from exc
    return Tokenizer(hf, chat_template=chat_template)
