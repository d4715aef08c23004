"""Writes a GGUF file with a real model's shapes, random weights and a synthetic vocabulary.

Benchmarks need Llama-2-7B-sized files on machines that cannot download one. The file is a
valid GGUF that `model.loader.load_model` (and llama.cpp) can load: the real architecture
metadata, every tensor in the type llama.cpp's quantizer would pick (`tensor_types`), and a
tokenizer of the right kind and size. Weights are random bytes written in bulk, with each
block's scale fields overwritten so that every matrix has a standard deviation near
1/sqrt(in_features): activations stay finite through all layers. The text is meaningless.

    python bench/make_synthetic_gguf.py --shape llama2-7b --quant q4_0 --out /tmp/llama2-7b-q4_0.gguf

Shapes: llama2-7b, llama3-8b, qwen2.5-7b (real sizes), tiny and tiny-qwen2 (2 layers, E=256,
for CPU smoke tests), tiny-tp (tiny-qwen2 with 8 heads and 4 kv heads, for tensor-parallel
tests). Quants: q4_0, q4_1, q5_0, q5_1, q4_k_m, q5_k_m, q8_0, f16.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import pathlib
import string
import sys
import time

import numpy as np

import gguf

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from model.tokenizer import _BYTE_TO_CHAR  # noqa: E402

Q = gguf.GGMLQuantizationType
QK_K = 256

log = logging.getLogger("make_synthetic_gguf")


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    arch: str  # "llama" | "qwen2"
    num_layers: int
    embed_dim: int  # E
    ffn_dim: int  # F
    num_heads: int  # H
    num_kv_heads: int  # K
    vocab_size: int  # V
    context_length: int
    rope_theta: float
    rms_eps: float
    vocab_kind: str  # "spm" | "llama3" | "qwen2"
    has_qkv_bias: bool = False

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("llama2-7b", "llama", 32, 4096, 11008, 32, 32, 32000, 4096, 10000.0, 1e-5, "spm"),
        Shape("llama3-8b", "llama", 32, 4096, 14336, 32, 8, 128256, 8192, 500000.0, 1e-5, "llama3"),
        Shape("qwen2.5-7b", "qwen2", 28, 3584, 18944, 28, 4, 152064, 32768, 1000000.0, 1e-6, "qwen2", True),
        Shape("tiny", "llama", 2, 256, 768, 4, 2, 2048, 4096, 10000.0, 1e-5, "spm"),
        Shape("tiny-qwen2", "qwen2", 2, 256, 768, 4, 2, 2048, 4096, 1000000.0, 1e-6, "qwen2", True),
        # heads (8) and kv heads (4) divide by 2 and 4: the tensor-parallel tests shard it that way.
        Shape("tiny-tp", "qwen2", 2, 256, 768, 8, 4, 2048, 4096, 1000000.0, 1e-6, "qwen2", True),
    )
}

QUANTS = ("q4_0", "q4_1", "q5_0", "q5_1", "q4_k_m", "q5_k_m", "q8_0", "f16")
# llama.cpp's general.file_type values (LLAMA_FTYPE_MOSTLY_*)
_FILE_TYPE = {"f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q4_k_m": 15, "q5_k_m": 17}
# The K-quant mixes: Q6_K for attn_v and ffn_down in llama.cpp's `use_more_bits` layers
_K_MIXES = ("q4_k_m", "q5_k_m")


# ---------------------------------------------------------------------------------------------
# tensor table


def _use_more_bits(i_layer: int, num_layers: int) -> bool:
    """llama.cpp's rule (llama-quant.cpp) for the layers Q4_K_M and Q5_K_M give Q6_K."""
    return i_layer < num_layers // 8 or i_layer >= 7 * num_layers // 8 or (i_layer - num_layers // 8) % 3 == 2


