"""Tokenizers behind one small interface: SentencePiece (translation, LM) and WordPiece (BERT).

Both expose `encode(str) -> list[int]` (no special tokens added), `decode(ids) -> str`,
`vocab_size`, `pad_id` (always 0), `eos_id`, `bos_id`, `unk_id`, and pickle by value so
Grain worker processes can use them.

SentencePiece ids are pad=0, eos=1, bos=2, unk=3 (a shared source/target vocabulary as in
Vaswani et al.: 37k BPE for WMT14, a few hundred pieces for the local corpus).
WordPiece specials come from the vocabulary; one trained here has
[PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4; Google's BERT vocab.txt files load as they are.
Byte-level BPE (RoBERTa, GPT-2 style; cased, no unknown tokens) has <pad>=0, <unk>=1, <s>=2,
</s>=3, <mask>=4 and the same `cls_id`/`sep_id`/`mask_id`/`special_ids`/`continuation_ids`
attributes as WordPiece, so BERT's pretraining pipeline takes either.
"""
from __future__ import annotations

import io
import os
from typing import Iterable, Protocol, Sequence

import sentencepiece as spm
import tokenizers as hf

WORDPIECE_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    eos_id: int
    bos_id: int
    unk_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _until_eos(ids: Sequence[int], eos_id: int, pad_id: int) -> list[int]:
    out = []
    for i in ids:
        i = int(i)
        if i == eos_id:
            break
        if i != pad_id:
            out.append(i)
    return out


class SentencePieceTokenizer:
    """A trained SentencePiece model; `decode` stops at EOS and drops padding."""

    def __init__(self, model_proto: bytes):
        self._proto = model_proto
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.vocab_size = self._sp.get_piece_size()
        self.pad_id, self.eos_id = self._sp.pad_id(), self._sp.eos_id()
        self.bos_id, self.unk_id = self._sp.bos_id(), self._sp.unk_id()

    @classmethod
    def load(cls, path: str | os.PathLike) -> SentencePieceTokenizer:
        if not os.path.exists(path):
            raise FileNotFoundError(f"no SentencePiece model at {path}")
        with open(path, "rb") as f:
            return cls(f.read())

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "wb") as f:
            f.write(self._proto)

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode(_until_eos(ids, self.eos_id, self.pad_id))

    def __reduce__(self):
        return SentencePieceTokenizer, (self._proto,)


def train_sentencepiece(texts: Iterable[str], vocab_size: int, *,
                        model_type: str = "bpe", character_coverage: float = 1.0,
                        max_sentences: int = 10_000_000, seed_sentences: int = 1_000_000,
                        path: str | os.PathLike | None = None) -> SentencePieceTokenizer:
    """Trains SentencePiece on `texts` (e.g. both sides of a parallel corpus, for a shared
    vocabulary); saves the model to `path` when given.

    `max_sentences` caps the sentences read (SentencePiece samples them); the paper's WMT14
    setting is vocab_size=37000 (BPE over source and target text).
    """
    if model_type not in ("bpe", "unigram", "char", "word"):
        raise ValueError(f"unknown SentencePiece model_type {model_type!r}")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size,
        model_type=model_type, character_coverage=character_coverage,
        input_sentence_size=max_sentences, shuffle_input_sentence=True,
        seed_sentencepiece_size=seed_sentences,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, num_threads=1, minloglevel=2,
        hard_vocab_limit=True)
    tok = SentencePieceTokenizer(model.getvalue())
    if path is not None:
        tok.save(path)
    return tok


class WordPieceTokenizer:
    """BERT WordPiece (lower-cased, accents stripped). `cls_id`, `sep_id`, `mask_id` too.

    `eos_id` is [SEP] and `bos_id` is [CLS], so generic code can use the common interface.
    """

    def __init__(self, vocab: dict[str, int]):
        missing = [t for t in WORDPIECE_SPECIALS if t not in vocab]
        if missing:
            raise ValueError(f"WordPiece vocabulary lacks special tokens {missing}")
        if vocab["[PAD]"] != 0:
            raise ValueError(f"[PAD] must have id 0, has {vocab['[PAD]']}")
        tok = hf.Tokenizer(hf.models.WordPiece(vocab, unk_token="[UNK]"))
        tok.normalizer = hf.normalizers.BertNormalizer(lowercase=True, strip_accents=True)
        tok.pre_tokenizer = hf.pre_tokenizers.BertPreTokenizer()
        tok.decoder = hf.decoders.WordPiece()
        self._tok, self._vocab = tok, dict(vocab)
        self.vocab_size = len(vocab)
        self.pad_id, self.unk_id = vocab["[PAD]"], vocab["[UNK]"]
        self.cls_id, self.sep_id, self.mask_id = vocab["[CLS]"], vocab["[SEP]"], vocab["[MASK]"]
        self.bos_id, self.eos_id = self.cls_id, self.sep_id
        self.special_ids = frozenset(vocab[t] for t in WORDPIECE_SPECIALS)
        self.continuation_ids = sorted(i for t, i in vocab.items() if t.startswith("##"))  # whole-word masking

    @classmethod
    def load(cls, vocab_txt: str | os.PathLike) -> WordPieceTokenizer:
        """Reads a BERT `vocab.txt` (one token a line, id = line number)."""
        if not os.path.exists(vocab_txt):
            raise FileNotFoundError(f"no WordPiece vocab.txt at {vocab_txt}")
        with open(vocab_txt, encoding="utf-8") as f:
            return cls({line.rstrip("\n"): i for i, line in enumerate(f)})

    def save(self, vocab_txt: str | os.PathLike) -> None:
        with open(vocab_txt, "w", encoding="utf-8") as f:
            for token, _ in sorted(self._vocab.items(), key=lambda kv: kv[1]):
                f.write(token + "\n")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, offsets): token i covers text[offsets[i][0]:offsets[i][1]] of the original
        (un-normalised) text, so a predicted token span maps back to the exact characters."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, [tuple(o) for o in enc.offsets]

    def decode(self, ids: Sequence[int]) -> str:
        """Drops [PAD]/[CLS]/[SEP] (not [UNK]/[MASK]) and joins '##' pieces."""
        keep = [int(i) for i in ids if int(i) not in (self.pad_id, self.cls_id, self.sep_id)]
        return self._tok.decode(keep, skip_special_tokens=False)

    def __reduce__(self):
        return WordPieceTokenizer, (self._vocab,)


