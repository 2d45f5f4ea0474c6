"""Deterministic, seeded local corpora so every pipeline runs offline.

* `translation_pairs`: English→German-like sentence pairs from a small grammar. The mapping
  is deterministic but not word-for-word: nouns carry gender and case (der/den/die/das,
  adjective endings), a fronted adverb moves the German verb before the subject (V2) and
  subordinate clauses put the verb last. A tiny Transformer learns it in a few hundred steps.
* `documents`: English documents (lists of sentences) that share a topic, for LM and NSP.
* `topical_documents`: documents on one of 32 topics with disjoint nouns and verbs, so a
  sentence from another document is nearly always off-topic (BERT pretraining's NSP).
* `topic_pairs`: labelled sentence pairs on those topics, 1 when both share one (BERT
  fine-tuning's offline GLUE-style task, features like `glue/rte`).
* `prepare_translation` / `prepare_documents`: write them as TFDS array_record datasets
  (`tfm_synthetic_translate` with features {"en", "de"} like `wmt14_translate/de-en`;
  `tfm_synthetic_docs` with {"title", "text"} like `wikipedia`), read back by
  `tfm.data.sources` through `tfds.data_source` — the code path of the real datasets.
"""
from __future__ import annotations

import os
import random
from typing import Iterable, Iterator

import numpy as np
import tensorflow_datasets as tfds

# (english, german, gender)
NOUNS = [
    ("dog", "Hund", "m"), ("cat", "Katze", "f"), ("child", "Kind", "n"), ("man", "Mann", "m"),
    ("woman", "Frau", "f"), ("teacher", "Lehrer", "m"), ("student", "Student", "m"),
    ("doctor", "Arzt", "m"), ("bird", "Vogel", "m"), ("horse", "Pferd", "n"),
    ("house", "Haus", "n"), ("book", "Buch", "n"), ("car", "Auto", "n"), ("city", "Stadt", "f"),
    ("friend", "Freund", "m"), ("girl", "Mädchen", "n"), ("boy", "Junge", "m"),
    ("farmer", "Bauer", "m"), ("king", "König", "m"), ("queen", "Königin", "f"),
    ("mouse", "Maus", "f"), ("tree", "Baum", "m"), ("apple", "Apfel", "m"),
    ("letter", "Brief", "m"), ("table", "Tisch", "m"), ("window", "Fenster", "n"),
    ("garden", "Garten", "m"), ("baker", "Bäcker", "m"), ("neighbor", "Nachbar", "m"),
    ("river", "Fluss", "m"), ("song", "Lied", "n"), ("picture", "Bild", "n"),
    ("door", "Tür", "f"), ("flower", "Blume", "f"), ("street", "Straße", "f"),
    ("school", "Schule", "f"), ("train", "Zug", "m"), ("ship", "Schiff", "n"),
    ("bridge", "Brücke", "f"), ("village", "Dorf", "n"),
]
ADJECTIVES = [
    ("big", "groß"), ("small", "klein"), ("old", "alt"), ("young", "jung"), ("red", "rot"),
    ("green", "grün"), ("quick", "schnell"), ("quiet", "ruhig"), ("happy", "glücklich"),
    ("new", "neu"), ("good", "gut"), ("beautiful", "schön"), ("strange", "seltsam"),
    ("clever", "klug"), ("hungry", "hungrig"), ("friendly", "freundlich"), ("lazy", "faul"),
    ("wild", "wild"),
]
VERBS = [
    ("sees", "sieht"), ("finds", "findet"), ("likes", "mag"), ("knows", "kennt"),
    ("buys", "kauft"), ("reads", "liest"), ("paints", "malt"), ("visits", "besucht"),
    ("carries", "trägt"), ("hears", "hört"), ("catches", "fängt"), ("builds", "baut"),
    ("loves", "liebt"), ("draws", "zeichnet"), ("sells", "verkauft"), ("opens", "öffnet"),
    ("forgets", "vergisst"), ("watches", "beobachtet"), ("calls", "ruft"), ("asks", "fragt"),
]
ADVERBS = [
    ("today", "heute"), ("now", "jetzt"), ("often", "oft"), ("sometimes", "manchmal"),
    ("suddenly", "plötzlich"), ("here", "hier"), ("later", "später"), ("usually", "meistens"),
]
CONJUNCTIONS = [
    ("that", "dass"), ("because", "weil"), ("while", "während"), ("although", "obwohl"),
    ("when", "wenn"),
]
_ARTICLE = {("m", "nom"): "der", ("m", "acc"): "den", ("f", "nom"): "die", ("f", "acc"): "die",
            ("n", "nom"): "das", ("n", "acc"): "das"}

