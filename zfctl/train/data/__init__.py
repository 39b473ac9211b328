"""Training data: records in, cached token sequences and a resumable batch order out.

- :mod:`.prepare`: ``prepare_data`` runs the whole pipeline once, before any process group forms,
  and returns the train/eval sequences plus the collate function; ``format_debug_samples``.
- :mod:`.source`: where records come from (shipped samples, local files, hub datasets).
- :mod:`.templates`: prompt templates, tokenising, truncation and packing; ``IGNORE_INDEX``.
- :mod:`.cache`: the tokenised-data cache (memory-mapped Arrow, keyed by everything that matters).
- :mod:`.sampler`: the deterministic, resumable order of micro-batches.

Nothing is imported here: the loop needs only the sampler, and importing ``datasets`` costs a second.
"""