def tensor_types(shape: Shape, quant: str) -> dict[str, tuple[tuple[int, ...], Q]]:
    """name -> (numpy shape, GGML type), in llama.cpp's file order. Matrices are [N, K]."""
    if quant not in QUANTS:
        raise ValueError(f"unknown quant {quant!r}; choose from {', '.join(QUANTS)}")
    e, f, v = shape.embed_dim, shape.ffn_dim, shape.vocab_size
    q_dim, kv_dim = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    base = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1, "q4_k_m": Q.Q4_K, "q5_k_m": Q.Q5_K,
            "q8_0": Q.Q8_0, "f16": Q.F16}[quant]
    # The output matrix: Q6_K in llama.cpp's 4- and 5-bit files, the base type otherwise.
    output = Q.Q6_K if quant in ("q4_0", "q4_1", "q5_0", "q5_1", *_K_MIXES) else base

    def fit(qtype: Q, k: int) -> Q:
        # llama.cpp's fallback (llama-quant.cpp) where a row is not a whole number of K-quant
        # super-blocks: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0
        if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) and k % QK_K:
            return {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}[qtype]
        return qtype

    out: dict[str, tuple[tuple[int, ...], Q]] = {
        "token_embd.weight": ((v, e), fit(base, e)),
        "output_norm.weight": ((e,), Q.F32),
        "output.weight": ((v, e), fit(output, e)),
    }
    for i in range(shape.num_layers):
        more = quant in _K_MIXES and _use_more_bits(i, shape.num_layers)
        p = f"blk.{i}."
        out[p + "attn_norm.weight"] = ((e,), Q.F32)
        out[p + "attn_q.weight"] = ((q_dim, e), fit(base, e))
        out[p + "attn_k.weight"] = ((kv_dim, e), fit(base, e))
        out[p + "attn_v.weight"] = ((kv_dim, e), fit(Q.Q6_K if more else base, e))
        if shape.has_qkv_bias:
            out[p + "attn_q.bias"] = ((q_dim,), Q.F32)
            out[p + "attn_k.bias"] = ((kv_dim,), Q.F32)
            out[p + "attn_v.bias"] = ((kv_dim,), Q.F32)
        out[p + "attn_output.weight"] = ((e, q_dim), fit(base, q_dim))
        out[p + "ffn_norm.weight"] = ((e,), Q.F32)
        out[p + "ffn_gate.weight"] = ((f, e), fit(base, e))
        out[p + "ffn_up.weight"] = ((f, e), fit(base, e))
        out[p + "ffn_down.weight"] = ((e, f), fit(Q.Q6_K if more else base, f))
    return out


