"""BLEU for the translation experiment: the paper's tokenized BLEU and sacreBLEU, side by side.

Vaswani et al. (2017) report BLEU as tensor2tensor's `get_ende_bleu.sh` computes it, and that
number is not sacreBLEU's:

1. `tokenizer.perl -l de` (Moses) on hypotheses and references, with its defaults: XML
   escaping on (`"` -> `&quot;`, `&` -> `&amp;`, ...; the script does not pass -no-escape) and
   no aggressive hyphen splitting (no -a). Here: sacremoses' port, `MosesTokenizer("de")`.
2. Compound splitting: `perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'`, so every `A-B`
   becomes `A ##AT##-##AT## B`. Perl reads bytes there, so `\\S` is "not ASCII whitespace";
   matches do not overlap, so a one-character middle part stays joined: `1-2-3` ->
   `1 ##AT##-##AT## 2-3`.
3. `multi-bleu.perl`: case-sensitive corpus BLEU-4 on whitespace tokens, no smoothing (a
   zero n-gram precision gives 0), brevity penalty exp(1 - r/c) when c < r. Here: sacreBLEU's
   BLEU with `tokenize="none"` and `smooth_method="none"`, which counts the same.

This is named `bleu_moses_compound_split` everywhere. sacreBLEU (13a tokenization on detokenized
text) is reported beside it with its signature, and the test set is named exactly: TFDS
`wmt14_translate/de-en` test is newstest2014 with all 3003 lines (`sacrebleu -t wmt14/full`),
not sacreBLEU's 2737-line `wmt14` default.
"""
from __future__ import annotations

import functools
import re
from typing import Sequence

from sacrebleu.metrics import BLEU

PAPER_BLEU = "bleu_moses_compound_split"
PAPER_BLEU_DESCRIPTION = "tokenized BLEU as in Vaswani et al. (t2t get_ende_bleu.sh)"
SACREBLEU = "sacrebleu"
SACREBLEU_SIGNATURE = "sacrebleu_signature"

# (TFDS name, split) -> (WMT name, lines in the full set)
TEST_SETS = {
    ("wmt14_translate/de-en", "test"): ("newstest2014", 3003),
    ("wmt14_translate/de-en", "validation"): ("newstest2013", 3000),
}

# A hyphen between two non-whitespace characters; re.ASCII matches Perl's byte semantics.
_COMPOUND = re.compile(r"(\S)-(\S)", re.ASCII)


@functools.lru_cache(maxsize=None)
def _moses(lang: str):
    from sacremoses import MosesTokenizer  # 0.4 s of regexes: loaded when a score is first computed
    return MosesTokenizer(lang=lang)


def moses_tokenize(line: str, lang: str = "de") -> str:
    """`tokenizer.perl -l de` with its default flags: escaping on, no aggressive dash splits."""
    return _moses(lang).tokenize(line, aggressive_dash_splits=False, escape=True, return_str=True)


def split_compounds(tokenized: str) -> str:
    """Every `A-B` (A, B non-whitespace) -> `A ##AT##-##AT## B`, left to right, not overlapping."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", tokenized)


def paper_tokenize(line: str, lang: str = "de") -> str:
    """The text that get_ende_bleu.sh scores: Moses tokenization, then compound splitting."""
    return split_compounds(moses_tokenize(line, lang))


def _check_lengths(hypotheses: Sequence[str], references: Sequence[str]) -> None:
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")


def paper_bleu(hypotheses: Sequence[str], references: Sequence[str], lang: str = "de") -> float:
    """bleu_moses_compound_split (0-100) of detokenized hypotheses against one reference each."""
    _check_lengths(hypotheses, references)
    hyps = [paper_tokenize(h, lang) for h in hypotheses]
    refs = [paper_tokenize(r, lang) for r in references]
    metric = BLEU(tokenize="none", smooth_method="none", force=True)
    return metric.corpus_score(hyps, [refs]).score


def sacrebleu_with_signature(hypotheses: Sequence[str], references: Sequence[str]) -> tuple[float, str]:
    """sacreBLEU with its defaults (13a, mixed case, exp smoothing) and its signature string."""
    _check_lengths(hypotheses, references)
    metric = BLEU()
    score = metric.corpus_score(list(hypotheses), [list(references)]).score
    return score, str(metric.get_signature())


def scores(hypotheses: Sequence[str], references: Sequence[str], lang: str = "de") -> dict:
    """Both BLEUs and the sacreBLEU signature, keyed by PAPER_BLEU, SACREBLEU, SACREBLEU_SIGNATURE."""
    sacre, signature = sacrebleu_with_signature(hypotheses, references)
    return {PAPER_BLEU: paper_bleu(hypotheses, references, lang), SACREBLEU: sacre,
            SACREBLEU_SIGNATURE: signature}


def describe_test_set(dataset: str, split: str, lines: int) -> str:
    """Names what was scored, e.g. 'newstest2014 (TFDS wmt14_translate/de-en test, all 3003 lines)'.

    dataset is the full TFDS name (`tfm.data.sources.resolve` gives it); lines is how many
    sentences were scored, flagged when it is not the whole set.
    """
    if (dataset, split) not in TEST_SETS:
        return f"TFDS {dataset} {split}, {lines} lines"
    wmt_name, full = TEST_SETS[dataset, split]
    extent = f"all {full} lines" if lines == full else f"{lines} of {full} lines"
    return f"{wmt_name} (TFDS {dataset} {split}, {extent})"


def report(result: dict, test_set: str) -> str:
    """One line: the test set, both BLEUs under their exact names, and the sacreBLEU signature."""
    return (f"{test_set}: {PAPER_BLEU} {result[PAPER_BLEU]:.2f} [{PAPER_BLEU_DESCRIPTION}] | "
            f"sacreBLEU {result[SACREBLEU]:.2f} [{result[SACREBLEU_SIGNATURE]}]")
