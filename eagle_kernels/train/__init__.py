"""Draft-head training for EAGLE-1 and EAGLE-3 heads: offline corpora (:mod:`.corpus`), a
memory-mapped feature cache of the target (:mod:`.features`), and the training loop with
EAGLE-3's training-time test (:mod:`.trainer`)."""
