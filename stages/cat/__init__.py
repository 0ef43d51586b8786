"""DiHT's CAT filter (issue 5): the ``cat`` stage (semantic parse: complexity and actions) and the
``textspot`` stage (OCR text spotting matched against the caption)."""