TRANSLATE_NAME = "tfm_synthetic_translate"
DOCS_NAME = "tfm_synthetic_docs"
TOPICS_NAME = "tfm_synthetic_topics"


def _noun_phrase(rng: random.Random, case: str, nouns=NOUNS) -> tuple[list[str], list[str]]:
    en_noun, de_noun, gender = rng.choice(nouns)
    en, de = ["the"], [_ARTICLE[gender, case]]
    if rng.random() < 0.4:
        en_adj, de_adj = rng.choice(ADJECTIVES)
        en.append(en_adj)
        de.append(de_adj + ("en" if (gender, case) == ("m", "acc") else "e"))
    return en + [en_noun], de + [de_noun]


def _clause(rng: random.Random, nouns=NOUNS, verbs=VERBS):
    """Returns (en words, de subject, de verb, de object) of `the X verbs the Y`."""
    en_s, de_s = _noun_phrase(rng, "nom", nouns)
    en_v, de_v = rng.choice(verbs)
    en_o, de_o = _noun_phrase(rng, "acc", nouns)
    return en_s + [en_v] + en_o, de_s, de_v, de_o


def _sentence(rng: random.Random, nouns=NOUNS, verbs=VERBS) -> tuple[str, str]:
    en, de_s, de_v, de_o = _clause(rng, nouns, verbs)
    if rng.random() < 0.3:  # Fronted adverb: German verb second, before the subject.
        en_adv, de_adv = rng.choice(ADVERBS)
        en, de = [en_adv] + en, [de_adv, de_v] + de_s + de_o
    else:
        de = de_s + [de_v] + de_o
    if rng.random() < 0.4:  # Subordinate clause: German verb last, after a comma.
        en_c, de_c = rng.choice(CONJUNCTIONS)
        sub_en, sub_s, sub_v, sub_o = _clause(rng, nouns, verbs)
        en = en + [en_c] + sub_en
        de = de[:-1] + [de[-1] + ",", de_c] + sub_s + sub_o + [sub_v]
    return _finish(en), _finish(de)


def _finish(words: list[str]) -> str:
    text = " ".join(words) + "."
    return text[0].upper() + text[1:]


def iter_translation_pairs(n: int, seed: int = 0) -> Iterator[tuple[str, str]]:
    """`n` (english, german) sentence pairs made one at a time (memory does not grow with `n`),
    identical for identical `seed`."""
    rng = random.Random(seed)
    for _ in range(n):
        yield _sentence(rng)


def translation_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """`iter_translation_pairs` as a list (small `n`)."""
    return list(iter_translation_pairs(n, seed))


def documents(n: int, seed: int = 0, min_sentences: int = 3,
              max_sentences: int = 8) -> list[list[str]]:
    """`n` English documents of `min_sentences..max_sentences` sentences each.

    Each document draws its sentences from its own few nouns and verbs, so consecutive
    sentences share words and next-sentence prediction is learnable.
    """
    def vocabulary(rng):
        nouns, verbs = rng.sample(NOUNS, 4), rng.sample(VERBS, 3)
        return lambda: _sentence(rng, nouns, verbs)[0]
    return _documents(n, seed, min_sentences, max_sentences, vocabulary)


def _documents(n: int, seed: int, min_sentences: int, max_sentences: int, vocabulary) -> list[list[str]]:
    """`n` documents of `min_sentences..max_sentences` sentences; `vocabulary(rng)` draws one
    document's words and returns the maker of its sentences."""
    if not 1 <= min_sentences <= max_sentences:
        raise ValueError(f"need 1 <= min_sentences <= max_sentences, got "
                         f"{min_sentences}, {max_sentences}")
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        sentence = vocabulary(rng)
        num = rng.randint(min_sentences, max_sentences)
        docs.append([sentence() for _ in range(num)])
    return docs


NOUN_TOPICS, VERB_TOPICS = 8, 4  # NOUNS and VERBS cut into this many disjoint groups


def topical_documents(n: int, seed: int = 0, min_sentences: int = 3,
                      max_sentences: int = 8) -> list[list[str]]:
    """`n` English documents, each on one topic: a group of 5 nouns and a group of 5 verbs
    (8 x 4 = 32 topics, disjoint vocabularies), used in every sentence. A random sentence of
    another document shares the topic with probability 1/32, so next-sentence prediction can
    reach ~98%, and a masked noun or verb is one of the topic's five."""
    def vocabulary(rng):
        topic = rng.randrange(NOUN_TOPICS), rng.randrange(VERB_TOPICS)
        return lambda: _topical_sentence(rng, topic)
    return _documents(n, seed, min_sentences, max_sentences, vocabulary)


