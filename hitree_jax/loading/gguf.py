"""GGUF (llama.cpp) weights of architecture `llama` (Llama, Mistral, a biased Llama), `qwen2`
and `qwen3`: `load_gguf` dequantizes into the run's dtype, `save_gguf` writes Q8_0 in the
architecture llama.cpp's converter would choose (`architecture`).

A tensor is dequantized only when the model takes it, a block of rows at a time, straight into
an array of the run's dtype (already transposed where the model wants [in, out]), which is
placed and dropped before the next: the host never holds the model, or a whole matrix, in
float32 (a 7B Q4 file once took 28 GB of it). docs/results/cpu/load_memory.py measures the peak.

For architecture `llama`, llama.cpp's converter permutes the rows of attn_q / attn_k from HF's
rotate-half RoPE layout into interleaved pairs; we undo that on load (and redo
it on save) so the model keeps a single (HF) RoPE layout while our files follow
llama.cpp's convention. Qwen2's and Qwen3's rows are written as HF has them (llama.cpp runs
their RoPE in the rotate-half, "NEOX", layout). A Qwen3 adds per-head q/k norms
(attn_q_norm, attn_k_norm) and its head width as `attention.key_length`. Parity with
transformers' own GGUF loading is tested in tests/test_smollm2.py (SmolLM2) and
tests/test_model_families.py (Qwen2, Qwen3).

Llama 3's `llama3` RoPE scaling has no GGUF key: llama.cpp writes it as the `rope_freqs` tensor
of per-frequency divisors, which `read_config` puts in config.rope_freq_factors (and `save_gguf`
writes for a llama3 config).

A draft with a reduced vocabulary (hitree_jax.vocab) stores its subset under
`hitree.vocab.*`; its token ids are draft ids. A copied tokenizer is always the
full target's, so when the config's bos/eos ids differ from the copied
`tokenizer.ggml.*` ones they go to `hitree.{bos,eos}_token_id` (-1: None).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from typing import Callable

import gguf
import numpy as np

from hitree_jax.errors import NotFound, UsageError
from hitree_jax.loading.hf import params_from_state_dict
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import rope_freq_factors
from hitree_jax.model.vocab import ReducedVocab

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}

# Metadata we read; tokenizer vocab arrays are skipped (the tokenizer module reads them).
_SKIPPED_PREFIX = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.merges", "hitree.vocab.target_ids")
_TOKENIZER_PREFIX = ("tokenizer.ggml.", "tokenizer.chat_template")
_VOCAB_IDS, _VOCAB_SIZE = "hitree.vocab.target_ids", "hitree.vocab.target_vocab_size"
_Q8_0 = gguf.GGMLQuantizationType.Q8_0
_VT = gguf.GGUFValueType


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's `permute`: interleaved RoPE rows -> rotate-half rows. w [out, in]."""
  out = w.shape[0]
  return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp's `permute` (convert_hf_to_gguf.py): rotate-half rows -> interleaved. w [out, in]."""
  out = w.shape[0]
  return w.reshape(n_heads, 2, out // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _scalar(field: gguf.ReaderField):
  value = field.contents()
  if field.types == [_VT.FLOAT32]:
    value = float(str(np.float32(value)))  # shortest float32 repr: 1e-05, not 9.99999974e-06
  return value


def open_reader(path: str | pathlib.Path) -> gguf.GGUFReader:
  """The file's GGUFReader, parsed once per process (and per file version).

  Parsing the header builds one numpy view per vocabulary string and merge
  (~150k for SmolLM2), several seconds; the config, the tokenizer and the
  weights all read the same file, so they share one reader (tensors stay
  memory-mapped, so keeping it costs no copy of the weights).
  """
  path = pathlib.Path(path).resolve()
  if not path.is_file():
    raise NotFound(f"GGUF file not found: {path}")
  stat = path.stat()
  return _open_reader(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_reader(path: str, size: int, mtime_ns: int) -> gguf.GGUFReader:
  del mtime_ns  # part of the cache key only: a rewritten file is parsed again
  try:
    reader = _PlainViewReader(path)
  except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError) as e:
    # gguf-py reads a cut file's missing bytes as short arrays and fails on their shapes
    raise UsageError(f"{path}: not a whole GGUF file ({size} bytes): {type(e).__name__}: {e}") from None
  end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
  if end > size:
    raise UsageError(f"{path}: not a whole GGUF file: its tensors end at byte {end}, the file at {size}")
  return reader


class _PlainViewReader(gguf.GGUFReader):
  """gguf's reader, slicing a plain ndarray view of its memory map instead of the np.memmap.

  Every slice of an np.memmap runs the subclass's Python hooks; the header's ~150k slices (one
  per vocabulary string and merge) took 2.1-2.6 s for SmolLM2, and 0.76 s over the plain view.
  The view shares the map's pages (nothing is copied), and the tensors come out as plain views.
  """

  def _get(self, offset, dtype, count=1, override_order=None):
    if type(self.data) is not np.ndarray:
      self.data = self.data.view(np.ndarray)
    return super()._get(offset, dtype, count, override_order)


def read_config(path: str | pathlib.Path, dtype: str = "float32") -> ModelConfig:
  """The model's config from the GGUF metadata (and `rope_freqs`, the one tensor that is config:
  a Llama 3's RoPE scaling, which llama.cpp stores as per-frequency factors and no key)."""
  reader = open_reader(path)
  tensors = {t.name: t for t in reader.tensors}
  meta = read_metadata(reader)
  try:
    config = ModelConfig.from_gguf_metadata(meta, dtype=dtype, tied="output.weight" not in tensors)
  except UsageError as e:
    raise UsageError(f"{path}: {e}") from None
  config = config.replace(qkv_bias="blk.0.attn_q.bias" in tensors,  # llama.cpp's optional
                          o_bias="blk.0.attn_output.bias" in tensors)  # attention biases
  if ROPE_FREQS in tensors:
    factors = gguf.quants.dequantize(tensors[ROPE_FREQS].data, tensors[ROPE_FREQS].tensor_type)
    try:
      config = config.replace(rope_freq_factors=tuple(np.asarray(factors, np.float64).ravel().tolist()))
    except UsageError as e:
      raise UsageError(f"{path}: {ROPE_FREQS}: {e}") from None
  return _own_token_ids(config, meta)


def read_metadata(reader: gguf.GGUFReader) -> dict:
  meta = {}
  for key, field in reader.fields.items():
    if key.startswith(_SKIPPED_PREFIX) or key.startswith("GGUF."):
      continue
    meta[key] = _scalar(field)
  return meta


ROPE_FREQS = "rope_freqs.weight"   # per-frequency RoPE factors: read into the config (read_config)


def hf_name(gguf_name: str) -> str | None:
  base, _, suffix = gguf_name.rpartition(".")  # suffix: weight / bias
  if base.startswith("blk."):
    _, layer, kind = base.split(".", 2)
    mapped = _LAYER_NAMES.get(kind)
    return mapped and f"model.layers.{layer}.{mapped}.{suffix}"
  mapped = _GLOBAL_NAMES.get(base)
  return mapped and f"{mapped}.{suffix}"


def read_vocab(path: str | pathlib.Path) -> ReducedVocab | None:
  """The draft's reduced vocabulary stored in the file, or None (the full vocabulary)."""
  reader = open_reader(path)
  if _VOCAB_IDS not in reader.fields:
    return None
  field = reader.fields[_VOCAB_IDS]
  ids = np.concatenate([field.parts[i] for i in field.data]).astype(np.int32)
  return ReducedVocab(ids, int(reader.fields[_VOCAB_SIZE].contents()))


def _own_token_ids(config: ModelConfig, meta: dict) -> ModelConfig:
  """The config's bos/eos when they differ from a copied tokenizer's (see module docstring)."""
  changes = {f"{k}_token_id": (None if meta[f"hitree.{k}_token_id"] < 0
                               else meta[f"hitree.{k}_token_id"])
             for k in ("bos", "eos") if f"hitree.{k}_token_id" in meta}
  return config.replace(**changes)


BLOCK_VALUES = 1 << 18   # values dequantized at a time (1 MB in float32)


@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
  """A GGUF tensor as params_from_state_dict takes it: its HF shape ([out, in]), dequantized by
  `array` only when taken. q/k (heads set) have llama.cpp's interleaved RoPE rows, undone per
  block of whole heads."""
  tensor: gguf.ReaderTensor
  heads: int | None = None

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(reversed([int(d) for d in self.tensor.shape]))   # ggml order -> [out, in]

  def array(self, dtype, transpose: bool = False) -> np.ndarray:
    """The tensor in `dtype` ([in, out] with transpose), built a block of rows at a time."""
    shape = self.shape
    rows, rest = shape[0], shape[1:]
    out = np.empty(shape[::-1] if transpose else shape, dtype)
    unit = rows // self.heads if self.heads else 1   # rows per head: a block holds whole heads
    step = unit * max(1, BLOCK_VALUES // (unit * max(1, int(np.prod(rest)))))
    for start in range(0, rows, step):
      block = gguf.quants.dequantize(self.tensor.data[start:start + step], self.tensor.tensor_type)
      block = np.asarray(block, np.float32).reshape(-1, *rest)
      if self.heads:
        block = unpermute_rope_rows(block, block.shape[0] // unit)
      if transpose:
        out[:, start:start + step] = block.T
      else:
        out[start:start + step] = block
    return out


def load_gguf(path: str | pathlib.Path, dtype: str = "float32", place: Callable | None = None):
  """(config, params, ReducedVocab or None) from a GGUF file (config.GGUF_ARCHITECTURES). Each
  tensor is dequantized into `dtype` when taken, and handed to `place` (e.g. to the device)
  before the next is made: QuantizedTensor."""
  reader = open_reader(path)
  config = read_config(path, dtype)
  vocab = read_vocab(path)
  if vocab is not None and vocab.size != config.vocab_size:
    raise UsageError(f"{path}: reduced vocabulary of {vocab.size} ids for a model of "
                     f"vocab_size={config.vocab_size}")
  unknown = [t.name for t in reader.tensors if hf_name(t.name) is None and t.name != ROPE_FREQS]
  if unknown:
    raise UsageError(f"{path}: {unknown[0]}: a tensor this model does not use"
                     + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
  permuted = reader.fields["general.architecture"].contents() == "llama"
  heads = lambda name: (None if not permuted else
                        config.num_heads if name.endswith(("q_proj.weight", "q_proj.bias")) else
                        config.num_kv_heads if name.endswith(("k_proj.weight", "k_proj.bias")) else None)
  state = {name: QuantizedTensor(tensor, heads(name)) for tensor in reader.tensors
           if (name := hf_name(tensor.name)) is not None}   # not ROPE_FREQS: it is in the config
  params = params_from_state_dict(state, config, source=str(path), dtype=dtype, place=place)
  return config, params, vocab


# ---- writing ----

def architecture(config: ModelConfig) -> str:
  """The GGUF architecture a model is written as, as llama.cpp's converter writes it: `qwen3`
  where it norms queries and keys per head, `qwen2` where q/k/v alone have biases, else `llama`
  (a Mistral; a Llama with attention biases keeps them as llama's optional tensors)."""
  if config.qk_norm:
    return "qwen3"
  return "qwen2" if config.qkv_bias and not config.o_bias else "llama"


def gguf_tensors(config: ModelConfig, params: dict) -> dict[str, np.ndarray]:
  """Our params -> llama.cpp tensor names, numpy [out, in] (ggml order reversed); for `llama`,
  q/k permuted; attention biases [out] (Qwen2's, a biased Llama's) as `.bias`, q/k's permuted like
  their rows (llama.cpp's convert_hf_to_gguf.py does the same); a Qwen3's q/k norms [head_dim]."""
  f32 = lambda x: np.asarray(x, np.float32)
  weight = lambda p: np.ascontiguousarray(f32(p["kernel"]).T)  # kernel [in, out] -> [out, in]
  out = {"token_embd.weight": f32(params["embed_tokens"]["embedding"]),
         "output_norm.weight": f32(params["norm"]["weight"])}
  if not config.tie_word_embeddings:
    out["output.weight"] = weight(params["lm_head"])
  factors = rope_freq_factors(config)
  if factors is not None:
    out[ROPE_FREQS] = factors
  hf_to_gguf = {v: k for k, v in _LAYER_NAMES.items()}
  permuted = architecture(config) == "llama"   # only llama's q/k rows are interleaved
  for i in range(config.num_layers):
    layer = params[f"layers_{i}"]
    for group in ("self_attn", "mlp"):
      for proj, p in layer[group].items():
        name = f"blk.{i}.{hf_to_gguf[f'{group}.{proj}']}"
        out[f"{name}.weight"] = f32(p["weight"]) if "weight" in p else weight(p)   # a norm, or a matrix
        if "bias" in p:
          out[f"{name}.bias"] = f32(p["bias"])
    for norm in ("input_layernorm", "post_attention_layernorm"):
      out[f"blk.{i}.{hf_to_gguf[norm]}.weight"] = f32(layer[norm]["weight"])
    for name, n_heads in (("attn_q", config.num_heads), ("attn_k", config.num_kv_heads)):
      for key in (f"blk.{i}.{name}.weight", f"blk.{i}.{name}.bias"):
        if key in out and permuted:
          out[key] = permute_rope_rows(out[key], n_heads)
  return out


def _add_tensor(writer: gguf.GGUFWriter, name: str, w: np.ndarray, quantize: bool) -> bool:
  """Q8_0 for matrices whose rows split into 32-blocks, else float32. True when quantized."""
  block = gguf.GGML_QUANT_SIZES[_Q8_0][0]
  if quantize and w.ndim == 2 and w.shape[-1] % block == 0:
    writer.add_tensor(name, gguf.quants.quantize(w, _Q8_0), raw_dtype=_Q8_0)  # uint8 [out, bytes]
    return True
  writer.add_tensor(name, np.ascontiguousarray(w, np.float32))
  return False


def _add_config(writer: gguf.GGUFWriter, config: ModelConfig) -> None:
  c = config
  writer.add_context_length(int(c.max_position_embeddings))
  writer.add_embedding_length(int(c.hidden_size))
  writer.add_block_count(int(c.num_layers))
  writer.add_feed_forward_length(int(c.intermediate_size))
  writer.add_head_count(int(c.num_heads))
  writer.add_head_count_kv(int(c.num_kv_heads))
  writer.add_rope_dimension_count(int(c.head_dim))
  if c.head_dim * c.num_heads != c.hidden_size:   # as llama.cpp's converter writes a head_dim
    writer.add_key_length(int(c.head_dim))
    writer.add_value_length(int(c.head_dim))
  writer.add_rope_freq_base(float(c.rope_theta))
  writer.add_layer_norm_rms_eps(float(c.rms_norm_eps))
  writer.add_vocab_size(int(c.vocab_size))
  scaling = config.rope_scaling_dict
  kind = scaling.get("rope_type", scaling.get("type"))
  if kind not in (None, "linear", "llama3") or (
      kind == "linear" and set(scaling) - {"rope_type", "type", "factor"}):
    raise NotImplementedError(f"a GGUF holds linear RoPE scaling (a key) and llama3's (the "
                              f"rope_freqs tensor), not {scaling}")
  if kind == "linear":
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(scaling["factor"])


def _field_value(field: gguf.ReaderField):
  """A reader field's raw value and (type, array item type) for GGUFWriter.add_key_value."""
  kind = field.types[0]
  if kind == _VT.ARRAY:
    item = field.types[1]
    if item == _VT.ARRAY:
      raise NotImplementedError(f"nested GGUF array {field.name}")
    if item == _VT.STRING:
      return [bytes(field.parts[i]) for i in field.data], kind, item  # bytes: no utf-8 round trip
    return np.concatenate([field.parts[i] for i in field.data]).tolist(), kind, item
  if kind == _VT.STRING:
    return bytes(field.parts[field.data[0]]), kind, None
  return field.parts[field.data[0]].tolist()[0], kind, None


def _copy_tokenizer(writer: gguf.GGUFWriter, source: pathlib.Path, n_vocab: int) -> dict:
  """Writes the tokenizer of `source` (a GGUF, or a Hugging Face folder with tokenizer.json) into
  the file; returns its bos/eos ids."""
  if source.is_dir():
    return _add_hf_tokenizer(writer, source, n_vocab)
  if source.suffix != ".gguf" or not source.is_file():
    raise UsageError(f"tokenizer_from={source}: expected an existing .gguf file or a folder with "
                     "tokenizer.json")
  fields = gguf.GGUFReader(str(source)).fields
  for key, field in fields.items():
    if key.startswith(_TOKENIZER_PREFIX):
      value, kind, item = _field_value(field)
      writer.add_key_value(key, value, kind, sub_type=item)
  return {k: fields[f"tokenizer.ggml.{k}_token_id"].contents()
          for k in ("bos", "eos") if f"tokenizer.ggml.{k}_token_id" in fields}


def _add_hf_tokenizer(writer: gguf.GGUFWriter, folder: pathlib.Path, n_vocab: int) -> dict:
  """A Hugging Face byte-level BPE tokenizer (Llama 3, SmolLM2, Qwen2, ...) as llama.cpp's
  converter writes it (convert_hf_to_gguf.py, `get_vocab_base`): every id up to the model's
  `n_vocab` rows, added special tokens as CONTROL, other added ones as USER_DEFINED, ids without
  a token as unused [PADi]; then its merges, special token ids and chat template with gguf's own
  reader (gguf.vocab.SpecialVocab). A sentencepiece tokenizer (Llama 2's) is not written here."""
  import transformers  # only here: loading weights needs no tokenizer library
  spec = json.loads((folder / "tokenizer.json").read_text())
  if spec["model"]["type"] != "BPE" or spec["model"].get("byte_fallback") or \
      (spec.get("decoder") or {}).get("type") != "ByteLevel":
    raise UsageError(f"the tokenizer in {folder} is not a byte-level BPE tokenizer.json, the only "
                     "kind written into a GGUF here; convert from a GGUF of the model instead")
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
  by_id = {i: token for token, i in tokenizer.get_vocab().items()}
  if len(by_id) > n_vocab:
    raise UsageError(f"the tokenizer in {folder} has {len(by_id)} tokens, the model {n_vocab} rows")
  added = tokenizer.added_tokens_decoder
  tokens, types = [], []
  for i in range(n_vocab):
    tokens.append(by_id.get(i, f"[PAD{i}]"))
    if i not in by_id:
      types.append(gguf.TokenType.UNUSED)
    elif i in added:
      types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
    else:
      types.append(gguf.TokenType.NORMAL)
  writer.add_tokenizer_model("gpt2")
  writer.add_token_list(tokens)
  writer.add_token_types(types)
  special = gguf.vocab.SpecialVocab(folder, load_merges=True, n_vocab=n_vocab)
  special.add_to_gguf(writer, quiet=True)
  return {k: special.special_token_ids[k] for k in ("bos", "eos") if k in special.special_token_ids}


def _add_token_ids(writer: gguf.GGUFWriter, config: ModelConfig, copied: dict | None) -> None:
  for k in ("bos", "eos"):
    value = getattr(config, f"{k}_token_id")
    if copied is None:
      if value is not None:
        writer.add_uint32(f"tokenizer.ggml.{k}_token_id", int(value))
    elif value != copied.get(k):
      writer.add_int32(f"hitree.{k}_token_id", -1 if value is None else int(value))


def save_gguf(path: str | pathlib.Path, config: ModelConfig, params: dict, *,
              vocab: ReducedVocab | None = None, tokenizer_from: str | pathlib.Path | None = None,
              quantize: bool = True) -> pathlib.Path:
  """Writes a GGUF of architecture `llama`, `qwen2` or `qwen3` (`architecture`) that
  llama.cpp's conventions and `load_gguf` accept.

  Matrices are Q8_0 (float32 with quantize=False, or when a row is not a multiple
  of 32 wide), norms float32. tokenizer_from: a GGUF whose tokenizer fields are copied, or a
  Hugging Face folder whose tokenizer.json is written (the full target's tokenizer, also for a
  reduced vocabulary).
  """
  path = pathlib.Path(path)
  if vocab is not None and vocab.size != config.vocab_size:
    raise UsageError(f"vocab has {vocab.size} ids but config.vocab_size={config.vocab_size}")
  writer = gguf.GGUFWriter(str(path), architecture(config))
  _add_config(writer, config)
  copied = (_copy_tokenizer(writer, pathlib.Path(tokenizer_from), vocab.target_vocab_size if vocab
                            else config.vocab_size) if tokenizer_from else None)
  _add_token_ids(writer, config, copied)
  if vocab is not None:
    writer.add_key_value(_VOCAB_IDS, vocab.target_ids.astype(np.int32).tolist(), _VT.ARRAY,
                         sub_type=_VT.INT32)
    writer.add_uint32(_VOCAB_SIZE, vocab.target_vocab_size)
  any_quantized = False
  for name, w in gguf_tensors(config, params).items():
    any_quantized |= _add_tensor(writer, name, w, quantize)
  writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if any_quantized else gguf.LlamaFileType.ALL_F32)
  writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path
