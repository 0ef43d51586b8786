"""DiHT's CAT filter: the ``cat`` stage (semantic parse: complexity and actions) and the
``textspot`` stage (OCR text spotting matched against the caption): ``cat_stage.py`` and
``textspot_stage.py``; ``parser.py`` and ``textspot.py`` hold the parse and the OCR backends."""
