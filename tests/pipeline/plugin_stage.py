"""A plug-in stage, as a user would write one: one file, its own parameters, no other change.
It flags captions with fewer than ``min_words`` words (reason ``wordcount.too_short``), and tells
the preflight and the guards what a built-in stage tells them: a check before the run, the share
of rows it expects to flag, and the setting behind its reason."""
from dataclasses import dataclass

import pyarrow as pa

from vlcurate.foundation.params import Params, positive
from vlcurate.schemas import F, tables
from vlcurate.stages.base import Finding, MapStage, Resources

N_WORDS = pa.field("n_words", pa.int32())
TOO_SHORT = "wordcount.too_short"


@dataclass(frozen=True)
class WordCountParams(Params):
    min_words: int = positive(3)
    resources: Resources = Resources()


class WordCountStage(MapStage):
    name = "wordcount"
    Params = WordCountParams
    inputs = {"ingest": (F.CAPTION,)}
    output = tables.stage_table(N_WORDS)
    expected_reject = 0.25          # warn above a quarter of the rows flagged
    knobs = {TOO_SHORT: "wordcount.min_words (the fewest words a caption may have)"}

    @classmethod
    def preflight(cls, config, stages):
        n = config.wordcount.min_words
        return [Finding(n <= 20, f"wordcount.min_words: {n}" if n <= 20 else
                        f"wordcount.min_words = {n} flags almost every caption: set it to 20 "
                        "or less")]

    def __call__(self, batch: pa.Table) -> pa.Table:
        words = [len(c.split()) for c in batch.column(F.CAPTION.name).to_pylist()]
        short = [w < self.config.wordcount.min_words for w in words]
        return pa.table({F.SAMPLE_ID.name: batch.column(F.SAMPLE_ID.name),
                         N_WORDS.name: pa.array(words, pa.int32()),
                         F.REASONS.name: [[TOO_SHORT] if s else [] for s in short],
                         F.REASON_DETAIL.name: [f"{w} words" if s else None
                                                for w, s in zip(words, short)]}, schema=self.output)