def _topical_sentence(rng: random.Random, topic: tuple[int, int]) -> str:
    """An English sentence on topic (noun group, verb group)."""
    (t, v), noun_size, verb_size = topic, len(NOUNS) // NOUN_TOPICS, len(VERBS) // VERB_TOPICS
    return _sentence(rng, NOUNS[t * noun_size:(t + 1) * noun_size], VERBS[v * verb_size:(v + 1) * verb_size])[0]


def topic_pairs(n: int, seed: int = 0) -> list[tuple[str, str, int]]:
    """`n` (sentence1, sentence2, label) of `topical_documents`' sentences: label 1 (every even
    index, so the classes are balanced) when both are on one topic, 0 when on two different
    topics (which may share the noun or the verb group)."""
    rng = random.Random(seed)
    topics = [(t, v) for t in range(NOUN_TOPICS) for v in range(VERB_TOPICS)]
    pairs = []
    for i in range(n):
        first, same = rng.choice(topics), i % 2 == 0
        second = first if same else rng.choice([t for t in topics if t != first])
        pairs.append((_topical_sentence(rng, first), _topical_sentence(rng, second), int(same)))
    return pairs


def write_text(path: str | os.PathLike, lines: Iterable[str]) -> str:
    """Writes one line per item (UTF-8) and returns the path as a string."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            if "\n" in line:
                raise ValueError(f"line contains a newline: {line!r}")
            f.write(line + "\n")
    return path


def write_text_corpus(directory: str | os.PathLike, size_bytes: int, *, file_bytes: int = 1 << 20,
                      seed: int = 0, pool_sentences: int = 20_000) -> str:
    """Streams a Wikipedia-like plain-text corpus of about `size_bytes` (it stops at the first
    document past it) to `directory`: files of ~`file_bytes`, documents of 3-40 sentences on one
    of the 32 topics (`topical_documents`' vocabularies) separated by blank lines, one sentence a
    line. Sentences come from a pool of `pool_sentences` per-topic sentences, so writing runs at
    disk speed and memory stays at one file whatever the size. Read it with
    `tfm.data.documents.TextDocuments`; returns the directory."""
    if size_bytes < 1 or file_bytes < 1:
        raise ValueError(f"size_bytes and file_bytes must be positive, got {size_bytes}, {file_bytes}")
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    rng = random.Random(seed)
    topics = [(t, v) for t in range(NOUN_TOPICS) for v in range(VERB_TOPICS)]
    per_topic = max(1, pool_sentences // len(topics))
    pool = [[_topical_sentence(rng, topic) for _ in range(per_topic)] for topic in topics]
    draw = np.random.default_rng(seed)
    written, index = 0, 0
    while written < size_bytes:
        docs, length = [], 0
        while length < file_bytes and written + length < size_bytes:
            sentences = pool[draw.integers(len(pool))]
            doc = "\n".join(sentences[i] for i in draw.integers(per_topic, size=draw.integers(3, 41)))
            docs.append(doc)
            length += len(doc) + 2
        text = "\n\n".join(docs) + "\n"
        with open(os.path.join(directory, f"part-{index:05d}.txt"), "w", encoding="utf-8") as f:
            f.write(text)
        written, index = written + len(text.encode("utf-8")), index + 1
    return directory


_SPLITS = ("train", "validation", "test")


def _split_sizes(train: int, validation: int, test: int) -> dict[str, int]:
    sizes = dict(zip(_SPLITS, (train, validation, test)))
    if any(v < 1 for v in sizes.values()):
        raise ValueError(f"every split needs at least one example, got {sizes}")
    return sizes


class _LocalBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """A builder that generates its examples here, `sizes` per split (default DEFAULT_SIZES for
    train, validation, test) from `seed`: each subclass names its items (`_items(count, seed)`)
    and how one becomes an example (`_example(i, item, split)`). It says it generates where TFDS
    would announce a download (its `_log_download_*` hooks print "Downloading and preparing
    dataset")."""

    VERSION = tfds.core.Version("1.0.0")
    DEFAULT_SIZES: tuple[int, int, int]

    def __init__(self, *, sizes: dict[str, int] | None = None, seed: int = 0, **kwargs):
        self._sizes, self._seed = sizes or _split_sizes(*self.DEFAULT_SIZES), seed
        super().__init__(**kwargs)

    def _split_generators(self, dl_manager):
        del dl_manager
        return {s: self._generate_examples(s) for s in self._sizes}

    def _generate_examples(self, split):
        seed = self._seed * len(_SPLITS) + _SPLITS.index(split)
        for i, item in enumerate(self._items(self._sizes[split], seed)):
            yield i, self._example(i, item, split)

    def _log_download_bytes(self):
        sizes = ", ".join(f"{split} {n}" for split, n in self._sizes.items())
        print(f"Generating {self.name} locally ({sizes} examples; nothing is downloaded) "
              f"in {self.data_dir}...", flush=True)

    def _log_download_done(self):
        print(f"Generated {self.name} in {self.data_dir}; later runs reuse it.", flush=True)


class TfmSyntheticTranslate(_LocalBuilder):
    """TFDS builder of `translation_pairs`; features match `wmt14_translate/de-en`."""

    DEFAULT_SIZES = (2000, 200, 200)

    def _info(self):
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {"en": tfds.features.Text(), "de": tfds.features.Text()}),
            supervised_keys=("en", "de"))

    def _items(self, count, seed):
        return iter_translation_pairs(count, seed)

    def _example(self, i, pair, split):
        return {"en": pair[0], "de": pair[1]}


