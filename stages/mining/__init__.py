"""Hard-pair mining (HELIP HPM / FastHPM, noise pairs) and positives (FFF Eq. 1, duplicates).

Algorithms live in ``hpm.py`` and ``fff.py`` (no I/O); ``store.py`` gathers the embeddings of the
rows still kept into files shared by a stage's actors; the stages are ``hpm_stage.py`` (``hpm``) and
``positives_stage.py`` (``positives``).
"""