def train_wordpiece(texts: Iterable[str], vocab_size: int, *,
                    path: str | os.PathLike | None = None) -> WordPieceTokenizer:
    """Trains a WordPiece vocabulary with [PAD]=0,[UNK]=1,[CLS]=2,[SEP]=3,[MASK]=4; saves
    `vocab.txt` to `path` when given. Not deterministic: the trainer breaks ties between equally
    frequent pairs (and orders the alphabet) in hash order, so train once and share the file."""
    tok = hf.Tokenizer(hf.models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = hf.normalizers.BertNormalizer(lowercase=True, strip_accents=True)
    tok.pre_tokenizer = hf.pre_tokenizers.BertPreTokenizer()
    trainer = hf.trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=list(WORDPIECE_SPECIALS), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    out = WordPieceTokenizer(tok.get_vocab())
    if path is not None:
        out.save(path)
    return out


BYTE_BPE_SPECIALS = ("<pad>", "<unk>", "<s>", "</s>", "<mask>")


class ByteBPETokenizer:
    """Byte-level BPE (Liu et al. 2019's RoBERTa vocabulary type): text as bytes, a leading
    space marks a word start (`Ġ`), so `continuation_ids` are the pieces without it.
    `cls_id` is <s>, `sep_id` </s>, `mask_id` <mask>."""

    def __init__(self, tokenizer_json: str):
        self._json = tokenizer_json
        self._tok = hf.Tokenizer.from_str(tokenizer_json)
        vocab = self._tok.get_vocab()
        missing = [t for t in BYTE_BPE_SPECIALS if t not in vocab]
        if missing:
            raise ValueError(f"byte-level BPE vocabulary lacks special tokens {missing}")
        if vocab["<pad>"] != 0:
            raise ValueError(f"<pad> must have id 0, has {vocab['<pad>']}")
        self.vocab_size = self._tok.get_vocab_size()
        self.pad_id, self.unk_id = vocab["<pad>"], vocab["<unk>"]
        self.cls_id, self.sep_id, self.mask_id = vocab["<s>"], vocab["</s>"], vocab["<mask>"]
        self.bos_id, self.eos_id = self.cls_id, self.sep_id
        self.special_ids = frozenset(vocab[t] for t in BYTE_BPE_SPECIALS)
        self.continuation_ids = sorted(i for t, i in vocab.items()
                                       if i not in self.special_ids and not t.startswith("\u0120"))

    @classmethod
    def load(cls, path: str | os.PathLike) -> ByteBPETokenizer:
        """Reads a `tokenizer.json` written by `save`."""
        if not os.path.exists(path):
            raise FileNotFoundError(f"no byte-level BPE tokenizer.json at {path}")
        with open(path, encoding="utf-8") as f:
            return cls(f.read())

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self._json)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Drops <pad>/<s>/</s> and joins the bytes back into text."""
        keep = [int(i) for i in ids if int(i) not in (self.pad_id, self.cls_id, self.sep_id)]
        return self._tok.decode(keep, skip_special_tokens=False).strip()

    def __reduce__(self):
        return ByteBPETokenizer, (self._json,)


def train_byte_bpe(texts: Iterable[str], vocab_size: int, *,
                   path: str | os.PathLike | None = None) -> ByteBPETokenizer:
    """Trains a byte-level BPE vocabulary (256 byte symbols + merges + 5 specials, RoBERTa uses
    50k); saves `tokenizer.json` to `path` when given."""
    tok = hf.Tokenizer(hf.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = hf.decoders.ByteLevel()
    trainer = hf.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(BYTE_BPE_SPECIALS), show_progress=False,
        initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    out = ByteBPETokenizer(tok.to_str())
    if path is not None:
        out.save(path)
    return out