# ---------------------------------------------------------------------------------------------
# random weights: bulk random bytes, then the scale fields of every block overwritten


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    # random_raw is the bit generator's output as uint64: ~10x faster than Generator.bytes
    return rng.bit_generator.random_raw((n + 7) // 8).view(np.uint8)[:n]


def _tiled(pool: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """n entries of `pool` (along axis 0) from a random start, repeating; cheap variety."""
    start = int(rng.integers(len(pool)))
    return np.resize(np.roll(pool, -start, axis=0), (n, *pool.shape[1:]))


def _f16_scales(rng: np.random.Generator, value: float, n: int) -> np.ndarray:
    pool = (value * rng.uniform(0.75, 1.25, 4093)).astype(np.float16)
    return _tiled(pool, n, rng)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K's 12 scale bytes from 8 6-bit scales and 8 6-bit mins per block ([B, 8] each);
    the inverse of get_scale_min_k4 (pallas_kernels.quant unpacks it)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    return out


# Standard deviation of the integer part of one element with uniform random bits
_Q_STD = {Q.Q4_0: 4.61, Q.Q4_1: 4.61, Q.Q5_0: 9.23, Q.Q5_1: 9.23, Q.Q8_0: 73.9, Q.Q4_K: 4.61, Q.Q5_K: 9.23,
          Q.Q6_K: 18.5}


def random_matrix(qtype: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random weights [N, K] with std ~ 1/sqrt(K): float16 [N, K], or uint8 blocks [N, row bytes]."""
    target = 1.0 / np.sqrt(k)
    if qtype == Q.F16:
        table = (np.arange(-128, 128, dtype=np.float32) * (target / _Q_STD[Q.Q8_0])).astype(np.float16)
        return table[_random_bytes(rng, n * k)].reshape(n, k)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    num_blocks = n * k // block
    blocks = _random_bytes(rng, num_blocks * type_size).reshape(num_blocks, type_size)
    if qtype in (Q.Q4_0, Q.Q5_0, Q.Q8_0):  # d at bytes 0..1; w = d (q - 8), d (q - 16), d q (Q5_0's qh at 2..5)
        blocks[:, 0:2].view(np.float16)[:, 0] = _f16_scales(rng, target / _Q_STD[qtype], num_blocks)
    elif qtype in (Q.Q4_1, Q.Q5_1):  # w = d q + m, q in [0, 15] ([0, 31]); d, m at 0..3; m = -7.5 d (-15.5 d)
        d = _f16_scales(rng, target / _Q_STD[qtype], num_blocks)
        blocks[:, 0:2].view(np.float16)[:, 0] = d
        mean_q = 7.5 if qtype == Q.Q4_1 else 15.5
        blocks[:, 2:4].view(np.float16)[:, 0] = (-mean_q * d.astype(np.float32)).astype(np.float16)
    elif qtype in (Q.Q4_K, Q.Q5_K):
        # w = d sc q - dmin m, q in [0, 15] (Q5_K: [0, 31], its fifth bits in qh at 16..47);
        # m = sc and dmin = 7.5 d (15.5 d): zero mean
        sc = rng.integers(32, 64, size=(4096, 8))
        sc_rms = float(np.sqrt(np.mean(sc.astype(np.float64) ** 2)))
        d = _f16_scales(rng, target / (_Q_STD[qtype] * sc_rms), num_blocks)
        blocks[:, 0:2].view(np.float16)[:, 0] = d
        mean_q = 7.5 if qtype == Q.Q4_K else 15.5
        blocks[:, 2:4].view(np.float16)[:, 0] = (d.astype(np.float32) * mean_q).astype(np.float16)
        blocks[:, 4:16] = _tiled(_pack_k_scales(sc, sc), num_blocks, rng)
    elif qtype == Q.Q6_K:  # w = d sc q, q in [-32, 31]; int8 scales at 192..207, d at 208..209
        sc = rng.integers(16, 64, size=(4096, 16)).astype(np.int8)
        sc_rms = float(np.sqrt(np.mean(sc.astype(np.float64) ** 2)))
        blocks[:, 192:208] = _tiled(sc, num_blocks, rng).view(np.uint8)
        blocks[:, 208:210].view(np.float16)[:, 0] = _f16_scales(rng, target / (_Q_STD[qtype] * sc_rms), num_blocks)
    else:
        raise ValueError(f"no random generator for {qtype.name}")
    return blocks.reshape(n, k // block * type_size)


# ---------------------------------------------------------------------------------------------
# synthetic vocabularies


@dataclasses.dataclass
class Vocab:
    model: str  # tokenizer.ggml.model
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    bos_id: int
    eos_id: int
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    chat_template: str


_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def _grow(base: list[str], count: int, rng: np.random.Generator, max_len: int = 16) -> list[tuple[str, str]]:
    """`count` new pieces, each the concatenation of two earlier ones (a BPE merge): returns the
    pairs in creation order. Short, early pieces are picked more often, as in real vocabularies."""
    pieces = list(base)
    seen = set(pieces)
    pairs: list[tuple[str, str]] = []
    while len(pairs) < count:
        size = len(pieces)
        u = rng.random((2, 4096)) ** 2  # skewed towards early (short) pieces
        for a_i, b_i in zip((u[0] * size).astype(np.int64), (u[1] * size).astype(np.int64)):
            a, b = pieces[a_i], pieces[b_i]
            s = a + b
            if len(s) > max_len or s in seen:
                continue
            seen.add(s)
            pieces.append(s)
            pairs.append((a, b))
            if len(pairs) == count:
                break
    return pairs


_LLAMA2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
)
_LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
_CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_QWEN2_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)


def _llama3_specials() -> list[str]:
    named = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>",
             6: "<|start_header_id|>", 7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>",
             10: "<|python_tag|>"}
    out, reserved = [], 0
    for i in range(256):
        if i in named:
            out.append(named[i])
        else:
            out.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return out


def build_vocab(shape: Shape, rng: np.random.Generator) -> Vocab:
    size = shape.vocab_size
    if shape.vocab_kind == "spm":
        # SentencePiece as Llama 2: <unk> <s> </s>, 256 byte tokens, merged pieces (score = -rank),
        # then the single characters they are built from (lowest scores).
        chars = ["\u2581"] + list(string.ascii_letters + string.digits + ".,;:!?'\"()-")
        head = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
        pairs = _grow(chars, size - len(head) - len(chars), rng)
        pieces = [a + b for a, b in pairs]
        tokens = head + pieces + chars
        types = [_UNKNOWN, _CONTROL, _CONTROL] + [_BYTE] * 256 + [_NORMAL] * (len(pieces) + len(chars))
        scores = [0.0] * len(head) + [-float(i) for i in range(len(pieces))]
        scores += [-1e9 - i for i in range(len(chars))]
        return Vocab("llama", None, tokens, types, scores, None, bos_id=1, eos_id=2, unk_id=0, pad_id=None,
                     add_bos=True, chat_template=_LLAMA2_TEMPLATE)

    # Byte-level BPE as GPT-2: the 256 byte symbols, then one token per merge, then specials.
    byte_chars = dict(_BYTE_TO_CHAR)  # GPT-2's printable stand-ins for the 256 byte values
    symbols = [byte_chars[b] for b in range(256)]
    # Merges use printable ASCII and the space/newline stand-ins, so that text reads as text.
    base = [byte_chars[b] for b in range(0x21, 0x7F)] + [byte_chars[0x20], byte_chars[0x0A]]
    if shape.vocab_kind == "llama3":
        specials = _llama3_specials()
        num_regular = size - len(specials)
        padding = 0
    elif shape.vocab_kind == "qwen2":
        specials = list(_QWEN2_SPECIALS)
        # Qwen's regular vocabulary ends at 151643; the GGUF pads to the embedding rows with [PADn]
        num_regular = min(151643, size - len(specials))
        padding = size - num_regular - len(specials)
    else:
        raise ValueError(f"unknown vocabulary kind {shape.vocab_kind!r}")
    pairs = _grow(base, num_regular - 256, rng)
    tokens = symbols + [a + b for a, b in pairs]
    merges = [f"{a} {b}" for a, b in pairs]
    types = [_NORMAL] * len(tokens)
    first_special = len(tokens)
    for text in specials:
        tokens.append(text)
        types.append(_USER_DEFINED if text in ("<tool_call>", "</tool_call>") else _CONTROL)
    for _ in range(padding):
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(_UNUSED)
    if shape.vocab_kind == "llama3":
        return Vocab("gpt2", "llama-bpe", tokens, types, None, merges, bos_id=first_special,
                     eos_id=first_special + 9, unk_id=None, pad_id=None, add_bos=True,
                     chat_template=_LLAMA3_TEMPLATE)
    return Vocab("gpt2", "qwen2", tokens, types, None, merges, bos_id=first_special,
                 eos_id=first_special + 2, unk_id=None, pad_id=first_special, add_bos=False,
                 chat_template=_CHATML_TEMPLATE)


# ---------------------------------------------------------------------------------------------
# the file


def write_gguf(path: str | pathlib.Path, shape: Shape, quant: str, seed: int = 0) -> dict:
    """Writes the file tensor by tensor (never more than one tensor in memory); returns a summary."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    vocab = build_vocab(shape, rng)
    if len(vocab.tokens) != shape.vocab_size:
        raise RuntimeError(f"built {len(vocab.tokens)} tokens for a vocabulary of {shape.vocab_size}")
    t_vocab = time.perf_counter() - t0

    arch = shape.arch
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.name", f"synthetic-{shape.name}-{quant}")
    w.add_string("general.description", "random weights and a synthetic vocabulary, for benchmarks only")
    w.add_uint32("general.file_type", _FILE_TYPE[quant])
    w.add_uint32("general.quantization_version", 2)
    w.add_uint32(f"{arch}.context_length", shape.context_length)
    w.add_uint32(f"{arch}.embedding_length", shape.embed_dim)
    w.add_uint32(f"{arch}.block_count", shape.num_layers)
    w.add_uint32(f"{arch}.feed_forward_length", shape.ffn_dim)
    w.add_uint32(f"{arch}.attention.head_count", shape.num_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", shape.num_kv_heads)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", shape.rms_eps)
    w.add_float32(f"{arch}.rope.freq_base", shape.rope_theta)
    w.add_uint32(f"{arch}.rope.dimension_count", shape.head_dim)
    w.add_uint32(f"{arch}.vocab_size", shape.vocab_size)
    w.add_string("tokenizer.ggml.model", vocab.model)
    if vocab.pre:
        w.add_string("tokenizer.ggml.pre", vocab.pre)
    w.add_array("tokenizer.ggml.tokens", vocab.tokens)
    w.add_array("tokenizer.ggml.token_type", vocab.token_types)
    if vocab.scores is not None:
        w.add_array("tokenizer.ggml.scores", vocab.scores)
    if vocab.merges is not None:
        w.add_array("tokenizer.ggml.merges", vocab.merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", vocab.bos_id)
    w.add_uint32("tokenizer.ggml.eos_token_id", vocab.eos_id)
    if vocab.unk_id is not None:
        w.add_uint32("tokenizer.ggml.unknown_token_id", vocab.unk_id)
    if vocab.pad_id is not None:
        w.add_uint32("tokenizer.ggml.padding_token_id", vocab.pad_id)
    w.add_bool("tokenizer.ggml.add_bos_token", vocab.add_bos)
    w.add_string("tokenizer.chat_template", vocab.chat_template)

    table = tensor_types(shape, quant)
    for name, (tshape, qtype) in table.items():
        if qtype == Q.F32:
            w.add_tensor_info(name, tshape, np.dtype(np.float32), int(np.prod(tshape)) * 4)
        elif qtype == Q.F16:
            w.add_tensor_info(name, tshape, np.dtype(np.float16), int(np.prod(tshape)) * 2)
        else:
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n, k = tshape
            row_bytes = k // block * type_size
            w.add_tensor_info(name, (n, row_bytes), np.dtype(np.uint8), n * row_bytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t_header = time.perf_counter() - t0

    num_bytes = 0
    counts: dict[str, int] = {}
    for name, (tshape, qtype) in table.items():
        if qtype == Q.F32:
            if name.endswith("norm.weight"):
                data = np.ones(tshape, np.float32)
            else:  # biases
                data = (rng.standard_normal(tshape) * 0.02).astype(np.float32)
        else:
            data = random_matrix(qtype, tshape[0], tshape[1], rng)
            counts[qtype.name] = counts.get(qtype.name, 0) + 1
        w.write_tensor_data(data)
        num_bytes += data.nbytes
    w.close()
    seconds = time.perf_counter() - t0
    return {
        "path": str(path),
        "shape": shape.name,
        "quant": quant,
        "tensor_bytes": num_bytes,
        "file_bytes": pathlib.Path(path).stat().st_size,
        "matrix_types": counts,
        "vocab_s": round(t_vocab, 2),
        "header_s": round(t_header, 2),
        "total_s": round(seconds, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--quant", required=True, choices=QUANTS)
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=0, help="another number of layers than the shape's (0: its own)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.shape]
    if args.layers:
        shape = dataclasses.replace(shape, num_layers=args.layers)
    summary = write_gguf(args.out, shape, args.quant, args.seed)
    print(
        f"wrote {summary['path']}: {summary['file_bytes'] / 2**20:,.1f} MiB, {summary['shape']} {summary['quant']} "
        f"({', '.join(f'{k} x{v}' for k, v in sorted(summary['matrix_types'].items()))}) in {summary['total_s']:.1f} s "
        f"(vocabulary {summary['vocab_s']:.1f} s, header {summary['header_s']:.1f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
