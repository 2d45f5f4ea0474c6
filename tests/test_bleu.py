"""The paper's BLEU (Moses -l de, compound split, multi-bleu) and sacreBLEU with its signature.

Expected tokenizations are written by hand from tokenizer.perl's rules (defaults: escaping on,
no -a) and get_ende_bleu.sh's `s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g`; expected BLEU values are
counted here, independently of sacreBLEU.
"""
import collections
import math
import re

import pytest

from experiments.translation import bleu

AT = "##AT##-##AT##"

TOKENIZED = [
    # hyphenated compounds and a year range: the tokenizer keeps them, the split takes them apart
    ("Das Rhein-Main-Gebiet wuchs von 1990-1995 um 3,5 Prozent.",
     f"Das Rhein {AT} Main {AT} Gebiet wuchs von 1990 {AT} 1995 um 3,5 Prozent ."),
    # times and fractions are split at ':' and '/'; a decimal comma stays inside the number
    ("Der Zug fährt um 10:30 Uhr, 3/4 der Plätze sind frei!",
     "Der Zug fährt um 10 : 30 Uhr , 3 / 4 der Plätze sind frei !"),
    # German quotes and the ellipsis are separate tokens
    ("„Wir schaffen das“, sagte sie…", "„ Wir schaffen das “ , sagte sie …"),
    # XML escaping (tokenizer.perl's default), apostrophes split outside en/fr/it
    ('Er sagte "ja" & ging\'s an.', "Er sagte &quot; ja &quot; &amp; ging &apos; s an ."),
    # German abbreviations and ordinals keep their period (nonbreaking prefixes for de)
    ("Er kam z.B. am 3. Mai 2014.", "Er kam z.B. am 3. Mai 2014 ."),
    # non-ASCII letters next to the hyphen; a spaced dash is no compound
    ("Öl-Förderung - E-Mail-Adresse", f"Öl {AT} Förderung - E {AT} Mail {AT} Adresse"),
    # the Perl substitution does not overlap: a one-character middle part stays joined
    ("Es steht 1-2-3.", f"Es steht 1 {AT} 2-3 ."),
]


@pytest.mark.parametrize("raw,expected", TOKENIZED)
def test_paper_tokenization_matches_hand_written(raw, expected):
    assert bleu.paper_tokenize(raw) == expected


def test_compound_split_alone():
    assert bleu.split_compounds("rich-text format") == f"rich {AT} text format"
    assert bleu.split_compounds("a - b -x y-") == "a - b -x y-"


def _ngrams(tokens, n):
    return collections.Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def _multi_bleu(hyps, refs):
    """multi-bleu.perl on whitespace tokens: clipped corpus precisions, no smoothing, BP."""
    hyps, refs = [h.split() for h in hyps], [r.split() for r in refs]
    log_precision = 0.0
    for n in range(1, 5):
        matched = sum(sum((_ngrams(h, n) & _ngrams(r, n)).values()) for h, r in zip(hyps, refs))
        total = sum(max(len(h) - n + 1, 0) for h in hyps)
        if matched == 0:
            return 0.0
        log_precision += math.log(matched / total) / 4
    c, r = sum(map(len, hyps)), sum(map(len, refs))
    brevity = math.exp(1 - r / c) if c < r else 1.0
    return 100 * brevity * math.exp(log_precision)


def test_paper_bleu_by_hand():
    # tokens: Das Rhein AT Main AT Gebiet ist klein|groß .  (9 each, one substitution)
    hyp, ref = "Das Rhein-Main-Gebiet ist klein.", "Das Rhein-Main-Gebiet ist groß."
    expected = 100 * (8 / 9 * 6 / 8 * 5 / 7 * 4 / 6) ** 0.25
    assert bleu.paper_bleu([hyp], [ref]) == pytest.approx(expected, abs=1e-9)


def test_paper_bleu_brevity_penalty_by_hand():
    # hyp "Wir fahren um 10 : 30 Uhr ." (8 tokens) vs ref "... um 10 : 30 Uhr ab ." (9 tokens)
    hyp, ref = "Wir fahren um 10:30 Uhr.", "Wir fahren um 10:30 Uhr ab."
    precisions = [8 / 8, 6 / 7, 5 / 6, 4 / 5]  # only the n-grams that contain "Uhr ." miss
    expected = 100 * math.exp(1 - 9 / 8) * math.prod(precisions) ** 0.25
    assert bleu.paper_bleu([hyp], [ref]) == pytest.approx(expected, abs=1e-9)


def test_paper_bleu_is_unsmoothed():
    # two tokens, so no 3-grams: multi-bleu.perl gives 0, not a smoothed value
    assert bleu.paper_bleu(["Ja."], ["Ja."]) == 0.0


def test_paper_bleu_matches_independent_count_on_a_corpus():
    hyps = [raw for raw, _ in TOKENIZED]
    refs = ["Das Rhein-Main-Gebiet wuchs 1990-1995 um 3,5 %.",
            "Der Zug fährt um 10:30 Uhr ab, 3/4 der Plätze sind frei!",
            "„Wir schaffen das“, sagte sie.",
            'Er sagte "ja" und ging.',
            "Er kam z.B. am 3. Mai 2014 an.",
            "Öl-Förderung und E-Mail-Adresse",
            "Es steht 1-2-3."]
    expected = _multi_bleu([t for _, t in TOKENIZED], [bleu.paper_tokenize(r) for r in refs])
    assert 0 < expected < 100
    assert bleu.paper_bleu(hyps, refs) == pytest.approx(expected, abs=1e-9)


def test_identical_text_scores_100_on_both():
    lines = [raw for raw, _ in TOKENIZED]
    result = bleu.scores(lines, lines)
    assert result[bleu.PAPER_BLEU] == pytest.approx(100.0)
    assert result[bleu.SACREBLEU] == pytest.approx(100.0)


def test_sacrebleu_signature_format():
    _, signature = bleu.sacrebleu_with_signature(["Das ist gut."], ["Das ist gut."])
    assert re.fullmatch(r"nrefs:1\|case:mixed\|eff:no\|tok:13a\|smooth:exp\|version:2\.\d+\.\d+", signature)


def test_scores_keys_and_mismatch():
    assert set(bleu.scores(["a b c d"], ["a b c d"])) == {
        "bleu_moses_compound_split", "sacrebleu", "sacrebleu_signature"}
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        bleu.scores(["a", "b"], ["a"])


def test_test_set_names():
    assert (bleu.describe_test_set("wmt14_translate/de-en", "test", 3003)
            == "newstest2014 (TFDS wmt14_translate/de-en test, all 3003 lines)")
    assert (bleu.describe_test_set("wmt14_translate/de-en", "validation", 300)
            == "newstest2013 (TFDS wmt14_translate/de-en validation, 300 of 3000 lines)")
    assert (bleu.describe_test_set("tfm_synthetic_translate", "test", 64)
            == "TFDS tfm_synthetic_translate test, 64 lines")


def test_report_line():
    result = {bleu.PAPER_BLEU: 27.3, bleu.SACREBLEU: 26.41,
              bleu.SACREBLEU_SIGNATURE: "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0"}
    line = bleu.report(result, "newstest2014 (TFDS wmt14_translate/de-en test, all 3003 lines)")
    assert line == ("newstest2014 (TFDS wmt14_translate/de-en test, all 3003 lines): "
                    "bleu_moses_compound_split 27.30 [tokenized BLEU as in Vaswani et al. "
                    "(t2t get_ende_bleu.sh)] | sacreBLEU 26.41 "
                    "[nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0]")
