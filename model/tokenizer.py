"""Text <-> token ids, built from a GGUF file's `tokenizer.ggml.*` metadata, giving the ids
llama.cpp gives.

Data comes from the GGUF metadata (`Tokenizer.from_gguf_metadata`); `server/` encodes prompts
with it and streams generated text through `IncrementalDetokenizer`. The algorithms follow
llama.cpp's `src/llama-vocab.cpp` and `src/unicode.cpp`:

- `tokenizer.ggml.model == "gpt2"`: byte-level BPE. The pre-tokenizer regexes are the ones
  llama.cpp picks per `tokenizer.ggml.pre`, applied in sequence, each splitting the pieces the
  previous one left; the merges run in the `tokenizers` library.
- `tokenizer.ggml.model == "llama"`: SentencePiece-style. Spaces become U+2581, adjacent
  symbols merge best-score-first (ties: leftmost) while the merged text is a vocab entry, and
  what never became a token falls back to `<0xXX>` byte tokens.
- Before either, special tokens are cut out of the text, longest first. User-defined tokens
  are always cut out (llama.cpp does this too: gemma's "\\n" and "  " tokens are
  user-defined); control tokens only when the caller passes `parse_special=True`.

Decoding renders each token's bytes (byte-level mapping undone, U+2581 -> space, `<0xXX>` ->
the byte); control tokens render as nothing when `skip_special`. With `add_space_prefix`, the
space the encoder put before the text is removed again when the ids start with BOS.
"""

from __future__ import annotations

import codecs
import heapq
import logging
import re
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from tokenizers import Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

log = logging.getLogger(__name__)

# GGUF tokenizer.ggml.token_type values
TOKEN_TYPE_UNDEFINED = 0
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# llama.cpp's token attribute bits (llama_token_attr); kept so its rules read the same here.
_ATTR_UNKNOWN = 1 << 0
_ATTR_UNUSED = 1 << 1
_ATTR_NORMAL = 1 << 2
_ATTR_CONTROL = 1 << 3
_ATTR_USER_DEFINED = 1 << 4
_ATTR_BYTE = 1 << 5
_TYPE_TO_ATTR = {
    TOKEN_TYPE_UNKNOWN: _ATTR_UNKNOWN,
    TOKEN_TYPE_UNUSED: _ATTR_UNUSED,
    TOKEN_TYPE_NORMAL: _ATTR_NORMAL,
    TOKEN_TYPE_CONTROL: _ATTR_CONTROL,
    TOKEN_TYPE_USER_DEFINED: _ATTR_USER_DEFINED,
    TOKEN_TYPE_BYTE: _ATTR_BYTE,
}
_ATTR_HIDDEN = _ATTR_CONTROL | _ATTR_UNKNOWN  # rendered only when skip_special is False
_ATTR_SPECIAL = _ATTR_CONTROL | _ATTR_USER_DEFINED | _ATTR_UNKNOWN  # cut out before BPE/SPM

SPM_SPACE = "\u2581"

# Pre-tokenizer regexes, as llama.cpp writes them (its case-insensitive contractions spelled
# out as character classes). They run in order: each splits every piece the previous one left.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")

# tokenizer.ggml.pre -> (regexes, ignore_merges, add_bos default). Names as in llama.cpp.
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool]] = {}
for _names, _spec in (
    (("default",), (_DEFAULT, False, False)),
    (
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        ((_LLAMA3,), True, True),
    ),
    (("dbrx", "smaug-bpe"), ((_LLAMA3,), False, False)),
    (("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), ((_QWEN2,), False, False)),
    (("gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"), ((_GPT2,), False, False)),
    (
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        ((r"\p{N}", _GPT2), False, False),
    ),
):
    for _name in _names:
        _PRE_TOKENIZERS[_name] = _spec

# Token texts llama.cpp treats as end of generation when it sees them in a vocab, and the
# texts of the end-of-turn and fill-in-the-middle tokens it detects (these become control).
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
))
_DETECTED_TEXTS: dict[str, tuple[str, ...]] = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
            "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_ID_KEYS = {
    "eot": ("eot_token_id",), "eom": ("eom_token_id",),
    "fim_pre": ("fim_pre_token_id", "prefix_token_id"), "fim_suf": ("fim_suf_token_id", "suffix_token_id"),
    "fim_mid": ("fim_mid_token_id", "middle_token_id"), "fim_pad": ("fim_pad_token_id",),
    "fim_rep": ("fim_rep_token_id",), "fim_sep": ("fim_sep_token_id",),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


