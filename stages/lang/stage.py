"""Language ID before the CAT parse (stage ``lang``, reason ``lang.other``).

DiHT applied its (English) CAT parse to English data. On multilingual alt text the parse rejects
non-English captions for the wrong reason ("no object"), and text spotting then OCRs rows that a
language filter would have dropped for a fraction of the cost. This stage scores each caption with
langid.py (Lui & Baldwin 2012; its model ships inside the package, so it runs offline) and flags a
caption whose probability of being in one of ``lang.keep`` is below ``lang.min_prob``.

Choice: the probability of the kept languages, not "the top language is kept". With
``min_prob: 0.5`` the two agree for one kept language; with several kept languages (``[en, de]``)
summing their probabilities keeps a caption that is split between them.
"""
from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from vlcurate.schemas import F, conform
from vlcurate.schemas import lang as S
from vlcurate.schemas import reasons as R
from vlcurate.pipeline.params import Params, nonempty, unit
from vlcurate.stages.base import MapStage, Resources, reasons_array


@functools.lru_cache(maxsize=1)
def identifier() -> Any:
    """langid.py's bundled model, loaded once per process (about 0.3 s)."""
    from langid.langid import LanguageIdentifier, model
    return LanguageIdentifier.from_modelstring(model, norm_probs=True)


def _log_probs(ident: Any, text: str) -> np.ndarray:
    """langid's naive-Bayes log-probabilities of ``text`` per language, as its ``nb_classprobs``
    computes them, from the sparse feature counts (langid builds a dense 7,480-wide vector per
    caption and takes a dense product: 2x slower for captions that hit a few dozen features)."""
    state, seen = 0, Counter()
    for byte in text.encode("utf-8", "surrogatepass"):
        state = ident.tk_nextmove[(state << 8) + byte]
        seen[state] += 1
    feats = Counter()
    for st, n in seen.items():
        for index in ident.tk_output.get(st, ()):
            feats[index] += n
    if not feats:
        return ident.nb_pc.astype(np.float64)
    idx = np.fromiter(feats.keys(), np.int64, len(feats))
    cnt = np.fromiter(feats.values(), np.float64, len(feats))
    return cnt @ ident.nb_ptc[idx] + ident.nb_pc


def classify(caption: str, keep: tuple[str, ...]) -> tuple[str, float]:
    """(most likely language, probability that the caption is in one of ``keep``)."""
    ident = identifier()
    logp = _log_probs(ident, caption)
    probs = np.exp(logp - logp.max())
    probs /= probs.sum()
    langs = ident.nb_classes
    return str(langs[int(np.argmax(probs))]), float(sum(probs[i] for i, lang in enumerate(langs)
                                                        if lang in keep))


@dataclass(frozen=True)
class LangParams(Params):
    """Language ID (stage ``lang``): flag captions not in the kept languages, before the CAT parse."""
    keep: tuple[str, ...] = nonempty(("en",), " (name at least one language, ISO 639-1, e.g. "
                                     "[en]; to run without the filter, leave `lang` out of "
                                     "run.stages)")  # DiHT's CAT parse is English
    min_prob: float = unit(0.5)           # flag when P(caption in one of keep) is below this
    resources: Resources = Resources()


class LangStage(MapStage):
    name = "lang"
    version = "1"
    Params = LangParams
    inputs = {"ingest": (F.CAPTION,)}
    output = S.LANG_TABLE
    resources = Resources(num_cpus=1, batch_size=0)

    def __call__(self, batch: pa.Table) -> pa.Table:
        c = self.config.lang
        keep = tuple(c.keep)
        scored = [classify(cap or "", keep) for cap in batch.column(F.CAPTION.name).to_pylist()]
        top = [lang for lang, _ in scored]
        prob = np.array([p for _, p in scored], np.float32)
        flag = np.array([lang not in keep for lang in top], bool) & (prob < c.min_prob)
        return conform(pa.table({
            F.SAMPLE_ID.name: batch.column(F.SAMPLE_ID.name),
            S.LANG.name: pa.array(top, pa.string()),
            S.LANG_PROB.name: pa.array(prob, pa.float32()),
            F.REASONS.name: reasons_array([[R.LANG_OTHER] if f else [] for f in flag]),
            F.REASON_DETAIL.name: pa.array(
                [f"{lang} (P(keep)={p:.2f} < {c.min_prob})" if f else None
                 for lang, p, f in zip(top, prob, flag)], pa.string())}), self.output)