class TfmSyntheticDocs(_LocalBuilder):
    """TFDS builder of `documents`; features match `wikipedia` (one sentence a line)."""

    DEFAULT_SIZES = (500, 50, 50)

    def _info(self):
        return self.dataset_info_from_configs(features=tfds.features.FeaturesDict(
            {"title": tfds.features.Text(), "text": tfds.features.Text()}))

    def _items(self, count, seed):
        return documents(count, seed)

    def _example(self, i, doc, split):
        return {"title": f"{split} document {i}", "text": "\n".join(doc)}


class TfmSyntheticTopics(TfmSyntheticDocs):
    """TFDS builder of `topical_documents` (BERT pretraining); features match `wikipedia`."""

    def _items(self, count, seed):
        return topical_documents(count, seed)


class TfmSyntheticTopicPairs(_LocalBuilder):
    """TFDS builder of `topic_pairs` (BERT fine-tuning); features match `glue/rte`."""

    DEFAULT_SIZES = (1000, 500, 500)

    def _info(self):
        return self.dataset_info_from_configs(features=tfds.features.FeaturesDict({
            "sentence1": tfds.features.Text(), "sentence2": tfds.features.Text(),
            "label": tfds.features.ClassLabel(names=["different_topics", "same_topic"]),
            "idx": tfds.features.Scalar(np.int32)}))

    def _items(self, count, seed):
        return topic_pairs(count, seed)

    def _example(self, i, pair, split):
        a, b, label = pair
        return {"sentence1": a, "sentence2": b, "label": label, "idx": i}


def _prepare(cls, data_dir, sizes, seed) -> str:
    builder = cls(sizes=sizes, seed=seed, data_dir=os.fspath(data_dir),
                  file_format="array_record")
    builder.download_and_prepare()
    found = {s: builder.info.splits[s].num_examples for s in sizes}
    if found != sizes:
        raise ValueError(f"{builder.data_dir} already holds {found}, not {sizes}: "
                         "remove it or use another data_dir")
    return os.fspath(data_dir)


def prepare_translation(data_dir: str | os.PathLike, train: int = 2000, validation: int = 200,
                        test: int = 200, seed: int = 0) -> str:
    """Writes `tfm_synthetic_translate` (array_record) under `data_dir`; returns data_dir.

    Read it with `tfm.data.sources.load("synthetic_translate", split, data_dir=data_dir)`.
    Re-running with the same sizes reuses the files already there.
    """
    return _prepare(TfmSyntheticTranslate, data_dir, _split_sizes(train, validation, test), seed)


def prepare_documents(data_dir: str | os.PathLike, train: int = 500, validation: int = 50,
                      test: int = 50, seed: int = 0) -> str:
    """Writes `tfm_synthetic_docs` (array_record, one document an example) under `data_dir`."""
    return _prepare(TfmSyntheticDocs, data_dir, _split_sizes(train, validation, test), seed)


def prepare_topical_documents(data_dir: str | os.PathLike, train: int = 3000, validation: int = 100,
                              test: int = 100, seed: int = 0) -> str:
    """Writes `tfm_synthetic_topics` (array_record, one document an example) under `data_dir`."""
    return _prepare(TfmSyntheticTopics, data_dir, _split_sizes(train, validation, test), seed)


def prepare_topic_pairs(data_dir: str | os.PathLike, train: int = 1000, validation: int = 500,
                        test: int = 500, seed: int = 0) -> str:
    """Writes `tfm_synthetic_topic_pairs` (array_record, one sentence pair an example) under `data_dir`."""
    return _prepare(TfmSyntheticTopicPairs, data_dir, _split_sizes(train, validation, test), seed)