class Tokenizer:
    """Encodes text to token ids and decodes ids to text as llama.cpp does for the same file."""

    def __init__(
        self,
        *,
        kind: str,
        tokens: Sequence[str],
        token_types: Sequence[int],
        scores: Sequence[float] | None,
        merges: Sequence[str] | None,
        pre: str | None,
        bos_id: int | None,
        eos_id: int | None,
        unk_id: int | None,
        add_bos: bool,
        add_space_prefix: bool,
        chat_template: str | None,
        extra_ids: Mapping[str, int],
        add_eos: bool = False,
    ) -> None:
        if kind not in ("gpt2", "llama"):
            raise ValueError(
                f"unsupported tokenizer.ggml.model {kind!r}: "
                "only 'gpt2' (byte-level BPE) and 'llama' (SentencePiece) are supported"
            )
        num = len(tokens)
        if num == 0:
            raise ValueError("tokenizer.ggml.tokens is empty")
        if len(token_types) < num:
            raise ValueError(f"tokenizer.ggml.token_type has {len(token_types)} entries for {num} tokens")
        self._kind = kind
        self._tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self._token_to_id = {t: i for i, t in enumerate(self._tokens)}
        self._scores = [float(s) for s in scores] if scores is not None else [0.0] * num
        if len(self._scores) < num:
            raise ValueError(f"tokenizer.ggml.scores has {len(self._scores)} entries for {num} tokens")
        attrs = [_TYPE_TO_ATTR.get(int(t), 0) for t in token_types[:num]]

        def valid(i: int | None) -> int | None:
            return int(i) if i is not None and 0 <= int(i) < num else None

        self._bos_id, self._eos_id, self._unk_id = valid(bos_id), valid(eos_id), valid(unk_id)
        self._add_bos = bool(add_bos)
        self._add_eos = bool(add_eos) and self._eos_id is not None  # (embeddings' inputs: the file's special tokens)
        self._add_space_prefix = bool(add_space_prefix) and kind == "llama"
        self._chat_template = chat_template
        self._eog_ids, found = self._detect_eog(attrs, {k: valid(v) for k, v in extra_ids.items()})
        self._eot_id = found.get("eot")
        self._fim_ids = {k: v for k, v in found.items() if k.startswith("fim_") and v is not None}
        self._attrs = attrs
        self._piece_cache: list[bytes | None] = [None] * num
        self._joined: tuple[bytes, np.ndarray, np.ndarray] | None = None  # tokens_containing's

        specials = [i for i in range(num) if attrs[i] & _ATTR_SPECIAL]
        self._specials_all = self._group_specials(specials)
        self._specials_user = self._group_specials([i for i in specials if not attrs[i] & _ATTR_HIDDEN])

        self._hf: HFTokenizer | None = None
        if kind == "gpt2":
            if pre is None or pre == "":
                log.warning("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer")
                pre = "default"
            if pre not in _PRE_TOKENIZERS:
                raise ValueError(
                    f"unsupported tokenizer.ggml.pre {pre!r}; supported: {', '.join(sorted(_PRE_TOKENIZERS))}"
                )
            if merges is None:
                raise ValueError("tokenizer.ggml.merges is missing for a 'gpt2' tokenizer")
            self._hf = _build_bpe(self._token_to_id, merges, _PRE_TOKENIZERS[pre][0], _PRE_TOKENIZERS[pre][1])

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":
        """Builds the tokenizer from GGUF metadata (key -> python value, as GGUFReader reads it)."""

        def get(key: str, default: Any = None) -> Any:
            value = meta.get("tokenizer.ggml." + key, default)
            return value.tolist() if isinstance(value, np.ndarray) else value

        kind = get("model")
        if kind is None:
            raise ValueError("GGUF has no tokenizer.ggml.model: the file carries no tokenizer")
        tokens = get("tokens")
        if tokens is None:
            raise ValueError("GGUF has no tokenizer.ggml.tokens")
        tokens = list(tokens)
        token_types = get("token_type")
        if token_types is None:
            token_types = [TOKEN_TYPE_NORMAL] * len(tokens)
        pre = get("pre")
        spm = kind == "llama"
        pre_spec = _PRE_TOKENIZERS.get(pre) if isinstance(pre, str) else None
        # llama.cpp's defaults when the file does not say: SPM adds BOS and a space prefix
        add_bos = get("add_bos_token", spm or (pre_spec is not None and pre_spec[2]))
        add_space_prefix = get("add_space_prefix", spm)
        template = meta.get("tokenizer.chat_template")
        extra = {name: get(keys[0], get(keys[1]) if len(keys) > 1 else None) for name, keys in _ID_KEYS.items()}
        return cls(
            kind=kind,
            tokens=tokens,
            token_types=list(token_types),
            scores=get("scores"),
            merges=get("merges"),
            pre=pre,
            bos_id=get("bos_token_id", 1 if spm else None),
            eos_id=get("eos_token_id", 2 if spm else None),
            unk_id=get("unknown_token_id", 0 if spm else None),
            add_bos=bool(add_bos),
            add_space_prefix=bool(add_space_prefix),
            chat_template=template if isinstance(template, str) and template else None,
            extra_ids=extra,
            add_eos=bool(get("add_eos_token", False)),
        )

    def _detect_eog(self, attrs: list[int], extra: dict[str, int | None]) -> tuple[frozenset[int], dict[str, int | None]]:
        """llama.cpp's rules (llama_vocab::impl::load): ids named in the file, else found by text;
        the tokens found become control; the end-of-generation set is built from them. Returns
        it and the tokens found (end of turn, of message, fill-in-the-middle) by name."""
        found = dict(extra)
        for name, texts in _DETECTED_TEXTS.items():
            for text in texts:
                tid = self._token_to_id.get(text)
                if tid is None:
                    continue
                if found.get(name) is None:
                    found[name] = tid
                if found[name] == tid:
                    attrs[tid] |= _ATTR_CONTROL
        eog = {found[k] for k in ("fim_pad", "fim_rep", "fim_sep") if found.get(k) is not None}
        for text in _EOG_TEXTS:
            tid = self._token_to_id.get(text)
            if tid is not None:
                eog.add(tid)
                attrs[tid] |= _ATTR_CONTROL
        for tid in (self._eos_id, found.get("eot"), found.get("eom")):
            if tid is not None:
                eog.add(tid)
        texts = {self._tokens[t]: t for t in eog}
        # gpt-oss / solar-open: "<|end|>" ends a message, not the generation
        harmony = "<|return|>" in texts and "<|call|>" in texts
        solar = "<|calls|>" in texts and "<|flush|>" in texts
        if "<|end|>" in texts and (harmony or solar):
            eog.discard(texts["<|end|>"])
            attrs[texts["<|end|>"]] = _ATTR_USER_DEFINED
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(texts["</s>"])
            attrs[texts["</s>"]] = _ATTR_NORMAL
        for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss: always rendered
            if text in self._token_to_id:
                attrs[self._token_to_id[text]] = _ATTR_USER_DEFINED
        return frozenset(eog), found

    def _group_specials(self, ids: list[int]) -> dict[str, tuple[dict[str, int], tuple[int, ...]]]:
        """Special tokens grouped by their first 3 characters: prefix -> (text -> id, the
        lengths present), so `encode` looks only where a group's prefix occurs in the text."""
        groups: dict[str, dict[str, int]] = {}
        for i in ids:
            text = self._tokens[i]
            groups.setdefault(text[:3], {})[text] = i
        return {p: (entries, tuple(sorted({len(t) for t in entries}))) for p, entries in groups.items()}

    # ---- properties ---------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def eot_id(self) -> int | None:
        return self._eot_id

    @property
    def fim_ids(self) -> dict[str, int]:
        """The fill-in-the-middle tokens the vocabulary has, by llama.cpp's names (fim_pre,
        fim_suf, fim_mid, fim_pad, fim_rep, fim_sep): named in the file, else found by text."""
        return dict(self._fim_ids)

    @property
    def eog_ids(self) -> frozenset[int]:
        """Ids that end a generation: EOS, end-of-turn and the tokens llama.cpp detects by text."""
        return self._eog_ids

    @property
    def add_bos(self) -> bool:
        return self._add_bos

    @property
    def add_eos(self) -> bool:
        """tokenizer.ggml.add_eos_token: llama.cpp appends EOS where it adds special tokens
        (an embedding model's input, say Qwen3-Embedding's)."""
        return self._add_eos

    @property
    def add_space_prefix(self) -> bool:
        return self._add_space_prefix

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def kind(self) -> str:
        """'gpt2' (byte-level BPE) or 'llama' (SentencePiece), as tokenizer.ggml.model says."""
        return self._kind

    def token_to_piece(self, token_id: int) -> str:
        """The token's text as the vocab stores it ('Ġhello', '▁hello', '<0x0A>', '<|im_end|>')."""
        return self._tokens[self._check(token_id)]

    def token_to_id(self, piece: str) -> int | None:
        return self._token_to_id.get(piece)

    def tokens_containing(self, texts: Iterable[str]) -> tuple[int, ...]:
        """The tokens whose bytes hold any of `texts` (UTF-8) within them, in order (DRY's sequence
        breakers). The first call joins every token's bytes into one string, kept for the next."""
        if self._joined is None:
            pieces = [self.token_bytes(i) for i in range(len(self._tokens))]
            ends = np.cumsum([len(p) for p in pieces])
            self._joined = (b"".join(pieces), ends - [len(p) for p in pieces], ends)
        joined, starts, ends = self._joined
        found: set[int] = set()
        for text in texts:
            needle = text.encode("utf-8")
            if not needle:
                continue
            at = np.asarray([m.start() for m in re.finditer(b"(?=" + re.escape(needle) + b")", joined)], np.int64)
            if at.size:
                token = np.searchsorted(starts, at, side="right") - 1
                found.update(token[at + len(needle) <= ends[token]].tolist())
        return tuple(sorted(found))

    def is_special(self, token_id: int) -> bool:
        """True for control and unknown tokens: the ones `decode(skip_special=True)` drops."""
        return bool(self._attrs[self._check(token_id)] & _ATTR_HIDDEN)

    def _check(self, token_id: int) -> int:
        token_id = int(token_id)
        if not 0 <= token_id < len(self._tokens):
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {len(self._tokens)})")
        return token_id

    # ---- encoding -----------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = False) -> list[int]:
        """Token ids for `text`. add_bos None: as the file says (tokenizer.ggml.add_bos_token).
        parse_special: also turn control-token texts ('<|im_start|>') into their ids."""
        if add_bos is None:
            add_bos = self._add_bos
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates (e.g. from a JSON "\ud800"): not text
            text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
        out: list[int] = []
        if add_bos:
            if self._bos_id is None:
                raise ValueError("add_bos requested but the vocabulary has no BOS token")
            out.append(self._bos_id)
        fragments = self._partition(text, parse_special)
        if self._kind == "llama":
            prev_special = True  # llama.cpp: the first fragment counts as following a special token
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if self._add_space_prefix and prev_special:
                    frag = " " + frag
                self._spm_tokenize(frag.replace(" ", SPM_SPACE), out)
                prev_special = False
        else:
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    out.extend(self._hf.encode(frag, add_special_tokens=False).ids)
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cuts special-token texts out of `text`, longest token first, as llama.cpp's
        tokenizer_st_partition does: raw-text fragments and token ids, in order."""
        if not text:
            return []
        groups = self._specials_all if parse_special else self._specials_user
        found: dict[str, int] = {}
        for prefix, (entries, lengths) in groups.items():
            pos = text.find(prefix)
            seen = 0
            while pos >= 0 and seen < len(entries):  # stop once every token of the group is found
                for length in lengths:
                    piece = text[pos:pos + length]
                    tid = entries.get(piece)
                    if tid is not None and piece not in found:
                        found[piece] = tid
                        seen += 1
                pos = text.find(prefix, pos + 1)
        if not found:
            return [text]
        # longest first (bytes, as llama.cpp measures); ties in id order
        candidates = sorted(found.items(), key=lambda e: (-len(e[0].encode("utf-8", "surrogateescape")), e[1]))
        fragments: list[str | int] = [text]
        for piece, tid in candidates:
            split: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or piece not in frag:
                    split.append(frag)
                    continue
                for k, part in enumerate(frag.split(piece)):
                    if k:
                        split.append(tid)
                    if part:
                        split.append(part)
            fragments = split
        return fragments

    def _spm_tokenize(self, text: str, out: list[int]) -> None:
        """llama.cpp's llm_tokenizer_spm: merge the best-scoring adjacent pair whose joined text
        is a vocab entry until none is left; symbols that are not tokens become byte tokens."""
        n = len(text)
        if n == 0:
            return
        vocab, scores = self._token_to_id, self._scores
        size = [1] * n  # characters in symbol i (0: merged away)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap: list[tuple[float, int, int, int]] = []

        def try_add(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            joined = size[left] + size[right]
            tid = vocab.get(text[left:left + joined])
            if tid is not None:
                heapq.heappush(heap, (-scores[tid], left, right, joined))

        for i in range(1, n):
            try_add(i - 1, i)
        while heap:
            _, left, right, joined = heapq.heappop(heap)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != joined:
                continue  # one side changed since this pair was queued
            size[left] = joined
            size[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            try_add(prv[left], left)
            try_add(left, nxt[left])
        i = 0
        while i != -1:
            piece = text[i:i + size[i]]
            tid = vocab.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self._byte_token(b) for b in piece.encode("utf-8"))
            i = nxt[i]

    def _byte_token(self, byte: int) -> int:
        tid = self._token_to_id.get(f"<0x{byte:02X}>")
        if tid is None and byte < 0x80:
            tid = self._token_to_id.get(chr(byte))
        if tid is None:
            if self._unk_id is None:
                raise ValueError(f"vocabulary has no byte token for 0x{byte:02X} and no unknown token")
            tid = self._unk_id
        return tid

    # ---- decoding -----------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for. Control tokens give their text (e.g. b'<|im_end|>')."""
        token_id = self._check(token_id)
        piece = self._piece_cache[token_id]
        if piece is None:
            piece = self._render(token_id)
            self._piece_cache[token_id] = piece
        return piece

    def _render(self, token_id: int) -> bytes:
        # llama.cpp's token_to_piece with special=True
        attr, text = self._attrs[token_id], self._tokens[token_id]
        if attr & _ATTR_SPECIAL:
            return text.encode("utf-8", "surrogateescape")
        if attr & _ATTR_NORMAL:
            if self._kind == "llama":
                return text.replace(SPM_SPACE, " ").encode("utf-8", "surrogateescape")
            # byte-level BPE: each character stands for one byte; any other character (not
            # produced by the GGUF converters) is kept as its UTF-8
            return b"".join(
                bytes((_CHAR_TO_BYTE[c],)) if c in _CHAR_TO_BYTE else c.encode("utf-8", "surrogateescape") for c in text
            )
        if attr & _ATTR_BYTE:
            if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                return bytes((int(text[3:5], 16),))
            return text.encode("utf-8", "surrogateescape")
        return b""  # unused / undefined tokens render as nothing, as in llama.cpp

    def piece_bytes(self, token_id: int, skip_special: bool = True) -> bytes:
        """What `token_id` adds to decoded text: its bytes, or b'' for a control token when skipped."""
        token_id = self._check(token_id)
        if skip_special and self._attrs[token_id] & _ATTR_HIDDEN:
            return b""
        return self.token_bytes(token_id)

    def strips_leading_space(self, ids: Sequence[int]) -> bool:
        """True when decoding drops the first space: the ids start with BOS and the encoder
        put a space before the text (add_space_prefix)."""
        return self._add_space_prefix and len(ids) > 0 and self._bos_id is not None and int(ids[0]) == self._bos_id

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of `ids`; invalid UTF-8 (e.g. a cut multi-byte character) becomes U+FFFD."""
        ids = list(ids)
        data = b"".join(self.piece_bytes(i, skip_special) for i in ids)
        if self.strips_leading_space(ids) and data.startswith(b" "):
            data = data[1:]
        return data.decode("utf-8", "replace")


class IncrementalDetokenizer:
    """Turns a stream of token ids into text, one id at a time.

    `add` returns the text completed by that token; bytes of a UTF-8 character not yet
    complete are held back until a later token completes it (or `flush` gives them up as
    U+FFFD). The concatenation of all outputs equals `tokenizer.decode(all_ids, skip_special)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._num_tokens = 0
        self._strip_pending = False  # drop the first output byte if it is a space

    def add(self, token_id: int) -> str:
        data = self._tokenizer.piece_bytes(token_id, self._skip_special)
        if self._num_tokens == 0:
            self._strip_pending = self._tokenizer.strips_leading_space([token_id])
        self._num_tokens += 1
        if self._strip_pending and data:
            self._strip_pending = False
            if data[:1] == b" ":
                data = data[1:]
        return self._decoder.decode(data) if data else ""

    def flush(self) -> str:
        """Text still held back (an incomplete UTF-8 sequence, as U+FFFD)."""
        return self._decoder.decode(b"", final=True)


def _build_bpe(
    vocab: dict[str, int], merges: Sequence[str], regexes: tuple[str, ...], ignore_merges: bool
) -> HFTokenizer:
    """A `tokenizers` BPE over the byte-level vocab. No normalizer, no added tokens: special
    tokens are cut out beforehand by `Tokenizer._partition`."""
    pairs = []
    for m in merges:
        # llama.cpp splits at the first space after the first character
        cut = m.find(" ", 1)
        if cut < 0:
            raise ValueError(f"malformed tokenizer.ggml.merges entry {m!r}")
        pairs.append((m[:cut], m[cut + 1:]))
    model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges)
    hf = HFTokenizer(model)
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return hf
